"""The verifier audit of every reasoning-gym generator (docs/notes/2026-12-07-environments-of-other-libraries.md).

    python -m experiments.rg_mix.verifier_audit [out.json]

For each generator of `reasoning_gym.factory.DATASETS` that builds within 20 s:
`verifier_audit(ReasoningGymEnv(g), n=8)` (a reference answer its verifier rejects, a
wrong answer it accepts or crashes on, the largest partial credit a wrong answer gets);
one line per generator on stdout, all of it as JSON in out.json (default
rg_verifier_audit.json). `main(out, names)` audits only `names` (its toy-size test).
"""

import json
import signal
import sys
import time


def main(out: str = "rg_verifier_audit.json", names: list[str] | None = None) -> dict:
    import reasoning_gym as rg

    from ac2_jax.envs.adapters import ReasoningGymEnv, verifier_audit

    def too_slow(*_):
        raise TimeoutError("over 20 s")

    signal.signal(signal.SIGALRM, too_slow)
    found = {}
    for g in names or sorted(rg.factory.DATASETS):
        t0 = time.time()
        signal.alarm(20)
        try:
            found[g] = verifier_audit(ReasoningGymEnv(g), n=8)["domains"][g]
            found[g]["seconds"] = round(time.time() - t0, 2)
        except Exception as e:  # noqa: BLE001 - a generator that cannot build is a finding
            found[g] = {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:160]}"}
        finally:
            signal.alarm(0)
        print(g, json.dumps(found[g])[:300], flush=True)
    with open(out, "w") as f:
        json.dump(found, f, indent=1)
    return found


if __name__ == "__main__":
    main(*sys.argv[1:2])
