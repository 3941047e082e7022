"""Supervised fine-tuning on demonstrations (whole tasks per batch)."""

from ac2_jax.training.sft.demos import demo_segment
from ac2_jax.training.sft.trainer import SFTConfig, SFTData, SFTResult, run_sft

__all__ = [
    "SFTConfig",
    "SFTData",
    "SFTResult",
    "demo_segment",
    "run_sft",
]
