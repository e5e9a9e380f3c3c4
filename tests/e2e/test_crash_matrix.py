"""The crash matrix: SIGKILL at every fault point, restart, and the effects stay exactly-once.

Each case runs ``jobstream.drills.chaos.run_point`` (the logic behind ``jobstream chaos``) on
the test's
own database and topic prefix: five distinct documents of several chunks each go through the
fake provider (real HTTP on loopback); the process the point belongs to kills itself there, is
restarted without the fault, and the invariants are checked from Postgres, the topics and the
provider's per-Idempotency-Key call counts.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from jobstream.drills import chaos
from jobstream.settings import Settings

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("fault", chaos.DEFAULT_PLAN)
def test_crash_at_fault_point_keeps_effects_exactly_once(settings: Settings, tmp_path: Path,
                                                         fault: str) -> None:
    result = chaos.run_point(settings, fault, jobs=5, logdir=tmp_path / "run", timeout_s=120)
    print(result.report())
    assert result.ok, result.report(tails=True)
    # The crash had the effect the point is about (else the case proves nothing).
    effects = result.effects
    if result.owner == "relay":
        assert effects["republished"] >= 1, result.report()
    if result.owner == "consume-ready":
        assert effects["downstream_redeliveries_skipped"] >= 1, result.report()
    if fault.startswith("llm_"):
        assert effects["retaken_stages"] >= 1, result.report()
    if fault.startswith("stage_after_commit"):
        assert effects["redelivered_skips"] >= 1, result.report()
