"""A local stand-in for an SGLang server (SGLang needs CUDA; this machine has none).

`FakeSGLang` answers SGLang's native HTTP API with the shapes and status
codes SGLang's own `http_server.py` / `tokenizer_manager.py` produce,
computing with a real tiny Decoder through a `JaxSampler`:

* `POST /generate`: SGLang's context check (`input >= context_len`: "The
  input (N tokens) is longer than the model's context length (C tokens).";
  `input + max_new_tokens >= context_len`: "Requested token count exceeds the
  model's maximum context length of C tokens. ..."), its vocabulary check,
  both as HTTP 400 `{"error": {"message": ...}}`; a malformed body is 400
  `{"object": "error", "message", "type": "Bad Request", "param", "code"}`
  (SGLang turns FastAPI's 422 into 400). `"stream": true` answers SSE
  `data: {...}` chunks with cumulative `output_ids` and
  `meta_info.output_token_logprobs` (SGLang's default, without
  `--incremental-streaming-output`), errors in-band as
  `data: {"error": {"message": ...}}`, then `data: [DONE]`; a client that
  disconnects aborts the request (logged as `("abort", body)`).
* `GET /get_model_info`: model_path, tokenizer_path, is_generation,
  preferred_sampling_params, weight_version (no context length: SGLang
  reports that as `max_model_len` in `GET /v1/models`).
* `GET /health_generate`: 200, or 503 while the server is not ready.
* `POST /update_weights_from_disk`: `{success, message, num_paused_requests}`,
  200 or 400; the weight version becomes the request's `weight_version`.
* `POST /load_lora_adapter {lora_name, lora_path}` / `POST /unload_lora_adapter
  {lora_name}`: `{success, error_message, loaded_adapters}`, 200 or 400 (a
  taken or unknown name, a directory that is no PEFT adapter); `/generate`
  with `lora_path` naming an adapter that is not loaded is a 400 with SGLang's
  message ("The following requested LoRA adapters are not loaded: ...").
  Needs a model with an adapter bank (`LoRAConfig(slots=N)`), like SGLang's
  `--enable-lora`; without one every load is refused.
* `restart()`: what an SGLang process restart leaves behind: the launch
  weights, the launch `--weight-version` and model path.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from ac2_jax.models.io.hf_io import load_hf_checkpoint
from ac2_jax.sampling import SamplingParams
from ac2_jax.sampling.engine.jax_sampler import JaxSampler

SHAPE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                "num_kv_heads", "head_dim")


class GenerateReq(BaseModel):
    """The part of SGLang's GenerateReqInput the client uses."""

    input_ids: list[int]
    sampling_params: dict[str, Any] = {}
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    stream: bool = False
    lora_path: str | None = None


