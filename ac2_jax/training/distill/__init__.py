"""Self-distillation (OPSD, RMSD) and on-policy distillation from a teacher model (`teacher`):
hinted teacher pairs (`data`), on-policy sources, the trainer."""

from ac2_jax.training.distill.data import (
    DistillExample,
    HintConfig,
    PairedBatch,
    fit_examples,
    insert_hint,
    make_example,
    pack_pairs,
    sft_segments,
)
from ac2_jax.training.distill.loss import (
    DistillLoss,
    distill_objective,
    divergence,
    relevance_scores,
    teacher_extras,
    teacher_hidden,
    teacher_logits,
)
from ac2_jax.training.distill.sources import (
    Graded,
    HintTask,
    PromptCache,
    SampleConfig,
    aresample_examples,
    arollout_and_grade,
    asample,
    publish_policy,
    resample_examples,
    rollout_and_grade,
    sample,
)
from ac2_jax.training.distill.teacher import TeacherModel, check_vocabulary, vocabulary_mismatch
from ac2_jax.training.distill.traces import examples_from_traces
from ac2_jax.training.distill.trainer import DistillConfig, Relevance, SelfDistiller

__all__ = [
    "DistillConfig",
    "DistillExample",
    "DistillLoss",
    "Graded",
    "HintConfig",
    "HintTask",
    "PairedBatch",
    "PromptCache",
    "Relevance",
    "SampleConfig",
    "SelfDistiller",
    "TeacherModel",
    "aresample_examples",
    "check_vocabulary",
    "arollout_and_grade",
    "asample",
    "distill_objective",
    "divergence",
    "examples_from_traces",
    "fit_examples",
    "insert_hint",
    "make_example",
    "pack_pairs",
    "publish_policy",
    "resample_examples",
    "relevance_scores",
    "rollout_and_grade",
    "sample",
    "sft_segments",
    "teacher_extras",
    "teacher_hidden",
    "teacher_logits",
    "vocabulary_mismatch",
]
