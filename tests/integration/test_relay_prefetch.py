"""A backlog drained with the next batch read ahead (``relay_prefetch``, outbox_relay/relay.py
``Prefetcher``) keeps the relay's guarantees: every row reaches Kafka exactly once (none
re-sent while its first copy is in flight or being deleted, none skipped), per-key order
holds, and a transaction that took its id before the backlog and commits in the middle of the
drain is still published. A real relay process, Postgres and broker; small batches so the
drain runs through many prefetched batches and looks from the floor."""

from __future__ import annotations

import uuid
from collections import Counter, defaultdict

import psycopg
import pytest
from psycopg.types.json import Jsonb

from jobstream.db import QUERIES as Q
from jobstream.settings import Settings
from tests.helpers import ProcessRunner, query, read_topic, wait_for

pytestmark = pytest.mark.integration

ROWS, KEYS = 4000, 7


def _row(topic: str, key: str, seq: int) -> tuple[object, ...]:
    return (topic, key, b'{"seq": %d}' % seq, Jsonb({"key": key}), uuid.uuid4(), "test.row")


def test_a_drain_read_ahead_publishes_each_row_once_in_key_order(
        settings: Settings, procs: ProcessRunner) -> None:
    topic = settings.topic("job.failed")
    url = settings.database_url
    late = psycopg.connect(url)  # takes its id before the backlog, commits mid-drain
    try:
        late.execute(Q["outbox_insert"], _row(topic, "late", 0))
        with psycopg.connect(url) as conn, conn.transaction(), conn.cursor() as cur:
            cur.executemany(Q["outbox_insert"],
                            [_row(topic, f"k{i % KEYS}", i) for i in range(ROWS)])
        relay = procs.start("relay", JOBSTREAM_RELAY_BATCH_SIZE="40",
                            JOBSTREAM_RELAY_MAX_IN_FLIGHT="200",
                            JOBSTREAM_RELAY_RESCAN_S="0.2", JOBSTREAM_RELAY_LATE_COMMIT_S="1",
                            JOBSTREAM_RELAY_PREFETCH="true")
        wait_for(lambda: query(url, "SELECT count(*) AS n FROM outbox_published")[0]["n"]
                 >= 200, 60, "the drain under way", procs.logs)
        late.commit()
    finally:
        late.close()
    wait_for(lambda: not query(url, "SELECT 1 FROM outbox WHERE published_at IS NULL"), 90,
             "the backlog and the late row published", procs.logs)
    msgs = read_topic(settings, topic)
    keys = Counter(m.key().decode() for m in msgs)
    expected = Counter(f"k{i % KEYS}" for i in range(ROWS))
    expected["late"] = 1
    assert keys == expected, (keys - expected, expected - keys)
    seqs: dict[str, list[int]] = defaultdict(list)
    for m in sorted(msgs, key=lambda m: (m.partition(), m.offset())):
        seqs[m.key().decode()].append(int(m.value().split(b":")[1].strip(b" }")))
    for key, got in seqs.items():
        assert got == sorted(got), f"{key}: out of order {got[:20]}"
    assert relay.popen.poll() is None and "Traceback" not in relay.log_text()
