"""Shared by the replayed multi-turn adapters (gym_env, textarena_env, openenv_env):
an episode is replayed from its task's seed, so `reply` is a pure function of the
answers so far and recorded attempts replay."""

from __future__ import annotations

import random
from typing import Any

from ac2_jax.seeds import hashed_seed


def episode_seeds(owner: str, kind: str, name: str, split: str, seed: int, n: int) -> list[int]:
    """`n` distinct episode seeds for `split`, deterministic in (kind, name, split, seed):
    even for "train", odd for "eval", so the two splits never share an episode. `owner`
    names the env class in the error for any other split."""
    if split not in ("train", "eval"):
        raise ValueError(f"{owner}: split must be 'train' or 'eval', got {split!r}")
    rng = random.Random(hashed_seed(kind, name, split, seed))
    parity = 0 if split == "train" else 1
    seeds: list[int] = []
    while len(seeds) < n:
        s = 2 * rng.randrange(2**30) + parity
        if s not in seeds:
            seeds.append(s)
    return seeds


def policy_answers(messages: list[dict[str, Any]]) -> list[str]:
    """The policy's answers so far: the text of each assistant turn without tool calls."""
    return [
        str(m.get("content") or "")
        for m in messages
        if m.get("role") == "assistant" and not m.get("tool_calls")
    ]
