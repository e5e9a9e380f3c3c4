#!/usr/bin/env bash
# The project's virtual environment, from the lockfile: creates or refreshes ./.venv with
# exactly the versions pinned in uv.lock (no resolution: `uv sync --frozen`), the project
# itself included (editable, inside .venv only: nothing goes into the system Python but uv).
#
#   bash scripts/venv.sh            # runtime + test dependencies (what scripts/test.sh uses)
#   bash scripts/venv.sh --upgrade  # re-resolve every dependency to its newest allowed
#                                   # version, rewrite uv.lock, then sync (commit uv.lock)
# Extra arguments go to `uv sync` (e.g. --extra bench).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! python3 -m uv --version >/dev/null 2>&1; then
  python3 -m pip install --quiet --disable-pip-version-check 'uv>=0.5'
fi
if [ "${1:-}" = "--upgrade" ]; then
  shift
  python3 -m uv lock --upgrade
fi
exec python3 -m uv sync --frozen --extra test --quiet "$@"
