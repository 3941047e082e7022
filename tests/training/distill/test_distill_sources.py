"""distill.sources: on-policy sampling goes through the Sampler protocol (a real
JaxSampler), which records log-probs of the distribution it sampled from
(sampling_logits: temperature, then top-k, then top-p; greedy the raw log_softmax);
examples say with which parameters; `ac2_jax.training.publish(..., sampler=)` keeps the sampler on the
learner's current weights (Orbax publish + load_weights).

Tolerance: recorded log-probs against a full learner forward, 1e-4 absolute (fp32,
KV-cache decode vs one causal pass).
"""

import asyncio
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ac2_jax.losses import token_logprobs
from ac2_jax.models import Decoder, DecoderConfig
from ac2_jax.models.io.params_io import published_checksum
from ac2_jax.sampling.engine.jax_sampler import JaxSampler
from ac2_jax.text.tiny_tokenizer import build_tiny_tokenizer
from ac2_jax.training import OptimizerConfig, create_train_state, publish
from ac2_jax.training.distill import sources
from ac2_jax.training.distill.sources import (
    HintTask,
    PromptCache,
    SampleConfig,
    aresample_examples,
    resample_examples,
    rollout_and_grade,
    sample,
)

MSGS = ({"role": "user", "content": "Pick a color."},)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tok = build_tiny_tokenizer(str(tmp_path_factory.mktemp("tok")))
    model = Decoder(DecoderConfig.tiny(vocab_size=tok.vocab_size, num_layers=1),
                    rngs=nnx.Rngs(1))
    g, st = create_train_state(model, OptimizerConfig(learning_rate=1e-3))
    publish_dir = str(tmp_path_factory.mktemp("publish"))
    with JaxSampler(st.model(g), publish_dir=publish_dir, max_context=256, max_batch=4) as s:
        yield tok, g, st, s, publish_dir


@functools.partial(jax.jit, static_argnums=0)
def _forward(g, st, tokens, n):
    """Logits [L, V] of one row whose first n tokens are real (segment 1), the rest
    padding (segment 0, which no real position attends to)."""
    segment = (jnp.arange(tokens.shape[1]) < n)[None].astype(jnp.int32)
    return st.model(g)(tokens, jnp.arange(tokens.shape[1])[None], segment)[0]


def _logits(g, st, prompt, out):
    """The learner's logits at each output position [n, V] (fp32). One jit over a row
    padded to 128 tokens (every call of the module: one compile, not one per length)."""
    ids = list(prompt) + list(out)
    assert len(ids) <= 128, len(ids)
    tokens = jnp.asarray([ids + [0] * (128 - len(ids))], jnp.int32)
    logits = _forward(g, st, tokens, len(ids))
    return np.asarray(logits[len(prompt) - 1:len(ids) - 1], np.float32)


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.0, 0, 1.0), (0.7, 0, 1.0),
                                                      (1.5, 0, 1.0), (1.2, 5, 0.8)])
def test_sampler_records_logprobs_of_the_sampled_distribution(setup, temperature, top_k, top_p):
    tok, g, st, s, _ = setup
    prompt = tok.apply_chat_template(list(MSGS), tokenize=True)
    cfg = SampleConfig(max_new_tokens=12, temperature=temperature, top_k=top_k, top_p=top_p)
    (res,) = sample(s, [prompt], cfg, stop_token_ids=tok.stop_token_ids, seed=3)
    out, lps = res.output_ids, res.output_logprobs
    assert len(out) == len(lps) > 0 and res.policy_version == s.policy_version
    logits = _logits(g, st, prompt, out)
    raw = np.asarray(jax.nn.log_softmax(logits))[np.arange(len(out)), out]
    if temperature == 0:  # greedy: the raw distribution, argmax tokens
        np.testing.assert_allclose(lps, raw, atol=1e-4)
        assert out == np.argmax(logits, -1).tolist()
        return
    want = token_logprobs(jnp.asarray(logits), jnp.asarray(out), temperature=temperature,
                          top_k=top_k, top_p=top_p)
    np.testing.assert_allclose(lps, np.asarray(want), atol=1e-4)
    assert np.abs(np.asarray(lps) - raw).max() > 1e-2  # and not the untempered log-probs


