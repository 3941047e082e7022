"""The SFT recipe: demonstrations from the env or a JSONL file, metrics in TensorBoard."""

import json
import os

import pytest

from ac2_jax.config_cli import load_config
from ac2_jax.models.io.hf_io import load_hf_checkpoint
from ac2_jax.recipes import SFTRecipeConfig, load_model, sft
from ac2_jax.recipes._sft import demo_chats
from tests.support.recipe_helpers import ParityEnv


def test_sft_learns_the_demonstrations_and_exports_hf(tmp_path):
    cfg = load_config(SFTRecipeConfig, None, [
        f"paths.workdir={tmp_path / 'run'}", "demos.num_tasks=8", "sft.steps=12",
        "sft.batch_rows=4", "sft.seq_len=128", "sft.checkpoint_every=0",
        "optimizer.learning_rate=1e-2", "log.progress=false"])
    result = sft(load_model("tiny", str(tmp_path / "build")), ParityEnv(), cfg)
    r = result.report
    assert r["steps"] == 12 and r["demonstrations"] == 8
    assert r["final_loss"] < 0.5 * r["first_loss"]
    # SFT metrics reach the run's metrics folder and TensorBoard (finding: they never did).
    metrics = [json.loads(x) for x in open(tmp_path / "run" / "metrics" / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == list(range(1, 13)) and "train/loss" in metrics[0]
    assert os.listdir(tmp_path / "run" / "metrics" / "tensorboard")
    model, config = load_hf_checkpoint(r["hf_export"])
    assert config.num_layers == 2


def test_demonstrations_from_a_jsonl_file(tmp_path):
    path = tmp_path / "demos.jsonl"
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    path.write_text(json.dumps({"messages": chat}) + "\n\n" + json.dumps(
        {"messages": chat, "task": "t1"}) + "\n")
    cfg = load_config(SFTRecipeConfig, None, [f"demos.file={path}"])
    assert demo_chats(None, cfg) == [("demo-0", chat, None), ("t1", chat, None)]
    path.write_text('{"message": []}\n')
    with pytest.raises(ValueError, match=r"demos.jsonl line 1: expected"):
        demo_chats(None, cfg)


def test_sft_without_env_or_file_says_what_to_give(tmp_path):
    cfg = load_config(SFTRecipeConfig, None, [f"paths.workdir={tmp_path}"])
    with pytest.raises(ValueError, match="give an env"):
        sft("tiny", None, cfg)


def test_sft_with_lora_learns_through_the_adapters_alone(tmp_path):
    """`lora.rank=8`: the loss falls with the base frozen; the export is merged HF +
    the PEFT adapter."""
    from ac2_jax.models.io.peft_io import read_peft_config
    cfg = load_config(SFTRecipeConfig, None, [
        f"paths.workdir={tmp_path / 'run'}", "demos.num_tasks=8", "sft.steps=12",
        "sft.batch_rows=4", "sft.seq_len=128", "sft.checkpoint_every=0", "lora.rank=8",
        "lora.alpha=16", "optimizer.learning_rate=1e-1", "log.progress=false"])
    result = sft(load_model("tiny", str(tmp_path / "build")), ParityEnv(), cfg)
    r = result.report
    # A random base with its embeddings and head frozen learns slower than a full
    # fine-tune (6.31 -> 5.13 here, full: below half); with the adapters frozen it
    # would not move at all.
    assert r["final_loss"] < 0.9 * r["first_loss"]
    assert result.model.config.lora.rank == 8 and read_peft_config(r["adapter"]).rank == 8
