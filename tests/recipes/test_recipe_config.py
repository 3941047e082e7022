"""The recipes' configs: one place per setting, every output location configurable."""

import os

from ac2_jax.recipes import PathsConfig, RLRecipeConfig


def test_every_location_defaults_into_the_workdir_and_each_can_move(tmp_path):
    p = PathsConfig(workdir=str(tmp_path)).resolved()
    assert (p.publish, p.traces, p.reports, p.metrics) == tuple(
        os.path.join(str(tmp_path), x) for x in ("published", "traces", "report", "metrics"))
    moved = PathsConfig(workdir="w", publish=str(tmp_path / "pub"), reports="rep").resolved()
    assert moved.publish == str(tmp_path / "pub") and moved.reports == os.path.abspath("rep")
    assert os.path.isabs(moved.workdir)


def test_rl_concurrency_lives_in_one_place():
    # Finding: concurrency was set in RLConfig and again in the collector. The recipe
    # config has no other concurrency field for RL: the collector and sampler follow rl.
    fields = [f for f in RLRecipeConfig.__dataclass_fields__ if f != "eval"]
    assert "concurrency" not in fields and RLRecipeConfig().rl.concurrency == 16
