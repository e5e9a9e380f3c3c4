#!/usr/bin/env bash
# The project's virtual environment, from the lockfile: creates or refreshes ./.venv with
# exactly the versions pinned in uv.lock (no resolution: `uv sync --frozen`), the project
# itself included (editable, inside .venv only: nothing goes into the system Python).
#
#   bash scripts/venv.sh              # runtime + test dependencies (what scripts/test.sh uses)
#   bash scripts/venv.sh --upgrade    # re-resolve every dependency to its newest allowed
#                                     # version, rewrite uv.lock, then sync (commit uv.lock)
#   bash scripts/venv.sh --uv ARGS    # run uv itself, e.g. `--uv lock` after editing
#                                     # pyproject.toml, `--uv lock --check` (what CI runs)
# Other arguments go to `uv sync` (e.g. --extra bench).
#
# uv comes from, in this order: `uv` on PATH; `python3 -m uv`; `pip install uv` into python3;
# and where the system Python refuses pip (Debian 12's "externally-managed-environment",
# PEP 668) or has none, a bootstrap venv .local/uv-bootstrap (Debian's python3-venv is
# apt-installed when missing), so a fresh Debian 12 with only its own python3 works.
set -euo pipefail
cd "$(dirname "$0")/.."

UV=()
find_uv() {
  if command -v uv >/dev/null 2>&1; then UV=(uv); return 0; fi
  if python3 -m uv --version >/dev/null 2>&1; then UV=(python3 -m uv); return 0; fi
  local boot=.local/uv-bootstrap
  if [ -x "$boot/bin/uv" ]; then UV=("$boot/bin/uv"); return 0; fi
  return 1
}

install_uv() {
  if python3 -m pip install --quiet --disable-pip-version-check 'uv>=0.5' 2>/dev/null \
      && python3 -m uv --version >/dev/null 2>&1; then
    return 0
  fi
  echo "[venv] this python3 does not take pip installs (PEP 668 or no pip): installing uv" \
       "into .local/uv-bootstrap" >&2
  local boot=.local/uv-bootstrap
  rm -rf "$boot"
  mkdir -p .local
  if ! python3 -m venv "$boot" >/dev/null 2>&1; then
    rm -rf "$boot"
    if [ "$(id -u)" -ne 0 ]; then
      echo "[venv] python3 cannot create a venv: install Debian's python3-venv (as root:" \
           "apt-get install python3-venv) or uv (https://docs.astral.sh/uv/), then retry" >&2
      exit 1
    fi
    echo "[venv] apt-get install python3-venv" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-venv \
      >/dev/null
    python3 -m venv "$boot"
  fi
  "$boot/bin/python" -m pip install --quiet --disable-pip-version-check 'uv>=0.5'
}

find_uv || { install_uv; find_uv; } || { echo "[venv] could not install uv" >&2; exit 1; }

case "${1:-}" in
  --uv)
    shift
    exec "${UV[@]}" "$@"
    ;;
  --upgrade)
    shift
    "${UV[@]}" lock --upgrade
    ;;
esac
# --inexact: an extra installed earlier (--extra bench) stays when demo.sh / test.sh sync again.
exec "${UV[@]}" sync --frozen --inexact --extra test --quiet "$@"
