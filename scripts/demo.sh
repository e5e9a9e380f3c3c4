#!/usr/bin/env bash
# The README's main command: create the project's virtual environment from uv.lock (.venv,
# scripts/venv.sh), start local Kafka + Postgres (reusing what already answers), and run
# `jobstream demo` on /usr/share/common-licenses (+ PDFs).
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in -h|--help)
  cat <<'EOF'
Usage: bash scripts/demo.sh [jobstream demo options]

Creates .venv from uv.lock (scripts/venv.sh), starts local Kafka + PostgreSQL under ./.local
(reusing services that already answer, or KAFKA_BOOTSTRAP_SERVERS / DATABASE_URL), then runs
`jobstream demo`: 17 licence texts + 3 PDFs through every stage, and checks that every
job.ready was applied exactly once (exit 0 only then). Takes ~20 s once installed.

Options of `jobstream demo`:
  --tenant TEXT      tenant id of this run (default: a fresh demo-<id>)
  --timeout FLOAT    give up after this many seconds (default 600)
  --no-services      do not start local Kafka/Postgres; use the configured ones
Stop the services afterwards: bash scripts/services.sh down
EOF
  exit 0 ;;
esac
bash scripts/venv.sh
bash scripts/services.sh up
exec .venv/bin/jobstream demo "$@"
