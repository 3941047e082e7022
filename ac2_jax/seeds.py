"""Seeds: every seed the library derives, in one module.

Each is a pure function of its arguments, stable across runs, processes and machines
(no Python `hash`, no global RNG), so a resumed or repeated run draws the same tasks
and samples with the same seeds. The hashed ones share one rule, `hashed_seed`, with a
tag among the parts that keeps one use's seeds apart from another's.
"""

from __future__ import annotations

import hashlib

__all__ = [
    "hashed_seed",
    "domain_seed",
    "request_seed",
    "rl_attempt_seed",
    "refill_seed",
    "eval_attempt_seed",
]


def hashed_seed(*parts) -> int:
    """A seed derived from `parts` (ints, strings): sha256 of their ":"-joined text,
    first 8 bytes, as a non-negative 63-bit int. Stable across runs and machines;
    a tag among the parts ("refill", "domain-seed") keeps one use's seeds apart
    from another's."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def domain_seed(seed: int, domain: str) -> int:
    """A domain's seed in a `DomainMixer`: a fixed hash of (mixer seed, domain)."""
    return hashed_seed("domain-seed", seed, domain)


def request_seed(seed: int, scope: str, index: int) -> int:
    """The sampling seed of request `index` (0, 1, ...) of an attempt seeded `seed`.

    Samplers draw output token i of a seeded request from the seed and i alone
    (JaxSampler: fold_in(key(seed), i); SGLang's sampling_seed likewise), so
    requests sent with one seed share their noise position by position and an
    attempt's requests would come out right or wrong together. Each request of
    an attempt therefore gets its own seed: the first request of the top-level
    agent keeps the attempt's seed (a one-request attempt samples as before);
    every other is a hash of (seed, scope, index). `scope` names the
    orchestrator within the attempt ("" for the top level, "spawn0/spawn1"...
    for subagents), so subagents never reuse their parent's seeds whatever the
    order their requests interleave in. Returns an int in [0, 2**63), or
    `seed` itself for (scope "", index 0).
    """
    if not scope and index == 0:
        return seed
    return hashed_seed(seed, scope, index)


def rl_attempt_seed(seed: int, rl_step: int, task_id: str, attempt: int) -> int:
    """The sampling seed of one RL attempt: a fixed hash, stable across runs and
    resumes, different for every (step, task, attempt)."""
    return hashed_seed("rl-attempt", seed, rl_step, task_id, attempt)


def refill_seed(seed: int, rl_step: int, round: int) -> int:
    """The task seed of refill `round` (>= 1) of `rl_step`: a fixed hash, stable across runs."""
    return hashed_seed("refill", seed, rl_step, round)


def eval_attempt_seed(seed: int, task_index: int, attempt: int, k: int) -> int:
    """The sampling seed of attempt `attempt` (of `k`) of the `task_index`-th eval task."""
    return seed * 1_000_003 + task_index * k + attempt
