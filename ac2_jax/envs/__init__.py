"""Environments: tasks, tools (optionally sandboxed), verifiers, judges, domain mixing,
the contract a recipe checks an env against (`check_env`), and adapters for other
libraries' environments (`adapters`: `--env=reasoning_gym:<generator>`)."""

from ac2_jax.envs.adapters import (
    ENV_ADAPTERS,
    MIX_PRESETS,
    ReasoningGymEnv,
    adapter_of,
    reasoning_gym_env,
    verifier_audit,
)
from ac2_jax.envs.base import (
    AgentError,
    Env,
    Task,
    Tool,
    hashed_seed,
    run_tool,
    set_tool_threads,
    tool_executor,
)
from ac2_jax.envs.calculator import (
    CalculatorEnv,
    ChainCalculatorEnv,
    StepwiseCalculatorEnv,
    chain_memo,
    chain_policy,
    demonstration,
    last_integer,
    parse_chain_state,
    safe_eval,
)
from ac2_jax.envs.contract import EnvError, check_env, load_env, needs_of
from ac2_jax.envs.guess import GuessEnv, replay_replies
from ac2_jax.envs.judges import (
    Judge,
    JudgeError,
    JudgeExample,
    LLMJudge,
    NoisyJudge,
    RuleJudge,
    hint_keywords,
    parse_judge_reply,
)
from ac2_jax.envs.mixer import AdaptiveMix, DomainMixer, difficulty_factor, domain_seed
from ac2_jax.envs.sandbox import SandboxLimits, check_sandboxable, run_sandboxed

__all__ = [
    "ENV_ADAPTERS",
    "MIX_PRESETS",
    "AdaptiveMix",
    "AgentError",
    "CalculatorEnv",
    "ChainCalculatorEnv",
    "DomainMixer",
    "Env",
    "EnvError",
    "GuessEnv",
    "Judge",
    "JudgeError",
    "JudgeExample",
    "LLMJudge",
    "NoisyJudge",
    "ReasoningGymEnv",
    "RuleJudge",
    "SandboxLimits",
    "StepwiseCalculatorEnv",
    "Task",
    "Tool",
    "adapter_of",
    "chain_memo",
    "chain_policy",
    "check_env",
    "check_sandboxable",
    "demonstration",
    "difficulty_factor",
    "domain_seed",
    "hashed_seed",
    "hint_keywords",
    "last_integer",
    "load_env",
    "needs_of",
    "parse_chain_state",
    "parse_judge_reply",
    "reasoning_gym_env",
    "replay_replies",
    "run_sandboxed",
    "run_tool",
    "safe_eval",
    "set_tool_threads",
    "tool_executor",
    "verifier_audit",
]
