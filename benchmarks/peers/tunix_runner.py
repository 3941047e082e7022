"""The loop race's tunix side: GRPOLearner steps with the vanilla JAX rollout engine (issue 66).

Run by bench_loop_race in tunix's own venv (google-tunix, its jax):

    /path/tunix-venv/bin/python benchmarks/peers/tunix_runner.py SPEC.json RESULT.json

tunix's GRPOLearner samples one completion per prompt string (single turn:
`rl_cluster.generate`); its agentic learner drives multi-turn tool use only
through a tool-call parser, which a random-weight model never satisfies. So
tunix runs the race's single-turn variant (spec "turns" must be 1: the
prompt is the rendered system prompt + task, one turn of max_tokens tokens,
the same reward), and bench_loop_race runs this library's single-turn row
beside it. Phases per step: rollout (`rl_cluster.generate`), scoring (the
reward function), hand-off (`rl_cluster.sync_weights`), update (the rest of
the step: advantages, the trainer's update). Tokens trained per step are the
sum of the learner's own completion mask (the TrainExample its loss reads),
counted apart from the tokens sampled: the equal-work check compares both.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from task import first_messages, load_spec, peak_rss_mb, reward  # noqa: E402


def main(spec_path: str, out_path: str) -> None:
    import jax
    import numpy as np
    import optax
    import transformers
    from tunix.models.qwen3 import model as qwen3_model
    from tunix.models.qwen3 import params as qwen3_params
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout

    spec = load_spec(spec_path)
    if spec["turns"] != 1:
        raise SystemExit("tunix_runner: the race's tunix side is single-turn (turns=1)")
    with open(os.path.join(spec["checkpoint"], "config.json")) as f:
        hf = json.load(f)
    cfg = qwen3_model.ModelConfig(
        num_layers=hf["num_hidden_layers"], vocab_size=hf["vocab_size"],
        embed_dim=hf["hidden_size"], hidden_dim=hf["intermediate_size"],
        num_heads=hf["num_attention_heads"], head_dim=hf["head_dim"],
        num_kv_heads=hf["num_key_value_heads"], rope_theta=int(hf["rope_theta"]),
        norm_eps=hf["rms_norm_eps"], use_tied_embedding=hf["tie_word_embeddings"])
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    actor = qwen3_params.create_model_from_safe_tensors(spec["checkpoint"], cfg, mesh)
    tok = transformers.AutoTokenizer.from_pretrained(spec["checkpoint"])
    tasks = spec["tasks"][: spec["tasks_per_step"]]
    prompts = [tok.apply_chat_template(first_messages(spec, t), tools=[spec["tool"]],
                                       tokenize=False, add_generation_prompt=True)
               for t in tasks]
    prompt_len = max(len(tok.encode(p, add_special_tokens=False)) for p in prompts)
    steps_total = spec["warmup"] + spec["steps"]
    g, m_tok = spec["attempts"], spec["max_tokens"]
    optimizer = optax.chain(
        optax.clip_by_global_norm(spec["clip"]),
        optax.adamw(spec["lr"], b1=spec["b1"], b2=spec["b2"], weight_decay=0.0))
    roles = rl_cluster_lib.Role
    cluster_cfg = rl_cluster_lib.ClusterConfig(
        role_to_mesh={roles.ACTOR: mesh, roles.REFERENCE: mesh, roles.ROLLOUT: mesh},
        rollout_engine="vanilla", offload_to_cpu=False,
        training_config=rl_cluster_lib.RLTrainingConfig(
            actor_optimizer=optimizer, eval_every_n_steps=10**9, max_steps=steps_total,
            checkpoint_root_directory=None),
        rollout_config=base_rollout.RolloutConfig(
            max_tokens_to_generate=m_tok, max_prompt_length=prompt_len,
            kv_cache_size=prompt_len + m_tok + 8, temperature=1.0, top_p=1.0, top_k=None,
            eos_tokens=[tok.convert_tokens_to_ids("<|im_end|>")]),
    )
    cluster = rl_cluster_lib.RLCluster(actor=actor, reference=None, tokenizer=tok,
                                       cluster_config=cluster_cfg)
    phase = {"rollout_s": 0.0, "scoring_s": 0.0, "handoff_s": 0.0, "sampled": 0, "trained": 0}
    starts: list[float] = []
    marks: list[dict] = []

    generate, sync = cluster.generate, cluster.sync_weights

    def timed_generate(*a, **kw):
        now = time.perf_counter()
        if starts:
            marks.append(dict(phase))
        starts.append(now)
        phase.update(rollout_s=0.0, scoring_s=0.0, handoff_s=0.0, sampled=0, trained=0)
        out = generate(*a, **kw)

        phase["rollout_s"] += time.perf_counter() - now
        phase["sampled"] += sum(len(t) for t in out.tokens)
        return out

    def timed_sync(*a, **kw):
        t0 = time.perf_counter()
        out = sync(*a, **kw)
        phase["handoff_s"] += time.perf_counter() - t0
        return out

    cluster.generate, cluster.sync_weights = timed_generate, timed_sync

    def reward_fn(prompts, completions, answer, **kw):
        t0 = time.perf_counter()
        out = [reward(c, a) for c, a in zip(completions, answer, strict=True)]
        phase["scoring_s"] += time.perf_counter() - t0
        return out

    learner = grpo_learner.GRPOLearner(
        rl_cluster=cluster, reward_fns=reward_fn,
        algo_config=grpo_learner.GRPOConfig(num_generations=g, num_iterations=1, beta=0.0,
                                            epsilon=0.2))
    advantage = learner._generate_and_compute_advantage

    def counted_advantage(*a, **kw):
        # The batch the loss trains on: its completion mask is the tokens trained.
        example = advantage(*a, **kw)
        phase["trained"] += int(np.asarray(example.completion_mask).sum())
        return example

    learner._generate_and_compute_advantage = counted_advantage
    # Arrays, not lists: the learner repeats each leaf G times (jax.tree.map + np.repeat).
    batch = {"prompts": np.array(prompts), "answer": np.array([t["answer"] for t in tasks])}
    data = [batch] * steps_total
    t0 = time.perf_counter()
    learner.train(data)
    end = time.perf_counter()
    marks.append(dict(phase))
    steps = []
    bounds = starts + [end]
    for i, m in enumerate(marks):
        wall = bounds[i + 1] - bounds[i]
        n = m["sampled"]
        steps.append({"rollout_s": m["rollout_s"], "scoring_s": m["scoring_s"],
                      "handoff_s": m["handoff_s"],
                      "update_s": wall - m["rollout_s"] - m["scoring_s"] - m["handoff_s"],
                      "step_s": wall, "sampled_tokens": n, "trained_tokens": m["trained"]})
    import importlib.metadata as md

    with open(out_path, "w") as f:
        json.dump({"system": "tunix", "steps": steps, "total_s": end - t0,
                   "peak_rss_mb": peak_rss_mb(),
                   "versions": {"tunix": md.version("google-tunix"), "jax": jax.__version__,
                                "flax": md.version("flax")},
                   "notes": "GRPOLearner + vanilla rollout, single turn; steps bounded by "
                            "rollout starts (the last by train()'s return)"}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
