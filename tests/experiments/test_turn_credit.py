"""experiments/turn_credit/run.py at toy size: both arms run through the library's RL pipeline,
the per-turn arm's batches carry its turn rewards, the summary has its intervals."""

import json

import numpy as np


def test_the_pipeline_runs_both_arms(tmp_path):
    import jax
    from flax import nnx

    from ac2_jax.models import Decoder, DecoderConfig
    from ac2_jax.training import BatchConfig, OptimizerConfig, create_train_state
    from ac2_jax.training.rl import batch_segments
    from experiments.turn_credit.run import Setup, collect, main

    setup = Setup(problems=2, attempts=4, steps=2)
    model = Decoder(DecoderConfig.tiny(vocab_size=16, num_layers=1), rngs=nnx.Rngs(0))
    graphdef, state = create_train_state(model, OptimizerConfig(learning_rate=1e-3))
    traces = collect(graphdef, state, setup, 0, jax.random.PRNGKey(0), "turn")
    assert len(traces) == 8 and all(len(t.episodes[0].completions) == 2 for t in traces)
    segs, stats, _ = batch_segments(traces, 0, BatchConfig(seq_len=16, rows=4, credit="turn"))
    assert stats.turn_credit_traces == 8
    for s in segs:  # turn 2's four tokens never carry credit
        adv = np.asarray(s.features["advantages"])[np.asarray(s.loss_mask) > 0]
        assert np.all(adv[1:] == 0.0)
    out = main(["--seeds", "2", "--steps", "1", "--problems", "2", "--attempts", "4",
                "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "results.json").read_text())
    assert set(saved["curves"]) == {"final", "turn"} and len(saved["curves"]["turn"]) == 2
    assert len(saved["curves"]["turn"][0]) == 2  # before + 1 step
    row = out["summary"]["1"]["turn_minus_final"]
    assert row["n"] == 2 and row["low"] <= row["mean"] <= row["high"]
