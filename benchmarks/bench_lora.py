"""LoRA at real size: peak RSS and time of one RL step, LoRA vs full fine-tuning vs
transformers + peft (and tunix), and the adapter-only publish (issue 35).

Each case runs in its own child process (peak RSS = the child's VmHWM), one at a time
under a lock file shared with the other real-size benchmarks (``--lock``), started only
when /proc/meminfo's MemAvailable covers the case's estimated need, and killed by a
memory guard if the child's process tree grows past ``--rss_cap_gb`` (recorded, not
hidden):

* ``jax_full``: one RL step (benchmarks/bench_real_size's ``jax_rl`` problem:
  PolicyGradientLoss, PPO clip + TIS, task_mean, AdamW, fp32) training every weight,
  with the preset's runtime choices (experiments/real_size/qwen3.py: scanned layers,
  remat "full", block-sparse attention) and chunked log-probs (``--chunk``).
* ``jax_lora``: the same step on ``load_hf_checkpoint(..., lora=LoRAConfig(rank, alpha))``
  (adapters on all seven projections; the base frozen in fp32): the optimizer holds
  the adapters only, the base rides in the state's ``rest``.
* ``jax_lora_bf16``: the same with the base stored in bf16 (``base_dtype="bfloat16"``),
  compute in fp32.
* ``torch_peft``: transformers + torch + peft: ``get_peft_model`` with the same rank,
  alpha and seven target modules, cross-entropy on the same tokens, AdamW over the
  trainable params, grad-norm clip 1.0, fp32 (no gradient checkpointing).
* ``torch_peft_gc``: the same with transformers' gradient checkpointing (non-reentrant),
  the torch counterpart of the jax step's remat "full".
* ``tunix_lora``: the same LoRA step with tunix + qwix, in a separate virtualenv
  (``--tunix_python``): see ``_tunix_step``.
* ``publish`` (once per shape, two children): a learner process ``publish_weights`` the
  LoRA learner (adapters alone) and the full learner (scanned layout); then a sampler
  process ``load_published`` each into a sampler-side model (per-layer layout, or the
  stacked one with ``--serve_scan 1``; for the adapters a LoRA model on the same base):
  seconds, and bytes of each step directory.

Peak RSS: ``peak_rss_gb`` is the child's whole-life high-water mark; the train cases
also split it into ``load_peak_gb`` (loading the checkpoint, building the state) and
``step_peak_rss_gb`` (the steps alone: VmHWM is reset through /proc/self/clear_refs
after loading).

Rows report ``trainable_params`` (what the optimizer updates) and, for the jax cases,
``opt_state_values`` (every value in the AdamW state) and ``frozen_params`` (the rest).

    python -m benchmarks.bench_lora --variants default,1.7b --tokens 1024,4096
    python -m benchmarks.bench_lora --variants tiny --tokens 64 --chunk 16 --lock ''  (smoke)
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from benchmarks.bench_real_size import (  # noqa: E402
    _jax_problem,
    _tokens,
    argparse_hidden,
    peak_rss_bytes,
    step_memory,
)
from benchmarks.bench_real_size import _mark as _timeline_mark  # noqa: E402
from benchmarks.common import parser, print_table, write_json  # noqa: E402

CASES = ("jax_full", "jax_lora", "jax_lora_bf16", "torch_peft", "torch_peft_gc", "tunix_lora",
         "publish")
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GB = 1e9


# ---------------------------------------------------------------- shapes and needs


def _shape(variant: str) -> dict:
    from experiments.real_size import qwen3
    return qwen3.get_config(variant).shape.to_dict()


def param_count(shape: dict) -> int:
    """Parameters of a Qwen3 shape (tied embedding counted once)."""
    d, inter, n = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    q = shape["num_attention_heads"] * shape["head_dim"]
    kv = shape["num_key_value_heads"] * shape["head_dim"]
    per_layer = d * (q + 2 * kv) + q * d + 3 * d * inter + 2 * d + 2 * shape["head_dim"]
    emb = shape["vocab_size"] * d * (1 if shape.get("tie_word_embeddings", True) else 2)
    return emb + n * per_layer + d


def need_gb(case: str, shape: dict, tokens: int) -> float:
    """Rough peak RSS of a case (GB): what MemAvailable must cover before it starts.
    State bytes exactly, plus the process and activations (from the measured 0.6B
    rows in docs/notes/2026-12-05-lora-memory-time-publish-real-size.md; torch without checkpointing keeps every layer's activations)."""
    p, k = param_count(shape), tokens / 1024
    width = shape["hidden_size"] / 1024
    if case == "jax_full":
        return (16 * p) / GB + 1.5 + 0.5 * k * width
    if case in ("jax_lora", "tunix_lora"):
        return 4 * p / GB + 1.5 + 0.5 * k * width
    if case == "jax_lora_bf16":
        return 2 * p / GB + 1.5 + 0.5 * k * width
    if case == "torch_peft":
        return 4 * p / GB + 1.0 + 5.0 * k * width
    if case == "torch_peft_gc":
        return 4 * p / GB + 1.0 + 2.0 * k
    if case == "publish":
        return 8 * p / GB + 1.5
    return 1.0  # write_ckpt and the rest


# ---------------------------------------------------------------- children


def _mark(timeline: list, phase: str) -> None:
    """bench_real_size's mark, also printed to stderr: a child killed by the memory
    guard leaves its last phases in the row's error."""
    _timeline_mark(timeline, phase)
    print("MARK " + json.dumps(timeline[-1]), file=sys.stderr, flush=True)


def _reset_peak(timeline: list) -> float:
    """Ends the load phase: returns its high-water mark (GB) and resets VmHWM
    (/proc/self/clear_refs 5), so the peak read after the steps is the steps' own."""
    _mark(timeline, "load phase peak (VmHWM reset)")
    load_peak = peak_rss_bytes() / GB
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return load_peak


def _lora_config(args, bf16: bool):
    from ac2_jax.models.lora import LoRAConfig
    return LoRAConfig(rank=args.rank, alpha=args.alpha,
                      base_dtype="bfloat16" if bf16 else None)


def _size(tree) -> int:
    import jax
    return int(sum(x.size for x in jax.tree.leaves(tree)))


def _jax_step(args) -> dict:
    """bench_real_size's jax_rl step with or without adapters (`args.case`)."""
    import jax
    from flax import nnx

    from ac2_jax.models import load_hf_checkpoint
    from ac2_jax.models.decoder import Decoder
    from ac2_jax.models.io.hf_io import load_hf_config
    from ac2_jax.training import OptimizerConfig, create_train_state, make_train_step
    from ac2_jax.training.core import abstract_train_state
    from experiments.real_size import qwen3
    from experiments.real_size.checkpoint import preset_runtime

    timeline: list = []
    _mark(timeline, "start")
    lora = None if args.case == "jax_full" else _lora_config(args, args.case == "jax_lora_bf16")
    runtime = {**preset_runtime(qwen3.get_config(args.variant)), "lora": lora}
    # Full fine-tuning as bench_real_size runs it; adapters at a LoRA learning rate.
    opt = OptimizerConfig(learning_rate=1e-6 if lora is None else 1e-4, weight_decay=0.1,
                          clip_norm=1.0)
    config = load_hf_config(args.ckpt, **runtime)
    batch, extras, loss = _jax_problem("jax_rl", config, args.n, args.chunk)
    graphdef, abstract = abstract_train_state(lambda: Decoder(config, rngs=nnx.Rngs(0)), opt)
    step = make_train_step(graphdef, loss, opt)
    xla = step_memory(step, abstract, batch, extras)
    _mark(timeline, "abstract compile (memory_analysis)")
    t0 = time.perf_counter()
    model, config = load_hf_checkpoint(args.ckpt, **runtime)
    load_s = time.perf_counter() - t0
    _mark(timeline, "load checkpoint")
    graphdef, state = create_train_state(model, opt)
    del model
    counts = {"trainable_params": _size(state.params), "frozen_params": _size(state.rest),
              "opt_state_values": _size(state.opt_state),
              "base_dtype": str(jax.tree.leaves(state.rest)[0].dtype) if lora else "float32"}
    _mark(timeline, "create_train_state")
    state = step.place(state, copy=False)
    _mark(timeline, "place")
    load_peak = _reset_peak(timeline)
    times = []
    for i in range(args.steps):
        t0 = time.perf_counter()
        state, m = step(state, batch, extras)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
        _mark(timeline, f"step {i + 1}")
    return {"load_s": load_s, "load_peak_gb": load_peak, "first_step_s": times[0],
            "step_s": times[-1] if args.steps > 1 else None, "loss": float(m["loss"]),
            "grad_norm": float(m["grad_norm"]), "xla_bytes": xla, "rss_timeline": timeline,
            **counts, "lora": None if lora is None else lora.to_dict(),
            "config": {k: str(getattr(config, k)) for k in (
                "scan_layers", "remat", "attention_backend", "dtype")}}


def _torch_step(args, checkpointing: bool) -> dict:
    """transformers + peft LoRA: cross-entropy on the same tokens, AdamW, fp32."""
    import peft
    import torch
    import transformers

    timeline: list = []
    _mark(timeline, "start")
    t0 = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(args.ckpt, dtype=torch.float32)
    model.config.use_cache = False
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = peft.get_peft_model(model, peft.LoraConfig(
        r=args.rank, lora_alpha=args.alpha, target_modules=list(TARGETS), lora_dropout=0.0,
        bias="none", task_type="CAUSAL_LM"))
    load_s = time.perf_counter() - t0
    _mark(timeline, "load checkpoint + get_peft_model")
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1)
    ids = torch.from_numpy(_tokens(args.n, model.config.vocab_size).astype("int64"))[None]
    load_peak = _reset_peak(timeline)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        _mark(timeline, f"step {len(times)}")
    return {"load_s": load_s, "load_peak_gb": load_peak, "first_step_s": times[0],
            "step_s": times[-1] if args.steps > 1 else None, "loss": float(loss.detach()),
            "trainable_params": int(sum(p.numel() for p in params)),
            "frozen_params": int(sum(p.numel() for p in model.parameters()
                                     if not p.requires_grad)),
            "gradient_checkpointing": checkpointing, "torch_threads": torch.get_num_threads(),
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "peft": peft.__version__}, "rss_timeline": timeline}


