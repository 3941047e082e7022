"""A sampler backend: one JaxSampler served over SGLang's native HTTP API.

`python -m ac2_jax.serving.backend --model=tiny --port=30000` starts one. An
`SGLangSampler` talks to it as to an SGLang server, so a fleet of these
processes and a fleet of SGLang servers are the same thing to the endpoint
(`python -m ac2_jax.serving --backends=URL,URL`: a `FleetSampler`).

Routes (the part of SGLang's API that `SGLangSampler` uses):
  POST /generate   input_ids, sampling_params (temperature, top_p, top_k,
                   max_new_tokens, stop, stop_token_ids, sampling_seed),
                   top_logprobs_num, stream. Answers text, output_ids and
                   meta_info: output_token_logprobs rows [logprob, id, null]
                   (always, as if return_logprob), output_top_logprobs,
                   finish_reason {type: stop|length}, weight_version,
                   cached_tokens, prompt_tokens, completion_tokens. stream:
                   SSE `data:` chunks with the output so far (cumulative,
                   SGLang's default), then `data: [DONE]`; a client that
                   leaves cancels its request.
  GET  /get_model_info, /health, /health_generate, /v1/models (max_model_len)
  POST /update_weights_from_disk  {model_path: an HF directory, weight_version:
                   an int}: hot swap; running requests finish on the old weights
                   (the sampler's weight_swap must be "drain": refused otherwise).
  GET  /get_server_info   this backend's own counters (not SGLang's fields).

Errors are SGLang's: what the sampler refuses (context, vocabulary,
parameters) is HTTP 400 `{"error": {"message"}}` with SGLang's
context-length wording (streamed: one in-band `data: {"error"}` chunk); a
malformed body 400; a sampler failure 503. Weight versions are the
JaxSampler's integer policy versions, reported as strings like SGLang's
`weight_version`; the launch weights are version 0.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from typing import Any

from absl import flags
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from ac2_jax.models import load_hf_checkpoint
from ac2_jax.sampling import SamplerError, SamplingParams
from ac2_jax.sampling.engine.jax_sampler import JaxSampler
from ac2_jax.serving.server import SAMPLER_LAYOUT


class GenerateRequest(BaseModel):
    """The fields of SGLang's GenerateReqInput that this backend reads."""

    input_ids: list[int]
    sampling_params: dict[str, Any] = {}
    return_logprob: bool = True
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    stream: bool = False


