"""SFT loop: memorizes a tiny data set, resumes exactly from a workdir checkpoint (fp32,
rtol 1e-6), and its batches are a pure function of (seed, batch index)."""

import dataclasses
import functools
import os

import jax
import numpy as np
import pytest
from flax import nnx

from ac2_jax.losses import aggregate_loss, token_logprobs
from ac2_jax.models import Decoder, DecoderConfig
from ac2_jax.segments import Segment
from ac2_jax.training import Checkpointer, OptimizerConfig, SFTConfig, run_sft
from ac2_jax.training.core import MetricsLogger, StepCache, read_metrics
from ac2_jax.training.core.train_step import forward
from ac2_jax.training.sft import SFTData

CFG = DecoderConfig.tiny(vocab_size=32, num_layers=1)
OPT = OptimizerConfig(learning_rate=1e-2, warmup_steps=3)
STEPS = StepCache()  # the runs of this module share one compiled step


@pytest.fixture(scope="module")
def model():
    return Decoder(CFG, rngs=nnx.Rngs(0))  # run_sft copies it, so one model serves all runs


def demos(n=4, length=12, seed=0):
    """n random sequences; the first token is the 'prompt', the rest is trained."""
    rng = np.random.default_rng(seed)
    return [Segment(rng.integers(0, 32, length), [0] + [1] * (length - 1),
                    task=f"demo{i}") for i in range(n)]


@functools.partial(jax.jit, static_argnums=0)
def nll(graphdef, params, rest, batch):
    logp = token_logprobs(forward(graphdef, params, rest, batch), batch.targets)
    return aggregate_loss(-logp, batch, "task_mean")


@pytest.mark.full  # a learning run (many steps to a memorised set)
def test_sft_memorizes_a_tiny_data_set(model):
    segs = demos()
    config = SFTConfig(seq_len=16, batch_rows=4, steps=60, shuffle=False)
    result = run_sft(model, segs, config, OPT, make_step=STEPS)
    losses = [h["loss"] for h in result.history]
    assert len(losses) == 60 and [h["step"] for h in result.history][-1] == 60
    assert losses[-1] < 0.2 * losses[0], losses[::10]
    # The first reported loss is the task_mean NLL of the initial model on batch 0.
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    batch = SFTData(segs, 16, 4, shuffle=False).batch(0)
    np.testing.assert_allclose(losses[0], float(nll(graphdef, params, rest, batch)), rtol=1e-5)
    trained = nnx.split(result.model(), nnx.Param, ...)
    assert float(nll(*trained, batch)) < 0.2 * losses[0]


