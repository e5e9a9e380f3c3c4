"""The crash matrix: SIGKILL at every fault point, restart, and the effects stay exactly-once.

Each case runs ``jobstream.drills.chaos.run_point`` (the logic behind ``jobstream chaos``) on
the test's
own database and topic prefix: five distinct documents of several chunks each go through the
fake provider (real HTTP on loopback); the process the point belongs to kills itself there, is
restarted without the fault, and the invariants are checked from Postgres, the topics and the
provider's per-Idempotency-Key call counts.

A killed worker's provider slots (the shared concurrency limit, ``jobstream/limiter.py``) expire
``provider_timeout_s + provider_slot_margin_s`` seconds after they were taken, and until then the
restarted worker may find no free slot. The fake provider answers at once, so the test runs with
a 5 s provider timeout and the suite's 5 s margin: a dead worker's slots free after 10 s instead
of the default 90 s (the recovery the point proves is the same, only the wait for it is
shorter).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from jobstream.drills import chaos
from tests.helpers import run_points_concurrently

pytestmark = pytest.mark.e2e

#: Provider timeout of the matrix (seconds): bounds how long a killed worker's slots are held.
PROVIDER_TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def crash_matrix(request: pytest.FixtureRequest, isolated_settings: Any,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """The selected points of the matrix, two at a time (a point mostly waits: for the dead
    process' session timeout, its lease, its provider slots), each on its own database, topic
    prefix, fake provider and processes, exactly as one test of its own would run it:
    ``{fault: Future[PointResult]}``."""
    def run(fault: str) -> chaos.PointResult:
        logdir = tmp_path_factory.mktemp("crash-matrix") / "run"
        with isolated_settings() as s:
            s = s.model_copy(update={"provider_timeout_s": PROVIDER_TIMEOUT_S})
            return chaos.run_point(s, fault, jobs=5, logdir=logdir, timeout_s=120)
    with run_points_concurrently(
            request, "test_crash_at_fault_point_keeps_effects_exactly_once", "fault",
            run) as futs:
        yield futs


@pytest.mark.parametrize("fault", chaos.DEFAULT_PLAN)
def test_crash_at_fault_point_keeps_effects_exactly_once(crash_matrix: dict[str, Any],
                                                         fault: str) -> None:
    result = crash_matrix[fault].result(timeout=280)
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
