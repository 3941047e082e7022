"""Test fixtures: small, deterministic stand-ins for tests, notebooks and toy studies.

A tiny BPE tokenizer trained on a built-in corpus (no download), toy environments with
exact answers (calculators, a number-guessing game), a judge with a set error rate, a
scripted user and a collector that replays stored traces. Each is defined where the
library uses it (e.g. `ac2_jax.text.tiny_tokenizer`) and gathered here; the top layer,
so nothing in the library imports it.

    from ac2_jax.testing import CalculatorEnv, build_tiny_tokenizer
"""

from ac2_jax.envs.calculator import (
    CalculatorEnv,
    ChainCalculatorEnv,
    StepwiseCalculatorEnv,
    chain_policy,
    demonstration,
    last_integer,
)
from ac2_jax.envs.guess import GuessEnv
from ac2_jax.envs.judges import NoisyJudge
from ac2_jax.orchestration.base import ScriptedUser
from ac2_jax.text.tiny_tokenizer import build_tiny_tokenizer, tiny_corpus
from ac2_jax.training.rl.collectors import ReplayCollector

__all__ = [
    "build_tiny_tokenizer",
    "tiny_corpus",
    "CalculatorEnv",
    "StepwiseCalculatorEnv",
    "ChainCalculatorEnv",
    "chain_policy",
    "demonstration",
    "last_integer",
    "GuessEnv",
    "NoisyJudge",
    "ScriptedUser",
    "ReplayCollector",
]