def _tunix_step(args) -> dict:
    """The LoRA step as tunix runs it (run by --tunix_python: tunix's own virtualenv):
    tunix's Qwen3 from the same safetensors (fp32, remat of each decoder layer), qwix's
    LoRA (rank, alpha) on the seven projections, and PeftTrainer's train step: its
    default loss (cross-entropy over full logits), nnx.value_and_grad over the
    LoRAParams, nnx.Optimizer(wrt=LoRAParam) with clip 1.0 + AdamW, the optimizer
    donated, one row of the same tokens."""
    import jax
    import jax.numpy as jnp
    import optax
    import qwix
    from flax import nnx
    from tunix.models.qwen3 import model as qwen3_model
    from tunix.models.qwen3 import params as qwen3_params
    from tunix.sft import utils as sft_utils
    from tunix.sft.peft_trainer import _default_loss_fn

    timeline: list = []
    _mark(timeline, "start")
    with open(os.path.join(args.ckpt, "config.json")) as f:
        hf = json.load(f)
    rope = hf.get("rope_parameters") or {}
    config = qwen3_model.ModelConfig(
        num_layers=hf["num_hidden_layers"], vocab_size=hf["vocab_size"],
        embed_dim=hf["hidden_size"], hidden_dim=hf["intermediate_size"],
        num_heads=hf["num_attention_heads"], head_dim=hf["head_dim"],
        num_kv_heads=hf["num_key_value_heads"],
        rope_theta=int(rope.get("rope_theta", hf.get("rope_theta", 1_000_000))),
        norm_eps=hf["rms_norm_eps"], use_tied_embedding=hf.get("tie_word_embeddings", True),
        remat_config=qwen3_model.RematConfig.DECODER)
    t0 = time.perf_counter()
    base = qwen3_params.create_model_from_safe_tensors(args.ckpt, config, dtype=jnp.float32)
    _mark(timeline, "load checkpoint")
    provider = qwix.LoraProvider(module_path="|".join(f".*{t}" for t in TARGETS),
                                 rank=args.rank, alpha=args.alpha)
    model = qwix.apply_lora_to_model(base, provider, **base.get_model_input())
    del base
    load_s = time.perf_counter() - t0
    _mark(timeline, "apply_lora_to_model")
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-4, weight_decay=0.1))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.LoRAParam)
    _mark(timeline, "optimizer")

    def train_step(model, optimizer, inputs):  # PeftTrainer._train_step, LoRA enabled
        grad_fn = nnx.value_and_grad(_default_loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam))
        loss, grads = grad_fn(model, **inputs)
        optimizer.update(model, grads)
        return loss, optax.global_norm(grads)

    step = nnx.jit(train_step, donate_argnames=("optimizer",))
    ids = jnp.asarray(_tokens(args.n, hf["vocab_size"]))[None]
    mask = jnp.ones_like(ids, dtype=jnp.bool_)
    inputs = {"input_tokens": ids, "input_mask": mask,
              "positions": sft_utils.build_positions_from_mask(mask),
              "attention_mask": sft_utils.make_causal_attn_mask(mask)}
    load_peak = _reset_peak(timeline)
    times = []
    # nnx.jit traces the step again on its second call (measured: the tiny preset's
    # step 2 took as long as step 1, steps 3-4 were fast), so "next step" is step 3.
    for i in range(args.steps + (args.steps > 1)):
        t0 = time.perf_counter()
        loss, gnorm = step(model, optimizer, inputs)
        jax.block_until_ready(loss)
        times.append(time.perf_counter() - t0)
        _mark(timeline, f"step {i + 1}")
        _partial({"step_times": times})
    lora = nnx.state(model, nnx.LoRAParam)
    from importlib.metadata import version
    return {"load_s": load_s, "load_peak_gb": load_peak, "first_step_s": times[0],
            "step_s": times[-1] if args.steps > 1 else None, "step_times": times,
            "loss": float(loss), "grad_norm": float(gnorm), "trainable_params": _size(lora),
            "frozen_params": _size(nnx.state(model, nnx.Not(nnx.LoRAParam))),
            "versions": {p: version(p) for p in ("google-tunix", "qwix", "jax", "flax")},
            "rss_timeline": timeline}


