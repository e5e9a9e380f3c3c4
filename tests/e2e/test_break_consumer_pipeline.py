"""Breaking the consumer library's per-event path (``@consumer.on`` handlers only, as in the
README's first example; the batch's handlers ran in a psycopg pipeline until breaker7) with
real consumer processes, Kafka and Postgres: a consumer frozen (SIGSTOP) in its first batch
transaction must not hold the partitions' ``processed_event`` rows for as long as it is frozen.

Two points:
- ``after_handlers``: after its handlers ran, before its COMMIT. ``TRANSACTION_IDLE_TIMEOUT_S``
  is meant to end that session so the next owner does not wait on those rows; but Postgres
  arms the idle timeout only after a statement run outside a pipeline, and the last statements
  ran in one: the next owner waited for as long as the first was frozen.
- ``inside_handler``: inside the second handler call, after its INSERT was sent. Statements
  sent in pipeline mode with no Sync after them leave the backend ``active`` (ClientRead), not
  ``idle in transaction``, so the idle timeout never applied either.

Since breaker7 the handlers run without a pipeline. At both points the next owner applies every
event while the first is frozen, and the resumed consumer re-applies nothing.
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
SCHEMA = "lib_pipe"

#: A library consumer with a per-event handler only; ``FREEZE`` names where the process stops
#: itself (SIGSTOP) in its first batch transaction: ``after_handlers`` (the in_transaction
#: hook) or ``inside_handler`` (the second handler call, after its INSERT; the ten events wait
#: before it starts: one batch). Anything else: it never freezes.
CONSUMER = f"""
import os, signal, sys
from consumers import ConsumerSettings, IdempotentConsumer
from consumers.idempotent import Hooks
from schemas.events import JobReady

point = os.environ.get("FREEZE")
frozen, calls = [], []
def freeze():
    if not frozen:
        frozen.append(1)
        print("FREEZING", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)

cs = ConsumerSettings(bootstrap_servers=sys.argv[1], dsn=sys.argv[2], group=sys.argv[3],
                      db_schema="{SCHEMA}", topic_prefix=sys.argv[4],
                      transaction_idle_timeout_s=3, session_timeout_ms=6000)
hooks = Hooks(in_transaction=freeze) if point == "after_handlers" else Hooks()
consumer = IdempotentConsumer(cs, hooks=hooks)

@consumer.on(JobReady)
def apply(tx, event):
    tx.execute("INSERT INTO {SCHEMA}.applied VALUES (%s)", (event.idempotency_key,))
    calls.append(1)
    if point == "inside_handler" and len(calls) == 2:
        freeze()

print("STARTED", flush=True)
consumer.run_forever()
"""


def _applied(url: str) -> dict[str, int]:
    return {r["name"]: int(r["n"]) for r in query(
        url, f"SELECT name, count(*) AS n FROM {SCHEMA}.applied GROUP BY name")}  # noqa: S608


@pytest.mark.parametrize("point", ["after_handlers", "inside_handler"])
def test_a_library_consumer_frozen_in_its_batch_does_not_hold_the_partitions(
        settings: Settings, tmp_path: Path, point: str) -> None:
    url = settings.database_url
    with psycopg.connect(url) as conn:
        create_tables(conn, SCHEMA)
        conn.execute(f"CREATE TABLE {SCHEMA}.applied (name text NOT NULL)")  # noqa: S608
    events = [job_ready(f"e{i}") for i in range(10)]
    topic = settings.topic("job.ready")
    produce_raw(settings, topic, [(b"k", encode_event(e)) for e in events])
    rig = ScriptRig(tmp_path, CONSUMER, [settings.kafka_bootstrap_servers, url,
                                         settings.group("lib-pipe"), settings.topic_prefix],
                    ("frozen", "next"))
    try:
        frozen = rig.start("frozen", FREEZE=point)
        wait_for(lambda: "FREEZING" in rig.log("frozen"), 60,
                 f"the consumer to freeze in its batch ({point})", rig.all_logs)
        frozen_at = time.monotonic()
        assert _applied(url) == {}
        try:
            rig.start("next", FREEZE="never")
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
