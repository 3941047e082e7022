"""Host-side bookkeeping of the JaxSampler's cache rows (no JAX compute here).

`SlotTable` knows which request owns which of the B cache rows, holds the
per-row decode state as numpy arrays (sent to the device once per decode
chunk, read back after it), and remembers the tokens whose keys/values a
free row still holds, so a later prompt that starts with them can skip that
part of its prefill (prefix reuse).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from ac2_jax.sampling.base import SamplingParams
from ac2_jax.sampling.engine.decode_loop import Rows
from ac2_jax.segments.batch import pow2_bucket


@dataclasses.dataclass(eq=False)
class Request:
    """One generate() call on its way through the sampler."""

    prompt: list[int]
    params: SamplingParams
    future: concurrent.futures.Future
    seed: int  # 64-bit; drawn by the sampler when params.seed is None
    stop_ids: tuple[int, ...]
    max_out: int  # min(max_tokens, max_context - len(prompt))
    version: int = 0  # weights version when admitted (samples its first token)
    cached: int = 0  # prompt tokens whose prefill was skipped
    gen: list[int] = dataclasses.field(default_factory=list)  # every sampled token
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)  # per token of gen
    tops: list | None = None
    on_tokens: Callable | None = None  # (ids, logprobs) of newly accepted tokens
    sent: int = 0  # output tokens already handed to on_tokens
    matcher: Any = None  # constraints.GrammarMatcher of params.constraint (None: free)
    slot: int = 0  # adapter bank slot of params.adapter (0: the base model), set at admission
    # MoE models: the experts of each position's token [prompt + max_out, layers, k], -1
    # until recorded (`worker.record_routing`); None for other models.
    routing: Any = None


@dataclasses.dataclass
class SamplerStats:
    """Counters for tests and benchmarks (read-only for callers)."""

    prefill_calls: int = 0
    prefill_rows: int = 0
    prefill_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens not computed: held in place or copied
    shared_tokens: int = 0  # of those, copied from another row (a shared prompt prefix)
    decode_chunks: int = 0
    decode_steps: int = 0
    output_tokens: int = 0
    max_active: int = 0
    active_rows: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    resizes: int = 0
    cache_shrinks: int = 0  # resizes to fewer slots (the running rows needed half)
    prefix_tokens_dropped: int = 0  # free rows' cached tokens past a shrunk cache
    weight_swaps: int = 0
    # weight_swap="in_flight": swaps made while rows were running, the rows they
    # caught, and the tokens those rows prefilled again under the new weights.
    in_flight_swaps: int = 0
    swapped_rows: int = 0
    recomputed_tokens: int = 0
    cancelled: int = 0  # requests dropped because their caller gave up
    request_errors: int = 0  # requests failed with SamplerError (own fault or a crash)
    worker_restarts: int = 0  # exceptions that escaped a device step (cache rebuilt)
    decode_s: float = 0.0  # wall time in decode chunks (device call + read back)
    prefill_s: float = 0.0  # wall time in prefill calls (dispatch until the next sync)
    # Every (jitted function, static shape) the worker has called: each new one
    # is one XLA compile (weights of the same structure reuse it). A set that
    # keeps growing under steady traffic is memory that keeps growing.
    shapes: set = dataclasses.field(default_factory=set)

    @property
    def compiled_shapes(self) -> int:
        return len(self.shapes)

    def counters(self) -> dict[str, float]:
        """The cumulative counters as plain numbers; two of them a step apart give
        that step's sampler work (`occupancy_metrics`)."""
        return {
            "decode_s": self.decode_s,
            "prefill_s": self.prefill_s,
            "decode_steps": self.decode_steps,
            "row_steps": sum(rows * n for rows, n in self.active_rows.items()),
            "output_tokens": self.output_tokens,
            "prefill_tokens": self.prefill_tokens,
            "cached_tokens": self.cached_tokens,
            "shared_tokens": self.shared_tokens,
            "compiled_shapes": self.compiled_shapes,
            "resizes": self.resizes,
            "cache_shrinks": self.cache_shrinks,
            "prefix_tokens_dropped": self.prefix_tokens_dropped,
            "weight_swaps": self.weight_swaps,
            "in_flight_swaps": self.in_flight_swaps,
            "recomputed_tokens": self.recomputed_tokens,
        }


