"""verifiers and TextArena environments through their adapters, unchanged, over the real
endpoint (a tiny random model served over HTTP, one rollout at a time).

verifiers: the environment's own rollout and rubric run with the rollout's OpenAI client;
the rubric's score is the reward; a rubric that raises makes the attempt infra_error.
TextArena: the game plays the other side (`reply`), one episode per attempt whose
tokens are what the policy sampled and what the game sent; the reward is the game's.
"""

import asyncio
import json

import openai
import pytest

from ac2_jax.envs.contract import EnvError, check_env, load_env
from ac2_jax.orchestration import LifecycleClient, run_rollout
from ac2_jax.recipes.common import error_lines, harness_factory
from tests.support.serving_helpers import served_random_model

vf = pytest.importorskip("verifiers", reason="the verifiers extra")
ta = pytest.importorskip("textarena", reason="the textarena extra")

from ac2_jax.orchestration.textarena_env import TextArenaEnv  # noqa: E402
from ac2_jax.orchestration.verifiers_env import VerifiersEnv  # noqa: E402

ADMIN = "adapter-admin"
SHORT = "Answer inside <answer></answer>."


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("adapters")
    with served_random_model(tmp, ADMIN, max_context=1024, max_batch=2) as (url, tok):
        yield dict(url=url, tok=tok)


def rollout(url, env, task, max_steps=1, max_tokens=12):
    make = harness_factory({"temperature": 1.0, "max_tokens": max_tokens, "seed": 3}, max_steps)

    async def go():
        lc = LifecycleClient(url, ADMIN)
        try:
            return await run_rollout(lc, env, task, make, "tiny", group_id="g")
        finally:
            await lc.aclose()

    return asyncio.run(go())


def _rg_env(**kw):
    return vf.ReasoningGymEnv(
        gym="chain_sum", num_train_examples=8, num_eval_examples=4, system_prompt=SHORT, **kw
    )


def _rubric_score(vf_env, row, text):
    """verifiers' own scoring of one completion (its init_state, then its rubric)."""
    from verifiers.clients import OpenAIChatCompletionsClient

    async def go():
        client = OpenAIChatCompletionsClient(
            openai.AsyncOpenAI(base_url="http://127.0.0.1:9/v1", api_key="unused")
        )
        state = await vf_env.init_state(row, client, "tiny", {})
        state["completion"] = [vf.AssistantMessage(content=text)]
        await vf_env.rubric.score_rollout(state)
        return state["reward"]

    return asyncio.run(go())


def test_verifiers_env_reward_is_its_rubrics_score(endpoint):
    env = check_env(VerifiersEnv(_rg_env()))
    task = env.sample_tasks(1, seed=0)[0]
    row = task.metadata["row"]
    entry = env.vf_env.rg_dataset[int(row["answer"])]
    # A known right and a wrong answer, scored by the env's own rubric (the watch on its
    # reward functions changes nothing), as reasoning-gym's verifier says.
    right = _rubric_score(env.vf_env, row, f"<answer>{entry['answer']}</answer>")
    wrong = _rubric_score(env.vf_env, row, "<answer>7</answer>")
    assert right == 1.0 and wrong == env.vf_env.rg_dataset.score_answer("7", entry) == 0.0
    # One attempt through the endpoint: the env's own rollout, its rubric's reward.
    trace, conv = rollout(endpoint["url"], env, task)
    assert trace.status == "finished", trace.metadata
    record = json.loads(conv.answer)
    assert trace.reward == record["reward"] == _rubric_score(
        env.vf_env, row, record["answer"] or ""
    )
    (episode,) = trace.episodes
    assert len(episode.completions) == 1
    assert episode.messages_at()[0] == env.initial_messages(task)
    text = endpoint["tok"].decode(episode.completions[0].output_ids)
    assert record["answer"] and text.startswith(record["answer"][:5])


def test_a_rubric_that_raises_is_an_infra_error_never_a_reward(endpoint):
    vf_env = _rg_env()

    def exploding_reward(completion, answer, **kwargs):
        raise RuntimeError("the judge is down")

    vf_env.rubric.add_reward_func(exploding_reward)
    env = VerifiersEnv(vf_env)
    task = env.sample_tasks(1, seed=1)[0]
    trace, conv = rollout(endpoint["url"], env, task)
    assert trace.status == "infra_error" and trace.reward is None
    error = trace.metadata["artifacts"]["error"]
    assert error.startswith("VerifiersError: ReasoningGymEnv's rubric failed: exploding_reward")
    assert "RuntimeError: the judge is down" in error
    lines = error_lines(1, [trace])
    assert lines[0] == "step 1: 1 of 1 attempts ended infra_error"


