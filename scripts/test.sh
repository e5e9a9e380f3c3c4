#!/usr/bin/env bash
# The README's test command: unit, integration and e2e tests against real Kafka + Postgres.
# Services come from KAFKA_BOOTSTRAP_SERVERS/DATABASE_URL, else testcontainers (Docker), else
# scripts/services.sh (started by the test session itself when nothing answers).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet --disable-pip-version-check -e '.[test]'
exec python3 -m pytest "$@"
