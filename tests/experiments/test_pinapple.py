"""The pinapple experiment's pieces (experiments/pinapple/run.py): judges by name, the sweep's
settings, and the whole pipeline at toy size."""

import pytest

from ac2_jax.envs.judges import JudgeExample, NoisyJudge, RuleJudge
from experiments.pinapple import data
from experiments.pinapple.config import get_config
from experiments.pinapple.run import make_judge, sweep_settings, with_setting
from tests.support.pinapple_toy import toy_base_config


def _example():
    toks = ("Spell", " pin", "apple", " as", " pin", "apple", ".")
    return JudgeExample(prompt="p", response="".join(toks), response_tokens=toks,
                        hint=data.TARGET_HINT, candidates=tuple(range(len(toks))))


def test_make_judge_by_name_with_top_s_and_a_noisy_oracle():
    ex = _example()
    oracle = make_judge("keywords").select(ex)
    assert oracle and isinstance(make_judge("keywords"), RuleJudge)
    assert make_judge("keywords", top_s=1).select(ex) == oracle[:1]
    clean = make_judge("noisy:0")
    assert isinstance(clean, NoisyJudge) and clean.select(ex) == oracle
    flipped = make_judge("noisy:1")
    assert set(flipped.select(ex)) == set(ex.candidates) - set(oracle)
    # The flips are fixed by the seed; another seed flips other positions.
    picks = {s: make_judge("noisy:0.5", seed=s).select(ex) for s in range(6)}
    assert picks[0] == make_judge("noisy:0.5", seed=0).select(ex)
    assert len({tuple(p) for p in picks.values()}) > 1
    for bad in ("noisy:", "noisy:x", "noisy:1.5", "oracle"):
        with pytest.raises(ValueError, match="judge"):
            make_judge(bad)


def test_the_llm_judge_by_name_needs_the_served_judge():
    with pytest.raises(ValueError, match="judge 'llm' needs the served judge model"):
        make_judge("llm")
    made = make_judge("llm", top_s=3, llm=lambda top_s: ("served", top_s))
    assert made == ("served", 3)


@pytest.fixture(scope="module")
def toy_faithful_run(tmp_path_factory):
    """One toy faithful run (seed 0, every method), shared: the pipeline test asserts on
    it and the resume test continues a copy of its workdir."""
    from experiments.pinapple import run as pinapple

    tmp = tmp_path_factory.mktemp("faithful")
    cfg = _toy_faithful(tmp)
    return cfg, pinapple.run(cfg, log=lambda *a: None)


def test_pretrain_then_hint_following_then_one_step_per_method(toy_faithful_run):
    """Issue 39's toy pipeline, the faithful variant cut to toy size: base SFT on a corpus
    that never shows a held-out hint, the held-out hints' check, one distillation step per
    method, the report."""
    import os

    cfg, out = toy_faithful_run
    assert set(out["meta"]["hint_following"]) == {*data.HELDOUT_HINTS, "unchanged_elsewhere",
                                                  "spell_other_words"}
    assert [(r["method"], len(r["train"])) for r in out["runs"]] == [
        (m, 1) for m in cfg.methods]
    assert os.path.exists(os.path.join(cfg.workdir, "report", "index.html"))


def test_a_stopped_run_resumes_from_its_finished_runs_and_refuses_other_settings(
        toy_faithful_run, tmp_path):
    """A copy of the shared run's workdir (seed 0: sft, opsd, rmsd finished) is run again
    with another seed's sft added: the finished runs are read back, not run again (nor
    the base), only the new one runs; a changed setting is refused, nothing lost."""
    import json
    import shutil

    from experiments.pinapple import run as pinapple

    done, first = toy_faithful_run
    shutil.copytree(done.workdir, tmp_path / "run")
    cfg = _toy_faithful(tmp_path)
    path = tmp_path / "run" / "runs.jsonl"
    assert len(path.read_text().splitlines()) == 3
    cfg.methods = ("sft",)
    cfg.seeds = (0, 1)
    logged = []
    again = pinapple.run(cfg, log=logged.append)["runs"]
    assert any("resuming: 3 finished runs" in str(m) for m in logged)
    assert any("base sft: restored the finished model" in str(m) for m in logged)
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [(r["seed"], r["method"]) for r in lines] == [
        (0, "sft"), (0, "opsd"), (0, "rmsd"), (1, "sft")]
    assert json.loads(json.dumps(first["runs"][0], default=str)) == again[0] == lines[0]
    cfg.loop.steps = 2
    with pytest.raises(ValueError, match=r"line 1: a run under other settings \(\['loop'\]\)"):
        pinapple.run(cfg, log=lambda *a: None)
    assert len(path.read_text().splitlines()) == 4  # nothing lost


def _toy_faithful(tmp_path):
    cfg = toy_base_config()
    cfg.seeds = (0,)
    cfg.loop.update(steps=1, prompts_per_step=4, target_every=1, eval_every=1,
                    retain_every=16, answer_tokens=6)
    cfg.sampling.max_new_tokens = 6
    cfg.sampling.min_batch = 64  # one row bucket (max_batch): fewer sampler compiles
    cfg.workdir = str(tmp_path / "run")
    return cfg


