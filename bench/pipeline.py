"""Jobs/s and per-hop latency through every stage, with 1, 2 and 4 worker processes.

For each worker count (``--workers``, default ``1,2,4``) the run starts, on a fresh database
and topic prefix: one ``jobstream relay``, one ``jobstream consume-ready`` (the example
downstream) and N ``jobstream worker`` processes (all six stage agents each, the ``local``
profile: an in-process model with zero network latency). Once the workers' consumer group is
stable and two warm-up jobs went through, ``--jobs`` distinct documents are submitted at once
(``document.uploaded``) and the run waits until every job's ``job.ready`` was applied.

Reported:

* ``jobs_per_s``: jobs / (first submit .. last job.ready applied), and to ``succeeded``;
* ``end_to_end_ms``: per job, submit -> applied (p50/p90/p99/max);
* ``hops``: for each event of the chain, medians (and p90) of the three legs, from the
  rows' timestamps: ``relay`` (the outbox row's insert -> published, i.e. after the
  broker's ack), ``pickup`` (published -> the next stage claimed it: Kafka fetch, faust, the
  claim transaction, and the wait behind earlier jobs of the burst) and ``work`` (claimed ->
  the completion transaction began); ``hops_idle``: the same for ``--idle-jobs`` jobs sent
  one at a time on an idle pipeline (no queueing), and ``idle_intake_to_applied_ms``: per such
  job, the intake commit (``job.created_at``) -> its ``job.ready`` applied downstream; the
  idle hops are also split at the broker's append time (``to_kafka_ms`` / ``from_kafka_ms``),
  with ``written_ms`` (the writing transaction's start -> its outbox row) before them, and
  ``legs_sum_of_hop_medians_ms`` says where the intake -> applied time goes;
* ``submit_to_intake_commit_ms`` of the burst, with ``submit_produce_ms`` and
  ``submit_to_intake_split`` (submit -> appended by the broker -> intake). Every submit of a
  run uses one producer kept for the run (``--cold-producer``: a new one for the burst);
* ``where_the_time_goes``: Postgres transactions per job (``pg_stat_database.xact_commit``
  of the run's database), Kafka messages per job, and the CPU milliseconds per job of each of
  our processes (workers, relay, downstream), of all Postgres processes, of the Kafka broker
  and of the whole machine (the last three shared with whatever else runs), from ``/proc``;
  ``postgres_bench_db`` counts only the backends connected to the run's database;
* ``statements_per_job`` (when the server preloads ``pg_stat_statements``): per statement of
  the run's database, calls, rows and execution milliseconds per job of the burst;
* ``postgres_per_job``: WAL bytes per job (server-wide), per table rows inserted / updated /
  HOT-updated / deleted per job and per index its scans per job (:func:`table_counters`);
* with ``--profile DIR``: ``py-spy`` samples of ``worker0`` and the relay during the burst,
  written to ``DIR`` (collapsed stacks) with a summary of the hottest functions in the JSON;
* ``targets_met``: the targets of issue 12 for this run (jobs/s with 2 workers, whole-machine
  CPU per job, Postgres transactions per job, burst submit -> intake commit p50, idle intake
  -> ``job.ready`` applied p50).
"""

from __future__ import annotations

import os
import re
import subprocess
import time
import uuid
from collections import Counter
from pathlib import Path
from tempfile import mkdtemp
from typing import Any

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient

from bench.common import (
    base_parser,
    emit,
    ensure_all_topics,
    isolated,
    latency_summary,
    log,
    machine,
    pct,
    pyplot,
    pyspy_record,
    pyspy_stacks,
    start_cli,
    stop,
)
from jobstream.db import connect
from jobstream.kafka import base_config, read_to_end
from jobstream.producer import submit, submit_producer
from jobstream.settings import Settings
from schemas.events import DocumentRef, DocumentUploaded, DocumentUploadedPayload
from schemas.pipeline import PIPELINE

LICENSES = Path("/usr/share/common-licenses")
CHAIN = tuple(s.emits for s in PIPELINE.stages)
#: The checkpoint written by the stage that consumes each event (job.ready: downstream).
NEXT_STAGE = {s.consumes: s.name for s in PIPELINE.job_stages}
#: The stage whose transaction writes each event's outbox row (job.accepted: intake).
PRODUCER = {s.emits: s.name for s in PIPELINE.stages}

#: Issue 12's targets for this benchmark (same run, same machine).
TARGETS = {"jobs_per_s_with_2_workers": 250.0, "machine_cpu_ms_per_job": 8.0,
           "postgres_tx_per_job": 14.0, "burst_submit_to_intake_commit_p50_ms": 300.0,
           "idle_intake_to_applied_p50_ms": 60.0}


