"""Test helpers: real processes, reading topics, waiting on Postgres."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from psycopg import sql
from psycopg.rows import dict_row

from jobstream.drills.procs import Proc, child_env, die_with_parent
from jobstream.drills.procs import ProcessRunner as _ProcessRunner
from jobstream.settings import Settings


class ProcessRunner(_ProcessRunner):
    """Runs ``python -m jobstream.cli <args>`` with the test's settings as environment (the
    harness' one runner, :class:`jobstream.drills.procs.ProcessRunner`)."""

    def __init__(self, settings: Settings, logdir: Path) -> None:
        s = settings
        super().__init__(child_env(
            JOBSTREAM_DATABASE_URL=s.database_url,
            JOBSTREAM_KAFKA_BOOTSTRAP_SERVERS=s.kafka_bootstrap_servers,
            JOBSTREAM_TOPIC_PREFIX=s.topic_prefix,
            JOBSTREAM_CONSUMER_SESSION_TIMEOUT_MS=str(s.consumer_session_timeout_ms),
            JOBSTREAM_RELAY_POLL_INTERVAL_S=str(s.relay_poll_interval_s),
            JOBSTREAM_LEASE_S=str(s.lease_s),
            JOBSTREAM_PROVIDER_BACKOFF_BASE_S=str(s.provider_backoff_base_s),
            JOBSTREAM_PROVIDER_SLOT_MARGIN_S=str(s.provider_slot_margin_s)), logdir)
        self.settings = settings

    def start_api(self, tokens: dict[str, str], **env: str) -> tuple[str, Proc]:
        """Start ``jobstream api`` on a free loopback port with bearer ``tokens`` (token ->
        tenant) and wait (30 s at most) until ``/healthz`` answers 200. Returns ``(base URL,
        process)``."""
        import json

        import httpx
        port = free_port()
        env.setdefault("JOBSTREAM_API_TOKENS", json.dumps(tokens))
        proc = self.start("api", "--port", str(port), **env)
        url = f"http://127.0.0.1:{port}"

        def up() -> bool:
            try:
                return httpx.get(f"{url}/healthz", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False
        wait_for(up, 30, "the API to answer", self.logs)
        return url, proc

    def pipeline(self, **env: str) -> dict[str, Proc]:
        """Start relay, stage workers and the downstream applier."""
        return {"relay": self.start("relay", **env), "worker": self.start("worker", **env),
                "downstream": self.start("consume-ready", **env)}


def produce_at(settings: Settings, topic: str, parts: list[tuple[int, bytes, bytes]]) -> None:
    """Produce ``(partition, key, value)`` to ``topic`` (full name) in order and wait until
    each is acknowledged (60 s at most); asserts no delivery failed."""
    from confluent_kafka import Producer

    from jobstream.kafka import producer_config
    producer = Producer(producer_config(settings))
    errors: list[object] = []
    for partition, key, value in parts:
        producer.produce(topic, value=value, key=key, partition=partition,
                         on_delivery=lambda err, _m: errors.append(err) if err else None)
        producer.poll(0)
    assert producer.flush(60) == 0 and not errors, errors


class ScriptRig:
    """Child processes that each run one Python ``script`` (e.g. a library consumer probe)
    with ``args``, this tree on ``PYTHONPATH`` and cwd, and one log per name under
    ``tmp_path`` (``<name>.log``, stdout and stderr). :meth:`close` SIGKILLs them and closes
    the logs; they die with this process too (:func:`jobstream.drills.procs.die_with_parent`)."""

    def __init__(self, tmp_path: Path, script: str, args: list[str], names: tuple[str, ...]
                 ) -> None:
        path = tmp_path / "script.py"
        path.write_text(script)
        self.args = [sys.executable, str(path), *args]
        self.tmp_path = tmp_path
        self.logs = {n: (tmp_path / f"{n}.log").open("w+") for n in names}
        self.procs: list[subprocess.Popen[bytes]] = []
        self.root = str(Path(__file__).resolve().parents[1])  # this tree, not another

    def start(self, name: str, **env: str) -> subprocess.Popen[bytes]:
        """Start the script logging to ``name``'s log, with ``env`` added to the environment."""
        p = subprocess.Popen(self.args, stdout=self.logs[name], stderr=subprocess.STDOUT,
                             env={**os.environ, **env, "PYTHONPATH": self.root}, cwd=self.root,
                             preexec_fn=die_with_parent())
        self.procs.append(p)
        return p

    def log(self, name: str) -> str:
        """``name``'s log so far."""
        return (self.tmp_path / f"{name}.log").read_text()

    def all_logs(self) -> str:
        """The last 3,000 characters of every log, each under its name."""
        return "\n".join(f"--- {n}\n{self.log(n)[-3000:]}" for n in self.logs)

    def close(self) -> None:
        """SIGKILL every process started (a stopped one too), close the logs."""
        for p in self.procs:
            p.kill()
            p.wait(10)
        for f in self.logs.values():
            f.close()


def query(url: str, q: str, params: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
    """Run one read-only test query (test-only SQL: assertions over the store's tables)."""
    with psycopg.connect(url, row_factory=dict_row, autocommit=True) as conn:
        return conn.execute(q, params).fetchall()  # type: ignore[arg-type]  # q: a str, not a LiteralString


def processed_rows(url: str, schema: str = "public") -> tuple[int, int]:
    """``(effects, dead_letter_marks)``: the ``processed_event`` rows of ``schema`` that record
    an applied event, and the marker rows of dead-lettered positions (event type
    ``consumers.idempotent.DEAD_LETTER_MARK``: one per group and position)."""
    from psycopg import sql

    from consumers.idempotent import DEAD_LETTER_MARK
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(sql.SQL(
            "SELECT count(*) FILTER (WHERE event_type <> %s), count(*) FILTER (WHERE "
            "event_type = %s) FROM {}").format(sql.Identifier(schema, "processed_event")),
            (DEAD_LETTER_MARK, DEAD_LETTER_MARK)).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def wait_pipeline_drained(settings: Settings, procs: ProcessRunner, timeout_s: float = 60.0
                          ) -> None:
    """Wait until the stage workers' group (every stage topic and its ``.retry`` twin) and the
    example downstream's group (``job.ready``) have consumer lag 0."""
    from jobstream.kafka import STAGE_TOPICS, group_lag
    streams = settings.group("jobstream-streams")
    topics = [settings.topic(t) for t in STAGE_TOPICS] + [
        settings.topic(t + ".retry") for t in STAGE_TOPICS]
    wait_for(lambda: group_lag(settings, streams, topics) == 0
             and group_lag(settings, settings.group("downstream-ready-applier"),
                           [settings.topic("job.ready")]) == 0,
             timeout_s, "consumer lag 0", procs.logs, every_s=1.0)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS picks it)."""
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(pred: Callable[[], Any], timeout_s: float, what: str,
             on_timeout: Callable[[], str] | None = None, every_s: float = 0.25) -> Any:
    """Poll ``pred`` until truthy; fails the test with ``what`` (+ diagnostics) on timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(every_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}\n"
                         + (on_timeout() if on_timeout else ""))


