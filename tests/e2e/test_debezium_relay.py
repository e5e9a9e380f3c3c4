"""The Debezium relay (``JOBSTREAM_RELAY=debezium``) end to end, on a real Kafka Connect worker.

The worker is PRIVATE to this module: ``scripts/services.sh up connect`` with its own state
directory, REST port and group id (so its config/offset/status topics are its own), on the
shared Kafka; it is stopped and its topics deleted at the end. Each test has its own database
(so its own replication slot ``jobstream_<db>``, publication and connector name) and drops the
slot in teardown through ``jobstream connect delete``: an inactive slot would retain WAL for
every other test on the shared Postgres.

1. Both relays on the same outbox rows send identical messages (key, value, headers,
   partition).
2. The pipeline and the demo's exactly-once check with Debezium publishing the outbox.
3. The worker killed with SIGKILL in the middle of 1,000 events and kept down
   ``CONNECT_DOWN_S`` (10 s; 30 s with ``JOBSTREAM_TEST_CONNECT_DOWN_S=30``) while writes and
   intake go on: the slot's retained WAL rises in /metrics and the verify check
   flags it; after the restart every event reaches Kafka, per-key order holds, the downstream
   applies each dedup_key once, and the documents accepted during the outage finish.
4. A quiet database's slot still advances (heartbeat rows); delete + deploy starts clean;
   deploy refuses while a Python relay runs and hands over the rows it left unpublished.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from confluent_kafka.admin import AdminClient

from jobstream import connect as dbz
from jobstream import verify
from jobstream.db import connect as db_connect
from jobstream.producer import produce_raw, uploaded_event
from jobstream.settings import Settings
from jobstream.store import Store, outbox_message
from outbox_relay.relay import OutboxRelay
from schemas.events import (
    DocumentAnalysis,
    JobReady,
    JobReadyPayload,
    TextExtracted,
    TextExtractedPayload,
    encode_event,
)
from tests.conftest import Endpoints
from tests.helpers import ProcessRunner, query, read_topic, wait_for

pytestmark = pytest.mark.e2e

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "services.sh"
#: How long the kill -9 test keeps Connect down (seconds). What the test needs from the outage:
#: writes go on meanwhile (> 100 events), the slot is inactive and its retained WAL grows in
#: /metrics, verify flags it, intake accepts 5 documents. All of that is reached in a few
#: seconds; a longer outage only adds more WAL for the restarted task to stream (the full-size
#: drill: JOBSTREAM_TEST_CONNECT_DOWN_S=30, as the test ran until session 9).
CONNECT_DOWN_S = float(os.environ.get("JOBSTREAM_TEST_CONNECT_DOWN_S", "10"))
#: Pause between two writer transactions (seconds): ~50 commits a second, so the 1,000 events
#: span the kill, the whole outage and the restart (they took 40 s at 0.04 s a pause).
WRITE_PAUSE_S = 0.015
LICENSES = Path("/usr/share/common-licenses")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Worker:
    """The module's Kafka Connect worker and how to drive it through services.sh."""

    url: str
    env: dict[str, str]
    group: str
    logdir: Path

    def services(self, *args: str) -> None:
        """``scripts/services.sh <args>`` for this worker (fails the test on error)."""
        r = subprocess.run(["bash", str(SCRIPT), *args], env=self.env, capture_output=True,
                           text=True, timeout=240)
        assert r.returncode == 0, f"services.sh {args}: {r.stdout}\n{r.stderr}\n{self.log()}"

    def log(self) -> str:
        """The tail of the worker's log (for assertion messages)."""
        f = self.logdir / "logs" / "connect.log"
        return f.read_text(errors="replace")[-4000:] if f.exists() else "(no connect.log)"