def corpus_text() -> str:
    parts = []
    for name in ("GPL-3", "Apache-2.0", "MPL-2.0", "LGPL-3", "Artistic"):
        p = LICENSES / name
        if p.exists():
            parts.append(p.read_text(errors="replace"))
    return "\n".join(parts) or ("Lorem ipsum dolor sit amet, consectetur adipiscing elit. " * 2000)


def documents(n: int, size: int, tenant: str) -> list[DocumentUploaded]:
    """``n`` distinct plain-text documents of ``size`` bytes (slices of licence texts with a
    unique first line, so every one is its own job)."""
    import base64
    import hashlib
    text = corpus_text()
    out = []
    for i in range(n):
        start = (i * 7919) % max(1, len(text) - size)
        body = f"Document {i} {uuid.uuid4().hex}\n{text[start:start + size]}".encode()[:size]
        out.append(DocumentUploaded(
            tenant_id=tenant, idempotency_key=f"{tenant}-{i}",
            payload=DocumentUploadedPayload(document=DocumentRef(
                filename=f"doc-{i}.txt", sha256=hashlib.sha256(body).hexdigest(),
                size_bytes=len(body), content_b64=base64.b64encode(body).decode()))))
    return out


def wait_group_stable(settings: Settings, group: str, members: int, timeout_s: float) -> float:
    """Wait until ``group`` is Stable with ``members`` members; returns the seconds waited."""
    admin = AdminClient(base_config(settings))
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        try:
            d = admin.describe_consumer_groups([group])[group].result(timeout=10)
            if d.state.name == "STABLE" and len(d.members) == members:
                return time.monotonic() - start
        except Exception:  # not there yet
            pass
        time.sleep(0.5)
    raise TimeoutError(f"group {group} not stable with {members} members after {timeout_s}s")


def wait_applied(url: str, tenant: str, n: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    with connect(url, autocommit=True) as conn:
        while time.monotonic() < deadline:
            # One statement per poll: each counts one transaction of the run's database.
            row = conn.execute(
                "SELECT (SELECT count(*) FROM downstream.document_analysis WHERE tenant_id = "
                "%s) AS n, (SELECT count(*) FROM job WHERE tenant_id = %s AND status = "
                "'failed') AS failed", (tenant, tenant)).fetchone()
            assert row is not None
            if row["n"] >= n:
                return
            if row["failed"]:
                raise RuntimeError(f"{row['failed']} jobs of {tenant} failed")
            time.sleep(0.1)
    raise TimeoutError(f"not all {n} jobs of {tenant} applied after {timeout_s}s")


def xact_commits(url: str) -> int:
    with connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT xact_commit FROM pg_stat_database "
                           "WHERE datname = current_database()").fetchone()
    assert row is not None
    return int(row["xact_commit"])


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (seconds), from /proc."""
    import os
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def shared_cpu_seconds() -> dict[str, Any]:
    """Per pid, CPU seconds so far of every Postgres and Kafka (java) process, and the busy
    time of the whole machine (all cores, /proc/stat)."""
    import os
    procs: dict[int, tuple[str, float]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            comm = (d / "comm").read_text().strip()
        except OSError:
            continue
        key = "postgres" if comm.startswith("postgres") else "kafka" if comm == "java" else None
        if key:
            procs[int(d.name)] = (key, cpu_seconds(int(d.name)))
    ticks = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    busy = sum(ticks) - ticks[3] - ticks[4]  # all but idle and iowait
    return {"procs": procs, "machine_busy": busy / os.sysconf("SC_CLK_TCK")}


def shared_cpu_delta(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
    """CPU seconds between two :func:`shared_cpu_seconds` readings: per kind, over the
    processes alive at the end (one that exited meanwhile is not counted: a lower bound)."""
    out = {"postgres": 0.0, "kafka": 0.0}
    for pid, (key, t) in b["procs"].items():
        before = a["procs"].get(pid)
        out[key] += t - (before[1] if before and before[0] == key else 0.0)
    out["machine_busy"] = b["machine_busy"] - a["machine_busy"]
    return out


def kafka_requests(pids: dict[str, int], bootstrap: str) -> dict[str, tuple[int, int]]:
    """Per process name, the TCP data segments and bytes it has sent to the broker(s) of
    ``bootstrap`` so far over its open sockets (``ss -tinp``; ~one segment per Kafka request:
    produce, fetch, offset commit, heartbeat, metadata). Sockets closed meanwhile are not
    counted (a lower bound); {} without ``ss``."""
    ports = {h.rsplit(":", 1)[1] for h in bootstrap.split(",") if ":" in h}
    try:
        out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True,
                             timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    by_pid = {pid: name for name, pid in pids.items()}
    totals: dict[str, tuple[int, int]] = {name: (0, 0) for name in pids}
    lines = out.splitlines()
    for head, info in zip(lines, lines[1:], strict=False):
        cols = head.split()
        if head[:1].isspace() or len(cols) < 5 or cols[4].rsplit(":", 1)[-1] not in ports:
            continue
        m = re.search(r"pid=(\d+)", head)
        name = by_pid.get(int(m.group(1))) if m else None
        if name is None:
            continue
        segs = re.search(r"data_segs_out:(\d+)", info)
        sent = re.search(r"bytes_sent:(\d+)", info)
        n, b = totals[name]
        totals[name] = (n + int(segs.group(1)) if segs else n,
                        b + int(sent.group(1)) if sent else b)
    return totals


def bench_db_backends(url: str) -> list[int]:
    """Pids of the Postgres backends connected to the run's database (our processes' pools)."""
    with connect(url, autocommit=True) as conn:
        rows = conn.execute("SELECT pid FROM pg_stat_activity WHERE datname = "
                            "current_database() AND pid <> pg_backend_pid()").fetchall()
    return [int(r["pid"]) for r in rows]


def statements_available(url: str) -> bool:
    """True when the server preloads ``pg_stat_statements`` (the extension is then created
    in the run's database). Loading it needs a server restart: never done here."""
    with connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT current_setting('shared_preload_libraries') AS libs"
                           ).fetchone()
        if row is None or "pg_stat_statements" not in row["libs"]:
            return False
        conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
        conn.execute("SELECT pg_stat_statements_reset(0, "
                     "(SELECT oid FROM pg_database WHERE datname = current_database()), 0)")
    return True