#: Errors a topic answers with for a moment after it was created.
_SETTLING = (KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE,
             KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._TIMED_OUT)


def _watermarks(c: Consumer, tp: TopicPartition, timeout_s: float = 15.0) -> tuple[int, int]:
    """``(low, high)`` of ``tp``, retrying retriable errors: just after a topic is created the
    broker answers NOT_LEADER_FOR_PARTITION for a moment, although metadata shows a leader."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return c.get_watermark_offsets(tp, timeout=10)
        except KafkaException as exc:
            err = exc.args[0]
            if not (err.retriable() or err.code() in _SETTLING) or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def read_topic(settings: Settings, topic: str, timeout_s: float = 20.0) -> list[Any]:
    """Every message currently in ``topic`` (full name), read from the beginning to the end
    offsets at call time, with a throwaway consumer group."""
    c = Consumer({"bootstrap.servers": settings.kafka_bootstrap_servers,
                  "group.id": f"reader-{uuid.uuid4().hex}", "enable.auto.commit": False,
                  "auto.offset.reset": "earliest"})
    try:
        md = c.list_topics(topic, timeout=10).topics[topic]
        tps = [TopicPartition(topic, p) for p in md.partitions]
        ends = {}
        for tp in tps:
            _lo, hi = _watermarks(c, tp)
            ends[tp.partition] = hi
        todo = {p for p, hi in ends.items() if hi > 0}
        c.assign([TopicPartition(topic, p, 0) for p in ends])
        out = []
        deadline = time.monotonic() + timeout_s
        while todo and time.monotonic() < deadline:
            m = c.poll(0.5)
            if m is None:
                continue
            if m.error():
                if m.error().code() == KafkaError._PARTITION_EOF:
                    continue
                raise RuntimeError(m.error())
            if m.offset() < ends[m.partition()]:
                out.append(m)
            if m.offset() >= ends[m.partition()] - 1:
                todo.discard(m.partition())
        assert not todo, f"could not read {topic} to its end offsets"
        return out
    finally:
        c.close()


def set_topic_config(settings: Settings, topic: str, key: str, value: str,
                     timeout_s: float = 30.0) -> None:
    """Set one config of ``topic`` (an incremental alter) and wait until the broker reports it
    in force: the controller accepts an alter before the broker applies it, and a test that
    produces at once may still meet the old value."""
    from confluent_kafka.admin import AdminClient, AlterConfigOpType, ConfigEntry, ConfigResource

    from jobstream.kafka import base_config
    admin = AdminClient(base_config(settings))
    res = ConfigResource(ConfigResource.Type.TOPIC, topic, incremental_configs=[
        ConfigEntry(key, value, incremental_operation=AlterConfigOpType.SET)])
    for fut in admin.incremental_alter_configs([res]).values():
        fut.result(timeout_s)

    def in_force() -> bool:
        (cfg,) = admin.describe_configs([ConfigResource(ConfigResource.Type.TOPIC, topic)]).values()
        return bool(cfg.result(timeout_s)[key].value == value)
    wait_for(in_force, timeout_s, f"{key}={value} in force on {topic}")


def text_uploaded(key: str, text: str, *, sha256: str | None = None,
                  tenant: str = "acme") -> Any:
    """A ``document.uploaded`` of ``text`` as an inline ``text/plain`` document named
    ``<key>.txt``, idempotency key ``key`` (``sha256``: a wrong one, to make it hostile)."""
    import base64
    import hashlib

    from schemas.events import DocumentRef, DocumentUploaded, DocumentUploadedPayload
    data = text.encode()
    doc = DocumentRef(filename=f"{key}.txt", sha256=sha256 or hashlib.sha256(data).hexdigest(),
                      size_bytes=len(data), content_b64=base64.b64encode(data).decode())
    return DocumentUploaded(tenant_id=tenant, idempotency_key=key,
                            payload=DocumentUploadedPayload(document=doc))


def job_ready(name: str, *, charge_usd: float = 0.5, blob_chars: int = 0) -> Any:
    """A well-formed ``job.ready`` of tenant ``acme`` with a fresh job id and dedup key
    (``name`` is its idempotency key, title and filename). ``blob_chars`` > 0: the result's
    ``fields`` hold ``{"blob": "x" * blob_chars}``, so the value is about that many bytes."""
    from schemas.events import DocumentAnalysis, JobReady, JobReadyPayload
    return JobReady(
        tenant_id="acme", idempotency_key=name, job_id=uuid.uuid4(),
        dedup_key=uuid.uuid4().hex * 2,
        payload=JobReadyPayload(
            result=DocumentAnalysis(title=name, summary="s", keywords=["a"], word_count=1,
                                    chunk_count=1,
                                    fields={"blob": "x" * blob_chars} if blob_chars else {}),
            document_sha256="a" * 64, filename=name, cost_usd=0.0, charge_usd=charge_usd))


def run_until_handled(consumer: Any, handled: int, timeout_s: float = 60.0) -> None:
    """Run an :class:`~consumers.idempotent.IdempotentConsumer` in a thread until its stats
    count ``handled`` messages (applied + duplicates + dead-lettered) within ``timeout_s``
    seconds, give it 0.5 s to store the last batch's offsets, then stop it and join it.
    Raises ``AssertionError`` (timeout, or the thread still alive 30 s after the stop)."""
    t = threading.Thread(target=consumer.run, daemon=True)
    t.start()
    st = consumer.stats
    try:
        wait_for(lambda: st.applied + st.duplicates + st.dead_lettered >= handled, timeout_s,
                 f"{handled} messages handled (stats {st})")
        time.sleep(0.5)  # the offsets of the last batch are stored right after the stats
    finally:
        consumer.stop()
        t.join(30)
    assert not t.is_alive()


@contextmanager
def database_before(server_url: str, version: int) -> Iterator[str]:
    """A fresh database migrated only up to (not including) migration ``version``, the way
    the release before it left a database: yields its URL (the server of ``server_url``),
    dropped (``WITH (FORCE)``) on exit. For upgrade tests: write rows the old way, then
    :func:`jobstream.db.migrate` and check them."""
    from jobstream.db import QUERIES, connect, migration_files
    name = f"jobstream_m_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    url = psycopg.conninfo.make_conninfo(server_url, dbname=name)
    try:
        with connect(url) as conn, conn.transaction():
            conn.execute(QUERIES["create_migration_table"])
            for v, fname, text in migration_files():
                if v < version:
                    conn.execute(text)
                    conn.execute(QUERIES["record_migration"], (v, fname))
        yield url
    finally:
        with psycopg.connect(server_url, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                sql.Identifier(name)))


def count(settings: Settings, q: str, params: tuple[Any, ...] = ()) -> int:
    """``q``'s first row's ``n`` column (a ``SELECT count(*) AS n ...``) in the test's
    database."""
    return int(query(settings.database_url, q, params)[0]["n"])


def assert_each_document_accepted_once(settings: Settings, keys: list[str]) -> None:
    """Intake's exactly-once check: one job, one ``job_request`` and one ``job.accepted``
    outbox row per idempotency key in ``keys`` (duplicates in the input were replays), and
    nothing on ``document.uploaded``'s dead-letter topic.

    Raises AssertionError naming what differs."""
    got = sorted(r["idempotency_key"] for r in query(
        settings.database_url, "SELECT idempotency_key FROM job"))
    assert got == sorted(keys), f"jobs {got} != documents {sorted(keys)}"
    accepted = count(settings, "SELECT count(*) AS n FROM outbox WHERE event_type = "
                               "'job.accepted'")
    assert accepted == len(keys), f"{accepted} job.accepted rows for {len(keys)} documents"
    assert count(settings, "SELECT count(*) AS n FROM job_request") == len(keys)
    assert not read_topic(settings, settings.topic("document.uploaded") + ".dlq")


def library_consumer(settings: Settings, schema: str, seen: dict[str, list[Any]],
                     **settings_kw: Any) -> Any:
    """The consumer library (:class:`consumers.IdempotentConsumer`) standalone on ``schema``
    of the test's database and topic prefix, group ``<prefix>lib``, with a 5 s dead-letter
    produce timeout (``settings_kw`` overrides any :class:`consumers.ConsumerSettings`
    field). Its callbacks record into ``seen`` when the key is there: ``"applied"`` and
    ``"duplicate"`` get the event's idempotency key, ``"dead"`` the dead letter's error
    code. The caller registers its handlers with ``@consumer.on(...)``."""
    from consumers import ConsumerSettings, IdempotentConsumer
    kw: dict[str, Any] = {"bootstrap_servers": settings.kafka_bootstrap_servers,
                          "dsn": settings.database_url, "group": settings.group("lib"),
                          "db_schema": schema, "topic_prefix": settings.topic_prefix,
                          "dlq_produce_timeout_s": 5, **settings_kw}

    def record(key: str) -> Callable[[Any], None] | None:
        return (lambda ev: seen[key].append(ev.idempotency_key)) if key in seen else None

    dead = seen.get("dead")
    return IdempotentConsumer(
        ConsumerSettings(**kw), on_applied=record("applied"), on_duplicate=record("duplicate"),
        on_dead_lettered=(lambda code, reason: dead.append(code)) if dead is not None else None)


def outbox_events(settings: Settings, event_type: str) -> list[Any]:
    """Every ``event_type`` event still in the test database's outbox, oldest first, decoded
    to its pydantic model (:func:`schemas.events.decode_event`; raises on a malformed row)."""
    from schemas.events import decode_event
    rows = query(settings.database_url, "SELECT payload FROM outbox WHERE event_type = %s "
                 "ORDER BY id", (event_type,))
    return [decode_event(bytes(r["payload"]), expected=event_type) for r in rows]


def stopped(pid: int) -> bool:
    """True while process ``pid`` is stopped (SIGSTOP): state ``T`` in /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def assert_jobs_succeed_charged_once(settings: Settings, procs: ProcessRunner, n: int,
                                     timeout_s: float = 120.0) -> list[dict[str, Any]]:
    """Wait (up to ``timeout_s`` seconds each) until the database's ``n`` jobs are terminal and
    the pipeline is drained (:func:`wait_pipeline_drained`); assert each job succeeded and was
    charged exactly once downstream (``downstream.ledger_charge`` by dedup key). Returns the
    jobs (``job_id``, ``status``, ``error_code``, ``current_stage``, ``generation``)."""
    url = settings.database_url
    wait_for(lambda: query(url, "SELECT count(*) AS n FROM job WHERE status IN "
                                "('succeeded', 'failed', 'cancelled')")[0]["n"] == n,
             timeout_s, "jobs terminal", procs.logs)
    wait_pipeline_drained(settings, procs, timeout_s)
    st = query(url, "SELECT job_id, status, error_code, current_stage, generation FROM job")
    assert len(st) == n and all(r["status"] == "succeeded" for r in st), st
    per_job = query(url, "SELECT (SELECT count(*) FROM downstream.ledger_charge c WHERE "
                         "c.dedup_key = j.dedup_key) AS c FROM job j")
    assert [r["c"] for r in per_job] == [1] * n, per_job
    return st


