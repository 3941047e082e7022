"""The JaxSampler's worker thread: admission, prefill, decode chunks, results.

`DeviceLoop` is the half of `JaxSampler` that runs on the worker thread (the
other half, in `jax_sampler`, validates requests in the caller and queues
them). It owns the cache and the `SlotTable`; every device call happens here.

Failures stay with their request: an exception in one row's host work (stop
strings, top-logprob rows, the caller's `on_tokens`) fails that request with
`SamplerError` and frees its row; an exception escaping a device step fails
only the requests held in rows, rebuilds the cache and goes on (waiting
requests are untouched). A caller that gives up (cancelled future) is dropped
from the queue or has its row freed at the next chunk boundary.
"""

from __future__ import annotations

import collections
import concurrent.futures
import queue
import threading
import time
from typing import Any

import jax
import numpy as np

from ac2_jax.sampling.base import SamplerError, SampleResult, truncate_at_stop
from ac2_jax.sampling.engine.batching import Request, SamplerStats, SlotTable, pow2_bucket, resolve
from ac2_jax.sampling.engine.decode_loop import copy_rows, decode_chunk, prefill_rows, resize_cache
from ac2_jax.trace.routing import encode_routing

WAKE = object()  # queue item: look at pending weights
STOP = object()  # queue item: close
# Fewest prompt tokens a row copies from another instead of computing them (`_prefill`):
# below it, one row copy and a second prefill call cost more than the tokens saved.
SHARE_MIN = 16


class Warmup:
    """Queue item: compile every shape of the fixed geometry (`JaxSampler.warmup`)."""

    def __init__(self):
        self.future: concurrent.futures.Future = concurrent.futures.Future()


def bucket_sizes(lo: int, hi: int) -> list[int]:
    """Every value `pow2_bucket(n, lo, hi)` can return, ascending."""
    out, b = [], max(int(lo), 1)
    while True:
        out.append(min(b, int(hi)))
        if b >= hi:
            return out
        b *= 2


def record_routing(req: Request, positions: np.ndarray, ids: np.ndarray) -> None:
    """Records the experts [n, moe layers, k] of the request's tokens at `positions`
    [n] (negative: padding, skipped) in `req.routing` ([prompt + max_out, layers, k],
    -1 until recorded: the positions of a reused prefix stay -1)."""
    ids = np.asarray(ids)
    if req.routing is None:
        req.routing = np.full((len(req.prompt) + req.max_out, *ids.shape[1:]), -1, np.int32)
    positions = np.asarray(positions)
    ok = (positions >= 0) & (positions < len(req.routing))
    req.routing[positions[ok]] = ids[: len(positions)][ok]


