"""JaxSampler: the embedded sampler; the Flax decoder with a KV cache, batched.

A worker thread owns the device work. `generate()` queues a request and awaits
its future; the worker gathers queued requests into free cache rows
(continuous batching: a request joins the running batch at the next decode
chunk, it never waits for the batch to finish), prefills only the part of the
prompt a free row does not already hold (prefix reuse), and runs jitted
multi-step decode chunks (`decode_loop.decode_chunk`) until every row is done.

Shared prompts (`share_prefix`, on with prefix reuse): the attempts of a group
arrive together, so none finds the others' prompt in a free row. The rule: at
admission, a request whose prompt starts with at least `worker.SHARE_MIN`
(16) more tokens than its own row already holds, held by a running row or by
a request admitted in the same round that computes its own prompt, copies
that row's keys/values (whole row, one `copy_rows` call for all) after the
source's prefill and computes only the rest: a group's shared prompt is
prefilled once. Nobody waits for it (all are admitted in the same round), the
tokens and log-probs are those of an unshared prefill (same weights, tokens
and positions; fp32 to rounding), and an in-flight swap's recompute shares the
same way. `stats.prefill_tokens` counts the tokens computed, `cached_tokens`
those not computed (`SampleResult.cached_tokens` per request) and
`shared_tokens` those of them copied from another row.
Shapes are bucketed to powers of two (rows, cache length, prefill length) so a
handful of compiles serve all traffic; a decode step costs O(1) in the sequence
length apart from attention over the cache, which reads every slot. So the
cache grows to what the next chunk writes and shrinks back once the running
rows need at most half of it (`shrink_cache`); a free row then keeps only the
part of its cached prefix that fits (`stats.cache_shrinks`, `stats.prefix_tokens_dropped`).
Every bucket combination is one XLA executable kept for good, so under varied
traffic the set (and memory) grows for a long while. A fixed cache length
(`min_cache_len >= max_context`, rows still bucketed) or `fixed_shapes=True`
(rows fixed too: one decode shape) bounds the set, and `warmup()` compiles it
all up front, after which no traffic compiles anything (`stats.compiled_shapes`).

Grammar-constrained requests (`SamplingParams.constraint`, see
`constraints`) decode one step per device call while any is in the batch:
before each step the worker computes each constrained row's allowed ids on
the host and passes them as a bitmask (all ones for the other rows); after
it, each sampled token advances its row's matcher. With no constrained row
the chunks run exactly as before (no mask input).

Requests are validated here, in the caller (ValueError naming the field),
before they reach the worker; the worker (`worker.DeviceLoop`) keeps one
request's failure from touching another and streams accepted tokens to each
request's `on_tokens`.

Weights: `load_weights` loads a published Orbax step into the model (or
`set_params` loads the learner's params from memory, as `load_weights` would
load their publish; or `set_weights` copies another Decoder's weights in) and
hands a snapshot to the worker. How the worker swaps it in is `weight_swap`:

- "drain" (default): once the running rows drain (new requests wait
  meanwhile), so one result never mixes two weight versions; one long
  generation holds every row on the old weights.
- "in_flight": at the next decode-chunk boundary, without draining. Running
  rows go on under the new weights and each output token records the version
  that sampled it (`SampleResult.output_versions`). KV rule: recompute. At
  the swap every running row's prompt and output so far are prefilled again
  under the new weights (one batched prefill; `stats.recomputed_tokens`), so
  token i's log-prob is log pi_{v_i}(y_i | prompt, y_<i): one forward pass of
  version v_i over the whole prefix, what the learner's importance ratio
  needs. (PipelineRL keeps the old keys/values instead: cheaper, but the
  tokens after a swap are then sampled from a mix of two policies that no
  forward pass reproduces.) A MoE row's recorded routing of its prefix is
  the recompute's (the new weights'). A running row whose adapter the new
  weights no longer serve fails alone. Only a new version swaps in flight: an
  adapter-bank change keeps the version (no token could record it), so it
  waits for the running rows as in "drain".
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import numbers
import queue
import threading
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx

from ac2_jax.models import Decoder, load_published
from ac2_jax.models.io.params_io import assign_params, read_published_adapter, weights_checksum
from ac2_jax.models.io.peft_io import load_peft_adapter, read_peft_config, write_slot
from ac2_jax.models.lora import LoRAConfig, adapter_params
from ac2_jax.sampling.base import (
    OnTokens,
    SamplerError,
    SampleResult,
    SamplerUnavailable,
    SamplingParams,
    check_adapter_name,
    check_prompt,
)
from ac2_jax.sampling.constraints import GrammarMatcher, end_token_id
from ac2_jax.sampling.engine.batching import Request, SamplerStats, SlotTable
from ac2_jax.sampling.engine.worker import STOP, WAKE, DeviceLoop, Warmup

WEIGHT_SWAPS = ("drain", "in_flight")  # JaxSampler(weight_swap=): see the module docstring


def _decodes(model: Any) -> bool:
    """Whether `model` has the decoder cache API the sampler drives (`Decoder`'s:
    `init_cache`, `decode`; every registered family's model)."""
    return (
        isinstance(model, nnx.Module)
        and all(callable(getattr(model, name, None)) for name in ("init_cache", "decode"))
        and hasattr(model, "config")
    )


class JaxSampler(DeviceLoop):
    """`Sampler` over a `Decoder` (see `ac2_jax.sampling.base` for the contract).

    max_context: most tokens per sequence (default: the model's
    max_position_embeddings). max_batch: most rows decoded together; the row
    count is a power of two >= min_batch (min_batch = max_batch: one shape).
    eos_token_ids: always stop tokens (plus each request's stop_token_ids).
    tokenizer: anything with `.decode(ids) -> str`; enables stop strings here.
    An `ac2_jax.text.Tokenizer` also enables `SamplingParams.constraint`
    (grammars; its EOS must be a stop token of the request).
    steps_per_sync: decode steps per device call (host checks stops between).
    prefill_chunk: most prompt tokens per row per prefill call (longer prompts
    take several). min_prefill_rows: smallest row bucket of a prefill call
    (larger: fewer compiles, more padded compute).
    max_top_logprobs: largest `top_logprobs` a request may ask for.
    seed: draws the seeds of requests that give none.
    prefix_reuse: a new request may start from the prompt prefix a free row
    already holds. Off for a model with a sliding window: its rows are rings
    (`KVCache.ring`) that hold the last window positions of the earlier
    request, not those before the shared prefix's end.
    share_prefix: requests admitted together, or beside running rows, compute
    a shared prompt prefix once (the module docstring); needs prefix_reuse.
    shrink_cache: cut the cache back once the running rows need at most half of
    it (every decode step's attention reads all slots). False keeps each free
    row's whole prefix for reuse (agents whose long contexts come back after a
    tool call), and short requests then decode over the long cache.
    fixed_shapes: always max_batch rows x max_context cache slots (min_batch and
    min_cache_len are then max_batch and max_context): more padded decode work
    at low load, a small fixed set of compiles (what a server wants).
    min_cache_len >= max_context with bucketed rows (min_batch < max_batch) is
    the middle way: decode work follows the load, and `warmup()` still compiles
    every shape up front (more of them: one set per row bucket).
    weight_swap: "drain" or "in_flight": when new weights (`load_weights`,
    `set_weights`, adapter changes) replace the running ones (module docstring).
    """

    # Decodes `SamplingParams.constraint` (masks the learner replays: `constraints`).
    supports_constraints = True

    def __init__(
        self,
        model: Decoder,
        *,
        publish_dir: str | None = None,
        max_context: int | None = None,
        max_batch: int = 16,
        min_batch: int = 1,
        eos_token_ids: Sequence[int] = (),
        tokenizer: Any = None,
        steps_per_sync: int = 8,
        min_cache_len: int = 64,
        prefill_chunk: int = 512,
        min_prefill_rows: int = 1,
        max_top_logprobs: int = 20,
        cache_dtype: Any = None,
        seed: int | None = None,
        batch_wait_s: float = 0.002,
        prefix_reuse: bool = True,
        share_prefix: bool = True,
        shrink_cache: bool = True,
        fixed_shapes: bool = False,
        weight_swap: str = "drain",
    ):
        if not _decodes(model):
            raise TypeError(
                "JaxSampler: model must be a decoder with a KV cache (an nnx.Module with "
                "config, init_cache and decode, e.g. ac2_jax.models.Decoder), got "
                f"{type(model).__name__}"
            )
        cfg = model.config
        self._max_context = int(max_context or cfg.max_position_embeddings)
        self.fixed_shapes = bool(fixed_shapes)
        if self.fixed_shapes:
            min_batch, min_cache_len = max_batch, self._max_context
        for name, v, lo in (
            ("max_context", self._max_context, 2),
            ("max_batch", max_batch, 1),
            ("min_batch", min_batch, 1),
            ("steps_per_sync", steps_per_sync, 1),
            ("min_cache_len", min_cache_len, 1),
            ("prefill_chunk", prefill_chunk, 1),
            ("min_prefill_rows", min_prefill_rows, 1),
            ("max_top_logprobs", max_top_logprobs, 0),
        ):
            if int(v) < lo:
                raise ValueError(f"JaxSampler: {name} must be >= {lo}, got {v}")
        if weight_swap not in WEIGHT_SWAPS:
            raise ValueError(
                f"JaxSampler: weight_swap must be one of {WEIGHT_SWAPS} ('drain': new "
                f"weights wait for the running rows; 'in_flight': swapped between decode "
                f"chunks), got {weight_swap!r}"
            )
        self._weight_swap = weight_swap
        if tokenizer is not None and not callable(getattr(tokenizer, "decode", None)):
            raise TypeError("JaxSampler: tokenizer must have a .decode(ids) method")
        self._vocab = cfg.vocab_size
        self._eos = tuple(int(t) for t in eos_token_ids)
        bad = [t for t in self._eos if not 0 <= t < self._vocab]
        if bad:
            raise ValueError(f"JaxSampler: eos_token_ids outside the vocabulary: {bad}")
        self._model, self._publish_dir, self._tokenizer = model, publish_dir, tokenizer
        if min_batch > max_batch:
            raise ValueError(f"JaxSampler: min_batch ({min_batch}) > max_batch ({max_batch})")
        self._max_batch, self._min_batch = int(max_batch), int(min_batch)
        self._steps = int(steps_per_sync)
        self._min_cache, self._prefill_chunk = int(min_cache_len), int(prefill_chunk)
        self._min_prefill_rows = int(min_prefill_rows)
        self._n_top, self._cache_dtype = int(max_top_logprobs), cache_dtype
        self._batch_wait = float(batch_wait_s)
        self._prefix_reuse = bool(prefix_reuse) and getattr(cfg, "sliding_window", None) is None
        self._share_prefix = bool(share_prefix) and self._prefix_reuse
        self._shrink_cache = bool(shrink_cache)
        self._rng = np.random.default_rng(seed)

        self._graphdef, self._state = self._snapshot()
        lora = getattr(cfg, "lora", None)
        self._bank_slots = 0 if lora is None or lora.slots is None else int(lora.slots)
        self._staged_slots: dict[str, int] = {}  # adapter name -> bank slot (new calls)
        self._running_slots: dict[str, int] = {}  # ... of the weights the worker runs
        self._version = 0  # weights the worker runs now
        self._latest = 0  # weights new calls will use (policy_version)
        # (version, its checksum, or the (graphdef, state) handed over to compute it from)
        self._checksum: tuple[int, Any] = (0, None)
        self._pending = None  # (state, version) waiting for the next swap
        self._lock = threading.Lock()
        self._load_lock = threading.Lock()

        self.stats = SamplerStats()
        self._table = SlotTable()
        self._cache = None
        self._S = 0
        self._waiting: collections.deque[Request] = collections.deque()
        self._admitting: list[Request] = []
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="JaxSampler", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ protocol

    @property
    def policy_version(self) -> int:
        return self._latest

    @property
    def max_context(self) -> int:
        return self._max_context

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def weight_swap(self) -> str:
        """The swap rule: "drain" or "in_flight" (see the module docstring)."""
        return self._weight_swap

    @property
    def running_version(self) -> int:
        """Version of the weights the worker runs now. Read inside `on_tokens`
        (the worker thread) it is the version sampling that request."""
        return self._version

    async def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = None,
        *,
        on_tokens: OnTokens | None = None,
    ) -> SampleResult:
        """One continuation of `prompt_ids`; see `ac2_jax.sampling.base`.

        Cancelling the awaiting task cancels the request (queue or row). A
        `params.constraint` is compiled in a worker thread (not on the loop)."""
        matcher = None
        if isinstance(params, SamplingParams) and params.constraint is not None:
            matcher = await asyncio.to_thread(self._matcher, params)
        req = self._make_request(prompt_ids, params, on_tokens, matcher)
        return await asyncio.wrap_future(req.future)

    def warmup(self) -> int:
        """Compiles every shape a sampler with a fixed cache length can use: per
        row bucket (one with fixed_shapes) the prefill row and length buckets,
        the decode chunk with up to 4 stop ids, the re-layouts between row
        buckets. Blocks until done and returns `stats.compiled_shapes`;
        requests wait meanwhile. After it, traffic compiles nothing."""
        if self._min_cache < self._max_context:
            raise ValueError(
                "JaxSampler.warmup needs a fixed cache length (fixed_shapes=True, "
                "or min_cache_len >= max_context): bucketed cache lengths have "
                "too many combinations to compile up front"
            )
        item = Warmup()
        with self._lock:
            if self._closed:
                raise SamplerError("JaxSampler is closed")
            self._queue.put(item)
        return item.future.result()

    def load_weights(self, step: int | None = None) -> int:
        """Loads a published step (None: latest); running rows finish on the old
        weights (weight_swap="drain") or go on under the new ones ("in_flight")."""
        if self._publish_dir is None:
            raise ValueError("JaxSampler.load_weights: the sampler was built without publish_dir")
        with self._load_lock:
            got = int(load_published(self._model, self._publish_dir, step))
            self._stage(got)
        return got

    def set_params(self, params: dict, version: int) -> int:
        """The in-memory `load_weights`: loads `params` as `version`, exactly as
        `load_weights` would load a publish of them (`params_io.assign_params`: a pure
        dict as `params_io.published_params` gives, every Param or a LoRA model's
        adapters alone; cast to the served dtype, placed on the served model's
        devices, copied so the caller may donate its arrays). Running rows:
        `weight_swap`. Returns version. The RL recipe's hand-off to this sampler
        when it runs in the learner's process (`SamplerConfig.hand_off`)."""
        if isinstance(version, bool) or not isinstance(version, numbers.Integral):
            raise ValueError(f"JaxSampler.set_params: version must be an int, got {version!r}")
        with self._load_lock:
            assign_params(self._model, params, "JaxSampler.set_params")
            self._stage(int(version))
        return int(version)

    def set_weights(self, source: Decoder, version: int) -> int:
        """Copies `source`'s weights (same parameter shapes) in as `version`, like
        `load_weights` (running rows: `weight_swap`). Returns version."""
        if not _decodes(source):
            raise TypeError(
                f"JaxSampler.set_weights: source must be a decoder model, got "
                f"{type(source).__name__}"
            )
        if isinstance(version, bool) or not isinstance(version, numbers.Integral):
            raise ValueError(f"JaxSampler.set_weights: version must be an int, got {version!r}")
        own, new = nnx.state(self._model, nnx.Param), nnx.state(source, nnx.Param)
        own_leaves = dict(jax.tree_util.tree_leaves_with_path(own))
        new_leaves = dict(jax.tree_util.tree_leaves_with_path(new))
        if own_leaves.keys() != new_leaves.keys():
            raise ValueError(
                "JaxSampler.set_weights: source has other parameters than the "
                "served model (a different architecture)"
            )
        for path, a in own_leaves.items():
            if a.shape != new_leaves[path].shape:
                raise ValueError(
                    f"JaxSampler.set_weights: parameter "
                    f"{jax.tree_util.keystr(path)} has shape "
                    f"{new_leaves[path].shape}, the served model {a.shape}"
                )
        cast = jax.tree.map(lambda a, b: b.astype(a.dtype), own, new)
        with self._load_lock:
            nnx.update(self._model, cast)
            self._stage(int(version))
        return int(version)

    def _stage(self, version: int, slots: dict[str, int] | None = None) -> None:
        """Hands the model's current weights (and adapter names, when `slots` is
        given) to the worker as `version`."""
        graphdef, state = self._snapshot()
        # What the worker is handed, for the weights alarm: its checksum is computed when
        # `served_weights` first asks (off the load path). An adapter-bank change serves
        # no published step: no checksum.
        with self._lock:
            self._pending = (state, version)
            self._latest = version
            self._checksum = (version, None if slots is not None else (graphdef, state))
            if slots is not None:
                self._staged_slots = dict(slots)
        self._queue.put(WAKE)

    # ------------------------------------------------------------------ adapters

    def adapters(self) -> list[str]:
        """The LoRA adapters served by name (`SamplingParams.adapter`)."""
        with self._lock:
            return sorted(self._staged_slots)

    def add_adapter(self, name: str, source: Any, lora: LoRAConfig | None = None) -> int:
        """Serves `source` as adapter `name` (replacing one of that name) in a slot
        of the model's adapter bank (`LoRAConfig(slots=N)`); returns the slot.

        source: a Decoder with one adapter (its `config.lora`), a PEFT adapter
        directory, or a pure dict of adapters (`models.lora.adapter_params`) with
        its `lora`. Nothing is merged into the base and nothing recompiles (the
        bank's arrays change, not their shapes). Running rows finish first, in
        either `weight_swap` mode (the policy version stays, so no token could
        record the change); requests after it returns may name the adapter."""
        check_adapter_name(name, "add_adapter: name")
        if not self._bank_slots:
            raise ValueError(
                "JaxSampler.add_adapter: the served model has no adapter bank; build it "
                "with DecoderConfig(lora=LoRAConfig(slots=N, rank=...))"
            )
        if isinstance(source, str):
            lora = read_peft_config(source)
            params = adapter_params(load_peft_adapter(self._model, source, slots=None))
        elif isinstance(source, nnx.Module):
            lora = getattr(getattr(source, "config", None), "lora", None)
            if lora is None or lora.slots is not None:
                raise ValueError("JaxSampler.add_adapter: source has no single adapter")
            params = adapter_params(source)
        else:
            if lora is None:
                raise ValueError("JaxSampler.add_adapter: a dict of adapters needs its lora")
            params = source
        with self._load_lock:
            slots = dict(self._staged_slots)
            used = set(slots.values())
            free = [i for i in range(1, self._bank_slots) if i not in used]
            slot = slots.get(name, free[0] if free else None)
            if slot is None:
                raise ValueError(
                    f"JaxSampler.add_adapter: all {self._bank_slots - 1} adapter slots are "
                    f"in use ({sorted(slots)}); remove_adapter one or build a larger bank"
                )
            write_slot(self._model, slot, params, lora)
            slots[name] = slot
            self._stage(self._latest, slots)
        return slot

    def load_adapter(self, name: str, publish_dir: str, step: int | None = None) -> int:
        """Serves the adapter a LoRA learner published (`publish_weights`) in
        `publish_dir` (step None: the latest) as `name`; returns the step."""
        params, lora, got = read_published_adapter(publish_dir, step)
        self.add_adapter(name, params, lora)
        return got

    def remove_adapter(self, name: str) -> None:
        """Stops serving adapter `name` (its slot is zeroed); running rows finish
        first, in either `weight_swap` mode (as `add_adapter`)."""
        with self._load_lock:
            slots = dict(self._staged_slots)
            if name not in slots:
                raise ValueError(f"JaxSampler.remove_adapter: no adapter {name!r}")
            bank = self._model.config.lora
            write_slot(self._model, slots.pop(name), {}, dataclasses.replace(bank, slots=None))
            self._stage(self._latest, slots)

    def counters(self) -> dict:
        """`stats.counters()` plus max_batch, for `occupancy_metrics` (e.g. the RL
        loop's per-step `sampler/...` metrics, `RLTrainer(sampler_counters=)`)."""
        return {**self.stats.counters(), "max_batch": self._max_batch}

    def served_weights(self) -> dict:
        """What this sampler serves, for the weights alarm (`training.rl.alarms`):
        {"version": the version new requests use, "running_version": the one the
        worker runs now, "checksum": `models.io.params_io.weights_checksum` of the
        weights `load_weights` / `set_weights` handed the worker for that version
        (None before the first load and after an adapter-bank change)}."""
        with self._lock:
            version, checksum = self._checksum
            latest, running = self._latest, self._version
        if version == latest and isinstance(checksum, tuple):  # first ask: compute, keep
            checksum = weights_checksum(nnx.merge(*checksum))
            with self._lock:
                if self._checksum[0] == version:
                    self._checksum = (version, checksum)
        return {
            "version": latest,
            "running_version": running,
            "checksum": checksum if version == latest else None,
        }

    def probe(self) -> dict:
        """Raises SamplerError when this sampler can no longer serve (closed, or
        its worker thread died); else returns {"policy_version"}."""
        if self._closed or not self._thread.is_alive():
            raise SamplerError("JaxSampler is closed (or its worker thread died)")
        return {"policy_version": self._latest}

    def close(self) -> None:
        """Stops the worker; queued and running calls fail with SamplerError."""
        with self._lock:  # no request can be queued behind STOP
            if self._closed:
                return
            self._closed = True
            self._queue.put(STOP)
        if threading.current_thread() is not self._thread:
            self._thread.join()

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.aclose()

    # ------------------------------------------------------------------ requests

    def _snapshot(self):
        """(graphdef, state) detached from the model, so in-place loads don't leak in.

        Arrays are committed to their own sharding: freshly built and
        Orbax-restored params then hit the same compiled functions."""
        graphdef, state = nnx.split(self._model)
        return graphdef, jax.tree.map(lambda a: jax.device_put(a, a.sharding), state)

    def _matcher(self, params: SamplingParams) -> GrammarMatcher:
        """The matcher of `params.constraint` over this model's vocabulary; ValueError
        naming `constraint` when it cannot be applied."""
        if self._tokenizer is None or getattr(self._tokenizer, "hf", None) is None:
            raise ValueError(
                "SamplingParams.constraint needs the JaxSampler's tokenizer (an "
                "ac2_jax.text.Tokenizer): build it with tokenizer="
            )
        end = end_token_id(self._tokenizer)
        stops = set(self._eos) | set(params.stop_token_ids)
        if end not in stops:
            raise ValueError(
                f"SamplingParams.constraint: the grammar ends the turn with token {end} "
                f"(the tokenizer's EOS), which is not a stop token of this request: add it "
                f"to stop_token_ids or the sampler's eos_token_ids"
            )
        try:
            return GrammarMatcher(params.constraint or "", self._tokenizer, self._vocab)
        except ValueError as e:
            raise ValueError(f"SamplingParams.constraint: {e}") from None

    def _make_request(self, prompt_ids, params, on_tokens=None, matcher=None) -> Request:
        """Validates everything here, in the caller: the worker only sees good requests."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"generate: params must be SamplingParams, got {type(params).__name__}")
        if on_tokens is not None and not callable(on_tokens):
            raise TypeError(f"generate: on_tokens must be callable, got {type(on_tokens).__name__}")
        checked = params.checked()  # again: a frozen dataclass can still be forced
        if any(getattr(params, k) != v for k, v in checked.items()):
            params = dataclasses.replace(params, **checked)
        if isinstance(prompt_ids, (str, bytes)) or not hasattr(prompt_ids, "__iter__"):
            raise ValueError(
                f"generate: prompt_ids must be a sequence of ints, got {type(prompt_ids).__name__}"
            )
        prompt = list(prompt_ids)
        bad = [t for t in prompt if isinstance(t, bool) or not isinstance(t, numbers.Integral)]
        if bad:
            raise ValueError(f"generate: prompt_ids must be ints, got {bad[0]!r}")
        prompt = [int(t) for t in prompt]
        check_prompt(prompt, self._max_context, self._vocab)
        if params.top_logprobs > self._n_top:
            raise ValueError(
                f"SamplingParams.top_logprobs={params.top_logprobs} exceeds this "
                f"sampler's max_top_logprobs={self._n_top}"
            )
        bad = [t for t in params.stop_token_ids if not 0 <= t < self._vocab]
        if bad:
            raise ValueError(
                f"SamplingParams.stop_token_ids has ids outside the vocabulary "
                f"[0, {self._vocab}): {bad[:5]}"
            )
        if params.constraint is not None and matcher is None:
            matcher = self._matcher(params)
        if params.adapter is not None and params.adapter not in self._staged_slots:
            raise ValueError(
                f"SamplingParams.adapter: this sampler serves no adapter {params.adapter!r} "
                f"(it serves {self.adapters()}; add_adapter adds one)"
            )
        seed = int(self._rng.integers(0, 2**63)) if params.seed is None else params.seed
        stop_ids = tuple(dict.fromkeys(self._eos + params.stop_token_ids))
        req = Request(
            prompt=prompt,
            params=params,
            future=concurrent.futures.Future(),
            seed=seed & (2**64 - 1),
            stop_ids=stop_ids,
            max_out=min(params.max_tokens, self._max_context - len(prompt)),
            on_tokens=on_tokens,
            matcher=matcher,
        )
        with self._lock:
            if self._closed:  # never queued: another sampler may take it
                raise SamplerUnavailable("JaxSampler is closed")
            self._queue.put(req)
        return req
