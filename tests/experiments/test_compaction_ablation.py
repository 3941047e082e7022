"""experiments/whole_trace/ablation.py: every arm from one SFT per seed, seeds pooled,
the memo-fidelity reward, the subagent variant."""

import json
import os

from experiments.calculator.config import get_config


def test_compaction_ablation_all_arms_then_pooled_over_seeds(tmp_path):
    """calculator/config.py:long_memo_quick: every arm (whole, main only, compactor only, the
    memo-reward reference) from one SFT, in seed 0's directory; then `run_seeds(cfg, 2)`
    pools it with a second seed's directory. The toy pipeline runs one seed (two took
    78 s, over the minute asked): the second is seed 0's run copied under seed 1's name,
    so the pooling, the reuse of finished seeds and the report run for real over two
    directories, and each pooled per-task figure must equal seed 0's."""
    import shutil

    from experiments.whole_trace import ablation as compaction_ablation
    cfg = get_config("long_memo_quick")
    cfg.workdir = str(tmp_path / "abl")
    cfg.sft_extend.max_stages = 0  # the extension has its own test
    single = compaction_ablation.run_seeds(cfg, 1, log=lambda *a: None)
    arms = ["whole", "main_only", "compactor_only", "memo_reward"]
    assert single["arms"] == arms and single["seeds"] == [0]
    seed0 = os.path.join(cfg.workdir, "seed_0")
    report = json.load(open(os.path.join(seed0, "report", "ablation.json")))
    assert report["seed"] == 0 and set(report["evals"]) == {"sft", *(f"rl_{a}" for a in arms)}
    # The same held-out tasks in every seed (eval.task_seed), so tasks pool.
    assert report["eval_tasks"] == cfg.eval.num_tasks
    assert set(report["differences"]) == {f"rl_{a} - sft" for a in arms} | {
        f"rl_{a} - rl_main_only" for a in arms if a != "main_only"}
    for arm in arms:
        assert [c["rl_step"] for c in report["rl_curves"][arm]] == [0]
        # Each arm trained from the SFT weights in its own directory.
        assert os.listdir(os.path.join(seed0, f"rl_{arm}", "checkpoints"))
    # Where the main agent slips, per eval: every main request of every trace counted.
    for name, ev in report["evals"].items():
        assert sum(v["n"] for v in ev["main_requests"].values()) > 0, name
    md = open(os.path.join(seed0, "report", "ablation.md")).read()
    assert "rl_memo_reward" in md and "memo fidelity" in md and "first calls right" in md
    # The arms that leave agents out count those agents' tokens as excluded.
    for arm in ("main_only", "compactor_only", "memo_reward"):
        metrics = [json.loads(line) for line in open(os.path.join(
            seed0, "report", f"metrics_{arm}", "metrics.jsonl"))]
        assert metrics and all("train/excluded_agent_tokens" in m for m in metrics), arm

    seed1 = os.path.join(cfg.workdir, "seed_1")
    shutil.copytree(seed0, seed1)
    report["seed"] = 1
    with open(os.path.join(seed1, "report", "ablation.json"), "w") as f:
        json.dump(report, f)
    logs = []
    pooled = compaction_ablation.run_seeds(cfg, 2, log=logs.append)
    assert sum("reused" in m for m in logs) == 2  # finished seeds are not run again
    assert pooled["arms"] == arms and pooled["seeds"] == [0, 1]
    assert pooled["primary"]["estimate"]["n"] == cfg.eval.num_tasks
    assert pooled["primary"]["verdict"] in ("shown", "not shown", "reversed")
    # Two identical seeds: per task, the mean over seeds is seed 0's figure.
    for arm in ["sft"] + arms:
        assert pooled["levels"][arm]["pass"]["mean"] == single["levels"][arm]["pass"]["mean"]
    assert set(pooled["differences"]) == {"main_only - sft", "whole - main_only",
                                          "compactor_only - main_only",
                                          "memo_reward - main_only"}
    assert [s["seed"] for s in pooled["per_seed"]] == [0, 1]
    report_dir = os.path.join(cfg.workdir, "report")
    assert os.path.getsize(os.path.join(report_dir, "curves.png")) > 1000
    assert "Primary (pre-registered)" in open(os.path.join(report_dir, "pooled.md")).read()


