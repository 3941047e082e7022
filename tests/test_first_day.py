"""A new user's first day (issue 68), scripted at toy size: an own HF model directory
made with transformers (Qwen2 architecture) with an own tokenizer carrying the published
Qwen2.5 chat template, an own env in an own package (a per-task lookup tool), then SFT ->
RL -> distillation -> eval through the launcher, one step each (the four command lines
in one child process, `tests.test_train.launch_all`: each through the launcher's `main()`
with its own console). Each run's report files exist and the console carries no
traceback."""

import json
import os

import pytest

from tests.test_train import launch_all

pytestmark = pytest.mark.full  # the launcher in child processes

ENV_SOURCE = '''
from ac2_jax.envs import Env, Task, Tool

TABLES = {}  # task id -> its table: per-task tool state through the `task` argument


def lookup(key, task):
    return TABLES.setdefault(task.task_id, {"word": "ok"})[key]


class LookupEnv(Env):
    name = "lookup"
    system_prompt = "Look the word up, then answer with it."

    def sample_tasks(self, n, seed, split="train"):
        return [Task(task_id=f"{split}-{seed}-{i}", prompt=f"Which word ({i})?")
                for i in range(n)]

    @property
    def tools(self):
        return [Tool("lookup", "Looks a key up in this task's table.",
                     {"type": "object", "properties": {"key": {"type": "string"}},
                      "required": ["key"]}, lookup)]

    def verify(self, task, answer):
        return float(bool(answer) and len(answer.strip()) % 2 == 0)

    def reference_answer(self, task):
        return "ok"

    def demonstration(self, task):
        call = {"id": "call_0", "type": "function",
                "function": {"name": "lookup", "arguments": '{"key": "word"}'}}
        return self.initial_messages(task) + [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": "ok"},
            {"role": "assistant", "content": "ok"}]

    def hint(self, task):
        return "The word is ok."
'''


def write_model_dir(path):
    """A Qwen2-architecture model saved by transformers, with a small byte-level BPE
    tokenizer built here (`build_tiny_tokenizer`) carrying the published Qwen2.5 chat
    template (tokenizer.json, tokenizer_config.json)."""
    import torch
    import transformers

    from ac2_jax.text.tiny_tokenizer import build_tiny_tokenizer
    from tests.models.test_family_templates import QWEN25

    tok = build_tiny_tokenizer(str(path / "build"))
    tok.chat_template = QWEN25
    tok.save_pretrained(str(path))
    config = transformers.Qwen2Config(
        vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=2048,
        tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(config).save_pretrained(str(path), safe_serialization=True)
    return str(path)


def test_first_day_sft_rl_distill_eval_through_the_launcher(tmp_path):
    model = write_model_dir(tmp_path / "my_model")
    pkg = tmp_path / "my_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "envs.py").write_text(ENV_SOURCE)
    env = "--env=my_pkg.envs:LookupEnv"
    rollout = ["--config.rollout.max_tokens=8", "--config.rollout.max_steps=1",
               "--config.sampler.warmup=false"]
    runs = {
        "sft": ["--config.demos.num_tasks=2", "--config.sft.steps=1", "--config.sft.batch_rows=2"],
        "rl": ["--config.rl.steps=1", "--config.rl.tasks_per_step=1",
               "--config.rl.attempts_per_task=2", "--config.rl.batch.rows=2",
               "--config.rl.batch.seq_len=1024", "--config.rl.concurrency=2", *rollout],
        "distill": ["--config.loop.steps=1", "--config.loop.tasks_per_step=1",
                    "--config.loop.concurrency=2", "--config.distill.seq_len=2048", *rollout],
        "eval": ["--config.eval.num_tasks=2", *rollout],
    }
    files = {"sft": ["report.json", "learning_curve.png", "demo_0.html", "final_hf"],
             "rl": ["report.json", "learning_curve.png", "trace_0.html", "final_hf"],
             "distill": ["report.json", "learning_curve.png", "trace_0.html",
                         "distill_report.html", "final_hf"],
             "eval": ["eval_report.json", "eval_attempts.json", "eval_trace_0.html"]}
    # Each recipe starts from the previous one's HF export.
    starts = dict(zip(runs, [model, *(str(tmp_path / r / "report" / "final_hf") for r in runs)]))
    procs = launch_all([{"key": recipe, "cwd": str(tmp_path), "args": [
        f"--recipe={recipe}", env, f"--model={starts[recipe]}",
        f"--workdir={tmp_path / recipe}", *args]} for recipe, args in runs.items()],
        str(tmp_path))
    for recipe in runs:
        work, proc = tmp_path / recipe, procs[recipe]
        assert proc.returncode == 0, (recipe, proc.stderr[-3000:])
        assert "Traceback" not in proc.stderr, (recipe, proc.stderr)
        assert "tool calls parsed as hermes (the chat template's format" in proc.stderr
        report = work / "report"
        missing = [f for f in files[recipe] if not os.path.exists(report / f)]
        assert not missing, (recipe, missing, sorted(os.listdir(report)))
        if recipe == "eval":
            r = json.load(open(report / "eval_report.json"))
            assert r["tasks"] == 2 and len(r["pass_rate_ci95"]) == 2
        else:
            assert json.load(open(report / "report.json"))["steps"] == 1
