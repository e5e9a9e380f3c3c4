"""A standby relay says it is standing by once, not every 2 s, and reports ready."""

from __future__ import annotations

import time

from tests.helpers import ProcessRunner, wait_for


def test_standby_relay_logs_once(procs: ProcessRunner) -> None:
    active = procs.start("relay", name="relay-a")
    wait_for(lambda: "relay active" in active.log_text(), 60, "the first relay to be active",
             procs.logs)
    standby = procs.start("relay", name="relay-b")
    wait_for(lambda: "standing by" in standby.log_text(), 60, "the second relay to stand by",
             procs.logs)
    time.sleep(7)  # three more lock attempts
    assert standby.log_text().count("standing by") == 1, standby.log_text()
    assert "relay active" not in standby.log_text()
