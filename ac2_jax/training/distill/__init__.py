"""Self-distillation (OPSD, RMSD) and on-policy distillation from a teacher model (`teacher`):
hinted teacher pairs (`data`), on-policy sources, the trainer."""

from ac2_jax.training.distill.data import DistillExample, HintConfig
from ac2_jax.training.distill.data import make_example as make_example
from ac2_jax.training.distill.data import pack_pairs as pack_pairs
from ac2_jax.training.distill.loss import DistillLoss, divergence
from ac2_jax.training.distill.loss import distill_objective as distill_objective
from ac2_jax.training.distill.loss import relevance_scores as relevance_scores
from ac2_jax.training.distill.loss import teacher_extras as teacher_extras
from ac2_jax.training.distill.loss import teacher_logits as teacher_logits
from ac2_jax.training.distill.sources import (
    HintTask,
    PromptCache,
    SampleConfig,
    aresample_examples,
    arollout_and_grade,
    asample,
)
from ac2_jax.training.distill.sources import publish_policy as publish_policy  # deprecated
from ac2_jax.training.distill.teacher import TeacherModel
from ac2_jax.training.distill.teacher import check_vocabulary as check_vocabulary
from ac2_jax.training.distill.traces import examples_from_traces
from ac2_jax.training.distill.trainer import DistillConfig, SelfDistiller

__all__ = [
    "DistillConfig",
    "SelfDistiller",
    "DistillExample",
    "DistillLoss",
    "HintConfig",
    "HintTask",
    "SampleConfig",
    "PromptCache",
    "TeacherModel",
    "examples_from_traces",
    "divergence",
    "asample",
    "arollout_and_grade",
    "aresample_examples",
]