def table_counters(url: str) -> dict[str, Any]:
    """Cumulative counters of the run's database (a :func:`table_counters_per_job` reading
    subtracts two): the server's WAL position (bytes; server-wide), per table the rows
    inserted / updated / HOT-updated / deleted, per index its scans."""
    with connect(url, autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        lsn = conn.execute("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn AS b, "
                           "pg_current_wal_lsn()::text AS lsn").fetchone()
        tables = conn.execute(
            "SELECT schemaname || '.' || relname AS t, n_tup_ins, n_tup_upd, n_tup_hot_upd, "
            "n_tup_del FROM pg_stat_user_tables").fetchall()
        indexes = conn.execute(
            "SELECT schemaname || '.' || indexrelname AS i, idx_scan "
            "FROM pg_stat_user_indexes").fetchall()
    assert lsn is not None
    return {"wal": int(lsn["b"]), "lsn": lsn["lsn"],
            "tables": {r["t"]: (r["n_tup_ins"], r["n_tup_upd"], r["n_tup_hot_upd"],
                                r["n_tup_del"]) for r in tables},
            "indexes": {r["i"]: r["idx_scan"] for r in indexes}}


def table_counters_per_job(a: dict[str, Any], b: dict[str, Any], jobs: int) -> dict[str, Any]:
    """Per job of the burst between two :func:`table_counters` readings: WAL bytes
    (server-wide: other databases' writes count too) and the burst's WAL range (``pg_waldump
    --start A --end B --stats=record`` tells what wrote it), per table rows inserted / updated /
    of those HOT (no index entry written) / deleted, and the indexes no statement scanned."""
    tables = {}
    for t, (ins, upd, hot, dele) in b["tables"].items():
        i0, u0, h0, d0 = a["tables"].get(t, (0, 0, 0, 0))
        if (ins - i0) or (upd - u0) or (dele - d0):
            tables[t] = {"ins": round((ins - i0) / jobs, 2), "upd": round((upd - u0) / jobs, 2),
                         "hot_upd": round((hot - h0) / jobs, 2),
                         "del": round((dele - d0) / jobs, 2)}
    return {"wal_bytes_per_job": round((b["wal"] - a["wal"]) / jobs),
            "wal_lsn_range": [a["lsn"], b["lsn"]],
            "rows_per_job": tables,
            "indexes_scanned_per_job": {i: round((n - a["indexes"].get(i, 0)) / jobs, 2)
                                        for i, n in sorted(b["indexes"].items())}}


def statements_per_job(url: str, jobs: int, top: int = 60) -> dict[str, Any]:
    """The run database's statements since the reset: the totals per job and the ``top``
    most called statements: calls, rows and execution milliseconds per job (``jobs`` = the
    burst's job count). ``BEGIN`` calls count the explicit transactions; ``xact_commit``
    also counts every statement run outside one (autocommit)."""
    with connect(url, autocommit=True) as conn:
        total = conn.execute(
            "SELECT sum(calls) AS calls, sum(total_exec_time) AS ms FROM pg_stat_statements s "
            "JOIN pg_database d ON d.oid = s.dbid WHERE d.datname = current_database()"
        ).fetchone()
        rows = conn.execute(
            "SELECT calls, rows, total_exec_time AS ms, total_plan_time AS plan_ms, plans, "
            "wal_bytes, shared_blks_hit + shared_blks_read AS blks, query "
            "FROM pg_stat_statements s "
            "JOIN pg_database d ON d.oid = s.dbid WHERE d.datname = current_database() "
            "ORDER BY calls DESC LIMIT %s", (top,)).fetchall()
    assert total is not None
    return {"calls_per_job": round(float(total["calls"] or 0) / jobs, 2),
            "exec_ms_per_job": round(float(total["ms"] or 0) / jobs, 3),
            "statements": [{"calls_per_job": round(r["calls"] / jobs, 2),
                            "rows_per_job": round(r["rows"] / jobs, 2),
                            "exec_ms_per_job": round(float(r["ms"]) / jobs, 3),
                            "plan_ms_per_job": round(float(r["plan_ms"]) / jobs, 3),
                            "plans_per_job": round(r["plans"] / jobs, 2),
                            "wal_bytes_per_call": round(float(r["wal_bytes"])
                                                        / max(1, r["calls"])),
                            "blocks_per_call": round(float(r["blks"]) / max(1, r["calls"]), 1),
                            "query": " ".join(str(r["query"]).split())[:160]} for r in rows]}


def start_profiler(pid: int, out: Path) -> subprocess.Popen[bytes] | None:
    """``py-spy record --gil`` of ``pid`` (collapsed stacks; only samples holding the GIL,
    i.e. Python CPU) until stopped with :func:`stop_profiler`; None without py-spy."""
    return pyspy_record(pid, out, "--gil", rate=200)


def _frame(raw: str) -> str:
    """``func (path/to/file.py:12)`` -> ``func (to/file.py)``: one key per function."""
    m = re.match(r"^(.*) \((.*?)(?::\d+)?\)$", raw)
    if not m:
        return raw
    return f"{m.group(1)} ({'/'.join(m.group(2).split('/')[-2:])})"


def stop_profiler(proc: subprocess.Popen[bytes] | None, out: Path, top: int = 25
                  ) -> dict[str, Any] | None:
    """Stop a :func:`start_profiler` (SIGINT: py-spy writes its file) and summarise the
    collapsed stacks: the share of samples per function, self (the innermost frame) and
    inclusive (anywhere in the stack), ours (repository code) marked by their path."""
    stacks = pyspy_stacks(proc, out)
    if stacks is None:
        return None
    own: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    total = 0
    for raw, count in stacks:
        total += count
        frames = [_frame(f) for f in raw]
        own[frames[-1]] += count
        for f in set(frames):
            incl[f] += count
    pct_of = (lambda c: round(100 * c / total, 1)) if total else (lambda c: 0.0)
    return {"samples": total, "file": str(out),
            "self_pct": {k: pct_of(v) for k, v in own.most_common(top)},
            "inclusive_pct": {k: pct_of(v) for k, v in incl.most_common(top)}}


def run_idle_jobs(s: Settings, args: Any, producer: Producer) -> dict[str, Any]:
    """``--idle-jobs`` jobs, one at a time on the idle pipeline (sent by ``producer``): per job
    the intake commit -> ``job.ready`` applied (ms), and the per-hop legs."""
    for i, doc in enumerate(documents(args.idle_jobs, args.doc_bytes, "idle")):
        submit(s, [doc], producer=producer)
        wait_applied(s.database_url, "idle", i + 1, 120)
        time.sleep(0.2)  # let the relay and the agents go back to waiting
    with connect(s.database_url, autocommit=True) as conn:
        ms = [float(r["ms"]) for r in conn.execute(
            "SELECT extract(epoch FROM a.applied_at - j.created_at) * 1000 AS ms FROM job j "
            "JOIN downstream.document_analysis a USING (job_id) WHERE j.tenant_id = 'idle'")]
    hops = hop_breakdown(s.database_url, "idle", appended_at(s))
    hops.pop("_intake_created")
    # Where the intake -> applied time goes: each leg's medians summed over the six hops
    # (medians do not add up exactly to the p50 of the sums; idle12).
    legs = {leg: round(sum(h[leg]["p50"] for h in hops.values() if leg in h), 1)
            for leg in ("written_ms", "to_kafka_ms", "from_kafka_ms")}
    return {"intake_to_applied_ms": latency_summary(ms), "hops": hops,
            "legs_sum_of_hop_medians_ms": legs}


def appended_at(s: Settings) -> dict[tuple[str, str], float]:
    """(job id, event type) -> the broker's append time (epoch seconds) of every chain event
    in Kafka so far: the topics are created with ``LogAppendTime`` (bench.common), so a
    message's timestamp is when it reached the broker."""
    import json
    out: dict[tuple[str, str], float] = {}
    topics = [s.topic(t) for t in PIPELINE.topics() if t != "document.uploaded"]
    for m in read_to_end(s, topics, timeout_s=60):
        key, value = m.key(), m.value()
        if key is None or value is None:
            continue
        out[(key.decode(), json.loads(value)["event_type"])] = m.timestamp()[1] / 1000
    return out


def burst_intake_split(s: Settings, tenant: str, t0: float) -> dict[str, Any]:
    """The burst's submit -> intake split at the broker's append time of each
    ``document.uploaded`` (``LogAppendTime``, matched to its job by idempotency key):
    ``submit_to_kafka_ms`` (t0 -> appended: encoding, the producer's batching and request)
    and ``kafka_to_intake_ms`` (appended -> the intake transaction's ``now()``: the workers'
    fetch, faust, decode, the batcher's wait and the batches before it)."""
    with connect(s.database_url, autocommit=True) as conn:
        created = {r["k"]: float(r["c"]) for r in conn.execute(
            "SELECT idempotency_key AS k, extract(epoch FROM created_at) AS c FROM job "
            "WHERE tenant_id = %s", (tenant,))}
    to_kafka, from_kafka = [], []
    for m in read_to_end(s, [s.topic("document.uploaded")], timeout_s=60):
        key = (m.key() or b"").decode()
        if key in created:
            at = m.timestamp()[1] / 1000
            to_kafka.append((at - t0) * 1000)
            from_kafka.append((created[key] - at) * 1000)
    return {"submit_to_kafka_ms": latency_summary(to_kafka),
            "kafka_to_intake_ms": latency_summary(from_kafka)}


def hop_breakdown(url: str, tenant: str,
                  appended: dict[tuple[str, str], float] | None = None) -> dict[str, Any]:
    """Per event of the chain: relay, pickup and work legs (ms), medians and p90. With
    ``appended`` (:func:`appended_at`), also the same hop split at the broker's append time:
    ``to_kafka_ms`` (outbox row written -> appended: the writing transaction's commit, the
    relay's wake-up, fetch and linger, the produce request) and ``from_kafka_ms`` (appended
    -> the next stage claimed it, or ``job.ready`` applied: the consumer's fetch, faust,
    decode, the claim). ``relay_ms`` ends at the relay's handling of the broker's ack, which
    can come after the next stage's claim (a negative ``pickup_ms``). ``written_ms``: the
    writing transaction's start (``now()``: the producing stage's ``started_at``, the intake's
    for ``job.accepted``) -> the outbox row's insert (``clock_timestamp()``): its claim, work
    and completion up to the row (not its commit, which is in ``to_kafka_ms``). So per hop
    ``written_ms`` + ``to_kafka_ms`` + ``from_kafka_ms`` runs from one stage transaction's
    start to the next one's, and over the chain from the intake's to the ``job.ready``
    apply's (``applied_at``, its transaction's start)."""
    q = """
    SELECT o.event_type, j.job_id::text AS job_id,
           extract(epoch FROM o.created_at) AS written,
           extract(epoch FROM o.created_at - p.started_at) * 1000 AS written_ms,
           extract(epoch FROM coalesce(s.started_at, a.applied_at)) AS picked,
           extract(epoch FROM o.published_at - o.created_at) * 1000 AS relay_ms,
           extract(epoch FROM coalesce(s.started_at, a.applied_at) - o.published_at) * 1000
               AS pickup_ms,
           extract(epoch FROM s.finished_at - s.started_at) * 1000 AS work_ms
      FROM outbox_published o JOIN job j ON o.kafka_key = j.job_id::text
      LEFT JOIN job_stage s ON s.job_id = j.job_id AND s.stage = %s
      LEFT JOIN job_stage p ON p.job_id = j.job_id AND p.stage = %s
      LEFT JOIN downstream.document_analysis a ON a.job_id = j.job_id AND %s = 'job.ready'
     WHERE j.tenant_id = %s AND o.event_type = %s
    """
    out: dict[str, Any] = {}
    with connect(url, autocommit=True) as conn:
        for ev in CHAIN:
            rows = conn.execute(q, (NEXT_STAGE.get(ev, "none"), PRODUCER.get(ev, "none"), ev,
                                    tenant, ev)).fetchall()
            if appended is not None:
                for r in rows:
                    at = appended.get((r["job_id"], ev))
                    r["to_kafka_ms"] = None if at is None else (at - float(r["written"])) * 1000
                    r["from_kafka_ms"] = (None if at is None or r["picked"] is None
                                          else (float(r["picked"]) - at) * 1000)
            legs: dict[str, Any] = {}
            for leg in ("relay_ms", "pickup_ms", "work_ms", "written_ms", "to_kafka_ms",
                        "from_kafka_ms"):
                vals = [float(r[leg]) for r in rows if r.get(leg) is not None]
                if vals:
                    legs[leg] = {"p50": round(pct(vals, 50) or 0, 1),
                                 "p90": round(pct(vals, 90) or 0, 1)}
            out[ev] = legs
        intake = conn.execute(
            "SELECT extract(epoch FROM j.created_at) AS created FROM job j "
            "WHERE j.tenant_id = %s", (tenant,)).fetchall()
    out["_intake_created"] = [float(r["created"]) for r in intake]
    return out


def run_workers(args: Any, workers: int, relays: int = 1) -> dict[str, Any]:
    logdir = Path(mkdtemp(prefix=f"bench-pipeline-{workers}-"))
    with isolated(args, f"pipe{workers}") as s:
        ensure_all_topics(s)
        procs = {"downstream": start_cli(s, logdir, "downstream", "consume-ready")}
        for i in range(relays):
            procs["relay" if i == 0 else f"relay{i}"] = start_cli(s, logdir, f"relay{i}",
                                                                   "relay")
        for i in range(workers):
            procs[f"worker{i}"] = start_cli(s, logdir, f"worker{i}", "worker",
                                            log_level=args.worker_log_level)
        profiles: dict[str, Any] = {}
        try:
            waited = wait_group_stable(s, s.group("jobstream-streams"), workers, 180)
            log(f"{workers} worker(s): group stable after {waited:.1f}s; warming up")
            # One producer for the whole run, as a submitting service keeps one: a new
            # idempotent producer's first send waits ~0.5 s for its producer ID (see
            # jobstream.producer.produce_raw), which is not the pipeline's latency.
            producer = submit_producer(s)
            submit(s, documents(2, args.doc_bytes, "warmup"), producer=producer)
            wait_applied(s.database_url, "warmup", 2, 120)
            idle = run_idle_jobs(s, args, producer) if args.idle_jobs else None
            tenant = "bench"
            docs = documents(args.jobs, args.doc_bytes, tenant)
            with_statements = statements_available(s.database_url)
            spies = {}
            if args.profile:
                Path(args.profile).mkdir(parents=True, exist_ok=True)
                for name in ("worker0", "relay"):
                    out = Path(args.profile) / f"pipeline-{workers}w-{name}.txt"
                    spies[name] = (start_profiler(procs[name].pid, out), out)
            cpu0 = {k: cpu_seconds(p.pid) for k, p in procs.items()}
            shared0 = shared_cpu_seconds()
            x0 = xact_commits(s.database_url)
            tc0 = table_counters(s.database_url)
            kr0 = kafka_requests({k: p.pid for k, p in procs.items()},
                                 s.kafka_bootstrap_servers)
            log(f"{workers} worker(s): submitting {args.jobs} documents")
            t0 = time.time()
            submit(s, docs, producer=None if args.cold_producer else producer)
            submit_s = time.time() - t0
            wait_applied(s.database_url, tenant, args.jobs, args.timeout)
            x1 = xact_commits(s.database_url)
            tc1 = table_counters(s.database_url)
            kr1 = kafka_requests({k: p.pid for k, p in procs.items()},
                                 s.kafka_bootstrap_servers)
            cpu1 = {k: cpu_seconds(p.pid) for k, p in procs.items()}
            shared1 = shared_cpu_seconds()
            pg_pids = bench_db_backends(s.database_url)
            for name, (spy, out) in spies.items():
                profiles[name] = stop_profiler(spy, out)
            statements = (statements_per_job(s.database_url, args.jobs) if with_statements
                          else None)
            with connect(s.database_url, autocommit=True) as conn:
                r = conn.execute(
                    "SELECT extract(epoch FROM max(a.applied_at)) AS applied, "
                    "extract(epoch FROM max(j.finished_at)) AS finished, "
                    "count(*) FILTER (WHERE j.status = 'succeeded') AS ok, "
                    "avg((SELECT count(*) FROM chunk c WHERE c.job_id = j.job_id)) AS chunks "
                    "FROM job j LEFT JOIN downstream.document_analysis a USING (job_id) "
                    "WHERE j.tenant_id = %s", (tenant,)).fetchone()
                e2e = [float(x["ms"]) for x in conn.execute(
                    "SELECT (extract(epoch FROM a.applied_at) - %s) * 1000 AS ms FROM "
                    "downstream.document_analysis a WHERE a.tenant_id = %s",
                    (t0, tenant)).fetchall()]
                kafka_msgs = conn.execute(
                    "SELECT count(*) AS n FROM (SELECT kafka_key FROM outbox_published "
                    "UNION ALL SELECT kafka_key FROM outbox) o JOIN job j ON "
                    "o.kafka_key = j.job_id::text WHERE j.tenant_id = %s",
                    (tenant,)).fetchone()
            assert r is not None and kafka_msgs is not None
            hops = hop_breakdown(s.database_url, tenant)
            intake_ms = [(c - t0) * 1000 for c in hops.pop("_intake_created")]
            intake_split = burst_intake_split(s, tenant, t0)
        finally:
            stop(list(procs.values()))
    n = args.jobs
    cpu = {k: round((cpu1[k] - cpu0[k]) / n * 1000, 2) for k in procs}
    worker_cpu = sum(v for k, v in cpu.items() if k.startswith("worker"))
    shared = {k: round(v / n * 1000, 2) for k, v in shared_cpu_delta(shared0, shared1).items()}
    pg_ours = round(sum(shared1["procs"].get(pid, ("", 0.0))[1]
                        - shared0["procs"].get(pid, ("", 0.0))[1] for pid in pg_pids)
                    / n * 1000, 2)
    ours = round(sum(cpu.values()), 2)
    run = {
        "workers": workers, "relays": relays, "jobs": n, "succeeded": r["ok"],
        "uptime_load_before_after": [args.load_before, list(os.getloadavg())],
        "avg_chunks_per_job": round(float(r["chunks"] or 0), 2),
        "jobs_per_s": round(n / (float(r["applied"]) - t0), 1),
        "jobs_per_s_to_succeeded": round(n / (float(r["finished"]) - t0), 1),
        "end_to_end_ms": latency_summary(e2e),
        "submit_to_intake_commit_ms": latency_summary(intake_ms),
        "submit_produce_ms": round(submit_s * 1000, 1),
        "submit_to_intake_split": intake_split,
        "hops": hops,
        "idle": idle,
        "where_the_time_goes": {
            "postgres_tx_per_job": round((x1 - x0) / n, 1),
            "kafka_messages_per_job": 1 + round(int(kafka_msgs["n"]) / n, 2),
            "cpu_ms_per_job": {"workers_total": round(worker_cpu, 2),
                               "relay": cpu["relay"], "downstream": cpu["downstream"],
                               "per_process": cpu,
                               "our_processes": ours,
                               "postgres_bench_db": pg_ours,
                               "ours_plus_postgres_bench_db_plus_kafka": round(
                                   ours + pg_ours + shared["kafka"], 2),
                               "shared_services_and_machine": shared,
                               "note": "postgres (all backends alive at the end), kafka "
                                       "(broker JVM) and machine_busy are shared: they "
                                       "include whatever else ran on the machine meanwhile; "
                                       "postgres_bench_db: only the backends connected to "
                                       "the run's database (not the WAL writer, checkpointer)"},
        },
        "statements_per_job": statements,
        "postgres_per_job": table_counters_per_job(tc0, tc1, n),
        "kafka_requests_per_job": {
            k: {"segments": round((kr1[k][0] - kr0.get(k, (0, 0))[0]) / n, 2),
                "kb_sent": round((kr1[k][1] - kr0.get(k, (0, 0))[1]) / n / 1000, 2)}
            for k in kr1},
        "profiles": profiles or None,
        "logs": str(logdir),
    }
    run["targets_met"] = targets_met(run)
    return run


def targets_met(run: dict[str, Any]) -> dict[str, bool | None]:
    """Issue 12's targets (:data:`TARGETS`) for one run; None where the run cannot say (the
    jobs/s target is for 2 workers, the idle latency needs ``--idle-jobs``)."""
    t = TARGETS
    w = run["where_the_time_goes"]
    idle = run["idle"]
    return {
        f"jobs_per_s>={t['jobs_per_s_with_2_workers']:g}_with_2_workers":
            run["jobs_per_s"] >= t["jobs_per_s_with_2_workers"] if run["workers"] == 2
            else None,
        f"machine_cpu_ms_per_job<={t['machine_cpu_ms_per_job']:g}":
            w["cpu_ms_per_job"]["shared_services_and_machine"]["machine_busy"]
            <= t["machine_cpu_ms_per_job"],
        f"postgres_tx_per_job<={t['postgres_tx_per_job']:g}":
            w["postgres_tx_per_job"] <= t["postgres_tx_per_job"],
        f"burst_submit_to_intake_commit_p50_ms<={t['burst_submit_to_intake_commit_p50_ms']:g}":
            (run["submit_to_intake_commit_ms"]["p50_ms"] or 1e9)
            <= t["burst_submit_to_intake_commit_p50_ms"],
        f"idle_intake_to_applied_p50_ms<={t['idle_intake_to_applied_p50_ms']:g}":
            None if idle is None else (idle["intake_to_applied_ms"]["p50_ms"] or 1e9)
            <= t["idle_intake_to_applied_p50_ms"],
    }


def plot(result: dict[str, Any], path: str) -> None:
    plt = pyplot()
    runs = result["runs"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    ax1 = axes[0]
    ax1.bar([f"{r['workers']}w/{r['relays']}r" for r in runs], [r["jobs_per_s"] for r in runs])
    ax1.axhline(TARGETS["jobs_per_s_with_2_workers"], color="red", ls="--", lw=1,
                label=f"target {TARGETS['jobs_per_s_with_2_workers']:g} jobs/s (2 workers)")
    ax1.set_xlabel("worker processes / relays")
    ax1.set_ylabel("jobs/s (submit -> applied)")
    ax1.legend()
    r0 = runs[0]
    for ax, hops, title in ((axes[1], (r0["idle"] or {}).get("hops", {}), "idle pipeline"),
                            (axes[2], r0["hops"], f"burst of {r0['jobs']} jobs")):
        bottoms = [0.0] * len(CHAIN)
        for leg in ("relay_ms", "pickup_ms", "work_ms"):
            vals = [max(0.0, hops.get(ev, {}).get(leg, {}).get("p50", 0)) for ev in CHAIN]
            ax.bar([e.removeprefix("job.") for e in CHAIN], vals, bottom=bottoms, label=leg)
            bottoms = [b + v for b, v in zip(bottoms, vals, strict=True)]
        ax.set_ylabel("ms (median)")
        ax.set_title(f"per hop, {r0['workers']} worker(s), {title}")
        ax.tick_params(axis="x", rotation=30)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    p = base_parser(__doc__)
    p.set_defaults(partitions=8)
    p.add_argument("--jobs", type=int, default=200, help="documents per worker count")
    p.add_argument("--workers", default="1,2,4", help="worker process counts")
    p.add_argument("--relays", default="1", help="relay process counts (e.g. 1,2): every "
                   "worker count runs with each")
    p.add_argument("--idle-jobs", type=int, default=5,
                   help="jobs sent one at a time before the burst (idle latency; 0: none)")
    p.add_argument("--profile", metavar="DIR",
                   help="py-spy worker0 and the relay during the burst; stacks to DIR")
    p.add_argument("--doc-bytes", type=int, default=3000,
                   help="document size (bytes); 4000 characters make one chunk")
    p.add_argument("--cold-producer", action="store_true",
                   help="submit the burst with a new producer (as before issue 12's latency "
                        "part: its first send waits ~0.5 s for the producer ID)")
    p.add_argument("--worker-log-level", default="warning",
                   help="the workers' --log-level (info: a line per intake batch, in the "
                        "run's log directory)")
    p.add_argument("--timeout", type=float, default=900.0, help="max seconds per run")
    args = p.parse_args()
    result: dict[str, Any] = {"benchmark": "pipeline", "machine": machine(),
                              "params": {k: v for k, v in vars(args).items() if k != "plot"},
                              "targets": TARGETS, "runs": []}
    for w in [int(x) for x in args.workers.split(",") if x.strip()]:
        for relays in [int(x) for x in args.relays.split(",") if x.strip()]:
            args.load_before = list(os.getloadavg())
            run = run_workers(args, w, relays)
            log(f"{w} worker(s), {relays} relay(s): {run['jobs_per_s']} jobs/s, "
                f"{run['where_the_time_goes']['postgres_tx_per_job']} tx/job")
            result["runs"].append(run)
    result["machine"]["loadavg_after"] = list(os.getloadavg())
    result["targets_met"] = {f"{r['workers']}_workers_{r['relays']}_relays": r["targets_met"]
                             for r in result["runs"]}
    if args.plot:
        plot(result, args.plot)
        result["plot"] = args.plot
    emit(result)


if __name__ == "__main__":
    main()
