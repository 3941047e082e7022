"""The whole RL loop side by side: this library vs TRL vs tunix on one agent task (issue 66).

Every system runs GRPO steps of the same calculator tool loop
(`benchmarks/peers/task.py`: system prompt, forced tool call, the tool's answer,
final answer; `--turns` assistant turns of `--max_tokens` tokens each), on the
same Qwen3-shaped random checkpoint (written once here as an HF directory every
system loads: `small` and `medium`, the train-step benchmark's sizes with the
tokenizer's vocabulary), with the same tasks, group size, temperature 1,
AdamW (lr 1e-6, betas 0.9/0.999, no weight decay, clip 1.0), no KL, one
update per step. Each system runs in its own process (peers in their own venv:
`--peer_python trl=/path/bin/python,tunix=/path/bin/python`), `--warmup` steps
first (compiles: timed and reported apart), then `--steps` timed steps. Per
step: wall time split into rollout / scoring / update / weight hand-off,
tokens sampled and trained, peak RSS of the process.

Equal work is checked, not assumed: the checkpoint makes stop tokens (and every
token that does not decode to printable ASCII) unsampleable (their lm-head
row carries -A on a dimension every hidden state carries +A on), so every
turn of every system samples exactly max_tokens tokens; the table says per
system how far its sampled and trained tokens per step are from this
library's (`--tolerance`).

Cost growth (this library; `--growth`): step time against attempts per task
(1 -> 32), turns per attempt (1 -> 16) and context (a long system prompt:
512 -> 8k tokens), in a PNG beside the JSON (matplotlib) with the peers' points
where they ran the same setting. The limit: per step a lower bound from this
machine's measured ceilings (bytes of weights read per decode step over the
measured memory bandwidth, plus the update's FLOPs over the best fp32 GEMM
rate), and the fraction of it the loop reaches.

    python -m benchmarks.bench_loop_race --out bench_results/loop_race.json \\
        --peer_python trl=VENVS/trl/bin/python,tunix=VENVS/tunix/bin/python
    python -m benchmarks.bench_loop_race --quick   # this library only, toy sizes
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from benchmarks.common import WIDTHS  # noqa: E402 (stdlib only)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# The train-step benchmark's sizes (benchmarks.common.WIDTHS), vocab from the tokenizer.
SIZES = {
    # The pipeline's test and --quick: the fewest layers and widths it runs with.
    "toy": dict(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                num_kv_heads=1, head_dim=16),
    "small": WIDTHS["small"],
    "medium": WIDTHS["medium"],
}
TOKENIZER_VOCAB = 2044  # BPE merges + 4 tool tokens: the model's vocabulary is the tokenizer's
SUPPRESS = 10.0  # the embedding's dimension-0 value (+ allowed tokens, - the rest)
LR, B1, B2, CLIP = 1e-6, 0.9, 0.999, 1.0
SYSTEM_PROMPT = "Use the calculator tool, then give the answer."
TOOL = {"type": "function", "function": {
    "name": "calculator",
    "description": "Evaluate an integer arithmetic expression (+ - * and parentheses).",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}


# ----------------------------------------------------------------------------- checkpoint
def allowed_tokens(tokenizer) -> list[int]:
    """Token ids a sampler may draw: not special, and decoding (alone) to printable ASCII."""
    special = set(tokenizer.all_special_ids) | set(tokenizer.get_added_vocab().values())
    out = []
    for i in range(len(tokenizer)):
        if i in special:
            continue
        s = tokenizer.decode([i])
        if s and all(32 <= ord(ch) < 127 for ch in s):
            out.append(i)
    return out


def write_checkpoint(path: str, size: str, seed: int = 0, vocab: int = TOKENIZER_VOCAB) -> dict:
    """A Qwen3-shaped random checkpoint + the tiny ChatML tokenizer as an HF directory.

    Weights: this library's random init (seed), untied embeddings, then input
    embedding dimension 0 set to +SUPPRESS for every token (every hidden state
    then carries a large positive dimension 0) and the lm head's dimension 0 to
    +SUPPRESS for allowed tokens, -SUPPRESS for the rest: a disallowed token's
    logit is ~ 2 x SUPPRESS x sqrt(hidden) below the allowed ones (never
    sampled), and the allowed ones stay near-uniform. Returns
    {"path", "vocab", "allowed"}.
    """
    import numpy as np
    from flax import nnx
    from safetensors.numpy import load_file, save_file

    from ac2_jax.models import Decoder, DecoderConfig
    from ac2_jax.models.io.hf_io import save_hf_checkpoint
    from ac2_jax.text.tiny_tokenizer import build_tiny_tokenizer

    tok_dir = os.path.join(path, "_tok")
    build_tiny_tokenizer(tok_dir, vocab_size=vocab)
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(tok_dir)
    vocab = len(hf_tok)
    cfg = DecoderConfig(vocab_size=vocab, tie_embeddings=False, qk_norm=True,
                        rope_theta=10000.0, max_position_embeddings=16384, **SIZES[size])
    save_hf_checkpoint(Decoder(cfg, rngs=nnx.Rngs(seed)), path)
    hf_tok.save_pretrained(path)
    allowed = allowed_tokens(hf_tok)
    f = os.path.join(path, "model.safetensors")
    tensors = load_file(f)
    emb = tensors["model.embed_tokens.weight"].copy()
    emb[:, 0] = SUPPRESS  # every input token: every hidden state carries +dim 0
    head = tensors["lm_head.weight"].copy()
    head[:, 0] = -SUPPRESS
    head[np.asarray(allowed), 0] = SUPPRESS  # output side: only allowed tokens score high
    tensors["model.embed_tokens.weight"], tensors["lm_head.weight"] = emb, head
    save_file(tensors, f, metadata={"format": "pt"})
    return {"path": path, "vocab": vocab, "allowed": len(allowed)}


def make_tasks(n: int, seed: int = 0) -> list[dict]:
    """n calculator tasks (CalculatorEnv's, 4-digit answers: every prompt one length)."""
    from ac2_jax.envs.calculator import CalculatorEnv

    env = CalculatorEnv(num_range=(10, 99), answer_digits=4)
    return [{"task_id": t.task_id, "prompt": t.prompt, "answer": t.answer,
             "expression": t.metadata["expression"]} for t in env.sample_tasks(n, seed)]


def system_prompt(context: int = 0, phrases: int | None = None) -> str:
    """The task's system prompt; with `phrases`, padded by that many short notes (the
    context-growth curve: a long fixed preamble, as a real agent's; `make_spec` picks
    the count that brings the prompt to about `context` tokens)."""
    if not context:
        return SYSTEM_PROMPT
    n = context if phrases is None else phrases
    filler = " ".join(f"rule{i % 97} holds." for i in range(n))
    return SYSTEM_PROMPT + " Reference notes: " + filler


# ----------------------------------------------------------------------------- this library
def _race_env(spec: dict):
    """The race's task as an ac2_jax Env whose harness is the forced tool loop."""
    from ac2_jax.envs.base import Env, Task, Tool
    from ac2_jax.orchestration.base import Orchestrator
    from benchmarks.peers.task import reward

    turns = spec["turns"]

    class ForcedToolLoop(Orchestrator):
        """`turns` requests; after each but the last, the calculator's answer comes
        back as a tool message (the call is made for the model: see peers/task.py)."""

        async def run(self, turn_input: str) -> None:
            msgs = self.trace.messages
            msgs.append({"role": "user", "content": turn_input})
            for t in range(turns):
                resp = await self.complete(msgs, tools=[TOOL])
                self.trace.count_step("main")
                text = resp.choices[0].message.content or ""
                msgs.append({"role": "assistant", "content": text})
                if t < turns - 1:
                    msgs.append({"role": "tool", "content": str(self.trace.task.answer)})
                    self.trace.metrics["tool_calls"] += 1
                else:
                    self.trace.answer = text
            self.trace.status = "finished"

    class RaceEnv(Env):
        name = "loop_race"
        system_prompt = spec["system_prompt"]
        reward_range = (0.0, 1.5)

        def sample_tasks(self, n, seed, split="train"):
            # The same tasks every step (every system does so); eval ids kept apart.
            return [Task(task_id=f"{split}:{t['task_id']}", prompt=t["prompt"],
                         answer=t["answer"], domain=self.name,
                         metadata={"expression": t["expression"]})
                    for t in spec["tasks"][:n]]

        @property
        def tools(self):
            return [Tool(name="calculator", description=TOOL["function"]["description"],
                         parameters=TOOL["function"]["parameters"], fn=lambda expression: "")]

        def verify(self, task, answer):
            return reward(answer, task.answer)

        def make_harness(self, task, client, model_name, sampling, max_steps):
            return ForcedToolLoop(self, task, client, model_name, max_steps=turns,
                                  max_context_tokens=None, sampling=sampling)

    return RaceEnv()


class _CompileClock:
    """JAX compile events (trace, lower, backend compile) with their wall-clock end."""

    EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
              "/jax/core/compile/jaxpr_to_mlir_module_duration",
              "/jax/core/compile/backend_compile_duration")

    def __init__(self):
        self.events: list[tuple[float, float]] = []

    def __call__(self, event: str, duration: float, **_) -> None:
        if event in self.EVENTS:
            self.events.append((time.time(), duration))

    def between(self, start: float, end: float) -> float:
        return sum(d for t, d in self.events if start < t <= end)


