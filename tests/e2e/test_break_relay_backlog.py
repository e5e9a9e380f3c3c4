"""The relay killed (SIGKILL) while it drains a backlog, between the broker's acknowledgement
and the delete of the rows (``relay_after_produce_before_mark@3``), with a standby taking over:
nothing is lost, each key's events first reach Kafka in outbox order, and every outbox row
ends with exactly one ``outbox_published`` record (migration 0022) and no outbox row left."""

from __future__ import annotations

import pytest

from jobstream.settings import Settings
from tests.helpers import (
    ProcessRunner,
    first_deliveries,
    insert_keyed_rows,
    query,
    wait_for,
)

pytestmark = pytest.mark.e2e

KEYS = [f"job-{i}" for i in range(4)]
N = 500  # rows per key


def test_a_relay_killed_mid_backlog_hands_over_without_loss_or_reorder(
        settings: Settings, procs: ProcessRunner) -> None:
    url, topic = settings.database_url, settings.topic("job.failed")
    insert_keyed_rows(url, topic, KEYS, N)
    env = {"JOBSTREAM_RELAY_BATCH_SIZE": "100",  # a backlog of 20 batches, some in flight
           "JOBSTREAM_RELAY_MAX_IN_FLIGHT": "200"}
    first = procs.start("relay", name="relay-killed",
                        JOBSTREAM_FAULT="relay_after_produce_before_mark@3", **env)
    wait_for(lambda: first.popen.poll() is not None, 60, "the relay to kill itself mid-backlog",
             procs.logs)
    left = int(query(url, "SELECT count(*) AS n FROM outbox")[0]["n"])
    assert 0 < left < N * len(KEYS), left  # killed mid-backlog, rows produced and not deleted
    procs.start("relay", name="relay-standby", **env)
    wait_for(lambda: not query(url, "SELECT 1 FROM outbox"), 60, "the standby to drain",
             procs.logs)
    firsts = first_deliveries(settings, topic)
    assert {k: firsts.get(k) for k in KEYS} == {k: list(range(N)) for k in KEYS}
    rec = query(url, "SELECT count(*) AS n, count(DISTINCT id) AS d FROM outbox_published")[0]
    assert rec["n"] == rec["d"] == N * len(KEYS), rec
