"""SGLangSampler: the `Sampler` protocol over an SGLang server's native API.

SGLang needs CUDA GPUs, so it cannot run on this machine: the tests run this
client against a local fake (`tests/support/sglang_fake.py`) that reproduces SGLang's
documented HTTP behaviour, and `scripts/launch_sglang.sh` starts a real
server on GPU machines.

Generation: `POST /generate` with `input_ids`, `sampling_params`
(temperature, top_p, top_k, max_new_tokens, stop, stop_token_ids,
sampling_seed) and `return_logprob: true`. Output ids and log-probs come from
`meta_info.output_token_logprobs` (`[logprob, token_id, text]` rows), top
log-probs from `meta_info.output_top_logprobs`, the finish reason from
`meta_info.finish_reason.type`, prefix-cache hits from `meta_info.cached_tokens`
and the weight version from `meta_info.weight_version`. With `on_tokens` the
request is streamed (`"stream": true`): SSE `data:` chunks carry the
cumulative `output_token_logprobs` (SGLang's default; servers started with
`--incremental-streaming-output` are refused), new tokens go to `on_tokens` as
they arrive, and cancelling the call closes the stream, which makes SGLang
abort the request.

Context: SGLang refuses `input + max_new_tokens >= context_len` (HTTP 400)
unless started with `--allow-auto-truncate`, so a sequence holds at most
`context_len - 1` tokens: `max_context` reports that. `context_len` is the
smaller of the `max_context` argument and the server's `max_model_len`
(`GET /v1/models`; `/get_model_info` does not report it).

Errors: SGLang's 400s (context check, vocabulary, validation) raise
`ContextLengthError` / `ValueError` with SGLang's message (the endpoint
answers 400); 5xx, 401/403/404, refused connections and malformed answers
raise `SGLangError`, a `SamplerError` (the endpoint answers 503 and the
rollout becomes infra_error). When the request was never sent (the
connection was refused, or the probe before it failed) the error is
`SGLangUnavailable`, a `SamplerUnavailable`: a `FleetSampler` sends the
request to another backend instead.

Restarts: the client probes the server (`probe`: `/health_generate`,
`/get_model_info`, `/v1/models`) before its first request, after a failed
connection or 5xx, and when a response reports a weight version this client
did not publish (an SGLang restart brings back the launch weights and
`--weight-version`). A result sampled by weights we did not publish is
discarded (counted in `stats["discarded"]`), the last export is re-published
with `/update_weights_from_disk`, and the request runs again; when that is
impossible, `SGLangError` says why. A server started without
`--weight-version` reports "default", which this client takes to be the
launch weights (`policy_version` at construction) until it publishes.

Log-probs: SGLang returns `log_softmax(logits / temperature)` (unless
`SGLANG_RETURN_ORIGINAL_LOGPROB=1`, which the launch script unsets), in fp32
with `--enable-fp32-lm-head`: the behaviour log-probs the protocol promises.
Its top-k / top-p filters act after that, so `generate` refuses them
(ValueError). Seeds are honoured only with `--enable-deterministic-inference`.

LoRA adapters: `load_adapter(name, peft_dir)` / `remove_adapter(name)` load
them into SGLang (`sampling/remote/_sglang_lora.py`); `SamplingParams.adapter` is sent
as `lora_path`.

Grammars: `SamplingParams.constraint` is refused (ValueError naming it).
SGLang's structured-output fields (`json_schema`, `regex`, `ebnf`,
`structural_tag`) run the server's own grammar backend (xgrammar unless it
was launched with `--grammar-backend llguidance`) with its own JSON
whitespace rules, so neither its token masks nor the log-probs it reports
would be the masks the learner replays (`constraints.replay_masks`): serve
constrained requests with the JaxSampler.

Weights: `load_weights(step)` loads the published Orbax step into a Decoder
on this host (`params_io.load_published`), writes it as HF safetensors
(`hf_io.save_hf_checkpoint`) under `export_dir/step_<step>`, and posts
`/update_weights_from_disk` with `model_path` and `weight_version=str(step)`.
Requests in flight finish on the old weights; calls to `generate` that start
during an update wait for it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import httpx

from ac2_jax.sampling.base import (
    ContextLengthError,
    OnTokens,
    SamplerError,
    SampleResult,
    SamplerUnavailable,
    SamplingParams,
    check_prompt,
)
from ac2_jax.sampling.remote._sglang_lora import SGLangAdapters

log = logging.getLogger(__name__)


class SGLangError(SamplerError):
    """The SGLang server failed or could not serve this request (not the request's fault)."""


class SGLangUnavailable(SGLangError, SamplerUnavailable):
    """The request was never sent: the server refused the connection, or the
    probe before the request failed."""


_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout)  # the request never left


