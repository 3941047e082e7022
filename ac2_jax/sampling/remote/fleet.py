"""FleetSampler: one `Sampler` over N backend samplers (a sampler fleet).

The backends are any samplers: `SGLangSampler` clients of SGLang servers or
of JaxSampler backend processes (`python -m ac2_jax.serving.backend`, which
speaks SGLang's protocol), or in-process `JaxSampler`s.

Routing. A request started inside `route_key(key)` (the endpoint uses the
rollout id) goes to the backend its key went to first, so one rollout stays
on one backend (its prefix cache). A new key, or a request without one, goes
to the live backend with the fewest requests in flight (then the fewest keys
so far). Keys are remembered up to `max_keys`, least recently used dropped
first (`route_evictions`); a key whose backend is down moves to a live one
(`moved_keys`).

Failures. `SamplerUnavailable` (the request never reached the backend: its
server refused the connection) marks that backend down, and the request goes
to another live backend (`retried`). Any other `SamplerError` fails that
request alone (the endpoint ends its rollout as infra_error) and starts a
health check of the backend (its `probe()`, when it has one) in a thread; a
failed check marks it down. A backend that is down gets no requests; every
`retry_s` a thread probes it and, once it answers, loads the fleet's weights
version into it if it missed one, then marks it up. With no live backend a
request fails with `SamplerUnavailable` naming each backend's last error.

Weights. `load_weights(step)` loads the step into every live backend in turn
(step=None resolves to one step on the first backend, which the others then
load). A backend that fails to load is marked down until a probe and a load
bring it to the fleet's version. `policy_version` moves once every live
backend has loaded the step. Each result carries the version of the backend
that sampled it, so no completion mixes versions; while a load runs,
backends may serve different versions for a moment.

`status()` is each backend's health and load (JSON-ready), which the
endpoint shows the admin in GET /v1/models.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

from ac2_jax.sampling.base import (
    OnTokens,
    Sampler,
    SamplerError,
    SampleResult,
    SamplerUnavailable,
    SamplingParams,
)

log = logging.getLogger(__name__)

_ROUTE_KEY: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "ac2_jax_route_key", default=None
)


@contextlib.contextmanager
def route_key(key: str | None) -> Iterator[None]:
    """Requests started inside this block (asyncio tasks created here keep it)
    carry `key`: a FleetSampler sends every request of one key to one backend.
    Other samplers ignore it."""
    token = _ROUTE_KEY.set(key)
    try:
        yield
    finally:
        _ROUTE_KEY.reset(token)


@dataclasses.dataclass
class BackendState:
    """One backend's health and load, as the fleet sees it."""

    name: str
    up: bool = True
    in_flight: int = 0
    requests: int = 0  # requests sent (retries included)
    errors: int = 0  # requests that failed with SamplerError
    unavailable: int = 0  # of those, never sent (retried on another backend)
    keys: int = 0  # route keys given to it (a rollout each)
    downs: int = 0  # times marked down
    last_error: str | None = None
    retry_at: float = 0.0  # monotonic time of the next probe while down
    checking: bool = False  # a health check thread is running


