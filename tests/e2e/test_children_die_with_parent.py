"""Children of the harness die with their parent: a pytest or drill killed with ``kill -9``
leaks no relay, worker or probe script (``PR_SET_PDEATHSIG``,
:func:`jobstream.drills.procs.die_with_parent`), a SIGSTOPped child included.

A real parent process starts one child through the drills' runner
(:class:`jobstream.drills.procs.ProcessRunner`: ``jobstream fake-provider``, which needs no
services) and one through the tests' :class:`tests.helpers.ScriptRig`, SIGSTOPs the first, and
is then killed with SIGKILL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import free_port, wait_for

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]

PARENT = """
import os, signal, sys, time
from pathlib import Path
from jobstream.drills.procs import ProcessRunner, child_env
from tests.helpers import ScriptRig

logdir = Path(sys.argv[1])
runner = ProcessRunner(child_env(), logdir / "runner")
provider = runner.start("fake-provider", "--port", sys.argv[2])
(logdir / "rig").mkdir()
rig = ScriptRig(logdir / "rig", "import time\\nwhile True:\\n    time.sleep(1)\\n", [],
                ("sleeper",))
sleeper = rig.start("sleeper")
os.kill(provider.popen.pid, signal.SIGSTOP)
print(provider.popen.pid, sleeper.pid, flush=True)
time.sleep(3600)
"""


def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (a dead child not yet reaped by init)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_children_die_when_their_parent_is_killed_9(tmp_path: Path) -> None:
    """Both children (one SIGSTOPped) are gone once their parent was SIGKILLed; without
    ``die_with_parent`` they are reparented to init and run on."""
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    parent = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path), str(free_port())],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        text=True,
    )
    children: list[int] = []
    try:
        assert parent.stdout is not None
        line = parent.stdout.readline()
        assert line, f"the parent printed no pids (rc={parent.wait(10)})"
        children = [int(pid) for pid in line.split()]
        assert all(_alive(pid) for pid in children)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        wait_for(
            lambda: not any(_alive(pid) for pid in children),
            30,
            "every child to die with its parent (kill -9)",
            lambda: f"alive: {[pid for pid in children if _alive(pid)]}",
        )
    finally:  # without the fix they outlive the test: end them here
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)
        if parent.stdout is not None:
            parent.stdout.close()
        for pid in children:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