@pytest.fixture(scope="module")
def worker(endpoints: Endpoints, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Worker]:
    """A private Connect worker (distributed mode) for this module."""
    d = tmp_path_factory.mktemp("connect")
    port = _free_port()
    group = f"t{uuid.uuid4().hex[:8]}-connect"
    env = {**os.environ, "JOBSTREAM_CONNECT_DIR": str(d), "JOBSTREAM_CONNECT_PORT": str(port),
           "JOBSTREAM_CONNECT_GROUP": group, "JOBSTREAM_KAFKA_BOOTSTRAP_SERVERS": endpoints.kafka,
           "JOBSTREAM_CONNECT_HEAP_OPTS": "-Xmx512m -Xms128m"}
    w = Worker(f"http://127.0.0.1:{port}", env, group, d)
    try:
        w.services("up", "connect")  # inside: a worker that started but failed a check is stopped
        yield w
    finally:
        subprocess.run(["bash", str(SCRIPT), "down", "connect"], env=env, timeout=60,
                       capture_output=True)
        admin = AdminClient({"bootstrap.servers": endpoints.kafka})
        for f in admin.delete_topics([f"{group}-{t}" for t in ("configs", "offsets", "status")],
                                     operation_timeout=30).values():
            with contextlib.suppress(Exception):  # best effort: a topic never created
                f.result()


@pytest.fixture
def dbz_settings(settings: Settings, worker: Worker) -> Iterator[Settings]:
    """The test's settings with the Debezium relay selected; the connector, its slot and
    publication are removed in teardown (before the test database is dropped)."""
    s = settings.model_copy(update={"relay": "debezium", "connect_url": worker.url})
    try:
        yield s
    finally:
        dbz.delete(s)
        assert not [r for r in dbz.slot_stats(s)], "replication slot left behind"


def _env(s: Settings) -> dict[str, str]:
    return {"JOBSTREAM_RELAY": "debezium", "JOBSTREAM_CONNECT_URL": s.connect_url}


def _text_extracted(topic: str, tenant: str = "acme") -> tuple[str, object]:
    ev = TextExtracted(tenant_id=tenant, idempotency_key=uuid.uuid4().hex, job_id=uuid.uuid4(),
                       dedup_key=uuid.uuid4().hex * 2,
                       payload=TextExtractedPayload(text_sha256="0" * 64, char_count=12,
                                                    page_count=1))
    return topic, ev


def _job_ready(tenant: str, job_id: uuid.UUID, dedup_key: str, n: int) -> JobReady:
    return JobReady(tenant_id=tenant, idempotency_key=f"k-{job_id}", job_id=job_id,
                    dedup_key=dedup_key, payload=JobReadyPayload(
                        result=DocumentAnalysis(title=f"Résumé №{n}", summary="s",
                                                keywords=["a"], word_count=3, chunk_count=1,
                                                fields={"n": n}),
                        document_sha256="0" * 64, filename=f"doc-{n}.txt", cost_usd=0.0,
                        charge_usd=0.01))


def _headers(m) -> list[tuple[str, bytes]]:  # type: ignore[no-untyped-def]
    return list(m.headers() or [])


def _event_id(m) -> str:  # type: ignore[no-untyped-def]
    return dict(_headers(m))["event_id"].decode()


