"""benchmarks/bench_loop_race.py at toy size, this library only (peers run only in the benchmark).

The fast tests build the race's checkpoint and check what the benchmark's
equal-work claim rests on (disallowed tokens can never be sampled: their logit
is far below every allowed one, in this library's own forward), the spec's
token shape, and the table's arithmetic (phases, equal-work check, machine
bound, growth PNG). The full-tier test runs one step of this library's whole
loop (endpoint, sampler, trainer) through the benchmark's runner.

Sized for the suite's time (about 20 s of CPU for the file): the smallest
checkpoint (`toy`: one layer, hidden 32, the tiny tokenizer's 512 tokens), one
task of two attempts (the smallest group with an advantage), two turns of two
tokens (the tool message between them is the loop's point), one step, and the
sampler's ahead-of-time warm-up compiles off (each shape compiles in its first
use instead; the benchmark's growth points run the same way).
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from benchmarks import bench_loop_race as race
from benchmarks.peers import task as race_task


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("race") / "ckpt")
    info = race.write_checkpoint(path, "toy", vocab=508)
    spec = race.make_spec(path, tasks_per_step=1, attempts=2, turns=2, max_tokens=2,
                          warmup=0, steps=1)
    return info, spec


def test_checkpoint_never_samples_disallowed_tokens(toy):
    import jax.numpy as jnp
    from transformers import AutoTokenizer

    from ac2_jax.recipes import load_model

    info, spec = toy
    model, _ = load_model(info["path"], os.path.dirname(info["path"]))
    tok = AutoTokenizer.from_pretrained(info["path"])
    allowed = np.zeros(info["vocab"], bool)
    allowed[race.allowed_tokens(tok)] = True
    assert allowed.sum() == info["allowed"] and not allowed[tok.convert_tokens_to_ids("<|im_end|>")]
    # A prompt ending in a disallowed token ("\n" of the generation prompt, <|im_end|>).
    ids = tok.apply_chat_template(race_task.first_messages(spec, spec["tasks"][0]),
                                  add_generation_prompt=True, tokenize=True, return_dict=False)
    ids = np.asarray([ids + [tok.convert_tokens_to_ids("<|im_end|>")]], np.int32)
    n = ids.shape[1]
    logits = np.asarray(model(jnp.asarray(ids), jnp.arange(n)[None], jnp.ones((1, n), jnp.int32)))
    # At every position: the best disallowed token is > 50 nats below the worst allowed one.
    gap = logits[0][:, allowed].min(-1) - logits[0][:, ~allowed].max(-1)
    assert gap.min() > 50.0, gap.min()


def test_spec_and_table_arithmetic(toy, tmp_path):
    info, spec = toy
    assert spec["seq_len"] % 64 == 0
    turns, m = spec["turns"], spec["max_tokens"]
    assert spec["seq_len"] >= spec["prompt_tokens"] + turns * m + spec["suffix_tokens"]
    assert race_task.reward("so 1798.0", 1798) == pytest.approx(1.0 + 0.009)
    assert race_task.reward("no", 1798) == pytest.approx(0.002)
    step = {"rollout_s": 1.0, "scoring_s": 0.0, "update_s": 2.0, "handoff_s": 0.5,
            "step_s": 4.0, "sampled_tokens": 16, "trained_tokens": 16}
    result = {"steps": [dict(step, step_s=9.0), step, dict(step, step_s=2.0)],
              "peak_rss_mb": 100.0, "process_s": 20.0}
    s = race.summarize(result, warmup=1)
    assert s["step_s"] == 3.0 and s["warmup_s"] == 9.0 and s["sampled_per_s"] == 16 / 3.0
    assert s["startup_s"] == pytest.approx(20.0 - 15.0)
    other = dict(s, sampled_tokens=16.3, trained_tokens=16)
    assert race.equal_work(other, s, 0.02)["equal_work"]
    assert not race.equal_work(dict(other, sampled_tokens=17), s, 0.02)["equal_work"]
    ceil = {"bandwidth_gb_s": 10.0, "gemm_gflops": 100.0}
    b = race.step_bound("toy", info["vocab"], spec, ceil)
    p = race.matmul_params("toy", info["vocab"])
    assert b["bound_decode_s"] == pytest.approx(turns * m * 4 * p / 10e9)
    assert b["bound_s"] == pytest.approx(b["bound_decode_s"] + b["bound_prefill_s"]
                                         + b["bound_update_s"])
    points = [{"axis": a, "value": v, "step_s": 0.1 * v} for a in ("attempts", "turns", "context")
              for v in (1, 2, 4)]
    png = race.plot_growth(points, [{"system": "trl", "axis": "turns", "value": 2,
                                     "step_s": 1.0}], str(tmp_path / "g.png"))
    assert png is not None and os.path.getsize(png) > 1000


@pytest.mark.full
def test_one_step_of_the_loop(toy, tmp_path):
    """This library's whole loop, one step, through the benchmark's runner process."""
    _, spec = toy
    out = race.run_system("ac2", dict(spec, sampler_warmup=False), str(tmp_path), None)
    assert "error" not in out, out.get("error")
    (step,) = out["steps"]
    n = spec["tasks_per_step"] * spec["attempts"]
    # Every turn sampled max_tokens exactly (the checkpoint's equal-length forcing).
    assert step["sampled_tokens"] == n * spec["turns"] * spec["max_tokens"]
    assert step["trained_tokens"] == step["sampled_tokens"]
    assert step["step_s"] >= step["rollout_s"] + step["update_s"] > 0
    assert out["peak_rss_mb"] > 0
    json.dumps(out)
