#!/usr/bin/env bash
# Creates .venv (if missing) and installs ac2_jax into it, quietly.
#   scripts/setup.sh        core + [serve,viz]: what the demo and experiments need
#   scripts/setup.sh dev    core + [dev] (serve, viz, pytest, torch CPU, transformers)
#   scripts/setup.sh core   the core only (no FastAPI, uvicorn, matplotlib)
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  "") EXTRAS="[serve,viz]" ;;
  dev) EXTRAS="[dev]" ;;
  core) EXTRAS="" ;;
  *) echo "setup.sh: unknown argument '$1' (use nothing, 'dev' or 'core')" >&2; exit 2 ;;
esac
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1

# An install already made from the same setup.py, pyproject.toml and extras is kept:
# pip's re-resolution of [dev] costs ~20 s per `scripts/test.sh` run (the inner loop).
# A change to either file (or AC2_SETUP_FORCE=1) installs again.
stamp=".venv/.ac2-setup-stamp"
want="$EXTRAS $(cat setup.py pyproject.toml | sha256sum | cut -d' ' -f1)"
if [ -z "${AC2_SETUP_FORCE:-}" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] \
  && python -c "import ac2_jax, jax, flax, optax, orbax.checkpoint" 2>/dev/null; then
  exit 0
fi

# pip -q, keeping its exit status and every message except one: a pip config
# that lists a local simple index without a folder for every package makes pip
# warn "Location '...' is ignored" once per package (the machine's config, not
# this project).
pip_install() {
  local log rc=0
  log=$(mktemp)
  python -m pip install -q "$@" >"$log" 2>&1 || rc=$?
  grep -v "^WARNING: Location '[^']*' is ignored: it is neither a file nor a directory\.$" \
    "$log" >&2 || true
  rm -f "$log"
  return "$rc"
}

pip_install --upgrade pip
pins=()
if [ "${1:-}" = "dev" ]; then
  # CPU torch pinned first, by pip (the machine's pip config points it at the CPU
  # wheel on disk), so the [dev] extra never pulls a CUDA build.
  pip_install "torch==2.13.0"
  pinfile=$(mktemp)
  trap 'rm -f "$pinfile"' EXIT
  echo "torch==2.13.0" > "$pinfile"
  pins=(--constraint "$pinfile")
fi
# The rest through uv when it installs: the same packages at the same versions as pip
# (`pip freeze` of the two venvs identical but for uv itself) in a seventh of the
# time ([dev]: 124 s -> 17 s from an empty cache; docs/notes, issue 60, sixth session).
# uv does not read pip's config, hence torch above and the constraint. pip otherwise.
if pip_install uv && python -m uv --version >/dev/null 2>&1; then
  python -m uv pip install --quiet --python "$(command -v python)" "${pins[@]}" -e ".$EXTRAS" \
    || { echo "setup.sh: uv failed (above); installing with pip" >&2; pip_install -e ".$EXTRAS"; }
else
  pip_install -e ".$EXTRAS"
fi
python -c "import ac2_jax, jax, flax, optax, orbax.checkpoint" \
  || { echo "setup.sh: install failed" >&2; exit 1; }
echo "$want" > "$stamp"
