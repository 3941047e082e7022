"""How long XLA:CPU takes to compile the tiny model's train step under different
XLA_FLAGS: each flag set in a fresh process (no persistent cache), rounds alternated,
so the machine's noise falls on every set alike. Backs the choice of test-suite flags
in tests/conftest.py (docs/notes/2026-12-07-suite-in-20-minutes-second-session.md).

    python scripts/compile_flags_probe.py              # the default sets, 3 rounds
    python scripts/compile_flags_probe.py --rounds 5 --flags "" "--xla_cpu_opt_preset=..."

Every set runs on top of --xla_backend_optimization_level=0 (the suite's level)."""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys

BASE = "--xla_backend_optimization_level=0"
DEFAULT_SETS = ["", "--xla_cpu_use_fusion_emitters=false"]

CHILD = """
import time
t0 = time.perf_counter()
import jax, jax.numpy as jnp, optax
from flax import nnx
from ac2_jax.models import Decoder, DecoderConfig
cfg = DecoderConfig.tiny(vocab_size=512, hidden_size=64, intermediate_size=128, num_heads=4,
                         num_kv_heads=2, head_dim=16, max_position_embeddings=1024)
model = Decoder(cfg, rngs=nnx.Rngs(0))
opt = nnx.Optimizer(model, optax.adamw(1e-3), wrt=nnx.Param)
tokens = jnp.zeros((2, 128), jnp.int32)
pos = jnp.broadcast_to(jnp.arange(128), (2, 128))

def loss_fn(m, tokens, pos):
    lp = jax.nn.log_softmax(m(tokens, pos, jnp.ones_like(tokens)).astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(lp, tokens[..., None], -1))

@nnx.jit
def step(m, o, tokens, pos):
    loss, grads = nnx.value_and_grad(loss_fn)(m, tokens, pos)
    o.update(m, grads)
    return loss

t1 = time.perf_counter()
step(model, opt, tokens, pos).block_until_ready()
print(f"{time.perf_counter() - t1:.3f}")
"""


def machine() -> str:
    model = "?"
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    isa = [x for x in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if x in flags]
    return f"{model} ({platform.machine()}), {os.cpu_count()} CPUs, {' '.join(isa) or '?'}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--flags", nargs="*", default=DEFAULT_SETS, help="flag sets, each a string")
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
    env["JAX_PLATFORMS"] = "cpu"
    times: dict[str, list[float]] = {s: [] for s in args.flags}
    for _ in range(args.rounds):
        for flags in args.flags:
            env["XLA_FLAGS"] = f"{BASE} {flags}".strip()
            out = subprocess.run(
                [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True
            )
            times[flags].append(float(out.stdout.split()[-1]))
    print(f"machine: {machine()}")
    print(f"first call of the tiny train step (compile + one run), s; on top of {BASE}")
    for flags, ts in times.items():
        print(f"  {flags or '(no extra flag)':<60} {' '.join(f'{t:.2f}' for t in ts)}")


if __name__ == "__main__":
    main()