def _compile_clock() -> _CompileClock:
    import jax.monitoring

    clock = _CompileClock()
    jax.monitoring.register_event_duration_secs_listener(clock)
    return clock


def run_ac2(spec: dict) -> dict:
    """This library's loop: `recipes.arl` (endpoint + JaxSampler + RLTrainer) on the race env."""
    from ac2_jax import recipes
    from ac2_jax.config import from_config
    from ac2_jax.recipes.config import RLRecipeConfig
    from benchmarks.peers.task import peak_rss_mb

    work = tempfile.mkdtemp(prefix="loop_race_ac2_")
    n = spec["tasks_per_step"] * spec["attempts"]
    seq = spec["seq_len"]
    cfg = from_config(RLRecipeConfig, {
        "seed": spec["seed"],
        "paths": {"workdir": work},
        "rl": {"steps": spec["warmup"] + spec["steps"], "tasks_per_step": spec["tasks_per_step"],
               "attempts_per_task": spec["attempts"], "concurrency": n,
               "batch": {"seq_len": seq, "rows": n, "layout": spec.get("layout", "flat")},
               "loss": {"entropy": False},
               "optimizer": {"learning_rate": LR, "b1": B1, "b2": B2, "weight_decay": 0.0,
                             "clip_norm": CLIP},
               # 1: a checkpoint (and, memory hand-off, a folder write) after every step.
               "checkpoint_every": spec.get("checkpoint_every", 1)},
        "rollout": {"max_tokens": spec["max_tokens"], "max_steps": spec["turns"],
                    "temperature": 1.0},
        "sampler": {"max_context": spec["max_context"],
                    "warmup": spec.get("sampler_warmup", True),
                    "hand_off": spec.get("hand_off", "memory")},
        "log": {"progress": False, "report_files": False, "tensorboard": False},
    })
    compiles = _compile_clock()
    t0 = time.perf_counter()
    asyncio.run(recipes.arl(spec["checkpoint"], _race_env(spec), cfg))
    total = time.perf_counter() - t0
    steps, last = [], None
    with open(os.path.join(cfg.paths.resolved().metrics, "metrics.jsonl")) as f:
        for line in f:
            m = json.loads(line)
            if "train/time_step_s" not in m:
                continue
            # Wall between two steps' records: the step plus its checkpoint write.
            between = m["time"] - last if last is not None else None
            last = m["time"]
            g = lambda k, m=m: m.get(f"train/{k}", 0.0)  # noqa: E731
            trained = sum(v for k, v in m.items() if k.startswith("train/trained_tokens/"))
            steps.append({
                "rollout_s": g("time_sampling_s"), "scoring_s": 0.0,
                "update_s": g("time_training_s"), "handoff_s": g("time_publishing_s"),
                "step_s": g("time_step_s"),
                "sampled_tokens": g("sampler/output_tokens"),
                "prefill_tokens": g("sampler/prefill_tokens"),
                "cached_tokens": g("sampler/cached_tokens"),
                "decode_s": g("sampler/decode_s"), "prefill_s": g("sampler/prefill_s"),
                "trained_tokens": trained, "between_steps_s": between,
                # JAX compile seconds since the previous step's record (a timed step
                # that compiles is not a steady-state step; the growth table shows it).
                "compile_s": compiles.between(m["time"] - (between or m["time"]), m["time"])})
    return {"system": "ac2_jax", "steps": steps, "total_s": total, "peak_rss_mb": peak_rss_mb(),
            "notes": "scoring (the verifier) runs inside each attempt, in rollout_s; "
                     "checkpoint writes (every step) are outside the timed phases"}


