"""The RL features a segment carries into the packed batch.

The packers (`ac2_jax.segments`) carry named per-token features without
reading them; RL adds three. `PolicyGradientLoss` reads the first two:

    SAMPLER_LOGPROBS  the log-prob the sampler drew each token with (recorded
                      in the trace; `segments_from_trace` puts it there), under
                      the policy version that drew it
    ADVANTAGES        the task-level advantage, the same on every token of a
                      segment (`with_advantage`)
    POLICY_VERSION    int32: the policy version that sampled each token
                      (`Completion.token_versions`; a generation that spans an
                      in-flight weight update has several), for per-token
                      staleness (`BatchConfig.stale_unit`)

    seg = rl_segment(tokens, mask, sampler_logprobs, task="t0", advantage=0.5)
    batch = pack_segments([seg], seq_len=64)
    batch.features[ADVANTAGES]            # [rows, seq_len], aligned with targets
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ac2_jax.segments import POLICY_VERSION, SAMPLER_LOGPROBS, Segment
from ac2_jax.training.core.objectives import ADVANTAGES

# Name -> dtype of the features every RL batch has (an empty share has them too).
RL_FEATURES = {
    ADVANTAGES: np.dtype(np.float32),
    SAMPLER_LOGPROBS: np.dtype(np.float32),
    POLICY_VERSION: np.dtype(np.int32),
}


def with_advantage(segment: Segment, advantage: float) -> Segment:
    """`segment` with `advantage` on every token (feature `ADVANTAGES`)."""
    return segment.with_features(
        **{ADVANTAGES: np.full(len(segment), float(advantage), np.float32)}
    )


def rl_segment(
    tokens: Sequence[int] | np.ndarray,
    loss_mask: Sequence[float] | np.ndarray,
    sampler_logprobs: Sequence[float] | np.ndarray,
    *,
    task: str,
    advantage: float = 0.0,
    policy_versions: Sequence[int] | np.ndarray | None = None,
    **kwargs: Any,
) -> Segment:
    """A segment with the RL features (`Segment`'s other fields by keyword);
    policy_versions None: version 0 on every token."""
    versions = np.zeros(len(tokens), np.int32) if policy_versions is None else policy_versions
    seg = Segment(
        np.asarray(tokens, np.int32),
        np.asarray(loss_mask, np.float32),
        task=task,
        features={
            SAMPLER_LOGPROBS: np.asarray(sampler_logprobs, np.float32),
            POLICY_VERSION: np.asarray(versions, np.int32),
        },
        **kwargs,
    )
    return with_advantage(seg, advantage)


def carries_signal(segment: Segment) -> bool:
    """True if some trained token of `segment` has a non-zero advantage."""
    adv = segment.features.get(ADVANTAGES)
    return adv is not None and bool(np.any(adv[segment.loss_mask > 0] != 0))
