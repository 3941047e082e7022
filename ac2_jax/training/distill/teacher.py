"""A teacher model for on-policy distillation: another model of the student's vocabulary.

On-policy distillation from a different (usually larger) model (OPD: Agarwal et
al. 2023, GKD, arXiv:2306.13649; Thinking Machines' "on-policy distillation",
2025): the student samples, the teacher scores every token of the student's
response, and the per-token divergence (reverse KL by default) is the signal.

`TeacherModel.from_model(model)` splits a loaded model into (graphdef, params,
rest): frozen (never in the optimizer, never checkpointed: it is loaded again
from its spec), optionally stored in bfloat16 (`dtype`). It is a pytree whose
graphdef is static, so it enters the train step as the step's `teacher`
argument (`SelfDistiller` passes it; `TrainStep` lets it place itself on the
step's mesh, `place`), and `DistillLoss` runs it inside the step on the teacher
rows of the packed batch (`teacher_extras`) with its own graphdef: its hidden
states are gathered into the student's layout [R, L, D_teacher] and projected by
its own head, chunk by chunk like the student's (no [R, L, V] logits, no HTTP
round trip, no host copy of teacher log-probs).

The vocabulary contract (`check_vocabulary`, and `SelfDistiller` again from the
fingerprint a `TeacherModel` records): the teacher's tokenizer is the student's
(the same token -> id table, special tokens included; a fingerprint of it is
recorded by `from_model`), and each model's logits width (`config.vocab_size`)
is at least the tokenizer's size N (its largest id + 1). The widths may differ:
ids >= N are padding rows of the heads, no token (Qwen2.5-0.5B pads to 151936,
Qwen2.5-7B to 152064, one tokenizer of 151665 ids). `DistillLoss` takes the
divergence over the first min(V_student, V_teacher) ids of both (each side
renormalised there; that keeps every real token, N <= min width), and
`SelfDistiller.update` refuses a response holding a padding id (>= N: the
student's sampler emitted no token), so no trained target lies outside the
common ids. Per-token divergences compare the two distributions token id by id.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

__all__ = [
    "TeacherModel",
    "check_vocabulary",
    "tokenizer_fingerprint",
    "vocabulary_mismatch",
]

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True, eq=False)
class TeacherModel:
    """A frozen teacher of another architecture or size: graphdef (static), params,
    rest (arrays). `name` says where it came from (its spec), for messages and the
    checkpoint's record. `vocab`: the fingerprint of its tokenizer's token table
    (`tokenizer_fingerprint`), `tokenizer_size` that tokenizer's size (largest id
    + 1); `SelfDistiller` compares both with the student's tokenizer. Build it with
    `from_model`."""

    graphdef: Any
    params: Any
    rest: Any
    name: str = "teacher"
    vocab: str = ""
    tokenizer_size: int = 0

    def tree_flatten(self):
        return (self.params, self.rest), (self.graphdef, self.name, self.vocab, self.tokenizer_size)

    @classmethod
    def tree_unflatten(cls, aux, children):
        graphdef, name, vocab, size = aux
        return cls(graphdef, children[0], children[1], name, vocab, size)

    @classmethod
    def from_model(
        cls,
        model: nnx.Module,
        tokenizer,
        *,
        dtype: str | None = None,
        name: str = "teacher",
    ):
        """The teacher of a loaded model (an `nnx.Module`, e.g. `recipes.load_model`'s).

        tokenizer: the teacher's own tokenizer (`load_model`'s second value, or an
        HF tokenizer / `tokenizers.Tokenizer`): its token table's fingerprint is
        recorded, and a teacher whose logits are narrower than it is refused.
        dtype: None keeps the weights as loaded; "bfloat16" / "float32" stores the
        floating-point weights in that dtype (bfloat16 halves the teacher's memory;
        its logits are fp32 either way)."""
        if dtype is not None and dtype not in _DTYPES:
            raise ValueError(
                f"TeacherModel: dtype must be None (as loaded) or one of {sorted(_DTYPES)}, "
                f"got {dtype!r}"
            )
        if getattr(getattr(model, "config", None), "lora", None) is not None:
            raise ValueError(
                f"TeacherModel({name}): the teacher has LoRA adapters; merge them first "
                "(models.io.peft_io.merge_lora): a teacher is one frozen model"
            )
        size = tokenizer_size(tokenizer)
        width = int(getattr(getattr(model, "config", None), "vocab_size", 0))
        if width < size:
            raise ValueError(
                f"TeacherModel({name}): logits width (config.vocab_size) {width} is below "
                f"its tokenizer's {size} ids; pass the teacher's own tokenizer"
            )
        graphdef, params, *others = nnx.split(model, nnx.Param, ...)
        (rest,) = others
        if dtype is not None:
            want = _DTYPES[dtype]
            params = jax.tree.map(
                lambda x: x.astype(want) if jnp.issubdtype(x.dtype, jnp.floating) else x, params
            )
        return cls(graphdef, params, rest, name, tokenizer_fingerprint(tokenizer), size)

    @property
    def vocab_size(self) -> int:
        """The width of the teacher's logits."""
        return int(nnx.merge(self.graphdef, self.params, self.rest).config.vocab_size)

    def place(self, mesh, rules=None) -> TeacherModel:
        """This teacher on `mesh`: params sharded by their logical axes like the
        student's (`param_shardings`), the rest replicated. The train step calls it
        for a teacher that is not the student's own params."""
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        from ac2_jax.training.core.sharding import param_shardings

        cached = getattr(self, "_placed", None)
        if cached is not None and cached[0] is mesh:
            return cached[1]
        rep = NamedSharding(mesh, P())
        params = jax.device_put(self.params, param_shardings(self.params, mesh, rules))
        rest = jax.device_put(self.rest, jax.tree.map(lambda _: rep, self.rest))
        placed = TeacherModel(
            self.graphdef, params, rest, self.name, self.vocab, self.tokenizer_size
        )
        object.__setattr__(self, "_placed", (mesh, placed))
        object.__setattr__(placed, "_placed", (mesh, placed))
        return placed


