"""The CLI's errors, as a user meets them: a bad setting names its environment variable,
`--help` works with a broken environment, Postgres down is one line and exit 1 (not a
traceback after a 30 s pool wait), and `--version` answers."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "jobstream.cli", *args],
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=60)


def test_a_bad_setting_names_its_variable_and_help_still_works() -> None:
    bad = _cli("config", JOBSTREAM_TOPIC_PARTITIONS="abc")
    assert bad.returncode == 1
    assert "JOBSTREAM_TOPIC_PARTITIONS='abc'" in bad.stderr and "valid integer" in bad.stderr
    helped = _cli("config", "--help", JOBSTREAM_TOPIC_PARTITIONS="abc")
    assert helped.returncode == 0 and "Usage:" in helped.stdout
    not_json = _cli("config", JOBSTREAM_API_TOKENS="not json")
    assert not_json.returncode == 1 and "JOBSTREAM_API_TOKENS is not valid JSON" in not_json.stderr
    profile = _cli("config", JOBSTREAM_MODEL_PROFILE="bogus")
    assert profile.returncode == 1 and "unknown model profile 'bogus'" in profile.stderr
    for got in (bad, not_json, profile):
        assert "Traceback" not in got.stderr


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # nothing listens once the socket is closed


@pytest.mark.parametrize("args", [("migrate",), ("jobs", "--tenant", "t"), ("sweep",),
                                  ("reconcile",),
                                  ("redrive", "00000000-0000-0000-0000-000000000000")])
def test_postgres_down_is_one_line_and_exit_1(args: tuple[str, ...]) -> None:
    url = f"postgresql://u:p@127.0.0.1:{_closed_port()}/db"
    got = _cli(*args, JOBSTREAM_DATABASE_URL=url)
    assert got.returncode == 1, got.stderr
    assert got.stderr.startswith("error: db_unavailable: ") and "Connection refused" in got.stderr
    assert "Traceback" not in got.stderr


def test_unknown_verify_check_and_version() -> None:
    got = _cli("verify", "--check", "nonesuch")
    assert got.returncode == 2 and "Error: unknown checks ['nonesuch']" in got.stderr
    version = _cli("--version")
    assert version.returncode == 0 and version.stdout.split()[-1][0].isdigit()
