"""Shared by the serving, orchestration and eval tests: a tiny real model fitted
to a scripted 3-turn tool-calling conversation, so greedy decoding reproduces the
calls (and to the orchestrators' delegation and transient-message scripts, so one
fitted model serves every module); and a tiny random model served by the real
endpoint (`served_random_model`).

The training sequence is built exactly as the endpoint builds prompts
(`build_prompt_ids` with the scripted outputs remembered), so the fitted
model sees at test time the same tokens it was fitted on.

A fit is done once per test run for each distinct input (sequences, seed, lr,
step cap, config): its weights are kept in the run's scratch directory
(`AC2_TEST_RUN_DIR`, made by tests/conftest.py), and every other module (either
xdist worker) that asks for the same fit gets a fresh Decoder holding them.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
import pathlib
import pickle
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from ac2_jax.envs import Env, Task, Tool
from ac2_jax.models import Decoder, DecoderConfig
from ac2_jax.orchestration import SubagentOrchestrator
from ac2_jax.sampling.engine.jax_sampler import JaxSampler
from ac2_jax.serving.app import build_app
from ac2_jax.serving.core.splice import TurnMemory, build_prompt_ids
from ac2_jax.serving.server import serve_in_thread
from ac2_jax.text import Tokenizer, parse_tool_calls
from ac2_jax.text.tiny_tokenizer import build_tiny_tokenizer
from ac2_jax.trace import TraceStore

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                    "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}]
SYSTEM = {"role": "system", "content": "You are a calculator agent."}
USER = {"role": "user", "content": "What is 3 + 4 + 10?"}
# What the model should emit at each turn, and what the tool answers.
TURNS = [
    ('<tool_call>\n{"name": "add", "arguments": {"a": 3, "b": 4}}\n</tool_call>', "7"),
    ('<tool_call>\n{"name": "add", "arguments": {"a": 7, "b": 10}}\n</tool_call>', "17"),
    ("The answer is 17.", None),
]


def add_tool(arguments: str) -> str:
    args = json.loads(arguments)
    return str(args["a"] + args["b"])


def scripted_sequence(tok: Tokenizer) -> tuple[list[int], list[int]]:
    """(tokens, loss mask) of the whole scripted conversation, as served."""
    return script(tok, [SYSTEM, USER], TOOLS, TURNS)


def script(tok: Tokenizer, messages: list[dict], tools: list[dict],
           turns: list[tuple[str, str | None]]) -> tuple[list[int], list[int]]:
    """(tokens, loss mask) of a conversation as the endpoint builds it; turns = [(text,
    tool result)]: each text is the model's output, each result answers its calls."""
    memory, tokens, mask = TurnMemory(), [], []
    messages = list(messages)
    for text, result in turns:
        prompt, _ = build_prompt_ids(tok, messages, tools, memory)
        assert prompt[:len(tokens)] == tokens, "the script is not append-only"
        out = tok.encode(text) + [tok.eos_token_id]
        mask += [0] * (len(prompt) - len(tokens)) + [1] * len(out)
        tokens = prompt + out
        content, calls = parse_tool_calls(text)
        memory.remember(content, calls, out)
        messages.append({"role": "assistant", "content": content or None,
                         "tool_calls": calls or None})
        messages += [{"role": "tool", "tool_call_id": c["id"], "content": result} for c in calls]
    return tokens, mask


# The orchestrators' scripts (tests/orchestration/test_orchestration_default.py): a
# delegation to a subagent, and the second call made with a reminder shown transiently.
DELEGATE = "Delegate: " + USER["content"]
SPAWN_CALL = ('<tool_call>\n{"name": "spawn_subagent", "arguments": {"name": "helper", '
              f'"task": "{USER["content"]}"}}}}\n</tool_call>')
REMINDER = {"role": "user", "content": "Reminder: add the numbers one call at a time."}


def _add(a: int, b: int) -> str:
    return str(a + b)


class AddEnv(Env):
    """The scripted task: add 3 + 4 + 10 with an `add` tool (schema = TOOLS)."""

    system_prompt = SYSTEM["content"]

    def sample_tasks(self, n, seed, split="train"):
        return [Task(task_id=f"add-{i}", prompt=USER["content"], answer=17) for i in range(n)]

    @property
    def tools(self):
        fn = TOOLS[0]["function"]
        return [Tool(fn["name"], fn["description"], fn["parameters"], _add)]

    def verify(self, task, answer):
        return float(answer is not None and "17" in answer)