def _vocab(tokenizer) -> dict[str, int]:
    hf = getattr(tokenizer, "hf", tokenizer)
    return dict(hf.get_vocab())


def tokenizer_size(tokenizer) -> int:
    """The tokenizer's size N: its largest token id + 1 (special tokens included)."""
    return max(_vocab(tokenizer).values(), default=-1) + 1


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of the tokenizer's token -> id table (special tokens included)."""
    table = json.dumps(sorted(_vocab(tokenizer).items()), ensure_ascii=False)
    return hashlib.sha256(table.encode()).hexdigest()


def vocabulary_mismatch(
    student_tokenizer, teacher_tokenizer, student_vocab_size: int, teacher_vocab_size: int
) -> str | None:
    """What differs between the student's and the teacher's vocabularies, or None.

    Compared: the tokenizers' token -> id tables (special tokens included); each
    logits width (`config.vocab_size`) must be at least the tokenizer's size N.
    Widths may differ beyond N (padding rows, the module docstring's contract)."""
    s, t = _vocab(student_tokenizer), _vocab(teacher_tokenizer)
    if s != t:
        only_s = sorted(set(s) - set(t))
        only_t = sorted(set(t) - set(s))
        moved = sorted(k for k in set(s) & set(t) if s[k] != t[k])
        parts = [f"student {len(s)} tokens, teacher {len(t)}"]
        if only_s:
            parts.append(f"{len(only_s)} only the student's (e.g. {only_s[0]!r})")
        if only_t:
            parts.append(f"{len(only_t)} only the teacher's (e.g. {only_t[0]!r})")
        if moved:
            k = moved[0]
            parts.append(f"{len(moved)} with other ids (e.g. {k!r}: {s[k]} vs {t[k]})")
        return "the tokenizers differ: " + ", ".join(parts)
    n = max(s.values(), default=-1) + 1
    for who, width in (("student", student_vocab_size), ("teacher", teacher_vocab_size)):
        if int(width) < n:
            return (
                f"the {who}'s logits width (vocab_size {width}) is below the tokenizer's "
                f"{n} ids (student vocab_size {student_vocab_size}, teacher {teacher_vocab_size})"
            )
    return None


def check_vocabulary(
    student_tokenizer,
    teacher_tokenizer,
    student_vocab_size: int,
    teacher_vocab_size: int,
    teacher_name: str = "teacher",
) -> None:
    """Refuses (ValueError, one line) a teacher whose vocabulary is not the student's
    (`vocabulary_mismatch`); logits widths that differ by padding are accepted."""
    why = vocabulary_mismatch(
        student_tokenizer, teacher_tokenizer, student_vocab_size, teacher_vocab_size
    )
    if why is not None:
        raise ValueError(
            f"distill.teacher {teacher_name!r}: vocabulary mismatch ({why}); a teacher "
            "model must share the student's tokenizer and vocabulary, token id by id"
        )