def test_examples_record_sampling_params(setup):
    tok, _, _, s, _ = setup
    prompts = PromptCache(tok)
    task = HintTask("pick", MSGS, hint="Say blue.")
    for temp, k, p in ((0.0, 0, 1.0), (0.8, 0, 1.0), (0.9, 4, 0.7)):
        sampling = SampleConfig(max_new_tokens=6, temperature=temp, top_k=k, top_p=p)
        (ex,) = resample_examples(s, [task], prompts, sampling)
        exs, graded = rollout_and_grade(s, [task], lambda t, s: "Say blue.", prompts, sampling)
        assert len(exs) == 1 and not graded[0].passed and graded[0].response == exs[0].response
        for e in (ex, *exs):
            assert (e.temperature, e.top_k, e.top_p) == (temp, k, p)  # Completion's convention
            assert len(e.response_logprobs) == len(e.response) > 0
            assert e.student_prompt == prompts.student(task)
    (t_ex,) = resample_examples(s, [task], prompts, SampleConfig(max_new_tokens=6,
                                                                 temperature=0.0),
                                source="teacher")
    _, teacher, _ = prompts(task, "Say blue.")
    assert t_ex.teacher_prompt == teacher
    with pytest.raises(ValueError, match="source"):
        resample_examples(s, [task], prompts, source="oracle")
    with pytest.raises(ValueError, match="top_p"):
        resample_examples(s, [task], prompts, SampleConfig(top_p=0.0))


def test_one_decode_loop_async_and_sync_forms(setup):
    tok, _, _, s, _ = setup
    assert not hasattr(sources, "generate") and not hasattr(sources, "_generate")
    prompts = PromptCache(tok)
    task = HintTask("pick", MSGS, hint="Say blue.")
    greedy = SampleConfig(max_new_tokens=6, temperature=0.0)

    async def inside_a_loop():
        with pytest.raises(RuntimeError, match="await aresample_examples"):
            resample_examples(s, [task], prompts, greedy)
        return await aresample_examples(s, [task], prompts, greedy)

    (a,) = asyncio.run(inside_a_loop())
    (b,) = resample_examples(s, [task], prompts, greedy)
    assert a.response == b.response
    np.testing.assert_allclose(a.response_logprobs, b.response_logprobs, atol=1e-6)


def test_publish_keeps_the_sampler_on_the_learners_weights(setup):
    tok, g, st, s, publish_dir = setup
    prompt = tok.apply_chat_template(list(MSGS), tokenize=True)
    greedy = SampleConfig(max_new_tokens=8, temperature=0.0)
    new = st.replace(params=jax.tree.map(lambda x: 3.0 * x, st.params))  # another policy
    # Reloaded from the folder (steps 1, 2), then handed over in memory (3, 4:
    # SamplerConfig.hand_off="memory"), which still publishes the same weights. Step 1
    # goes through the deprecated `publish_policy`, which warns and does the same.
    for step, state in ((1, new), (2, st), (3, new), (4, st)):
        in_memory = step > 2
        if step == 1:
            with pytest.warns(DeprecationWarning, match=r"ac2_jax\.training\.publish"):
                got = sources.publish_policy(s, g, state, publish_dir, step, keep=2)
            assert got == step
        else:
            publish(g, state, publish_dir, step, keep=2, sampler=s, in_memory=in_memory)
        assert step == s.policy_version
        assert s.served_weights()["checksum"] == published_checksum(publish_dir, step)
        (res,) = sample(s, [prompt], greedy, stop_token_ids=tok.stop_token_ids)
        assert res.policy_version == step
        logits = _logits(g, state, prompt, res.output_ids)
        assert res.output_ids == np.argmax(logits, -1).tolist()
        np.testing.assert_allclose(
            res.output_logprobs,
            np.asarray(jax.nn.log_softmax(logits))[np.arange(len(res.output_ids)),
                                                   res.output_ids], atol=1e-4)


def test_an_in_memory_publish_without_a_sampler_that_takes_params_writes_nothing(setup):
    """`publish(in_memory=True)` needs a sampler with `set_params`: without one it is a
    clear error before anything is written (the folder keeps its steps)."""
    from ac2_jax.models.io.params_io import latest_published

    _, g, st, _, publish_dir = setup
    before = latest_published(publish_dir)
    with pytest.raises(ValueError, match="pass sampler="):
        publish(g, st, publish_dir, 90, in_memory=True)
    with pytest.raises(TypeError, match="object has none: leave in_memory False"):
        publish(g, st, publish_dir, 91, sampler=object(), in_memory=True)
    assert latest_published(publish_dir) == before