def orchestration_scripts(tok: Tokenizer) -> list[tuple[list[int], list[int]]]:
    """(tokens, mask) of the delegation script (spawn a subagent, then answer) and of
    the transient-reminder script: with the reminder shown after the first tool result
    the model still makes the second call (without it the script's third turn follows)."""
    env = AddEnv()
    spawn_spec = SubagentOrchestrator(env, env.sample_tasks(1, 0)[0], None, "tiny").tools[-1].spec()
    delegation = script(tok, [SYSTEM, {"role": "user", "content": DELEGATE}], TOOLS + [spawn_spec],
                        [(SPAWN_CALL, TURNS[-1][0]), (TURNS[-1][0], None)])
    first = parse_tool_calls(TURNS[0][0])[1]
    transient = script(tok, [SYSTEM, USER, {"role": "assistant", "content": None,
                                            "tool_calls": first},
                             {"role": "tool", "tool_call_id": first[0]["id"], "content": "7"},
                             REMINDER], TOOLS, [(TURNS[1][0], "17")])
    return [delegation, transient]


def tiny_config(tok: Tokenizer) -> DecoderConfig:
    return DecoderConfig.tiny(vocab_size=tok.vocab_size, hidden_size=64, intermediate_size=128,
                              num_heads=4, num_kv_heads=2, head_dim=16,
                              max_position_embeddings=1024)


# The fit is runtime-bound (~50 steps of 3 rows x ~520 tokens), unlike the suite's other
# programs: at the suite's -O0 a step took 0.45 CPU s, at LLVM -O1 0.12 s, for 1.7 s more
# compile (tests/conftest.py sets -O0 for all; this one program overrides it).
@functools.partial(jax.jit, static_argnums=(0, 1),
                   compiler_options={"xla_backend_optimization_level": 1})
def _train_step(graphdef, lr, params, rest, opt_state, tokens, positions, segs, targets, weights):
    """One Adam step; also says whether greedy decoding reproduced the targets before it."""
    def loss_fn(p):
        logits = nnx.merge(graphdef, p, rest)(tokens, positions, segs)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
        return jnp.sum(ce * weights) / jnp.sum(weights), logits

    (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    ok = jnp.all((jnp.argmax(logits, -1) == targets) | (weights == 0))
    updates, opt_state = optax.adam(lr).update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss, ok


_FITS: dict[str, dict] = {}  # this process's fitted weights by fit key (numpy leaves)


def fit_tiny_model(tok: Tokenizer, max_steps: int = 600, seed: int = 0, lr: float = 3e-3,
                   extra: list[tuple[list[int], list[int]]] = ()) -> Decoder:
    """A tiny Decoder fitted (Adam) until greedy decoding reproduces the script and
    the orchestrators' scripts (`orchestration_scripts`).

    extra: more (tokens, mask) sequences to fit at the same time. The fit is
    deterministic, so it runs once per test run for each distinct input (the
    module docstring): a later call returns a new Decoder with the same weights.
    """
    seqs = [scripted_sequence(tok)] + orchestration_scripts(tok) + list(extra)
    cfg = tiny_config(tok)
    key = hashlib.sha256(repr((seqs, max_steps, seed, lr, cfg)).encode()).hexdigest()[:24]
    if key not in _FITS:
        run_dir = os.environ.get("AC2_TEST_RUN_DIR")
        if run_dir is None:
            _FITS[key] = _fit(seqs, cfg, max_steps, seed, lr)
        else:
            path = pathlib.Path(run_dir) / f"fit-{key}.pkl"
            with open(path.with_suffix(".lock"), "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # the other worker waits for one fit
                if path.exists():
                    _FITS[key] = pickle.loads(path.read_bytes())
                else:
                    _FITS[key] = _fit(seqs, cfg, max_steps, seed, lr)
                    path.with_suffix(".tmp").write_bytes(pickle.dumps(_FITS[key]))
                    path.with_suffix(".tmp").rename(path)
    model = Decoder(cfg, rngs=nnx.Rngs(seed))
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, _FITS[key]))
    nnx.update(model, state)
    return model