class FakeSGLang:
    """SGLang's HTTP surface over a JaxSampler; logs every request body.

    context_len: SGLang's `--context-length`. weight_version: the launch
    `--weight-version` ("default" when not given, as in SGLang).
    hold_for: when set to n, /generate requests wait until n are in flight
    (or 30 s) and then answer one canned token (to count concurrent
    connections). fail_with: a 5xx status for /generate, with the body
    SGLang's HTTPException handler writes. stream_hold: an Event that
    streams wait on after their first chunk.
    """

    def __init__(self, model, tok, *, context_len: int = 128, weight_version: str = "default",
                 model_path: str = "/models/base", max_batch: int = 4):
        self.tok, self.context_len = tok, context_len
        self.launch = (model, weight_version, model_path)
        self.model, self.version, self.model_path = self.launch
        self.max_batch = max_batch
        self.sampler = self._sampler(model)
        self.healthy = True
        self.log: list[tuple[str, Any]] = []
        self.in_flight = self.peak_in_flight = 0
        self.hold_for: int | None = None
        self.held_all = False  # hold_for's n were in flight at once
        self.fail_with: int | None = None  # answer /generate with this 5xx (SGLang's shape)
        self.stream_hold: threading.Event | None = None  # pause streams after one chunk
        self.update_started = threading.Event()
        self.release_update = threading.Event()
        self.release_update.set()
        app = self.app = FastAPI()
        app.add_exception_handler(RequestValidationError, self._validation_error)
        app.post("/generate")(self.generate)
        app.post("/update_weights_from_disk")(self.update)
        app.get("/get_model_info")(self.model_info)
        app.get("/health_generate")(self.health_generate)
        app.get("/v1/models")(self.models)
        app.post("/load_lora_adapter")(self.load_lora)
        app.post("/unload_lora_adapter")(self.unload_lora)
        self.loras: dict[str, str] = {}

    def _sampler(self, model) -> JaxSampler:
        return JaxSampler(model, max_context=self.context_len, tokenizer=self.tok,
                          max_batch=self.max_batch, steps_per_sync=2)

    def restart(self) -> None:
        """An SGLang restart: launch weights, launch version and model path again."""
        old = self.sampler
        self.model, self.version, self.model_path = self.launch
        self.sampler = self._sampler(self.model)
        old.close()
        self.log.append(("restart", None))

    def close(self) -> None:
        self.sampler.close()

    # ------------------------------------------------------------------ routes

    async def _validation_error(self, request: Request, exc: RequestValidationError):
        return JSONResponse({"object": "error", "message": str(exc), "type": "Bad Request",
                             "param": None, "code": 400}, status_code=400)

    def model_info(self):
        return {"model_path": self.model_path, "tokenizer_path": self.launch[2],
                "is_generation": True, "preferred_sampling_params": None,
                "weight_version": self.version}

    def models(self):
        return {"object": "list", "data": [{"id": "fake", "object": "model", "created": 0,
                                            "owned_by": "sglang", "root": "fake",
                                            "max_model_len": self.context_len}]}

    def health_generate(self):
        return Response(status_code=200 if self.healthy else 503)

    def _check(self, req: GenerateReq) -> None:
        """SGLang's TokenizerManager checks (ValueError -> HTTP 400)."""
        n = len(req.input_ids)
        if n >= self.context_len:
            raise ValueError(f"The input ({n} tokens) is longer than the model's context "
                             f"length ({self.context_len} tokens).")
        new = req.sampling_params.get("max_new_tokens")
        if new is not None and new + n >= self.context_len:
            raise ValueError(
                f"Requested token count exceeds the model's maximum context length of "
                f"{self.context_len} tokens. You requested a total of {new + n} tokens: {n} "
                f"tokens from the input messages and {new} tokens for the completion. Please "
                f"reduce the number of tokens in the input messages or the completion to fit "
                f"within the limit.")
        if req.lora_path is not None and req.lora_path not in self.loras:
            raise ValueError(f"The following requested LoRA adapters are not loaded: "
                             f"{req.lora_path}\nLoaded adapters: {self.loras.keys()}.")
        if any(t >= self.tok.vocab_size for t in req.input_ids):
            raise ValueError(f"The input_ids {req.input_ids} contains values greater than the "
                             f"vocab size ({self.tok.vocab_size}).")

    def _params(self, req: GenerateReq) -> SamplingParams:
        sp = req.sampling_params
        return SamplingParams(
            temperature=sp["temperature"], top_p=sp["top_p"], top_k=sp["top_k"],
            max_tokens=sp["max_new_tokens"], stop=sp.get("stop", ()),
            stop_token_ids=sp.get("stop_token_ids", ()), seed=sp.get("sampling_seed"),
            top_logprobs=req.top_logprobs_num, adapter=req.lora_path)

    def _out(self, req: GenerateReq, ids, lps, top, finish) -> dict:
        meta = {"id": "abc", "finish_reason": finish, "prompt_tokens": len(req.input_ids),
                "weight_version": self.version, "completion_tokens": len(ids),
                "cached_tokens": 0,
                "output_token_logprobs": [[lp, t, None] for t, lp in zip(ids, lps)]}
        if top is not None:
            meta["output_top_logprobs"] = [[[lp, t, None] for t, lp in row] for row in top]
        return {"text": self.tok.decode(ids), "output_ids": list(ids), "meta_info": meta}

    @staticmethod
    def _finish(r) -> dict:
        return ({"type": "stop", "matched": r.output_ids[-1]} if r.finish_reason == "stop"
                else {"type": "length", "length": len(r.output_ids)})

    async def generate(self, req: GenerateReq):
        body = req.model_dump()
        self.log.append(("generate", body))
        if self.fail_with is not None:
            return JSONResponse({"object": "error", "message": "scheduler is not responding",
                                 "type": str(self.fail_with), "param": None,
                                 "code": self.fail_with}, status_code=self.fail_with)
        try:
            self._check(req)
        except ValueError as e:
            if req.stream:
                return StreamingResponse(self._error_stream(e), media_type="text/event-stream")
            return JSONResponse({"error": {"message": str(e)}}, status_code=400)
        if req.stream:
            return StreamingResponse(self._stream(req, body), media_type="text/event-stream")
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            if self.hold_for is not None:
                # Released together once n were in flight at once (not "while fewer are in
                # flight": the first to leave would hold the rest to the deadline).
                self.held_all = self.held_all or self.in_flight >= self.hold_for
                deadline = asyncio.get_running_loop().time() + 30
                while not self.held_all and asyncio.get_running_loop().time() < deadline:
                    await asyncio.sleep(0.005)
                return self._out(req, [1], [-1.0], None, {"type": "length", "length": 1})
            r = await self.sampler.generate(req.input_ids, self._params(req))
        finally:
            self.in_flight -= 1
        return self._out(req, r.output_ids, r.output_logprobs, r.top_logprobs, self._finish(r))

    @staticmethod
    async def _error_stream(e: Exception):
        yield b"data: " + json.dumps({"error": {"message": str(e)}}).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"

    async def _stream(self, req: GenerateReq, body: dict):
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue = asyncio.Queue()
        task = asyncio.ensure_future(self.sampler.generate(
            req.input_ids, self._params(req),
            on_tokens=lambda ids, lps: loop.call_soon_threadsafe(chunks.put_nowait, (ids, lps))))
        task.add_done_callback(lambda _: loop.call_soon_threadsafe(chunks.put_nowait, None))
        ids: list[int] = []
        lps: list[float] = []
        finished = False
        try:
            while (item := await chunks.get()) is not None:
                ids += item[0]
                lps += item[1]
                out = self._out(req, ids, lps, None, None)
                yield b"data: " + json.dumps(out).encode() + b"\n\n"
                while self.stream_hold is not None and not self.stream_hold.is_set():
                    await asyncio.sleep(0.005)
            r = task.result()
            assert (r.output_ids, r.output_logprobs) == (ids, lps)
            yield (b"data: " + json.dumps(self._out(req, ids, lps, r.top_logprobs,
                                                     self._finish(r))).encode() + b"\n\n")
            yield b"data: [DONE]\n\n"
            finished = True
        finally:
            if not finished:  # the client went away: SGLang aborts the request
                task.cancel()
                self.log.append(("abort", body))

    def update(self, body: dict):
        self.log.append(("update_start", body))
        self.update_started.set()
        self.release_update.wait()
        path = body["model_path"]

        def refuse(message):
            self.log.append(("update_end", body))
            return JSONResponse({"success": False, "message": message,
                                 "num_paused_requests": 0}, status_code=400)

        if not os.path.exists(os.path.join(path, "config.json")):
            return refuse(f"no model at {path}")
        model, config = load_hf_checkpoint(path)
        if any(getattr(config, f) != getattr(self.model.config, f) for f in SHAPE_FIELDS):
            return refuse("config of the new weights does not match the served model")
        old, self.sampler = self.sampler, self._sampler(model)
        old.close()
        self.model, self.model_path = model, path
        message = "Succeeded to update model weights."
        if body.get("weight_version") is not None:
            self.version = body["weight_version"]
            message += f" Weight version updated to {self.version}."
        self.log.append(("update_end", body))
        return {"success": True, "message": message, "num_paused_requests": 0}

    def _lora_answer(self, error: str | None):
        body = {"success": error is None, "error_message": error,
                "loaded_adapters": dict(self.loras)}
        return JSONResponse(body, status_code=200 if error is None else 400)

    def load_lora(self, body: dict):
        self.log.append(("load_lora_adapter", body))
        name, path = body.get("lora_name"), body.get("lora_path")
        if name in self.loras:
            return self._lora_answer(f"LoRA adapter {name} is already loaded")
        try:
            self.sampler.add_adapter(name, path)
        except (ValueError, OSError, KeyError) as e:
            return self._lora_answer(f"Failed to load LoRA adapter {name}: {e}")
        self.loras[name] = path
        return self._lora_answer(None)

    def unload_lora(self, body: dict):
        self.log.append(("unload_lora_adapter", body))
        name = body.get("lora_name")
        if name not in self.loras:
            return self._lora_answer(f"LoRA adapter {name} is not loaded")
        self.sampler.remove_adapter(name)
        del self.loras[name]
        return self._lora_answer(None)