def _error(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def build_backend_app(sampler: JaxSampler, tokenizer: Any, *, model_path: str = "tiny") -> FastAPI:
    """The SGLang-protocol app over `sampler` (see the module docstring).

    tokenizer: decodes output ids into `text` (anything with `.decode`).
    model_path: what /get_model_info reports until a weight update.
    """
    if not isinstance(sampler, JaxSampler):
        raise TypeError(f"build_backend_app serves a JaxSampler, got {type(sampler).__name__}")
    if sampler.weight_swap != "drain":  # SGLang's answer has one weight_version
        raise ValueError(
            f"build_backend_app: the sampler has weight_swap={sampler.weight_swap!r}; "
            "SGLang's /generate reports one weight_version per answer, so per-token "
            "versions would be lost: build the JaxSampler with weight_swap='drain'"
        )
    context = sampler.max_context  # SGLang's context_len: input + max_new_tokens < context
    vocab = sampler.vocab_size
    state = {"model_path": model_path}
    counts = {
        "requests": 0,
        "finished": 0,
        "failed": 0,
        "refused": 0,
        "cancelled": 0,
        "in_flight": 0,
        "weight_updates": 0,
    }
    update_lock = threading.Lock()
    app = FastAPI(
        title="ac2_jax sampler backend (SGLang protocol)",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.sampler = sampler
    app.state.counts = counts

    @app.exception_handler(RequestValidationError)
    async def validation_error(_request: Request, exc: RequestValidationError):
        return JSONResponse(
            {
                "object": "error",
                "message": str(exc),
                "type": "Bad Request",
                "param": None,
                "code": 400,
            },
            status_code=400,
        )

    def checked(req: GenerateRequest) -> SamplingParams:
        """SGLang's admission checks, then SamplingParams (ValueError -> 400)."""
        n, sp = len(req.input_ids), req.sampling_params
        if n >= context:
            raise ValueError(
                f"The input ({n} tokens) is longer than the model's context "
                f"length ({context} tokens)."
            )
        new = sp.get("max_new_tokens")
        new = context - 1 - n if new is None else new
        if not isinstance(new, int) or new < 1:
            raise ValueError(f"max_new_tokens must be a positive int, got {new!r}")
        if new + n >= context:
            raise ValueError(
                f"Requested token count exceeds the model's maximum context length of "
                f"{context} tokens. You requested a total of {new + n} tokens: {n} tokens from "
                f"the input messages and {new} tokens for the completion. Please reduce the "
                f"number of tokens in the input messages or the completion to fit within the "
                f"limit."
            )
        if any(not 0 <= t < vocab for t in req.input_ids):
            raise ValueError(f"The input_ids contain values outside the vocabulary [0, {vocab}).")
        return SamplingParams(
            temperature=sp.get("temperature", 1.0),
            top_p=sp.get("top_p", 1.0),
            top_k=sp.get("top_k", -1),
            max_tokens=new,
            stop=sp.get("stop") or (),
            stop_token_ids=sp.get("stop_token_ids") or (),
            seed=sp.get("sampling_seed"),
            top_logprobs=req.top_logprobs_num,
        )

    def body(req, ids, lps, version, top=None, finish=None, cached=0) -> dict:
        meta = {
            "id": "",
            "finish_reason": finish,
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(ids),
            "cached_tokens": cached,
            "weight_version": str(version),
            "output_token_logprobs": [[lp, t, None] for t, lp in zip(ids, lps, strict=True)],
        }
        if top is not None:
            meta["output_top_logprobs"] = [[[lp, t, None] for t, lp in row] for row in top]
        return {"text": tokenizer.decode(ids), "output_ids": list(ids), "meta_info": meta}

    def finish_of(r) -> dict:
        return (
            {"type": "stop", "matched": r.output_ids[-1]}
            if r.finish_reason == "stop"
            else {"type": "length", "length": len(r.output_ids)}
        )

    @app.post("/generate")
    async def generate(req: GenerateRequest):
        counts["requests"] += 1
        try:
            params = checked(req)
        except ValueError as e:
            counts["refused"] += 1
            if req.stream:
                return StreamingResponse(
                    iter([_sse({"error": {"message": str(e)}}), b"data: [DONE]\n\n"]),
                    media_type="text/event-stream",
                )
            return _error(str(e))
        if req.stream:
            return StreamingResponse(stream(req, params), media_type="text/event-stream")
        counts["in_flight"] += 1
        try:
            r = await sampler.generate(req.input_ids, params)
        except ValueError as e:
            counts["refused"] += 1
            return _error(str(e))
        except SamplerError as e:
            counts["failed"] += 1
            return _error(f"the sampler failed: {e}", 503)
        except asyncio.CancelledError:
            counts["cancelled"] += 1
            raise
        finally:
            counts["in_flight"] -= 1
        counts["finished"] += 1
        return body(
            req,
            r.output_ids,
            r.output_logprobs,
            r.policy_version,
            r.top_logprobs,
            finish_of(r),
            r.cached_tokens,
        )

    async def stream(req: GenerateRequest, params: SamplingParams):
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue = asyncio.Queue()

        def on_tokens(ids, lps):  # the worker thread: running_version is this request's
            loop.call_soon_threadsafe(chunks.put_nowait, (ids, lps, sampler.running_version))

        counts["in_flight"] += 1
        task = asyncio.ensure_future(sampler.generate(req.input_ids, params, on_tokens=on_tokens))
        task.add_done_callback(lambda _: loop.call_soon_threadsafe(chunks.put_nowait, None))
        ids: list[int] = []
        lps: list[float] = []
        version, done = None, False
        try:
            while (item := await chunks.get()) is not None:
                ids, lps, version = ids + item[0], lps + item[1], item[2]
                yield _sse(body(req, ids, lps, version))
            try:
                r = task.result()
            except ValueError as e:
                counts["refused"] += 1
                yield _sse({"error": {"message": str(e)}})
            except SamplerError as e:
                counts["failed"] += 1
                yield _sse({"error": {"message": f"the sampler failed: {e}"}})
            else:
                counts["finished"] += 1
                yield _sse(
                    body(
                        req,
                        ids,
                        lps,
                        r.policy_version,
                        r.top_logprobs,
                        finish_of(r),
                        r.cached_tokens,
                    )
                )
            yield b"data: [DONE]\n\n"
            done = True
        finally:
            counts["in_flight"] -= 1
            if not done:  # the client went away: cancel its request
                counts["cancelled"] += 1
                task.cancel()

    def model_info() -> dict:
        return {
            "model_path": state["model_path"],
            "tokenizer_path": model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": str(sampler.policy_version),
        }

    app.get("/get_model_info")(model_info)

    @app.get("/health")
    @app.get("/health_generate")
    def health():
        try:
            sampler.probe()
        except SamplerError:
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/v1/models")
    def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": model_path,
                    "object": "model",
                    "created": 0,
                    "owned_by": "ac2_jax",
                    "root": model_path,
                    "max_model_len": context,
                }
            ],
        }

    @app.get("/get_server_info")
    def server_info():
        st = sampler.stats
        return {
            **counts,
            "weight_version": str(sampler.policy_version),
            "context_len": context,
            "output_tokens": st.output_tokens,
            "compiled_shapes": st.compiled_shapes,
            "request_errors": st.request_errors,
            "weight_swaps": st.weight_swaps,
            "cancelled_in_sampler": st.cancelled,
        }

    @app.post("/update_weights_from_disk")
    async def update(request: Request):
        try:
            data = await request.json()
        except ValueError:
            data = None
        if not isinstance(data, dict) or not isinstance(data.get("model_path"), str):
            return refuse("the body must be JSON with model_path (an HF checkpoint directory)")
        path, version = data["model_path"], str(data.get("weight_version"))
        if not version.lstrip("-").isdigit():
            return refuse(
                f"weight_version must be an integer (the policy version these "
                f"weights are), got {version!r}"
            )
        if not os.path.exists(os.path.join(path, "config.json")):
            return refuse(f"no HF checkpoint (config.json) at {path}")

        def load():
            with update_lock:
                model, _ = load_hf_checkpoint(path, **SAMPLER_LAYOUT)
                sampler.set_weights(model, int(version))

        try:
            await asyncio.to_thread(load)
        except (ValueError, TypeError, OSError) as e:
            return refuse(f"could not load {path}: {type(e).__name__}: {e}")
        state["model_path"] = path
        counts["weight_updates"] += 1
        return {
            "success": True,
            "message": f"Succeeded to update model weights. Weight "
            f"version updated to {int(version)}.",
            "num_paused_requests": 0,
        }

    def refuse(message: str) -> JSONResponse:
        return JSONResponse(
            {"success": False, "message": message, "num_paused_requests": 0}, status_code=400
        )

    return app


