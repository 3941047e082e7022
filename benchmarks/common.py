"""Shared helpers for the side-by-side benchmarks: timing, tables, JSON out."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from collections.abc import Callable


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", default=None, help="write results as JSON here")
    p.add_argument("--repeats", type=int, default=5)
    return p


# The benchmarks' model widths by size (DecoderConfig fields; each benchmark adds its
# vocabulary and context): the train-step benchmark's sizes, which the loop race and the
# shared-prompt benchmark run too.
WIDTHS = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=16),
    "small": dict(hidden_size=256, intermediate_size=512, num_layers=4, num_heads=4,
                  num_kv_heads=2, head_dim=64),
    "medium": dict(hidden_size=512, intermediate_size=1024, num_layers=4, num_heads=8,
                   num_kv_heads=4, head_dim=64),
}


def child_xla_flags(flags: str | None = None) -> str:
    """`flags` (default: this process's XLA_FLAGS) less a forced host device count: what a
    server or worker child gets, so it runs on one CPU device as deployed (or the devices
    it asks for itself) while the caller's compile flags reach it (the test suite's -O0,
    tests/conftest.py; a benchmark run with XLA_FLAGS set)."""
    flags = os.environ.get("XLA_FLAGS", "") if flags is None else flags
    return " ".join(f for f in flags.split()
                    if not f.startswith("--xla_force_host_platform_device_count"))


def time_fn(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> dict[str, float]:
    """Median / min wall seconds of fn() (fn must block until done)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times), "min_s": min(times)}


def cpu_record() -> dict[str, object]:
    """The CPU model, its vector extensions (AVX2, AVX-512, AMX) and the thread
    settings: figures differ by instruction set, so every benchmark records them."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model in ("", platform.machine()):
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    wanted = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
              "amx_tile", "amx_bf16", "amx_int8")
    threads = {k: os.environ[k] for k in ("OMP_NUM_THREADS", "XLA_FLAGS", "MKL_NUM_THREADS")
               if k in os.environ}
    return {"cpu_model": model, "vector_extensions": [f for f in wanted if f in flags],
            "threads": threads}


def machine() -> dict[str, object]:
    import jax
    return {"machine": platform.machine(), "cpus": os.cpu_count(), **cpu_record(),
            "jax": jax.__version__, "backend": jax.default_backend(),
            "date": time.strftime("%Y-%m-%d")}


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    print(" | ".join(c.ljust(w) for c, w in zip(columns, widths)))
    print("-|-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths)))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def write_json(path: str | None, payload: dict) -> None:
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump({"machine": machine(), **payload}, f, indent=2)
