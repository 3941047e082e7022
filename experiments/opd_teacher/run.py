"""On-policy distillation from a bigger teacher model vs RL at the same budget (issue 64).

    python -m experiments.opd_teacher --workdir runs/opd            # the study (docs/notes/2026-12-07-on-policy-distillation-teacher-judge.md)
    python -m experiments.opd_teacher --workdir runs/opd --preset toy  # seconds: the pipeline

The task (`ReverseEnv`): reverse a sequence of letters ("Reverse: c a f h" -> "h f a
c"), exact match; train and held-out sequences never overlap. Every stage is a
recipe of the library, every rollout and eval goes through its endpoint (real
HTTP), as a user's run would:

1. teacher: a 2-layer hidden-64 decoder, SFT on demonstrations (`recipes.sft`)
   until it solves the task; its held-out pass rate measured.
2. student: a 2-layer hidden-32 decoder (about a quarter of the teacher's
   non-embedding weights), the same tokenizer, a short SFT warm start
   (`recipes.sft`: 280 steps, about half the held-out tasks, so that RL sees
   rewards); its held-out pass rate measured.
3. from that student, the same budget (steps x tasks x attempts, the same
   learning rate and rollout settings) of
   - OPD: `recipes.distill` with `distill.teacher=<the teacher's HF dir>`,
     `loop.hints=false` (the teacher reads the student's prompt, per-token
     reverse KL on the student's own samples);
   - RL: `recipes.rl` (the default objective: group-relative advantages).
   Held-out pass rate after each (greedy, `eval.num_tasks` tasks), per seed.

The headline is the share of the teacher-student gap each method closes:
(after - student) / (teacher - student). `report.json` holds every figure.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import time
from typing import Any

from ac2_jax.envs import Env, Task

LETTERS = "abcdefgh"


class ReverseEnv(Env):
    """Reverse `length` space-separated letters. Reward 1 for the exact reversal
    (whitespace-normalised), else 0. A sequence is held out (split "eval") when its
    letters' index in base len(LETTERS) is 0 mod 5: the splits never overlap."""

    name = "reverse"

    def __init__(self, length: int = 4):
        self.length = length

    @staticmethod
    def _split_of(seq: str) -> str:
        code = 0
        for ch in seq:
            code = code * len(LETTERS) + LETTERS.index(ch)
        return "eval" if code % 5 == 0 else "train"

    def sample_tasks(self, n: int, seed: int, split: str = "train") -> list[Task]:
        rng, out = random.Random(f"{seed}:{split}"), []
        while len(out) < n:
            seq = "".join(rng.choice(LETTERS) for _ in range(self.length))
            if self._split_of(seq) == split:
                answer = " ".join(reversed(seq))
                out.append(Task(f"{split}-{seed}-{len(out)}", "Reverse: " + " ".join(seq), answer))
        return out

    def verify(self, task: Task, answer: str | None) -> float:
        return float(" ".join((answer or "").split()) == task.answer)

    def reference_answer(self, task: Task) -> str:
        return task.answer

    def demonstration(self, task: Task) -> list[dict]:
        return self.initial_messages(task) + [{"role": "assistant", "content": task.answer}]


@dataclasses.dataclass(frozen=True)
class Preset:
    teacher_sft_steps: int
    student_sft_steps: int
    demos: int
    steps: int  # OPD / RL steps
    tasks_per_step: int
    attempts_per_task: int
    learning_rate: float
    temperature: float  # the rollouts' sampling temperature (evals are greedy)
    eval_tasks: int
    seeds: tuple[int, ...]


PRESETS = {
    "study": Preset(teacher_sft_steps=600, student_sft_steps=280, demos=512, steps=200,
                    tasks_per_step=8, attempts_per_task=4, learning_rate=3e-4, temperature=1.0,
                    eval_tasks=128, seeds=(0,)),
    "study400": Preset(teacher_sft_steps=600, student_sft_steps=280, demos=512, steps=400,
                       tasks_per_step=8, attempts_per_task=4, learning_rate=3e-4,
                       temperature=1.0, eval_tasks=128, seeds=(0,)),
    "toy": Preset(teacher_sft_steps=1, student_sft_steps=0, demos=8, steps=1, tasks_per_step=2,
                  attempts_per_task=2, learning_rate=1e-3, temperature=1.0, eval_tasks=2,
                  seeds=(0,)),
}  # fmt: skip