class FleetSampler:
    """`Sampler` over `backends` (see the module docstring).

    names: one per backend, shown in `status()` (default: its `base_url`, else
    "backend<i>"). retry_s: seconds between probes of a down backend.
    max_keys: route keys remembered (least recently used dropped first).
    """

    def __init__(
        self,
        backends: Sequence[Sampler],
        *,
        names: Sequence[str] | None = None,
        retry_s: float = 2.0,
        max_keys: int = 100_000,
    ):
        backends = list(backends)
        if not backends:
            raise ValueError("FleetSampler needs at least one backend sampler")
        for i, b in enumerate(backends):
            if not isinstance(b, Sampler):
                raise TypeError(
                    f"FleetSampler: backend {i} ({type(b).__name__}) is not a "
                    f"Sampler (generate, load_weights, policy_version, max_context)"
                )
        if names is None:
            names = [str(getattr(b, "base_url", f"backend{i}")) for i, b in enumerate(backends)]
        if len(names) != len(backends) or len(set(names)) != len(names):
            raise ValueError(
                f"FleetSampler: names must be {len(backends)} distinct strings, got {list(names)}"
            )
        versions = {b.policy_version for b in backends}
        if len(versions) > 1:
            raise ValueError(
                f"FleetSampler: the backends serve different policy versions "
                f"{sorted(versions)}; load one step into each first"
            )
        if retry_s <= 0 or max_keys < 1:
            raise ValueError(
                f"FleetSampler: retry_s must be > 0 and max_keys >= 1, got {retry_s}, {max_keys}"
            )
        self._backends = backends
        self._states = [BackendState(name=str(n)) for n in names]
        self._version = versions.pop()
        self._retry_s, self._max_keys = float(retry_s), int(max_keys)
        self._routes: collections.OrderedDict[str, int] = collections.OrderedDict()
        self.route_evictions = self.moved_keys = self.retried = 0
        self._lock = threading.Lock()  # the states and routes
        self._load_lock = threading.Lock()  # weight loads (the fleet's and revivals')

    # ------------------------------------------------------------------ protocol

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def supports_constraints(self) -> bool:
        """Grammar-constrained requests only when every backend decodes them."""
        return all(getattr(b, "supports_constraints", False) for b in self._backends)

    @property
    def max_context(self) -> int:
        return min(b.max_context for b in self._backends)

    async def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        on_tokens: OnTokens | None = None,
    ) -> SampleResult:
        """One continuation, sampled by one backend (see the module docstring)."""
        key, tried = _ROUTE_KEY.get(), set[int]()
        while True:
            i = self._pick(key, tried)
            st = self._states[i]
            try:
                return await self._backends[i].generate(prompt_ids, params, on_tokens=on_tokens)
            except SamplerUnavailable as e:  # never sent: another backend may take it
                self._failed(i, e, sent=False)
                tried.add(i)
            except SamplerError as e:
                self._failed(i, e, sent=True)
                raise
            finally:
                with self._lock:
                    st.in_flight -= 1

    def load_weights(self, step: int | None = None) -> int:
        """Loads `step` (None: the latest) into every live backend; returns it."""
        with self._load_lock:
            with self._lock:
                live = [i for i, st in enumerate(self._states) if st.up]
            if not live:
                raise SamplerError(f"FleetSampler.load_weights: no live backend ({self._errors()})")
            got, first_err = step, None
            version: int | None = None  # what the backends loaded (None: none yet)
            for i in live:
                try:
                    version = got = int(self._backends[i].load_weights(got))
                except Exception as e:  # noqa: BLE001 - that backend is out until it loads
                    if version is None and not isinstance(e, SamplerError):
                        raise  # a bad step or setup, not a backend failure: nothing loaded
                    first_err = first_err or e
                    with self._lock:
                        self._mark_down(i, f"load_weights({got}) failed: {type(e).__name__}: {e}")
            if version is None:
                raise SamplerError(
                    f"FleetSampler.load_weights: every backend failed ({self._errors()})"
                ) from first_err
            self._version = version
            return version

    def served_weights(self) -> dict:
        """The weights alarm's report (`JaxSampler.served_weights`) of every live
        backend ("members"; a backend without one reports its version and no
        checksum); "version" is the oldest a member serves."""
        with self._lock:
            live = [b for st, b in zip(self._states, self._backends, strict=True) if st.up]
        members: list[dict] = []
        for b in live:
            report = getattr(b, "served_weights", None)
            members.append(
                report() if callable(report) else {"version": b.policy_version, "checksum": None}
            )
        versions = [int(m["version"]) for m in members if m.get("version") is not None]
        return {"version": min(versions, default=None), "checksum": None, "members": members}

    # ------------------------------------------------------------------ status

    def status(self) -> dict[str, Any]:
        """Per-backend health and load, and the routing counters (JSON-ready)."""
        with self._lock:
            rows = [
                {**dataclasses.asdict(st), "policy_version": b.policy_version}
                for st, b in zip(self._states, self._backends, strict=True)
            ]
            for r in rows:
                del r["retry_at"], r["checking"]
            return {
                "policy_version": self._version,
                "live": sum(r["up"] for r in rows),
                "route_keys": len(self._routes),
                "route_evictions": self.route_evictions,
                "moved_keys": self.moved_keys,
                "retried": self.retried,
                "backends": rows,
            }

    def route_of(self, key: str) -> str | None:
        """Name of the backend requests with `key` go to (None: not routed yet)."""
        with self._lock:
            i = self._routes.get(key)
            return None if i is None else self._states[i].name

    async def aclose(self) -> None:
        for b in self._backends:
            if hasattr(b, "aclose"):
                await b.aclose()

    # ------------------------------------------------------------------ internals

    def _pick(self, key: str | None, tried: set[int]) -> int:
        """The backend for this request (in-flight counted); SamplerUnavailable if none."""
        with self._lock:
            now = time.monotonic()
            for j, st in enumerate(self._states):
                if not st.up and not st.checking and now >= st.retry_at:
                    self._check_in_thread(j, revive=True)
            live = [j for j, st in enumerate(self._states) if st.up and j not in tried]
            if not live:
                raise SamplerUnavailable(
                    f"FleetSampler: no live backend for this request ({self._errors()})"
                )
            i: int | None = None
            if key is not None:
                i = self._routes.get(key)
                if i is not None:
                    self._routes.move_to_end(key)
                    if i not in live:
                        self.moved_keys += 1
                        i = None
            if i is None:
                i = min(live, key=lambda j: (self._states[j].in_flight, self._states[j].keys, j))
                if key is not None:
                    self._states[i].keys += 1
                    self._routes[key] = i
                    if len(self._routes) > self._max_keys:
                        self._routes.popitem(last=False)
                        self.route_evictions += 1
            if tried:
                self.retried += 1
            st = self._states[i]
            st.in_flight += 1
            st.requests += 1
            return i

    def _failed(self, i: int, exc: Exception, *, sent: bool) -> None:
        with self._lock:
            st = self._states[i]
            st.errors += 1
            st.last_error = f"{type(exc).__name__}: {exc}"[:500]
            if not sent:
                st.unavailable += 1
                self._mark_down(i, st.last_error)
            elif st.up and not st.checking:
                self._check_in_thread(i, revive=False)

    def _mark_down(self, i: int, why: str) -> None:
        """Under self._lock."""
        st = self._states[i]
        st.last_error = why[:500]
        st.retry_at = time.monotonic() + self._retry_s
        if st.up:
            st.up, st.downs = False, st.downs + 1
            log.warning("sampler backend %s is down: %s", st.name, why)

    def _check_in_thread(self, i: int, *, revive: bool) -> None:
        """Under self._lock: probes backend i in a thread (see `_check`)."""
        self._states[i].checking = True
        threading.Thread(
            target=self._check, args=(i, revive), daemon=True, name=f"fleet-check-{i}"
        ).start()

    def _check(self, i: int, revive: bool) -> None:
        """Probes backend i; marks it down on failure. revive: it is down, and
        on success it first loads the fleet's version if it has another one."""
        b, st = self._backends[i], self._states[i]
        try:
            if hasattr(b, "probe"):
                b.probe()
            if revive:
                with self._load_lock:  # no fleet load can slip between the sync and "up"
                    if b.policy_version != self._version:
                        b.load_weights(self._version)
                    with self._lock:
                        st.checking, st.up = False, True
                log.warning(
                    "sampler backend %s is up again (policy version %d)", st.name, b.policy_version
                )
                return
            why = None
        except Exception as e:  # noqa: BLE001 - reported in status(), logged
            why = f"{'revival' if revive else 'health check'} failed: {type(e).__name__}: {e}"
        with self._lock:
            st.checking = False
            if why is not None:
                self._mark_down(i, why)

    def _errors(self) -> str:
        return "; ".join(
            f"{st.name}: {'up' if st.up else 'down'}, last error {st.last_error or 'none'}"
            for st in self._states
        )
