"""The env contract: load_env from an import path, check_env lists every problem."""

import pytest

from ac2_jax.envs import CalculatorEnv, Env, Task
from ac2_jax.envs.contract import EnvError, check_env, load_env, needs_of
from tests.support.recipe_helpers import ParityEnv


class Broken(Env):
    """Repeats ids, shares them across splits, and its verifier overflows."""

    def sample_tasks(self, n, seed, split="train"):
        return [Task(task_id="same", prompt="?") for _ in range(n)]

    def verify(self, task, answer):
        return 3.0


def test_load_env_takes_an_import_path_a_factory_or_an_instance():
    assert isinstance(load_env("tests.support.recipe_helpers:ParityEnv"), ParityEnv)
    assert isinstance(load_env(ParityEnv), ParityEnv)
    env = ParityEnv()
    assert load_env(env) is env


@pytest.mark.parametrize("spec, says", [
    ("tests.support.recipe_helpers", "expected an import path 'pkg.module:Factory'"),
    ("no_such_pkg.mod:Env", "cannot import 'no_such_pkg.mod'"),
    ("tests.support.recipe_helpers:Nope", "has no attribute 'Nope'"),
    ("tests.support.recipe_helpers:write_tiny_model", "calling it with no arguments raised TypeError"),
])
def test_load_env_errors_name_the_problem(spec, says):
    with pytest.raises(EnvError) as e:
        load_env(spec)
    assert says in str(e.value)


def test_a_good_env_passes_for_every_recipe():
    for recipe in ("rl", "sft", "distill"):
        check_env(ParityEnv(), recipe)


def test_every_problem_is_listed_in_one_error():
    with pytest.raises(EnvError) as e:
        check_env(Broken(), "distill")
    msg = str(e.value)
    for part in ("repeats task ids", "train and eval splits share task ids",
                 "outside reward_range", "needs Broken.hint(task)"):
        assert part in msg, (part, msg)
    assert "\n" not in msg


def test_sft_needs_a_demonstration_method():
    # CalculatorEnv's demonstrations are a function of the module, not a method.
    with pytest.raises(EnvError, match=r"recipe 'sft' needs CalculatorEnv.demonstration"):
        check_env(CalculatorEnv(), "sft")
    check_env(CalculatorEnv(), "rl")
    assert needs_of("distill") == ("hint",)


def test_a_reference_answer_that_fails_its_verifier_is_reported():
    class Wrong(ParityEnv):
        def reference_answer(self, task):
            return "odd"

    with pytest.raises(EnvError, match="reference_answer.*earns 0.0"):
        check_env(Wrong())


class ToolDemoEnv(ParityEnv):
    """ParityEnv with a lookup tool; its demonstration calls it, then answers."""

    def __init__(self, answer="ok", arguments='{"key": "a"}', name="lookup"):
        self.answer, self.arguments, self.name = answer, arguments, name

    @property
    def tools(self):
        from ac2_jax.envs import Tool

        return [Tool("lookup", "Looks a key up.", {"type": "object", "properties": {
            "key": {"type": "string"}}}, lambda key: "b")]

    def demonstration(self, task):
        call = {"id": "call_0", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}
        return self.initial_messages(task) + [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": "b"},
            {"role": "assistant", "content": self.answer}]


def test_a_demonstration_runs_through_its_verifier_and_tool_call_checks():
    # Issue 68, finding 6: a demo whose answer fails its own verifier, or whose tool call
    # is broken, was SFT-trained silently.
    check_env(ToolDemoEnv(), "sft")
    with pytest.raises(EnvError, match=r"demonstration\('train-0-0'\) answers 'odd', which its "
                                       r"verifier rewards 0.0, not the top reward 1.0"):
        check_env(ToolDemoEnv(answer="odd"), "sft")
    with pytest.raises(EnvError, match=r"tool call 1 \(lookup\) has arguments that are not a "
                                       r"JSON object: '\{key: a\}'"):
        check_env(ToolDemoEnv(arguments="{key: a}"), "sft")
    with pytest.raises(EnvError, match=r"calls 'lokup', not a tool of the env \(lookup\)"):
        check_env(ToolDemoEnv(name="lokup"), "sft")
    check_env(ToolDemoEnv(answer="odd"), "rl")  # only SFT reads demonstrations
