"""The drill harness (jobstream/drills/) stays out of the runtime: importing the worker's app,
the relay, the API, the downstream applier and the consumer library loads none of it."""

from __future__ import annotations

import json
import subprocess
import sys

RUNTIME = ("jobstream.api", "streams.app", "outbox_relay.relay", "jobstream.ready_applier",
           "consumers.idempotent", "jobstream.cli")


def test_runtime_modules_import_no_drill_module() -> None:
    code = ("import json, sys\n"
            + "".join(f"import {m}\n" for m in RUNTIME)
            + "print(json.dumps(sorted(m for m in sys.modules\n"
              "                        if m.startswith('jobstream.drills'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
