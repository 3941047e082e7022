"""Running the endpoint: in a background thread (tests, demos, notebooks) or
as a process (`python -m ac2_jax.serving`, flags in `__main__`).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence

import uvicorn

# How a sampler loads a checkpoint: per-layer weights, whatever the memory plan would
# pick for training (scanned decode copies each layer's weights and cache slice out of
# the stacked arrays every step: ~1.6x slower on CPU,
# docs/notes/2026-12-02-qwen3-06b-policy-on-2-cores.md), no remat.
SAMPLER_LAYOUT = {"scan_layers": False, "remat": "none"}


def serve_in_thread(
    app, host: str = "127.0.0.1", port: int = 0, startup_timeout_s: float = 60.0
) -> tuple[str, Callable[[], None]]:
    """Starts uvicorn for `app` in a daemon thread; returns (base_url, stop).

    port=0 picks a free port. base_url is like "http://127.0.0.1:PORT" (add
    "/v1" for OpenAI clients). stop() shuts the server down and joins the
    thread; calling it twice is harmless.
    """
    config = uvicorn.Config(
        app, host=host, port=port, log_level="warning", lifespan="on", timeout_graceful_shutdown=5
    )
    server = uvicorn.Server(config)
    errors: list[BaseException] = []

    def run():
        try:
            asyncio.run(server.serve())
        except BaseException as e:  # noqa: BLE001 - reported to the caller
            errors.append(e)

    thread = threading.Thread(target=run, name=f"ac2-serving-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started:
        if errors or not thread.is_alive():
            raise RuntimeError(f"serve_in_thread: the server failed to start: {errors}")
        if time.monotonic() > deadline:
            server.should_exit = True
            raise TimeoutError(f"serve_in_thread: not started after {startup_timeout_s} s")
        time.sleep(0.02)
    bound = server.servers[0].sockets[0].getsockname()[1]
    url_host = f"[{host}]" if ":" in host else host

    def stop():
        server.should_exit = True
        thread.join(timeout=30)

    return f"http://{url_host}:{bound}", stop


# The context "tiny" is served with unless --max_context says otherwise: Claude Code's
# default request is about 48k tokens of the tiny tokenizer (issue 67).
TINY_CONTEXT = 65536


def sampler_config(
    sampler: str = "jax",
    *,
    max_context: int | None = None,
    sglang_url: str | None = None,
    export_dir: str | None = None,
    fixed_shapes: bool = False,
    backends: Sequence[str] = (),
    backend_timeout_s: float = 600.0,
    weight_swap: str = "drain",
):
    """The `SamplerConfig` the serving flags describe (`--sampler` names a registered
    kind, `ac2_jax.sampling.registry.SAMPLERS`; `--backends` makes it a fleet).
    A flag the kind does not read, or an unknown kind, is a ValueError naming it."""
    from ac2_jax.sampling.registry import SAMPLERS, SamplerConfig

    backends = [u.strip() for u in backends if u.strip()]
    if backends and (sglang_url or fixed_shapes):
        raise ValueError(
            "--backends replaces the embedded or single SGLang sampler: drop "
            "--sglang_url / --fixed_shapes (a backend process takes those)"
        )
    if len(set(backends)) != len(backends):
        raise ValueError(f"--backends lists a URL twice: {backends}")
    kind = "fleet" if backends else sampler
    try:
        SAMPLERS.get(kind)
    except ValueError as e:
        raise ValueError(f"--sampler: {e}") from None
    if kind == "sglang" and not sglang_url:
        raise ValueError("--sampler=sglang needs --sglang_url")
    if kind == "fleet" and not backends:
        raise ValueError("--sampler=fleet needs --backends (the servers' URLs)")
    reads = SAMPLERS.get(kind).reads
    fields: dict = {"kind": kind, "max_context": max_context}
    if "warmup" in reads:  # the endpoint compiles up front only with --fixed_shapes
        fields["warmup"] = False
    if "timeout_s" in reads:
        fields["timeout_s"] = backend_timeout_s
    given = {"url": sglang_url, "backends": tuple(backends), "export_dir": export_dir,
             "fixed_shapes": fixed_shapes,
             # its default is the flag's: only a value set away from it is the caller's
             "timeout_s": backend_timeout_s != 600.0 and backend_timeout_s,
             "weight_swap": weight_swap != "drain" and weight_swap}  # fmt: skip
    flag = {"url": "--sglang_url", "backends": "--backends", "export_dir": "--export_dir",
            "fixed_shapes": "--fixed_shapes", "timeout_s": "--backend_timeout_s",
            "weight_swap": "--weight_swap"}  # fmt: skip
    for name, value in given.items():
        if value:
            if name not in reads:
                raise ValueError(
                    f"{flag[name]} has no effect with --sampler={kind} (SGLang manages "
                    "its own shapes; only the embedded sampler compiles them)"
                    if name == "fixed_shapes"
                    else f"{flag[name]} has no effect with --sampler={kind}; drop it"
                )
            fields[name] = value
    return SamplerConfig(**fields)


def load_policy(
    model: str,
    *,
    sampler: str = "jax",
    max_context: int | None = None,
    publish_dir: str | None = None,
    sglang_url: str | None = None,
    export_dir: str | None = None,
    max_batch: int = 16,
    seed: int = 0,
    tokenizer_dir: str | None = None,
    fixed_shapes: bool = False,
    backends: Sequence[str] = (),
    backend_timeout_s: float = 600.0,
    tool_parser: str | None = None,
    weight_swap: str = "drain",
):
    """(sampler, tokenizer, model_name) for `model`: "tiny" or an HF directory.

    tool_parser: the model's tool-call format (`text.tool_parsers`); None: picked
    from its chat template, else its family (`Tokenizer.from_pretrained`).

    "tiny" builds the tiny tokenizer (in `tokenizer_dir` or a temp dir) and a
    randomly initialised tiny Decoder: a smoke-test policy, not a useful one.
    sampler: a registered sampler kind (`ac2_jax.sampling.registry.SAMPLERS`, the
    same the recipes' `sampler.kind` picks): "jax" (embedded JaxSampler), "sglang"
    (SGLangSampler at `sglang_url`, serving the same weights; `export_dir`
    receives exports), "fleet" (needs `backends`), or one registered by the
    caller. fixed_shapes (JaxSampler only): max_batch rows x max_context slots
    always, compiled up front by `warmup()`: no compiles (and no memory growth from
    them) once serving. weight_swap (JaxSampler only): "drain" or "in_flight"
    (`JaxSampler(weight_swap=)`: new weights between decode chunks, per-token versions).
    backends: URLs of SGLang-protocol servers (SGLang, or `python -m
    ac2_jax.serving.backend` processes serving the same weights): the sampler
    is a `FleetSampler` of `SGLangSampler`s (timeout `backend_timeout_s`),
    each exporting to `export_dir/backend<i>`; they share one load buffer,
    which the fleet fills for one backend at a time. Replaces `sampler`.
    """
    import os
    import tempfile

    config = sampler_config(
        sampler, max_context=max_context, sglang_url=sglang_url, export_dir=export_dir,
        fixed_shapes=fixed_shapes, backends=backends, backend_timeout_s=backend_timeout_s,
        weight_swap=weight_swap,
    )  # fmt: skip
    if model != "tiny" and not os.path.isdir(model):
        raise ValueError(f"--model must be 'tiny' or a local HF directory, got {model!r}")
    from flax import nnx  # heavy imports only once the arguments are known to be good

    from ac2_jax.models import Decoder, DecoderConfig
    from ac2_jax.models.io.hf_io import load_hf_checkpoint
    from ac2_jax.sampling.registry import SamplerSetup, build_sampler
    from ac2_jax.text import Tokenizer
    from ac2_jax.text.tiny_tokenizer import build_tiny_tokenizer

    if model == "tiny":
        tokenizer = build_tiny_tokenizer(tokenizer_dir or tempfile.mkdtemp(prefix="ac2_tok_"))
        if tool_parser is not None:
            tokenizer.set_tool_parser(tool_parser)
        # Its context fits what agent CLIs send with their defaults (18k-48k tokens of
        # the tiny tokenizer): RoPE has no trained length to keep to.
        tiny_context = max_context or TINY_CONTEXT
        decoder = Decoder(
            DecoderConfig.tiny(
                vocab_size=tokenizer.vocab_size, max_position_embeddings=tiny_context
            ),
            rngs=nnx.Rngs(seed),
        )
        tokenizer.model_max_length = tiny_context
        name = "tiny"
    else:
        tokenizer = Tokenizer.from_pretrained(tokenizer_dir or model, tool_parser)
        decoder, _ = load_hf_checkpoint(model, **SAMPLER_LAYOUT)
        name = os.path.basename(os.path.normpath(model))
    context = max_context or min(
        decoder.config.max_position_embeddings, tokenizer.model_max_length or 1 << 30
    )
    setup = SamplerSetup(
        model=decoder, tokenizer=tokenizer, max_context=context, publish_dir=publish_dir,
        max_batch=max_batch, seed=seed, eos_token_ids=tokenizer.stop_token_ids,
    )  # fmt: skip
    return build_sampler(config, setup), tokenizer, name
