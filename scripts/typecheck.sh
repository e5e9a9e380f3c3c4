#!/usr/bin/env bash
# Type checks (run by .ci/run, and by hand before a commit):
#  1. mypy with the configuration in pyproject.toml ([tool.mypy]): strict on the library
#     packages consumers/, schemas/, streams/; the default checks on jobstream/ and outbox_relay/.
#  2. every `# type: ignore` in those packages names its error code and says why on its line:
#     `x = f()  # type: ignore[code]  # the reason`.
# Uses .venv's mypy when there is one (bash scripts/venv.sh), else python3 -m mypy.
set -euo pipefail
cd "$(dirname "$0")/.."
py=python3
[ -x .venv/bin/python ] && py=.venv/bin/python
"$py" -m mypy
unexplained=$(grep -rnE --include='*.py' '#[[:space:]]*type:[[:space:]]*ignore' \
                consumers schemas streams jobstream outbox_relay \
              | grep -vE '# type: ignore\[[a-z0-9_, -]+\]  # [^ ]' || true)
if [ -n "$unexplained" ]; then
  printf 'a "# type: ignore" without an error code and a reason on its line:\n%s\n' \
    "$unexplained" >&2
  exit 1
fi
echo "type: ignore comments: each has a code and a reason"
