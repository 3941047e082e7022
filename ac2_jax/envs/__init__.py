"""Environments: tasks, tools (optionally sandboxed), verifiers, judges, domain mixing,
the contract a recipe checks an env against (`check_env`), and adapters for other
libraries' environments (`adapters`: `--env=reasoning_gym:<generator>`)."""

from ac2_jax._deprecation import deprecated_getattr
from ac2_jax.envs.adapters import ENV_ADAPTERS, ReasoningGymEnv
from ac2_jax.envs.base import AgentError, Env, Task, Tool, run_tool
from ac2_jax.envs.calculator import CalculatorEnv as CalculatorEnv
from ac2_jax.envs.calculator import ChainCalculatorEnv as ChainCalculatorEnv
from ac2_jax.envs.calculator import StepwiseCalculatorEnv as StepwiseCalculatorEnv
from ac2_jax.envs.calculator import chain_memo as chain_memo
from ac2_jax.envs.calculator import chain_policy as chain_policy
from ac2_jax.envs.calculator import demonstration as demonstration
from ac2_jax.envs.calculator import parse_chain_state as parse_chain_state
from ac2_jax.envs.calculator import safe_eval as safe_eval
from ac2_jax.envs.contract import EnvError, check_env, load_env
from ac2_jax.envs.guess import GuessEnv as GuessEnv
from ac2_jax.envs.guess import replay_replies as replay_replies
from ac2_jax.envs.judges import Judge, JudgedEnv, LLMJudge, RubricJudge, RuleJudge
from ac2_jax.envs.judges import JudgeUnavailable as JudgeUnavailable
from ac2_jax.envs.judges import parse_score_reply as parse_score_reply
from ac2_jax.envs.mixer import AdaptiveMix as AdaptiveMix
from ac2_jax.envs.mixer import DomainMixer
from ac2_jax.envs.sandbox import SandboxLimits, run_sandboxed

# Renamed or moved; resolve with a DeprecationWarning for one release.
DEPRECATED = {
    "hashed_seed": "ac2_jax.seeds:hashed_seed",
    "domain_seed": "ac2_jax.seeds:domain_seed",
}
__getattr__ = deprecated_getattr(__name__, DEPRECATED)

__all__ = [
    "Env",
    "Task",
    "Tool",
    "AgentError",
    "EnvError",
    "check_env",
    "load_env",
    "run_tool",
    "SandboxLimits",
    "run_sandboxed",
    "DomainMixer",
    "Judge",
    "JudgedEnv",
    "LLMJudge",
    "RubricJudge",
    "RuleJudge",
    "ENV_ADAPTERS",
    "ReasoningGymEnv",
]
