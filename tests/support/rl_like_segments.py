"""Segments with the two features an RL batch has, for the packers' tests.

The segments layer must not import `ac2_jax.training.rl` (its `rl_segment`), so its
tests build the same features here by name; the packers never read them.
"""

import numpy as np

from ac2_jax.segments import Segment


def rl_like_segment(tokens, mask, lp, *, task, advantage=0.0, **kw):
    """A segment carrying `sampler_logprobs` = lp and `advantages` = advantage per token."""
    n = len(tokens)
    return Segment(tokens, mask, task=task, features={
        "sampler_logprobs": np.asarray(lp, np.float32),
        "advantages": np.full(n, advantage, np.float32)}, **kw)
