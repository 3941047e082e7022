"""TextArena (`pip install 'ac2_jax[textarena]'`): a single-player game, the game the other side.

`TextArenaEnv("GuessTheNumber-v0")` makes the game with `textarena.make` (its
default wrappers), resets it with the task's seed and asks its first
observation. The game plays the other side through `reply` (multi-turn path
(c), `orchestration.EnvUser`): after each answer of the agent the game is
rebuilt from the task's seed and every answer so far is replayed through
`step`, so `reply` is a pure function of the task and the conversation (a
recorded attempt replays turn for turn); the reply is what the game's
observation added since the agent's answer, None once the game is done. The
attempt is one episode, the agent's turns its trained tokens.

The reward is the game's own: `close()`'s reward for player 0 after replaying
the attempt's answers (the harness records them all as the attempt's answer).
A game the attempt left unfinished (the rollout's step limit came first)
scores the bottom of `reward_range`, the game's loss. Task ids are
`<game>-<split>-<seed>`: train seeds are even, eval seeds odd, so the splits
never share a game. Games for two or more players are refused (one line): the
adapter has no opponent to seat.
"""

from __future__ import annotations

import json
from typing import Any

from ac2_jax.envs.base import Env, Task
from ac2_jax.extras import require
from ac2_jax.orchestration._replay import episode_seeds, policy_answers
from ac2_jax.orchestration.default import DefaultOrchestrator

__all__ = ["TextArenaEnv", "TextArenaHarness", "textarena_env"]

EXTRA = "textarena"


def _ta():
    return require("textarena", EXTRA, what="the textarena env adapter")


class TextArenaEnv(Env):
    """One single-player TextArena game (module docstring)."""

    reward_range = (-1.0, 1.0)

    def __init__(self, game: str):
        ta = _ta()
        registry = ta.envs.registration.ENV_REGISTRY
        if game not in registry:
            import difflib

            close = difflib.get_close_matches(game, list(registry), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(
                f"unknown textarena game {game!r}{hint} ({len(registry)} registered: "
                "textarena.envs.registration.ENV_REGISTRY)"
            )
        self.game = game
        self.name = game
        try:
            probe = ta.make(env_id=game)
        except Exception as e:  # noqa: BLE001 - the library's own game fails to load
            raise ValueError(
                f"textarena game {game!r} failed to load in textarena "
                f"{getattr(ta, '__version__', '?')} ({type(e).__name__}: "
                f"{' '.join(str(e).split())[:200]})"
            ) from None
        try:
            probe.reset(num_players=1, seed=0)
        except Exception as e:  # noqa: BLE001 - a game that cannot seat one player
            raise ValueError(
                f"textarena game {game!r} does not play with one player ({type(e).__name__}: "
                f"{' '.join(str(e).split())[:200]}); the adapter plays single-player games"
            ) from None

    def _start(self, seed: int):
        env = _ta().make(env_id=self.game)
        env.reset(num_players=1, seed=seed)
        return env

    def sample_tasks(self, n: int, seed: int, split: str = "train") -> list[Task]:
        seeds = episode_seeds("TextArenaEnv", "textarena", self.game, split, seed, n)
        tasks = []
        for s in seeds:
            _, observation = self._start(s).get_observation()
            tasks.append(Task(
                task_id=f"{self.game}-{split}-{s}", prompt=observation, domain=self.game,
                metadata={"seed": s},
            ))  # fmt: skip
        return tasks

    def _replay(self, task: Task, answers: list[str]):
        """(env, done, the observation before the last answer) after playing `answers`."""
        env = self._start(int(task.metadata["seed"]))
        done, before = False, None
        for i, answer in enumerate(answers):
            if done:
                raise ValueError(
                    f"{task.task_id}: answer {i + 1} of {len(answers)} comes after the game ended"
                )
            before = env.get_observation()[1]
            done, _ = env.step(answer)
        return env, done, before

    def reply(self, task: Task, messages: list[dict[str, Any]]) -> str | None:
        """What the game's observation added after the agent's last answer (it echoes
        the move, then says what the game made of it); None once the game is done."""
        answers = policy_answers(messages)
        if not answers:
            return None
        env, done, _ = self._replay(task, answers)
        if done:
            return None
        _, observation = env.get_observation()
        _, previous = self._replay(task, answers[:-1])[0].get_observation()
        return observation[len(previous) :] if observation.startswith(previous) else observation

    def verify(self, task: Task, answer: str | None) -> float:
        """The game's reward for player 0 after the recorded answers (a JSON list, the
        harness's record); unfinished or no answer: the game's loss (-1)."""
        answers = [] if answer is None else json.loads(answer)["answers"]
        env, done, _ = self._replay(task, answers)
        if not done:
            return self.reward_range[0]
        rewards, _ = env.close()
        return float(rewards[0])

    def make_harness(
        self, task: Task, client, model_name: str, *, sampling=None, max_steps=8
    ) -> TextArenaHarness:
        """The harness the recipes use (`recipes.common.harness_factory`)."""
        return TextArenaHarness(
            self, task, client, model_name, sampling=sampling, max_steps=max_steps
        )


class TextArenaHarness(DefaultOrchestrator):
    """The tool loop, whose answer is every answer of the attempt (a JSON record), so
    that the verifier replays the whole game."""

    async def run(self, turn_input: str) -> None:
        await super().run(turn_input)
        self.trace.answer = json.dumps({"answers": policy_answers(self.trace.messages)})


def textarena_env(arg: str) -> TextArenaEnv:
    """The launcher's `--env=textarena:<game id>` (e.g. GuessTheNumber-v0)."""
    game = arg.strip()
    if not game:
        raise ValueError(
            "--env=textarena:<game id> names no game (e.g. textarena:GuessTheNumber-v0)"
        )
    return TextArenaEnv(game)
