"""Lease settings are validated at start: a lease must outlive three heartbeats."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from pydantic import ValidationError

from jobstream.settings import Settings


def test_the_heartbeat_defaults_to_a_quarter_of_the_lease() -> None:
    assert Settings(lease_s=10).heartbeat_s == 2.5
    assert Settings(lease_s=10, lease_heartbeat_s=3).heartbeat_s == 3


@pytest.mark.parametrize("lease_s,heartbeat_s", [(6, 2), (5, 2), (1, 1)])
def test_a_lease_of_three_heartbeats_or_less_is_refused(lease_s: float,
                                                       heartbeat_s: float) -> None:
    with pytest.raises(ValidationError, match="must exceed 3 x JOBSTREAM_LEASE_HEARTBEAT_S"):
        Settings(lease_s=lease_s, lease_heartbeat_s=heartbeat_s)


def test_every_command_refuses_to_start_with_a_clear_error() -> None:
    env = {**os.environ, "JOBSTREAM_LEASE_S": "6", "JOBSTREAM_LEASE_HEARTBEAT_S": "2"}
    got = subprocess.run([sys.executable, "-m", "jobstream.cli", "config"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert got.returncode == 1
    assert "invalid settings: " in got.stderr and "JOBSTREAM_LEASE_S=6 must exceed" in got.stderr
    assert "Traceback" not in got.stderr
