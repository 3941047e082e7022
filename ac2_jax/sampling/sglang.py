"""SGLangSampler: the `Sampler` protocol over an SGLang server's native API.

SGLang needs CUDA GPUs, so it cannot run on this machine: the tests talk to a
local FastAPI server that answers with the JSON shapes SGLang documents, and
`scripts/launch_sglang.sh` starts a real server on GPU machines.

Generation: `POST /generate` with `input_ids`, `sampling_params`
(temperature, top_p, top_k, max_new_tokens, stop, stop_token_ids,
sampling_seed) and `return_logprob: true`. Output ids and log-probs come from
`meta_info.output_token_logprobs` (a list of `[logprob, token_id, text]`),
top log-probs from `meta_info.output_top_logprobs`, the finish reason from
`meta_info.finish_reason.type`, prefix-cache hits from
`meta_info.cached_tokens`, and the weight version from
`meta_info.weight_version` when the server reports one.

Log-probs: SGLang returns `log_softmax(logits / temperature)` (unless the
server runs with `SGLANG_RETURN_ORIGINAL_LOGPROB=1`, which the launch script
unsets): the behaviour log-probs the protocol promises for temperature
sampling. Its top-k / top-p filters act after that, so `generate` refuses
them (ValueError; the endpoint answers 400). Seeds are
honoured only with `--enable-deterministic-inference`.

Weights: `load_weights(step)` loads the published Orbax step into a Decoder
on this host (`params_io.load_published`), writes it as an HF safetensors
directory (`hf_io.save_hf_checkpoint`) under `export_dir/step_<step>`, and
posts `/update_weights_from_disk` with `model_path` and
`weight_version=str(step)`. SGLang lets requests in flight finish on the old
weights; calls to `generate` that start during an update wait for it.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import weakref
from typing import Any, Sequence

import httpx

from ac2_jax.sampling.base import SampleResult, SamplingParams, check_prompt


class SGLangError(RuntimeError):
    """The SGLang server refused or failed a request."""


class SGLangSampler:
    """`Sampler` backed by an SGLang server at `base_url`.

    model: a Decoder whose config matches the served model, used as the
    buffer that published weights are loaded into before export (needed only
    for `load_weights`). keep_exports: how many exported step directories to
    keep on disk (older ones are deleted after a successful update).
    """

    def __init__(self, base_url: str, *, max_context: int, model: Any = None,
                 publish_dir: str | None = None, export_dir: str | None = None,
                 api_key: str | None = None, timeout_s: float = 600.0, keep_exports: int = 2,
                 policy_version: int = 0, vocab_size: int | None = None):
        if int(max_context) < 2:
            raise ValueError(f"SGLangSampler: max_context must be >= 2, got {max_context}")
        self.base_url = base_url.rstrip("/")
        self._max_context = int(max_context)
        self._model, self._publish_dir, self._export_dir = model, publish_dir, export_dir
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = timeout_s
        self._keep = max(1, int(keep_exports))
        self._exports: list[str] = []
        self._version = int(policy_version)
        self._vocab = vocab_size
        self._ready = threading.Event()  # clear while a weight update runs
        self._ready.set()
        self._load_lock = threading.Lock()
        self._clients: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, httpx.AsyncClient]"
        self._clients = weakref.WeakKeyDictionary()

    # ------------------------------------------------------------------ protocol

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def max_context(self) -> int:
        return self._max_context

    def _client(self) -> httpx.AsyncClient:
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            client = httpx.AsyncClient(base_url=self.base_url, timeout=self._timeout,
                                       headers=self._headers)
            self._clients[loop] = client
        return client

    def request_body(self, prompt_ids: Sequence[int], params: SamplingParams) -> dict[str, Any]:
        """The native /generate JSON for one prompt."""
        room = self._max_context - len(prompt_ids)
        sp: dict[str, Any] = {
            "temperature": float(params.temperature), "top_p": float(params.top_p),
            "top_k": int(params.top_k) if params.top_k > 0 else -1,
            "max_new_tokens": int(min(params.max_tokens, room)),
            "skip_special_tokens": False, "no_stop_trim": True,
        }
        if params.stop:
            sp["stop"] = list(params.stop)
        if params.stop_token_ids:
            sp["stop_token_ids"] = list(params.stop_token_ids)
        if params.seed is not None:
            sp["sampling_seed"] = int(params.seed)
        body: dict[str, Any] = {"input_ids": [int(t) for t in prompt_ids], "sampling_params": sp,
                                "return_logprob": True, "logprob_start_len": -1}
        if params.top_logprobs:
            body["top_logprobs_num"] = int(params.top_logprobs)
        return body

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> SampleResult:
        if params.top_k > 0 or params.top_p < 1.0:
            # SGLang reports log_softmax(logits / T), before its top-k / top-p
            # filters: those would not be the log-probs of what was sampled.
            raise ValueError(
                f"top_k={params.top_k} / top_p={params.top_p}: SGLang reports log-probs "
                "before top-k/top-p filtering, so they would not be the behaviour "
                "log-probs RL needs; use top_k=-1 and top_p=1 with the SGLang sampler "
                "(temperature is fine)")
        prompt = [int(t) for t in prompt_ids]
        check_prompt(prompt, self._max_context, self._vocab)
        if not self._ready.is_set():
            await asyncio.to_thread(self._ready.wait)
        version = self._version
        body = self.request_body(prompt, params)
        try:
            r = await self._client().post("/generate", json=body)
        except httpx.HTTPError as e:
            raise SGLangError(f"SGLang /generate at {self.base_url} failed: {e!r}") from e
        if r.status_code != 200:
            raise SGLangError(f"SGLang /generate returned HTTP {r.status_code}: {r.text[:500]}")
        data = r.json()
        if isinstance(data, list):  # a batch of one
            data = data[0]
        return parse_generate_response(data, version, params.top_logprobs)

    def load_weights(self, step: int | None = None) -> int:
        """Exports a published step to HF safetensors and hot-swaps it into SGLang."""
        if self._model is None or self._publish_dir is None or self._export_dir is None:
            raise ValueError("SGLangSampler.load_weights needs model, publish_dir and export_dir")
        from ac2_jax.models.hf_io import save_hf_checkpoint
        from ac2_jax.models.params_io import load_published

        with self._load_lock:
            got = int(load_published(self._model, self._publish_dir, step))
            path = os.path.abspath(os.path.join(self._export_dir, f"step_{got}"))
            save_hf_checkpoint(self._model, path)
            self._ready.clear()
            try:
                with httpx.Client(base_url=self.base_url, timeout=self._timeout,
                                  headers=self._headers) as http:
                    r = http.post("/update_weights_from_disk",
                                  json={"model_path": path, "weight_version": str(got)})
                try:
                    data = r.json()
                except ValueError:
                    data = {"success": False, "message": r.text[:500]}
                if r.status_code != 200 or not data.get("success", False):
                    raise SGLangError(f"SGLang /update_weights_from_disk({path}) failed: HTTP "
                                      f"{r.status_code}: {data.get('message')}")
                self._version = got
            finally:
                self._ready.set()
            if path in self._exports:
                self._exports.remove(path)
            self._exports.append(path)
            while len(self._exports) > self._keep:
                shutil.rmtree(self._exports.pop(0), ignore_errors=True)
        return got

    async def aclose(self) -> None:
        for client in list(self._clients.values()):
            await client.aclose()
        self._clients.clear()


def parse_generate_response(data: dict[str, Any], version: int, top_n: int = 0) -> SampleResult:
    """SampleResult from SGLang's /generate JSON (see the module docstring)."""
    meta = data.get("meta_info")
    if not isinstance(meta, dict) or "output_token_logprobs" not in meta:
        raise SGLangError("SGLang /generate response has no meta_info.output_token_logprobs "
                          "(was return_logprob set?)")
    pairs = meta["output_token_logprobs"] or []
    ids = [int(p[1]) for p in pairs]
    logprobs = [float(p[0]) for p in pairs]
    reason = meta.get("finish_reason") or {}
    kind = reason.get("type") if isinstance(reason, dict) else reason
    if kind not in ("stop", "length"):
        raise SGLangError(f"SGLang request ended with finish_reason {reason!r}")
    top = None
    if top_n:
        rows = meta.get("output_top_logprobs") or []
        if len(rows) != len(ids):
            raise SGLangError(f"SGLang returned {len(rows)} top-logprob rows for {len(ids)} tokens")
        top = [[(int(t[1]), float(t[0])) for t in (row or [])][:top_n] for row in rows]
    wv = meta.get("weight_version")
    try:
        version = int(wv) if wv is not None else version
    except (TypeError, ValueError):
        pass  # a server started without a numeric version: keep ours
    return SampleResult(output_ids=ids, output_logprobs=logprobs, finish_reason=kind,
                        policy_version=version, cached_tokens=int(meta.get("cached_tokens") or 0),
                        top_logprobs=top)
