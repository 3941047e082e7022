"""The memory plan: the runtime choices a model and its train step run with, picked
from the model's shape and the device's memory, logged, and overridden by any
explicit value ("auto" picks; anything else is kept).

Four choices decide a train step's memory. Measured with XLA's memory analysis of
the Qwen3-0.6B-shaped RL step (PPO, AdamW, fp32) at 1,024 tokens on CPU: step
temporaries 6.55 GB with per-layer layers, no remat and dense logits (the old
defaults), 2.70 GB with all four lean choices (docs/notes/2026-12-05-memory-lean-defaults.md):

- `scan_layers` (DecoderConfig): stacked layers under `lax.scan`. With remat each
  layer then keeps only its input (4.91 GB of temporaries per-layer with remat
  "full" and chunked log-probs, 2.70 GB scanned), and compile time does not grow
  with depth (28 layers: 4.8 vs 28.9 s). Per-layer decode is ~1.6x faster on CPU,
  so a CPU sampler of a lean model may pass scan_layers=False.
- `remat` (DecoderConfig): "full" recomputes each layer in the backward pass
  (about one more forward of the layers); "none" keeps ~25K values per token and
  layer at the 0.6B shape (5.56 GB of temporaries scanned, against 2.70 GB).
- the attention kernel (`attention_backend` "auto", `models.kernels.attention.choose_backend`):
  on CPU block-sparse tiles from rows of 4 x attention_block tokens, dense below.
- chunked log-probs (the losses' `chunk_size` "auto"): the loss
  projects `chunk` positions at a time when dense fp32 logits of the rows would
  exceed LOGITS_CHUNK_BYTES (151,936-token vocabulary, one row: 256 positions;
  `logprob_chunk_for`).

Lean (scan + full remat) is chosen for models of at least LEAN_PARAMS parameters,
or when the fast plan's estimate at REFERENCE_TOKENS tokens exceeds
MEMORY_FRACTION of the device's memory; smaller models keep the fast choices
(remat "none" and per-layer weights cost no memory worth saving there).
The choices are made where they can be, each once: scan_layers / remat "auto"
(the model's) where the model is built (`models.config.resolve_config`, called by
`Transformer.__init__` and `load_hf_checkpoint`; a config itself stays "auto"), the
attention kernel per row length when a forward is traced, the losses' `chunk_size`
"auto" in the step from the batch's shape; the train step logs the whole plan once
per compiled shape. `plan` is pure given `device_memory_bytes`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from typing import Any

import jax.numpy as jnp

log = logging.getLogger(__name__)

AUTO = "auto"
LEAN_PARAMS = 100_000_000  # parameters from which scan + remat "full" are the default
MEMORY_FRACTION = 0.5  # the fast plan must fit in this share of the device's memory
REFERENCE_TOKENS = 4096  # tokens per step assumed when a config is resolved (no batch yet)
# Dense fp32 logits above this are chunked. 160 MiB, not 320: a chunk's logits (with
# their softmax and gradient) are most of a LoRA step's fixed temporaries, 2.01 -> 1.07 GB
# at the Qwen3-0.6B shape from 512 to 256 positions (docs/notes/
# 2026-12-05-lora-frozen-bf16-base.md).
LOGITS_CHUNK_BYTES = 160 * 2**20
LOGITS_COPIES = 2.5  # logits, their softmax / log-probs and gradient (measured 2.4x)
GB = 1e9


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """The runtime choices of a model (and a train step at `rows` x `tokens`) and why.

    attention_backend is the kernel that runs on rows of `tokens` (what "auto"
    resolves to); logprob_chunk is positions per chunk of the loss's logits, None
    for dense logits. estimate_bytes: params, gradients, AdamW moments, activations
    and logits of one step under these choices (a model, not a measurement).
    reasons: choice -> why (an explicit value says so, and what "auto" would pick).
    """

    scan_layers: bool
    remat: str
    attention_backend: str
    logprob_chunk: int | None
    params: int
    rows: int
    tokens: int
    memory_bytes: int
    estimate_bytes: int
    lean: bool
    reasons: Mapping[str, str]

    def describe(self) -> str:
        """One line: each choice with its reason, the sizes behind them."""
        chunk = "dense" if self.logprob_chunk is None else f"chunked {self.logprob_chunk}"
        scan, remat = self.reasons["scan_layers"], self.reasons["remat"]
        layers = (
            f"scan_layers={self.scan_layers}, remat={self.remat} ({scan}); "
            if scan == remat
            else f"scan_layers={self.scan_layers} ({scan}); remat={self.remat} ({remat}); "
        )
        choices = (
            layers + f"attention={self.attention_backend} ({self.reasons['attention_backend']}); "
            f"log-probs {chunk} ({self.reasons['logprob_chunk']})"
        )
        return (
            f"{_count(self.params)} params, {self.rows} x {self.tokens:,} tokens, "
            f"estimate {_gb(self.estimate_bytes)} of {_gb(self.memory_bytes)} memory: {choices}"
        )


def param_count(config) -> int:
    """Parameters of a decoder config (embeddings, layers, norms, untied head)."""
    d, hd = config.hidden_size, config.head_dim
    q, kv = config.num_heads * hd, config.num_kv_heads * hd
    layer = d * (q + 2 * kv) + q * d + 3 * d * config.intermediate_size + 2 * d
    layer += 2 * hd if config.qk_norm else 0
    layer += q + 2 * kv if config.attention_bias else 0
    head = 0 if config.tie_embeddings else d * config.vocab_size
    return int(config.vocab_size * d + head + config.num_layers * layer + d)


def _layer_values(config, remat: str) -> int:
    """Activation values per token one layer keeps for its backward pass."""
    d, i = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    if remat == "none":  # norms, q/k/v, attention out, o, residuals, gate/up/act/product
        return 6 * d + 2 * q + 2 * kv + 4 * i
    if remat == "save_dots":  # the weight matmuls' outputs
        return q + 2 * kv + 2 * d + 2 * i
    return d  # "full": the layer's input


def estimate_bytes(
    config, *, scan_layers: bool, remat: str, rows: int, tokens: int, logprob_chunk: int | None
) -> int:
    """Bytes of one train step: params and gradients in the param dtype, AdamW moments
    in fp32, activations kept for the backward pass (plus one layer's recomputation
    under remat; per-layer weights with remat are counted as without: XLA keeps most
    of them, measured), and LOGITS_COPIES x the fp32 logits of a chunk or the rows."""
    n = param_count(config)
    state = n * (2 * jnp.dtype(config.param_dtype).itemsize + 8)
    act_bytes = jnp.dtype(config.dtype).itemsize * rows * tokens
    kept = remat if scan_layers else "none"
    acts = config.num_layers * _layer_values(config, kept) * act_bytes
    if kept != "none":
        acts += _layer_values(config, "none") * act_bytes
    positions = tokens if logprob_chunk is None else min(logprob_chunk, tokens)
    logits = LOGITS_COPIES * rows * positions * config.vocab_size * 4
    return int(state + acts + logits)


def logprob_chunk_for(rows: int, length: int, vocab: int) -> int | None:
    """Positions per chunk of the loss's log-probs for [rows, length] over `vocab`:
    None (dense logits) when the rows' fp32 logits fit LOGITS_CHUNK_BYTES, else the
    largest power of two whose chunk of all rows does (at least 1).

    LOGITS_CHUNK_BYTES is a device's: under a mesh (`jax.set_mesh`, as the step is
    traced) `rows` counts the rows one device holds, ceil(rows / the ways of the
    active rules' "batch" axes). Counting all of them chunked Qwen3-8B's 8 x 8,192
    rows on 8 chips (one row a chip) at 32 positions, a 256-trip loop of 19 MB
    logits, instead of 256 positions (issue 69)."""
    rows = _rows_per_device(int(rows))
    per_position = max(int(rows), 1) * int(vocab) * 4
    if per_position * int(length) <= LOGITS_CHUNK_BYTES:
        return None
    chunk = 1
    while chunk * 2 * per_position <= LOGITS_CHUNK_BYTES and chunk * 2 < length:
        chunk *= 2
    return chunk


def _rows_per_device(rows: int) -> int:
    """`rows` split over the active rules' "batch" mesh axes under the current mesh
    (`jax.sharding.get_abstract_mesh()`); `rows` when no mesh is set."""
    import jax

    from ac2_jax.models.axes import active_rules

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return rows
    axes = active_rules().spec(("batch",), mesh)[0]
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    ways = 1
    for a in axes:
        ways *= int(mesh.shape[a])
    return -(-rows // ways)


def host_memory_bytes() -> int:
    """The host's memory: physical pages, capped by a cgroup (v2) limit if one is set."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 0
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemTotal:"):
                        total = int(line.split()[1]) * 1024
        except OSError:
            pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit.isdigit() and (not total or int(limit) < total):
            total = int(limit)
    except OSError:
        pass
    return int(total) or 16 * 2**30


def available_memory_bytes(device: Any = None) -> int:
    """The memory a step has: the device's `memory_stats()["bytes_limit"]` where it
    reports one (GPU, TPU), else the host's (CPU). Without `device`, the first JAX
    device if a backend is already up; never starts one (a config may be built
    before `jax.distributed.initialize`), the host's memory then."""
    device = _started_device() if device is None else device
    stats = None
    if device is not None:
        try:
            stats = device.memory_stats()
        except Exception:
            stats = None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    return host_memory_bytes()


def _gb(n: float) -> str:
    return f"{n / GB:.1f} GB" if n >= GB else f"{n / 1e6:.0f} MB"


def _count(n: int) -> str:
    if n >= 1e9:
        return f"{n / 1e9:.2f}B"
    return f"{n / 1e6:,.0f}M" if n >= 1e6 else f"{n / 1e3:,.0f}K"


def plan(
    config,
    *,
    tokens: int | None = None,
    rows: int = 1,
    device_memory_bytes: int | None = None,
    logprob_chunk: int | str | None = AUTO,
    platform: str | None = None,
) -> MemoryPlan:
    """The memory plan of `config` for a step of `rows` x `tokens` (default: one row of
    REFERENCE_TOKENS, at most max_position_embeddings).

    config's scan_layers / remat / attention_backend may be "auto" (chosen here) or
    set (kept, with what "auto" would pick in the reason). logprob_chunk: the loss's
    chunk_size ("auto", an int, or None for dense logits). device_memory_bytes:
    default `available_memory_bytes()`. platform: for the attention kernel (default JAX's).
    """
    from ac2_jax.models.kernels.attention import choose_backend

    n = param_count(config)
    ref = min(REFERENCE_TOKENS, int(config.max_position_embeddings))
    tokens, rows = int(tokens or ref), int(rows)
    mem = int(device_memory_bytes or available_memory_bytes())
    reasons: dict[str, str] = {}

    auto_chunk = logprob_chunk_for(rows, tokens, config.vocab_size)
    dense = rows * tokens * config.vocab_size * 4
    if logprob_chunk == AUTO:
        chunk = auto_chunk
        reasons["logprob_chunk"] = (
            f"auto: dense logits {_gb(dense)} > {_gb(LOGITS_CHUNK_BYTES)}"
            if chunk is not None
            else f"auto: dense logits {_gb(dense)} <= {_gb(LOGITS_CHUNK_BYTES)}"
        )
    else:
        chunk = None if logprob_chunk is None else int(logprob_chunk)
        would = "dense" if auto_chunk is None else f"chunk {auto_chunk}"
        reasons["logprob_chunk"] = f"set by the loss; auto would pick {would}"

    fast = estimate_bytes(
        config,
        scan_layers=False,
        remat="none",
        rows=1,
        tokens=ref,
        logprob_chunk=logprob_chunk_for(1, ref, config.vocab_size),
    )
    budget = MEMORY_FRACTION * mem
    if n >= LEAN_PARAMS:
        lean, why = True, f"{_count(n)} params >= {_count(LEAN_PARAMS)}"
    elif fast > budget:
        lean = True
        why = f"fast plan {_gb(fast)} at {ref:,} tokens > {MEMORY_FRACTION:.0%} of {_gb(mem)}"
    else:
        lean = False
        why = (
            f"{_count(n)} params < {_count(LEAN_PARAMS)} and fast plan "
            f"{_gb(fast)} at {ref:,} tokens <= {MEMORY_FRACTION:.0%} of {_gb(mem)}"
        )
    choices: dict[str, Any] = {}
    for field, lean_value, fast_value in (("scan_layers", True, False), ("remat", "full", "none")):
        value, auto_value = getattr(config, field), (lean_value if lean else fast_value)
        if value == AUTO:
            choices[field], reasons[field] = auto_value, f"auto: {why}"
        else:
            choices[field] = value
            reasons[field] = (
                f"as auto: {why}" if value == auto_value else f"set; auto would pick {auto_value}"
            )

    requested, platform = config.attention_backend, platform or _platform()
    if platform is None:  # no backend started yet: "auto" is chosen per row when it runs
        backend = requested
        reasons["attention_backend"] = (
            "chosen per row length at trace time" if (requested == AUTO) else "set"
        )
    else:
        backend = choose_backend(
            requested,
            kind="flat",
            q_len=tokens,
            dtype=config.dtype,
            head_dim=config.head_dim,
            block=config.attention_block,
            platform=platform,
        )
        reasons["attention_backend"] = (
            f"auto on {platform}: rows of {tokens:,} tokens, block {config.attention_block}"
            if requested == AUTO
            else "set"
        )

    total = estimate_bytes(
        config,
        scan_layers=bool(choices["scan_layers"]),
        remat=str(choices["remat"]),
        rows=rows,
        tokens=tokens,
        logprob_chunk=chunk,
    )
    return MemoryPlan(
        scan_layers=bool(choices["scan_layers"]),
        remat=str(choices["remat"]),
        attention_backend=backend,
        logprob_chunk=chunk,
        params=n,
        rows=rows,
        tokens=tokens,
        memory_bytes=mem,
        estimate_bytes=total,
        lean=lean,
        reasons=reasons,
    )


def _started_device() -> Any:
    """The first JAX device if a backend is up, else None (never starts one)."""
    try:
        from jax._src import xla_bridge

        if xla_bridge.backends_are_initialized():
            import jax

            return jax.devices()[0]
    except Exception:  # a private API: without it, as if no backend were up
        pass
    return None


def _platform() -> str | None:
    device = _started_device()
    return None if device is None else device.platform


def resolve_runtime(config) -> dict[str, Any]:
    """scan_layers / remat of a config whose fields may be "auto", chosen by `plan` (at
    REFERENCE_TOKENS, the device's memory) and logged (one INFO line). Called by
    `models.config.resolve_config`, the one place a config is resolved."""
    p = plan(config)
    log.info(
        "memory plan for a %s-param %s model: scan_layers=%s (%s); remat=%s (%s)",
        _count(p.params),
        config.family,
        p.scan_layers,
        p.reasons["scan_layers"],
        p.remat,
        p.reasons["remat"],
    )
    return {"scan_layers": p.scan_layers, "remat": p.remat}


def log_step_plan(config, *, rows: int, tokens: int, logprob_chunk, device=None) -> MemoryPlan:
    """Logs the plan of a train step of `rows` x `tokens` (`TrainStep` calls it when it
    compiles for a batch shape); warns when the estimate exceeds the device's memory."""
    p = plan(
        config,
        tokens=tokens,
        rows=rows,
        device_memory_bytes=available_memory_bytes(device),
        logprob_chunk=logprob_chunk,
    )
    log.info("train step memory plan: %s", p.describe())
    if p.estimate_bytes > p.memory_bytes:
        log.warning(
            "train step memory plan: the estimate %s exceeds the device's %s; set "
            "scan_layers=True, remat='full', a smaller chunk_size or fewer tokens per step",
            _gb(p.estimate_bytes),
            _gb(p.memory_bytes),
        )
    return p
