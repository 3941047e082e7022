"""A multi-turn env: guess a secret number, told "higher" or "lower" after each guess.

The env plays the user (`reply`): every answer of the agent gets a reply until the
guess is right or the guesses run out, so one attempt is one append-only episode of
several requests, whatever the model. `reply` is a pure function of the task and the
conversation, so a recorded attempt replays turn for turn (`replay_replies`). The
verifier grades the last guess; the hint (for distillation) names the secret; the
demonstration is a binary search.
"""

from __future__ import annotations

import random
from typing import Any

from ac2_jax.envs.base import Env, Task
from ac2_jax.envs.calculator import last_integer

__all__ = ["GuessEnv", "replay_replies"]


def _is_answer(message: dict[str, Any]) -> bool:
    """An assistant turn that ends a request's work (no tool call): what an env replies to."""
    return message.get("role") == "assistant" and not message.get("tool_calls")


class GuessEnv(Env):
    """Secret numbers from 1 to `high` (drawn per task from `highs`), `max_guesses` each
    (enough for a binary search). Reward 1 when the last guess is the secret, else 0."""

    name = "guess"
    system_prompt = "Play the guessing game. Reply with one whole number each turn."

    def __init__(self, highs: tuple[int, ...] = (7, 15), max_guesses: int = 4):
        if not highs or min(highs) < 2 or max(highs) >= 2**max_guesses:
            raise ValueError(
                f"GuessEnv: highs {highs} must be >= 2 and below 2**max_guesses "
                f"= {2**max_guesses}, so that a binary search always wins"
            )
        self.highs, self.max_guesses = tuple(highs), max_guesses

    def sample_tasks(self, n: int, seed: int, split: str = "train") -> list[Task]:
        # Train and eval take disjoint (high, secret) pairs: the parity of secret + high.
        want = 0 if split == "train" else 1
        space = [(h, s) for h in self.highs for s in range(1, h + 1) if (h + s) % 2 == want]
        rng = random.Random(f"{self.name}:{split}:{seed}")
        tasks = []
        for i in range(n):
            high, secret = space[rng.randrange(len(space))]
            tasks.append(Task(
                task_id=f"{self.name}-{split}-{seed}-{i}",
                prompt=(f"I am thinking of a whole number from 1 to {high}. Guess it; after "
                        f"each guess I say higher or lower. You have {self.max_guesses} "
                        "guesses."),
                answer=secret, domain=self.name,
                metadata={"high": high, "max_guesses": self.max_guesses},
            ))  # fmt: skip
        return tasks

    def reply(self, task: Task, messages: list[dict[str, Any]]) -> str | None:
        """The reply to the agent's last answer: None when it is right or the guesses are
        spent, else "Higher." / "Lower." / a request for one number."""
        answers = [m for m in messages if _is_answer(m)]
        if not answers:
            return None
        guess = last_integer(answers[-1].get("content"))
        if guess == task.answer or len(answers) >= task.metadata["max_guesses"]:
            return None
        high = task.metadata["high"]
        if guess is None or not 1 <= guess <= high:
            return f"Reply with one whole number from 1 to {high}."
        return "Higher." if guess < task.answer else "Lower."

    def verify(self, task: Task, answer: str | None) -> float:
        return float(last_integer(answer) == task.answer)

    def reference_answer(self, task: Task) -> str:
        return str(task.answer)

    def hint(self, task: Task) -> str:
        return f"The secret number is {task.answer}."

    def demonstration(self, task: Task) -> list[dict[str, Any]]:
        """A binary search to the secret, with the env's own replies."""
        msgs = self.initial_messages(task)
        lo, hi = 1, task.metadata["high"]
        while True:
            guess = (lo + hi) // 2
            msgs.append({"role": "assistant", "content": str(guess)})
            reply = self.reply(task, msgs)
            if reply is None:
                return msgs
            msgs.append({"role": "user", "content": reply})
            lo, hi = (guess + 1, hi) if guess < task.answer else (lo, guess - 1)


def replay_replies(env: Env, task: Task, messages: list[dict[str, Any]]) -> list[str | None]:
    """The env's reply after each answer of a recorded conversation, recomputed from the
    conversation up to that answer: equal to the recorded user turns that follow each
    answer (then None) when the attempt replays."""
    reply = getattr(env, "reply", None)
    if reply is None:
        raise ValueError(f"replay_replies: {type(env).__name__} has no reply (a single-turn env)")
    out = []
    for i, m in enumerate(messages):
        if _is_answer(m):
            out.append(reply(task, messages[: i + 1]))
    return out