def test_both_relays_send_identical_messages_for_the_same_outbox_rows(
        dbz_settings: Settings, tmp_path: Path) -> None:
    # No heartbeat rows in this test: the Python relay would publish them too.
    s = dbz_settings.model_copy(update={"connect_heartbeat_s": 3600.0})
    dbz.deploy(s)
    # Keep the rows for the Python relay too (deploy deletes them on insert): both relays
    # then publish the very same rows to the very same topics.
    with db_connect(s.database_url, autocommit=True) as conn:
        conn.execute("ALTER TABLE outbox DISABLE TRIGGER outbox_forget_v1")
    doc = tmp_path / "contrat-ü.txt"
    doc.write_text("Une clause, deux parties. ✓\n")
    events = [_text_extracted(s.topic("job.text_extracted")) for _ in range(5)]
    events.append((s.topic("job.ready"),
                   _job_ready("tenant.x", uuid.uuid4(), "e" * 64, 1)))
    # No job yet: no job_id / dedup_key headers, key = the idempotency key.
    events.append((s.topic("document.uploaded"),
                   uploaded_event(doc, tenant_id="acme", idempotency_key="idem-1",
                                  settings=s)))
    with db_connect(s.database_url) as conn, conn.transaction():
        for topic, ev in events:
            Store.add_outbox(conn, outbox_message(topic, ev))  # type: ignore[arg-type]
    with db_connect(s.database_url, autocommit=True) as conn:
        relay = OutboxRelay(s)
        assert relay.publish_batch(conn) == len(events)
    topics = sorted({t for t, _ in events})

    def both_copies() -> dict[str, list]:
        got: dict[str, list] = defaultdict(list)
        for t in topics:
            for m in read_topic(s, t):
                got[_event_id(m)].append(m)
        return got if len(got) == len(events) and all(
            len(v) >= 2 for v in got.values()) else {}
    got = wait_for(both_copies, 60, "both relays' copies of every row",
                   lambda: str(dbz.status(s)))
    for eid, (a, b, *_rest) in got.items():
        assert a.topic() == b.topic(), eid
        assert a.key() == b.key(), eid
        assert a.value() == b.value(), eid
        assert _headers(a) == _headers(b), (eid, _headers(a), _headers(b))
        assert a.partition() == b.partition(), eid  # both use murmur2 on the key
    uploaded = next(v for v in got.values() if v[0].topic().endswith("document.uploaded"))
    assert uploaded[0].key() == b"idem-1"
    assert "job_id" not in dict(_headers(uploaded[0]))


def test_python_relay_refuses_while_the_connector_owns_the_outbox(
        dbz_settings: Settings, procs: ProcessRunner) -> None:
    s = dbz_settings
    dbz.deploy(s)
    # Even with JOBSTREAM_RELAY unset (python), the deployed connector is found.
    r = procs.run("relay", timeout_s=60)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "refuses to start" in r.stderr and "connect delete" in r.stderr
    # Beside Debezium, the sweeper and retention run without publishing.
    hk = procs.start("relay", "--housekeeping-only")
    wait_for(lambda: "housekeeping active" in hk.log_text(), 60, "housekeeping to start",
             procs.logs)
    assert hk.popen.poll() is None
    st = procs.run("connect", "status", "--json", timeout_s=60, **_env(s))
    assert st.returncode == 0, st.stdout + st.stderr
    info = json.loads(st.stdout)
    assert info["state"] == "RUNNING" and info["slots"][0]["active"] is True
    # WAL written and not yet confirmed by the connector: over a threshold of 0 bytes.
    with db_connect(s.database_url) as conn, conn.transaction():
        for _ in range(50):
            topic, ev = _text_extracted(s.topic("job.text_extracted"))
            Store.add_outbox(conn, outbox_message(topic, ev))  # type: ignore[arg-type]
    lagging = dbz.check_replication_slot(s.model_copy(update={"slot_retained_alert_bytes": 0}))
    assert [f.severity for f in lagging] == ["warning"], lagging
    assert lagging[0].details["retained_bytes"] > 0
    assert all(f.ok for f in dbz.check_replication_slot(s))


