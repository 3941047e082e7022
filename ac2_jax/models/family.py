"""Model families: one protocol every trained model meets, and a registry by HF model_type.

A family is what an HF `config.json`'s `model_type` names ("qwen3", "llama"):
how its config reads and writes that file, and how its model is built. The
built-in families live in `models/families.py`; a new one is a module with a
`ModelFamily` subclass under `@register_family("<model_type>")` and its test,
and nothing shared changes:

    @register_family("toy")
    class ToyFamily(ModelFamily):
        hf_architecture = "ToyForCausalLM"
        config_class = ToyConfig
        def build(self, config, rngs): return ToyLM(config, rngs)
        ...

    model = build_model(ToyConfig(...))   # by config.family

The trainers need only `CausalLM`: logits of packed rows, the final hidden
states and the head that projects them (the chunked losses read hidden
states and the head, never [R, L, V] logits). Sampling with `JaxSampler`
also needs the decoder's cache API (`init_cache`, `decode`).
"""

from __future__ import annotations

import abc
from typing import Any, Protocol, runtime_checkable

import jax
from flax import nnx

from ac2_jax.losses import LMHead
from ac2_jax.registry import Registry
from ac2_jax.text.tool_parsers import family_format, register_family_format

__all__ = [
    "CausalLM",
    "FAMILIES",
    "ModelFamily",
    "build_model",
    "config_from_hf",
    "get_family",
    "register_family",
]


@runtime_checkable
class CausalLM(Protocol):
    """What the trainers read from a model (an `nnx.Module`).

    tokens, positions, segment_ids: [R, L] int32 packed rows (segment_ids 0 =
    padding; a token attends only within its segment, causally);
    subtree_end: [R, L] int32 for tree-packed rows, else None.
    """

    config: Any  # the family's config; `config.family` names the family

    def __call__(self, tokens, positions, segment_ids, subtree_end=None) -> jax.Array:
        """fp32 logits [R, L, V] of packed rows (the arrays as above)."""
        ...

    def hidden_states(self, tokens, positions, segment_ids, subtree_end=None) -> jax.Array:
        """Final (normed) hidden states [R, L, D]: `logits(hidden_states(...))` is
        `__call__(...)`."""
        ...

    def logits(self, hidden: jax.Array) -> jax.Array:
        """hidden [..., D] -> fp32 logits [..., V]; equals `head().logits(hidden)`."""
        ...

    def head(self) -> LMHead:
        """The output projection as an `LMHead` (the chunked losses' view)."""
        ...


class ModelFamily(abc.ABC):
    """One model family: its config class, its HF `config.json` mapping, its model.

    `hf_architecture`: the HF class name written in `config.json`
    ("Qwen3ForCausalLM"); `config_class`: the config dataclass the family's
    `build` takes (its `family` field is the registered name).
    """

    name: str = ""  # set by `register_family`
    hf_architecture: str = ""
    config_class: type = object
    # The projections its model can hold LoRA adapters on (`models.lora.TARGETS`
    # names); `check_lora_targets` refuses a LoRAConfig naming others.
    lora_targets: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")
    # The tool-call format (an `ac2_jax.text` tool-parser name) of the family's published
    # chat templates: a tokenizer whose template renders no call markup takes it. Left ""
    # it is text's entry for the model type (`text.tool_parsers.FAMILY_FORMATS`, where the
    # built-in families' are: reading a tokenizer needs no model code), else "hermes";
    # `register_family` records the family's format there.
    tool_parser: str = ""

    def check_lora_targets(self, targets) -> None:
        """Raises ValueError naming any of `targets` this family has no adapter for."""
        missing = [t for t in targets if t not in self.lora_targets]
        if missing:
            raise ValueError(
                f"LoRA targets {missing} are not adaptable in family {self.name!r} "
                f"(it adapts {list(self.lora_targets)})"
            )

    @abc.abstractmethod
    def build(self, config: Any, rngs: nnx.Rngs) -> CausalLM:
        """A model of `config` with fresh weights from `rngs`."""

    @abc.abstractmethod
    def config_from_hf(self, hf: dict[str, Any], **kwargs: Any) -> Any:
        """The family's config from an HF `config.json` dict of this model_type."""

    @abc.abstractmethod
    def config_to_hf(self, config: Any) -> dict[str, Any]:
        """The HF `config.json` dict of `config` (model_type = this family's name)."""


FAMILIES: Registry[ModelFamily] = Registry("model family", builtins="ac2_jax.models.families")


def register_family(model_type: str, *, replace: bool = False):
    """Class decorator: registers an instance of a `ModelFamily` subclass as the
    family of HF model_type `model_type`."""

    def add(cls: type[ModelFamily]) -> type[ModelFamily]:
        if not (isinstance(cls, type) and issubclass(cls, ModelFamily)):
            raise TypeError(
                f"register_family({model_type!r}): expected a ModelFamily subclass, got {cls!r}"
            )
        family = cls()
        family.name = model_type
        family.tool_parser = family.tool_parser or family_format(model_type) or "hermes"
        FAMILIES.register(model_type, replace=replace)(family)
        register_family_format(model_type, family.tool_parser)
        return cls

    return add


def get_family(model_type: str | None) -> ModelFamily:
    """The family registered as `model_type` (ValueError listing the known ones)."""
    return FAMILIES.get(str(model_type))


def build_model(config: Any, rngs: nnx.Rngs | None = None) -> CausalLM:
    """A model of `config` (its family: `config.family`), weights from `rngs`
    (default nnx.Rngs(0))."""
    family = get_family(getattr(config, "family", None))
    if not isinstance(config, family.config_class):
        raise TypeError(
            f"build_model: family {family.name!r} takes a "
            f"{family.config_class.__name__}, got {type(config).__name__}"
        )
    return family.build(config, nnx.Rngs(0) if rngs is None else rngs)


def config_from_hf(hf: dict[str, Any], **kwargs: Any) -> Any:
    """The config of an HF `config.json` dict, read by the family its model_type names."""
    try:
        family = get_family(hf.get("model_type"))
    except ValueError as e:
        raise ValueError(f"config_from_hf: model_type: {e}") from None
    return family.config_from_hf(hf, **kwargs)
