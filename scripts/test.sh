#!/usr/bin/env bash
# The README's test command: unit, integration and e2e tests against real Kafka + Postgres,
# in the project's virtual environment (.venv, from uv.lock: scripts/venv.sh).
# Services come from KAFKA_BOOTSTRAP_SERVERS/DATABASE_URL, else testcontainers (Docker), else
# scripts/services.sh (started by the test session itself when nothing answers).
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  -h|--help)
    cat <<'EOF'
Usage: bash scripts/test.sh [pytest arguments]

Runs pytest in .venv (created from uv.lock by scripts/venv.sh) against real Kafka + PostgreSQL:
KAFKA_BOOTSTRAP_SERVERS / DATABASE_URL when set, else testcontainers when a Docker engine
answers, else the native services of scripts/services.sh (started by the test session).
Installs promtool (Debian's prometheus package) for the alert-rule tests when missing.

Without arguments: the whole suite (unit, integration, e2e) on JOBSTREAM_TEST_WORKERS pytest-xdist
workers (default 2: ~15 min on 2 cores; 0 or 1: one process, over 30 min; see docs/testing.md).
JOBSTREAM_TEST_POINTS_AT_ONCE (default 3): how many crash/pause-matrix points run at once in
threads (each its own database, topics and processes; 1 runs them in turn).
Arguments go to pytest (one process unless they say -n), e.g.
  bash scripts/test.sh tests/unit -q               # the unit tests only (~1 min)
  bash scripts/test.sh tests/e2e/test_pause.py     # one module
  bash scripts/test.sh -k exactly_once -x          # by name, stop at the first failure
  bash scripts/test.sh --help-pytest               # pytest's own options
EOF
    exit 0 ;;
  --help-pytest) set -- --help ;;
esac
bash scripts/venv.sh
# promtool (Debian's prometheus package) unit-tests the alert rules (tests/unit/test_alerts.py)
if ! command -v promtool >/dev/null 2>&1; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
    --no-install-recommends prometheus >/dev/null
fi
export VIRTUAL_ENV="$PWD/.venv" PATH="$PWD/.venv/bin:$PATH"
workers=${JOBSTREAM_TEST_WORKERS:-2}
if [ "$#" -eq 0 ] && [ "$workers" != 0 ] && [ "$workers" != 1 ]; then
  # The whole suite, tests spread over workers (every test has its own database and topic
  # prefix; the modules that share a private service stay on one worker: tests/conftest.py
  # ONE_WORKER_MODULES). The default since session 10 (docs/testing.md: 606 tests, 15 min vs
  # 30+ in one process, past the CI budget of ~30).
  set -- -n "$workers"
fi
exec .venv/bin/python -m pytest "$@"
