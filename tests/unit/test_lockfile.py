"""Reproducible installs: uv.lock pins what pyproject.toml asks for, and the README's commands
install from it into the project's .venv (scripts/venv.sh), never into the system Python."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_the_lockfile_matches_pyproject() -> None:
    r = subprocess.run([sys.executable, "-m", "uv", "lock", "--check"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr  # else: bash scripts/venv.sh --upgrade


def test_readme_commands_use_the_venv_from_the_lock() -> None:
    venv = (ROOT / "scripts" / "venv.sh").read_text()
    assert "sync --frozen" in venv and "lock --upgrade" in venv
    for script in ("test.sh", "demo.sh"):
        text = (ROOT / "scripts" / script).read_text()
        assert "bash scripts/venv.sh" in text and ".venv/bin/" in text, script
        assert "pip install" not in text, script
    ci = (ROOT / ".ci" / "run").read_text()
    assert "bash scripts/venv.sh" in ci and "pip install -e" not in ci
    ignored = (ROOT / ".gitignore").read_text().split()
    assert ".venv/" in ignored
    lock = (ROOT / "uv.lock").read_text()
    assert 'name = "confluent-kafka"' in lock and 'name = "faust-streaming"' in lock