def succeeded_and_applied(url: str, tenant: str) -> tuple[int, int]:
    """``(jobs of tenant succeeded, of those applied downstream)``: the example
    downstream's ``document_analysis`` holds a row of the job's dedup key."""
    row = query(url, """
        SELECT count(*) FILTER (WHERE j.status = 'succeeded') AS ok,
               count(*) FILTER (WHERE j.status = 'succeeded' AND EXISTS (
                   SELECT 1 FROM downstream.document_analysis a
                    WHERE a.tenant_id = j.tenant_id AND a.dedup_key = j.dedup_key)) AS applied
          FROM job j WHERE j.tenant_id = %s""", (tenant,))[0]
    return row["ok"], row["applied"]


def paragraphs_document(path: Path, paragraphs: int) -> Path:
    """Write a text document of ``paragraphs`` paragraphs (~400 characters each: about one
    chunk each at ``chunk_size_chars`` 400) to ``path``; returns ``path``."""
    path.write_text("\n\n".join(f"Paragraph {i} talks about harbour lanterns and copper "
                                 f"kettles for a while, sentence after sentence. " * 4
                                 for i in range(paragraphs)))
    return path


def freeze_in_local_llm(settings: Settings, procs: ProcessRunner, key: str, text: str,
                        env: dict[str, str]) -> tuple[Proc, Proc]:
    """Start a relay and the ready applier, and a worker that SIGSTOPs itself inside the
    local llm stage's one transaction (its third one-transaction stage run: extract, chunk,
    llm); submit one document ``key`` with ``text`` and wait (90 s) until that worker is
    frozen holding the job's row lock. ``env``: settings for all three. Returns
    ``(relay, frozen worker)``; the caller SIGCONTs the worker."""
    from jobstream.producer import produce_raw
    from schemas.events import encode_event
    relay = procs.start("relay", **env)
    procs.start("consume-ready", **env)
    frozen = procs.start("worker", name="worker-frozen", **env,
                         JOBSTREAM_FAULT="stage_inside_one_transaction@3=stop")
    produce_raw(settings, settings.topic("document.uploaded"),
                [(key.encode(), encode_event(text_uploaded(key, text)))])
    wait_for(lambda: "SIGSTOP" in frozen.log_text(), 90,
             "the worker to freeze inside the local llm transaction", procs.logs)
    return relay, frozen


