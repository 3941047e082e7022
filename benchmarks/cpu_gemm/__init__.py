"""An OpenBLAS GEMM inside XLA:CPU programs (issue 41's experiment, not the library's).

`gemm.cc` is an XLA FFI custom call computing a float32 matmul with the OpenBLAS numpy
ships; `build()` compiles it once per source and jaxlib (g++ and the FFI headers
`jax.ffi.include_dir()` gives), hands it numpy's `cblas_sgemm` and registers the target.
`matmul(x, w)` is x @ w through it, with a custom VJP whose two backward products go
through it too, so a jitted step can swap XLA's dot for it and be timed side by side
(`benchmarks/bench_cpu_gemm.py`).
"""

from __future__ import annotations

import ctypes
import glob
import hashlib
import os
import subprocess

import jax
import jax.numpy as jnp
import numpy as np

_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gemm.cc")
_TARGET = "ac2_cpu_gemm"
_state: dict = {}


class BuildError(RuntimeError):
    """The custom call could not be built or loaded (no compiler, no OpenBLAS, ...)."""


def openblas_path() -> str:
    """numpy's bundled OpenBLAS (scipy-openblas, ILP64), or BuildError saying why not."""
    libs = os.path.join(os.path.dirname(os.path.dirname(np.__file__)), "numpy.libs")
    found = sorted(glob.glob(os.path.join(libs, "libscipy_openblas64_*.so")))
    if not found:
        raise BuildError(f"no libscipy_openblas64_*.so in {libs}: this numpy does not ship "
                         "the OpenBLAS the custom call uses")
    return found[0]


def build(cache_dir: str | None = None) -> str:
    """Compiles gemm.cc (once per source and jaxlib version), loads it, sets its sgemm
    and registers the FFI target. Returns the .so path."""
    if "so" in _state:
        return _state["so"]
    src = open(_SRC, "rb").read()
    key = hashlib.sha256(src + jax.__version__.encode()).hexdigest()[:16]
    cache_dir = cache_dir or os.path.join(os.path.expanduser("~"), ".cache", "ac2_jax")
    os.makedirs(cache_dir, exist_ok=True)
    so = os.path.join(cache_dir, f"ac2_cpu_gemm_{key}.so")
    if not os.path.exists(so):
        tmp = f"{so}.{os.getpid()}.tmp"
        cmd = ["g++", "-O2", "-std=c++17", "-shared", "-fPIC", "-w",
               f"-I{jax.ffi.include_dir()}", _SRC, "-o", tmp]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True)
        except FileNotFoundError as e:
            raise BuildError("g++ is not installed: the custom call cannot be built") from e
        if proc.returncode != 0:
            raise BuildError(f"g++ failed ({' '.join(cmd)}):\n{proc.stderr[-2000:]}")
        os.replace(tmp, so)
    lib = ctypes.CDLL(so)
    blas = ctypes.CDLL(openblas_path())
    sgemm = ctypes.cast(blas.scipy_cblas_sgemm64_, ctypes.c_void_p).value
    lib.ac2_set_sgemm.argtypes = [ctypes.c_void_p]
    lib.ac2_set_sgemm(sgemm)
    jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.Ac2Gemm), platform="cpu")
    _state.update(so=so, lib=lib, blas=blas)
    return so


def gemm(a: jax.Array, b: jax.Array, trans_a: bool = False, trans_b: bool = False):
    """op(a) @ op(b) for 2-D float32 arrays through the custom call (build() first)."""
    if a.ndim != 2 or b.ndim != 2 or a.dtype != jnp.float32 or b.dtype != jnp.float32:
        raise ValueError(f"gemm: 2-D float32 arrays only, got {a.shape} {a.dtype} and "
                         f"{b.shape} {b.dtype}")
    m = a.shape[1] if trans_a else a.shape[0]
    k = a.shape[0] if trans_a else a.shape[1]
    kb, n = (b.shape[1], b.shape[0]) if trans_b else b.shape
    if k != kb:
        raise ValueError(f"gemm: inner dimensions differ: op(a) {(m, k)}, op(b) {(kb, n)}")
    out = jax.ShapeDtypeStruct((m, n), jnp.float32)
    return jax.ffi.ffi_call(_TARGET, out)(a, b, trans_a=np.bool_(trans_a),
                                          trans_b=np.bool_(trans_b))


@jax.custom_vjp
def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [..., K] @ w [K, N] -> [..., N], every product (forward and both gradients)
    through the custom call; the leading axes of x are flattened into its rows."""
    return gemm(x.reshape(-1, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[1])


def _fwd(x, w):
    return matmul(x, w), (x, w)


def _bwd(res, g):
    x, w = res
    x2, g2 = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
    dx = gemm(g2, w, trans_b=True).reshape(x.shape)  # g @ w.T
    dw = gemm(x2, g2, trans_a=True)  # x.T @ g
    return dx, dw


matmul.defvjp(_fwd, _bwd)
