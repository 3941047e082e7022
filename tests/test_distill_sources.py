"""distill_sources: the decode records log-probs of the distribution it sampled from
(tempered; greedy records the raw log_softmax) and its examples say at what temperature.

Tolerance: recorded log-probs against a full learner forward, 1e-4 absolute (fp32,
KV-cache decode vs one causal pass).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ac2_jax.models import Decoder, DecoderConfig
from ac2_jax.models.tokenizer import build_tiny_tokenizer
from ac2_jax.training import OptimizerConfig, create_train_state
from ac2_jax.training.distill.sources import (HintTask, PromptCache, SampleConfig, generate,
                                              resample_examples, rollout_and_grade)

MSGS = ({"role": "user", "content": "Pick a color."},)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tok = build_tiny_tokenizer(str(tmp_path_factory.mktemp("tok")))
    model = Decoder(DecoderConfig.tiny(vocab_size=tok.vocab_size), rngs=nnx.Rngs(1))
    g, st = create_train_state(model, OptimizerConfig(learning_rate=1e-3))
    return tok, g, st


def _raw_logp(g, st, prompt, out):
    """log_softmax of the learner's logits at each output position [n, V] (fp32)."""
    ids = list(prompt) + list(out)
    tokens = jnp.asarray([ids], jnp.int32)
    logits = st.model(g)(tokens, jnp.arange(len(ids))[None], jnp.ones_like(tokens))[0]
    return np.asarray(logits[len(prompt) - 1:len(ids) - 1], np.float32)


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.5])
def test_generate_records_logprobs_of_the_sampled_distribution(setup, temperature):
    tok, g, st = setup
    prompt = tok.apply_chat_template(list(MSGS), tokenize=True)
    (out, lps), = generate(g, st.params, st.rest, [prompt], max_new_tokens=12,
                           stop_token_ids=tok.stop_token_ids, temperature=temperature, seed=3)
    assert len(out) == len(lps) > 0
    logits = _raw_logp(g, st, prompt, out)
    t = temperature if temperature > 0 else 1.0  # greedy: the raw distribution
    want = jax.nn.log_softmax(logits / t)[np.arange(len(out)), out]
    np.testing.assert_allclose(lps, want, atol=1e-4)
    if temperature == 0:
        assert out == np.argmax(logits, -1).tolist()
    else:  # and not the untempered log-probs
        assert np.abs(np.asarray(lps) - jax.nn.log_softmax(logits)[np.arange(len(out)), out]
                      ).max() > 1e-2


def test_examples_record_sampling_params(setup):
    tok, g, st = setup
    prompts = PromptCache(tok)
    task = HintTask("pick", MSGS, hint="Say blue.")
    for temp in (0.0, 0.8):
        sampling = SampleConfig(max_new_tokens=6, temperature=temp)
        (ex,) = resample_examples(g, st.params, st.rest, [task], prompts, sampling)
        exs, _ = rollout_and_grade(g, st.params, st.rest, [task], lambda t, s: "Say blue.",
                                   prompts, sampling)
        for e in (ex, *exs):
            assert (e.temperature, e.top_k, e.top_p) == (temp, 0, 1.0)  # Completion's convention
            assert len(e.response_logprobs) == len(e.response)