def occupancy_metrics(before: dict, after: dict, max_batch: int) -> dict[str, float]:
    """What the sampler did between two `SamplerStats.counters()` snapshots.

    mean_active_rows: rows generating per decode step (occupancy: over
    max_batch); decode_s / prefill_s: wall time in device calls; new_shapes:
    compiles in the interval (0 once warmed up); prefill_tokens / cached_tokens /
    shared_tokens: prompt tokens computed, not computed (held in place or copied), and
    of those copied from another row that prefilled the same prefix; cache_shrinks /
    prefix_tokens_dropped: cache cuts and the cached prefix tokens they dropped;
    weight_swaps / in_flight_swaps / recomputed_tokens: weight versions swapped in,
    those swapped while rows ran (`weight_swap="in_flight"`) and the tokens
    those rows prefilled again; decode_tokens_per_s: output tokens per second of decode time.
    """
    d = {k: after[k] - before[k] for k in after}
    active = d["row_steps"] / d["decode_steps"] if d["decode_steps"] else 0.0
    return {
        "decode_s": d["decode_s"],
        "prefill_s": d["prefill_s"],
        "decode_steps": d["decode_steps"],
        "mean_active_rows": active,
        "occupancy": active / max_batch,
        "output_tokens": d["output_tokens"],
        "prefill_tokens": d["prefill_tokens"],
        "cached_tokens": d["cached_tokens"],
        "shared_tokens": d.get("shared_tokens", 0),
        "new_shapes": d["compiled_shapes"],
        "resizes": d["resizes"],
        "cache_shrinks": d["cache_shrinks"],
        "prefix_tokens_dropped": d["prefix_tokens_dropped"],
        "weight_swaps": d.get("weight_swaps", 0),
        "in_flight_swaps": d.get("in_flight_swaps", 0),
        "recomputed_tokens": d.get("recomputed_tokens", 0),
        "decode_tokens_per_s": d["output_tokens"] / d["decode_s"] if d["decode_s"] else 0.0,
    }


class _HasFuture(Protocol):
    """A queue item a caller waits on (a `Request`, the worker's `Warmup`)."""

    future: concurrent.futures.Future


def resolve(req: _HasFuture, result=None, exc: BaseException | None = None) -> None:
    """Completes a request's future unless the caller already gave up on it."""
    try:
        if exc is not None:
            req.future.set_exception(exc)
        else:
            req.future.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass


_FIELDS = {
    "token": np.int32,
    "pos": np.int32,
    "active": np.bool_,
    "n_out": np.int32,
    "max_out": np.int32,
    "temperature": np.float32,
    "top_p": np.float32,
    "top_k": np.int32,
    "seed_lo": np.uint32,
    "seed_hi": np.uint32,
    "adapter": np.int32,
}


