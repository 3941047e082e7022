"""LoRA adapters against `peft` (models/lora.py, models/io/peft_io.py).

Tiny Qwen3 and Llama models from transformers' config classes (random fp32
weights, std 0.1), saved with `save_pretrained`, loaded with
`load_hf_checkpoint(..., lora=LoRAConfig(...))`. Both directions, log-probs
within 1e-5 (fp32):
- ours -> PEFT: random adapters exported with `save_peft_adapter` and loaded
  by `peft.PeftModel.from_pretrained` give our log-probs (rslora too, for
  qwen3, and stacked layers);
- PEFT -> ours: a `get_peft_model` adapter with random A and B, saved with
  `save_pretrained`, loaded with `load_peft_adapter`, gives PEFT's log-probs;
- merged: `merge_lora` -> `save_hf_checkpoint` -> transformers gives them too.
Also: a fresh adapter leaves the model's outputs as they were, a LoRA train
state trains the adapters only, and bad adapter files are refused by name.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from ac2_jax.models.io.hf_io import load_hf_checkpoint, save_hf_checkpoint  # noqa: E402
from ac2_jax.models.io.peft_io import (  # noqa: E402
    load_peft_adapter,
    merge_lora,
    read_peft_config,
    save_peft_adapter,
)
from ac2_jax.models.lora import LoRAConfig, adapter_params  # noqa: E402
from ac2_jax.training.core.state import create_train_state  # noqa: E402

TOL = 1e-5
SHAPE = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1,
             max_position_embeddings=128)
CASES = {
    "qwen3": (transformers.Qwen3Config, dict(head_dim=8, tie_word_embeddings=True)),
    "llama": (transformers.LlamaConfig, dict(tie_word_embeddings=False)),
}
TOKENS = [3, 17, 42, 5, 88, 9, 61, 2, 33, 70, 14, 7]


@pytest.fixture(scope="module", params=list(CASES))
def base(request, tmp_path_factory):
    cls, extra = CASES[request.param]
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(
        cls(**SHAPE, **extra), dtype=torch.float32, attn_implementation="eager").eval()
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return request.param, path


def hf_logprobs(model):
    with torch.no_grad():
        logits = model(torch.tensor([TOKENS])).logits[0]
    return torch.log_softmax(logits, -1).numpy()


def our_logprobs(model):
    t = jnp.asarray([TOKENS])
    pos = jnp.arange(len(TOKENS))[None]
    logits = model(t, pos, jnp.ones_like(t))[0]
    return np.asarray(jax.nn.log_softmax(logits, -1))


def randomise(model, seed=1, std=0.05):
    """Random A and B (a fresh adapter's B is zero: it would test nothing)."""
    state = nnx.state(model, nnx.LoRAParam)
    leaves, tree = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    new = [std * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves, strict=True)]
    nnx.update(model, jax.tree.unflatten(tree, new))


def hf_base(path):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager").eval()


def test_fresh_adapter_leaves_outputs_unchanged(base):
    _, path = base
    plain, _ = load_hf_checkpoint(str(path))
    lora, config = load_hf_checkpoint(str(path), lora=LoRAConfig(rank=4))
    assert config.lora.rank == 4
    np.testing.assert_array_equal(our_logprobs(lora), our_logprobs(plain))
    b = [x for k, x in nnx.to_flat_state(nnx.state(lora, nnx.LoRAParam)) if k[-1] == "b"]
    assert b and all(not np.any(np.asarray(x[...])) for x in b)


@pytest.mark.parametrize("rslora,scan", [(False, False), (True, True)])
def test_export_loads_in_peft_with_same_logprobs(base, tmp_path, rslora, scan):
    family, path = base
    lora = LoRAConfig(rank=4, alpha=8.0, rslora=rslora,
                      targets=("q", "v", "o", "down") if family == "llama" else
                      ("q", "k", "v", "o", "gate", "up", "down"))
    model, _ = load_hf_checkpoint(str(path), lora=lora, scan_layers=scan)
    randomise(model)
    ours = our_logprobs(model)
    save_peft_adapter(model, str(tmp_path / "adapter"), base_model_name_or_path=str(path))
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["use_rslora"] is rslora
    peft_model = peft.PeftModel.from_pretrained(hf_base(path), str(tmp_path / "adapter")).eval()
    theirs = hf_logprobs(peft_model)
    assert np.abs(theirs - hf_logprobs(hf_base(path))).max() > 1e-3  # the adapter matters
    np.testing.assert_allclose(ours, theirs, atol=TOL, rtol=0)


