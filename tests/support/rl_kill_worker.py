"""A whole RL run in one process (endpoint + sampler + learner), for the kill test.

    python tests/support/rl_kill_worker.py WORKDIR STEPS [PACE_AFTER]

PACE_AFTER: the rollouts after the first PACE_AFTER of this process are paced (`PACE_S`);
none without it.
"""

import asyncio
import itertools
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "training", "rl"))

from test_rl_trainer import ADMIN, _config, _model  # noqa: E402

from ac2_jax.orchestration import DefaultOrchestrator, LifecycleClient  # noqa: E402
from ac2_jax.sampling.engine.jax_sampler import JaxSampler  # noqa: E402
from ac2_jax.serving.app import build_app  # noqa: E402
from ac2_jax.serving.server import serve_in_thread  # noqa: E402
from ac2_jax.text.tiny_tokenizer import build_tiny_tokenizer  # noqa: E402
from ac2_jax.trace import TraceStore  # noqa: E402
from ac2_jax.training.rl.trainer import EndpointCollector, RLTrainer  # noqa: E402
from experiments.rl_split.toy_envs import LengthParityEnv  # noqa: E402

# Each paced rollout waits this long before its agent runs, so collecting the step the
# test kills takes seconds and the test can kill the process in the middle of it. Without
# a pace the window was a few rollouts of ~20 ms each (once rollouts stopped building an
# SSL context apiece), and a fresh CI run once finished the step before the kill. At
# 0.3 s the window is 7 x 0.3 s, polled every 0.05 s. Only the killed step is paced
# (PACE_AFTER = the 8 rollouts of step 0; concurrency 1): step 0 and the restarted
# run's rollouts do not wait (~4 s of idle wall less).
PACE_S = 0.3
_made = itertools.count()


class PacedOrchestrator(DefaultOrchestrator):
    def __init__(self, *a, pace_s: float, **kw):
        super().__init__(*a, **kw)
        self.pace_s = pace_s

    async def run(self, turn_input):
        await asyncio.sleep(self.pace_s)
        return await super().run(turn_input)


def _make_paced(pace_after: int | None):
    def make(env, task, client, model):  # test_rl_trainer._make, paced after pace_after
        paced = pace_after is not None and next(_made) >= pace_after
        return PacedOrchestrator(env, task, client, model, max_steps=1,
                                 pace_s=PACE_S if paced else 0.0,
                                 sampling={"temperature": 1.0, "max_tokens": 6})

    return make


async def main(workdir: str, steps: int, pace_after: int | None = None) -> None:
    tok = build_tiny_tokenizer(os.path.join(workdir, "tok"))
    sampler = JaxSampler(_model(tok.vocab_size), publish_dir=os.path.join(workdir, "published"),
                         max_context=256, max_batch=8, min_batch=8, min_cache_len=256,
                         eos_token_ids=tok.stop_token_ids, tokenizer=tok, seed=0)
    url, stop = serve_in_thread(build_app(sampler, tok, admin_key=ADMIN, model_name="tiny"))
    lc = LifecycleClient(url, ADMIN)
    store = TraceStore(os.path.join(workdir, "rollouts.jsonl"))
    collector = EndpointCollector(lc, LengthParityEnv(), _make_paced(pace_after), "tiny", store,
                                  tasks_per_step=2, attempts_per_task=4, seed=0, concurrency=1)
    trainer = RLTrainer(_model(tok.vocab_size), collector, _config(steps, concurrency=1), workdir,
                        on_publish=sampler.load_weights)
    print(f"start_step={trainer.start_step}", flush=True)
    for h in await trainer.run():
        print(f"trained rl_step={h['rl_step']} version={h['policy_version']}", flush=True)
    trainer.close()
    await lc.aclose()
    stop()
    sampler.close()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), *(int(a) for a in sys.argv[3:4])))