def _define_flags() -> None:
    """The command's flags (defined only when run as a command, so importing this
    module next to `python -m ac2_jax.serving`'s flags clashes with nothing)."""
    flags.DEFINE_string("model", "tiny", "'tiny' or a local HF model directory.")
    flags.DEFINE_string("host", "127.0.0.1", "Address to bind.")
    flags.DEFINE_integer("port", 30000, "Port to bind (0: a free one, logged).")
    flags.DEFINE_integer("max_context", None, "Tokens per sequence (default: the model's).")
    flags.DEFINE_integer("max_batch", 16, "Rows decoded together.")
    flags.DEFINE_bool("fixed_shapes", False, "Always max_batch x max_context, compiled at start.")
    flags.DEFINE_integer("seed", 0, "Seed of the tiny model and of unseeded requests.")


def main(argv):
    del argv
    import uvicorn

    from ac2_jax.serving.server import load_policy

    F = flags.FLAGS
    sampler, tokenizer, name = load_policy(
        F.model,
        sampler="jax",
        max_context=F.max_context,
        max_batch=F.max_batch,
        seed=F.seed,
        fixed_shapes=F.fixed_shapes,
    )
    api = build_backend_app(sampler, tokenizer, model_path=name)
    uvicorn.run(api, host=F.host, port=F.port, log_level="info")


if __name__ == "__main__":
    from absl import app as absl_app

    _define_flags()
    absl_app.run(main)
