"""Sampler kinds: how a served policy samples, picked by `SamplerConfig.kind`.

The endpoint (`python -m ac2_jax.serving --sampler=KIND`) and every recipe
(`--config.sampler.kind=KIND`) build their sampler here, from one config:

- "jax" (default): the embedded `JaxSampler` over the model in this process.
- "sglang": an `SGLangSampler` client of the SGLang server at `url` serving the
  same weights; each publish is exported as HF safetensors to `export_dir`
  (which that server must be able to read) and hot-swapped in.
- "fleet": a `FleetSampler` of one `SGLangSampler` per URL in `backends` (SGLang
  servers or `python -m ac2_jax.serving.backend` processes), each exporting to
  `export_dir/backend<i>`.

A new kind is one class registered from its own module (or a test), nothing
shared changed:

    @SAMPLERS.register("mine")
    class MineKind(SamplerKind):
        reads = ("options",)  # the kind-specific SamplerConfig fields it honours
        def build(self, config, setup):
            return MySampler(setup.model, config.options or {}, ...)

A kind-specific field set away from its default on a kind that does not read it
is refused by name (nothing silent), and so is an unknown kind (did-you-mean).
"""

from __future__ import annotations

import abc
import dataclasses
import os
from collections.abc import Sequence
from typing import Any

from ac2_jax.registry import Registry
from ac2_jax.sampling.base import Sampler

__all__ = [
    "SAMPLERS",
    "SamplerConfig",
    "SamplerKind",
    "SamplerSetup",
    "build_sampler",
    "close_sampler",
]

# Sampler kinds by name (`SamplerConfig.kind`): each entry a `SamplerKind` subclass.
SAMPLERS: Registry[type[SamplerKind]] = Registry("sampler")

# SamplerConfig.hand_off: how the embedded sampler gets the learner's weights.
HAND_OFFS = ("memory", "disk")

# The fields only some kinds read (the others: kind, max_context, model_name).
KIND_FIELDS = (
    "warmup",
    "fixed_shapes",
    "url",
    "backends",
    "export_dir",
    "timeout_s",
    "options",
    "weight_swap",
    "hand_off",
)


@dataclasses.dataclass(frozen=True)
class SamplerConfig:
    """The sampler a policy is served with (see the module docstring).

    kind: a registered sampler kind (`SAMPLERS`: jax, sglang, fleet, ...).
    max_context: tokens per sequence (None: the model's max_position_embeddings).
    model_name: the `model` clients send.
    warmup (jax): compile every shape before the first request (the first request
      then never waits on a compile). fixed_shapes (jax): always max_batch rows x
      max_context slots, compiled up front (no compiles once serving).
    url (sglang): the SGLang server. backends (fleet): the servers' URLs.
    export_dir (sglang, fleet): where each publish is exported as HF safetensors
      for the server(s) to load (None: `exports` beside the publish folder).
    timeout_s (sglang, fleet): the HTTP timeout of each request.
    weight_swap (jax): "drain" (default: new weights wait for the running rows)
      or "in_flight" (swapped between decode chunks; each token records its
      version: `JaxSampler(weight_swap=)`).
    hand_off (jax): how the RL and distillation recipes' learner gives each update's weights to
      the embedded sampler: "memory" (default: `JaxSampler.set_params` with the
      learner's params, no disk round trip; `publish_dir` is still written, in the
      background, for other readers) or "disk" (published to `publish_dir`, then
      `load_weights` reloads them). The two serve the same weights (same dtype
      cast, same version and swap rule; tests/training/rl/test_hand_off.py).
    options: a registered kind's own settings (the built-in kinds read none).
    """

    kind: str = "jax"
    max_context: int | None = None
    warmup: bool = True
    model_name: str = "policy"
    fixed_shapes: bool = False
    url: str | None = None
    backends: tuple[str, ...] = ()
    export_dir: str | None = None
    timeout_s: float = 600.0
    options: dict[str, Any] | None = None
    weight_swap: str = "drain"
    hand_off: str = "memory"

    def __post_init__(self):
        if isinstance(self.backends, (list, str)):  # a list from Python, "a,b" from a flag
            items = self.backends.split(",") if isinstance(self.backends, str) else self.backends
            object.__setattr__(self, "backends", tuple(u.strip() for u in items if u.strip()))
        kind = SAMPLERS.get(self.kind)()  # an unknown kind: did-you-mean
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name in KIND_FIELDS:
            if name not in kind.reads and getattr(self, name) != defaults[name]:
                readers = [k for k in SAMPLERS.names() if name in SAMPLERS.get(k).reads]
                raise ValueError(
                    f"sampler.{name}={getattr(self, name)!r} has no effect with sampler.kind="
                    f"{self.kind!r} (read by kind {', '.join(readers) or 'none'}); drop it or "
                    "pick a kind that reads it"
                )
        kind.check(self)


@dataclasses.dataclass(frozen=True)
class SamplerSetup:
    """What a kind builds its sampler from, beyond its config.

    model: the policy (a Decoder; for remote kinds the buffer published weights are
    loaded into before export). max_context: resolved (config's, else the model's).
    publish_dir: published steps `load_weights` reads. max_batch: rows decoded
    together (the embedded sampler). seed: of unseeded requests. eos_token_ids:
    the tokens that end a completion. export_dir: the default of
    `SamplerConfig.export_dir`.
    """

    model: Any
    tokenizer: Any
    max_context: int
    publish_dir: str | None = None
    max_batch: int = 16
    seed: int = 0
    eos_token_ids: Sequence[int] = ()
    export_dir: str | None = None