def test_a_quiet_outbox_still_lets_its_slot_advance_and_a_redeploy_starts_clean(
        dbz_settings: Settings, procs: ProcessRunner) -> None:
    s = dbz_settings.model_copy(update={"connect_heartbeat_s": 1.0})
    dbz.deploy(s)
    # 8 MB of WAL that the publication does not carry (as other databases of the server
    # would write): only the connector's heartbeat rows let it confirm past them.
    with db_connect(s.database_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE wal_filler AS SELECT repeat('x', 1000) AS x "
                     "FROM generate_series(1, 8000)")
    filled = dbz.slot_stats(s)[0]["unconfirmed_bytes"]
    assert filled > 8_000_000
    wait_for(lambda: dbz.slot_stats(s)[0]["unconfirmed_bytes"] < 1_000_000, 60,
             "the slot confirmed past the WAL of other tables", lambda: str(dbz.status(s)))
    # Back to the Python relay: while it runs, deploy refuses (both would publish).
    dbz.delete(s)
    relay = procs.start("relay")
    wait_for(lambda: "relay active" in relay.log_text(), 60, "the Python relay", procs.logs)
    with pytest.raises(RuntimeError, match="Python relay is running"):
        dbz.deploy(s)
    procs.kill9(relay)
    # A row the Python relay never published: deploy hands it over to the connector.
    topic, left = _text_extracted(s.topic("job.text_extracted"))
    with db_connect(s.database_url) as conn, conn.transaction():
        Store.add_outbox(conn, outbox_message(topic, left))  # type: ignore[arg-type]
    # delete + deploy: the new connector starts at the new slot, not at the old offsets.
    dbz.deploy(s)
    _, ev = _text_extracted(topic)
    with db_connect(s.database_url) as conn, conn.transaction():
        Store.add_outbox(conn, outbox_message(topic, ev))  # type: ignore[arg-type]
    want = {str(left.event_id), str(ev.event_id)}  # type: ignore[attr-defined]
    wait_for(lambda: want <= {_event_id(m) for m in read_topic(s, topic)}, 60,
             "the handed-over row and the new one", lambda: str(dbz.status(s)))
    assert query(s.database_url, "SELECT count(*) AS n FROM outbox")[0]["n"] == 0


def test_connect_worker_keeps_its_state_in_compacted_topics(worker: Worker,
                                                            endpoints: Endpoints) -> None:
    from confluent_kafka.admin import ConfigResource
    admin = AdminClient({"bootstrap.servers": endpoints.kafka})
    names = [f"{worker.group}-{t}" for t in ("configs", "offsets", "status")]
    res = admin.describe_configs([ConfigResource(ConfigResource.Type.TOPIC, n) for n in names])
    for r, f in res.items():
        assert f.result(timeout=30)["cleanup.policy"].value == "compact", r


def test_pipeline_and_demo_exactly_once_with_debezium_publishing_the_outbox(
        dbz_settings: Settings, procs: ProcessRunner) -> None:
    s = dbz_settings
    env = _env(s)
    dep = procs.run("connect", "deploy", timeout_s=150, **env)
    assert dep.returncode == 0, dep.stdout + dep.stderr
    procs.start("worker", **env)
    procs.start("consume-ready", **env)
    # The pipeline test's case: the same upload three times is one job, applied once.
    ev = uploaded_event(LICENSES / "GPL-2", tenant_id="acme", idempotency_key="upload-1",
                        settings=s)
    for _ in range(3):
        produce_raw(s, s.topic("document.uploaded"), [(b"upload-1", encode_event(ev))])

    def applied(tenant: str) -> list[dict]:
        return query(s.database_url,
                     "SELECT dedup_key, count(*) AS n FROM downstream.document_analysis "
                     "WHERE tenant_id = %s GROUP BY dedup_key", (tenant,))
    wait_for(lambda: applied("acme"), 120, "the job applied downstream", procs.logs)
    jobs = query(s.database_url, "SELECT status FROM job WHERE tenant_id = 'acme'")
    assert [j["status"] for j in jobs] == ["succeeded"]
    assert [a["n"] for a in applied("acme")] == [1]
    charges = query(s.database_url, "SELECT count(*) AS n FROM downstream.ledger_charge "
                                    "WHERE tenant_id = 'acme'")
    assert charges[0]["n"] == 1
    # Rows were deleted in their own transactions: the outbox does not grow with Debezium.
    assert query(s.database_url, "SELECT count(*) AS n FROM outbox")[0]["n"] == 0
    ready = read_topic(s, s.topic("job.ready"))
    assert len({_event_id(m) for m in ready}) == 1

    # The demo (its own workers; the connector is already deployed: deploy is idempotent).
    procs.stop_all()
    r = subprocess.run([sys.executable, "-m", "jobstream.cli", "demo", "--no-services",
                        "--tenant", "demo-dbz", "--timeout", "300"],
                       env=procs.env(COLUMNS="160", **env), capture_output=True, text=True,
                       timeout=400)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "CHECK PASSED" in r.stdout
    demo = applied("demo-dbz")
    assert len(demo) == 17 and all(a["n"] == 1 for a in demo)


