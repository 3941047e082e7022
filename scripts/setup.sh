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
# Everything through uv when it installs: the same packages at the same versions as
# pip (`pip freeze` of the two venvs identical but for uv itself), faster (from empty
# caches: the [dev] step 124.5 s -> 17.2 s quiet, the whole script 36 s; 2.6-2.7x side
# by side at load 6-12; docs/notes/2026-12-07-install-with-uv.md). pip where uv cannot install
# or fails.
uv=()
if pip_install uv && python -m uv --version >/dev/null 2>&1; then
  uv=(python -m uv pip install --quiet --python "$(command -v python)")
fi
reqs=()
if [ "${1:-}" = "dev" ]; then
  # The CPU build of torch, pinned so the [dev] extra never pulls a CUDA build. uv reads
  # no pip config: it is given the machine's wheel folder (PIP_FIND_LINKS) when that
  # holds the CPU wheel; otherwise pip installs torch first (its config knows where).
  torch_version=2.13.0
  links=()
  for d in ${PIP_FIND_LINKS:-}; do
    if compgen -G "$d/torch-$torch_version+cpu-*.whl" >/dev/null; then
      links+=(--find-links "$d")
    fi
  done
  reqs=("torch==$torch_version")
  if [ ${#uv[@]} -gt 0 ] && [ ${#links[@]} -gt 0 ]; then
    uv+=("${links[@]}")
  else
    pip_install "${reqs[@]}"
  fi
fi
if [ ${#uv[@]} -gt 0 ]; then
  "${uv[@]}" "${reqs[@]}" -e ".$EXTRAS" \
    || { echo "setup.sh: uv failed (above); installing with pip" >&2
         pip_install "${reqs[@]}" -e ".$EXTRAS"; }
else
  pip_install "${reqs[@]}" -e ".$EXTRAS"
fi
python -c "import ac2_jax, jax, flax, optax, orbax.checkpoint" \
  || { echo "setup.sh: install failed" >&2; exit 1; }
echo "$want" > "$stamp"