class SamplerKind(abc.ABC):
    """A registered way to sample. `reads`: the kind-specific `SamplerConfig` fields
    (`KIND_FIELDS`) it honours; `check` refuses a bad config in one line before any
    work; `build` returns the `Sampler`."""

    reads: tuple[str, ...] = ()

    def check(self, config: SamplerConfig) -> None:  # noqa: B027 - optional hook
        """Raises ValueError naming what is wrong with `config` for this kind."""

    @abc.abstractmethod
    def build(self, config: SamplerConfig, setup: SamplerSetup) -> Sampler: ...


def _export_dir(config: SamplerConfig, setup: SamplerSetup) -> str | None:
    return (
        config.export_dir
        or setup.export_dir
        or (
            os.path.join(os.path.dirname(os.path.abspath(setup.publish_dir)), "exports")
            if setup.publish_dir
            else None
        )
    )


def _no_lora(kind: str, model: Any) -> None:
    if getattr(getattr(model, "config", None), "lora", None) is not None:
        raise ValueError(
            f"sampler.kind={kind!r} serves full weights; a LoRA policy's publishes are "
            "adapters, which are not wired to remote servers: use sampler.kind='jax' or "
            "train without lora"
        )


@SAMPLERS.register("jax")
class JaxKind(SamplerKind):
    """The embedded `JaxSampler` (see `SamplerConfig.warmup`, `fixed_shapes`)."""

    reads = ("warmup", "fixed_shapes", "weight_swap", "hand_off")

    def check(self, config):
        if config.hand_off not in HAND_OFFS:
            raise ValueError(
                f"sampler.hand_off must be one of {HAND_OFFS} ('memory': the learner's "
                f"weights handed over in memory; 'disk': published, then reloaded), got "
                f"{config.hand_off!r}"
            )
        swaps = ("drain", "in_flight")  # jax_sampler.WEIGHT_SWAPS (not imported: no jax here)
        if config.weight_swap not in swaps:
            raise ValueError(
                f"sampler.weight_swap must be one of {swaps}, got {config.weight_swap!r}"
            )

    def build(self, config, setup):
        from ac2_jax.sampling.engine.jax_sampler import JaxSampler

        extra = {"min_cache_len": setup.max_context} if config.warmup else {}
        sampler = JaxSampler(
            setup.model, publish_dir=setup.publish_dir, max_context=setup.max_context,
            max_batch=setup.max_batch, eos_token_ids=list(setup.eos_token_ids),
            tokenizer=setup.tokenizer, seed=setup.seed, fixed_shapes=config.fixed_shapes,
            weight_swap=config.weight_swap, **extra,
        )  # fmt: skip
        if config.warmup or config.fixed_shapes:
            sampler.warmup()
        return sampler


def _sglang(url: str, config: SamplerConfig, setup: SamplerSetup, export_dir: str | None):
    from ac2_jax.sampling.remote.sglang import SGLangSampler

    return SGLangSampler(
        url, max_context=setup.max_context, model=setup.model, publish_dir=setup.publish_dir,
        export_dir=export_dir, vocab_size=getattr(setup.tokenizer, "vocab_size", None),
        timeout_s=config.timeout_s,
    )  # fmt: skip


@SAMPLERS.register("sglang")
class SGLangKind(SamplerKind):
    """An `SGLangSampler` client of the server at `url`."""

    reads = ("url", "export_dir", "timeout_s")

    def check(self, config):
        if not config.url:
            raise ValueError(
                "sampler.kind='sglang' needs sampler.url (the SGLang server, e.g. "
                "http://127.0.0.1:30000)"
            )

    def build(self, config, setup):
        _no_lora("sglang", setup.model)
        return _sglang(str(config.url), config, setup, _export_dir(config, setup))


@SAMPLERS.register("fleet")
class FleetKind(SamplerKind):
    """A `FleetSampler` of one `SGLangSampler` per URL in `backends`."""

    reads = ("backends", "export_dir", "timeout_s")

    def check(self, config):
        if not config.backends:
            raise ValueError(
                "sampler.kind='fleet' needs sampler.backends (URLs of SGLang servers or "
                "`python -m ac2_jax.serving.backend` processes, comma-separated)"
            )
        if len(set(config.backends)) != len(config.backends):
            raise ValueError(f"sampler.backends lists a URL twice: {list(config.backends)}")

    def build(self, config, setup):
        from ac2_jax.sampling.remote.fleet import FleetSampler

        _no_lora("fleet", setup.model)
        root = _export_dir(config, setup)
        return FleetSampler([
            _sglang(url, config, setup, None if root is None else os.path.join(root, f"backend{i}"))
            for i, url in enumerate(config.backends)
        ])  # fmt: skip


def build_sampler(config: SamplerConfig, setup: SamplerSetup) -> Sampler:
    """The sampler `config.kind` builds for `setup` (a `Sampler`, checked)."""
    sampler = SAMPLERS.get(config.kind)().build(config, setup)
    if not isinstance(sampler, Sampler):
        raise TypeError(
            f"sampler kind {config.kind!r} built a {type(sampler).__name__}, not a Sampler "
            "(generate, load_weights, policy_version, max_context)"
        )
    return sampler


async def close_sampler(sampler: Any) -> None:
    """Closes a sampler of any kind: its `aclose()`, else its `close()` (neither: nothing)."""
    aclose = getattr(sampler, "aclose", None)
    if callable(aclose):
        await aclose()
        return
    close = getattr(sampler, "close", None)
    if callable(close):
        close()
