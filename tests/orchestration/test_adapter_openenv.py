"""OpenEnv environments through their adapter (`--env=openenv:<url or module>`), unchanged.

The environment is the library's own: the echo environment `openenv init` generates from
the library's template (`openenv.cli.templates.openenv_env`), served by the library's
`create_app` (the adapter starts it from its module, uvicorn in a thread). Its reward
(`min(0.1 * len(message), 1.0)` per step) is checked against the environment class itself;
a server that fails mid-rollout makes the attempt infra_error (no reward, counted).
The launcher end to end is tests/recipes/test_recipe_adapters.py (full tier: the five
libraries in one mix).
"""

import asyncio
import json
import pathlib
import re
import shlex
import sys

import pytest

from ac2_jax.envs.contract import EnvError, check_env, load_env

ADMIN = "openenv-admin"
HOW = "Answer with the 'message' of your action: Message to echo back."
DOC = pathlib.Path(__file__).resolve().parents[2] / "docs/howto/existing-environments.md"


def test_bad_openenv_specs_are_one_line():
    """No openenv needed: an unreachable server, a missing target, an unknown key and an
    unimportable module are each one line naming what was wrong."""
    for spec, says in [
        ("openenv:http://127.0.0.1:9", "no OpenEnv server answers at http://127.0.0.1:9 ("),
        ("openenv:", "names no server"),
        ("openenv:http://127.0.0.1:9,max_turn=2", "unknown key 'max_turn'"),
        ("openenv:http://127.0.0.1:9,reward_range=1", "reward_range must be [low, high]"),
        (
            "openenv:no_such_openenv_module.app",
            "cannot import 'no_such_openenv_module.app' (No module",
        ),
    ]:
        with pytest.raises(EnvError) as e:
            load_env(spec)
        assert says in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert "did you mean 'max_turns'?" in str(
        pytest.raises(EnvError, load_env, "openenv:http://127.0.0.1:9,max_turn=2").value
    )


@pytest.fixture(scope="module")
def echo_pkg(tmp_path_factory):
    """The echo environment package `openenv init echo_env` writes (the library's template,
    without its `uv lock` step), importable as `echo_env`."""
    pytest.importorskip("openenv", reason="the openenv extra")
    from openenv.cli.commands.init import _copy_template_directory, _create_template_replacements

    root = tmp_path_factory.mktemp("openenv")
    _copy_template_directory(
        "openenv.cli.templates.openenv_env", "", root / "echo_env",
        _create_template_replacements("echo_env"), "echo_env",
    )  # fmt: skip
    sys.path.insert(0, str(root))
    try:
        from echo_env.models import EchoAction
        from echo_env.server.echo_env_environment import EchoEnvironment

        yield EchoEnvironment, EchoAction
    finally:
        sys.path.remove(str(root))


@pytest.fixture(scope="module")
def echo(echo_pkg):
    env = load_env("openenv:echo_env.server.app,max_turns=2")
    try:
        yield env
    finally:
        env.close()


def own_reward(echo_pkg, seed, answers):
    """The echo environment's own summed step rewards, from its class (no server)."""
    cls, action = echo_pkg
    env = cls()
    env.reset(seed=seed)
    return sum(env.step(action(message=a)).reward for a in answers)


def test_echo_env_meets_the_contract_and_its_rewards_are_its_own(echo, echo_pkg):
    env = check_env(echo)
    assert env.name == "EchoEnvironment" and env.action_field == "message"
    task = env.sample_tasks(1, seed=0)[0]
    assert task.prompt == f"Echo Env environment ready!\n{HOW}"
    assert re.fullmatch(r"EchoEnvironment-train-\d*[02468]", task.task_id)
    seed = task.metadata["seed"]
    for answers, expected in [(["hello", "hi"], 0.7), (["a very long message"], 1.0), ([""], 0.0)]:
        got = env.verify(task, json.dumps({"answers": answers}))
        assert got == own_reward(echo_pkg, seed, answers) == pytest.approx(expected)
    assert env.verify(task, None) == 0.0
    first = env.initial_messages(task) + [{"role": "assistant", "content": "hello"}]
    assert env.reply(task, first) == f"hello\n{HOW}"  # the echoed observation
    second = first + [{"role": "user", "content": "x"}, {"role": "assistant", "content": "b"}]
    assert env.reply(task, second) is None  # max_turns=2 answers given
    from ac2_jax.orchestration import OpenEnvError

    with pytest.raises(OpenEnvError, match="more than max_turns=2"):
        env.verify(task, json.dumps({"answers": ["a", "b", "c"]}))
    # A task the server did not sample this way (another first observation) is refused.
    other = type(task)(task_id=task.task_id, prompt="", metadata={"seed": seed, "observation": "?"})
    with pytest.raises(OpenEnvError, match="does not replay from its seed"):
        env.verify(other, json.dumps({"answers": ["hi"]}))
    with pytest.raises(
        EnvError, match=r"action has no field 'msg' \(fields: message\); did you mean 'message'\?"
    ):
        load_env(f"openenv:{env.url},action_field=msg")


