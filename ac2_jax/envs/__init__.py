"""Environments: tasks, tools, verifiers, domain mixing."""

from ac2_jax.envs.base import AgentError, Env, Task, Tool, run_tool
from ac2_jax.envs.calculator import CalculatorEnv, StepwiseCalculatorEnv, demonstration, safe_eval
from ac2_jax.envs.mixer import DomainMixer

__all__ = ["AgentError", "CalculatorEnv", "DomainMixer", "Env", "StepwiseCalculatorEnv", "Task",
           "Tool", "demonstration", "run_tool", "safe_eval"]