def _scrape(port: int) -> dict[str, float]:
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    except httpx.TransportError:  # the metrics process is still starting
        return {}
    out = {}
    for line in text.splitlines():
        if line.startswith("jobstream_replication_slot_"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_connect_killed_mid_stream_and_kept_down_loses_nothing_and_the_slot_is_flagged(
        dbz_settings: Settings, procs: ProcessRunner, worker: Worker, tmp_path: Path) -> None:
    s = dbz_settings
    env = _env(s)
    dbz.deploy(s)
    slot = dbz.names(s).slot
    port = _free_port()
    procs.start("metrics", "--port", str(port), **env)
    procs.start("consume-ready", **env)
    procs.start("worker", **env)
    retained = f'jobstream_replication_slot_retained_bytes{{slot="{slot}"}}'
    active = f'jobstream_replication_slot_active{{slot="{slot}"}}'
    wait_for(lambda: _scrape(port).get(active) == 1.0, 60, "the slot active in /metrics",
             procs.logs)

    # 1,000 job.ready events: 100 jobs x 10 events (same job, same dedup_key: re-publishes
    # the downstream must apply once), one transaction each, ~50 per second.
    jobs = [(uuid.uuid4(), uuid.uuid4().hex * 2) for _ in range(100)]
    order: dict[str, list[str]] = defaultdict(list)  # key -> event ids in commit order
    written = 0

    def writer() -> None:
        nonlocal written
        with db_connect(s.database_url) as conn:
            for i in range(1000):
                job_id, dk = jobs[i % len(jobs)]
                ev = _job_ready("kill9", job_id, dk, i)
                with conn.transaction():
                    Store.add_outbox(conn, outbox_message(s.topic("job.ready"), ev))
                order[str(job_id)].append(str(ev.event_id))
                written = i + 1
                time.sleep(WRITE_PAUSE_S)
    t = threading.Thread(target=writer, daemon=True)
    t.start()
    wait_for(lambda: written >= 150, 60, "150 events written")
    worker.services("stop", "connect", "--immediate")  # kill -9 mid-stream
    down_at = time.monotonic()
    killed_at = written
    wait_for(lambda: _scrape(port).get(active) == 0.0, 60, "the slot inactive in /metrics")
    before = _scrape(port)[retained]
    findings = dbz.check_replication_slot(s)
    assert [f.severity for f in findings] == ["critical"], findings
    assert "inactive" in findings[0].message
    v = procs.run("verify", "--check", "replication_slot", timeout_s=120, **env)
    assert v.returncode == 1 and "inactive" in v.stdout + v.stderr, v.stdout + v.stderr
    audit = verify.run(s, checks=["replication_slot"])  # what `jobstream verify` reports
    assert audit.exit_code == 1 and "inactive" in str(audit.broken[0]), audit.text()
    # Intake goes on meanwhile: 5 documents become jobs whose events wait in the WAL.
    docs = []
    for i in range(5):
        d = tmp_path / f"outage-{i}.txt"
        d.write_text(f"Document {i} written while Kafka Connect was down. " * 20)
        docs.append(uploaded_event(d, tenant_id="outage", idempotency_key=f"o-{i}", settings=s))
    produce_raw(s, s.topic("document.uploaded"),
                [(f"o-{i}".encode(), encode_event(e)) for i, e in enumerate(docs)])
    wait_for(lambda: len(query(s.database_url, "SELECT 1 FROM job WHERE tenant_id = "
                                               "'outage'")) == 5, 25,
             "intake to accept the 5 documents while Connect is down", procs.logs)
    time.sleep(max(0.0, CONNECT_DOWN_S - (time.monotonic() - down_at)))  # down in all
    assert written > killed_at + 100, (killed_at, written)
    # /metrics reuses a scrape for metrics_cache_s (5 s): `before` may still be served, so
    # wait (bounded) for a fresh scrape to show the WAL the writer added meanwhile.
    wait_for(lambda: _scrape(port)[retained] > before, 30,
             "the slot's retained WAL to rise in /metrics while Connect is down",
             lambda: f"before {before}, now {_scrape(port)[retained]}")
    worker.services("start", "connect")
    # The restarted worker takes its task back at once (it is the group's only member;
    # services.sh caps Connect's lost-member rebalance delay at 5 s, not the default 5 min):
    # RUNNING, and streaming from the slot again (the status topic may still hold the killed
    # worker's RUNNING; only the restarted task makes the slot active).
    def streaming() -> bool:
        st = dbz.status(s)
        return ([t["state"] for t in st["tasks"]] == ["RUNNING"]
                and [x["active"] for x in st["slots"]] == [True])
    wait_for(streaming, 60, "the connector task RUNNING and its slot active after the restart",
             lambda: str(dbz.status(s)) + worker.log())
    t.join(120)
    assert written == 1000

    # Only this test's 1,000 events: job.ready also carries the 5 outage jobs' events, which
    # may land before the last of the 1,000 when the writer still runs after the restart (so
    # counting every event id on the topic, as this test once did, could miss "exactly 1,000").
    want = {eid for eids in order.values() for eid in eids}
    keys = {str(job_id).encode() for job_id, _ in jobs}
    seen: set[str] = set()

    def all_events() -> list:
        msgs = [m for m in read_topic(s, s.topic("job.ready")) if m.key() in keys]
        seen.clear()
        seen.update(_event_id(m) for m in msgs)
        return msgs if want <= seen else []
    msgs = wait_for(all_events, 180, "all 1,000 events on Kafka after the restart",
                    lambda: f"{len(want - seen)} of {len(want)} missing\n"
                            + str(dbz.status(s)) + worker.log())
    assert seen == want  # and nothing else under these jobs' keys
    # Per-key order: in each partition, the first copy of each event id comes in commit order.
    by_key: dict[str, list[str]] = defaultdict(list)
    for m in sorted(msgs, key=lambda m: (m.partition(), m.offset())):
        eid = _event_id(m)
        if eid not in by_key[m.key().decode()]:
            by_key[m.key().decode()].append(eid)
    assert by_key == order
    assert len({m.partition() for m in msgs if m.key() == msgs[0].key()}) == 1

    def applied() -> list[dict]:
        rows = query(s.database_url,
                     "SELECT dedup_key, count(*) AS n FROM downstream.document_analysis "
                     "WHERE tenant_id = 'kill9' GROUP BY dedup_key")
        return rows if len(rows) == len(jobs) else []
    rows = wait_for(applied, 120, "every dedup_key applied", procs.logs)
    assert all(r["n"] == 1 for r in rows)
    charges = query(s.database_url, "SELECT dedup_key, count(*) AS n FROM "
                                    "downstream.ledger_charge WHERE tenant_id = 'kill9' "
                                    "GROUP BY dedup_key")
    assert len(charges) == len(jobs) and all(c["n"] == 1 for c in charges)
    # The jobs accepted during the outage went through the whole pipeline once.
    def outage_applied() -> list[dict]:
        rows = query(s.database_url,
                     "SELECT dedup_key, count(*) AS n FROM downstream.document_analysis "
                     "WHERE tenant_id = 'outage' GROUP BY dedup_key")
        return rows if len(rows) == 5 else []
    rows = wait_for(outage_applied, 120, "the outage's 5 jobs applied", procs.logs)
    assert all(r["n"] == 1 for r in rows)
    # Drained: the slot is streamed again and the check is clean.
    wait_for(lambda: _scrape(port).get(active) == 1.0, 60, "the slot active again")
    assert all(f.ok for f in dbz.check_replication_slot(s))
    v = procs.run("verify", "--check", "replication_slot", timeout_s=120, **env)
    assert v.returncode == 0, v.stdout + v.stderr
    assert query(s.database_url, "SELECT count(*) AS n FROM outbox")[0]["n"] == 0
