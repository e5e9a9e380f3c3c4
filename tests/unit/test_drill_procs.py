"""The one child-process runner: what environment a child gets, and that it is reaped."""

from __future__ import annotations

from pathlib import Path

import pytest

from jobstream.drills.procs import ProcessRunner, child_env
from jobstream.settings import Settings


def test_child_env_carries_settings_not_the_parents_stray_ones(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JOBSTREAM_TOPIC_PREFIX", "parent.")
    monkeypatch.setenv("DATABASE_URL", "postgresql://parent/db")
    s = Settings(database_url="postgresql://u:secret@h/child", topic_prefix="child.")
    env = child_env(s, JOBSTREAM_FAULT="x")
    assert env["JOBSTREAM_TOPIC_PREFIX"] == "child."
    assert env["JOBSTREAM_DATABASE_URL"] == "postgresql://u:secret@h/child"  # revealed
    assert "DATABASE_URL" not in env and env["JOBSTREAM_FAULT"] == "x"
    kept = child_env(keep_jobstream=True, JOBSTREAM_LEASE_S="3")
    assert kept["JOBSTREAM_TOPIC_PREFIX"] == "parent." and kept["JOBSTREAM_LEASE_S"] == "3"
    assert "JOBSTREAM_TOPIC_PREFIX" not in child_env()


def test_runner_logs_each_child_and_stops_them(tmp_path: Path) -> None:
    runner = ProcessRunner(child_env(), tmp_path)
    done = runner.start("--help", name="help")
    assert done.popen.wait(60) == 0
    assert "Usage:" in done.log_text() and done.log.name == "help-0.log"
    assert runner.dead() == [done]
    failed = runner.run("no-such-command")
    assert failed.returncode != 0 and "no-such-command" in failed.stderr
    serving = runner.start("fake-provider", "--port", "0")  # serves until SIGTERM
    assert serving.popen.poll() is None
    runner.stop_all(10)
    assert serving.popen.poll() is not None  # SIGTERM (or SIGKILL after 10 s) and reaped