def test_resume_from_checkpoint_equals_uninterrupted(model, tmp_path):
    """6 steps straight == 3 steps, a new run restored from the workdir, 3 more (fp32,
    rtol 1e-6); the checkpoint cadence and the train/ metrics in the workdir."""
    segs = demos(n=4, seed=1)
    full = SFTConfig(seq_len=16, batch_rows=2, steps=6, checkpoint_every=2, seed=3,
                     keep_checkpoints=None)
    straight = run_sft(model, segs, dataclasses.replace(full, checkpoint_every=0), OPT,
                       make_step=STEPS)
    wd = tmp_path / "sft"
    first = run_sft(model, segs, dataclasses.replace(full, steps=3), OPT, workdir=wd,
                    make_step=STEPS)
    rest = run_sft(model, segs, full, OPT, workdir=wd, make_step=STEPS)
    with Checkpointer(wd / "checkpoints") as ck:
        assert ck.all_steps() == [2, 3, 4, 6]  # every 2 steps and at each run's end
    assert [h["step"] for h in first.history] == [1, 2, 3]
    assert [h["step"] for h in rest.history] == [4, 5, 6]
    got = [h["loss"] for h in first.history + rest.history]
    np.testing.assert_allclose(got, [h["loss"] for h in straight.history], rtol=1e-6)
    assert int(rest.state.step) == 6
    for a, b in zip(jax.tree.leaves(straight.state), jax.tree.leaves(rest.state)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-6, atol=1e-7)
    rows = read_metrics(str(wd / "metrics" / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    np.testing.assert_allclose([r["train/loss"] for r in rows], got, rtol=1e-6)
    # A finished run resumed again trains nothing and returns the trained state.
    again = run_sft(model, segs, full, OPT, workdir=wd, make_step=STEPS)
    assert again.history == [] and int(again.state.step) == 6


def test_resume_refuses_another_data_order(model, tmp_path):
    segs = demos(n=4, seed=1)
    config = SFTConfig(seq_len=16, batch_rows=2, steps=1, seed=3)
    run_sft(model, segs, config, OPT, workdir=tmp_path, make_step=STEPS)
    with pytest.raises(ValueError, match="seed: checkpoint 3, now 4"):
        run_sft(model, segs, dataclasses.replace(config, seed=4, steps=2), OPT,
                workdir=tmp_path, make_step=STEPS)


def test_batches_are_a_pure_function_of_the_index():
    segs = demos(n=6, seed=2)
    a, b = SFTData(segs, 16, 2, seed=5), SFTData(segs, 16, 2, seed=5)
    assert a.batches_per_epoch == 3
    for i in range(6):
        np.testing.assert_array_equal(a.batch(i).tokens, b.batch(i).tokens)
    for epoch in range(2):  # every segment exactly once per epoch
        rows = np.concatenate([a.batch(epoch * 3 + k).tokens for k in range(3)])
        assert sorted(tuple(r[:12]) for r in rows) == sorted(tuple(s.tokens) for s in segs)
    assert not np.array_equal(a.batch(0).tokens, SFTData(segs, 16, 2, seed=6).batch(0).tokens)


def test_a_task_is_never_split_across_steps():
    """Packing once and batching rows put one task's segments into different steps, each
    normalised as if it were the whole task."""
    rng = np.random.default_rng(7)
    segs = [Segment(rng.integers(1, 32, 9), [0] + [1] * 8, task=f"t{i // 3}")
            for i in range(12)]  # 4 tasks x 3 segments; a row of 16 holds one segment
    data = SFTData(segs, 16, 4, seed=1)
    seen = []
    for i in range(2 * data.batches_per_epoch):
        b = data.batch(i)
        assert b.shape == (4, 16)
        tasks = {int(t) for t in np.unique(b.task_ids[b.loss_mask > 0])}
        assert b.loss_mask.sum() == 8 * 3 * len(tasks)  # all 3 segments of each task present
        seen.append(len(tasks))
    assert sum(seen) == 8  # every task once per epoch, 2 epochs
    with pytest.raises(ValueError, match="needs more than batch_rows=2"):
        SFTData(segs, 16, 2)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="SFTConfig.batch_rows"):
        SFTConfig(batch_rows=0)
    with pytest.raises(ValueError, match="SFTConfig.checkpoint_every"):
        SFTConfig(checkpoint_every=-1)
    with pytest.raises(ValueError, match="checkpoint_every=2 needs a workdir"):
        run_sft(None, [], SFTConfig(checkpoint_every=2))
    no_loss = [Segment([1, 2, 3], [0, 0, 0], task="x")]
    with pytest.raises(ValueError, match="no segment has a loss-mask token"):
        SFTData(no_loss, 8, 1)


def test_truncation_is_cut_and_counted_in_the_metrics(model):
    """truncate=True keeps each segment's first seq_len tokens (segments.fit_segments,
    RL's cut-and-count) and every step reports what its batch lost:
    truncated_segments and truncated_agent_tokens."""
    rng = np.random.default_rng(4)
    lengths = [20, 12, 16, 19]  # seq_len 16: t0 loses 4 agent tokens, t3 loses 3
    segs = [Segment(rng.integers(0, 32, n), [0, 0] + [1] * (n - 2), task=f"t{i}")
            for i, n in enumerate(lengths)]
    data = SFTData(segs, 16, 2, shuffle=False, truncate=True)
    counts = [data.counts(i) for i in range(data.batches_per_epoch)]
    assert sum(c.truncated_segments for c in counts) == 2
    assert sum(c.truncated_agent_tokens for c in counts) == 7
    # What an epoch trains + what it cut = every agent token.
    trained = sum(data.batch(i).loss_mask.sum() for i in range(len(counts)))
    assert trained + 7 == sum(s.num_agent_tokens for s in segs)
    config = SFTConfig(seq_len=16, batch_rows=2, steps=2 * len(counts), shuffle=False,
                       truncate=True)
    history = run_sft(model, segs, config, OPT, make_step=STEPS).history
    assert [h["truncated_agent_tokens"] for h in history] == [
        float(c.truncated_agent_tokens) for c in counts * 2]
    assert [h["truncated_segments"] for h in history] == [
        float(c.truncated_segments) for c in counts * 2]


def test_an_agent_token_at_position_0_is_counted_never_silent(model):
    """A segment's first token has no prediction (nothing precedes it), so the packed
    loss_mask cannot count it: it is counted as unpredicted_agent_tokens in every step
    whose batch holds it, and a data set whose only agent tokens sit there is refused."""
    segs = [Segment([5, 6, 7, 8], [1, 1, 1, 1], task="a"), Segment([1, 2, 3], [0, 1, 1], task="b")]
    data = SFTData(segs, 8, 1, shuffle=False)
    assert data.batch(0).loss_mask.sum() == 5 and data.counts(0).unpredicted_agent_tokens == 1
    config = SFTConfig(seq_len=8, batch_rows=1, steps=1, shuffle=False)
    history = run_sft(model, segs, config, OPT, make_step=STEPS).history
    assert history[0]["unpredicted_agent_tokens"] == 1.0
    with pytest.raises(ValueError, match="position 0"):
        SFTData([Segment([1, 2, 3], [1, 0, 0], task="x")], 8, 1)


def test_varied_batches_compile_the_step_once(model):
    """Batches of 1-7 tasks of 3-15 tokens: the step compiles once (a count, not a
    timing). The static capacities come from the data set's bound, not each batch."""
    rng = np.random.default_rng(5)
    segs = []
    for i in range(24):
        n = int(rng.integers(3, 16))
        segs.append(Segment(rng.integers(0, 32, n), [0] + [1] * (n - 1),
                            task=f"t{i}"))
    data = SFTData(segs, 16, 4, seed=2)
    counts = {(data.batch(i).num_tasks, data.batch(i).num_segments) for i in range(8)}
    assert len(counts) == 1, counts
    result = run_sft(model, segs, SFTConfig(seq_len=16, batch_rows=4, steps=8, seed=2), OPT)
    assert [h["compiled_steps"] for h in result.history] == [1.0] * 8


def test_chunked_log_probs_train_like_dense(model):
    """SFTConfig.chunk_size reaches the loss: 3 steps with chunks of 4 positions give the
    dense run's losses (fp32, rtol 1e-5)."""
    segs = demos(n=4, seed=3)
    dense = run_sft(model, segs, SFTConfig(seq_len=16, batch_rows=4, steps=3, seed=1), OPT)
    chunked = run_sft(model, segs, SFTConfig(seq_len=16, batch_rows=4, steps=3, seed=1,
                                             chunk_size=4), OPT)
    np.testing.assert_allclose([h["loss"] for h in chunked.history],
                               [h["loss"] for h in dense.history], rtol=1e-5)


class _CountingLogger(MetricsLogger):
    closes = 0

    def close(self):
        self.closes += 1
        super().close()


@pytest.mark.parametrize("with_workdir", [False, True])
def test_a_given_logger_gets_the_metrics_and_stays_open(model, tmp_path, with_workdir):
    """logger=: train/ metrics reach its metrics.jsonl and TensorBoard, with or without
    a workdir (whose own metrics/ is then not made); the caller closes it."""
    logger = _CountingLogger(str(tmp_path / "run"), tensorboard=True, console=False)
    wd = tmp_path / "sft" if with_workdir else None
    config = SFTConfig(seq_len=16, batch_rows=4, steps=3, shuffle=False)
    result = run_sft(model, demos(), config, OPT, workdir=wd, logger=logger, make_step=STEPS)
    assert logger.closes == 0
    logger.log(4, {"later": 1.0})  # still the caller's to use
    logger.close()
    rows = read_metrics(logger.path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    np.testing.assert_allclose([r["train/loss"] for r in rows[:3]],
                               [h["loss"] for h in result.history], rtol=1e-6)
    events = os.listdir(tmp_path / "run" / "tensorboard")
    assert events and all(e.startswith("events.out.tfevents") for e in events)
    assert sum(os.path.getsize(tmp_path / "run" / "tensorboard" / e) for e in events) > 0
    if with_workdir:
        assert not (wd / "metrics").exists() and (wd / "checkpoints").exists()
