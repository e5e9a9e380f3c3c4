"""Breaking the ready applier's binary COPY batch path (``ready_applier.copy_rows`` /
``apply_ready_rows`` through ``IdempotentConsumer.on_batch(prepare=)``) from outside, with real
``consume-ready`` processes, Postgres and the broker.

- kill -9 between the COPY and the commit: the batch's ``processed_event`` rows and both COPYs
  are written, the transaction is not committed (with ``apply_lanes`` 2 the other lane's
  part of the batch may be committed or not). The restarted consumer must apply every
  event exactly once (duplicates in the batch included: the same message twice, and the same
  dedup key under a new event id).
- hostile numbers in a batch: a ``charge_usd`` the schema accepts but ``copy_rows`` cannot
  encode (``1e400`` parses as an infinite float) or Postgres cannot store (``1e308``), between
  good events. The batch must split, the good events be applied exactly once and the bad ones
  dead-lettered as ``invalid_data`` (never retried forever, never ``handler_error``).
"""

from __future__ import annotations

import json
import os
import signal
import time
import uuid

import pytest

from jobstream.kafka import group_lag
from jobstream.producer import produce_raw
from jobstream.settings import Settings
from schemas.events import JobReady, encode_event
from tests.helpers import ProcessRunner, job_ready, query, read_topic, wait_for

pytestmark = pytest.mark.e2e


def _raw(e: JobReady) -> tuple[bytes, bytes]:
    return str(e.job_id).encode(), encode_event(e)


def _applied(settings: Settings) -> dict[str, tuple[int, int]]:
    """dedup_key -> (analyses, charges)."""
    rows = query(settings.database_url,
                 "SELECT a.dedup_key, count(*) AS n, (SELECT count(*) FROM "
                 "downstream.ledger_charge c WHERE c.dedup_key = a.dedup_key) AS charges "
                 "FROM downstream.document_analysis a GROUP BY a.dedup_key")
    return {r["dedup_key"]: (int(r["n"]), int(r["charges"])) for r in rows}


def _lag_zero(settings: Settings) -> bool:
    group = settings.group("downstream-ready-applier")
    return group_lag(settings, group, [settings.topic("job.ready")]) == 0


def test_a_consumer_killed_between_copy_and_commit_applies_each_event_once(
        settings: Settings, procs: ProcessRunner) -> None:
    events = [job_ready(f"k{i}", charge_usd=0.25) for i in range(24)]
    again = events[3].model_copy(update={"event_id": uuid.uuid4()})
    msgs = [_raw(e) for e in events] + [_raw(events[0]), _raw(again), _raw(events[10])]
    produce_raw(settings, settings.topic("job.ready"), msgs)
    # Apply lanes even for this small batch: the kill lands while two parts are applied.
    lanes = {"JOBSTREAM_CONSUMER_APPLY_LANES_MIN_BATCH": "2"}
    killed = procs.start("consume-ready", name="consumer-killed",
                         JOBSTREAM_FAULT="consumer_inside_transaction", **lanes)
    wait_for(lambda: killed.popen.poll() is not None, 60,
             "the consumer to SIGKILL itself inside its COPY transaction", procs.logs)
    assert killed.popen.returncode == -9, procs.logs()
    assert "SIGKILL" in killed.log_text()
    # The killed transaction committed nothing. With apply lanes a batch of the three
    # partitions is applied as two transactions at once: the other one may have committed
    # before the kill (its offsets not stored: it comes back as duplicates), never all 24.
    partial = _applied(settings)
    assert len(partial) < 24 and set(partial.values()) <= {(1, 1)}, partial
    procs.start("consume-ready", name="consumer-next", **lanes)
    wait_for(lambda: len(_applied(settings)) == 24 and _lag_zero(settings), 60,
             "every event applied and every offset committed after the restart", procs.logs)
    assert set(_applied(settings).values()) == {(1, 1)}, _applied(settings)
    n = query(settings.database_url, "SELECT count(*) AS n FROM processed_event")[0]["n"]
    assert n == 24
    charged = query(settings.database_url,
                    "SELECT sum(amount_usd)::float8 AS s FROM downstream.ledger_charge")
    assert charged[0]["s"] == pytest.approx(24 * 0.25)
    assert read_topic(settings, settings.topic("job.ready.dlq")) == []


def _with_charge(e: JobReady, literal: str) -> bytes:
    """``e`` encoded with ``charge_usd`` replaced by the JSON number ``literal``."""
    doc = json.loads(encode_event(e))
    doc["payload"]["charge_usd"] = "@@"
    return json.dumps(doc).replace('"@@"', literal).encode()