def _dir_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total


def _partial(fields: dict) -> None:
    """Figures a child has so far, on stderr: a child the memory guard kills later
    still reports them (`run_child`)."""
    print("PARTIAL " + json.dumps(fields), file=sys.stderr, flush=True)


def _adapter_sum(model) -> float:
    import jax
    import numpy as np

    from ac2_jax.models.lora import adapter_params
    return sum(float(np.asarray(x, np.float64).sum())
               for x in jax.tree.leaves(adapter_params(model)))


def _publish_learner(args) -> dict:
    """The learner side of `publish`: publish_weights of the LoRA learner (adapters
    alone) and of the full learner (scanned layout) into args.publish_dir."""
    import jax
    from flax import nnx

    from ac2_jax.models import load_hf_checkpoint
    from ac2_jax.models.io.params_io import publish_weights
    from ac2_jax.models.io.peft_io import add_lora
    from ac2_jax.models.lora import adapter_params
    from experiments.real_size import qwen3
    from experiments.real_size.checkpoint import preset_runtime

    timeline: list = []
    _mark(timeline, "start")
    learner, _ = load_hf_checkpoint(args.ckpt, **preset_runtime(qwen3.get_config(args.variant)))
    learner_lora = add_lora(learner, _lora_config(args, False), seed=1)
    # Adapters that are not the fresh B = 0 ones, so the sampler's copy is checked.
    state = nnx.state(learner_lora, nnx.LoRAParam)
    nnx.update(learner_lora, jax.tree.map(lambda x: x + 0.01, state))
    _mark(timeline, "learner loaded")
    out: dict = {"learner_timeline": timeline, "adapter_sum": _adapter_sum(learner_lora),
                 "trainable_params": _size(adapter_params(learner_lora))}
    for kind, model in (("lora", learner_lora), ("full", learner)):
        times = []
        for i in range(args.publish_repeats):
            t0 = time.perf_counter()
            step_dir = publish_weights(model, os.path.join(args.publish_dir, kind), step=i,
                                       keep=1)
            times.append(time.perf_counter() - t0)
        out[f"{kind}_publish_s"] = times
        out[f"{kind}_bytes"] = _dir_bytes(step_dir)
        _mark(timeline, f"publish {kind}")
        _partial({f"{kind}_publish_s": times, f"{kind}_bytes": out[f"{kind}_bytes"]})
    return out


