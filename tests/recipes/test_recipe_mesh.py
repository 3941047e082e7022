"""The recipes' `mesh` section (issue 68): data x fsdp x tensor over this machine's
devices (the suite forces 8 host devices, tests/conftest.py), refused in one line above
the device count, said on the console when it is not 1x1x1."""

import functools
import importlib
import io

import jax
import pytest

from ac2_jax.config import ConfigError
from ac2_jax.config_cli import load_config
from ac2_jax.recipes import MeshConfig, SFTRecipeConfig, load_model, sft
from ac2_jax.recipes.common import recipe_mesh
from ac2_jax.train import main
from tests.support.recipe_helpers import ParityEnv


def test_the_mesh_section_makes_a_mesh_of_its_shape():
    assert jax.device_count() == 8  # the suite's forced host devices
    mesh, line = recipe_mesh(MeshConfig(data=2, fsdp=2, tensor=2))
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "tensor": 2}
    assert line == "learner over 8 of 8 cpu devices: mesh.data=2 x mesh.fsdp=2 x mesh.tensor=2"
    mesh, line = recipe_mesh(MeshConfig(fsdp=4))
    assert dict(mesh.shape) == {"data": 1, "fsdp": 4, "tensor": 1} and "over 4 of 8" in line
    assert recipe_mesh(MeshConfig()) == (None, None)  # the trainers' one-device mesh
    with pytest.raises(ValueError, match=r"must be >= 1, got 0/1/1"):
        MeshConfig(data=0)


def test_a_mesh_above_the_device_count_is_one_line_naming_fields_and_count():
    with pytest.raises(ConfigError) as e:
        recipe_mesh(MeshConfig(data=4, tensor=4))
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("mesh.data=4 x mesh.fsdp=1 x mesh.tensor=4 needs 16 devices; ")
    assert "this machine has 8 (cpu)" in msg


def test_batch_rows_the_mesh_cannot_split_are_refused_naming_the_field():
    with pytest.raises(ConfigError, match=r"^sft.batch_rows=6 must be a multiple of mesh.data x "
                       r"mesh.fsdp x grad_accum = 2 x 2 x 1 = 4 .*--config.sft.batch_rows=8$"):
        recipe_mesh(MeshConfig(data=2, fsdp=2), {"sft.batch_rows": 6})
    with pytest.raises(ConfigError, match=r"= 2 x 1 x 2 = 4"):
        recipe_mesh(MeshConfig(data=2), {"rl.batch.rows_multiple": 2}, grad_accum=2)
    mesh, _ = recipe_mesh(MeshConfig(data=2, tensor=3), {"sft.batch_rows": 2})  # tensor: no split
    assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "tensor": 3}


