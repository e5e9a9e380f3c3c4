"""A library consumer paused (SIGSTOP) INSIDE a dead letter's transaction (main at bcda484: the
position's marker row inserted in ``processed_event``, the DLQ produce not yet acknowledged),
past its Kafka session; a second consumer of the group takes the partition over; then the first
is resumed. Real consumer processes (the DLQ sink frozen from inside the child process, the
way fault points do), shared broker and Postgres.

The next owner meets the paused one's uncommitted marker row: it must wait only until Postgres
ends the paused session (the dead letter's idle limit), then dead-letter the position itself
and go on; the resumed consumer finds its session gone and the position marked, and adds at
most the one DLQ record whose produce it was inside. Each hostile position at most twice in
the DLQ (that one), every other once; the good events applied once; lag 0.
"""

from __future__ import annotations

import collections
import os
import signal
import time
from pathlib import Path

import psycopg
import pytest

from consumers import create_tables
from jobstream.kafka import group_lag
from jobstream.producer import produce_raw
from jobstream.settings import Settings
from schemas.events import encode_event
from tests.helpers import ScriptRig, job_ready, query, read_topic, stopped, wait_for

pytestmark = pytest.mark.e2e
SCHEMA = "lib_dlpause"

#: A library consumer; ``FREEZE=1`` stops the process (SIGSTOP) at its first dead letter's
#: sink call: inside the dead letter's transaction, its marker row inserted.
CONSUMER = f"""
import os, signal, sys
import consumers.routing as routing
from consumers import ConsumerSettings, IdempotentConsumer
from schemas.events import JobReady

send, frozen = routing.DeadLetterSink.send, []
def paused_send(self, **kw):
    if os.environ.get("FREEZE") == "1" and not frozen:
        frozen.append(1)
        print("FREEZING", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    return send(self, **kw)
routing.DeadLetterSink.send = paused_send

cs = ConsumerSettings(bootstrap_servers=sys.argv[1], dsn=sys.argv[2], group=sys.argv[3],
                      db_schema="{SCHEMA}", topic_prefix=sys.argv[4],
                      transaction_idle_timeout_s=2, dlq_produce_timeout_s=0.5,
                      session_timeout_ms=6000)
consumer = IdempotentConsumer(cs)

@consumer.on(JobReady)
def apply(tx, event):
    tx.execute("INSERT INTO {SCHEMA}.applied VALUES (%s)", (event.idempotency_key,))

print("STARTED", flush=True)
consumer.run_forever()
"""
HOSTILE = [b"not json at all", b"[1,2,3]", b'{"event_type": "job.ready"}']


def test_a_consumer_paused_inside_a_dead_letter_delays_the_next_owner_only_boundedly(
        settings: Settings, tmp_path: Path) -> None:
    url, topic = settings.database_url, settings.topic("job.ready")
    with psycopg.connect(url) as conn:
        create_tables(conn, SCHEMA)
        conn.execute(f"CREATE TABLE {SCHEMA}.applied (name text NOT NULL)")  # noqa: S608
    events = [job_ready(f"dlp{i}") for i in range(6)]
    msgs: list[tuple[bytes, bytes]] = []
    for i, e in enumerate(events):
        msgs.append((b"k", HOSTILE[i] if i < len(HOSTILE) else b"null"))
        msgs.append((b"k", encode_event(e)))
    produce_raw(settings, topic, msgs)
    group = settings.group("lib-dlpause")
    rig = ScriptRig(tmp_path, CONSUMER, [settings.kafka_bootstrap_servers, url, group,
                                         settings.topic_prefix], ("paused", "next"))

    def applied() -> int:
        return int(query(url, f"SELECT count(*) AS n FROM {SCHEMA}.applied")[0]["n"])  # noqa: S608
    try:
        paused = rig.start("paused", FREEZE="1")
        wait_for(lambda: "FREEZING" in rig.log("paused"), 60, "the consumer to pause in a dead "
                 "letter's transaction", rig.all_logs)
        wait_for(lambda: stopped(paused.pid), 5, "the consumer stopped")
        try:
            rig.start("next", FREEZE="0")
            # The next owner gets the partition after the paused one's Kafka session (6 s),
            # then waits on the paused marker row until Postgres ends that session (the dead
            # letter's idle limit: 2 x (0.5 + 5) + 10 s here, see _dead_letter).
            wait_for(lambda: group_lag(settings, group, [topic]) == 0, 90,
                     "the next owner to take over and commit every offset while the first is "
                     "paused", rig.all_logs, every_s=0.5)
            assert stopped(paused.pid), "resumed early: inconclusive"
        finally:
            os.kill(paused.pid, signal.SIGCONT)
        time.sleep(3)  # the resumed consumer meets its ended session and the marked position
        assert applied() == len(events), rig.all_logs()
        dlq: collections.Counter[int] = collections.Counter(
            int(dict(m.headers() or [])["dlq_original_offset"])
            for m in read_topic(settings, topic + ".dlq"))
        twice = [o for o, n in dlq.items() if n > 1]
        assert len(dlq) == len(events) and len(twice) <= 1 and max(dlq.values()) <= 2, \
            f"DLQ records per original offset: {dict(dlq)}\n{rig.all_logs()}"
        assert all(p.poll() is None for p in rig.procs), rig.all_logs()
    finally:
        rig.close()