def test_sweep_settings_are_every_combination_and_keep_unswept_values():
    cfg = get_config("quick")
    assert sweep_settings(cfg) == []
    cfg.sweep.top_t = (1, 4)
    cfg.sweep.judge = ("keywords", "noisy:0.3")
    got = sweep_settings(cfg)
    assert got == [{"top_t": t, "top_s": None, "judge": j, "kind": "reverse_kl"}
                   for j in ("keywords", "noisy:0.3") for t in (1, 4)]
    cfg.sweep.update(top_t=(), judge=(), kind=("reverse_kl", "forward_kl"))
    assert [g["kind"] for g in sweep_settings(cfg)] == ["reverse_kl", "forward_kl"]
    c = with_setting(cfg, sweep_settings(cfg)[1])
    assert c.distill.kind == "forward_kl" and cfg.distill.kind == "reverse_kl"
    cfg.sweep.kind = ()
    c = with_setting(cfg, {"top_t": 4, "top_s": 2, "judge": "noisy:0.3"})
    assert (c.distill.top_t, c.loop.judge_top_s, c.loop.judge) == (4, 2, "noisy:0.3")
    assert (cfg.distill.top_t, cfg.loop.judge) == (2, "keywords")  # the original unchanged
    cfg.sweep.judge = ("perfect",)
    with pytest.raises(ValueError, match="'perfect'"):
        sweep_settings(cfg)


def test_the_judges_target_test_is_spread_over_the_target_items():
    """loop.judge_target_examples: n of the target-hint examples, evenly spaced (0: all)."""
    from experiments.pinapple.judge import spread

    xs = list(range(84))
    assert spread(xs, 0) == xs and spread(xs, 84) == spread(xs, 100) == xs
    assert spread(xs, 4) == [0, 21, 42, 63]
    with pytest.raises(ValueError, match="judge_target_examples must be >= 0"):
        spread(xs, -1)


def test_faithful_pipeline_at_toy_size_with_a_sweep(tmp_path):
    """Base SFT on the faithful corpus -> the held-out hints' teacher check -> one
    distillation step per method -> RMSD sweep settings (T, S; a noisy judge, and the LLM
    judge: a 3-step judge model served through the endpoint), with
    the report's sweep table and plot (the toy faithful run's settings, `_toy_faithful`:
    its base SFT and sampler programs are the shared run's, read back from the run's
    compilation cache; reverse KL as pinapple/config.py:quick; answers cut to 6 tokens,
    as an untrained model writes to the limit; 9 sums, not 100)."""
    import json
    import os

    from experiments.pinapple import run as pinapple

    cfg = _toy_faithful(tmp_path)
    cfg.distill.kind = "reverse_kl"
    cfg.sweep.update(top_t=(1,), top_s=(1,), judge=("noisy:0.5", "llm"))
    cfg.judge_data.update(examples=40, test_examples=4, vocab_size=500)  # a 3-step judge
    cfg.judge_model.update(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                           num_kv_heads=2, head_dim=16, max_position_embeddings=512)
    cfg.judge_sft.update(steps=3, seq_len=384, checkpoint_every=0)
    cfg.judge_optimizer.warmup_steps = 1
    cfg.loop.judge_max_tokens = 8  # an untrained judge's replies are invalid at any length
    cfg.loop.judge_target_examples = 4  # of 84 (28 target items x 3 hints), 3 requests each
    cfg.data_seeds = (0, 1)  # two distill / held-out splits
    out = pinapple.run(cfg, log=lambda *a: None)
    following = out["meta"]["hint_following"]
    assert set(following) == {*data.HELDOUT_HINTS, "unchanged_elsewhere", "spell_other_words"}
    assert all(0.0 <= v <= 1.0 for v in following.values())
    main = [r for r in out["runs"] if r["setting"] is None]
    assert [(r["data_seed"], r["method"]) for r in main] == [
        (ds, m) for ds in (0, 1) for m in cfg.methods]
    splits = out["meta"]["splits"]
    assert splits["0"]["heldout"] != splits["1"]["heldout"]
    swept = [r for r in out["runs"] if r["setting"] is not None]
    assert [r["setting"] for r in swept] == [{"top_t": 1, "top_s": 1, "judge": j,
                                              "kind": "reverse_kl"}
                                             for j in ("noisy:0.5", "llm") for _ in (0, 1)]
    assert swept[0]["method"] == "rmsd" and swept[0]["judge_stats"]["examples"] >= 1
    # The LLM judge: asked over HTTP for every example, scored against the oracle.
    assert swept[2]["judge_stats"]["requests"] >= swept[2]["judge_stats"]["examples"] >= 1
    agree = out["meta"]["llm_judge"]
    assert agree["other_hints"]["examples"] == agree["target_hints"]["examples"] == 4
    assert all(len(r["train"]) == 1 for r in out["runs"])
    report = tmp_path / "run" / "report"
    rows = json.load(open(report / "sweep.json"))
    assert [(r["judge"], r["top_s"], r["top_t"]) for r in rows] == [("noisy:0.5", 1, 1),
                                                                     ("llm", 1, 1)]
    assert os.path.getsize(report / "sweep.png") > 1000
    page = (report / "index.html").read_text()
    assert "RMSD over T, S and the judge" in page and page.count('class="tokens heat"') == 3
    assert "llm judge vs the oracle" in page
    assert out["rows"][2]["target"]["n"] == 2  # a method's row: over seeds x data seeds
    assert "judge noisy:0.5, T=1, S=1, reverse_kl" in page and "data:image/png;base64," in page