def run_ac2_many(specs: list[dict]) -> list[dict]:
    """Several runs of this library's loop in one process (the growth curves)."""
    return [run_ac2(s) for s in specs]


# ----------------------------------------------------------------------------- driver
def attempt_tokens(ckpt: str, spec: dict) -> dict:
    """Per attempt: prompt tokens, tool-suffix tokens and the sequence length of a full attempt."""
    from transformers import AutoTokenizer

    from benchmarks.peers.task import first_messages

    tok = AutoTokenizer.from_pretrained(ckpt)
    task = spec["tasks"][0]
    prompt = len(tok.apply_chat_template(first_messages(spec, task), tools=[TOOL],
                                         add_generation_prompt=True, tokenize=True,
                                         return_dict=False))
    mark = "\u2063XQX\u2063"
    text = tok.apply_chat_template(
        first_messages(spec, task) + [{"role": "assistant", "content": mark},
                                      {"role": "tool", "content": str(task["answer"])}],
        tools=[TOOL], tokenize=False, add_generation_prompt=True)
    suffix = len(tok.encode(text.split(mark, 1)[1], add_special_tokens=False))
    turns, m = spec["turns"], spec["max_tokens"]
    return {"prompt": prompt, "suffix": suffix,
            "seq": prompt + turns * m + (turns - 1) * suffix}