class _StaleWeights(Exception):
    """A response came from weights this client did not publish."""


def error_message(r: httpx.Response) -> str:
    """SGLang's error text: `{"error": {"message"}}`, `{"message"}` or `{"detail"}` bodies."""
    try:
        data = r.json()
    except ValueError:
        return r.text[:500]
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        for key in ("error", "message", "detail"):
            if isinstance(data.get(key), str):
                return data[key]
    return r.text[:500]


def request_error(status: int, message: str, where: str) -> Exception:
    """The exception for an SGLang refusal: 400/413/422 are the request's fault."""
    if status in (400, 413, 422):
        if "context length" in message:
            return ContextLengthError(f"SGLang: {message}")
        return ValueError(f"SGLang refused the request (HTTP {status}): {message}")
    return SGLangError(f"SGLang {where} returned HTTP {status}: {message}")


class SGLangSampler(SGLangAdapters):
    """`Sampler` backed by an SGLang server at `base_url`.

    max_context: the context length SGLang serves (`--context-length`); the
      server's own `max_model_len` caps it once probed. `self.max_context` is
      one less (SGLang's strict check).
    model: a Decoder whose config matches the served model, the buffer that
      published weights are loaded into before export (only for `load_weights`).
    keep_exports: exported step directories kept on disk (the newest is
      re-published after a restart, so it is never deleted).
    policy_version: the version of the weights the server was launched with.
    max_concurrency: HTTP connections to the server; concurrent calls beyond
      it wait for a free connection (up to timeout_s, then SGLangError), and
      `stats["waited"]` counts them.
    weight_swap: "drain" only (requests in flight finish on the old weights).
      "in_flight" is refused by name: SGLang's `/pause_generation` +
      `/update_weights_from_disk` + `/continue_generation` can swap weights
      under running requests, but `/generate` reports one
      `meta_info.weight_version` per request, so the version (and the policy)
      of each token would go unrecorded; serve in-flight updates with the
      JaxSampler (`JaxSampler(weight_swap="in_flight")`).
    """

    # `SamplingParams.constraint` is refused (see the module docstring).
    supports_constraints = False

    def __init__(
        self,
        base_url: str,
        *,
        max_context: int,
        model: Any = None,
        publish_dir: str | None = None,
        export_dir: str | None = None,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        keep_exports: int = 2,
        policy_version: int = 0,
        vocab_size: int | None = None,
        max_concurrency: int = 256,
        weight_swap: str = "drain",
    ):
        if weight_swap != "drain":
            raise ValueError(
                f"SGLangSampler: weight_swap={weight_swap!r} is not offered: only 'drain'. "
                "SGLang reports one weight_version per /generate answer, so a request that "
                "spans a weight update (pause_generation, update_weights_from_disk, "
                "continue_generation) could not record which weights sampled each token; "
                "use JaxSampler(weight_swap='in_flight') for in-flight updates"
            )
        if int(max_context) < 3:
            raise ValueError(f"SGLangSampler: max_context must be >= 3, got {max_context}")
        if int(max_concurrency) < 1:
            raise ValueError(f"SGLangSampler: max_concurrency must be >= 1, got {max_concurrency}")
        self.base_url = base_url.rstrip("/")
        self._context = self._configured = int(max_context)
        self._model, self._publish_dir, self._export_dir = model, publish_dir, export_dir
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = timeout_s
        self._keep = max(1, int(keep_exports))
        self._exports: list[str] = []
        self._version = int(policy_version)
        self._loading: int | None = None  # the version load_weights is pushing now
        self._vocab = vocab_size
        self._max_conc = int(max_concurrency)
        self._in_flight = 0
        self.stats = {"probes": 0, "restarts": 0, "republished": 0, "discarded": 0, "waited": 0}
        self.server_info: dict[str, Any] = {}
        self._needs_probe = True
        self._probe_lock = threading.Lock()
        self._ready = threading.Event()  # clear while a weight update runs
        self._ready.set()
        self._load_lock = threading.Lock()
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient]
        self._clients = weakref.WeakKeyDictionary()
        self._sync_client: httpx.Client | None = None  # probe, weight and adapter calls
        self._sync_lock = threading.Lock()
        self._adapters: dict[str, str] = {}
        self._adapter_lock = threading.Lock()

    # ------------------------------------------------------------------ protocol

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def max_context(self) -> int:
        return self._context - 1

    def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            limits = httpx.Limits(
                max_connections=self._max_conc, max_keepalive_connections=self._max_conc
            )
            client = httpx.AsyncClient(
                base_url=self.base_url, timeout=self._timeout, headers=self._headers, limits=limits
            )
            self._clients[loop] = client
        return client

    def _http(self) -> httpx.Client:
        """The synchronous client of the probe, weight and adapter calls: one per
        sampler (its connections kept alive between calls), closed by `aclose`."""
        with self._sync_lock:
            if self._sync_client is None:
                self._sync_client = httpx.Client(
                    base_url=self.base_url, timeout=self._timeout, headers=self._headers
                )
            return self._sync_client

    def request_body(self, prompt_ids: Sequence[int], params: SamplingParams) -> dict[str, Any]:
        """The native /generate JSON for one prompt (max_new_tokens fits the context)."""
        room = self.max_context - len(prompt_ids)
        if room < 1:
            raise ContextLengthError(
                f"prompt has {len(prompt_ids)} tokens; SGLang's context of {self._context} "
                f"holds at most {self.max_context} (prompt + output)"
            )
        sp: dict[str, Any] = {
            "temperature": float(params.temperature),
            "top_p": float(params.top_p),
            "top_k": int(params.top_k) if params.top_k > 0 else -1,
            "max_new_tokens": int(min(params.max_tokens, room)),
            "skip_special_tokens": False,
            "no_stop_trim": True,
        }
        if params.stop:
            sp["stop"] = list(params.stop)
        if params.stop_token_ids:
            sp["stop_token_ids"] = list(params.stop_token_ids)
        if params.seed is not None:
            sp["sampling_seed"] = int(params.seed)
        body: dict[str, Any] = {
            "input_ids": [int(t) for t in prompt_ids],
            "sampling_params": sp,
            "return_logprob": True,
            "logprob_start_len": -1,
        }
        if params.top_logprobs:
            body["top_logprobs_num"] = int(params.top_logprobs)
        if params.adapter is not None:
            self.check_adapter(params.adapter)
            body["lora_path"] = params.adapter
        return body

    async def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        *,
        on_tokens: OnTokens | None = None,
    ) -> SampleResult:
        if params.constraint is not None:
            raise ValueError(
                "SamplingParams.constraint is not supported by the SGLangSampler: SGLang's "
                "json_schema/regex/ebnf/structural_tag fields run its own grammar backend, "
                "whose masks and log-probs are not the ones the learner replays "
                "(sampling.constraints.replay_masks); use the JaxSampler for constrained "
                "requests"
            )
        if params.top_k > 0 or params.top_p < 1.0:
            # SGLang reports log_softmax(logits / T), before its top-k / top-p
            # filters: those would not be the log-probs of what was sampled.
            raise ValueError(
                f"top_k={params.top_k} / top_p={params.top_p}: SGLang reports log-probs "
                "before top-k/top-p filtering, so they would not be the behaviour "
                "log-probs RL needs; use top_k=-1 and top_p=1 with the SGLang sampler "
                "(temperature is fine)"
            )
        if on_tokens is not None and not callable(on_tokens):
            raise TypeError(f"generate: on_tokens must be callable, got {type(on_tokens).__name__}")
        prompt = [int(t) for t in prompt_ids]
        check_prompt(prompt, self.max_context, self._vocab)
        for _ in range(2):
            if not self._ready.is_set():
                await asyncio.to_thread(self._ready.wait)
            if self._needs_probe:
                try:
                    await asyncio.to_thread(self.probe)
                except SGLangUnavailable:
                    raise
                except SGLangError as e:  # nothing was sent: another server may take it
                    raise SGLangUnavailable(f"{e} (the request was not sent)") from e
            check_prompt(prompt, self.max_context, self._vocab)
            body = self.request_body(prompt, params)
            try:
                return await self._generate_once(body, params.top_logprobs, on_tokens)
            except _StaleWeights:
                self._needs_probe = True
        raise SGLangError(
            f"SGLang at {self.base_url} still serves weights this client did not "
            f"publish after a re-publish (policy version {self._version})"
        )

    async def _generate_once(self, body, top_n, on_tokens) -> SampleResult:
        if self._in_flight >= self._max_conc:
            self.stats["waited"] += 1
        self._in_flight += 1
        started = self._version
        try:
            if on_tokens is None:
                data = await self._post(body)
                if isinstance(data, list):  # a batch of one
                    data = data[0]
                version = self._checked_version(
                    (data.get("meta_info") or {}).get("weight_version"), started
                )
            else:
                data, version = await self._stream(body, on_tokens, started)
        except _NOT_SENT as e:
            self._needs_probe = True
            raise SGLangUnavailable(
                f"SGLang /generate at {self.base_url} is unreachable: {e!r}"
            ) from e
        except httpx.HTTPError as e:
            self._needs_probe = True
            raise SGLangError(f"SGLang /generate at {self.base_url} failed: {e!r}") from e
        finally:
            self._in_flight -= 1
        return parse_generate_response(data, version, top_n)

    async def _post(self, body) -> dict:
        r = await self._client().post("/generate", json=body)
        if r.status_code != 200:
            raise self._refusal(r.status_code, error_message(r))
        return r.json()

    def _refusal(self, status: int, message: str) -> Exception:
        err = request_error(status, message, "/generate")
        if isinstance(err, (SGLangError, ContextLengthError)):
            self._needs_probe = True  # restarted, or with another context length
        return err

    async def _stream(self, body, on_tokens: OnTokens, started: int) -> tuple[dict, int]:
        """Streams /generate, handing new tokens to on_tokens.

        Returns (last chunk, the policy version of the weights, checked before
        the first token is handed over)."""
        sent, last, version = 0, None, self._version
        async with self._client().stream("POST", "/generate", json=dict(body, stream=True)) as r:
            if r.status_code != 200:
                await r.aread()
                raise self._refusal(r.status_code, error_message(r))
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    err = chunk["error"]
                    msg = err.get("message") if isinstance(err, dict) else str(err)
                    raise (
                        self._refusal(400, str(msg))
                        if sent == 0
                        else SGLangError(f"SGLang stream failed after {sent} tokens: {msg}")
                    )
                meta = chunk.get("meta_info") or {}
                if sent == 0:  # before any token leaves
                    version = self._checked_version(meta.get("weight_version"), started)
                rows = meta.get("output_token_logprobs") or []
                if len(rows) < sent:
                    raise SGLangError(
                        "SGLang stream chunks are not cumulative (is the server "
                        "running with --incremental-streaming-output?)"
                    )
                if len(rows) > sent:
                    new = rows[sent:]
                    try:
                        on_tokens([int(x[1]) for x in new], [float(x[0]) for x in new])
                    except Exception as e:  # noqa: BLE001 - fails this request only
                        raise SamplerError(f"on_tokens raised {e!r}") from e
                    sent = len(rows)
                last = chunk
        if last is None or not (last.get("meta_info") or {}).get("finish_reason"):
            raise SGLangError(f"SGLang stream ended after {sent} tokens without a finish_reason")
        return last, version

    def _version_of(self, reported, started: int | None = None) -> int | None:
        """The policy version of the weights a server reporting `reported` serves;
        None when it names weights this client did not publish. started: the
        version when the request was sent (in-flight requests finish on it)."""
        if reported is None:  # a server too old to report one: trust our bookkeeping
            return self._version
        for v in (self._version, started, self._loading):
            if v is not None and str(reported) == str(v):
                return v
        if not self._exports and not str(reported).lstrip("-").isdigit():
            return self._version  # "default": the launch weights, nothing published yet
        return None

    def _checked_version(self, reported, started: int) -> int:
        v = self._version_of(reported, started)
        if v is None:  # sampled by weights we did not publish: never stamped
            self.stats["discarded"] += 1
            raise _StaleWeights(reported)
        return v

    # ------------------------------------------------------------------ probe

    def probe(self) -> dict[str, Any]:
        """Checks the server; re-publishes the current weights after a restart.

        Synchronous. Reads `/health_generate` (must be 200), `/get_model_info`
        and `/v1/models` (`max_model_len`); returns the model info. Raises
        SGLangError when the server is down or unhealthy, or serves weights
        this client cannot restore."""
        with self._probe_lock:
            if not self._needs_probe:
                return self.server_info
            self.stats["probes"] += 1
            try:
                info = self._probe_with(self._http())
            except _NOT_SENT as e:
                raise SGLangUnavailable(f"SGLang at {self.base_url} is unreachable: {e!r}") from e
            except httpx.HTTPError as e:
                raise SGLangError(f"SGLang at {self.base_url} is unreachable: {e!r}") from e
            self._needs_probe = False
            return info

    def _get(self, http: httpx.Client, path: str) -> Any:
        r = http.get(path)
        if r.status_code != 200:
            raise SGLangError(
                f"SGLang {path} at {self.base_url} returned HTTP {r.status_code}"
                f" (server not ready?): {error_message(r)}"
            )
        return r.json() if r.content else None

    def _probe_with(self, http: httpx.Client) -> dict[str, Any]:
        self._get(http, "/health_generate")
        info = self._get(http, "/get_model_info")
        cards = (self._get(http, "/v1/models") or {}).get("data") or []
        server_ctx = cards[0].get("max_model_len") if cards else None
        if server_ctx is not None:
            if int(server_ctx) < self._configured:
                log.warning(
                    "SGLang at %s serves a context of %d tokens, less than the "
                    "configured %d: using %d",
                    self.base_url,
                    int(server_ctx),
                    self._configured,
                    int(server_ctx),
                )
            self._context = min(self._configured, int(server_ctx))
        reported = info.get("weight_version")
        if self._version_of(reported) is None:
            self.stats["restarts"] += 1
            self._republish(http, reported, info.get("model_path"))
            info = self._get(http, "/get_model_info")
            if self._version_of(info.get("weight_version")) is None:
                raise SGLangError(
                    f"SGLang at {self.base_url} reports weight version "
                    f"{info.get('weight_version')!r} after re-publishing version "
                    f"{self._version}"
                )
        self.server_info = info
        return info

    def _republish(self, http: httpx.Client, reported, model_path) -> None:
        what = (
            f"SGLang at {self.base_url} restarted: it serves weight version {reported!r} "
            f"({model_path}) but the policy is at version {self._version}"
        )
        path = self._exports[-1] if self._exports else None
        if path is None or not os.path.isdir(path):
            raise SGLangError(f"{what}, and there is no export to re-publish ({path})")
        log.warning("%s: re-publishing %s", what, path)
        r = http.post(
            "/update_weights_from_disk",
            json={"model_path": path, "weight_version": str(self._version)},
        )
        if r.status_code != 200:
            raise SGLangError(
                f"{what}; re-publishing {path} failed: HTTP {r.status_code}: {error_message(r)}"
            )
        self.stats["republished"] += 1

    # ------------------------------------------------------------------ weights

    def load_weights(self, step: int | None = None) -> int:
        """Exports a published step to HF safetensors and hot-swaps it into SGLang."""
        if self._model is None or self._publish_dir is None or self._export_dir is None:
            raise ValueError("SGLangSampler.load_weights needs model, publish_dir and export_dir")
        if getattr(getattr(self._model, "config", None), "lora", None) is not None:
            raise ValueError(
                "SGLangSampler.load_weights: the policy trains LoRA adapters; publishing them "
                "to SGLang as the policy is not wired (serve them with load_adapter(name, "
                "peft_dir) and SamplingParams.adapter, or sample with the JaxSampler)"
            )
        from ac2_jax.models.io.hf_io import save_hf_checkpoint
        from ac2_jax.models.io.params_io import load_published

        with self._load_lock:
            got = int(load_published(self._model, self._publish_dir, step))
            path = os.path.abspath(os.path.join(self._export_dir, f"step_{got}"))
            save_hf_checkpoint(self._model, path)
            self._ready.clear()
            self._loading = got  # results of these weights may come back before the reply
            try:
                r = self._http().post(
                    "/update_weights_from_disk",
                    json={"model_path": path, "weight_version": str(got)},
                )
                try:
                    data = r.json()
                except ValueError:
                    data = {"success": False, "message": r.text[:500]}
                if r.status_code != 200 or not data.get("success", False):
                    raise SGLangError(
                        f"SGLang /update_weights_from_disk({path}) failed: HTTP "
                        f"{r.status_code}: {data.get('message')}"
                    )
                self._version = got
            finally:
                self._loading = None
                self._ready.set()
            if path in self._exports:
                self._exports.remove(path)
            self._exports.append(path)
            while len(self._exports) > self._keep:
                shutil.rmtree(self._exports.pop(0), ignore_errors=True)
        return got

    async def aclose(self) -> None:
        """Closes this event loop's connection pool and the synchronous client
        (a later probe, weight or adapter call opens a new one). Pools of other
        event loops (e.g. an endpoint's, in its thread) belong to those loops:
        they are dropped here, and closed with their loop."""
        with self._sync_lock:
            sync, self._sync_client = self._sync_client, None
        if sync is not None:
            sync.close()
        loop = asyncio.get_running_loop()
        clients = dict(self._clients)
        self._clients.clear()
        if loop in clients:
            await clients[loop].aclose()