class DeviceLoop:
    """Worker-thread methods of `JaxSampler` (a mixin: it uses the sampler's
    config, `_queue`, `_lock`, `_pending`, `_graphdef`/`_state`, `stats`)."""

    # What the mixin reads and writes; `JaxSampler.__init__` sets every one of them.
    _pending: tuple[Any, int] | None  # (state, version) waiting for the next swap
    _queue: queue.SimpleQueue
    _lock: threading.Lock
    _waiting: collections.deque[Request]
    _admitting: list[Request]
    _table: SlotTable
    _cache: Any
    _S: int
    stats: SamplerStats
    _graphdef: Any
    _state: Any
    _version: int
    _weight_swap: str  # "drain" | "in_flight" (`JaxSampler(weight_swap=)`)
    _model: Any
    _staged_slots: dict[str, int]  # adapter name -> bank slot of the staged weights
    _running_slots: dict[str, int]  # ... of the weights the worker runs
    _tokenizer: Any
    _cache_dtype: Any
    _max_context: int
    _max_batch: int
    _min_batch: int
    _min_cache: int
    _min_prefill_rows: int
    _prefill_chunk: int
    _steps: int
    _n_top: int
    _batch_wait: float
    _prefix_reuse: bool
    _share_prefix: bool
    _shrink_cache: bool
    _vocab: int

    # ------------------------------------------------------------------ worker

    def _run(self) -> None:
        try:
            while self._pull():
                try:
                    self._iteration()
                except Exception as e:  # noqa: BLE001 - a crash: fail what it held, go on
                    self._restart(e)
        finally:

            def closed():
                return SamplerError("JaxSampler was closed before this request finished")

            self._fail_running(closed)
            for req in self._waiting:
                resolve(req, exc=closed())
            while True:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if isinstance(item, Request):
                    resolve(item, exc=closed())

    def _pull(self) -> bool:
        """Moves queued requests to `_waiting`; blocks when idle. False on close."""
        busy = self._waiting or self._table.active_rows() or self._pending is not None
        items = []
        if not busy:
            items.append(self._queue.get())
            if self._batch_wait > 0:
                time.sleep(self._batch_wait)  # let concurrent callers join this batch
        while True:
            try:
                items.append(self._queue.get_nowait())
            except queue.Empty:
                break
        for item in items:
            if item is STOP:
                return False
            if isinstance(item, Request):
                self._waiting.append(item)
            elif isinstance(item, Warmup):
                try:
                    resolve(item, result=self._warm())
                except Exception as e:  # noqa: BLE001 - the caller of warmup() gets it
                    resolve(item, exc=e)
        return True

    def _warm(self) -> int:
        """Runs every jitted shape a fixed cache length can produce on scratch
        caches (the live cache and rows are untouched): per row bucket B the
        cache, its prefill row / length buckets, the decode chunk (up to 4 stop
        ids) and its one-step masked form (constrained rows), and the re-layout
        to every other row bucket. Returns the number of shapes known afterwards."""
        S, buckets = self._max_context, bucket_sizes(self._min_batch, self._max_batch)
        for B in buckets:
            cache = self._new_cache(B, S)
            for b in bucket_sizes(min(self._min_prefill_rows, B), B):
                for T in bucket_sizes(min(16, self._prefill_chunk), self._prefill_chunk):
                    cache, _ = self._prefill_call(
                        cache,
                        B,
                        np.full(b, B, np.int32),
                        np.zeros((b, T), np.int32),
                        np.full((b, T), -1, np.int32),
                        np.zeros(b, np.int32),
                    )
            for n in bucket_sizes(1, B):  # shared prompt prefixes (`_prefill`)
                cache = copy_rows(cache, np.zeros(n, np.int32), np.full(n, B, np.int32))
                self.stats.shapes.add(("copy_rows", B, S, n))
            rows = SlotTable.idle_rows(B)
            cache, _, _ = decode_chunk(
                self._graphdef,
                self._state,
                cache,
                rows,
                np.bool_(False),
                None,  # as _decode passes it: jit keys an omitted argument apart
                n_steps=self._steps,
                n_top=self._n_top,
            )
            self.stats.shapes.add(("decode_chunk", B, S, rows.stop_ids.shape[1]))
            cache, _, _ = decode_chunk(  # the one-step chunk of constrained rows
                self._graphdef,
                self._state,
                cache,
                rows,
                np.bool_(False),
                np.full((B, -(-self._vocab // 32)), 0xFFFFFFFF, np.uint32),
                n_steps=1,
                n_top=self._n_top,
            )
            self.stats.shapes.add(("decode_masked", B, S, rows.stop_ids.shape[1]))
            for new_B in buckets:  # admission grows the rows, compaction shrinks them
                if new_B != B:
                    jax.block_until_ready(
                        resize_cache(cache, np.full(new_B, B, np.int32), max_len=S)
                    )
                    self.stats.shapes.add(("resize_cache", B, S, new_B, S))
            jax.block_until_ready(cache)
        return self.stats.compiled_shapes

    def _prefill_call(self, cache, B: int, idx, tok, pos, adapters):
        """`prefill_rows` on a [B]-row cache, its three compiled shapes recorded."""
        (b, T), S = tok.shape, cache.max_len
        self.stats.shapes.update(
            {("prefill", b, S, T), ("take_rows", B, S, b), ("put_rows", B, S, b)}
        )
        return prefill_rows(self._graphdef, self._state, cache, idx, tok, pos, adapters)

    def _new_cache(self, B: int, S: int):
        """An empty cache committed to its device, like every cache a jitted call
        returns: one executable per shape, not one for fresh and one for reused."""
        cache = self._model.init_cache(B, S, dtype=self._cache_dtype)
        self.stats.shapes.add(("init_cache", B, S))
        return jax.tree.map(lambda a: jax.device_put(a, a.sharding), cache)

    def _iteration(self) -> None:
        t = self._table
        for row in t.active_rows():
            self._drop_if_cancelled(row)
        keep = collections.deque(r for r in self._waiting if not r.future.cancelled())
        self.stats.cancelled += len(self._waiting) - len(keep)
        self._waiting = keep
        running = t.active_rows()
        with self._lock:
            pending = self._pending
            # In flight only when the version changes: a stage that keeps the running
            # version (an adapter-bank change: add_adapter, load_adapter,
            # remove_adapter) would change a running row's weights with no token
            # recording it, so it waits for the rows to drain in either mode.
            in_flight = (
                self._weight_swap == "in_flight"
                and pending is not None
                and pending[1] != self._version
            )
            if pending is not None and (in_flight or not running):
                (self._state, self._version), self._pending = pending, None
                self._running_slots = dict(self._staged_slots)
                t.clear_history()
                self.stats.weight_swaps += 1
                pending = None
            else:
                running = []
        if running:  # in flight: the running rows go on under the new weights
            self._recompute(running)
        if pending is None and self._waiting:
            self._admit()
        if t.active_rows():
            self._decode()

    def _recompute(self, rows: list[int]) -> None:
        """The KV rule of an in-flight swap (`weight_swap="in_flight"`): every
        running row's prompt and output so far are prefilled again under the new
        weights (one batched prefill), so each later token is sampled from, and
        its log-prob is, the new policy over the whole prefix: exactly what a
        learner forward pass of that version gives. A row whose adapter the new
        weights no longer serve fails alone (SamplerError)."""
        t, jobs = self._table, []
        for r in rows:
            req = t.held(r)
            try:
                req.slot = self._adapter_slot(req)
            except Exception as e:  # noqa: BLE001 - this request's adapter only
                self._fail_row(r, req, e)
                t.hist[r] = t.hist[r][:0]  # its keys/values are the old weights'
                continue
            t.arr["adapter"][r] = req.slot
            seq = np.asarray(req.prompt + req.gen, np.int32)  # pos = len(seq) - 1: fed next
            jobs.append((r, seq, 0))
        self.stats.in_flight_swaps += 1
        self.stats.swapped_rows += len(jobs)
        self.stats.recomputed_tokens += sum(len(p) - 1 for _, p, _ in jobs)
        self._prefill(jobs)

    def _drop_if_cancelled(self, row: int) -> bool:
        """Frees `row` if its caller gave up (counted)."""
        if not self._table.held(row).future.cancelled():
            return False
        self._table.release(row)
        self.stats.cancelled += 1
        return True

    def _fail_row(self, row: int, req: Request, exc: Exception) -> None:
        """Host work for `req` in `row` raised: that request fails, its row is freed."""
        if self._table.req[row] is req:
            self._table.release(row)
        self._fail_request(req, exc)

    def _fail_request(self, req: Request, exc: Exception) -> None:
        self.stats.request_errors += 1
        err = SamplerError(f"JaxSampler failed this request: {type(exc).__name__}: {exc}")
        err.__cause__ = exc
        resolve(req, exc=err)

    def _restart(self, exc: Exception) -> None:
        """An exception escaped a device step: fail only the requests held in
        rows (or being admitted), rebuild the cache; waiting requests go on."""
        held = {id(r): r for r in self._admitting + [r for r in self._table.req if r is not None]}
        for req in held.values():
            if not req.future.done():
                self.stats.request_errors += 1
            err = SamplerError(
                f"JaxSampler worker failed ({type(exc).__name__}: {exc}) while "
                f"this request was running; the worker restarted"
            )
            err.__cause__ = exc
            resolve(req, exc=err)
        self.stats.worker_restarts += 1
        self._admitting = []
        self._table, self._cache, self._S = SlotTable(), None, 0

    def _fail_running(self, make_exc) -> None:
        """Fails every admitted request with `make_exc()` and drops the cache."""
        t = self._table
        for req in self._admitting + [r for r in t.req if r is not None]:
            resolve(req, exc=make_exc())
        self._admitting = []
        self._table, self._cache, self._S = SlotTable(), None, 0

    # ------------------------------------------------------------------ device steps

    def _layout(self, rows: list[int], B: int, S: int) -> None:
        """Re-lays the cache: new row i = old row rows[i]; S slots per row."""
        if self._cache is None:
            self._table.relayout([], B)
            self._cache = self._new_cache(B, S)
        else:
            old = (self._table.B, self._S)
            idx = self._table.relayout(rows, B)
            self._cache = resize_cache(self._cache, idx, max_len=S)
            self.stats.shapes.add(("resize_cache", *old, B, S))
            self.stats.resizes += 1
            if S < old[1]:  # free rows keep the prefix that still fits
                self.stats.cache_shrinks += 1
                self.stats.prefix_tokens_dropped += self._table.truncate_history(S)
        self._S = S

    def _need_len(self, steps: int) -> int:
        """Cache slots the active rows need for the next `steps` decode steps."""
        t, need = self._table, 1
        for r in t.active_rows():
            req = t.held(r)
            last = len(req.prompt) + req.max_out - 1  # last position ever written
            need = max(need, min(int(t.arr["pos"][r]) + steps, last))
        return pow2_bucket(need, self._min_cache, self._max_context)

    def _admit(self) -> None:
        t = self._table
        n_active = len(t.active_rows())
        n = min(len(self._waiting), self._max_batch - n_active)
        if n <= 0:
            return
        self._admitting = [self._waiting.popleft() for _ in range(n)]
        if self._cache is None or n > len(t.free_rows()):
            B = pow2_bucket(n_active + n, self._min_batch, self._max_batch)
            self._layout(list(range(t.B)), max(B, t.B), max(self._S, self._min_cache))
        jobs, taken = [], set[int]()
        for req in self._admitting:
            prompt = np.asarray(req.prompt, np.int32)
            slot = self._running_slots.get(req.params.adapter or "", 0)
            row, reuse = (
                t.pick_row(prompt, taken, slot)
                if self._prefix_reuse
                else (next(r for r in t.free_rows() if r not in taken), 0)
            )
            try:
                req.slot = self._adapter_slot(req)
                t.assign(row, req)  # writes nothing unless every field fits
            except Exception as e:  # noqa: BLE001 - a request the checks missed fails alone
                self._fail_request(req, e)
                continue
            taken.add(row)
            req.version, req.cached = self._version, reuse
            jobs.append((row, prompt, reuse))
        S = self._need_len(self._steps)
        if S > self._S:
            self._layout(list(range(t.B)), t.B, S)
        running = []  # rows decoding now: slots 0..pos-1 hold prompt + output
        for r in t.active_rows():
            if r not in taken:
                req = t.held(r)
                running.append((r, (req.prompt + req.gen)[: int(t.arr["pos"][r])]))
        shared = self._prefill(jobs, running)
        for row, _, reuse in jobs:
            t.held(row).cached = max(reuse, shared.get(row, 0))
        self._admitting = []
        self.stats.cached_tokens += sum(t.held(row).cached for row, _, _ in jobs)

    def _adapter_slot(self, req: Request) -> int:
        """The bank slot of the request's adapter in the running weights (0: none);
        SamplerError if it was removed after the request was accepted."""
        name = req.params.adapter
        if name is None:
            return 0
        if name not in self._running_slots:
            raise SamplerError(f"adapter {name!r} was removed before this request started")
        return self._running_slots[name]

    def _prefill(self, jobs, sources=()) -> dict[int, int]:
        """Writes prompt[reuse:-1] of each job (row, prompt, reuse) into its row.

        Shared prefixes (`share_prefix`): a job whose prompt starts with at least
        SHARE_MIN more tokens than its own `reuse` held by another row takes them
        from that row instead of computing them. The source is the row with the
        longest such prefix among `sources` ((row, tokens its slots 0.. hold now),
        e.g. running rows) and the earlier jobs of this call that take no source
        themselves (after their prefill). So the attempts of a group that arrive
        together prefill their shared prompt once: the first computes it, the
        others copy its keys/values (`copy_rows`, whole rows) and compute only
        their own suffix. Same weights, same tokens, same positions: the copied
        keys/values are the ones the row would compute (to float rounding of a
        differently shaped call). Returns {row: tokens copied} of those jobs."""
        plan = self._share_plan(jobs, sources) if self._share_prefix else {}
        jobs = [(row, p, reuse) for row, p, reuse in jobs if len(p) - 1 > reuse]
        self._prefill_jobs([j for j in jobs if j[0] not in plan])
        if plan:
            t = self._table
            n = pow2_bucket(len(plan), 1, t.B)
            src, dst = np.zeros(n, np.int32), np.full(n, t.B, np.int32)
            for i, (row, (source, _)) in enumerate(plan.items()):
                src[i], dst[i] = source, row
            t0 = time.perf_counter()
            self._cache = jax.block_until_ready(copy_rows(self._cache, src, dst))
            self.stats.shapes.add(("copy_rows", t.B, self._S, n))
            for row, (source, shared) in plan.items():  # MoE: the copied keys' experts
                frm, to = t.req[source], t.held(row)
                if frm is not None and frm.routing is not None:
                    record_routing(to, np.arange(shared), frm.routing[:shared])
            self.stats.shared_tokens += sum(shared for _, shared in plan.values())
            self.stats.prefill_s += time.perf_counter() - t0
            rest = [(row, p, plan[row][1]) for row, p, _ in jobs if row in plan]
            self._prefill_jobs([(row, p, n) for row, p, n in rest if len(p) - 1 > n])
        return {row: shared for row, (_, shared) in plan.items()}

    def _share_plan(self, jobs, sources) -> dict[int, tuple[int, int]]:
        """{job row: (source row, shared tokens)} for `_prefill` (its rule)."""
        t = self._table
        cands = [(row, np.asarray(held, np.int32)) for row, held in sources]
        plan: dict[int, tuple[int, int]] = {}
        for row, p, reuse in jobs:
            want = np.asarray(p[:-1], np.int32)  # the last prompt token is fed by decode
            best, best_n = None, reuse + SHARE_MIN - 1
            for src, held in cands:
                if t.arr["adapter"][src] != t.arr["adapter"][row]:
                    continue  # another adapter's keys and values differ
                n = min(len(held), len(want))
                same = held[:n] == want[:n]
                lcp = int(n if same.all() else np.argmin(same))
                if lcp > best_n:
                    best, best_n = src, lcp
            if best is None:
                cands.append((row, want))  # computes its own prompt: a source for the later
            else:
                plan[row] = (best, best_n)
        return plan

    def _prefill_jobs(self, jobs) -> None:
        """Writes prompt[reuse:-1] of each job into its row, in chunks of <= prefill_chunk."""
        if not jobs:
            return
        t = self._table
        b = pow2_bucket(len(jobs), min(self._min_prefill_rows, t.B), t.B)
        longest = max(len(p) - 1 - reuse for _, p, reuse in jobs)
        T = pow2_bucket(longest, min(16, self._prefill_chunk), self._prefill_chunk)
        t0 = time.perf_counter()
        for start in range(0, longest, T):
            idx = np.full(b, t.B, np.int32)
            ada = np.zeros(b, np.int32)
            tok = np.zeros((b, T), np.int32)
            pos = np.full((b, T), -1, np.int32)
            for i, (row, p, reuse) in enumerate(jobs):
                lo, hi = reuse + start, min(reuse + start + T, len(p) - 1)
                idx[i], ada[i] = row, t.arr["adapter"][row]
                if hi > lo:
                    tok[i, : hi - lo] = p[lo:hi]
                    pos[i, : hi - lo] = np.arange(lo, hi)
            self._cache, routing = self._prefill_call(self._cache, t.B, idx, tok, pos, ada)
            self.stats.prefill_calls += 1
            if routing is not None:  # the experts each prompt token went to (MoE)
                routing = np.asarray(jax.device_get(routing))
                for i, (row, _, _) in enumerate(jobs):
                    record_routing(t.held(row), pos[i], routing[i])
        jax.block_until_ready(self._cache)
        self.stats.prefill_s += time.perf_counter() - t0
        self.stats.prefill_rows += len(jobs)
        self.stats.prefill_tokens += sum(len(p) - 1 - reuse for _, p, reuse in jobs)

    def _decode(self) -> None:
        t = self._table
        active = t.active_rows()
        if not self._waiting and t.B > self._min_batch and len(active) <= t.B // 4:
            # Few rows left: compact, keeping the most recently used free rows' prefixes.
            B = pow2_bucket(len(active), self._min_batch, self._max_batch)
            spare = sorted(t.free_rows(), key=lambda r: -t.used[r])[: B - len(active)]
            self._layout(active + spare, B, self._S)
            active = t.active_rows()
        mask = self._masks(active)
        if mask is not None:
            active = t.active_rows()  # a row whose grammar failed is gone
            if not active:
                return
        steps = self._steps if mask is None else 1
        S = self._need_len(steps)
        # Grow to what the next chunk writes; shrink once the running rows need at
        # most half (every step's attention reads all S slots of every row).
        if S > self._S or (self._shrink_cache and 2 * S <= self._S):
            self._layout(list(range(t.B)), t.B, S)
        want_top = any(t.held(r).params.top_logprobs > 0 for r in active)
        t0 = time.perf_counter()
        rows_in = t.rows()
        self._cache, rows, out = decode_chunk(
            self._graphdef,
            self._state,
            self._cache,
            rows_in,
            np.bool_(want_top),
            mask,
            n_steps=steps,
            n_top=self._n_top,
        )
        kind = "decode_chunk" if mask is None else "decode_masked"
        self.stats.shapes.add((kind, t.B, self._S, rows_in.stop_ids.shape[1]))
        rows, (toks, lps, tids, tlps, rts) = jax.device_get((rows, out))
        self.stats.decode_s += time.perf_counter() - t0
        t.update(rows)
        steps = int((toks >= 0).any(axis=1).sum())
        st = self.stats
        st.decode_chunks += 1
        st.decode_steps += steps
        st.active_rows[len(active)] += steps
        st.max_active = max(st.max_active, len(active))
        for r in active:
            if self._drop_if_cancelled(r):
                continue
            req = t.held(r)
            try:
                self._accept(r, toks, lps, tids, tlps, rts)
            except Exception as e:  # noqa: BLE001 - this request's fault only
                self._fail_row(r, req, e)

    def _masks(self, active: list[int]) -> np.ndarray | None:
        """Bitmask words [B, W] of the next token of every row (all ones where no
        grammar holds), or None when no active row has a constraint. A row whose
        grammar fails here fails its request alone (its row is freed)."""
        t = self._table
        held = [r for r in active if t.held(r).matcher is not None]
        if not held:
            return None
        mask = np.full((t.B, -(-self._vocab // 32)), 0xFFFFFFFF, np.uint32)
        for r in held:
            req = t.held(r)
            try:
                req.matcher.fill_bitmask(mask[r])
            except Exception as e:  # noqa: BLE001 - this request's grammar only
                self._fail_row(r, req, e)
        return mask

    def _accept(self, row: int, toks, lps, tids, tlps, rts=None) -> None:
        """Per-request host work after a chunk: take the row's new tokens, apply
        stop strings, hand accepted tokens to on_tokens, resolve when done.
        rts: the chunk's routing [n, B, moe layers, k] (MoE models), else None."""
        t, st = self._table, self.stats
        req = t.held(row)
        got = toks[:, row] >= 0
        new = toks[got, row].tolist()
        if rts is not None:  # step i fed position len(prompt) - 1 + (tokens before it)
            fed = len(req.prompt) - 1 + len(req.gen) + np.arange(len(new))
            record_routing(req, fed, rts[got, row])
        if req.matcher is not None:
            for tok in new:  # a token outside the grammar fails the request here
                req.matcher.consume(tok)
        req.gen += new
        req.logprobs += lps[got, row].tolist()
        req.versions += [self._version] * len(new)  # one chunk, one set of weights
        st.output_tokens += len(new)
        k = req.params.top_logprobs
        if k:
            req.tops = req.tops or []
            req.tops.extend(
                list(zip(i.tolist(), lp.tolist(), strict=True))
                for i, lp in zip(tids[got, row, :k], tlps[got, row, :k], strict=True)
            )
        done = not bool(t.arr["active"][row])
        keep, cut = len(req.gen), False
        if self._tokenizer is not None and req.params.stop and req.gen:
            text = self._tokenizer.decode(req.gen)
            hit = tuple(x for x in req.params.stop if x in text)
            if hit:
                probe = SampleResult(req.gen, req.logprobs, "length", req.version)
                cut_res, _ = truncate_at_stop(probe, hit, self._tokenizer.decode)
                # Accepted tokens are never taken back (a non-monotone decode could try).
                keep, cut, done = max(len(cut_res.output_ids), req.sent), True, True
        if req.on_tokens is not None and keep > req.sent:
            req.on_tokens(req.gen[req.sent : keep], req.logprobs[req.sent : keep])
            req.sent = keep
        if not done:
            return
        ids, versions = req.gen[:keep], req.versions[:keep]
        first = versions[0] if versions else req.version
        res = SampleResult(
            output_ids=list(ids),
            output_logprobs=list(req.logprobs[:keep]),
            finish_reason="stop" if cut or (ids and ids[-1] in req.stop_ids) else "length",
            policy_version=first,
            output_versions=None if all(v == first for v in versions) else list(versions),
            cached_tokens=req.cached,
            top_logprobs=None if req.tops is None else list(req.tops[:keep]),
            routed_experts=(
                None
                if req.routing is None
                else encode_routing(req.routing[: len(req.prompt) + len(ids)])
            ),
        )
        t.release(row)
        resolve(req, result=res)
