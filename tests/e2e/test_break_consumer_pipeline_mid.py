"""A library consumer (``@consumer.on`` handlers only) frozen (SIGSTOP) INSIDE its batch's
handlers: while the second handler of a batch runs, after the first one's INSERT was sent.
Real consumer processes, Kafka and Postgres.

The handlers ran in a psycopg pipeline: statements sent in pipeline mode with no Sync after
them leave the backend ``active`` (ClientRead), not ``idle in transaction``, so
``TRANSACTION_IDLE_TIMEOUT_S`` never applied and the frozen consumer kept the batch's
``processed_event`` rows (and the next owner of the partitions waiting on them) for as long as
it was frozen. The next owner must apply every event while the first is frozen; the resumed
consumer re-applies nothing. (test_break_consumer_pipeline.py freezes after the handlers,
before the COMMIT.)
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import psycopg
import pytest

from consumers import create_tables
from jobstream.producer import produce_raw
from jobstream.settings import Settings
from schemas.events import encode_event
from tests.helpers import ScriptRig, job_ready, query, stopped, wait_for

pytestmark = pytest.mark.e2e
SCHEMA = "lib_pipe_mid"

#: A library consumer with a per-event handler only; ``FREEZE=1`` stops the process (SIGSTOP)
#: in its second handler call, after its INSERT (the ten events wait before it starts: one
#: batch, the first handler's INSERT sent in the same transaction).
CONSUMER = f"""
import os, signal, sys
from consumers import ConsumerSettings, IdempotentConsumer
from schemas.events import JobReady

calls = []
cs = ConsumerSettings(bootstrap_servers=sys.argv[1], dsn=sys.argv[2], group=sys.argv[3],
                      db_schema="{SCHEMA}", topic_prefix=sys.argv[4],
                      transaction_idle_timeout_s=3, session_timeout_ms=6000)
consumer = IdempotentConsumer(cs)

@consumer.on(JobReady)
def apply(tx, event):
    tx.execute("INSERT INTO {SCHEMA}.applied VALUES (%s)", (event.idempotency_key,))
    calls.append(1)
    if os.environ.get("FREEZE") == "1" and len(calls) == 2:
        print("FREEZING", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)

print("STARTED", flush=True)
consumer.run_forever()
"""


def _applied(url: str) -> dict[str, int]:
    return {r["name"]: int(r["n"]) for r in query(
        url, f"SELECT name, count(*) AS n FROM {SCHEMA}.applied GROUP BY name")}  # noqa: S608



def test_a_library_consumer_frozen_inside_a_handler_of_its_batch_does_not_hold_the_partitions(
        settings: Settings, tmp_path: Path) -> None:
    url = settings.database_url
    with psycopg.connect(url) as conn:
        create_tables(conn, SCHEMA)
        conn.execute(f"CREATE TABLE {SCHEMA}.applied (name text NOT NULL)")  # noqa: S608
    events = [job_ready(f"e{i}") for i in range(10)]
    topic = settings.topic("job.ready")
    produce_raw(settings, topic, [(b"k", encode_event(e)) for e in events])
    rig = ScriptRig(tmp_path, CONSUMER, [settings.kafka_bootstrap_servers, url,
                                         settings.group("lib-pipe-mid"), settings.topic_prefix],
                    ("frozen", "next"))
    try:
        frozen = rig.start("frozen", FREEZE="1")
        wait_for(lambda: "FREEZING" in rig.log("frozen"), 60,
                 "the consumer to freeze inside a handler of its batch",
                 rig.all_logs)
        frozen_at = time.monotonic()
        assert _applied(url) == {}
        try:
            rig.start("next", FREEZE="0")
            wait_for(lambda: len(_applied(url)) == len(events), 60,
                     "the next owner to apply every event while the first is frozen", rig.all_logs)
            assert stopped(frozen.pid), "the frozen consumer was resumed early: inconclusive"
            assert time.monotonic() - frozen_at < 60
        finally:
            os.kill(frozen.pid, signal.SIGCONT)
        time.sleep(3)  # the resumed consumer finds its session gone and re-reads its batch
        assert set(_applied(url).values()) == {1}, _applied(url)
        assert all(p.poll() is None for p in rig.procs), rig.all_logs()
    finally:
        rig.close()