def test_unrepresentable_charges_in_a_copy_batch_are_dead_lettered_and_the_rest_applied_once(
        settings: Settings, procs: ProcessRunner) -> None:
    """Charges no numeric(14, 8) column holds (1e400 parses as infinity; 1e308) among good
    events of one batch: the schema refuses them (money is finite and below 10^6 USD), each
    is dead-lettered with its reason and every good neighbour is applied once."""
    good = [job_ready(f"g{i}", charge_usd=0.5) for i in range(20)]
    bad = {"infinite": job_ready("infinite"), "overflow": job_ready("overflow")}
    msgs = [_raw(e) for e in good[:7]]
    msgs.append((str(bad["infinite"].job_id).encode(), _with_charge(bad["infinite"], "1e400")))
    msgs += [_raw(e) for e in good[7:14]]
    msgs.append((str(bad["overflow"].job_id).encode(), _with_charge(bad["overflow"], "1e308")))
    msgs += [_raw(e) for e in good[14:]] + [_raw(good[2])]
    produce_raw(settings, settings.topic("job.ready"), msgs)
    procs.start("consume-ready", JOBSTREAM_CONSUMER_POISON_AFTER="2")
    wait_for(lambda: len(_applied(settings)) == 20 and _lag_zero(settings), 60,
             "the good events applied and every offset committed", procs.logs)
    applied = _applied(settings)
    assert set(applied) == {e.dedup_key for e in good}, applied
    assert set(applied.values()) == {(1, 1)}, applied
    dlq = read_topic(settings, settings.topic("job.ready.dlq"))
    reasons = {dict(m.headers())["dlq_reason_code"].decode() for m in dlq}
    assert len(dlq) == 2 and reasons == {"schema_violation"}, [m.headers() for m in dlq]
    assert all(b"charge_usd" in dict(m.headers())["dlq_reason"] for m in dlq), [
        m.headers() for m in dlq]
    assert "Traceback" not in "".join(p.log_text() for p in procs.procs), procs.logs()


def _members_with_partitions(settings: Settings) -> int:
    """Members of the ready applier's group that hold partitions (describe_consumer_groups)."""
    from confluent_kafka.admin import AdminClient

    from jobstream.kafka import base_config
    group = settings.group("downstream-ready-applier")
    admin = AdminClient(base_config(settings))  # referenced until the answer came
    (fut,) = admin.describe_consumer_groups([group], request_timeout=5).values()
    return sum(1 for m in fut.result(10).members
               if m.assignment and m.assignment.topic_partitions)


def test_copies_on_different_partitions_applied_by_two_consumers_at_once_apply_once(
        settings: Settings, procs: ProcessRunner) -> None:
    """Duplicate delivery across partitions (each event produced twice under random Kafka
    keys): two ``consume-ready`` processes apply overlapping COPY batches at the same time;
    their ``processed_event`` inserts (sorted by key digest) decide, each event applies once."""
    events = [job_ready(f"d{i}", charge_usd=0.5) for i in range(60)]
    a = procs.start("consume-ready", name="consumer-a")
    b = procs.start("consume-ready", name="consumer-b")
    wait_for(lambda: _members_with_partitions(settings) == 2, 60,
             "both consumers assigned partitions", procs.logs, every_s=0.5)
    msgs = [(uuid.uuid4().bytes, encode_event(e)) for e in events for _ in range(2)]
    produce_raw(settings, settings.topic("job.ready"), msgs)
    wait_for(lambda: len(_applied(settings)) == 60 and _lag_zero(settings), 60,
             "every event applied and every offset committed", procs.logs)
    assert set(_applied(settings).values()) == {(1, 1)}, _applied(settings)
    assert query(settings.database_url,
                 "SELECT count(*) AS n FROM processed_event")[0]["n"] == 60
    assert read_topic(settings, settings.topic("job.ready.dlq")) == []
    assert a.popen.poll() is None and b.popen.poll() is None, procs.logs()


def test_partitions_revoked_while_a_lane_is_inside_its_transaction_apply_each_event_once(
        settings: Settings, procs: ProcessRunner) -> None:
    """Rebalance during apply with apply lanes (``APPLY_LANES_MIN_BATCH`` 2, ``BATCH_SIZE``
    20): consumer A freezes (SIGSTOP) inside a lane's transaction of its third part; B joins,
    A is evicted at its session timeout and B takes every partition, re-fetching A's batch
    from the last committed offset: B's dedup insert waits on A's uncommitted rows. A is
    resumed: it commits, finds its partitions revoked (no offset stored for them), rejoins.
    Every event is applied once (some also re-delivered on another partition), every offset
    committed, nothing dead-lettered, nobody crashed."""
    lanes = {"JOBSTREAM_CONSUMER_APPLY_LANES_MIN_BATCH": "2",
             "JOBSTREAM_CONSUMER_BATCH_SIZE": "20"}
    events = [job_ready(f"r{i}", charge_usd=0.5) for i in range(300)]
    msgs = [_raw(e) for e in events] + [(uuid.uuid4().bytes, encode_event(e))
                                        for e in events[::5]]
    produce_raw(settings, settings.topic("job.ready"), msgs)
    a = procs.start("consume-ready", name="consumer-a", **lanes,
                    JOBSTREAM_FAULT="consumer_inside_transaction@3=stop")
    try:
        wait_for(lambda: "SIGSTOP" in a.log_text(), 60, "A frozen inside a lane's transaction",
                 procs.logs)
        b = procs.start("consume-ready", name="consumer-b", **lanes)
        wait_for(lambda: query(settings.database_url,
                               "SELECT count(*) AS n FROM pg_stat_activity WHERE datname = "
                               "current_database() AND wait_event_type = 'Lock'")[0]["n"] > 0,
                 60, "B holding A's partitions, waiting on A's uncommitted dedup rows",
                 procs.logs, every_s=0.2)
    finally:
        os.kill(a.popen.pid, signal.SIGCONT)
    wait_for(lambda: len(_applied(settings)) == 300 and _lag_zero(settings), 120,
             "every event applied and every offset committed", procs.logs)
    time.sleep(1)  # a copy applied twice would show by now
    assert set(_applied(settings).values()) == {(1, 1)}
    assert query(settings.database_url,
                 "SELECT count(*) AS n FROM processed_event")[0]["n"] == 300
    assert read_topic(settings, settings.topic("job.ready.dlq")) == []
    assert a.popen.poll() is None and b.popen.poll() is None, procs.logs()
    assert "Traceback" not in a.log_text() + b.log_text(), procs.logs()
