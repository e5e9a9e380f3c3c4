"""A worker killed (SIGKILL) inside a shared stage transaction (group commit, issue 12): five
documents are submitted at once, so the one-transaction stages take several events into one
transaction; the worker kills itself at the third run inside such a transaction
(``stage_inside_one_transaction@3``: inside a shared one when the events arrived
together, which the test prints), is restarted without the fault, and the effects stay
exactly-once (``jobstream.drills.chaos.run_point``: every job succeeded once, one result
applied per job, no duplicate outbox event, no paid call twice)."""

from __future__ import annotations

from pathlib import Path

import pytest

from jobstream.drills import chaos
from jobstream.settings import Settings

pytestmark = pytest.mark.e2e


def test_a_worker_killed_inside_a_shared_stage_transaction_keeps_effects_exactly_once(
        settings: Settings, tmp_path: Path) -> None:
    result = chaos.run_point(settings, "stage_inside_one_transaction@3", jobs=5,
                             logdir=tmp_path / "run", timeout_s=120)
    print(result.report())
    assert result.ok, result.report(tails=True)
    assert result.owner == "worker"
    # Whether the third run was inside a shared transaction depends on how the events
    # arrived (timing), so it is reported, not asserted: the deterministic check of sharing
    # is tests/integration/test_stage_batch.py.
    killed = sorted((tmp_path / "run").glob("worker-*.log"),
                    key=lambda p: int(p.stem.split("-")[1]))[0]
    print("shared transactions before the kill:",
          [ln.split("[INFO] ")[-1] for ln in killed.read_text().splitlines()
           if "shared stage transaction:" in ln])