def test_a_raising_reward_in_a_rubric_group_is_an_infra_error(endpoint):
    """verifiers' multi-turn envs hold a RubricGroup (MultiTurnEnv, ToolEnv add their
    monitor rubrics with `add_rubric`): a reward function of a member rubric that raises
    is an infra_error too, never verifiers' 0; the range counts every member's weights."""
    vf_env = _rg_env()

    def exploding_reward(completion, answer, **kwargs):
        raise RuntimeError("the judge is down")

    vf_env.add_rubric(vf.Rubric(funcs=[exploding_reward], weights=[0.5]))
    assert isinstance(vf_env.rubric, vf.RubricGroup)
    env = VerifiersEnv(vf_env)
    assert env.reward_range == (0.0, sum(vf_env.rubric._get_reward_weights()))
    trace, _ = rollout(endpoint["url"], env, env.sample_tasks(1, seed=1)[0])
    assert trace.status == "infra_error" and trace.reward is None
    assert "exploding_reward raised RuntimeError" in trace.metadata["artifacts"]["error"]


def test_the_envs_own_max_turns_is_said_when_it_differs_from_max_steps(capsys):
    """verifiers' own `max_turns` bounds its turns, not rollout.max_steps: the adapter
    says so in one console line (once per env and max_steps) when the two differ."""
    env = VerifiersEnv(_rg_env())  # a SingleTurnEnv: max_turns=1
    task = env.sample_tasks(1, seed=0)[0]
    capsys.readouterr()  # datasets' progress bars
    for _ in range(3):
        env.make_harness(task, None, "tiny", max_steps=8)
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "[verifiers] ReasoningGymEnv: the environment's own max_turns=1 bounds each "
        "attempt's turns; rollout.max_steps=8 does not apply (set the environment's "
        "max_turns argument instead)"
    ]
    env.make_harness(task, None, "tiny", max_steps=1)  # the same: nothing to say
    assert capsys.readouterr().err == ""


def test_verifiers_bad_specs_are_one_line():
    for spec, says in [
        ("verifiers:ReasoningGymEn", "no verifiers environment 'ReasoningGymEn'; did you mean"),
        ("verifiers:", "names no environment"),
        ("verifiers:ReasoningGymEnv,gym", "'gym' is not key=value"),
    ]:
        with pytest.raises(EnvError) as e:
            load_env(spec)
        assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


def _play(game, seed, answers):
    """The game's own reward for these answers, played with textarena directly."""
    g = ta.make(env_id=game)
    g.reset(num_players=1, seed=seed)
    for a in answers:
        done, _ = g.step(a)
        if done:
            return g.close()[0][0]
    return None


def test_textarena_reward_is_the_games_own_score():
    env = check_env(load_env("textarena:GuessTheNumber-v0"))
    task = env.sample_tasks(1, seed=0)[0]
    seed = task.metadata["seed"]
    g = ta.make(env_id="GuessTheNumber-v0")
    g.reset(num_players=1, seed=seed)
    secret = g.state.game_state["game_number"]
    right = [f"[{secret}]"]
    wrong = [f"[{1 if secret != 1 else 2}]"] * 3  # repeating a wrong guess ends the game
    assert env.verify(task, json.dumps({"answers": right})) == _play(task.domain, seed, right) == 1
    got = env.verify(task, json.dumps({"answers": wrong}))
    assert got == _play(task.domain, seed, wrong) and got < 1
    assert env.verify(task, None) == -1.0  # nothing played: the game's loss


