"""One headless task per production agent CLI, each with its default settings, against
a running `python -m ac2_jax.serving` (issue 67).

    python -m ac2_jax.serving --model=tiny --port=8000 --admin_key=sk-admin --max_tokens=16 &
    python -m experiments.agent_clis --url=http://127.0.0.1:8000 --admin_key=sk-admin \\
        --bin=~/.cache/ac2_jax/cli-agents/node_modules/.bin

For each CLI (the `cli_presets` preset: only base URL, key, model and telemetry/update
switches set) it creates a rollout (with the preset's agent_rules), runs the program in
a scratch directory under a timeout, ends the rollout and prints one JSON line: exit
code, wall time, the request APIs it used, episodes by agent label, prompt tokens of
each request, counters (built-in tools left out) and the last of its output. The model
is whatever the endpoint serves (tiny: a random policy, so the CLIs see noise; what is
measured is that every request is taken and recorded).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile

import httpx

from ac2_jax.orchestration.cli_agent import Launch, run_cli
from ac2_jax.orchestration.cli_presets import claude_code, codex, gemini_cli, opencode, qwen_code

PRESETS = {
    "claude": claude_code,
    "codex": codex,
    "gemini": gemini_cli,
    "qwen": qwen_code,
    "opencode": opencode,
}


async def one(name: str, args) -> dict:
    agent = PRESETS[name](os.path.join(os.path.expanduser(args.bin), name))
    admin = {"Authorization": f"Bearer {args.admin_key}"}
    async with httpx.AsyncClient(base_url=args.url, headers=admin, timeout=60) as http:
        body = {"task_id": f"smoke-{name}", "agent_rules": list(agent.agent_rules) or None}
        info = (await http.post("/v1/rollouts", json=body)).json()
        workdir = tempfile.mkdtemp(prefix=f"ac2-{name}-")
        home = os.path.join(workdir, ".home")
        os.makedirs(home)
        launch = Launch(
            args.prompt, info["model"], info["base_url"], info["api_key"], workdir, home
        )
        try:
            result = await run_cli(agent, launch, args.timeout_s)
            exit_code, wall, tail = result.exit_code, result.wall_s, result.stdout + result.stderr
        except TimeoutError as e:
            exit_code, wall, tail = None, args.timeout_s, str(e)
        rid = info["rollout_id"]
        await http.post(f"/v1/rollouts/{rid}/finish", json={"reward": 0.0})
        trace = (await http.get(f"/v1/rollouts/{rid}/trace")).json()
        status = (await http.get(f"/v1/rollouts/{rid}")).json()
    episodes = [
        {"agent": e["agent"], "prompts": [len(c["prompt_ids"]) for c in e["completions"]]}
        for e in trace["episodes"]
    ]
    return {
        "cli": name,
        "exit_code": exit_code,
        "wall_s": round(wall, 1),
        "episodes": episodes,
        "builtin_tools_omitted": status.get("builtin_tools_omitted"),
        "omitted_tools": trace["metadata"].get("omitted_tools"),
        "tail": tail[-300:],
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--admin_key", required=True)
    p.add_argument("--bin", required=True, help="node_modules/.bin holding the CLIs")
    p.add_argument("--cli", default=",".join(PRESETS), help="comma-separated: " + ",".join(PRESETS))
    p.add_argument("--prompt", default="Say hello in one word.")
    p.add_argument("--timeout_s", type=float, default=600.0)
    args = p.parse_args()
    for name in args.cli.split(","):
        print(json.dumps(asyncio.run(one(name, args))), flush=True)


if __name__ == "__main__":
    main()
