"""Many domains, adaptively mixed: RL on 30 reasoning-gym generators (docs/notes/2026-12-07-environments-of-other-libraries.md).

The RL recipe's config for `--env=reasoning_gym:@mix30` (a DomainMixer, a domain per
generator): weights adapt to each domain's rolling pass rate (`mix.adaptive`), the
console shows the mix each step and the report holds mix.jsonl and mix.png (per-domain
pass curves and weights) and env_audit.json (the verifier audit of every domain).

    python -m ac2_jax.train --recipe=sft --env=reasoning_gym:@mix30 --model=tiny \
        --workdir=runs/rg_sft --config.demos.num_tasks=600 --config.sft.steps=300 \
        --config.sft.batch_rows=4 --config.sft.seq_len=1024 \
        --config.sft.checkpoint_every=0 --config.optimizer.learning_rate=3e-3
    python -m ac2_jax.train --recipe=rl --env=reasoning_gym:@mix30 \
        --model=runs/rg_sft/report/final_hf --config=experiments/rg_mix/config.py:toy \
        --workdir=runs/rg_mix

Variants:
  default  a real-size shape: 200 steps of 32 tasks x 8 attempts, a 64-result window
  toy      20 steps of 16 tasks x 4 attempts on a 2-core CPU (the SFT'd tiny model):
           pass = reward >= 0.5 (reasoning-gym gives partial credit), an 8-result window
"""

from ac2_jax.config import select_variant


def _toy(c: dict) -> dict:
    c["rl"].update(steps=20, tasks_per_step=16, attempts_per_task=4, concurrency=32)
    c["rl"]["batch"] = {"rows": 8, "seq_len": 1024}
    c["rollout"].update(max_tokens=24, max_steps=1)
    c["mix"].update(window=8, min_results=4, floor=0.2, pass_threshold=0.5)
    c["sampler"] = {"warmup": False}
    return c


VARIANTS = {"default": lambda c: c, "toy": _toy}


def get_config(variant: str | None = None) -> dict:
    apply = select_variant(variant, VARIANTS)
    c = {
        "rl": {"steps": 200, "tasks_per_step": 32, "attempts_per_task": 8, "concurrency": 64},
        "rollout": {"max_tokens": 256, "max_steps": 1, "temperature": 1.0},
        "mix": {"adaptive": True, "window": 64, "min_results": 8, "floor": 0.1},
    }
    return apply(c)