def test_memo_reward_is_the_attempts_memo_fidelity():
    from ac2_jax.trace import Trace
    from experiments.whole_trace.ablation import MemoRewardCollector, memo_fidelity
    t = Trace(task_id="t", status="finished", reward=1.0, metadata={"artifacts": {"events": [
        {"kind": "compaction", "memo_ok": True}, {"kind": "compaction", "memo_ok": False},
        {"kind": "compaction", "memo_ok": True}]}})
    assert [e.get("memo_ok") for e in t.events] == [True, False, True]
    assert abs(memo_fidelity(t) - 2 / 3) < 1e-12
    assert memo_fidelity(Trace(task_id="u", status="finished", reward=1.0)) == 0.0
    failed = Trace(task_id="v", status="infra_error", reward=None)
    out = MemoRewardCollector._rewarded([t, failed])
    assert abs(out[0].reward - 2 / 3) < 1e-12 and out[1].reward is None and t.reward == 1.0


def test_ablation_needs_the_compacting_harness():
    import pytest

    from experiments.whole_trace import ablation as compaction_ablation
    with pytest.raises(ValueError, match="calculator/config.py:long"):
        compaction_ablation.run(get_config("quick"))


def test_subagent_variant_ablation(tmp_path):
    """calculator/config.py:sub_helper_quick: whole trace vs main only with the delegating
    harness; every spawn judged (helper_ok), the report names the helper's fidelity."""
    from experiments.whole_trace import ablation as compaction_ablation
    cfg = get_config("sub_helper_quick")
    cfg.workdir = str(tmp_path / "sub")
    pooled = compaction_ablation.run_seeds(cfg, 1, log=lambda *a: None)
    assert pooled["arms"] == ["whole", "main_only"] and pooled["judged"] == "helper_ok"
    report = json.load(open(os.path.join(cfg.workdir, "seed_0", "report", "ablation.json")))
    assert report["judged"] == "helper_ok"
    for ev in report["evals"].values():
        assert "helper_fidelity" in ev["agents"]
        assert sum(v["n"] for v in ev["main_requests"].values()) > 0
    assert "helper fidelity" in open(os.path.join(cfg.workdir, "report", "pooled.md")).read()


def test_seed_config_reseeds_the_warm_start_and_rl():
    from experiments.calculator import agent as ca
    from experiments.whole_trace.ablation import seed_config
    cfg = get_config("long_memo")
    one = seed_config(cfg, 2)
    typed = ca.typed_configs(one)
    assert (one.seed, typed["sft"].seed, typed["rl"].seed) == (2, 2, 2)
    assert one.workdir.endswith("seed_2") and cfg.seed == 0


def test_run_seeds_and_arms_are_checked_before_any_work(tmp_path):
    import pytest

    from experiments.whole_trace import ablation as compaction_ablation
    cfg = get_config("long_quick")  # no eval.task_seed: seeds share no held-out task
    cfg.workdir = str(tmp_path / "x")
    with pytest.raises(ValueError, match="task_seed"):
        compaction_ablation.run_seeds(cfg, 2)
    sub = get_config("sub_helper_quick")
    sub.ablation.arms = ("whole", "main_only", "memo_reward")
    with pytest.raises(ValueError, match="memo_reward"):
        compaction_ablation.arm_names(sub)
    memo = get_config("long_memo_quick")
    memo.ablation.arms = ("main_only", "whole")
    with pytest.raises(ValueError, match="starting with"):
        compaction_ablation.arm_names(memo)
    assert not os.path.exists(cfg.workdir)
