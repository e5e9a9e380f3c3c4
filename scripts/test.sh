#!/usr/bin/env bash
# The README's test command: unit, integration and e2e tests against real Kafka + Postgres,
# in the project's virtual environment (.venv, from uv.lock: scripts/venv.sh).
# Services come from KAFKA_BOOTSTRAP_SERVERS/DATABASE_URL, else testcontainers (Docker), else
# scripts/services.sh (started by the test session itself when nothing answers).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/venv.sh
# promtool (Debian's prometheus package) unit-tests the alert rules (tests/unit/test_alerts.py)
if ! command -v promtool >/dev/null 2>&1; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
    --no-install-recommends prometheus >/dev/null
fi
export VIRTUAL_ENV="$PWD/.venv" PATH="$PWD/.venv/bin:$PATH"
exec .venv/bin/python -m pytest "$@"
