"""Size a run before renting chips: the recipe's train step, the sampler and the weight
hand-off compiled ahead of time for a TPU topology, on a CPU host.

    python -m ac2_jax.aot --topology=v5p:2x2x2 --model=qwen3-8b --recipe=rl --seq-len=8192 \
        --batch=8 [--lora[=RANK]] [--config.FIELD=VALUE ...] [--json=out.json]

Needs libtpu (`pip install -e .[tpu-aot]`): `jax.experimental.topologies.
get_topology_desc(platform="tpu", topology_name=...)` gives the topology's devices
without any chip; the mesh is made over them and every argument is a
`jax.ShapeDtypeStruct` with its `NamedSharding` (params and optimizer state by the
model's logical axes and the rules, `models.axes`; batch rows over data x fsdp), so
no weight is ever in memory. What is compiled is what runs:

* train: `TrainStep._update` of `make_train_step` (the recipe's objective, its
  chunked log-probs, the model's remat and scan) on the batch geometry the recipe
  packs (`rl.batch.rows x rl.batch.seq_len` through `warmup_batch`; sft:
  `sft.batch_rows x sft.seq_len`); an MoE policy with `rl.moe.routing=replay`
  gets the batch's routing input.
* prefill / decode: the sampler's `prefill_sub` and `decode_chunk` (the one
  decode loop, `steps_per_sync` steps) on `--sampler-batch` rows of a
  `--sampler-len` cache, weights in the sampler's layout.
* handoff: the learner's params (their train-step sharding, `param_dtype`) to the
  sampler's layout (cast to the compute dtype, the sampler mesh's sharding): the
  resharding a publish / set_weights does on the pod.

Per program and chip: XLA's memory analysis (argument, output, temporary bytes;
arguments donated into outputs are counted once) against the chip's HBM, the
cost analysis' FLOPs and bytes, and the collectives of the optimized HLO (kind,
count, bytes; a collective inside a while loop counts trip-count times). XLA's
cost analysis counts a while-loop body ONCE (the layer scan's body is one layer),
so the roofline takes FLOPs from the model's shape instead (`model_flops`: 6 N T
for full training, 4 N T with frozen weights (LoRA: no weight gradients), N without
an untied input embedding (a lookup), plus causal attention; the executed FLOPs add
remat's second forward). Per chip:
compute = executed FLOPs / bf16 peak, HBM = (argument + output + 2 x temporary
bytes) / HBM bandwidth, ICI = the loop-counted collective bytes / ICI bandwidth.
The step time is their maximum (perfect overlap) and MFU = model FLOPs / (step
time x peak): an upper bound; "serial" sums the three (no overlap), a lower one.

Chip figures (`CHIPS`), per chip, from Google Cloud's TPU pages
(cloud.google.com/tpu/docs/v4, /v5e, /v5p, /v6e, "System architecture" tables); the
ICI figure is the table's bidirectional per-chip bandwidth over 2 (one direction):
  v4:  32 GiB HBM, 275 TFLOP/s bf16, 1,200 GB/s HBM, ICI not in the v4 table: 2,400 Gbps
       (300 GB/s) kept, unbacked
  v5e: 16 GiB HBM, 197 TFLOP/s bf16,   819 GB/s HBM,   400 GB/s bidirectional ICI
  v5p: 95 GiB HBM, 459 TFLOP/s bf16, 2,765 GB/s HBM, 1,200 GB/s bidirectional ICI
  v6e: 32 GiB HBM, 918 TFLOP/s bf16, 1,638 GB/s HBM,   800 GB/s bidirectional ICI
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
import time
from collections.abc import Sequence
from typing import Any

GiB = 1024**3


@dataclasses.dataclass(frozen=True)
class Chip:
    """Per-chip figures of a TPU generation (module docstring: sources)."""

    name: str
    hbm_bytes: int
    peak_bf16_flops: float
    hbm_bytes_per_s: float
    ici_bytes_per_s: float


CHIPS = {
    "v4": Chip("v4", 32 * GiB, 275e12, 1200e9, 2400e9 / 8),
    "v5e": Chip("v5e", 16 * GiB, 197e12, 819e9, 400e9 / 2),
    "v5p": Chip("v5p", 95 * GiB, 459e12, 2765e9, 1200e9 / 2),
    "v6e": Chip("v6e", 32 * GiB, 918e12, 1638e9, 800e9 / 2),
}
PROGRAMS = ("train", "prefill", "decode", "handoff")
USAGE = (
    "usage: python -m ac2_jax.aot --topology=v5e:2x2 --model=SHAPE|DIR|tiny "
    "--recipe={rl,sft} [--lora[=RANK]] [--seq-len=N] [--batch=ROWS] [--rules=expert=fsdp] "
    "[--dtype=bfloat16] [--param-dtype=float32] [--remat=full] [--attention=splash_tpu|dense] "
    "[--sampler-batch=B] [--sampler-len=S] [--sampler-tensor=T] [--prefill-len=P] "
    "[--programs=train,decode,...] "
    "[--config.FIELD=VALUE ...] [--json=PATH]"
)
_FLAGS = {
    "topology": None, "model": None, "recipe": "rl", "lora": None, "seq_len": None,
    "batch": None, "rules": "", "dtype": "bfloat16", "param_dtype": "float32",
    "remat": "full", "attention": "auto", "sampler_batch": "64",
    "sampler_len": None, "sampler_tensor": None, "programs": ",".join(PROGRAMS),
    "json": None, "prefill_len": "512",
}  # fmt: skip


class UsageError(ValueError):
    """A command-line mistake (one line)."""


# ----------------------------------------------------------------------------- topology


def chip_of(topology: str) -> Chip:
    """The chip generation of a topology name ("v5e:2x2" -> v5e)."""
    gen = topology.split(":")[0].split("_")[0].lower()
    if gen not in CHIPS:
        raise UsageError(
            f"--topology={topology!r}: the chip must be one of {sorted(CHIPS)} "
            "(e.g. v5e:2x2, v5p:2x2x2, v4:2x2x1, v6e:2x2)"
        )
    return CHIPS[gen]


def topology_devices(topology: str) -> list:
    """The devices of a TPU topology (no chip needed; libtpu compiles for them).
    One device per chip on v5e / v6e / v5p (megacore); v4 lists one per core."""
    import os

    # libtpu takes a machine-wide lock file by default (one process per TPU host); here no
    # chip is driven, so concurrent compiles (tests, several sizings) may share it.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from ac2_jax.extras import require

    require("libtpu", "tpu-aot", what="compiling for a TPU topology (python -m ac2_jax.aot)")
    try:
        from jax.experimental import topologies

        desc = topologies.get_topology_desc(platform="tpu", topology_name=topology)
    except Exception as e:  # noqa: BLE001 - libtpu absent or a bad name: one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(
            f"--topology={topology!r}: no TPU topology ({first}); install libtpu with "
            "`pip install -e .[tpu-aot]` and name one like v5e:2x2 or v5p:2x2x2"
        ) from None
    return list(desc.devices)


# ----------------------------------------------------------------------------- HLO


_SHAPE = re.compile(r"\b(pred|s8|u8|s16|u16|s32|u32|s64|u64|f16|bf16|f32|f64)\[([0-9,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2,
          "s32": 4, "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}  # fmt: skip
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([a-z][\w\-]*)\(")
_COMP = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\))?\s*->.*\{\s*$")


def _shape_bytes(text: str) -> list[tuple[int, tuple[int, ...]]]:
    out = []
    for dt, dims in _SHAPE.findall(text):
        shape = tuple(int(d) for d in dims.split(",") if d)
        out.append((_BYTES[dt] * math.prod(shape), shape))
    return out


def collectives(hlo: str) -> list[dict[str, Any]]:
    """The collectives of an optimized HLO module's text: one dict per instruction
    (kind, bytes of its result, shape, times it runs per call: the product of the
    known trip counts of the while loops around it). Async pairs count once
    (the -start); bytes are the largest array of the result (an all-gather's
    gathered array); trip counts from `trip_count`."""
    comps: dict[str, list[str]] = {}
    entry, current = None, None
    for line in hlo.splitlines():
        m = _COMP.match(line)
        if m and not line.startswith(" "):
            current = m.group(2)
            comps[current] = []
            if m.group(1):
                entry = current
            continue
        if current is not None:
            comps[current].append(line)
    # Multiplier of each computation: a while body runs its trip count times.
    mult: dict[str, int] = {}
    stack = [(entry, 1)] if entry else []
    while stack:
        name, k = stack.pop()
        if name not in comps or mult.get(name, 0) >= k:
            continue
        mult[name] = k
        for line in comps[name]:
            cond = re.search(r"\bcondition=%?([\w.\-]+)", line)
            for key, callee in re.findall(r"\b(body|calls|to_apply|branch_computations"
                                          r"|true_computation|false_computation)=\{?%?([\w.\-]+)",
                                          line):  # fmt: skip
                times = trip_count(comps.get(cond.group(1), [])) if (key == "body" and cond) else 1
                stack.append((callee, k * times))
    found = []
    for name, lines in comps.items():
        for line in lines:
            m = _INSTR.match(line)
            if not m:
                continue
            op = m.group(3)
            kind = op.removesuffix("-start")
            if kind not in COLLECTIVES or op.endswith("-done"):
                continue
            arrays = _shape_bytes(m.group(2))
            if not arrays:
                continue
            nbytes, shape = max(arrays)
            found.append({"kind": kind, "bytes": nbytes, "shape": list(shape),
                          "times": mult.get(name, 1), "computation": name})  # fmt: skip
    return found


def trip_count(condition: list[str]) -> int:
    """A while loop's trip count from its condition computation: the bound N of its
    `compare(i, constant(N)), direction=LT` (LE: N + 1), as JAX's scan and fori
    loops count from 0 by 1; a loop that may stop early (the decode chunk's `i <
    n_steps & any(active)`) gets its most trips. 1 when no such compare is found."""
    consts = {}
    for line in condition:
        m = re.match(r"^\s*%?([\w.\-]+)\s*=\s*s32\[\][^ ]*\s+constant\((-?\d+)\)", line)
        if m:
            consts[m.group(1)] = int(m.group(2))
    for line in condition:
        m = re.search(r"compare\(%?([\w.\-]+), %?([\w.\-]+)\), direction=(LT|LE)", line)
        if m and m.group(2) in consts:
            return max(consts[m.group(2)] + (m.group(3) == "LE"), 1)
    return 1


def collective_summary(found: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """kind -> {count (instructions), runs (per call, loops counted), bytes (per call)}."""
    out: dict[str, dict[str, int]] = {}
    for c in found:
        s = out.setdefault(c["kind"], {"count": 0, "runs": 0, "bytes": 0, "largest": 0})
        s["count"] += 1
        s["runs"] += c["times"]
        s["bytes"] += c["bytes"] * c["times"]
        s["largest"] = max(s["largest"], c["bytes"])
    return out


def kernel_names(hlo: str) -> dict[str, int]:
    """Pallas kernels of an optimized HLO module by name (the jaxpr scope that called
    `pallas_call`: "ac2_pallas_tpu_attention_fwd", "gmm", ...) -> their custom calls."""
    names: dict[str, int] = {}
    for line in hlo.splitlines():
        if 'custom_call_target="tpu_custom_call"' not in line:
            continue
        m = re.search(r'op_name="(?:[^"]*/)?([^/"]+)/pallas_call"', line)
        name = re.sub(r"^jit\((.*)\)$", r"\1", m.group(1)) if m else "?"
        names[name] = names.get(name, 0) + 1
    return names


def analyze(compiled, chip: Chip) -> dict[str, Any]:
    """Memory, cost and collectives of a compiled program, per chip."""
    ma = compiled.memory_analysis()
    mem = {
        k: int(getattr(ma, f"{k}_size_in_bytes"))
        for k in ("argument", "output", "alias", "temp", "generated_code")
    }
    # Donated arguments live on in the outputs: count them once.
    mem["peak"] = (
        mem["argument"] + mem["output"] - mem["alias"] + mem["temp"] + mem["generated_code"]
    )
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    text = compiled.as_text()
    found = collectives(text)
    return {
        # Pallas / Mosaic kernels in the program (attention "pallas_tpu", the MoE's gmm).
        "tpu_kernels": text.count('custom_call_target="tpu_custom_call"'),
        "kernel_names": kernel_names(text),
        "memory": mem,
        "hbm_bytes": chip.hbm_bytes,
        "fits": mem["peak"] <= chip.hbm_bytes,
        "xla_flops_loop_body_once": float(cost.get("flops", 0.0)),
        "xla_bytes_accessed_loop_body_once": float(cost.get("bytes accessed", 0.0)),
        "collectives": collective_summary(found),
        "collective_list": found,
    }


# ----------------------------------------------------------------------------- model


def model_config(spec: str, args: dict[str, str], lora):
    """The model's config: a shape name (`models.presets`), "tiny" (the launcher's
    preset shape), or an HF directory / config.json; dtypes and runtime fields set,
    resolved (`models.config.resolve_config`: --remat=auto is decided here)."""
    import os

    import jax.numpy as jnp

    from ac2_jax.models.config import resolve_config
    from ac2_jax.models.family import config_from_hf
    from ac2_jax.models.presets import SHAPES, shape_config

    if spec == "tiny":
        hf = {"model_type": "qwen3", "vocab_size": 512, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 1024,
              "tie_word_embeddings": True}  # fmt: skip
    elif spec in SHAPES:
        hf = shape_config(spec)
    elif os.path.exists(spec):
        path = os.path.join(spec, "config.json") if os.path.isdir(spec) else spec
        with open(path) as f:
            hf = json.load(f)
    else:
        raise UsageError(
            f"--model={spec!r}: not a shape ({', '.join(SHAPES.names())}, tiny) nor an HF "
            "directory / config.json"
        )
    dt = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}
    for flag in ("dtype", "param_dtype"):
        if args[flag] not in dt:
            raise UsageError(f"--{flag.replace('_', '-')}={args[flag]!r}: one of {sorted(dt)}")
    config = config_from_hf(
        hf, dtype=dt[args["dtype"]], param_dtype=dt[args["param_dtype"]], scan_layers=True,
        remat=args["remat"], attention_backend=args["attention"],
    )  # fmt: skip
    if lora is not None:
        config = config.replace(lora=lora)
    return resolve_config(config)  # the one plan: the models and steps below share it


def _abstract(tree, shardings):
    import jax

    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings
    )


def param_count(params) -> int:
    import jax

    return int(sum(math.prod(x.shape) for x in jax.tree.leaves(params)))


def model_flops(
    config, tokens: int, seq_len: int, trainable_all: bool, active: int, executed: bool = False
) -> float:
    """Matmul FLOPs of one train step over `tokens` tokens in rows of `seq_len`: 2 N T
    forward, 2 N T for the activations' gradients and, when every weight trains,
    2 N T for the weights' (N = the params of the matmuls a token passes through: an
    MoE's top-k experts only; an untied input embedding is a lookup, not counted, as
    in MaxText's and PaLM's MFU: the vocabulary counts once, as the output head);
    plus causal attention, 4 T S/2 H hd per layer forward and twice that backward.
    Remat's recomputation is not counted (MFU's convention) unless
    `executed`: remat "full" / "save_dots" then adds one more forward of the layers
    (the chip executes it; "save_dots" recomputes attention only, counted as full)."""
    attn = 4 * tokens * (seq_len / 2) * config.num_heads * config.head_dim * config.num_layers
    per = 6 if trainable_all else 4
    if not getattr(config, "tie_embeddings", False):
        active -= config.vocab_size * config.hidden_size  # the input embedding's lookup
    flops = per * active * tokens + 3 * attn
    if executed and config.remat != "none":
        flops += 2 * active * tokens + attn
    return flops


def active_params(config, total: int) -> int:
    """Params one token passes through: all, or for an MoE the router's top-k experts."""
    E = getattr(config, "num_experts", None)
    if not E:
        return total
    k, F, D = config.num_experts_per_tok, config.moe_intermediate_size, config.hidden_size
    return total - len(config.moe_layers) * (E - k) * 3 * D * F


# ----------------------------------------------------------------------------- programs


@dataclasses.dataclass
class Plan:
    """What the command compiles: the parsed flags and the recipe's config."""

    topology: str
    chip: Chip
    devices: list
    recipe: str
    config: Any  # the recipe's config (RLRecipeConfig / SFTRecipeConfig)
    model: Any  # the model's config
    rules: Any  # AxisRules
    mesh: Any
    sampler_batch: int
    sampler_len: int
    sampler_tensor: int
    prefill_len: int
    programs: tuple[str, ...]


def learner_mesh(cfg, devices):
    """The recipe's mesh section over the topology's devices; 1/1/1 means every chip
    on fsdp (the pod-scale default)."""
    from ac2_jax.training.core.sharding import make_mesh

    m = cfg.mesh
    shape = (m.data, m.fsdp, m.tensor)
    if shape == (1, 1, 1):
        shape = (1, len(devices), 1)
    if math.prod(shape) != len(devices):
        raise UsageError(
            f"mesh.data={shape[0]} x mesh.fsdp={shape[1]} x mesh.tensor={shape[2]} is "
            f"{math.prod(shape)} devices; the topology has {len(devices)}: make the "
            "product equal"
        )
    return make_mesh(*shape, devices=devices)


def parse_rules(text: str):
    """ "expert=fsdp,mlp=tensor" -> AxisRules with those entries first (precedence)."""
    from ac2_jax.models.axes import DEFAULT_RULES, AxisRules

    extra = []
    for item in filter(None, (t.strip() for t in text.split(","))):
        name, eq, axes = item.partition("=")
        if not eq:
            raise UsageError(f"--rules: {item!r} is not LOGICAL=MESH_AXIS[+MESH_AXIS]")
        extra.append((name, tuple(a for a in axes.split("+") if a)))
    try:
        return AxisRules(table=(*extra, *DEFAULT_RULES))
    except ValueError as e:
        raise UsageError(f"--rules: {e}") from None


def _loss_and_batch(plan: Plan):
    """(loss, abstract-ready numpy batch, rows, seq_len) of the recipe, as its trainer has them."""
    import numpy as np

    from ac2_jax.training.rl.batching import warmup_batch

    cfg = plan.config
    if plan.recipe == "rl":
        loss, bc = cfg.rl.loss, cfg.rl.batch
        batch = warmup_batch(dataclasses.replace(
            bc, task_capacity=bc.task_capacity or cfg.rl.tasks_per_step * cfg.rl.attempts_per_task,
            segment_capacity=bc.segment_capacity or bc.rows))  # fmt: skip
        layers = getattr(plan.model, "moe_layers", None)
        if layers and cfg.rl.moe.routing == "replay":
            R, L = batch.tokens.shape
            k = plan.model.num_experts_per_tok
            routing = np.full((R, L, len(layers), k), -1, np.int32)
            batch = dataclasses.replace(batch, routing=routing)
        return loss, batch, cfg.rl.grad_accum
    from ac2_jax.training import SFTLoss

    sc = cfg.sft
    loss = SFTLoss(mode=sc.mode, chunk_size=sc.chunk_size)
    from ac2_jax.training.rl.batching import BatchConfig

    batch = warmup_batch(BatchConfig(seq_len=sc.seq_len, rows=sc.batch_rows))
    return loss, batch, sc.grad_accum


def compile_train(plan: Plan) -> tuple[Any, dict[str, Any]]:
    """The recipe's train step compiled for the topology; (compiled, facts)."""
    import jax

    from ac2_jax.models.family import build_model
    from ac2_jax.training.core.sharding import batch_sharding, state_shardings
    from ac2_jax.training.core.state import abstract_train_state
    from ac2_jax.training.core.train_step import make_train_step

    cfg = plan.config
    optimizer = cfg.rl.optimizer if plan.recipe == "rl" else cfg.optimizer
    graphdef, state = abstract_train_state(lambda: build_model(plan.model), optimizer)
    loss, batch, grad_accum = _loss_and_batch(plan)
    step = make_train_step(graphdef, loss, optimizer, mesh=plan.mesh, grad_accum=grad_accum,
                           axis_rules=plan.rules)  # fmt: skip
    sh = state_shardings(state, plan.mesh, plan.rules)
    step.state_sharding = sh
    step._build(state)
    abstract_state = _abstract(state, sh)
    rows = batch_sharding(plan.mesh)
    abstract_batch = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rows),
        step._fill((batch, None))[0],
    )
    if getattr(loss, "needs_reference", False):
        teacher = _abstract(state.params, sh.params)
    else:
        teacher = None
    # Under the mesh: kernels that run in shard_map (attention "pallas_tpu", the MoE's
    # grouped GEMM) read it, and "auto" picks by its (TPU) platform.
    with jax.set_mesh(plan.mesh):
        compiled = step._step.lower(abstract_state, abstract_batch, None, teacher).compile()
    R, L = batch.tokens.shape
    n_params = param_count(state.params) + param_count(getattr(state, "rest", {}))
    trainable = param_count(state.params)
    total = n_params if plan.model.lora is None else n_params - trainable
    facts = {
        "rows": R, "seq_len": L, "tokens": R * L, "params": total, "trainable": trainable,
        "active_params": active_params(plan.model, total),
        "model_flops": model_flops(plan.model, R * L, L, plan.model.lora is None,
                                   active_params(plan.model, total)),
        "executed_flops": model_flops(plan.model, R * L, L, plan.model.lora is None,
                                      active_params(plan.model, total), executed=True),
        "loss": type(loss).__name__, "chunk_size": str(getattr(loss, "chunk_size", None)),
        "grad_accum": grad_accum,
    }  # fmt: skip
    return compiled, facts


def sampler_mesh(plan: Plan):
    """The sampler's mesh over the same chips: ('data', 'fsdp'=1, 'tensor'=T)."""
    from ac2_jax.training.core.sharding import make_mesh

    T = plan.sampler_tensor
    return make_mesh(len(plan.devices) // T, 1, T, devices=plan.devices)


def _sampler_state(plan: Plan, mesh):
    from flax import nnx

    from ac2_jax.models.family import build_model
    from ac2_jax.training.core.sharding import param_shardings

    sconfig = plan.model.replace(param_dtype=plan.model.dtype)
    model = nnx.eval_shape(lambda: build_model(sconfig))
    graphdef, state = nnx.split(model)
    sh = param_shardings(state, mesh, plan.rules)
    return sconfig, model, graphdef, _abstract(state, sh)


def compile_sampler(plan: Plan) -> dict[str, tuple[Any, dict[str, Any]]]:
    """The sampler's prefill (`prefill_sub`) and decode chunk (`decode_chunk`)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from ac2_jax.sampling.engine.batching import SlotTable
    from ac2_jax.sampling.engine.decode_loop import decode_chunk, prefill_sub

    mesh = sampler_mesh(plan)
    sconfig, model, graphdef, state = _sampler_state(plan, mesh)
    B, S = plan.sampler_batch, plan.sampler_len
    rows_axis = "data" if B % mesh.shape["data"] == 0 else None
    rows = NamedSharding(mesh, P(rows_axis))
    cache = jax.eval_shape(lambda: model.init_cache(B, S))
    # The stacked cache [B, S, layers, K * hd]: rows over data, kv heads over tensor.
    kv_axis = "tensor" if (sconfig.num_kv_heads % plan.sampler_tensor == 0) else None
    cache_sh = NamedSharding(mesh, P(rows_axis, None, None, kv_axis))
    acache = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=cache_sh if x.ndim == 4 else rows
        ),
        cache,
    )
    idle = SlotTable.idle_rows(B)
    arows = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype,
                                                        sharding=rows), idle)  # fmt: skip
    rep = NamedSharding(mesh, P())
    out = {}
    if "decode" in plan.programs:
        steps = 8
        with jax.set_mesh(mesh):
            lowered = decode_chunk.lower(
                graphdef, state, acache, arows, jax.ShapeDtypeStruct((), jnp.bool_, sharding=rep),
                None, n_steps=steps, n_top=20,
            )  # fmt: skip
            compiled = lowered.compile()
        out["decode"] = (compiled, {"rows": B, "cache_len": S, "steps": steps,
                                             "tokens": B * steps})  # fmt: skip
    if "prefill" in plan.programs:
        b, T = B, min(plan.prefill_len, S)
        sub = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                           acache)  # fmt: skip
        i32 = lambda shape: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=rows)  # noqa: E731
        with jax.set_mesh(mesh):
            lowered = prefill_sub.lower(graphdef, state, sub, i32((b, T)), i32((b, T)), i32((b,)))
            compiled = lowered.compile()
        out["prefill"] = (compiled, {"rows": b, "prompt_len": T, "cache_len": S,
                                              "tokens": b * T})  # fmt: skip
    return out


def compile_handoff(plan: Plan) -> tuple[Any, dict[str, Any]]:
    """Learner params (train-step sharding, param_dtype) -> the sampler's params
    (compute dtype, the sampler mesh's sharding): a publish's resharding on the pod."""
    import jax
    from flax import nnx

    from ac2_jax.models.family import build_model
    from ac2_jax.training.core.sharding import param_shardings

    learner = nnx.eval_shape(lambda: build_model(plan.model))
    _, lparams = nnx.split(learner, nnx.Param)
    lsh = param_shardings(lparams, plan.mesh, plan.rules)
    smesh = sampler_mesh(plan)
    _, smodel, _, _ = _sampler_state(plan, smesh)
    ssh = param_shardings(nnx.state(smodel, nnx.Param), smesh, plan.rules)
    dtype = plan.model.dtype
    fn = jax.jit(lambda p: jax.tree.map(lambda x: x.astype(dtype), p), out_shardings=ssh)
    compiled = fn.lower(_abstract(lparams, lsh)).compile()
    return compiled, {"params": param_count(lparams)}


# ----------------------------------------------------------------------------- report


def roofline(name: str, analysis: dict[str, Any], facts: dict[str, Any], chip: Chip,
             chips: int) -> dict[str, Any]:  # fmt: skip
    """Step-time lower bound and MFU of a program, per chip (module docstring)."""
    coll = sum(s["bytes"] for s in analysis["collectives"].values())
    mem = analysis["memory"]
    flops = facts.get("model_flops")
    if flops is None:  # sampler programs: 2 N per token
        flops = 2.0 * facts.get("active_params", 0) * facts.get("tokens", 0)
    flops_chip = flops / chips
    executed = facts.get("executed_flops", flops) / chips
    # HBM traffic: every argument read once and every output written once, the
    # temporaries written and read once; a lower bound.
    hbm = mem["argument"] + mem["output"] + 2 * mem["temp"]
    t = {"compute_s": executed / chip.peak_bf16_flops, "hbm_s": hbm / chip.hbm_bytes_per_s,
         "ici_s": coll / chip.ici_bytes_per_s}  # fmt: skip
    # Overlapped: the largest term (an upper bound on MFU); serial: their sum.
    step, serial = max(t.values()), sum(t.values())
    peak = chip.peak_bf16_flops
    return {**t, "step_s": step, "serial_step_s": serial,
            "bound": max(t, key=lambda k: t[k]).removesuffix("_s"),
            "mfu": flops_chip / (step * peak) if step else 0.0,
            "mfu_serial": flops_chip / (serial * peak) if serial else 0.0,
            "collective_bytes": coll}  # fmt: skip


def whole_stack_gathers(found: list[dict[str, Any]], layers: int, per_layer_max: int) -> list:
    """All-gathers of a [layers, ...] array bigger than one layer's largest weight:
    a whole scanned weight stack gathered at once (FSDP should gather a layer at a
    time inside the scan)."""
    return [
        c for c in found
        if c["kind"] == "all-gather" and c["shape"][:1] == [layers] and c["bytes"] > per_layer_max
    ]  # fmt: skip


def _gb(n: float) -> str:
    return f"{n / GiB:.2f}"


def table(rows: list[dict[str, Any]]) -> str:
    head = ["program", "arg GiB", "out GiB", "temp GiB", "peak GiB", "HBM GiB", "fits",
            "collectives (kind: runs, GiB)", "step ms", "bound", "MFU (serial)"]  # fmt: skip
    lines = [head]
    for r in rows:
        a, rf = r["analysis"], r["roofline"]
        m = a["memory"]
        coll = "; ".join(f"{k}: {v['runs']}, {v['bytes'] / GiB:.2f}"
                         for k, v in sorted(a["collectives"].items())) or "-"  # fmt: skip
        lines.append([r["program"], _gb(m["argument"]), _gb(m["output"]), _gb(m["temp"]),
                      _gb(m["peak"]), _gb(a["hbm_bytes"]), "yes" if a["fits"] else "NO", coll,
                      f"{rf['step_s'] * 1e3:.1f}", rf["bound"],
                      f"{rf['mfu'] * 100:.1f}% ({rf['mfu_serial'] * 100:.1f}%)"
                      if r["program"] == "train" else "-"])  # fmt: skip
    widths = [max(len(str(row[i])) for row in lines) for i in range(len(head))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True))
                     for row in lines)  # fmt: skip


# ----------------------------------------------------------------------------- CLI


def parse_args(argv: Sequence[str]) -> tuple[dict[str, Any], list[str]]:
    """(flags with defaults, --config. overrides)."""
    flags: dict[str, Any] = dict(_FLAGS)
    overrides: list[str] = []
    for arg in argv:
        if not arg.startswith("--"):
            raise UsageError(f"unexpected argument {arg!r}; {USAGE}")
        name, eq, value = arg[2:].partition("=")
        if name.startswith("config."):
            overrides.append(f"{name.removeprefix('config.')}={value}")
            continue
        key = name.replace("-", "_")
        if key not in _FLAGS:
            import difflib

            close = difflib.get_close_matches(key, list(_FLAGS), n=1)
            hint = f"; did you mean --{close[0].replace('_', '-')}?" if close else ""
            raise UsageError(f"unknown flag --{name}{hint} ({USAGE})")
        flags[key] = value if eq else ("" if key == "lora" else None)
        if flags[key] is None:
            raise UsageError(f"--{name} needs a value (--{name}=VALUE)")
    for need in ("topology", "model"):
        if not flags[need]:
            raise UsageError(f"--{need} is required; {USAGE}")
    return flags, overrides


# The --config.FIELD prefixes whose values reach a compiled program, per recipe; any
# other field (sampler, rollout, eval, log, alarms, ...) is refused by name, not ignored.
COMPILED_FIELDS = {
    "rl": ("rl.batch.", "rl.loss.", "rl.optimizer.", "rl.moe.", "rl.grad_accum",
           "rl.tasks_per_step", "rl.attempts_per_task", "lora.", "mesh."),
    "sft": ("sft.seq_len", "sft.batch_rows", "sft.mode", "sft.chunk_size", "sft.grad_accum",
            "optimizer.", "lora.", "mesh."),
}  # fmt: skip


def check_compiled_fields(recipe: str, overrides: Sequence[str]) -> None:
    """Refuses a --config.FIELD that no compiled program reads (one line, naming it)."""
    for item in overrides:
        field = item.partition("=")[0]
        if not any(field == p.rstrip(".") or field.startswith(p) for p in COMPILED_FIELDS[recipe]):
            raise UsageError(
                f"--config.{field}: not compiled by this command (it sizes the {recipe} train "
                f"step from {', '.join(COMPILED_FIELDS[recipe])}; the sampler's shapes come "
                "from --sampler-batch / --sampler-len / --prefill-len)"
            )


def build_plan(argv: Sequence[str]) -> Plan:
    from ac2_jax.config_cli import load_config
    from ac2_jax.recipes import RECIPES

    flags, overrides = parse_args(argv)
    recipe = flags["recipe"]
    if recipe == "distill":
        raise UsageError(
            "--recipe='distill': not compiled by this command (its paired teacher batch is "
            "not built here); size the student's step with --recipe=rl or --recipe=sft"
        )
    if recipe not in ("rl", "sft"):
        import difflib

        close = difflib.get_close_matches(recipe, ["rl", "sft"], n=1, cutoff=0.5)
        hint = f"; did you mean --recipe={close[0]}?" if close else ""
        raise UsageError(f"--recipe={recipe!r}: one of rl, sft{hint}")
    check_compiled_fields(recipe, overrides)
    cls = RECIPES[recipe][0]
    sizes = {"rl": ("rl.batch.seq_len", "rl.batch.rows"), "sft": ("sft.seq_len", "sft.batch_rows")}
    seq_key, rows_key = sizes[recipe]
    pre = []
    if flags["seq_len"]:
        pre.append(f"{seq_key}={flags['seq_len']}")
        if recipe == "rl":
            pre.append(f"rl.batch.max_seq_len={flags['seq_len']}")
    if flags["batch"]:
        pre.append(f"{rows_key}={flags['batch']}")
    if flags["lora"] is not None:
        pre.append(f"lora.rank={flags['lora'] or 16}")
    config = load_config(cls, None, [*pre, *overrides])
    chip = chip_of(flags["topology"])
    devices = topology_devices(flags["topology"])
    if chip.name == "v4" and getattr(devices[0], "num_cores", 2) == 1:
        # libtpu lists a v4 topology's TensorCores (two a chip) as its devices: the
        # figures are then per core, half a chip's.
        chip = Chip("v4 core", chip.hbm_bytes // 2, chip.peak_bf16_flops / 2,
                    chip.hbm_bytes_per_s / 2, chip.ici_bytes_per_s / 2)  # fmt: skip
    model = model_config(flags["model"], flags, config.lora)
    programs = tuple(p for p in flags["programs"].split(",") if p)
    bad = sorted(set(programs) - set(PROGRAMS))
    if bad:
        raise UsageError(f"--programs: unknown {bad}; choose from {PROGRAMS}")
    tensor = flags["sampler_tensor"]
    if tensor is None:  # the fewest chips whose HBM holds the bf16 weights at half
        weight = 2 * n_params(model)
        tensor = 1
        while tensor < len(devices) and weight / tensor > chip.hbm_bytes / 2:
            tensor *= 2
    seq = config.rl.batch.seq_len if recipe == "rl" else config.sft.seq_len
    return Plan(
        topology=flags["topology"], chip=chip, devices=devices, recipe=recipe, config=config,
        model=model, rules=parse_rules(flags["rules"]), mesh=learner_mesh(config, devices),
        sampler_batch=int(flags["sampler_batch"]),
        sampler_len=int(flags["sampler_len"] or seq), sampler_tensor=int(tensor),
        prefill_len=int(flags["prefill_len"]), programs=programs,
    )  # fmt: skip


def n_params(config) -> int:
    """The model's parameter count (an abstract model: no memory)."""
    from flax import nnx

    from ac2_jax.models.family import build_model

    return param_count(nnx.state(nnx.eval_shape(lambda: build_model(config)), nnx.Param))


def run(plan: Plan, out=None) -> dict[str, Any]:
    """Compiles the plan's programs; returns the report (and prints its table to `out`,
    default stdout)."""
    out = sys.stdout if out is None else out
    rows: list[dict[str, Any]] = []
    chips = len(plan.devices)
    facts_train: dict[str, Any] = {}
    rows_failed: list[dict[str, Any]] = []
    todo: list[tuple[str, Any]] = []
    if "train" in plan.programs:
        todo.append(("train", lambda: compile_train(plan)))
    if "handoff" in plan.programs:
        todo.append(("handoff", lambda: compile_handoff(plan)))
    for name, make in todo:
        t0 = time.perf_counter()
        try:
            compiled, facts = make()
        except Exception as e:  # noqa: BLE001 - XLA refuses a program over the chip's HBM
            need = over_hbm(e)
            if need is None:
                raise
            rows_failed.append({"program": name, "needs_bytes": need, "error": first_line(e)})
            continue
        facts["compile_s"] = round(time.perf_counter() - t0, 1)
        if name == "train":
            facts_train = facts
        rows.append({"program": name, "facts": facts, "analysis": analyze(compiled, plan.chip)})
    if {"prefill", "decode"} & set(plan.programs):
        t0 = time.perf_counter()
        try:
            sampler = compile_sampler(plan)
        except Exception as e:  # noqa: BLE001 - as above
            need = over_hbm(e)
            if need is None:
                raise
            rows_failed.append({"program": "sampler", "needs_bytes": need, "error": first_line(e)})
            sampler = {}
        for name, (compiled, facts) in sampler.items():
            facts["compile_s"] = round(time.perf_counter() - t0, 1)
            rows.append({"program": name, "facts": facts,
                         "analysis": analyze(compiled, plan.chip)})  # fmt: skip
    active = facts_train.get("active_params")
    if active is None:
        active = active_params(plan.model, n_params(plan.model))
    for r in rows:
        r["facts"].setdefault("active_params", active)
        sharded = chips if r["program"] == "train" else 1
        if r["program"] in ("prefill", "decode"):
            sharded = chips  # rows over data, weights over tensor: the whole pod's tokens
        r["roofline"] = roofline(r["program"], r["analysis"], r["facts"], plan.chip, sharded)
    stack = []
    train = next((r for r in rows if r["program"] == "train"), None)
    if train is not None:
        per_layer = _largest_layer_weight(plan)
        stack = whole_stack_gathers(train["analysis"]["collective_list"],
                                    plan.model.num_layers, per_layer)  # fmt: skip
    for r in rows:  # the JSON keeps each program's 12 largest collectives per call
        found = r["analysis"].pop("collective_list")
        r["analysis"]["largest_collectives"] = sorted(
            found, key=lambda c: -c["bytes"] * c["times"]
        )[:12]
    report = {
        "topology": plan.topology, "chip": dataclasses.asdict(plan.chip), "chips": chips,
        "recipe": plan.recipe, "model": _model_line(plan.model),
        "mesh": dict(plan.mesh.shape), "sampler_mesh": {"data": chips // plan.sampler_tensor,
                                                        "tensor": plan.sampler_tensor},
        "rules": [list(map(str, r)) for r in plan.rules.table],
        "whole_stack_all_gathers": stack,
        "programs": rows,
        "over_hbm": rows_failed,
    }  # fmt: skip
    print(f"{plan.topology} ({chips} chips, {plan.chip.name}: {plan.chip.hbm_bytes / GiB:.0f} "
          f"GiB HBM, {plan.chip.peak_bf16_flops / 1e12:.0f} TFLOP/s bf16) | {plan.recipe} | "
          f"{report['model']} | mesh {report['mesh']} | sampler mesh "
          f"{report['sampler_mesh']}", file=out)  # fmt: skip
    for r in rows:
        f = r["facts"]
        print(
            f"  {r['program']}: "
            + ", ".join(f"{k}={v}" for k, v in f.items() if not k.endswith("_flops")),
            file=out,
        )
    print(table(rows), file=out)
    for r in rows_failed:
        print(f"{r['program']}: does NOT fit: XLA refused it ({r['error']})", file=out)
    print(f"whole weight stacks all-gathered at once: {len(stack)}"
          + ("" if not stack else f" (largest {max(c['bytes'] for c in stack) / GiB:.2f} GiB)"),
          file=out)  # fmt: skip
    return report


def first_line(e: BaseException) -> str:
    return " ".join(str(e).strip().splitlines()[0].split()) if str(e).strip() else type(e).__name__


def over_hbm(e: BaseException) -> int | None:
    """The bytes XLA's TPU compiler said a program needs when it refused it for not
    fitting the chip's HBM ("Ran out of memory on HBM ... required ... (47.58G)"); None
    for any other error."""
    text = str(e)
    if "RESOURCE_EXHAUSTED" not in text or "HBM" not in text:
        return None
    m = re.search(r"\(([\d.]+)([KMGT])\)", text)
    if not m:
        return -1
    return int(float(m.group(1)) * 1024 ** "KMGT".index(m.group(2)) * 1024)


def _largest_layer_weight(plan: Plan) -> int:
    """Bytes of the largest single-layer slice of any stacked param (its dtype)."""
    import jax
    from flax import nnx

    from ac2_jax.models.family import build_model

    m = nnx.eval_shape(lambda: build_model(plan.model))
    best = 0
    for x in jax.tree.leaves(nnx.state(m, nnx.Param)):
        if x.ndim >= 2 and x.shape[0] == plan.model.num_layers:
            best = max(best, math.prod(x.shape[1:]) * x.dtype.itemsize)
    return best


def _model_line(config) -> str:
    lora = f", LoRA r={config.lora.rank}" if config.lora is not None else ""
    return (f"{config.family} L={config.num_layers} D={config.hidden_size} "
            f"{jnp_name(config.dtype)}/{jnp_name(config.param_dtype)} remat={config.remat} "
            f"attention={config.attention_backend}{lora}")  # fmt: skip


def jnp_name(dt) -> str:
    import jax.numpy as jnp

    return jnp.dtype(dt).name


def main(argv: Sequence[str] | None = None) -> int:
    import logging

    from ac2_jax.config import ConfigError
    from ac2_jax.extras import MissingExtraError

    argv = sys.argv[1:] if argv is None else argv
    # The train step logs the memory plan's estimate against this host's memory (a
    # topology's devices report none); XLA's memory analysis per chip replaces it here.
    logging.getLogger("ac2_jax.models.memory_plan").setLevel(logging.ERROR)
    try:
        plan = build_plan(argv)
    except (UsageError, ConfigError, MissingExtraError) as e:
        print(f"ac2_jax.aot: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    report = run(plan)
    path = dict(a[2:].partition("=")[::2] for a in argv if a.startswith("--json="))
    if path.get("json"):
        with open(path["json"], "w") as f:
            json.dump(report, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
