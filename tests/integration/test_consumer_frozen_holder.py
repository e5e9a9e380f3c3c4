"""flakes10: the watcher that ends a former owner's frozen session (consumers/holders.py) never
ends a live member's. Two library consumers of one group, real Kafka and Postgres: the same
event on all three partitions, so both apply it at once; whoever inserts its dedup row first
holds it for 4 s inside a running statement (``pg_sleep``: ``active``, not idle, so the idle
limit does not end it either) while the other waits on it far past ``held_s`` (1 s). The
holder is a member of the group: it must be left alone, apply the event once, and the other
see two duplicates. (The frozen, non-member case: test_break_consumer_copy_frozen.py.)
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import psycopg
import pytest
from confluent_kafka.admin import AdminClient

from consumers import create_tables
from jobstream.kafka import base_config
from jobstream.settings import Settings
from schemas.events import JobReady, encode_event
from tests.helpers import job_ready, library_consumer, produce_at, wait_for

pytestmark = pytest.mark.integration
SCHEMA = "holder_test"


def _assigned_members(settings: Settings, group: str) -> int:
    """How many members of ``group`` have partitions assigned (0 when not told in 5 s)."""
    admin = AdminClient(base_config(settings))
    try:
        desc = admin.describe_consumer_groups([group], request_timeout=5)[group].result(5)
    except Exception:  # noqa: BLE001 - not yet known: asked again
        return 0
    return sum(1 for m in desc.members if m.assignment.topic_partitions)


def test_a_live_member_holding_a_lock_past_held_s_is_never_ended(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    with psycopg.connect(settings.database_url) as conn:
        create_tables(conn, SCHEMA)
    seen: dict[str, list[Any]] = {"applied": [], "duplicate": [], "dead": []}
    consumers = [
        library_consumer(
            settings, SCHEMA, seen, transaction_idle_timeout_s=1, batch_size=1, poison_after=1
        )
        for _ in range(2)
    ]
    for consumer in consumers:

        @consumer.on(JobReady)
        def apply(tx: psycopg.Connection, event: JobReady) -> None:
            tx.execute("SELECT pg_sleep(4)")  # a live member, busy in a statement

    threads = [threading.Thread(target=c.run, daemon=True) for c in consumers]
    caplog.set_level(logging.WARNING, logger="consumers.holders")
    for t in threads:
        t.start()
    try:
        wait_for(
            lambda: _assigned_members(settings, consumers[0].group) == 2,
            60,
            "both consumers assigned partitions",
        )
        ev = job_ready("held")
        produce_at(
            settings,
            settings.topic("job.ready"),
            [(p, str(ev.job_id).encode(), encode_event(ev)) for p in range(3)],
        )
        wait_for(
            lambda: len(seen["applied"]) + len(seen["duplicate"]) >= 3,
            60,
            f"the event handled on every partition ({seen})",
        )
    finally:
        for c in consumers:
            c.stop()
        for t in threads:
            t.join(30)
    assert (seen["applied"], seen["duplicate"], seen["dead"]) == (["held"], ["held"] * 2, [])
    assert not [r for r in caplog.records if "ended Postgres session" in r.getMessage()]
