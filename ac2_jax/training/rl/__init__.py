"""Task-level RL: which traces train (`data`), traces -> packed batch (`batching`),
collectors (`collectors`), the trainer (`trainer`), and the driver split into collector
and learner processes (`split`)."""

from ac2_jax._deprecation import deprecated_getattr
from ac2_jax.training.rl.advantages import ADVANTAGE_ESTIMATORS, AdvantageEstimator
from ac2_jax.training.rl.advantages import DrGRPOAdvantage as DrGRPOAdvantage
from ac2_jax.training.rl.advantages import GRPOAdvantage as GRPOAdvantage
from ac2_jax.training.rl.advantages import ReinforceAdvantage as ReinforceAdvantage
from ac2_jax.training.rl.advantages import ReinforcePPAdvantage as ReinforcePPAdvantage
from ac2_jax.training.rl.advantages import RLOOAdvantage as RLOOAdvantage
from ac2_jax.training.rl.batching import batch_segments as batch_segments
from ac2_jax.training.rl.batching import build_batch, pack_rl_batch
from ac2_jax.training.rl.branches import branch_groups as branch_groups
from ac2_jax.training.rl.branches import continued_path as continued_path
from ac2_jax.training.rl.branches import recorded_choices as recorded_choices
from ac2_jax.training.rl.branches import unchosen_branch_episodes as unchosen_branch_episodes
from ac2_jax.training.rl.collectors import Collector, EndpointCollector
from ac2_jax.training.rl.collectors import ReplayCollector as ReplayCollector
from ac2_jax.training.rl.credit import CREDITS, TURN_REWARDS
from ac2_jax.training.rl.data import BatchConfig, OverlongShaping
from ac2_jax.training.rl.data import MoEConfig as MoEConfig
from ac2_jax.training.rl.data import trace_advantages as trace_advantages
from ac2_jax.training.rl.features import ADVANTAGES as ADVANTAGES
from ac2_jax.training.rl.features import RL_FEATURES as RL_FEATURES
from ac2_jax.training.rl.features import carries_signal as carries_signal
from ac2_jax.training.rl.features import rl_segment as rl_segment
from ac2_jax.training.rl.features import with_advantage as with_advantage
from ac2_jax.training.rl.metrics import trace_agent_metrics
from ac2_jax.training.rl.objectives import CISPOLoss as CISPOLoss
from ac2_jax.training.rl.objectives import DAPOLoss as DAPOLoss
from ac2_jax.training.rl.objectives import DrGRPOLoss as DrGRPOLoss
from ac2_jax.training.rl.objectives import GRPOLoss as GRPOLoss
from ac2_jax.training.rl.objectives import GSPOLoss as GSPOLoss
from ac2_jax.training.rl.split import StoreCollector, run_collector, run_learner
from ac2_jax.training.rl.split import tell_endpoint as tell_endpoint
from ac2_jax.training.rl.trainer import RLConfig, RLTrainer

# Renamed or moved; resolve with a DeprecationWarning for one release.
DEPRECATED = {
    "attempt_sampling_seed": "ac2_jax.seeds:rl_attempt_seed",
    "refill_seed": "ac2_jax.seeds:refill_seed",
}
__getattr__ = deprecated_getattr(__name__, DEPRECATED)

__all__ = [
    "RLConfig",
    "RLTrainer",
    "BatchConfig",
    "OverlongShaping",
    "ADVANTAGE_ESTIMATORS",
    "AdvantageEstimator",
    "CREDITS",
    "TURN_REWARDS",
    "Collector",
    "EndpointCollector",
    "StoreCollector",
    "run_collector",
    "run_learner",
    "build_batch",
    "pack_rl_batch",
    "trace_agent_metrics",
]