def make_spec(ckpt: str, *, tasks_per_step: int, attempts: int, turns: int, max_tokens: int,
              warmup: int, steps: int, context: int = 0, seed: int = 0) -> dict:
    """The spec every system's runner reads (JSON): checkpoint, tasks, sizes, settings."""
    spec = {"checkpoint": ckpt, "seed": seed, "warmup": warmup, "steps": steps,
            "tasks_per_step": tasks_per_step, "attempts": attempts, "turns": turns,
            "max_tokens": max_tokens, "system_prompt": system_prompt(context),
            "tasks": make_tasks(max(tasks_per_step, 16), seed), "tool": TOOL,
            "lr": LR, "b1": B1, "b2": B2, "clip": CLIP, "context": context}
    if context:  # pad the prompt to about `context` tokens
        probe = 256
        base = attempt_tokens(ckpt, dict(spec, system_prompt=system_prompt(context, 0)))
        more = attempt_tokens(ckpt, dict(spec, system_prompt=system_prompt(context, probe)))
        per = (more["prompt"] - base["prompt"]) / probe
        n = max(0, int((context - base["prompt"]) / per))
        spec["system_prompt"] = system_prompt(context, n)
    shape = attempt_tokens(ckpt, spec)
    seq = 64 * -(-shape["seq"] // 64)
    spec.update(prompt_tokens=shape["prompt"], suffix_tokens=shape["suffix"],
                seq_len=seq, max_context=seq + 64)
    return spec


def run_system(system: str, spec: dict, work: str, python: str | None) -> dict:
    """One system's run in its own process; returns its result JSON (or an error record)."""
    tag = f"{system}-{abs(hash(json.dumps(spec, sort_keys=True))) % 10**8}"
    spec_path, out_path = os.path.join(work, f"{tag}.spec.json"), os.path.join(work, f"{tag}.json")
    with open(spec_path, "w") as f:
        json.dump(spec if system != "ac2_many" else {"specs": spec}, f)
    if system in ("ac2", "ac2_many"):
        cmd = [sys.executable, "-m", "benchmarks.bench_loop_race", "--_run", system,
               spec_path, out_path]
    else:
        cmd = [python, os.path.join(HERE, "peers", f"{system}_runner.py"), spec_path, out_path]
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    if system not in ("ac2", "ac2_many"):
        env.pop("XLA_FLAGS", None)  # this repo's flags are for its own jax
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall, load1 = time.perf_counter() - t0, os.getloadavg()[0]
    if proc.returncode != 0 or not os.path.exists(out_path):
        tail = (proc.stderr or proc.stdout)[-1500:]
        return {"system": system, "error": f"exit {proc.returncode}: {tail}", "process_s": wall}
    with open(out_path) as f:
        out = json.load(f)
    if isinstance(out, list):
        return out
    out["process_s"] = wall
    out["load_avg"] = [load0, load1]  # the machine's 1-min load before / after (shared box)
    return out


def summarize(result: dict, warmup: int) -> dict:
    """Mean of the timed steps (after `warmup`), and the warm-up steps' own time."""
    steps = result["steps"]
    timed, warm = steps[warmup:], steps[:warmup]
    keys = ("rollout_s", "scoring_s", "update_s", "handoff_s", "step_s",
            "sampled_tokens", "trained_tokens", "compile_s")
    mean = {k: sum(s.get(k, 0.0) for s in timed) / len(timed) for k in keys}
    mean["warmup_s"] = sum(s["step_s"] for s in warm)
    mean["sampled_per_s"] = mean["sampled_tokens"] / mean["step_s"]
    mean["trained_per_s"] = mean["trained_tokens"] / mean["step_s"]
    mean["peak_rss_mb"] = result.get("peak_rss_mb")
    mean["startup_s"] = result.get("process_s", 0.0) - sum(s["step_s"] for s in steps)
    mean["load_avg"] = result.get("load_avg")
    return mean


def equal_work(row: dict, ref: dict, tolerance: float) -> dict:
    """Sampled / trained tokens per step against the reference row's, within `tolerance`."""
    out = {}
    for k in ("sampled_tokens", "trained_tokens"):
        rel = abs(row[k] - ref[k]) / max(ref[k], 1)
        out[k.split("_")[0] + "_diff"] = rel
    out["equal_work"] = all(v <= tolerance for v in out.values())
    return out


# ----------------------------------------------------------------------------- the limit
def measured_ceilings(seconds: float = 0.5) -> dict:
    """This machine's memory bandwidth (numpy copy of 256 MB: read + write bytes / s)
    and best fp32 GEMM rate (XLA and numpy's BLAS, n = 1024 and 2048)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    a = np.ones(64 * 2**20, np.float32)
    b = np.empty_like(a)
    np.copyto(b, a)
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        np.copyto(b, a)
        n += 1
    bw = 2 * a.nbytes * n / (time.perf_counter() - t0)
    rates = {}
    for size in (1024, 2048):
        x = np.random.default_rng(0).standard_normal((size, size)).astype(np.float32)
        xj = jnp.asarray(x)
        f = jax.jit(lambda p, q: p @ q)
        f(xj, xj).block_until_ready()
        calls = (("xla", lambda f=f, xj=xj: f(xj, xj).block_until_ready()),
                 ("numpy", lambda x=x: x @ x))
        for lib, call in calls:
            call()
            t0, k = time.perf_counter(), 0
            while time.perf_counter() - t0 < seconds:
                call()
                k += 1
            rates[f"{lib}_{size}"] = 2 * size**3 * k / (time.perf_counter() - t0) / 1e9
    best = max(rates, key=rates.get)
    return {"bandwidth_gb_s": bw / 1e9, "gemm_gflops": rates[best], "gemm_by": best,
            "gemm_rates": rates}


def matmul_params(size: str, vocab: int) -> int:
    c = SIZES[size]
    attn = c["hidden_size"] * c["head_dim"] * (2 * c["num_heads"] + 2 * c["num_kv_heads"])
    mlp = 3 * c["hidden_size"] * c["intermediate_size"]
    return c["num_layers"] * (attn + mlp) + vocab * c["hidden_size"]


def step_bound(size: str, vocab: int, spec: dict, ceil: dict) -> dict:
    """A lower bound on one step: decode reads every weight once per decode step (all
    attempts batched: turns x max_tokens steps) at the measured bandwidth; the prompt's
    prefill (once per task, prefix reuse) and the update (forward + backward, 6 FLOPs per
    matmul weight per token, plus attention) at the best GEMM rate."""
    p = matmul_params(size, vocab)
    c = SIZES[size]
    n = spec["tasks_per_step"] * spec["attempts"]
    decode_steps = spec["turns"] * spec["max_tokens"]
    decode_s = decode_steps * 4 * p / (ceil["bandwidth_gb_s"] * 1e9)
    prefill_tokens = spec["tasks_per_step"] * spec["prompt_tokens"] + n * (
        spec["turns"] - 1) * spec["suffix_tokens"]
    seq = spec["prompt_tokens"] + decode_steps + (spec["turns"] - 1) * spec["suffix_tokens"]
    attn = 12 * c["num_layers"] * c["num_heads"] * c["head_dim"] * seq * seq / 2 * n
    train_flops = 6.0 * p * n * seq + attn
    gemm = ceil["gemm_gflops"] * 1e9
    prefill_s = 2.0 * p * prefill_tokens / gemm
    update_s = train_flops / gemm
    return {"bound_s": decode_s + prefill_s + update_s, "bound_decode_s": decode_s,
            "bound_prefill_s": prefill_s, "bound_update_s": update_s}


# ----------------------------------------------------------------------------- growth
GROWTH = {  # curve: (axis values, spec overrides per value)
    "attempts": [1, 4, 16, 32],
    "turns": [1, 2, 4, 8, 16],
    "context": [512, 2048, 8192],
}
QUICK_GROWTH = {"attempts": [1, 4], "turns": [1, 2], "context": [512]}


def growth_specs(ckpt: str, base: dict, quick: bool) -> list[tuple[str, int, dict]]:
    axes = QUICK_GROWTH if quick else GROWTH
    only = base.get("growth_axes") or list(axes)
    out = []
    for axis, values in ((a, axes[a]) for a in only):
        for v in values:
            # The race's own setting (tasks_per_step, attempts, turns) is one point of the
            # attempts and turns curves: the peers' race points sit on them.
            kw = dict(tasks_per_step=base["tasks_per_step"], attempts=base["attempts"],
                      turns=base["turns"], max_tokens=base["max_tokens"],
                      warmup=base.get("growth_warmup", 1), steps=base["growth_steps"])
            if axis == "attempts":
                kw["attempts"] = v
            elif axis == "turns":
                kw["turns"] = v
            else:
                kw.update(tasks_per_step=1, attempts=2, turns=1, context=v)
            spec = make_spec(ckpt, **kw)
            # Shapes compile in each point's warm-up step (excluded), not all ahead.
            spec["sampler_warmup"] = False
            spec["layout"] = base.get("layout", "flat")
            out.append((axis, v, spec))
    return out


def plot_growth(points: list[dict], peers: list[dict], path: str) -> str | None:
    """Step time against attempts, turns and context (this library; peers' points)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    fig = Figure(figsize=(13, 4))
    axes = fig.subplots(1, 3)
    for ax, axis in zip(axes, ("attempts", "turns", "context"), strict=True):
        pts = sorted((p["value"], p["step_s"]) for p in points if p["axis"] == axis)
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, "o-", label="ac2_jax")
            lin = [ys[0] * x / xs[0] for x in xs]
            ax.plot(xs, lin, ":", color="grey", label="linear from the first point")
        for q in peers:
            if q.get("axis") == axis:
                ax.plot([q["value"]], [q["step_s"]], "s", label=q["system"])
        ax.set(xscale="log", yscale="log", xlabel=axis, ylabel="step s",
               title=f"step time vs {axis}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return path


# ----------------------------------------------------------------------------- main
COLS = ["size", "system", "hand_off", "turns", "step_s", "rollout_s", "scoring_s", "update_s",
        "handoff_s",
        "sampled_tokens", "trained_tokens", "sampled_per_s", "trained_per_s", "peak_rss_mb",
        "warmup_s", "startup_s", "equal_work", "speedup_vs", "bound_s", "frac_of_bound"]


def parse_peers(text: str) -> dict[str, str]:
    out = {}
    for item in filter(None, text.split(",")):
        name, sep, path = item.partition("=")
        if not sep or name not in ("trl", "tunix"):
            raise SystemExit(f"--peer_python: expected trl=PATH,tunix=PATH, got {item!r}")
        out[name] = path
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="results JSON (the PNG goes beside it)")
    p.add_argument("--sizes", default="small,medium")
    p.add_argument("--peer_python", default="",
                   help="trl=PYTHON,tunix=PYTHON: each peer's venv interpreter (peers "
                        "left out are not run)")
    p.add_argument("--tasks_per_step", type=int, default=2)
    p.add_argument("--attempts", type=int, default=4, help="group size (attempts per task)")
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--max_tokens", type=int, default=32, help="tokens per assistant turn")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--growth_steps", type=int, default=1)
    p.add_argument("--layout", default="flat", choices=("flat", "tree"),
                   help="this library's RL batch layout (rl.batch.layout): flat rows, or "
                        "tree rows holding a group's shared prompt once")
    p.add_argument("--growth_axes", default="",
                   help="comma-separated growth curves to run (attempts, turns, context; "
                        "default: all)")
    p.add_argument("--growth_warmup", type=int, default=2,
                   help="untimed steps per growth point (its shapes compile in them: the "
                        "growth points run without the sampler's ahead-of-time warm-up)")
    p.add_argument("--growth_size", default="small")
    p.add_argument("--no_growth", action="store_true")
    p.add_argument("--no_race", action="store_true", help="the growth curves only")
    p.add_argument("--tolerance", type=float, default=0.02,
                   help="equal work: largest relative difference in tokens per step")
    p.add_argument("--quick", action="store_true",
                   help="toy size, 1 timed step, a few growth points (this library only "
                        "unless --peer_python)")
    p.add_argument("--workdir", default=None)
    p.add_argument("--hand_off", default="memory",
                   help="this library's weight hand-off to its embedded sampler "
                        "(sampler.hand_off): memory, disk, or both as 'disk,memory' (one row "
                        "each, run one after the other; the first is the peers' reference)")
    p.add_argument("--checkpoint_every", type=int, default=1,
                   help="this library's rl.checkpoint_every (1: the recipe's default, a "
                        "checkpoint after every step; the peers save none: TRL "
                        "save_strategy='no', tunix no checkpoint directory)")
    p.add_argument("--handoff_only", type=int, default=0, metavar="ROUNDS",
                   help="only time the hand-off phase, both modes side by side in one process "
                        "(ROUNDS alternating rounds per size; measure_hand_off)")
    args = p.parse_args(argv)
    hand_offs = [h.strip() for h in args.hand_off.split(",") if h.strip()]
    growth_axes = [a.strip() for a in args.growth_axes.split(",") if a.strip()]
    unknown = sorted(set(growth_axes) - set(GROWTH))
    if unknown:
        raise SystemExit(f"--growth_axes: {unknown} unknown; choose from {list(GROWTH)}")
    if not hand_offs or any(h not in ("memory", "disk") for h in hand_offs):
        raise SystemExit(f"--hand_off: memory, disk or a list of them, got {args.hand_off!r}")
    if args.quick:
        args.sizes, args.growth_size, args.steps = "toy", "toy", 1
        args.growth_warmup = 1
        args.max_tokens = min(args.max_tokens, 8)
    peers = parse_peers(args.peer_python)
    work = args.workdir or tempfile.mkdtemp(prefix="loop_race_")
    os.makedirs(work, exist_ok=True)
    if args.handoff_only:
        out = {}
        for size in args.sizes.split(","):
            ckpt = write_checkpoint(os.path.join(work, f"ckpt-{size}"), size)
            load0 = os.getloadavg()
            out[size] = measure_hand_off(ckpt["path"], args.handoff_only, work)
            out[size]["load_average"] = [load0, os.getloadavg()]
            r = out[size]
            print(f"{size}: hand-off disk {r['disk']:.3f} s, memory {r['memory']:.3f} s "
                  f"({r['speedup']:.1f}x); background write {r['background_write_s']:.3f} s; "
                  f"load {load0[0]:.1f} -> {os.getloadavg()[0]:.1f}", flush=True)
        from benchmarks.common import write_json

        write_json(args.out, {"benchmark": "loop_race", "handoff": out, "args": vars(args)})
        return out
    t_start = time.perf_counter()
    rows, raw, ckpts = [], {}, {}
    for size in [] if args.no_race else args.sizes.split(","):
        if size not in SIZES:
            raise SystemExit(f"unknown size {size!r}; choose from {sorted(SIZES)}")
        ckpts[size] = write_checkpoint(os.path.join(work, f"ckpt-{size}"), size)
        base = dict(tasks_per_step=args.tasks_per_step, attempts=args.attempts,
                    max_tokens=args.max_tokens, warmup=args.warmup, steps=args.steps)
        variants = [("ac2", args.turns), ("trl", args.turns)] if "trl" in peers else [
            ("ac2", args.turns)]
        if "tunix" in peers:
            variants += [("ac2", 1), ("tunix", 1)]
        specs = {t: make_spec(ckpts[size]["path"], turns=t, **base)
                 for t in sorted({t for _, t in variants})}
        runs = [(system, turns, h) for system, turns in variants
                for h in (hand_offs if system == "ac2" else [None])]
        for system, turns, hand_off in runs:
            spec = specs[turns] if hand_off is None else dict(
                specs[turns], hand_off=hand_off, checkpoint_every=args.checkpoint_every,
                layout=args.layout)
            res = run_system(system, spec, work, peers.get(system))
            mode = f"/{hand_off}" if hand_off is not None and len(hand_offs) > 1 else ""
            raw[f"{size}/{system}/turns{turns}{mode}"] = res
            if "error" in res:
                rows.append({"size": size, "system": system, "turns": turns,
                             "hand_off": hand_off, "error": res["error"]})
                print(f"{size} {system} turns={turns}: FAILED {res['error'][-400:]}")
                continue
            rows.append({"size": size, "system": system, "turns": turns, "hand_off": hand_off,
                         **summarize(res, args.warmup), "spec": {
                             k: specs[turns][k] for k in ("tasks_per_step", "attempts", "turns",
                                                          "max_tokens", "prompt_tokens",
                                                          "suffix_tokens", "seq_len")}})
    growth = []
    if not args.no_growth:
        gspecs = growth_specs(make_checkpoint_once(ckpts, args.growth_size, work)["path"],
                              {"max_tokens": args.max_tokens, "growth_steps": args.growth_steps,
                               "growth_warmup": args.growth_warmup, "layout": args.layout,
                               "growth_axes": growth_axes,
                               "tasks_per_step": args.tasks_per_step, "attempts": args.attempts,
                               "turns": args.turns},
                              args.quick)
        res = run_system("ac2_many", [s for _, _, s in gspecs], work, None)
        if isinstance(res, dict) and "error" in res:
            print(f"growth: FAILED {res['error'][-400:]}")
        else:
            for (axis, value, spec), r in zip(gspecs, res, strict=True):
                s = summarize(r, spec["warmup"])
                growth.append({"axis": axis, "value": value, "step_s": s["step_s"],
                               "rollout_s": s["rollout_s"], "update_s": s["update_s"],
                               "handoff_s": s["handoff_s"], "sampled_tokens": s["sampled_tokens"],
                               "trained_tokens": s["trained_tokens"],
                               "compile_s": s["compile_s"], "seq_len": spec["seq_len"]})
    ceil = measured_ceilings()
    for r in rows:
        if "error" in r:
            continue
        ref = next((q for q in rows if q["size"] == r["size"] and q["system"] == "ac2"
                    and q["turns"] == r["turns"] and q["hand_off"] == hand_offs[0]
                    and "error" not in q), None)
        if ref is not None and r is not ref:
            r.update(equal_work(r, ref, args.tolerance))
            r["speedup_vs"] = r["step_s"] / ref["step_s"]  # this library's speed-up over it
        spec = dict(r["spec"], tasks_per_step=r["spec"]["tasks_per_step"])
        r.update(step_bound(r["size"], ckpts[r["size"]]["vocab"], spec, ceil))
        r["frac_of_bound"] = r["bound_s"] / r["step_s"]
    peer_points = []
    for r in rows:
        if "error" in r or r["system"] == "ac2" or r["size"] != args.growth_size:
            continue
        # The race's setting is the attempts curve's point at --attempts (turns = --turns)
        # and the turns curve's point at its turns.
        if r["turns"] == args.turns:
            peer_points.append({"system": r["system"], "axis": "attempts",
                                "value": r["spec"]["attempts"], "step_s": r["step_s"]})
        peer_points.append({"system": r["system"], "axis": "turns", "value": r["turns"],
                            "step_s": r["step_s"]})
    print_rows(rows)
    if growth:
        from benchmarks.common import print_table

        print("\ncost growth (this library, size", args.growth_size + "):")
        print_table(growth, ["axis", "value", "step_s", "rollout_s", "update_s", "handoff_s",
                             "compile_s", "sampled_tokens", "trained_tokens", "seq_len"])
    png = None
    if args.out and growth:
        png = plot_growth(growth, peer_points, os.path.splitext(args.out)[0] + ".png")
    payload = {"benchmark": "loop_race", "args": vars(args), "rows": rows, "growth": growth,
               "ceilings": ceil, "checkpoints": ckpts, "peer_versions": {
                   k: v.get("versions") for k, v in raw.items() if isinstance(v, dict)
                   and v.get("versions")}, "png": png,
               "notes": {k: v.get("notes") for k, v in raw.items() if isinstance(v, dict)},
               "total_s": time.perf_counter() - t_start}
    from benchmarks.common import write_json

    write_json(args.out, payload)
    print(f"\nceilings: {ceil['bandwidth_gb_s']:.1f} GB/s copy, {ceil['gemm_gflops']:.1f} GFLOP/s "
          f"({ceil['gemm_by']}); total {payload['total_s']:.0f}s; work dir {work}")
    return payload