#: How many points :func:`run_points_concurrently` runs at once by default
#: (``JOBSTREAM_TEST_POINTS_AT_ONCE``; 2 until session 9, 1 runs them one after another).
POINTS_AT_ONCE = int(os.environ.get("JOBSTREAM_TEST_POINTS_AT_ONCE", "3"))


@contextmanager
def run_points_concurrently(request: Any, test_name: str, param: str,
                            run: Callable[[str], Any], width: int | None = None,
                            pool: Any = None) -> Iterator[dict[str, Any]]:
    """Start the selected points of the parametrised test ``test_name`` (its ``param`` values,
    in collection order), ``width`` (default :data:`POINTS_AT_ONCE`, 3) at a time in threads,
    each by ``run(point)``; yields ``{point: concurrent.futures.Future}``. For a module fixture
    of points that are independent (each its own database, topic prefix, fake provider and
    processes) and that mostly WAIT (fixed freezes, session timeouts, leases): they overlap
    their waits. Six points three at a time take two rounds, not three. Exits once every
    started point finished; with ``pool`` (a ``ThreadPoolExecutor`` several such fixtures
    share, ``width`` then unused) the points go to that pool and whoever owns it waits."""
    from concurrent.futures import ThreadPoolExecutor
    width = width or POINTS_AT_ONCE
    # pytest creates (and first empties) the session's base temp dir on its first use: here,
    # not in two threads at once (one would delete the other's tmp_path_factory.mktemp dir).
    request.getfixturevalue("tmp_path_factory").getbasetemp()
    points = [item.callspec.params[param] for item in request.session.items
              if getattr(item, "originalname", None) == test_name
              and item.module is request.module]
    if pool is not None:
        yield {p: pool.submit(run, p) for p in points}
        return
    with ThreadPoolExecutor(max_workers=width, thread_name_prefix=test_name) as own:
        yield {p: own.submit(run, p) for p in points}


