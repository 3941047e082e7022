"""The main job: a tiny agent learns to use a calculator tool (CPU, minutes)."""

import ml_collections
from ml_collections import config_dict


def get_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.workdir = "runs/calculator"

    c.tokenizer = ml_collections.ConfigDict(dict(vocab_size=640))
    c.model = ml_collections.ConfigDict(dict(
        hidden_size=64, intermediate_size=192, num_layers=2, num_heads=4, num_kv_heads=4,
        head_dim=16, max_position_embeddings=512))

    c.env = ml_collections.ConfigDict(dict(name="calculator", num_low=10, num_high=99,
                                            answer_digits=4))

    # SFT warm start on deliberately imperfect demos: half skip the tool and guess.
    c.sft = ml_collections.ConfigDict(dict(
        num_demos=1024, skip_tool_prob=0.5, steps=400, batch_rows=8, seq_len=512, layout="tree",
        learning_rate=5e-3, warmup_steps=20))

    c.rl = ml_collections.ConfigDict(dict(
        steps=12, tasks_per_step=8, attempts_per_task=8, mode="sync", learning_rate=1e-4,
        temperature=0.3, max_tokens=48, max_steps=3, seq_len=512, rows=8, layout="tree",
        aggregate="task_mean", clip_eps=0.2, tis_cap=2.0, max_staleness=1,
        normalize_std=False, concurrency=64,
        # Failures (DESIGN.md): infra_error is retried, then never trained; agent_error
        # trains with the verifier's reward (None) or this one; timed_out is dropped (None).
        infra_retries=2, agent_error_reward=config_dict.placeholder(float),
        timed_out_reward=config_dict.placeholder(float)))

    c.eval = ml_collections.ConfigDict(dict(num_tasks=200, temperature=0.3, concurrency=64))
    c.report = ml_collections.ConfigDict(dict(num_sample_traces=4))
    return c
