"""A worker frozen (SIGSTOP) inside a shared stage transaction (group commit, issue 12) past
its lease, while a second worker and the sweeper take its jobs over, then resumed
(``jobstream.drills.chaos.run_point`` in ``pause`` mode at ``stage_inside_one_transaction@3``):
every job succeeds once, one result applied per job, no duplicate outbox event, nothing left
``started``. The kill variant is tests/e2e/test_group_commit_crash.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from jobstream.drills import chaos
from jobstream.settings import Settings

pytestmark = pytest.mark.e2e


def test_a_worker_frozen_inside_a_shared_stage_transaction_keeps_effects_exactly_once(
        settings: Settings, tmp_path: Path) -> None:
    result = chaos.run_point(settings, "stage_inside_one_transaction@3", jobs=5,
                             logdir=tmp_path / "run", timeout_s=150, mode="pause")
    print(result.report())
    assert result.ok, result.report(tails=True)
    frozen = sorted((tmp_path / "run").glob("worker-*.log"),
                    key=lambda p: int(p.stem.split("-")[1]))[0]
    print("shared transactions before the freeze:",
          [ln.split("[INFO] ")[-1] for ln in frozen.read_text().splitlines()
           if "shared stage transaction:" in ln])