@contextmanager
def kept_frozen(settings: Settings, procs: ProcessRunner, frozen: Proc) -> Iterator[None]:
    """Run the block while ``frozen`` (a worker from :func:`freeze_in_local_llm`) stays
    stopped: assert it is still stopped at the end of the block (else the probe was
    inconclusive), SIGCONT it whatever happens, then wait (90 s) until the late stage topics
    (``job.chunks_ready``, ``job.llm_done``, ``job.validated``) are consumed and committed by
    the stage workers' consumer group (lag 0), so the resumed worker had its say.

    Raises AssertionError when the worker was resumed early, TimeoutError when the lag
    stays."""
    import os
    import signal

    from jobstream.kafka import group_lag
    try:
        yield
        assert stopped(frozen.popen.pid), "the frozen worker was resumed early: inconclusive"
    finally:
        os.kill(frozen.popen.pid, signal.SIGCONT)
    topics = [settings.topic(t) for t in ("job.chunks_ready", "job.llm_done", "job.validated")]
    wait_for(lambda: group_lag(settings, settings.group("jobstream-streams"), topics) == 0, 90,
             "the stage topics consumed and committed after the resume", procs.logs,
             every_s=1.0)


def assert_one_succeeded_attempt_per_chunk(url: str, job_id: Any) -> list[dict[str, Any]]:
    """Assert that job ``job_id`` has more than one chunk and exactly one ``succeeded``
    provider attempt per chunk (no other attempt): a frozen or stale run's answers were never
    recorded beside the live run's. Returns the chunks (``idx``, ``llm_attempt_id``,
    ``outcome`` of the bound attempt) ordered by ``idx``."""
    chunks = query(url, "SELECT c.idx, c.llm_attempt_id, a.outcome FROM chunk c LEFT JOIN "
                        "provider_attempt a ON a.attempt_id = c.llm_attempt_id "
                        "WHERE c.job_id = %s ORDER BY c.idx", (job_id,))
    assert len(chunks) > 1, chunks
    attempts = query(url, "SELECT chunk_idx, outcome, count(*) AS n FROM provider_attempt "
                          "WHERE job_id = %s GROUP BY chunk_idx, outcome", (job_id,))
    assert sorted((a["chunk_idx"], a["outcome"], a["n"]) for a in attempts) == [
        (c["idx"], "succeeded", 1) for c in chunks], attempts
    return chunks


