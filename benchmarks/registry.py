"""The kept benchmarks, by name: what `python -m benchmarks NAME [args]` runs.

A benchmark stays here while a current figure rests on it (docs/results.md quotes
each figure with its dated note in docs/notes/ and its command). A benchmark is one
module of this folder whose `main()` parses `sys.argv`; the entry point sets
`sys.argv` to `[NAME, *args]` and calls it, so `python -m benchmarks NAME --help`
shows its flags.
Benchmarks that answered a question now recorded, and left, are listed with the
section that holds their figures in docs/notes/benchmarks-retired.md.

Adding one: a module `benchmarks/bench_<name>.py` with `main()`, a line in
`_KEPT` below, and a toy-size test of its pipeline under tests/benchmarks/.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import sys

from ac2_jax.registry import Registry

__all__ = ["BENCHMARKS", "CONCERNS", "SUPPORT", "Benchmark", "describe", "run"]


@dataclasses.dataclass(frozen=True)
class Benchmark:
    """One kept benchmark: `module` (under `benchmarks.`) is run; `concern` groups the
    listing; `summary` is its one line there."""

    module: str
    concern: str
    summary: str


# The listing's order of concerns.
CONCERNS = (
    "gemm and the train step",
    "the RL loop",
    "decode",
    "real size",
    "endpoint",
    "faults",
    "mixture of experts",
    "packing",
    "gpu",
)

BENCHMARKS: Registry[Benchmark] = Registry("benchmark")

_KEPT = (
    (
        "roofline",
        "bench_roofline",
        "gemm and the train step",
        "this machine's fp32 GEMM ceiling ([n, n] @ [n, n] GFLOP/s per library)",
    ),
    (
        "matmul_ceiling",
        "bench_matmul_ceiling",
        "gemm and the train step",
        "the train step vs transformers + torch, alternating rounds in one process; "
        "XLA vs torch GEMMs at the step's shapes",
    ),
    (
        "train_step",
        "bench_train_step",
        "gemm and the train step",
        "train-step tokens/s vs transformers + torch, N steps in a row, against the roofline",
    ),
    (
        "step_ab",
        "bench_step_ab",
        "gemm and the train step",
        "same-process A/B of the train step under two DecoderConfig runtime choices",
    ),
    (
        "long_rows",
        "bench_long_rows",
        "gemm and the train step",
        "one RL step from long agent rows: packing, the step's compile and run, reference "
        "forwards, in CPU seconds under the caller's XLA flags; --kernel: attention alone",
    ),
    (
        "inflight_updates",
        "bench_inflight_updates",
        "the RL loop",
        "async RL with mixed short and long attempts: in-flight weight updates vs drain",
    ),
    (
        "alarm_cost",
        "bench_alarm_cost",
        "the RL loop",
        "the drift alarm's cost per RL step: off vs from the step's forward vs an extra forward",
    ),
    (
        "loop_race",
        "bench_loop_race",
        "the RL loop",
        "the whole RL loop (GRPO on a calculator tool loop) vs TRL and tunix, per-step split",
    ),
    (
        "shared_prompt",
        "bench_shared_prompt",
        "decode",
        "a group's shared prompt in the JaxSampler: prefilled once vs once per attempt",
    ),
    (
        "sampler",
        "bench_sampler",
        "decode",
        "JaxSampler decode vs transformers generate, same weights, greedy",
    ),
    (
        "real_size",
        "bench_real_size",
        "real size",
        "one train step's (or decode's) peak RSS and time at a Qwen3-0.6B shape vs torch",
    ),
    (
        "lora",
        "bench_lora",
        "real size",
        "LoRA at real size: one RL step's peak RSS and time vs full fine-tuning and peft",
    ),
    (
        "endpoint",
        "bench_endpoint",
        "endpoint",
        "the endpoint: overhead per request, load in its own process, load over a fleet",
    ),
    (
        "weight_publish",
        "bench_weight_publish",
        "endpoint",
        "weight hand-off learner -> sampler: publish, load, first completion, vs one RL step",
    ),
    (
        "fault_soak",
        "fault_soak",
        "faults",
        "the split RL job under many injected faults; final weights vs a fault-free replay",
    ),
    (
        "moe",
        "bench_moe",
        "mixture of experts",
        "MoE vs dense forward + backward time; routing replay's log-prob gap",
    ),
    (
        "packing",
        "bench_packing",
        "packing",
        "padding waste: first-fit decreasing packing vs one segment per row",
    ),
    (
        "merge_savings",
        "bench_merge_savings",
        "packing",
        "one forward per append-only episode vs one forward per request",
    ),
    (
        "gpu",
        "gpu_bench",
        "gpu",
        "one accelerator: bf16 matmul, train-step MFU, decode tokens/s (scripts/gpu_bench.sh)",
    ),
)
for _name, _module, _concern, _summary in _KEPT:
    BENCHMARKS.register(_name)(Benchmark(_module, _concern, _summary))

# Modules of this folder that are not benchmarks of their own: shared helpers, and
# processes a benchmark starts (`python -m benchmarks.<module>`).
SUPPORT = {
    "common": "timing, tables, JSON out and the machine record",
    "registry": "this table",
    "endpoint_harness": "the endpoint's load harness, run in its own process (endpoint)",
    "endpoint_fleet_load": "client processes and a publishing learner over a fleet (endpoint)",
}


def describe() -> str:
    """The listing `python -m benchmarks` prints: one line per benchmark, by concern."""
    order = {n: i for i, (n, *_) in enumerate(_KEPT)}
    listed = sorted(BENCHMARKS.names(), key=lambda n: (order.get(n, len(order)), n))
    width = max(len(n) for n in listed)
    lines = ["usage: python -m benchmarks NAME [args]   (NAME --help: its flags)", ""]
    for concern in CONCERNS:
        names = [n for n in listed if BENCHMARKS.get(n).concern == concern]
        if names:
            lines.append(f"{concern}:")
            lines += [f"  {n.ljust(width)}  {BENCHMARKS.get(n).summary}" for n in names]
    lines += [
        "",
        "Figures and commands: docs/results.md; retired benchmarks: "
        "docs/notes/benchmarks-retired.md",
    ]
    return "\n".join(lines)


def run(name: str, args: list[str]) -> object:
    """Runs benchmark `name` with command-line `args` (its `main()` reads `sys.argv`).

    An unknown name is a ValueError naming the closest registered one."""
    if name not in BENCHMARKS:
        close = difflib.get_close_matches(name.removeprefix("bench_"), BENCHMARKS.names(), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"unknown benchmark {name!r}{hint} (`python -m benchmarks` lists "
            f"them: {', '.join(BENCHMARKS.names())})"
        )
    module = importlib.import_module(f"benchmarks.{BENCHMARKS.get(name).module}")
    saved = sys.argv
    sys.argv = [f"benchmarks {name}", *args]
    try:
        return module.main()
    finally:
        sys.argv = saved