def _publish_sampler(args) -> dict:
    """The sampler side of `publish` (its own process, as a sampler is):
    load_published of the adapters into a LoRA model on the same base, and of the
    full step into the plain model; per-layer layout unless --serve_scan 1."""
    import jax
    from flax import nnx

    from ac2_jax.models import load_hf_checkpoint
    from ac2_jax.models.io.params_io import load_published
    from ac2_jax.models.io.peft_io import add_lora
    from experiments.real_size import qwen3
    from experiments.real_size.checkpoint import preset_runtime

    timeline: list = []
    _mark(timeline, "start")
    runtime = preset_runtime(qwen3.get_config(args.variant))
    sampler, _ = load_hf_checkpoint(args.ckpt, **{**runtime,
                                                 "scan_layers": bool(args.serve_scan)})
    sampler_lora = add_lora(sampler, _lora_config(args, False), seed=2)
    _mark(timeline, "sampler loaded")
    out: dict = {"sampler_timeline": timeline, "serve_scan": bool(args.serve_scan)}
    for kind, model in (("lora", sampler_lora), ("full", sampler)):
        times = []
        for _ in range(args.publish_repeats):
            t0 = time.perf_counter()
            load_published(model, os.path.join(args.publish_dir, kind))
            jax.block_until_ready(nnx.state(model))
            times.append(time.perf_counter() - t0)
        out[f"{kind}_load_s"] = times
        _mark(timeline, f"load_published {kind}")
        _partial({f"{kind}_load_s": times})
    out["adapter_sum"] = _adapter_sum(sampler_lora)
    return out


