"""The advantage estimator's interface and registry (`rl.batch.advantage.kind`)."""

from __future__ import annotations

import abc
import collections
from collections.abc import Sequence

import numpy as np

from ac2_jax.registry import Registry

# Advantage estimators by name: `rl.batch.advantage = dict(kind="rloo")`; a new one is
# a subclass of `AdvantageEstimator` registered from its own module.
ADVANTAGE_ESTIMATORS: Registry[type] = Registry("advantage estimator")


class AdvantageEstimator(abc.ABC):
    """Rewards of the kept attempts -> one advantage each (host-side, float64).

    `__call__(rewards [n] float64, groups [n] group names, normalize_std,
    std_ddof, eps) -> [n] float64`. A group is a problem's attempts
    (`data.group_name`). Estimators with a group baseline give exactly 0 to a
    group whose rewards are all equal or that has one attempt (the exact
    comparison `data.informative_groups` makes, never fp arithmetic); the
    counters (`BatchStats.zero_advantage_groups`) count the groups whose
    advantages are all 0, whatever the estimator. `check(config)` refuses a
    `BatchConfig` setting the estimator cannot honour, by name.
    """

    __registry__ = ADVANTAGE_ESTIMATORS
    __default_kind__ = "grpo"

    def check(self, config) -> None:
        """Raises ValueError for a BatchConfig setting this estimator ignores."""
        name = ADVANTAGE_ESTIMATORS.name_of(self)
        if config.normalize_std:
            raise ValueError(
                f"rl.batch.normalize_std=True divides GRPO's group advantages by their std; "
                f"the advantage kind {name!r} has no such step: set normalize_std=False "
                "(or advantage kind 'grpo')"
            )
        if config.std_ddof != 0:
            raise ValueError(
                f"rl.batch.std_ddof={config.std_ddof} picks the sample std of GRPO's "
                f"normalize_std; the advantage kind {name!r} takes no such std: leave "
                "std_ddof at 0 (or advantage kind 'grpo')"
            )

    @abc.abstractmethod
    def __call__(
        self,
        rewards: np.ndarray,
        groups: Sequence[str],
        *,
        normalize_std: bool = False,
        std_ddof: int = 0,
        eps: float = 1e-6,
    ) -> np.ndarray: ...


def group_members(groups: Sequence[str]) -> dict[str, np.ndarray]:
    """Group name -> the indices of its members, in order."""
    members: dict[str, list[int]] = collections.defaultdict(list)
    for i, g in enumerate(groups):
        members[g].append(i)
    return {g: np.asarray(idx) for g, idx in members.items()}


def spread(r: np.ndarray) -> bool:
    """At least two values that differ (exact comparison)."""
    return len(r) >= 2 and bool(r.max() != r.min())
