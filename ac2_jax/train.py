"""The launcher: one command trains any model on any environment.

    python -m ac2_jax.train --recipe=rl --env=my_pkg.envs:MyEnv --model=path/to/hf_model \
        --config=my_config.py:variant --config.rl.optimizer.learning_rate=5e-4 \
        --workdir=runs/mine

--recipe: rl, sft, distill, or eval (no training: the model's held-out pass rate
with its 95% CI; `ac2_jax.recipes`). --env: an import path
"pkg.module:Factory" (the current folder is importable). --model: an HF
directory or a preset ("tiny"). --config: a Python file whose
`get_config(variant=None)` returns a dict of the fields it sets (optional).
Any `--config.FIELD=VALUE` sets one field of the recipe's config, listed in
the file or not (`--config.help` lists them all). --workdir is
`--config.paths.workdir`; --tool_parser is `--config.tool_parser` (the model's
tool-call format; by default its chat template's, else its family's). A workdir
that holds a run of the recipe is refused unless `--resume` (continue from its
checkpoint; its saved config is compared first, and another model or full <->
LoRA is refused before anything is written) or `--overwrite` (its files are deleted first) is given
(`--config.paths.existing`). A mistake in any of these is one line on stderr
(exit status 2); the resolved config is written to the run's report folder.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

USAGE = (
    "usage: python -m ac2_jax.train --recipe={rl,sft,distill,eval} --env=pkg.module:Factory "
    "--model=DIR|tiny [--config=FILE.py[:variant]] [--config.FIELD=VALUE ...] [--workdir=DIR] "
    "[--tool_parser=NAME] [--resume | --overwrite]"
)
_FLAGS = ("recipe", "env", "model", "config", "workdir", "tool_parser")
# A workdir that holds a run of the recipe: continue it, or delete it and start afresh
# (neither: refused, naming both).
_SWITCHES = ("resume", "overwrite")


class UsageError(ValueError):
    """A launcher argument that is missing or unknown."""


def parse_args(argv: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """(flags, config overrides) of a command line (`--name=value` or `--name value`)."""
    flags: dict[str, str] = {}
    overrides: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if not arg.startswith("--"):
            raise UsageError(f"unexpected argument {arg!r}; {USAGE}")
        name, eq, value = arg[2:].partition("=")
        if name.startswith("config."):
            if not eq:
                if i >= len(args):
                    raise UsageError(f"--{name} needs a value (--{name}=VALUE)")
                value, i = args[i], i + 1
            overrides.append(f"{name.removeprefix('config.')}={value}")
            continue
        if name in ("help", "h"):
            flags["help"] = "1"
            continue
        if name in _SWITCHES:
            if eq:
                raise UsageError(f"--{name} takes no value")
            flags[name] = "1"
            continue
        if name not in _FLAGS:
            import difflib

            close = difflib.get_close_matches(name, (*_FLAGS, *_SWITCHES), n=1)
            hint = f"; did you mean --{close[0]}?" if close else ""
            raise UsageError(f"unknown flag --{name}{hint} ({USAGE})")
        if not eq:
            if i >= len(args):
                raise UsageError(f"--{name} needs a value")
            value, i = args[i], i + 1
        flags[name] = value
    return flags, overrides


def quiet_libraries() -> None:
    """Known library noise, silenced at the source: absl/Orbax INFO lines (one per
    checkpoint), JAX's probe of absent TPU/GPU backends, httpx's line per request."""
    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.WARNING)
    for name in ("jax._src.xla_bridge", "httpx", "orbax", "absl"):
        logging.getLogger(name).setLevel(logging.ERROR if "jax" in name else logging.WARNING)


def build(argv: Sequence[str]):
    """(entry point, model, env, typed config) for a command line; raises one-line errors."""
    from ac2_jax.config_cli import load_config
    from ac2_jax.recipes import RECIPES

    flags, overrides = parse_args(argv)
    recipe = flags.get("recipe")
    if recipe is None:
        raise UsageError(f"--recipe is required; {USAGE}")
    try:
        cls, entry = RECIPES.get(recipe)
    except ValueError as e:  # did-you-mean
        raise UsageError(f"--recipe: {e}") from None
    if "help" in flags or overrides == ["help="]:
        from ac2_jax.config_cli import help_lines

        lines = help_lines(cls)  # one per field: type, default, meaning
        raise SystemExit(f"{USAGE}\nfields of {cls.__name__}:\n" + "\n".join(lines))
    if "workdir" in flags:
        overrides = [f"paths.workdir={flags['workdir']}", *overrides]
    if "tool_parser" in flags:
        overrides = [f"tool_parser={flags['tool_parser']}", *overrides]
    if "resume" in flags and "overwrite" in flags:
        raise UsageError("--resume or --overwrite, not both")
    for switch in _SWITCHES:
        if switch in flags:
            overrides = [f"paths.existing={switch}", *overrides]
    config = load_config(cls, flags.get("config"), overrides)
    if "model" not in flags:
        raise UsageError("--model is required: an HF directory or a preset ('tiny')")
    env = flags.get("env")
    if env is None and not (recipe == "sft" and config.demos.file):
        raise UsageError("--env is required: an import path 'pkg.module:Factory'")
    return entry, flags["model"], env, config


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the launcher; returns the exit status (2 on a bad argument)."""
    from ac2_jax.config import ConfigError
    from ac2_jax.envs.contract import EnvError

    argv = sys.argv[1:] if argv is None else argv
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # --env=pkg.module:Factory from the current folder
    quiet_libraries()
    try:
        entry, model, env, config = build(argv)
        if env is not None:
            from ac2_jax.envs.contract import load_env

            env = load_env(env)
        entry(model, env, config)
    except (UsageError, ConfigError, EnvError, ImportError) as e:
        message = " ".join(str(e).split("\n")[0].split())
        print(f"ac2_jax.train: error: {message}", file=sys.stderr)
        return 2
    except ValueError as e:
        if "--model" not in str(e):
            raise
        print(f"ac2_jax.train: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