@pytest.mark.parametrize("recipe", ["rl", "sft", "distill"])
def test_each_recipe_refuses_a_mesh_above_the_device_count_before_any_work(
    recipe, tmp_path, capsys
):
    """Through the launcher: exit 2, one stderr line, and no model loaded (no workdir
    files beyond the claim)."""
    rc = main([f"--recipe={recipe}", "--model=tiny", "--env=tests.support.recipe_helpers:ParityEnv",
               f"--workdir={tmp_path / 'run'}", "--config.mesh.data=16"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "mesh.data=16 x mesh.fsdp=1 x mesh.tensor=1 needs 16 devices" in err[0]
    assert "this machine has 8" in err[0]
    assert not (tmp_path / "run" / "report").exists()


def test_rl_on_a_data_mesh_asks_for_rows_multiple(tmp_path, capsys):
    """RL rows grow in steps of rl.batch.rows_multiple (default 1): refused up front on a
    data mesh of 2, naming the setting that fixes it, not at the first step."""
    rc = main(["--recipe=rl", "--model=tiny", "--env=tests.support.recipe_helpers:ParityEnv",
               f"--workdir={tmp_path / 'run'}", "--config.mesh.data=2"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("ac2_jax.train: error: rl.batch.rows_multiple=1 must be a multiple")
    assert err[0].endswith("set --config.rl.batch.rows_multiple=2")


def _console(monkeypatch, recipe: str) -> io.StringIO:
    """Where the recipe's `Progress` lines go (the console), for the test to read."""
    module = importlib.import_module(f"ac2_jax.recipes._{recipe}")
    console = io.StringIO()
    monkeypatch.setattr(module, "Progress", functools.partial(module.Progress, out=console))
    return console


@pytest.mark.full  # a real step (compiles a sharded train step)
def test_sft_trains_on_the_configured_mesh_and_says_so(tmp_path, monkeypatch):
    """The trainer gets the section's mesh: the trained params live on a 2x2x1 mesh over
    4 devices, and the console names it."""
    cfg = load_config(SFTRecipeConfig, None, [
        f"paths.workdir={tmp_path / 'run'}", "demos.num_tasks=4", "sft.steps=1",
        "sft.batch_rows=4", "sft.seq_len=128", "sft.checkpoint_every=0",
        "log.report_files=false", "log.tensorboard=false",
        "mesh.data=2", "mesh.fsdp=2"])  # fmt: skip
    console = _console(monkeypatch, "sft")
    result = sft(load_model("tiny", str(tmp_path / "build")), ParityEnv(), cfg)
    assert result.report["steps"] == 1
    line = "[sft] learner over 4 of 8 cpu devices: mesh.data=2 x mesh.fsdp=2 x mesh.tensor=1"
    assert line in console.getvalue().splitlines()
    assert _on_mesh(result.model, {"data": 2, "fsdp": 2, "tensor": 1})


def _on_mesh(model, shape: dict[str, int]) -> bool:
    from flax import nnx

    shardings = {x.sharding for x in jax.tree.leaves(nnx.state(model, nnx.Param))}
    n = shape["data"] * shape["fsdp"] * shape["tensor"]
    return all(
        {a: dict(s.mesh.shape)[a] for a in shape} == shape and len(s.device_set) == n
        for s in shardings
    )


@pytest.mark.full  # serves and rolls out: a recipe end to end
@pytest.mark.parametrize("recipe", ["rl", "distill"])
def test_rl_and_distill_train_on_the_configured_mesh(recipe, tmp_path, monkeypatch):
    from ac2_jax.recipes import DistillRecipeConfig, RLRecipeConfig, distill, rl

    common = ["rollout.max_tokens=8", "rollout.max_steps=1", "sampler.warmup=false",
              "log.report_files=false", f"paths.workdir={tmp_path / 'run'}",
              "mesh.data=2", "mesh.tensor=2"]  # fmt: skip
    if recipe == "rl":
        cls, run = RLRecipeConfig, rl
        over = ["rl.steps=1", "rl.tasks_per_step=2", "rl.attempts_per_task=4",
                "rl.batch.rows=2", "rl.batch.rows_multiple=2", "rl.batch.seq_len=128",
                "rl.concurrency=8"]  # fmt: skip
    else:
        cls, run = DistillRecipeConfig, distill
        over = ["loop.steps=1", "loop.tasks_per_step=2", "loop.concurrency=4"]
    cfg = load_config(cls, None, [*common, *over])
    console = _console(monkeypatch, recipe)
    result = run(load_model("tiny", str(tmp_path / "build")), ParityEnv(), cfg)
    assert result.report["steps"] == 1
    line = "learner over 4 of 8 cpu devices: mesh.data=2 x mesh.fsdp=1 x mesh.tensor=2"
    assert line in console.getvalue()
    assert _on_mesh(result.model, {"data": 2, "fsdp": 1, "tensor": 2})


def test_distill_rows_grow_in_steps_the_mesh_splits(tmp_path):
    """distill.rows=2 on mesh.data=2, and three examples that need a row each: the batch
    grows to 4 rows, not to 3 (check_rows' ValueError at the step before the fix)."""
    import numpy as np
    from flax import nnx

    from ac2_jax.models import Decoder, DecoderConfig
    from ac2_jax.text.tiny_tokenizer import build_tiny_tokenizer
    from ac2_jax.training import OptimizerConfig, create_train_state, make_mesh
    from ac2_jax.training.distill.data import make_example
    from ac2_jax.training.distill.trainer import DistillConfig, SelfDistiller

    tok = build_tiny_tokenizer(str(tmp_path), extra_corpus=["Pick a color. Say blue."] * 20)
    opt = OptimizerConfig(learning_rate=1e-2)
    model = Decoder(DecoderConfig.tiny(vocab_size=tok.vocab_size), rngs=nnx.Rngs(3))
    graphdef, state = create_train_state(model, opt, rng=0)
    rng = np.random.default_rng(0)
    msgs = [{"role": "user", "content": "Pick a color."}]
    examples = [make_example(tok, msgs, rng.integers(10, 300, 6).tolist(), "Say blue.",
                             f"task/{i}") for i in range(3)]  # fmt: skip
    longest = max(len(e.teacher_prompt) + len(e.response) for e in examples)
    cfg = DistillConfig(seq_len=longest + 2, rows=2, checkpoint_every=0)  # one row each
    dist = SelfDistiller(graphdef, state, cfg, opt, mesh=make_mesh(data=2))
    m = dist.update(examples)
    assert m["batch_rows"] == 4 and m["skipped"] == 0