def test_the_howto_openenv_commands_build_their_env(echo_pkg, tmp_path):
    """docs/howto/existing-environments.md's OpenEnv block: `openenv init echo_env` then a
    launcher line whose env spec builds on the package that wrote (running it is the
    full tier's: tests/recipes/test_recipe_adapters.py)."""
    from ac2_jax.train import build

    (block,) = [b for b in re.findall(r"```bash\n(.*?)```", DOC.read_text(), re.S)
                if "--env=openenv:" in b]  # fmt: skip
    init, train = [shlex.split(c) for c in block.replace("\\\n", " ").strip().splitlines()]
    assert init == ["openenv", "init", "echo_env", "--output-dir", "runs"]
    assert train[0] == "PYTHONPATH=runs" and train[1:4] == ["python", "-m", "ac2_jax.train"]
    argv = [a if not a.startswith("--workdir=") else f"--workdir={tmp_path}" for a in train[4:]]
    entry, model, spec, config = build(argv)
    assert model == "tiny" and config.rl.steps >= 1
    env = check_env(load_env(spec))
    env.close()


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory, echo):
    from tests.support.serving_helpers import served_random_model

    tmp = tmp_path_factory.mktemp("openenv_endpoint")
    with served_random_model(tmp, ADMIN, max_context=512, max_batch=1) as (url, tok):
        yield url


def rollout(url, env, task, max_steps=4, max_tokens=6):
    from ac2_jax.orchestration import LifecycleClient, run_rollout
    from ac2_jax.recipes.common import harness_factory

    make = harness_factory({"temperature": 1.0, "max_tokens": max_tokens, "seed": 3}, max_steps)

    async def go():
        lc = LifecycleClient(url, ADMIN)
        try:
            return await run_rollout(lc, env, task, make, "tiny", group_id="g")
        finally:
            await lc.aclose()

    return asyncio.run(go())


def test_an_attempt_is_one_episode_rewarded_by_the_env_and_a_server_error_is_infra(
    echo, echo_pkg, endpoint, monkeypatch
):
    from ac2_jax.recipes.common import error_lines

    task = echo.sample_tasks(1, seed=2)[0]
    trace, conv = rollout(endpoint, echo, task)
    assert trace.status == "finished", trace.metadata
    answers = json.loads(conv.answer)["answers"]
    assert len(answers) == 2  # max_turns=2: the env's reply ended the episode
    assert trace.reward == own_reward(echo_pkg, task.metadata["seed"], answers)
    users = [m["content"] for m in conv.messages if m["role"] == "user"]
    assert users == [task.prompt, f"{answers[0]}\n{HOW}"]  # what the env sent
    (episode,) = trace.episodes
    assert len(episode.completions) == 2

    # The environment fails on the server mid-rollout: infra_error, no reward, counted.
    cls, _ = echo_pkg

    def broken(self, action, **kw):
        raise RuntimeError("the echo backend is down")

    monkeypatch.setattr(cls, "step", broken)
    trace, _ = rollout(endpoint, echo, task)
    assert trace.status == "infra_error" and trace.reward is None
    error = trace.metadata["artifacts"]["error"]
    assert error.startswith("OpenEnvError: EchoEnvironment at http://127.0.0.1:"), error
    assert "step answered error EXECUTION_ERROR: the echo backend is down" in error
    assert error_lines(1, [trace])[0] == "step 1: 1 of 1 attempts ended infra_error"