def measure_hand_off(ckpt: str, rounds: int, work: str) -> dict:
    """The hand-off phase alone (`time_publishing_s`: `RLTrainer.publish` + the weights
    alarm's `check_served`), both `sampler.hand_off` modes side by side in one
    process, alternating, on the race's checkpoint as the recipe loads it: "disk"
    (Orbax publish, then `JaxSampler.load_weights`) and "memory" (`set_params`; the
    folder is written in the background, timed apart as `background_write_s`).
    Medians over `rounds` after one warm-up round of each. No update runs: each
    round publishes the next version of the same weights."""
    import statistics

    from ac2_jax.recipes import load_model
    from ac2_jax.sampling.engine.jax_sampler import JaxSampler
    from ac2_jax.training import OptimizerConfig, PolicyGradientLoss
    from ac2_jax.training.rl.collectors import ReplayCollector
    from ac2_jax.training.rl.data import BatchConfig
    from ac2_jax.training.rl.trainer import RLConfig, RLTrainer

    def build(mode: str):
        model, _ = load_model(ckpt, work)
        pub = os.path.join(work, f"handoff-{mode}", "published")
        sampler = JaxSampler(model, publish_dir=pub, max_context=256, max_batch=8)
        config = RLConfig(steps=1, tasks_per_step=1, attempts_per_task=2,
                          batch=BatchConfig(seq_len=64, rows=2), loss=PolicyGradientLoss(),
                          optimizer=OptimizerConfig(learning_rate=LR))
        trainer = RLTrainer(model, ReplayCollector([]), config,
                            os.path.join(work, f"handoff-{mode}"), publish_dir=pub,
                            on_publish=sampler.load_weights if mode == "disk" else None,
                            hand_off=sampler.set_params if mode == "memory" else None,
                            served_weights=sampler.served_weights)
        return sampler, trainer

    runs = {mode: build(mode) for mode in ("disk", "memory")}
    times: dict[str, list[float]] = {"disk": [], "memory": [], "background_write_s": []}
    try:
        for i in range(rounds + 1):
            for mode, (sampler, trainer) in runs.items():
                state = trainer.trainer.state
                trainer.trainer.state = state.replace(step=state.step * 0 + i + 1)
                t0 = time.perf_counter()
                trainer.publish()
                asyncio.run(trainer.check_served(f"round {i}"))
                t1 = time.perf_counter()
                trainer.wait_published()
                t2 = time.perf_counter()
                assert sampler.policy_version == i + 1, (mode, sampler.policy_version)
                if i:  # round 0: the warm-up (Orbax's first use, the checksum's compile)
                    times[mode].append(t1 - t0)
                    if mode == "memory":
                        times["background_write_s"].append(t2 - t1)
        fired = {m: t.alarm_metrics() for m, (_, t) in runs.items()}
    finally:
        for sampler, trainer in runs.values():
            trainer.close()
            sampler.close()
    out = {k: statistics.median(v) for k, v in times.items()}
    out.update(rounds=rounds, all=times, alarms=fired, speedup=out["disk"] / out["memory"])
    return out


def make_checkpoint_once(ckpts: dict, size: str, work: str) -> dict:
    if size not in ckpts:
        ckpts[size] = write_checkpoint(os.path.join(work, f"ckpt-{size}"), size)
    return ckpts[size]


def print_rows(rows: list[dict]) -> None:
    from benchmarks.common import print_table

    ok = [r for r in rows if "error" not in r]
    if ok:
        print_table(ok, COLS)
    for r in rows:
        if "error" in r:
            print(f"{r['size']} {r['system']}: not run ({r['error'][-300:]})")


def _internal(argv: list[str]) -> None:
    """`--_run ac2|ac2_many SPEC OUT`: one run of this library's loop in this process."""
    kind, spec_path, out_path = argv
    with open(spec_path) as f:
        spec = json.load(f)
    out = run_ac2(spec) if kind == "ac2" else run_ac2_many(spec["specs"])
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--_run":
        _internal(sys.argv[2:])
    else:
        main()
