"""Shared by the recipe and launcher tests: a toy env a random model earns rewards in,
and a tiny HF model directory written by the test."""

from __future__ import annotations

import os

from ac2_jax.envs import Env, Task


class ParityEnv(Env):
    """Reward 1 for a non-empty answer of even length: a random policy earns it about
    half the time, so groups of attempts differ and RL steps update."""

    name = "parity"
    system_prompt = "Answer briefly."

    def sample_tasks(self, n, seed, split="train"):
        return [Task(task_id=f"{split}-{seed}-{i}", prompt=f"Say a word ({i}).")
                for i in range(n)]

    def verify(self, task, answer):
        return float(bool(answer) and len(answer) % 2 == 0)

    def reference_answer(self, task):
        return "ok"

    def demonstration(self, task):
        return self.initial_messages(task) + [{"role": "assistant", "content": "ok"}]

    def hint(self, task):
        return "Answer with an even number of letters, e.g. ok."


def write_tiny_model(directory: str) -> str:
    """The "tiny" preset saved as an HF directory (weights, config, tokenizer)."""
    from ac2_jax.models.io.hf_io import save_hf_checkpoint
    from ac2_jax.recipes import load_model

    model, tokenizer = load_model("tiny", os.path.join(directory, "build"))
    path = os.path.join(directory, "model")
    save_hf_checkpoint(model, path)
    tokenizer.save_pretrained(path)
    return path
