"""`python -m ac2_jax.serving --model=tiny --port=8000 --admin_key=...`

Serves the OpenAI-compatible endpoint and the rollout lifecycle API. With
--publish_dir holding finalized steps it serves the newest one from the start
(a restarted endpoint does not fall back to the launch weights).
"""

import importlib
import secrets

import uvicorn
from absl import app, flags, logging

from ac2_jax.sampling.base import SamplerError
from ac2_jax.sampling.registry import SAMPLERS
from ac2_jax.serving.apis import REQUEST_APIS
from ac2_jax.serving.app import build_app, mounted_apis
from ac2_jax.serving.server import load_policy, sampler_config

flags.DEFINE_string("model", "tiny", "'tiny' or a local HF model directory.")
flags.DEFINE_string("model_name", None, "Name clients pass as `model` (default: from --model).")
flags.DEFINE_string("host", "127.0.0.1", "Address to bind.")
flags.DEFINE_integer("port", 8000, "Port to bind.")
flags.DEFINE_string("admin_key", None, "Admin API key (default: a random one, logged).")
flags.DEFINE_string("trace_store", None, "JSONL file that receives finished traces.")
flags.DEFINE_string(
    "sampler",
    "jax",
    "Sampler kind, one registered in ac2_jax.sampling.registry.SAMPLERS "
    f"({', '.join(SAMPLERS.names())}, or one a module of --extensions registers).",
)
flags.DEFINE_list(
    "extensions",
    [],
    "Comma-separated modules imported first: they register sampler kinds (SAMPLERS) "
    "or request APIs (ac2_jax.serving.apis.REQUEST_APIS) by name.",
)
flags.DEFINE_list(
    "apis",
    [],
    f"Request APIs to mount (default: every registered one: {', '.join(REQUEST_APIS.names())}).",
)
flags.DEFINE_string("sglang_url", None, "SGLang server URL (--sampler=sglang).")
flags.DEFINE_list(
    "backends",
    [],
    "Sampler fleet: comma-separated URLs of SGLang servers or `python -m "
    "ac2_jax.serving.backend` processes; a rollout stays on one, a dead one "
    "fails only its in-flight requests. Replaces --sampler.",
)
flags.DEFINE_float(
    "backend_timeout_s", 600.0, "HTTP timeout of each request to --backends or --sglang_url."
)
flags.DEFINE_string("publish_dir", None, "Orbax publish dir read by load_weights.")
flags.DEFINE_string("export_dir", None, "Where SGLang weight exports are written.")
flags.DEFINE_integer("max_context", None, "Tokens per sequence (default: the model's).")
flags.DEFINE_integer("max_batch", 16, "Rows decoded together by the JaxSampler.")
flags.DEFINE_bool(
    "fixed_shapes",
    False,
    "JaxSampler: always max_batch rows x max_context slots, compiled at start "
    "(no compiles, so no memory growth from them, while serving).",
)
flags.DEFINE_enum(
    "weight_swap",
    "drain",
    ["drain", "in_flight"],
    "JaxSampler: new weights wait for the running rows (drain) or are swapped in "
    "between decode chunks, each token recording its version (in_flight).",
)
flags.DEFINE_integer("max_tokens", None, "Default max_tokens of a request.")
flags.DEFINE_float("rollout_timeout_s", None, "Default rollout timeout in seconds.")
flags.DEFINE_integer("seed", 0, "Seed of the tiny model and of unseeded requests.")
flags.DEFINE_integer("max_body_bytes", 8 << 20, "Larger request bodies get 413.")
flags.DEFINE_integer(
    "max_finished_rollouts", 256, "Finished rollouts whose whole trace stays in memory."
)
flags.DEFINE_bool("expose_docs", False, "Serve /docs, /redoc and /openapi.json.")
flags.DEFINE_enum(
    "builtin_tools",
    "omit",
    ["omit", "refuse"],
    "/v1/responses: built-in tools (web_search, ...) the server cannot run are left out "
    "of the model's prompt (omit: counted and named in the trace metadata) or refused (400).",
)
flags.DEFINE_string(
    "tool_parser",
    None,
    "The model's tool-call format (hermes, llama3_json, mistral, ...; "
    "default: its chat template's, else its family's).",
)
FLAGS = flags.FLAGS


def main(argv):
    del argv
    for module in FLAGS.extensions:  # they register their kinds and APIs by name
        importlib.import_module(module)
    try:  # an unknown kind or API, a flag the kind does not read: one line, before any work
        apis = mounted_apis(FLAGS.apis or None)
        sampler_config(
            FLAGS.sampler, sglang_url=FLAGS.sglang_url, export_dir=FLAGS.export_dir,
            fixed_shapes=FLAGS.fixed_shapes, backends=FLAGS.backends,
            backend_timeout_s=FLAGS.backend_timeout_s, weight_swap=FLAGS.weight_swap,
        )  # fmt: skip
    except ValueError as e:
        raise app.UsageError(str(e)) from None
    sampler, tokenizer, name = load_policy(
        FLAGS.model,
        sampler=FLAGS.sampler,
        max_context=FLAGS.max_context,
        publish_dir=FLAGS.publish_dir,
        sglang_url=FLAGS.sglang_url,
        export_dir=FLAGS.export_dir,
        max_batch=FLAGS.max_batch,
        seed=FLAGS.seed,
        fixed_shapes=FLAGS.fixed_shapes,
        backends=FLAGS.backends,
        backend_timeout_s=FLAGS.backend_timeout_s,
        tool_parser=FLAGS.tool_parser,
        weight_swap=FLAGS.weight_swap,
    )
    if FLAGS.publish_dir:
        from ac2_jax.models.io.params_io import latest_published

        step = latest_published(FLAGS.publish_dir)
        if step is not None:  # a restart serves the newest publish, not the launch weights
            try:
                logging.info("serving step %d of %s", sampler.load_weights(step), FLAGS.publish_dir)
            except SamplerError as e:  # e.g. every fleet backend down: the learner's next tell
                logging.warning("serving the launch weights: step %d not loaded (%s)", step, e)
    admin_key = FLAGS.admin_key or "sk-admin-" + secrets.token_urlsafe(16)
    if not FLAGS.admin_key:
        logging.warning("no --admin_key given; using %s", admin_key)
    api = build_app(
        sampler,
        tokenizer,
        admin_key=admin_key,
        trace_store=FLAGS.trace_store,
        model_name=FLAGS.model_name or name,
        rollout_timeout_s=FLAGS.rollout_timeout_s,
        default_max_tokens=FLAGS.max_tokens,
        max_body_bytes=FLAGS.max_body_bytes,
        max_finished_rollouts=FLAGS.max_finished_rollouts,
        expose_docs=FLAGS.expose_docs,
        builtin_tools=FLAGS.builtin_tools,
        apis=apis,
    )
    uvicorn.run(api, host=FLAGS.host, port=FLAGS.port, log_level="info")


if __name__ == "__main__":
    app.run(main)
