"""Recipes: train your model on your environment, from Python or the launcher.

    from ac2_jax import recipes
    recipes.rl("path/to/hf_model", "my_pkg.envs:MyEnv", recipes.RLRecipeConfig())
    recipes.sft(model, env, recipes.SFTRecipeConfig())
    recipes.distill(model, env, recipes.DistillRecipeConfig())
    recipes.eval_model(model, env, recipes.EvalRecipeConfig())  # held-out, with CIs

    python -m ac2_jax.train --recipe=rl --env=my_pkg.envs:MyEnv --model=path/to/hf_model \
        --config=my_config.py:variant --config.rl.optimizer.learning_rate=5e-4

A model is an HF directory, a preset name (`MODELS`: "tiny") or a (model,
tokenizer) pair; an env is an `Env`, a factory, or an import path
(`ac2_jax.envs.contract`: what each recipe needs of it).
"""

from collections.abc import Callable
from typing import Any

from ac2_jax.recipes._distill import adistill, distill
from ac2_jax.recipes._rl import arl, rl
from ac2_jax.recipes._sft import sft
from ac2_jax.recipes.common import MODELS, Progress, load_model
from ac2_jax.recipes.config import (
    DistillRecipeConfig,
    MeshConfig,
    PathsConfig,
    RLRecipeConfig,
    RolloutConfig,
    SamplerConfig,
    SFTRecipeConfig,
)
from ac2_jax.recipes.config import EvalConfig as EvalConfig
from ac2_jax.recipes.evaluate import EvalRecipeConfig, aeval_model, eval_model
from ac2_jax.registry import Registry

# Recipe name -> (its config class, its entry point): `python -m ac2_jax.train --recipe=NAME`.
# A new recipe registers its pair from its own module: RECIPES.register("mine")((Cfg, fn)).
RECIPES: Registry[tuple[type, Callable[..., Any]]] = Registry("recipe")
RECIPES.register("rl")((RLRecipeConfig, rl))
RECIPES.register("sft")((SFTRecipeConfig, sft))
RECIPES.register("distill")((DistillRecipeConfig, distill))
RECIPES.register("eval")((EvalRecipeConfig, eval_model))  # no training: held-out eval, CIs

__all__ = [
    "MODELS",
    "RECIPES",
    "RLRecipeConfig",
    "SFTRecipeConfig",
    "DistillRecipeConfig",
    "EvalRecipeConfig",
    "SamplerConfig",
    "RolloutConfig",
    "PathsConfig",
    "MeshConfig",
    "Progress",
    "load_model",
    "arl",
    "rl",
    "sft",
    "adistill",
    "distill",
    "aeval_model",
    "eval_model",
]