def parse_generate_response(data: dict[str, Any], version: int, top_n: int = 0) -> SampleResult:
    """SampleResult from SGLang's /generate JSON (see the module docstring)."""
    meta = data.get("meta_info")
    if not isinstance(meta, dict) or "output_token_logprobs" not in meta:
        raise SGLangError(
            "SGLang /generate response has no meta_info.output_token_logprobs "
            "(was return_logprob set?)"
        )
    rows = meta["output_token_logprobs"] or []
    ids = [int(p[1]) for p in rows]
    logprobs = [float(p[0]) for p in rows]
    reason = meta.get("finish_reason") or {}
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind == "abort" and isinstance(reason, dict) and reason.get("status_code") == 400:
        raise ValueError(f"SGLang aborted the request: {reason.get('message')}")
    if kind not in ("stop", "length"):
        raise SGLangError(f"SGLang request ended with finish_reason {reason!r}")
    top = None
    if top_n:
        top_rows = meta.get("output_top_logprobs") or []
        if len(top_rows) != len(ids):
            raise SGLangError(
                f"SGLang returned {len(top_rows)} top-logprob rows for {len(ids)} tokens"
            )
        top = [[(int(t[1]), float(t[0])) for t in (row or [])][:top_n] for row in top_rows]
    return SampleResult(
        output_ids=ids,
        output_logprobs=logprobs,
        finish_reason=kind,
        policy_version=version,
        cached_tokens=int(meta.get("cached_tokens") or 0),
        top_logprobs=top,
    )
