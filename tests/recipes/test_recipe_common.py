"""The recipes' shared pieces: model loading, the harness, progress lines."""

import io

import pytest

from ac2_jax.orchestration import DefaultOrchestrator
from ac2_jax.recipes import MODELS, Progress, load_model
from ac2_jax.recipes.common import LINE_WIDTH, harness_factory
from tests.recipe_helpers import ParityEnv, write_tiny_model


def test_a_model_loads_from_an_hf_directory_a_preset_or_a_pair(tmp_path):
    path = write_tiny_model(str(tmp_path))
    model, tokenizer = load_model(path)
    assert model.config.num_layers == 2 and tokenizer.vocab_size == model.config.vocab_size
    assert load_model((model, tokenizer)) == (model, tokenizer)
    assert "tiny" in MODELS
    with pytest.raises(ValueError, match=r"--model 'nope': not a directory .* preset \(tiny\)"):
        load_model("nope")


def test_progress_lines_are_never_wider_than_120():
    out = io.StringIO()
    p = Progress("rl", 10, out=out)
    p.step(3, {f"metric_number_{i}": 0.123456 * i for i in range(40)}, note="(no update)")
    p.say("x" * 300)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("[rl] 3/10  ") and lines[0].endswith("(no update)")
    assert all(len(x) <= LINE_WIDTH for x in lines)
    Progress("rl", 1, enabled=False, out=out).step(1)
    assert len(out.getvalue().splitlines()) == 2


def test_the_harness_is_the_envs_own_or_the_tool_loop():
    made = []

    class WithHarness(ParityEnv):
        def make_harness(self, task, client, model_name, *, sampling, max_steps):
            made.append((task, model_name, sampling, max_steps))
            return "custom"

    sampling = {"temperature": 0.5}
    assert harness_factory(sampling, 3)(WithHarness(), "t", None, "m") == "custom"
    assert made == [("t", "m", sampling, 3)] and made[0][2] is not sampling  # its own copy
    env = ParityEnv()
    task = env.sample_tasks(1, 0)[0]
    orch = harness_factory(sampling, 2)(env, task, None, "m")
    assert isinstance(orch, DefaultOrchestrator) and orch.sampling == sampling
