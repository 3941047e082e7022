"""The main job's pipeline at toy size: every stage runs and the report is complete."""

import json
import os

import numpy as np
import pytest

from ac2_jax.models.io.hf_io import load_hf_checkpoint
from experiments.calculator import agent as calculator_agent
from experiments.calculator.config import get_config


def test_pipeline_writes_a_complete_report(tmp_path):
    cfg = get_config("quick")  # 16 demos, 3 SFT steps, 1 RL step of 2 x 2 attempts, 4 eval tasks
    cfg.workdir = str(tmp_path / "run")
    cfg.sampler.warmup = True  # as the demo runs: every sampler shape compiled before the evals
    # 2 tasks x 2 attempts: at most 4 rollouts at once, so 4 rows serve them (row buckets
    # 1, 2 and 4 warmed up, not also 8: a quarter of the warm-up's programs).
    cfg.rl.concurrency = 4
    report = calculator_agent.run(cfg, log=lambda *a: None)

    out = os.path.join(cfg.workdir, "report")
    assert json.load(open(os.path.join(out, "report.json"))) == json.loads(json.dumps(report))
    for name in ("sft_pass_rate", "rl_pass_rate"):
        r = report[name]
        assert r["n"] == 4 and r["pass_rate_ci95"][0] <= r["pass_rate"] <= r["pass_rate_ci95"][1]
    assert report["rl_steps"] == 1
    assert os.path.getsize(os.path.join(out, "learning_curve.png")) > 0
    assert os.path.exists(os.path.join(out, "trace_1.html"))
    assert os.listdir(os.path.join(cfg.workdir, "rl", "checkpoints"))
    model, config = load_hf_checkpoint(os.path.join(out, "final_hf"))
    assert config.num_layers == cfg.model.num_layers
    # The rollouts were collected through the endpoint and stored with their step.
    lines = open(os.path.join(cfg.workdir, "rl", "rollouts.jsonl")).read().splitlines()
    assert len(lines) == 2 * 2
    # The RL step's sampler metrics: work was done, and nothing compiled after warmup.
    (step,) = [json.loads(x) for x in open(os.path.join(out, "metrics", "metrics.jsonl"))]
    assert step["train/sampler/new_shapes"] == 0
    assert step["train/sampler/output_tokens"] > 0 and step["train/sampler/decode_steps"] > 0
    assert 0 < step["train/sampler/occupancy"] <= 1


def test_rl_first_tasks_are_not_the_sft_demonstrations():
    """Both used seed 0: RL step 0 trained on exactly the first SFT demo tasks."""
    cfg = get_config()
    env = calculator_agent.build_env(cfg)
    demos = {t.task_id for t in calculator_agent.sft_tasks(cfg, env)}
    collector_seed = calculator_agent.rl_collector_seed(cfg) * 1_000_003 + 0  # EndpointCollector.tasks(0)
    step0 = {t.task_id for t in env.sample_tasks(cfg.rl.tasks_per_step, seed=collector_seed,
                                                 split="train")}
    assert len(step0 & demos) <= 1, step0 & demos


def test_long_variant_pipeline_reports_per_agent_figures(tmp_path):
    """`:long_quick`: the compacting harness runs every stage and the report has the
    per-agent figures of both evals (an untrained model rarely compacts: shapes only)."""
    cfg = get_config("long_quick")
    cfg.workdir = str(tmp_path / "run")
    report = calculator_agent.run(cfg, log=lambda *a: None)
    assert report["rl_steps"] == 1 and report["sft_pass_rate"]["n"] == 3
    for name in ("sft", "rl"):
        figures = report["agents"][name]
        assert set(figures) >= {"memo_fidelity", "memos_judged", "compactions_per_attempt",
                                "episodes_per_trace", "episodes_per_trace_by_agent",
                                "trace_metrics"}
        assert figures["episodes_per_trace"] >= 1
    assert "memo_fidelity_improvement" in report


def test_sft_restarts_equal_continuing_by_hand():
    """`sft_restarts` (the long variant's warm start): each (steps, lr) trains again
    with a fresh optimizer; the same as running the continued SFT by hand, as the
    runs of docs/notes/2026-12-06-whole-trace-claim-where-it-must-show.md did (fp32, atol 1e-6)."""
    import jax
    from flax import nnx

    cfg = get_config("long_quick")
    env = calculator_agent.build_env(cfg)
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        tok = calculator_agent.build_tokenizer(cfg, d, env)
    quiet = lambda *a: None  # noqa: E731
    model, history = calculator_agent.sft_warm_start(
        cfg, calculator_agent.build_model(cfg, tok.vocab_size), tok, env, quiet)
    assert [h["stage"] for h in history] == [0] * cfg.sft.steps + [1] * 2
    first = cfg.copy_and_resolve_references()
    first.sft_restarts = ()
    by_hand, _ = calculator_agent.sft_warm_start(
        first, calculator_agent.build_model(cfg, tok.vocab_size), tok, env, quiet)
    second = get_config("long_quick")
    second.sft_restarts = ()
    second.sft.steps, second.sft_optimizer.learning_rate = 2, 3e-3
    by_hand, _ = calculator_agent.sft_warm_start(second, by_hand, tok, env, quiet)
    a, b = nnx.state(model, nnx.Param), nnx.state(by_hand, nnx.Param)
    assert all(np.allclose(x, y, atol=1e-6) for x, y in zip(jax.tree.leaves(a),
                                                             jax.tree.leaves(b)))
    assert not all(np.allclose(x, y, atol=1e-6) for x, y in zip(
        jax.tree.leaves(a), jax.tree.leaves(nnx.state(calculator_agent.build_model(
            cfg, tok.vocab_size), nnx.Param))))


