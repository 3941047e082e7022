"""The loop race's TRL side: GRPOTrainer steps of the forced calculator tool loop (issue 66).

Run by bench_loop_race in TRL's own venv (trl, transformers, torch CPU):

    /path/trl-venv/bin/python benchmarks/peers/trl_runner.py SPEC.json RESULT.json

TRL's built-in tool loop (`GRPOTrainer(tools=...)` / `environment_factory`)
runs a tool only when `parse_response` finds a tool call in the completion,
which a random-weight model never writes; so the attempt runs through
GRPOTrainer's multi-turn hook `rollout_func` (experimental in TRL 1.16): each
turn is TRL's own generation call (`_generate_single_turn`: transformers
`generate`, the trainer's generation config) over the whole step's attempts,
the tool's answer is appended as tokens (the chat template's suffix after an
assistant turn: end of turn, tool response, generation prompt) and masked out
of the loss with `env_mask`, as TRL's tool loop does with its `tool_mask`.
Everything after the rollout is GRPOTrainer's: rewards, group advantages, the
loss, backward, AdamW. Phases per step: rollout (rollout_func), scoring (the
rest of `_generate_and_score_completions`: reward function, advantages,
padding), update (the rest of the optimizer step), hand-off 0 (generation
uses the trained module itself).
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from task import first_messages, load_spec, peak_rss_mb, reward  # noqa: E402


def suffix_ids(tok, tools, answer) -> list[int]:
    """The template's tokens between an assistant turn's text and the next turn's output."""
    mark = "\u2063XQX\u2063"
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
            {"role": "assistant", "content": mark}, {"role": "tool", "content": str(answer)}]
    text = tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
    return tok.encode(text.split(mark, 1)[1], add_special_tokens=False)


def main(spec_path: str, out_path: str) -> None:
    import torch
    import transformers
    import trl
    from datasets import Dataset

    spec = load_spec(spec_path)
    torch.manual_seed(spec["seed"])
    tools = [spec["tool"]]
    turns, m_tok, g = spec["turns"], spec["max_tokens"], spec["attempts"]
    tok = transformers.AutoTokenizer.from_pretrained(spec["checkpoint"])
    model = transformers.AutoModelForCausalLM.from_pretrained(spec["checkpoint"],
                                                              dtype=torch.float32)
    tasks = spec["tasks"][: spec["tasks_per_step"]]
    steps_total = spec["warmup"] + spec["steps"]
    rows = [{"prompt": first_messages(spec, t), "answer": t["answer"], "task_id": t["task_id"]}
            for t in tasks] * steps_total
    phase = {"rollout_s": 0.0, "scoring_s": 0.0, "sampled": 0, "prompt": 0}
    answer_of = {t["prompt"]: t["answer"] for t in tasks}

    def rollout(prompts, trainer):
        t0 = time.perf_counter()
        ids0 = [tok.apply_chat_template(p, tools=tools, add_generation_prompt=True,
                                        tokenize=True, return_dict=False) for p in prompts]
        ids = [list(x) for x in ids0]
        comp = [[] for _ in prompts]
        mask = [[] for _ in prompts]
        last = [[] for _ in prompts]
        for t in range(turns):
            outs, _ = trainer._generate_single_turn(ids, None, {}, 1)
            for i, o in enumerate(outs):
                o = list(o)
                comp[i] += o
                mask[i] += [1] * len(o)
                ids[i] += o
                last[i] = o
            if t < turns - 1:
                for i, p in enumerate(prompts):
                    s = suffix_ids(tok, tools, answer_of[p[-1]["content"]])
                    comp[i] += s
                    mask[i] += [0] * len(s)
                    ids[i] += s
        phase["rollout_s"] += time.perf_counter() - t0
        phase["sampled"] += sum(sum(x) for x in mask)
        phase["prompt"] += sum(len(x) for x in ids0)
        return {"prompt_ids": [list(x) for x in ids0], "completion_ids": comp, "logprobs": None,
                "env_mask": mask,
                "final_text": tok.batch_decode(last, skip_special_tokens=True)}

    def reward_fn(prompts, completions, final_text, answer, **kw):
        return [reward(text, a) for text, a in zip(final_text, answer, strict=True)]

    class Timed(trl.GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            t0, r0 = time.perf_counter(), phase["rollout_s"]
            out = super()._generate_and_score_completions(inputs)
            phase["scoring_s"] += (time.perf_counter() - t0) - (phase["rollout_s"] - r0)
            out_mask = out["completion_mask"]
            tmask = out.get("tool_mask")
            phase["trained"] = int((out_mask * tmask).sum() if tmask is not None
                                   else out_mask.sum())
            return out

    steps: list[dict] = []

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            phase.update(rollout_s=0.0, scoring_s=0.0, sampled=0, prompt=0, trained=0)
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            wall = time.perf_counter() - self.t0
            steps.append({"rollout_s": phase["rollout_s"], "scoring_s": phase["scoring_s"],
                          "update_s": wall - phase["rollout_s"] - phase["scoring_s"],
                          "handoff_s": 0.0, "step_s": wall,
                          "sampled_tokens": phase["sampled"], "prompt_tokens": phase["prompt"],
                          "trained_tokens": phase["trained"]})

    n = len(tasks) * g
    args = trl.GRPOConfig(
        output_dir=os.path.join(os.path.dirname(out_path), "trl_out"), use_cpu=True,
        per_device_train_batch_size=n, gradient_accumulation_steps=1, num_generations=g,
        max_completion_length=turns * m_tok + (turns - 1) * 64,
        max_steps=steps_total, learning_rate=spec["lr"], adam_beta1=spec["b1"],
        adam_beta2=spec["b2"], weight_decay=0.0, max_grad_norm=spec["clip"],
        lr_scheduler_type="constant", beta=0.0, num_iterations=1, temperature=1.0, top_p=1.0,
        top_k=0, logging_steps=1, save_strategy="no", report_to=[], seed=spec["seed"],
        bf16=False, fp16=False, disable_tqdm=True, dataloader_num_workers=0,
        shuffle_dataset=False,
    )
    trainer = Timed(model=model, reward_funcs=reward_fn, args=args,
                    train_dataset=Dataset.from_list(rows), processing_class=tok,
                    rollout_func=rollout, callbacks=[Clock()])
    trainer.generation_config.max_new_tokens = m_tok  # per turn; the turns add up
    t0 = time.perf_counter()
    trainer.train()
    total = time.perf_counter() - t0
    with open(out_path, "w") as f:
        json.dump({"system": "trl", "steps": steps, "total_s": total,
                   "peak_rss_mb": peak_rss_mb(), "threads": torch.get_num_threads(),
                   "versions": {"trl": trl.__version__, "transformers": transformers.__version__,
                                "torch": torch.__version__},
                   "notes": "GRPOTrainer + rollout_func (forced tool loop over TRL's "
                            "_generate_single_turn); hand-off 0: generation uses the trained "
                            "module"}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
