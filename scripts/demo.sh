#!/usr/bin/env bash
# The README's main command: create the project's virtual environment from uv.lock (.venv,
# scripts/venv.sh), start local Kafka + Postgres (reusing what already answers), and run
# `jobstream demo` on /usr/share/common-licenses (+ PDFs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/venv.sh
bash scripts/services.sh up
exec .venv/bin/jobstream demo "$@"