def test_sft_extend_restarts_only_while_the_loss_stays_high():
    """`sft_extend` (`long_memo`): up to max_stages more restarts, each only while the
    mean loss of the last `window` steps is above max_loss; none when it is below."""
    cfg = get_config("long_memo_quick")
    cfg.sft.steps = 2
    # The restarts' and extensions' (2 steps at 3e-3): every stage is one compiled step.
    cfg.sft_optimizer.learning_rate = 3e-3
    env = calculator_agent.build_env(cfg)
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        tok = calculator_agent.build_tokenizer(cfg, d, env)
    logs = []
    _, history = calculator_agent.sft_warm_start(
        cfg, calculator_agent.build_model(cfg, tok.vocab_size), tok, env, logs.append)
    # An untrained model's loss (~log of the vocab) is far above 0.15: both extensions.
    assert [h["stage"] for h in history] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert sum("sft extend: final loss" in m for m in logs) == 2
    cfg.sft_extend.max_loss = 100.0
    logs.clear()
    _, history = calculator_agent.sft_warm_start(
        cfg, calculator_agent.build_model(cfg, tok.vocab_size), tok, env, logs.append)
    assert [h["stage"] for h in history] == [0, 0, 1, 1]
    assert any("no extension" in m for m in logs)


def test_sft_weak_link_stage_trains_the_named_agents_episodes_last(tmp_path):
    """`sft_weak_link` (`long_memo_weak_link`): after the restarts, one more stage on
    demos re-recorded with its own `demos` settings, keeping only the named agents'
    episodes, from a locked config (as the command line gives it). The weights before it
    are checkpointed: a second call restores them and gives the same weights. An agent
    with no episode, or a single-agent harness, is refused by name."""
    import jax
    from flax import nnx

    weak = get_config("long_memo_weak_link").sft_weak_link
    weak.steps = 2
    weak.learning_rate = 3e-3  # the restart's (2 steps at 3e-3): one compiled step for both
    cfg = get_config("long_memo_quick")
    cfg.sft_weak_link = weak
    cfg.sft_extend.max_stages = 0  # the extension has its own test
    cfg.lock()
    env = calculator_agent.build_env(cfg)
    tok = calculator_agent.build_tokenizer(cfg, str(tmp_path / "tok"), env)
    logs = []
    model, history = calculator_agent.sft_warm_start(
        cfg, calculator_agent.build_model(cfg, tok.vocab_size), tok, env, logs.append,
        str(tmp_path))
    assert [h["stage"] for h in history] == [0] * cfg.sft.steps + [1] * 2 + ["weak_link"] * 2
    demo_logs = [m for m in logs if m.startswith("demos:")]
    assert len(demo_logs) == 2  # the first stage's demos, then the weak link's
    assert any(m.startswith("sft weak link step ") for m in logs)
    assert os.path.exists(tmp_path / "sft_before_weak_link")
    logs = []
    again, history = calculator_agent.sft_warm_start(
        cfg, calculator_agent.build_model(cfg, tok.vocab_size), tok, env, logs.append,
        str(tmp_path))
    assert [h["stage"] for h in history] == ["weak_link"] * 2
    assert any(m.startswith("SFT before the weak link restored") for m in logs)
    assert all(np.allclose(x, y, atol=1e-6) for x, y in zip(
        jax.tree.leaves(nnx.state(model, nnx.Param)), jax.tree.leaves(nnx.state(again, nnx.Param))))
    bad = get_config("long_memo_quick")
    bad.sft_weak_link = weak.copy_and_resolve_references()
    bad.sft_weak_link.agents = ("nobody",)
    bad.sft_restarts, bad.sft.steps = (), 2
    with pytest.raises(ValueError, match="no episode of agents \\('nobody',\\)"):
        calculator_agent.sft_warm_start(
            bad, calculator_agent.build_model(bad, tok.vocab_size), tok, env, lambda *a: None)
    single = get_config("quick")
    single.sft_weak_link = bad.sft_weak_link
    with pytest.raises(ValueError, match="sft_weak_link .* multi-agent harness"):
        calculator_agent.sft_warm_start(
            single, calculator_agent.build_model(single, tok.vocab_size), tok, env,
            lambda *a: None)


def test_moe_variant_pipeline_records_and_replays_routing(tmp_path):
    """calculator/config.py:moe_quick: the job runs with a Qwen3-MoE policy, its rollouts
    carry the sampler's routing (flat rows replay it), and the export loads as
    qwen3_moe. The lora variants configure adapters for RL only."""
    cfg = get_config("moe_quick")
    cfg.workdir = str(tmp_path / "run")
    report = calculator_agent.run(cfg, log=lambda *a: None)
    assert report["rl_steps"] == 1
    lines = open(os.path.join(cfg.workdir, "rl", "rollouts.jsonl")).read()
    assert '"routed_experts"' in lines
    _, config = load_hf_checkpoint(os.path.join(cfg.workdir, "report", "final_hf"))
    assert config.family == "qwen3_moe" and config.num_experts == 8
    for variant in ("lora", "lora_quick"):
        rcfg = calculator_agent.recipe_config(get_config(variant))
        assert rcfg.lora is not None and rcfg.lora.rank == 16
    assert calculator_agent.recipe_config(get_config("quick")).lora is None