COMMON = ["rollout.max_tokens=12", "rollout.max_steps=1", "eval.temperature=0.0",
          "sampler.warmup=false", "log.tensorboard=false"]


def _models(workdir: str):
    """(teacher, student) fresh decoders over one tiny tokenizer."""
    from flax import nnx

    from ac2_jax.models import Decoder, DecoderConfig
    from ac2_jax.text.tiny_tokenizer import build_tiny_tokenizer

    tok = build_tiny_tokenizer(os.path.join(workdir, "tokenizer"), vocab_size=512)

    def make(hidden: int, seed: int):
        cfg = DecoderConfig(vocab_size=tok.vocab_size, hidden_size=hidden,
                            intermediate_size=2 * hidden, num_layers=2, num_heads=4,
                            num_kv_heads=2, head_dim=hidden // 4, max_position_embeddings=256,
                            tie_embeddings=True)  # fmt: skip
        return Decoder(cfg, rngs=nnx.Rngs(seed)), tok

    return make(64, 1), make(32, 2)


def _sft(model, env, workdir: str, steps: int, p: Preset, log) -> str:
    """The HF directory of `model` after `steps` SFT steps (0: as it is)."""
    from ac2_jax.config_cli import load_config
    from ac2_jax.recipes import SFTRecipeConfig, sft
    from ac2_jax.recipes.common import export_model

    if steps == 0:
        return export_model(*model, os.path.join(workdir, "final_hf"))["hf_export"]

    cfg = load_config(SFTRecipeConfig, None, [
        f"paths.workdir={workdir}", f"demos.num_tasks={p.demos}", f"sft.steps={steps}",
        "sft.seq_len=128", "sft.batch_rows=16", "sft.checkpoint_every=0",
        "optimizer.learning_rate=3e-3", "log.tensorboard=false", "log.progress=false"])  # fmt: skip
    r = sft(model, env, cfg).report
    log(f"sft {os.path.basename(workdir)}: {steps} steps, loss {r['first_loss']:.3f} -> "
        f"{r['final_loss']:.3f} ({r['time_s']:.0f}s)")  # fmt: skip
    return r["hf_export"]


def _eval_only(model_dir: str, env, workdir: str, p: Preset) -> float:
    """Held-out pass rate of a model through the endpoint (the distill recipe's
    eval path, with no training step run: steps=0 is not allowed, so the eval is
    called directly on a served policy)."""
    import asyncio

    from ac2_jax.config_cli import load_config
    from ac2_jax.recipes import DistillRecipeConfig, load_model
    from ac2_jax.recipes._rl import evaluate_policy
    from ac2_jax.recipes.common import Progress, serve_policy

    cfg = load_config(DistillRecipeConfig, None, [
        *COMMON, f"paths.workdir={workdir}", f"eval.num_tasks={p.eval_tasks}"])
    paths = cfg.paths.resolved()
    model, tok = load_model(model_dir, paths.workdir)

    async def go():
        async with serve_policy(
            model, tok, publish_dir=paths.publish, traces_dir=paths.traces, sampler=cfg.sampler,
            rollout=cfg.rollout, max_batch=16, seed=cfg.seed,
        ) as (_, lifecycle):  # fmt: skip
            quiet = Progress("eval", 1, enabled=False)
            r = await evaluate_policy(cfg, env, lifecycle, "eval", quiet)
            return r.pass_rate.mean

    return float(asyncio.run(go()))