def publish_row(learner: dict, sampler: dict) -> dict:
    """The publish row from its two children: bytes, seconds, ratios."""
    out = {k: v for k, v in learner.items() if k not in ("peak_rss_gb", "adapter_sum")}
    out.update({k: v for k, v in sampler.items() if k not in ("peak_rss_gb", "adapter_sum")})
    out["learner_peak_rss_gb"] = learner["peak_rss_gb"]
    out["sampler_peak_rss_gb"] = sampler["peak_rss_gb"]
    out["peak_rss_gb"] = max(learner["peak_rss_gb"], sampler["peak_rss_gb"])
    want, got = learner["adapter_sum"], sampler["adapter_sum"]
    out["adapter_roundtrip_ok"] = bool(abs(got - want) <= 1e-6 * max(1.0, abs(want)))
    for kind in ("lora", "full"):
        out[f"{kind}_publish_to_serve_s"] = min(out[f"{kind}_publish_s"]) + min(
            out[f"{kind}_load_s"])
    out["bytes_ratio"] = out["lora_bytes"] / out["full_bytes"]
    out["time_ratio"] = out["lora_publish_to_serve_s"] / out["full_publish_to_serve_s"]
    return out


def _write_ckpt(args) -> dict:
    from experiments.real_size.checkpoint import write_random_checkpoint
    t0 = time.perf_counter()
    write_random_checkpoint(_shape(args.variant), args.ckpt)
    return {"write_s": time.perf_counter() - t0}


def child(args) -> dict:
    if args.case == "write_ckpt":
        out = _write_ckpt(args)
    elif args.case == "publish_learner":
        out = _publish_learner(args)
    elif args.case == "publish_sampler":
        out = _publish_sampler(args)
    elif args.case in ("torch_peft", "torch_peft_gc"):
        out = _torch_step(args, args.case == "torch_peft_gc")
    elif args.case == "tunix_lora":
        out = _tunix_step(args)
    else:
        out = _jax_step(args)
    # The process's peak: the load phase's (before the reset) or the steps' (after it).
    if "load_peak_gb" in out:
        out["step_peak_rss_gb"] = peak_rss_bytes() / GB
    out["peak_rss_gb"] = max(peak_rss_bytes() / GB, out.get("load_peak_gb", 0.0))
    return out


# ---------------------------------------------------------------- the parent


def mem_available_gb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 / GB
    return 0.0


def mem_total_gb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024 / GB
    return 0.0