def test_textarena_game_is_one_episode_of_what_the_env_sent(endpoint):
    """Multi-turn path (c): every answer is replied to by the game until it ends; one
    append-only episode whose trained tokens are exactly the sampled ones and whose
    requests hold the game's replies as it sent them."""
    env = TextArenaEnv("GuessTheNumber-v0")
    task = env.sample_tasks(1, seed=2)[0]
    trace, conv = rollout(endpoint["url"], env, task, max_steps=12, max_tokens=6)
    assert trace.status == "finished", trace.metadata
    answers = [m["content"] for m in conv.messages if m["role"] == "assistant"]
    replies = [m["content"] for m in conv.messages if m["role"] == "user"][1:]
    assert len(answers) >= 2 and len(replies) == len(answers) - 1  # the last ends the game
    # The reward is the game's own for the answers the policy gave.
    assert trace.reward == _play(task.domain, task.metadata["seed"], answers)
    (episode,) = trace.episodes
    completions = episode.completions
    assert len(completions) == len(answers)
    for i, messages in enumerate(episode.messages_at()):
        # Request i: the task and every answer so far, each followed by the game's reply.
        assert messages == conv.messages[: len(env.initial_messages(task)) + 2 * i]
        assert [m["content"] for m in messages if m["role"] == "user"][1:] == replies[:i]
    assert [env.reply(task, conv.messages[: 2 + 2 * i + 1]) for i in range(len(answers))] == [
        *replies, None
    ]
    # Token-exact: append-only, the mask is exactly the sampled tokens.
    last = completions[-1]
    assert episode.token_ids == last.prompt_ids + last.output_ids
    sampled = [t for c in completions for t in c.output_ids]
    assert [t for t, m in zip(episode.token_ids, episode.loss_mask, strict=True) if m] == sampled
    tok = endpoint["tok"]
    between = tok.decode(completions[1].prompt_ids[len(completions[0].prompt_ids)
                                                   + len(completions[0].output_ids):])
    assert replies[0] in between


def test_textarena_bad_specs_are_one_line():
    for spec, says in [
        ("textarena:GuessTheNumbr-v0", "did you mean 'GuessTheNumber-v0'?"),
        ("textarena:", "names no game"),
    ]:
        with pytest.raises(EnvError) as e:
            load_env(spec)
        assert says in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_the_howto_commands_parse_and_build_their_envs(tmp_path):
    """docs/howto/existing-environments.md: every command is a valid launcher line
    whose env spec builds (running them is the full tier's job and
    docs/notes/2026-12-07-howto-environment-commands-timed.md's)."""
    import pathlib
    import re
    import shlex

    from ac2_jax.train import build

    doc = pathlib.Path(__file__).resolve().parents[2] / "docs/howto/existing-environments.md"
    blocks = re.findall(r"```bash\n(.*?)```", doc.read_text(), re.S)
    # The OpenEnv block (`openenv init`, then the launcher) needs the openenv extra:
    # tests/orchestration/test_adapter_openenv.py builds its env.
    blocks = [b for b in blocks if "--env=openenv:" not in b]
    assert len(blocks) == 5
    for block in blocks:
        argv = shlex.split(block.replace("\\\n", " "))
        assert argv[:3] == ["python", "-m", "ac2_jax.train"]
        argv = [a if not a.startswith("--workdir=") else f"--workdir={tmp_path}" for a in argv]
        entry, model, env, config = build(argv[3:])
        assert model == "tiny" and config.rl.steps >= 1
        check_env(load_env(env))


# FrozenLake 4x4, not slippery: right, right, down, down, down, right reaches the goal.
LAKE_PATH = ["2", "2", "1", "1", "1", "2"]


def test_gym_reward_is_the_envs_own_and_bad_specs_are_one_line():
    gym = pytest.importorskip("gymnasium", reason="the gymnasium extra")
    env = check_env(load_env("gym:FrozenLake-v1,is_slippery=false"))
    task = env.sample_tasks(1, seed=0)[0]
    assert task.prompt.startswith("[S]FFF\nFHFH")  # the agent's cell is marked

    def own(actions):
        g = gym.make("FrozenLake-v1", is_slippery=False)
        g.reset(seed=task.metadata["seed"])
        total = 0.0
        for a in actions:
            _, r, term, trunc, _ = g.step(a)
            total += r
            if term or trunc:
                break
        return total

    right = json.dumps({"answers": [f"Action: {a}" for a in LAKE_PATH]})
    into_hole = json.dumps({"answers": ["1", "1", "1"]})
    assert env.verify(task, right) == own([2, 2, 1, 1, 1, 2]) == 1.0
    assert env.verify(task, into_hole) == own([1, 1, 1]) == 0.0
    steps = env.initial_messages(task) + [{"role": "assistant", "content": "2"}]
    assert env.reply(task, steps).startswith("  (Right)\nS[F]FF")
    assert env.reply(task, steps[:-1] + [{"role": "assistant", "content": "nine"}]) is None
    for spec, says in [
        ("gym:FrozenLak-v1", "did you mean 'FrozenLake-v1'?"),
        ("gym:FrozenLake-v1,slippery=false", "unexpected keyword argument 'slippery'"),
        ("gym:", "names no environment"),
    ]:
        with pytest.raises(EnvError) as e:
            load_env(spec)
        assert says in str(e.value) and "\n" not in str(e.value), str(e.value)