def _train(kind: str, student_dir: str, teacher_dir: str, env, workdir: str, seed: int,
           p: Preset) -> dict[str, Any]:  # fmt: skip
    from ac2_jax.config_cli import load_config
    from ac2_jax.recipes import DistillRecipeConfig, RLRecipeConfig, distill, rl

    common = [*COMMON, f"paths.workdir={workdir}", f"seed={seed}",
              f"rollout.temperature={p.temperature}",
              f"eval.num_tasks={p.eval_tasks}", "log.progress=false"]  # fmt: skip
    t0 = time.perf_counter()
    if kind == "opd":
        cfg = load_config(DistillRecipeConfig, None, [
            *common, f"distill.teacher={teacher_dir}", "loop.hints=false",
            f"loop.steps={p.steps}", f"loop.tasks_per_step={p.tasks_per_step}",
            f"loop.attempts_per_task={p.attempts_per_task}", "loop.concurrency=16",
            "distill.seq_len=128", "distill.rows=2", "distill.checkpoint_every=0",
            f"optimizer.learning_rate={p.learning_rate}"])  # fmt: skip
        r = distill(student_dir, env, cfg).report
    else:
        cfg = load_config(RLRecipeConfig, None, [
            *common, f"rl.steps={p.steps}", f"rl.tasks_per_step={p.tasks_per_step}",
            f"rl.attempts_per_task={p.attempts_per_task}", "rl.concurrency=16",
            f"rl.optimizer.learning_rate={p.learning_rate}"])  # fmt: skip
        r = rl(student_dir, env, cfg).report
    return {"before": r["eval"]["before"], "after": r["eval"]["after"],
            "time_s": time.perf_counter() - t0}  # fmt: skip


def run(workdir: str, preset: str = "study", log=print) -> dict[str, Any]:
    """The study (module docstring); writes and returns `workdir/report.json`."""
    p = PRESETS[preset]
    env = ReverseEnv()
    t0 = time.perf_counter()
    os.makedirs(workdir, exist_ok=True)
    teacher, student = _models(workdir)
    teacher_dir = _sft(teacher, env, os.path.join(workdir, "teacher"), p.teacher_sft_steps, p, log)
    student_dir = _sft(student, env, os.path.join(workdir, "student"), p.student_sft_steps, p, log)
    teacher_rate = _eval_only(teacher_dir, env, os.path.join(workdir, "eval_teacher"), p)
    log(f"teacher held-out pass rate {teacher_rate:.3f}")
    runs: dict[str, list[dict[str, Any]]] = {"opd": [], "rl": []}
    for seed in p.seeds:
        for kind in ("opd", "rl"):
            out = _train(kind, student_dir, teacher_dir, env,
                         os.path.join(workdir, f"{kind}_seed{seed}"), seed, p)  # fmt: skip
            gap = teacher_rate - out["before"]
            out["gap_closed"] = (out["after"] - out["before"]) / gap if gap > 0 else None
            runs[kind].append({"seed": seed, **out})
            log(f"{kind} seed {seed}: {out['before']:.3f} -> {out['after']:.3f} "
                f"(gap closed {out['gap_closed']}) in {out['time_s']:.0f}s")  # fmt: skip
    n_params = {name: _count(d) for name, d in (("teacher", teacher_dir), ("student", student_dir))}
    report = {"preset": dataclasses.asdict(p), "teacher_pass_rate": teacher_rate,
              "student_pass_rate": runs["opd"][0]["before"], "params": n_params, "runs": runs,
              "mean_gap_closed": {k: _mean([r["gap_closed"] for r in v]) for k, v in runs.items()},
              "time_s": time.perf_counter() - t0}  # fmt: skip
    with open(os.path.join(workdir, "report.json"), "w") as f:
        json.dump(report, f, indent=2)
    log(json.dumps(report["mean_gap_closed"]))
    return report


def _count(model_dir: str) -> int:
    import jax

    from ac2_jax.models.io.hf_io import load_hf_checkpoint

    model, _ = load_hf_checkpoint(model_dir)
    from flax import nnx

    return int(sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))))


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--preset", default="study", choices=sorted(PRESETS))
    args = ap.parse_args()
    run(args.workdir, args.preset)


if __name__ == "__main__":
    main()
