"""Gymnasium-style text environments (`pip install 'ac2_jax[gymnasium]'`), trained unchanged.

`GymTextEnv("FrozenLake-v1", is_slippery=False)` makes the environment with
`gymnasium.make` (render_mode "ansi" when it has one) and plays it as a
multi-turn env: the task is a reset seed, the prompt is the first
observation as text (a `str` observation as it is, else the ansi render,
a coloured span marked with brackets, else `str(obs)`) and what the action space takes;
each answer of the agent is an action (a `Text` space: the answer itself; a
`Discrete(n)` space: the last integer of the answer), and the env's `reply`
is the next observation. `reply` rebuilds the environment from the task's
seed and replays every answer so far (a pure function of the task and the
conversation, so a recorded attempt replays); None once the episode is
terminated or truncated, or when an answer holds no valid action (the
episode then ends there: an invalid action is never sent to the env).

The reward is the environment's own: the sum of `step`'s rewards over the
attempt's answers (the harness records them all). Task ids are
`<env id>-<split>-<seed>`: train seeds even, eval seeds odd.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ac2_jax.envs.base import Env, Task
from ac2_jax.extras import require
from ac2_jax.orchestration._replay import episode_seeds, policy_answers
from ac2_jax.orchestration.default import DefaultOrchestrator

__all__ = ["GymHarness", "GymTextEnv", "gym_env"]

EXTRA = "gymnasium"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# A coloured span (e.g. FrozenLake's agent cell) keeps its mark as brackets.
_MARKED = re.compile(r"\x1b\[[0-9;]*[1-9][0-9;]*m([^\x1b]*)\x1b\[0m")


def _gym():
    return require("gymnasium", EXTRA, what="the gym env adapter")


class GymTextEnv(Env):
    """One Gymnasium environment as a multi-turn text env (module docstring).
    kwargs: `gymnasium.make`'s keyword arguments; reward_range: the rewards an attempt
    may sum to (the contract checks verify against it)."""

    def __init__(
        self,
        env_id: str,
        reward_range: tuple[float, float] = (-1e9, 1e9),
        **kwargs: Any,
    ):
        gym = _gym()
        if env_id not in gym.registry:
            import difflib

            close = difflib.get_close_matches(env_id, list(gym.registry), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"unknown gymnasium environment {env_id!r}{hint}")
        self.env_id, self.kwargs, self.name = env_id, dict(kwargs), env_id
        self.reward_range = reward_range
        try:
            probe = gym.make(env_id, **self.kwargs)
        except TypeError as e:  # a keyword the environment does not take
            raise ValueError(f"gymnasium {env_id!r}: {' '.join(str(e).split())}") from None
        modes = probe.metadata.get("render_modes") or []
        self._render = {"render_mode": "ansi"} if "ansi" in modes else {}
        space = probe.action_space
        if isinstance(space, gym.spaces.Discrete):
            self.n_actions: int | None = int(space.n)
            self.how = (
                f"Answer with one action: an integer from {int(space.start)} to "
                f"{int(space.start) + int(space.n) - 1}."
            )
        elif isinstance(space, gym.spaces.Text):
            self.n_actions = None
            self.how = "Answer with your action as text."
        else:
            raise ValueError(
                f"gymnasium {env_id!r}: action space {space} is neither Text nor Discrete; "
                "the adapter plays text or numbered actions"
            )
        self.start = int(getattr(space, "start", 0))
        probe.close()

    def _make(self):
        return _gym().make(self.env_id, **self.kwargs, **self._render)

    def _text(self, env, obs) -> str:
        if isinstance(obs, str):
            return obs
        if getattr(env, "render_mode", None) == "ansi":
            return _ANSI.sub("", _MARKED.sub(r"[\1]", str(env.render()))).strip("\n")
        return str(obs)

    def action_of(self, answer: str) -> Any:
        """The action an answer names, or None when it names no valid one."""
        if self.n_actions is None:
            return answer
        found = re.findall(r"-?\d+", answer)
        if not found:
            return None
        action = int(found[-1])
        return action if self.start <= action < self.start + self.n_actions else None

    def sample_tasks(self, n: int, seed: int, split: str = "train") -> list[Task]:
        seeds = episode_seeds("GymTextEnv", "gymnasium", self.env_id, split, seed, n)
        tasks = []
        for s in seeds:
            env = self._make()
            obs, _ = env.reset(seed=s)
            tasks.append(Task(
                task_id=f"{self.env_id}-{split}-{s}",
                prompt=f"{self._text(env, obs)}\n{self.how}", domain=self.env_id,
                metadata={"seed": s},
            ))  # fmt: skip
            env.close()
        return tasks

    def play(self, task: Task, answers: list[str]) -> tuple[float, bool, str | None]:
        """(summed reward, whether the episode ended, the last observation's text) after
        stepping the answers' actions from the task's seed; an answer without a valid
        action ends the episode there."""
        env = self._make()
        obs, _ = env.reset(seed=int(task.metadata["seed"]))
        total, text = 0.0, self._text(env, obs)
        try:
            for i, answer in enumerate(answers):
                action = self.action_of(answer)
                if action is None:
                    return total, True, None
                obs, reward, terminated, truncated, _ = env.step(action)
                total += float(reward)
                text = self._text(env, obs)
                if terminated or truncated:
                    if i != len(answers) - 1:
                        raise ValueError(
                            f"{task.task_id}: answer {i + 2} comes after the episode ended"
                        )
                    return total, True, text
            return total, False, text
        finally:
            env.close()

    def reply(self, task: Task, messages: list[dict[str, Any]]) -> str | None:
        """The next observation after the agent's last action; None once the episode ended."""
        answers = policy_answers(messages)
        if not answers:
            return None
        _, done, text = self.play(task, answers)
        return None if done else f"{text}\n{self.how}"

    def verify(self, task: Task, answer: str | None) -> float:
        """The environment's summed reward over the recorded answers (a JSON record)."""
        answers = [] if answer is None else json.loads(answer)["answers"]
        return self.play(task, answers)[0]

    def make_harness(
        self, task: Task, client, model_name: str, *, sampling=None, max_steps=8
    ) -> GymHarness:
        """The harness the recipes use (`recipes.common.harness_factory`)."""
        return GymHarness(self, task, client, model_name, sampling=sampling, max_steps=max_steps)


class GymHarness(DefaultOrchestrator):
    """The tool loop, whose answer is every answer of the attempt (a JSON record)."""

    async def run(self, turn_input: str) -> None:
        await super().run(turn_input)
        self.trace.answer = json.dumps({"answers": policy_answers(self.trace.messages)})


def gym_env(arg: str) -> GymTextEnv:
    """The launcher's `--env=gym:<env id>[,key=value...]` (values JSON, else strings)."""
    ident, *pairs = [p.strip() for p in arg.split(",")]
    if not ident:
        raise ValueError(
            "--env=gym:<env id>[,key=value...] names no environment (e.g. gym:FrozenLake-v1)"
        )
    kwargs: dict[str, Any] = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key:
            raise ValueError(f"--env=gym:{arg}: {pair!r} is not key=value")
        try:
            kwargs[key.strip()] = json.loads(value.strip())
        except json.JSONDecodeError:
            kwargs[key.strip()] = value.strip()
    return GymTextEnv(ident, **kwargs)
