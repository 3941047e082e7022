"""GuessEnv (ac2_jax/envs/guess.py): a multi-turn env that plays the user."""

import pytest

from ac2_jax.envs import EnvError, GuessEnv, Task, check_env, replay_replies


def _ask(env, task, *guesses):
    msgs = env.initial_messages(task)
    replies = []
    for g in guesses:
        msgs.append({"role": "assistant", "content": g})
        replies.append(env.reply(task, msgs))
        msgs.append({"role": "user", "content": replies[-1]})
    return replies


def test_the_env_meets_the_contract_of_every_recipe_with_disjoint_splits():
    env = GuessEnv()
    for recipe in ("rl", "sft", "distill"):
        assert check_env(env, recipe) is env
    train = {(t.metadata["high"], t.answer) for t in env.sample_tasks(200, 0)}
    evals = {(t.metadata["high"], t.answer) for t in env.sample_tasks(200, 0, "eval")}
    assert train and evals and not train & evals
    assert env.sample_tasks(5, 3) == env.sample_tasks(5, 3)


def test_replies_say_higher_lower_or_ask_for_a_number_until_right_or_spent():
    env = GuessEnv(highs=(15,), max_guesses=4)
    task = Task("t", "p", answer=9, metadata={"high": 15, "max_guesses": 4})
    assert _ask(env, task, "4", "I think 12", "zero", "9") == [
        "Higher.", "Lower.", "Reply with one whole number from 1 to 15.", None]
    assert _ask(env, task, "9") == [None]  # right: the game ends
    assert _ask(env, task, "1", "2", "3", "4") == ["Higher."] * 3 + [None]  # spent
    assert _ask(env, task, "99")[0] == "Reply with one whole number from 1 to 15."
    assert env.verify(task, "9") == 1.0 and env.verify(task, "4") == 0.0
    assert env.verify(task, None) == 0.0 and env.hint(task) == "The secret number is 9."


def test_the_demonstration_is_a_binary_search_that_wins_and_replays():
    env = GuessEnv()
    for task in env.sample_tasks(40, 1):
        chat = env.demonstration(task)
        answers = [m["content"] for m in chat if m["role"] == "assistant"]
        assert int(answers[-1]) == task.answer and len(answers) <= env.max_guesses
        users = [m["content"] for m in chat if m["role"] == "user"][1:]
        assert replay_replies(env, task, chat) == [*users, None]


def test_bad_settings_and_a_broken_reply_are_refused_by_name():
    with pytest.raises(ValueError, match="below 2\\*\\*max_guesses"):
        GuessEnv(highs=(16,), max_guesses=4)

    class Broken(GuessEnv):
        def reply(self, task, messages):
            return 3

    with pytest.raises(EnvError, match="must give a str or None"):
        check_env(Broken())