def tree_rss_gb(pid: int) -> float:
    """VmRSS summed over `pid` and its descendants (GB)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    tree, frontier = {pid}, [pid]
    while frontier:
        p = frontier.pop()
        for c, pp in parents.items():
            if pp == p and c not in tree:
                tree.add(c)
                frontier.append(c)
    total = 0
    for p in tree:
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total / GB


class _Lock:
    """flock(2) on the shared real-size lock file (flock(1) uses the same lock)."""

    def __init__(self, path: str):
        self.path, self.f = path, None

    def __enter__(self):
        if self.path:
            self.f = open(self.path, "a")
            fcntl.flock(self.f, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        if self.f is not None:
            fcntl.flock(self.f, fcntl.LOCK_UN)
            self.f.close()


def run_child(cmd: list, need: float, args, python: str | None = None) -> dict:
    """Runs one child under the lock once MemAvailable covers `need`, with a memory guard.
    Returns the child's RESULT dict or {"error": ...}."""
    t_wait = time.time()
    with _Lock(args.lock):
        waited_lock = time.time() - t_wait
        while mem_available_gb() < need + args.headroom_gb:
            if time.time() - t_wait > args.wait_s:
                return {"error": f"MemAvailable {mem_available_gb():.1f} GB stayed below the "
                                 f"case's need {need:.1f} + {args.headroom_gb} GB for "
                                 f"{args.wait_s} s"}
            time.sleep(15)
        full = [python or sys.executable, "-m", "benchmarks.bench_lora"] + cmd
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            proc = subprocess.Popen(full, stdout=out, stderr=err, text=True,
                                    start_new_session=True)
            t0, killed, top = time.time(), None, 0.0
            while True:
                try:  # the guard samples every second; an ended child is seen at once
                    proc.wait(timeout=1.0)
                    break
                except subprocess.TimeoutExpired:
                    pass
                rss = tree_rss_gb(proc.pid)
                top = max(top, rss)
                if rss > args.rss_cap_gb or mem_available_gb() < args.min_free_gb:
                    killed = (f"killed by the memory guard at {rss:.1f} GB of child RSS "
                              f"(cap {args.rss_cap_gb} GB; MemAvailable "
                              f"{mem_available_gb():.1f} GB)")
                elif time.time() - t0 > args.timeout:
                    killed = f"timeout after {args.timeout}s"
                if killed:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    break
            out.seek(0)
            err.seek(0)
            stdout, stderr = out.read(), err.read()
    row = {"wall_s": round(time.time() - t0, 1), "waited_for_lock_s": round(waited_lock, 1),
           "loadavg": os.getloadavg()[0]}
    if killed:
        marks = [x[5:] for x in stderr.splitlines() if x.startswith("MARK ")][-3:]
        for x in stderr.splitlines():
            if x.startswith("PARTIAL "):
                row.update(json.loads(x[8:]))
        return {**row, "error": killed + (f"; last phases [phase, VmRSS, VmHWM]: "
                                          f"{', '.join(marks)}" if marks else ""),
                "guard_max_rss_gb": round(top, 2)}
    line = [x for x in stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode == 0 and line:
        return {**row, **json.loads(line[-1][7:])}
    return {**row, "error": f"exit {proc.returncode}: {stderr[-600:]}"}


def _run_publish(cmd: list, need: float, args) -> dict:
    """The learner child publishes, then the sampler child loads (one after the other,
    each its own process)."""
    work = tempfile.mkdtemp(prefix="ac2_lora_publish_", dir=args.work_dir)
    try:
        sides = {}
        for side in ("learner", "sampler"):
            side_cmd = [x if x != "publish" else f"publish_{side}" for x in cmd]
            sides[side] = run_child(side_cmd + ["--publish_dir", work], need, args)
            if "error" in sides[side]:  # what the sides measured before it, kept
                kept = {k: v for k, v in sides.get("learner", {}).items() if side != "learner"}
                return {**kept, **{k: v for k, v in sides[side].items() if k != "error"},
                        "error": f"{side}: {sides[side]['error']}"}
        row = publish_row(sides["learner"], sides["sampler"])
        row["wall_s"] = sides["learner"]["wall_s"] + sides["sampler"]["wall_s"]
        return row
    finally:
        subprocess.run(["rm", "-rf", work], check=False)


def _checkpoint(variant: str, args) -> str:
    path = os.path.join(args.ckpt_dir, variant)
    if not os.path.exists(os.path.join(path, "config.json")):
        cmd = ["--child", "1", "--case", "write_ckpt", "--variant", variant, "--ckpt", path]
        res = run_child(cmd, 3.0 + 6 * param_count(_shape(variant)) / GB, args)
        if "error" in res:
            raise SystemExit(f"writing the {variant} checkpoint failed: {res['error']}")
    return path


def main(argv=None):
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--variants", default="default,1.7b",
                   help="experiments/real_size/qwen3.py variants (shapes)")
    p.add_argument("--tokens", default="1024,4096")
    p.add_argument("--cases", default="jax_full,jax_lora,jax_lora_bf16,torch_peft,"
                                      "torch_peft_gc,tunix_lora,publish")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--chunk", type=int, default=256,
                   help="log-prob chunk (0: dense logits; 256 is what the memory plan's \"auto\" "
                        "picks at these shapes)")
    p.add_argument("--steps", type=int, default=2, help="train steps per case (the first compiles)")
    p.add_argument("--publish_repeats", type=int, default=2)
    p.add_argument("--serve_scan", type=int, default=0,
                   help="publish: 1 loads into a sampler-side model of the learner's stacked "
                        "layout (0: per-layer, the CPU sampler's; loading a full step then "
                        "converts the layout)")
    p.add_argument("--ckpt_dir", default="/tmp/ac2_lora_ckpts",
                   help="random HF checkpoints, one folder per variant (written if missing)")
    p.add_argument("--work_dir", default=None, help="where publish writes (default: $TMPDIR)")
    p.add_argument("--lock", default="/tmp/ac2_realsize.lock",
                   help="lock file shared by real-size runs ('' for none)")
    p.add_argument("--headroom_gb", type=float, default=1.5)
    p.add_argument("--wait_s", type=int, default=3600, help="how long to wait for memory")
    p.add_argument("--rss_cap_gb", type=float, default=None,
                   help="memory guard: kill a child past this RSS (default MemTotal - 2.5 GB)")
    p.add_argument("--min_free_gb", type=float, default=0.8,
                   help="memory guard: kill a child when MemAvailable falls below this")
    p.add_argument("--timeout", type=int, default=3600)
    p.add_argument("--tunix_python", default="/tmp/tunix_venv/bin/python")
    p.add_argument("--child", default=None, help=argparse_hidden())
    p.add_argument("--case", default=None, help=argparse_hidden())
    p.add_argument("--variant", default="default", help=argparse_hidden())
    p.add_argument("--ckpt", default=None, help=argparse_hidden())
    p.add_argument("--n", type=int, default=0, help=argparse_hidden())
    p.add_argument("--publish_dir", default=None, help=argparse_hidden())
    args = p.parse_args(argv)
    if args.child:
        print("RESULT " + json.dumps(child(args)), flush=True)
        return None
    if args.rss_cap_gb is None:
        args.rss_cap_gb = round(mem_total_gb() - 2.5, 1)
    cases = args.cases.split(",")
    for case in cases:
        if case not in CASES:
            raise SystemExit(f"unknown case {case!r}; choose from {CASES}")
    rows = []

    def emit(row):
        rows.append(row)
        print(json.dumps(row), flush=True)
        write_json(args.out, {"benchmark": "lora", "rank": args.rank, "alpha": args.alpha,
                              "chunk": args.chunk, "steps": args.steps, "rows": rows})

    for variant in args.variants.split(","):
        shape = _shape(variant)
        ckpt = _checkpoint(variant, args)
        for case in cases:
            for n in ([0] if case == "publish" else [int(x) for x in args.tokens.split(",")]):
                need = need_gb(case, shape, n)
                row = {"case": case, "variant": variant, "params": param_count(shape),
                       "tokens": n or None, "need_gb": round(need, 1)}
                if need > args.rss_cap_gb:
                    row["error"] = (f"does not fit: needs ~{need:.1f} GB (train state alone "
                                    f"{16 * param_count(shape) / GB:.1f} GB)" if case ==
                                    "jax_full" else f"does not fit: needs ~{need:.1f} GB") + (
                        f" > the {args.rss_cap_gb} GB cap of this {mem_total_gb():.1f} GB box")
                    emit(row)
                    continue
                if case == "tunix_lora" and not os.path.exists(args.tunix_python):
                    row["error"] = f"no tunix virtualenv at {args.tunix_python}"
                    emit(row)
                    continue
                cmd = ["--child", "1", "--case", case, "--n", str(n), "--ckpt", ckpt,
                       "--variant", variant, "--chunk", str(args.chunk), "--steps",
                       str(args.steps), "--rank", str(args.rank), "--alpha", str(args.alpha),
                       "--publish_repeats", str(args.publish_repeats),
                       "--serve_scan", str(args.serve_scan)]
                if args.work_dir:
                    cmd += ["--work_dir", args.work_dir]
                python = args.tunix_python if case == "tunix_lora" else None
                if case == "publish":
                    row.update(_run_publish(cmd, need, args))
                else:
                    row.update(run_child(cmd, need, args, python))
                emit(row)
    print_table(rows, ["case", "variant", "tokens", "peak_rss_gb", "first_step_s", "step_s",
                       "trainable_params", "lora_bytes", "full_bytes", "error"])
    return rows


if __name__ == "__main__":
    main()