def insert_keyed_rows(url: str, topic: str, keys: list[str], n: int, *,
                      pad_bytes: int = 0) -> None:
    """Write ``n`` outbox rows per key of ``keys`` for ``topic`` (one transaction), interleaved
    by key, each payload ``{"k": key, "n": i}`` with i = 0..n-1 in id order: the backlog of a
    relay ordering probe (:func:`first_deliveries` reads it back). ``pad_bytes`` > 0: each
    payload starts with a ``"pad"`` string of that many characters (big rows)."""
    from psycopg.types.json import Jsonb

    from jobstream.db import QUERIES
    pad = f'"pad": "{"p" * pad_bytes}", ' if pad_bytes else ""
    with psycopg.connect(url) as conn, conn.cursor() as cur:
        cur.executemany(QUERIES["outbox_insert"], [
            (topic, k, f'{{{pad}"k": "{k}", "n": {i}}}'.encode(), Jsonb({"key": k}),
             uuid.uuid4(), "test.row") for i in range(n) for k in keys])


def first_deliveries(settings: Settings, topic: str) -> dict[str, list[int]]:
    """Key -> the ``n`` of :func:`insert_keyed_rows`' rows in the order of their FIRST
    delivery on ``topic`` (a re-delivered copy, allowed at-least-once, is left out): per-key
    order holds when each list is 0..n-1."""
    firsts: dict[str, list[int]] = {}
    seen: set[tuple[str, int]] = set()
    for m in read_topic(settings, topic):
        key, i = m.key().decode(), int(m.value().decode().split('"n": ')[1].rstrip("}"))
        if (key, i) not in seen:
            seen.add((key, i))
            firsts.setdefault(key, []).append(i)
    return firsts


def create_limited_topic(admin: Any, topic: str, max_message_bytes: int,
                         partitions: int = 1) -> None:
    """Create ``topic`` with ``admin`` (a confluent-kafka AdminClient) at the topic limit
    ``max_message_bytes`` (bytes; below the producer's ``message.max.bytes`` it is a "narrow"
    topic for the relay) and wait (30 s) until the broker's metadata lists it."""
    from confluent_kafka.admin import NewTopic
    admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1,
                                  config={"max.message.bytes": str(max_message_bytes)})]
                        )[topic].result(30)
    wait_for(lambda: topic in admin.list_topics(timeout=10).topics, 30, f"topic {topic}")