def test_peft_adapter_imports_with_same_logprobs(base, tmp_path):
    family, path = base
    torch.manual_seed(3)
    config = peft.LoraConfig(r=6, lora_alpha=12, target_modules=["q_proj", "k_proj", "up_proj",
                                                                 "gate_proj"],
                             init_lora_weights=False, lora_dropout=0.0)
    peft_model = peft.get_peft_model(hf_base(path), config).eval()
    peft_model.save_pretrained(str(tmp_path / "theirs"))
    theirs = hf_logprobs(peft_model)
    plain, _ = load_hf_checkpoint(str(path))
    model = load_peft_adapter(plain, str(tmp_path / "theirs"))
    assert model.config.lora.rank == 6
    assert set(model.config.lora.targets) == {"q", "k", "up", "gate"}
    np.testing.assert_allclose(our_logprobs(model), theirs, atol=TOL, rtol=0)
    # merged: one matrix per projection, saved as a plain HF checkpoint
    merged = merge_lora(model)
    assert merged.config.lora is None
    np.testing.assert_allclose(our_logprobs(merged), theirs, atol=TOL, rtol=0)
    save_hf_checkpoint(merged, str(tmp_path / "merged"))
    np.testing.assert_allclose(hf_logprobs(hf_base(tmp_path / "merged")), theirs, atol=TOL, rtol=0)
    with pytest.raises(ValueError, match="merge_lora"):
        save_hf_checkpoint(model, str(tmp_path / "nope"))


def test_bad_adapter_files_are_refused_by_name(base, tmp_path):
    _, path = base
    model, _ = load_hf_checkpoint(str(path), lora=LoRAConfig(rank=2, targets=("q",)))
    out = tmp_path / "a"
    save_peft_adapter(model, str(out))
    cfg = json.loads((out / "adapter_config.json").read_text())
    for field, value in (("use_dora", True), ("bias", "all"), ("modules_to_save", ["lm_head"])):
        (out / "adapter_config.json").write_text(json.dumps({**cfg, field: value}))
        with pytest.raises(ValueError, match=field):
            read_peft_config(str(out))
    (out / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": ["q_proj",
                                                                                  "k_proj"]}))
    plain, _ = load_hf_checkpoint(str(path))
    with pytest.raises(KeyError, match="k_proj.lora_A"):
        load_peft_adapter(plain, str(out))
    with pytest.raises(ValueError, match="unknown target 'lm_head'"):
        LoRAConfig(targets=("q", "lm_head"))


def test_lora_train_state_trains_adapters_only(base):
    _, path = base
    model, _ = load_hf_checkpoint(str(path), lora=LoRAConfig(rank=2, base_dtype="bfloat16"))
    graphdef, state = create_train_state(model, optax.adam(1e-2))
    trained = jax.tree.leaves(state.params)
    assert trained and all(x.dtype == jnp.float32 for x in trained)
    n_adapter = sum(x.size for x in jax.tree.leaves(adapter_params(model)))
    assert sum(x.size for x in trained) == n_adapter
    opt_leaves = [x for x in jax.tree.leaves(state.opt_state) if x.ndim > 0]
    assert sum(x.size for x in opt_leaves) == 2 * n_adapter  # Adam's mu and nu, adapters only
    # The layers' frozen bf16 weights sit in the state as their bits (`frozen_bits`);
    # the model the state gives back has them in bf16.
    base_w = [x for x in jax.tree.leaves(state.rest) if x.ndim == 2]
    assert base_w and all(x.dtype in (jnp.bfloat16, jnp.uint16) for x in base_w)
    back = [x for x in jax.tree.leaves(nnx.state(state.model(graphdef), nnx.Param))
            if x.ndim == 2 and x.dtype != jnp.float32]
    assert back and all(x.dtype == jnp.bfloat16 for x in back)
