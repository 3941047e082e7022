"""experiments/pinapple/judge.py: the LLM judge's data, and the judge served through the
endpoint and asked through the real `openai` client."""

import json
import os

import pytest

from ac2_jax.text.tiny_tokenizer import build_tiny_tokenizer
from experiments.pinapple import data
from experiments.pinapple import judge as pj
from experiments.pinapple.common import corpus_items, word_pool
from experiments.pinapple.config import get_config


def _setup(tmp_path):
    cfg = get_config("faithful")
    cfg.base_data.update(repeat_items=30, nonce_words=30, math_limit=3)
    items = data.all_items(cfg.base_data.math_limit)
    corpus, pool = corpus_items(cfg, items), word_pool(cfg, items)
    tok = build_tiny_tokenizer(str(tmp_path / "policy_tok"), vocab_size=500,
                               extra_corpus=[f"{i.question} {i.answer}" for i in corpus])
    return cfg, items, corpus, pool, tok


def test_judge_examples_are_the_oracles_verdicts_on_other_hints(tmp_path):
    """No example hints at the target word; candidates are response positions, the
    oracle's picks first on relevant examples; the reply is the oracle's JSON; the request
    is `LLMJudge`'s; the held-out test is every target item under every held-out hint."""
    _, items, corpus, pool, tok = _setup(tmp_path)
    examples = pj.judge_examples(tok, corpus, pool, 300, seed=0)
    assert len(examples) == 300 and examples == pj.judge_examples(tok, corpus, pool, 300, 0)
    assert not any(data.TARGET_WORD in e.hint for e in examples)
    picked = 0
    for e in examples:
        assert 1 <= len(e.candidates) <= 4
        assert all(0 <= c < len(e.response_tokens) for c in e.candidates)
        want = pj.oracle().select(e)
        assert json.loads(pj.reply(e)) == {"relevant": want}
        assert list(e.candidates[:len(want)]) == want or not want
        picked += bool(want)
    # Both verdicts are taught (the oracle matches only hint words of >= 4 letters and
    # tokens of >= 3, so with this small tokenizer a minority of examples has a pick).
    assert 0.1 < picked / len(examples) < 0.9
    assert sum(e.prompt.count("Repeat:") == 0 for e in examples) > 100  # facts too
    msgs = pj.judge_messages(examples[0])
    assert [m["role"] for m in msgs] == ["system", "user"] and examples[0].hint in msgs[1]["content"]
    # A test set apart from the training examples (`exclude`), and a corpus too small to
    # give one is refused.
    seen = {pj.example_key(e) for e in examples}
    held = pj.judge_examples(tok, corpus, pool, 50, seed=1, exclude=seen)
    assert len(held) == 50 and not seen & {pj.example_key(e) for e in held}
    assert seen & {pj.example_key(e) for e in pj.judge_examples(tok, corpus, pool, 50, 1)}
    one = [i for i in corpus if i.kind != "repeat"][:1]
    with pytest.raises(ValueError, match="the corpus is too small"):
        pj.judge_examples(tok, one, pool[:2], 5, seed=1, exclude={
            pj.example_key(e) for e in pj.judge_examples(tok, one, pool[:2], 400, 0)})
    target = pj.target_examples(tok, items, seed=0)
    n_target = sum(i.kind == "target" for i in items)
    assert len(target) == n_target * len(data.HELDOUT_HINTS)
    assert {e.hint for e in target} == {h for h, _ in data.HELDOUT_HINTS.values()}
    assert all(pj.oracle().select(e) for e in target)  # the target word is a candidate


def test_a_judge_trained_served_and_asked_through_openai(tmp_path):
    """Train a toy judge (3 steps), serve it with `build_app` under a rollout, ask it
    through `openai.OpenAI` (`LLMJudge`): every example gets a request, each invalid
    reply is retried then skipped and counted, and the requests' traces are stored. A
    second training in the same workdir restores the finished judge."""
    cfg, _, corpus, pool, tok = _setup(tmp_path)
    cfg.judge_data.update(examples=40, vocab_size=500)
    cfg.judge_model.update(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                           num_kv_heads=2, head_dim=16, max_position_embeddings=512)
    cfg.judge_sft.update(steps=3, seq_len=384, checkpoint_every=0)
    cfg.judge_optimizer.warmup_steps = 1
    work, logs = str(tmp_path / "judge"), []
    judge = pj.train_judge(cfg, tok, corpus, pool, work, logs.append)
    assert judge.final_loss is not None and any("judge: 40 demos" in m for m in logs)
    assert judge.trained_on == {pj.example_key(e)
                                for e in pj.judge_examples(tok, corpus, pool, 40, cfg.seed)}
    tests = pj.judge_examples(tok, corpus, pool, 4, seed=1)
    with pj.served_judge(judge, work, max_tokens=8) as make:
        llm = make(2)
        assert llm.top_s == 2
        out = pj.agreement(llm, tests)
    s = out["stats"]
    assert out["examples"] == 4 and s["examples"] == 4 and s["cache_hits"] == 0
    assert s["requests"] == 4 + s["retries"]  # a first try per example, then the retries
    assert s["retries"] >= 2 * s["skipped"]  # a skip comes after max_retries=2 retries
    assert s["request_errors"] == 0  # the endpoint answered every request
    lines = open(os.path.join(work, "judge_traces.jsonl")).read().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["trace"]["task_id"] == "judge"
    again = pj.train_judge(cfg, tok, corpus, pool, work, logs.append)
    assert again.final_loss == judge.final_loss  # restored, with its recorded loss
    assert any("judge sft: restored the finished model" in m for m in logs)


def test_the_judge_command_trains_serves_and_reports(tmp_path):
    """`pinapple_judge.run` (the command's body) at toy size: judge_report.json holds the
    judge's agreement with the oracle on held-out other hints and on the target hints."""
    cfg = get_config("faithful")
    cfg.workdir = str(tmp_path / "run")
    cfg.tokenizer.vocab_size = 400
    cfg.base_data.update(repeat_items=20, nonce_words=20, math_limit=3)
    cfg.judge_data.update(examples=40, test_examples=4, vocab_size=500)
    cfg.judge_model.update(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                           num_kv_heads=2, head_dim=16, max_position_embeddings=512)
    cfg.judge_sft.update(steps=3, seq_len=384, checkpoint_every=0)
    cfg.judge_optimizer.warmup_steps = 1
    cfg.loop.judge_max_tokens = 8  # an untrained judge's replies are invalid at any length
    meta = pj.run(cfg, log=lambda *a: None)
    saved = json.load(open(tmp_path / "run" / "judge" / "judge_report.json"))
    assert saved["other_hints"]["examples"] == 4 and meta["wall_s"] > 0
    n_target = sum(i.kind == "target" for i in data.all_items(3))
    assert saved["target_hints"]["examples"] == n_target * len(data.HELDOUT_HINTS)
    assert saved["final_loss"] == meta["final_loss"] is not None