class SlotTable:
    """B cache rows: owner request, numpy decode state, cached token history."""

    def __init__(self):
        self.B = 0
        self.req: list[Request | None] = []
        self.hist: list[np.ndarray] = []  # tokens held in slots 0.. of a free row
        self.hist_adapter: list[int] = []  # the adapter slot those keys/values came from
        self.used: list[int] = []  # tick of last use (free rows: LRU reuse)
        self.arr = {k: np.zeros(0, t) for k, t in _FIELDS.items()}
        self.tick = 0

    # -- queries

    def active_rows(self) -> list[int]:
        return [i for i in range(self.B) if self.req[i] is not None]

    def held(self, row: int) -> Request:
        """The request in `row`, an active row."""
        req = self.req[row]
        if req is None:
            raise RuntimeError(f"SlotTable: row {row} holds no request")
        return req

    def free_rows(self) -> list[int]:
        return [i for i in range(self.B) if self.req[i] is None]

    def clear_history(self) -> None:
        """Forget cached prefixes (their keys/values came from other weights)."""
        self.hist = [np.zeros(0, np.int32) for _ in range(self.B)]
        self.hist_adapter = [0] * self.B

    # -- layout

    def relayout(self, old_rows: list[int], new_B: int) -> np.ndarray:
        """Row i of the new table is old row old_rows[i] (missing: empty).

        Returns the gather index [new_B] for `resize_cache` (B = empty row).
        """
        idx = np.full(new_B, self.B, np.int32)
        idx[: len(old_rows)] = old_rows

        def keep(lst, empty):
            pad = [empty() for _ in range(new_B - len(old_rows))]
            return [lst[o] for o in old_rows] + pad

        self.req = keep(self.req, lambda: None)
        self.hist = keep(self.hist, lambda: np.zeros(0, np.int32))
        self.hist_adapter = keep(self.hist_adapter, lambda: 0)
        self.used = keep(self.used, lambda: -1)
        for k, a in self.arr.items():
            new = np.zeros(new_B, a.dtype)
            new[: len(old_rows)] = a[old_rows]
            self.arr[k] = new
        self.B = new_B
        return idx

    def truncate_history(self, slots: int) -> int:
        """Cuts every free row's cached prefix to its first `slots` tokens (the cache
        was cut to that many slots); returns how many tokens were dropped."""
        dropped = 0
        for r in self.free_rows():
            dropped += max(len(self.hist[r]) - slots, 0)
            self.hist[r] = self.hist[r][:slots]
        return dropped

    def pick_row(self, prompt: np.ndarray, taken: set[int], adapter: int = 0) -> tuple[int, int]:
        """(free row, reusable prefix length) for a prompt sampled with adapter slot
        `adapter`; prefers the longest cached prefix (of a row that held the same
        adapter: another's keys and values differ), then the least recently used
        row. At most len-1 tokens are reused (the last prompt token is fed by the
        first decode step)."""
        best = None
        for r in self.free_rows():
            if r in taken:
                continue
            h = self.hist[r] if self.hist_adapter[r] == adapter else self.hist[r][:0]
            n = min(len(h), len(prompt) - 1)
            same = h[:n] == prompt[:n]
            lcp = int(n if same.all() else np.argmin(same))
            key = (lcp, -self.used[r])
            if best is None or key > best[0]:
                best = (key, r, lcp)
        if best is None:
            raise RuntimeError("SlotTable.pick_row: no free row")
        return best[1], best[2]

    # -- rows

    def assign(self, row: int, req: Request) -> None:
        """Puts `req` in `row`, ready for its first decode step.

        All or nothing: a value that does not fit its field (OverflowError,
        ValueError) raises before the row changes."""
        p = req.params
        vals = {
            "token": req.prompt[-1],
            "pos": len(req.prompt) - 1,
            "active": True,
            "n_out": 0,
            "max_out": req.max_out,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "top_k": p.top_k,
            "seed_lo": req.seed & 0xFFFFFFFF,
            "seed_hi": (req.seed >> 32) & 0xFFFFFFFF,
            "adapter": req.slot,
        }
        vals = {k: _FIELDS[k](v) for k, v in vals.items()}  # np.int32(2**40) raises here
        for k, v in vals.items():
            self.arr[k][row] = v
        self.req[row] = req
        self.hist[row] = np.zeros(0, np.int32)

    def release(self, row: int) -> Request:
        """Frees `row`; its slots keep the keys/values of prompt + fed outputs."""
        req = self.req[row]
        assert req is not None, f"release of empty row {row}"
        seq = np.asarray(req.prompt + req.gen, np.int32)
        self.hist[row] = seq[: int(self.arr["pos"][row])]
        self.hist_adapter[row] = int(self.arr["adapter"][row])
        self.req[row] = None
        self.arr["active"][row] = False
        self.tick += 1
        self.used[row] = self.tick
        return req

    @staticmethod
    def idle_rows(B: int) -> Rows:
        """`Rows` for B empty rows (what `rows()` gives with no request held)."""
        t = SlotTable()
        t.relayout([], B)
        return t.rows()

    def rows(self) -> Rows:
        """The numpy state as a `Rows` pytree (stop ids padded with -1)."""
        reqs = [r for r in self.req if r is not None]
        ns = pow2_bucket(max([len(r.stop_ids) for r in reqs], default=1), 4, 1 << 30)
        stop = np.full((self.B, ns), -1, np.int32)
        for i, r in enumerate(self.req):
            if r is not None and r.stop_ids:
                stop[i, : len(r.stop_ids)] = r.stop_ids
        return Rows(**{k: a.copy() for k, a in self.arr.items()}, stop_ids=stop)

    def update(self, rows: Rows) -> None:
        """Takes back the decode state after a chunk."""
        for k in ("token", "pos", "active", "n_out"):
            self.arr[k] = np.array(getattr(rows, k), dtype=_FIELDS[k])