def _fit(seqs: list[tuple[list[int], list[int]]], cfg: DecoderConfig, max_steps: int, seed: int,
         lr: float) -> dict:
    """The fitted Params of `fit_tiny_model`, as a pure dict of numpy arrays."""
    L = max(len(t) for t, _ in seqs)
    tokens = np.zeros((len(seqs), L), np.int32)
    weights = np.zeros((len(seqs), L), np.float32)
    segs = np.zeros((len(seqs), L), np.int32)
    for i, (t, m) in enumerate(seqs):
        tokens[i, :len(t)] = t
        segs[i, :len(t)] = 1
        weights[i, :len(t) - 1] = m[1:]  # the prediction at p scores token p + 1
    data = (tokens, np.broadcast_to(np.arange(L, dtype=np.int32), tokens.shape).copy(), segs,
            np.roll(tokens, -1, axis=1), weights)
    graphdef, params, rest = nnx.split(Decoder(cfg, rngs=nnx.Rngs(seed)), nnx.Param, ...)
    opt_state = optax.adam(lr).init(params)
    for _ in range(max_steps):
        before = params  # immutable arrays: a snapshot
        params, opt_state, loss, ok = _train_step(graphdef, lr, params, rest, opt_state, *data)
        if bool(ok):  # the params before this step reproduce the script: keep those
            return jax.tree.map(np.asarray, nnx.to_pure_dict(before))
    raise AssertionError(f"fit_tiny_model: greedy decoding does not reproduce the script "
                         f"(loss {float(loss):.4f} after {max_steps} steps)")


@nnx.jit
def _token_logprobs(model, tokens, positions, segs):
    logits = model(tokens, positions, segs)
    lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(lp[:, :-1], tokens[:, 1:, None], axis=-1)[..., 0]


def forward_logprobs(model: Decoder, tokens: list[int], bucket: int = 128) -> np.ndarray:
    """log p(tokens[p] | tokens[:p]) for p >= 1 (index 0 is 0), fp32, by one forward pass.

    Padded to a multiple of `bucket` (padding is its own segment, so it is
    never attended to) to reuse one compile across lengths.
    """
    n = len(tokens)
    L = -(-n // bucket) * bucket
    t = np.zeros((1, L), np.int32)
    t[0, :n] = tokens
    segs = np.zeros((1, L), np.int32)
    segs[0, :n] = 1
    pos = np.arange(L, dtype=np.int32)[None]
    out = np.zeros(n, np.float32)
    out[1:] = np.asarray(_token_logprobs(model, t, pos, segs))[0, :n - 1]
    return out


@contextlib.contextmanager
def served_random_model(tmp_dir: pathlib.Path, admin_key: str, *, max_context: int = 256,
                        max_batch: int = 8, trace_store: TraceStore | None = None,
                        publish_dir: str | None = None) -> Iterator[tuple[str, Tokenizer]]:
    """Yields (base url, tokenizer) of the real endpoint (FastAPI over HTTP, model name
    "tiny") in front of a JaxSampler over a tiny random Decoder (seed 0); stops both after.

    For tests of what happens around the model (rollout lifecycle, failure taxonomy,
    audits): its replies are noise, but real tokens with real log-probs. Batch and cache
    are fixed at `max_batch` x `max_context` so it compiles once. The tokenizer is
    written to `tmp_dir/tok`. publish_dir: where POST /v1/admin/load_weights loads
    published steps from (a learner's; the same Decoder config and seed start it).
    """
    tok = build_tiny_tokenizer(str(tmp_dir / "tok"))
    cfg = DecoderConfig.tiny(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64,
                             num_heads=2, num_kv_heads=1, head_dim=16,
                             max_position_embeddings=max_context)
    sampler = JaxSampler(Decoder(cfg, rngs=nnx.Rngs(0)), publish_dir=publish_dir,
                         max_context=max_context,
                         max_batch=max_batch, min_batch=max_batch, min_cache_len=max_context,
                         eos_token_ids=tok.stop_token_ids, tokenizer=tok, seed=0)
    try:
        url, stop = serve_in_thread(build_app(sampler, tok, admin_key=admin_key,
                                              model_name="tiny", trace_store=trace_store))
        try:
            yield url, tok
        finally:
            stop()
    finally:
        sampler.close()
