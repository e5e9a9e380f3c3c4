#!/usr/bin/env bash
# The README's main command: install the project, start local Kafka + Postgres (reusing what
# already answers), and run `jobstream demo` on /usr/share/common-licenses (+ PDFs).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet --disable-pip-version-check -e .
bash scripts/services.sh up
exec jobstream demo "$@"
