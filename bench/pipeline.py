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
  rows' timestamps: ``relay`` (the outbox row's insert -> marked published, i.e. after the
  broker's ack), ``pickup`` (published -> the next stage claimed it: Kafka fetch, faust, the
  claim transaction, and the wait behind earlier jobs of the burst) and ``work`` (claimed ->
  the completion transaction began); ``hops_idle``: the same for the two warm-up jobs, which
  run on an idle pipeline (no queueing);
* ``where_the_time_goes``: Postgres transactions per job (``pg_stat_database.xact_commit``
  of the run's database), Kafka messages per job, and the CPU milliseconds per job of each of
  our processes (workers, relay, downstream), of all Postgres processes, of the Kafka broker
  and of the whole machine (the last three shared with whatever else runs), from ``/proc``.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from tempfile import mkdtemp
from typing import Any

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
    start_cli,
    stop,
)
from jobstream.db import connect
from jobstream.kafka import base_config
from jobstream.producer import submit
from jobstream.settings import Settings
from schemas.events import DocumentRef, DocumentUploaded, DocumentUploadedPayload
from schemas.pipeline import PIPELINE

LICENSES = Path("/usr/share/common-licenses")
CHAIN = tuple(s.emits for s in PIPELINE.stages)
#: The checkpoint written by the stage that consumes each event (job.ready: downstream).
NEXT_STAGE = {s.consumes: s.name for s in PIPELINE.job_stages}


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
            row = conn.execute("SELECT count(*) AS n FROM downstream.document_analysis "
                               "WHERE tenant_id = %s", (tenant,)).fetchone()
            assert row is not None
            if row["n"] >= n:
                return
            failed = conn.execute("SELECT count(*) AS n FROM job WHERE tenant_id = %s AND "
                                  "status = 'failed'", (tenant,)).fetchone()
            assert failed is not None
            if failed["n"]:
                raise RuntimeError(f"{failed['n']} jobs of {tenant} failed")
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


def hop_breakdown(url: str, tenant: str) -> dict[str, Any]:
    """Per event of the chain: relay, pickup and work legs (ms), medians and p90."""
    q = """
    SELECT o.event_type,
           extract(epoch FROM o.published_at - o.created_at) * 1000 AS relay_ms,
           extract(epoch FROM coalesce(s.started_at, a.applied_at) - o.published_at) * 1000
               AS pickup_ms,
           extract(epoch FROM s.finished_at - s.started_at) * 1000 AS work_ms
      FROM outbox o JOIN job j ON j.job_id = (o.headers->>'job_id')::uuid
      LEFT JOIN job_stage s ON s.job_id = j.job_id AND s.stage = %s
      LEFT JOIN downstream.document_analysis a ON a.job_id = j.job_id AND %s = 'job.ready'
     WHERE j.tenant_id = %s AND o.event_type = %s
    """
    out: dict[str, Any] = {}
    with connect(url, autocommit=True) as conn:
        for ev in CHAIN:
            rows = conn.execute(q, (NEXT_STAGE.get(ev, "none"), ev, tenant, ev)).fetchall()
            legs: dict[str, Any] = {}
            for leg in ("relay_ms", "pickup_ms", "work_ms"):
                vals = [float(r[leg]) for r in rows if r[leg] is not None]
                if vals:
                    legs[leg] = {"p50": round(pct(vals, 50) or 0, 1),
                                 "p90": round(pct(vals, 90) or 0, 1)}
            out[ev] = legs
        intake = conn.execute(
            "SELECT extract(epoch FROM j.created_at) AS created FROM job j "
            "WHERE j.tenant_id = %s", (tenant,)).fetchall()
    out["_intake_created"] = [float(r["created"]) for r in intake]
    return out


def run_workers(args: Any, workers: int) -> dict[str, Any]:
    logdir = Path(mkdtemp(prefix=f"bench-pipeline-{workers}-"))
    with isolated(args, f"pipe{workers}") as s:
        ensure_all_topics(s)
        procs = {"relay": start_cli(s, logdir, "relay", "relay"),
                 "downstream": start_cli(s, logdir, "downstream", "consume-ready")}
        for i in range(workers):
            procs[f"worker{i}"] = start_cli(s, logdir, f"worker{i}", "worker")
        try:
            waited = wait_group_stable(s, s.group("jobstream-streams"), workers, 180)
            log(f"{workers} worker(s): group stable after {waited:.1f}s; warming up")
            submit(s, documents(2, args.doc_bytes, "warmup"))
            wait_applied(s.database_url, "warmup", 2, 120)
            tenant = "bench"
            docs = documents(args.jobs, args.doc_bytes, tenant)
            cpu0 = {k: cpu_seconds(p.pid) for k, p in procs.items()}
            shared0 = shared_cpu_seconds()
            x0 = xact_commits(s.database_url)
            log(f"{workers} worker(s): submitting {args.jobs} documents")
            t0 = time.time()
            submit(s, docs)
            wait_applied(s.database_url, tenant, args.jobs, args.timeout)
            x1 = xact_commits(s.database_url)
            cpu1 = {k: cpu_seconds(p.pid) for k, p in procs.items()}
            shared1 = shared_cpu_seconds()
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
                    "SELECT count(*) AS n FROM outbox o JOIN job j ON j.job_id = "
                    "(o.headers->>'job_id')::uuid WHERE j.tenant_id = %s",
                    (tenant,)).fetchone()
            assert r is not None and kafka_msgs is not None
            hops = hop_breakdown(s.database_url, tenant)
            intake_ms = [(c - t0) * 1000 for c in hops.pop("_intake_created")]
            idle_hops = hop_breakdown(s.database_url, "warmup")
            idle_hops.pop("_intake_created")
        finally:
            stop(list(procs.values()))
    n = args.jobs
    cpu = {k: round((cpu1[k] - cpu0[k]) / n * 1000, 2) for k in procs}
    worker_cpu = sum(v for k, v in cpu.items() if k.startswith("worker"))
    return {
        "workers": workers, "jobs": n, "succeeded": r["ok"],
        "avg_chunks_per_job": round(float(r["chunks"] or 0), 2),
        "jobs_per_s": round(n / (float(r["applied"]) - t0), 1),
        "jobs_per_s_to_succeeded": round(n / (float(r["finished"]) - t0), 1),
        "end_to_end_ms": latency_summary(e2e),
        "submit_to_intake_commit_ms": latency_summary(intake_ms),
        "hops": hops,
        "hops_idle": idle_hops,
        "where_the_time_goes": {
            "postgres_tx_per_job": round((x1 - x0) / n, 1),
            "kafka_messages_per_job": 1 + round(int(kafka_msgs["n"]) / n, 2),
            "cpu_ms_per_job": {"workers_total": round(worker_cpu, 2),
                               "relay": cpu["relay"], "downstream": cpu["downstream"],
                               "per_process": cpu,
                               "shared_services_and_machine": {
                                   k: round(v / n * 1000, 2) for k, v in
                                   shared_cpu_delta(shared0, shared1).items()},
                               "note": "postgres (all backends alive at the end), kafka "
                                       "(broker JVM) and machine_busy are shared: they "
                                       "include whatever else ran on the machine meanwhile"},
        },
        "logs": str(logdir),
    }


def plot(result: dict[str, Any], path: str) -> None:
    plt = pyplot()
    runs = result["runs"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    ax1 = axes[0]
    ax1.bar([str(r["workers"]) for r in runs], [r["jobs_per_s"] for r in runs])
    ax1.axhline(300, color="red", ls="--", lw=1, label="target 300 jobs/s")
    ax1.set_xlabel("worker processes")
    ax1.set_ylabel("jobs/s (submit -> applied)")
    ax1.legend()
    r0 = runs[0]
    for ax, key, title in ((axes[1], "hops_idle", "idle pipeline"),
                           (axes[2], "hops", f"burst of {r0['jobs']} jobs")):
        bottoms = [0.0] * len(CHAIN)
        for leg in ("relay_ms", "pickup_ms", "work_ms"):
            vals = [max(0.0, r0[key][ev].get(leg, {}).get("p50", 0)) for ev in CHAIN]
            ax.bar([e.removeprefix("job.") for e in CHAIN], vals, bottom=bottoms, label=leg)
            bottoms = [b + v for b, v in zip(bottoms, vals, strict=True)]
        ax.set_ylabel("ms (median)")
        ax.set_title(f"per hop, {r0['workers']} worker(s), {title}")
        ax.tick_params(axis="x", rotation=30)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    p = base_parser(__doc__.split("\n", 1)[0])
    p.set_defaults(partitions=8)
    p.add_argument("--jobs", type=int, default=200, help="documents per worker count")
    p.add_argument("--workers", default="1,2,4", help="worker process counts")
    p.add_argument("--doc-bytes", type=int, default=3000,
                   help="document size (bytes); 4000 characters make one chunk")
    p.add_argument("--timeout", type=float, default=900.0, help="max seconds per run")
    args = p.parse_args()
    result: dict[str, Any] = {"benchmark": "pipeline", "machine": machine(),
                              "params": {k: v for k, v in vars(args).items() if k != "plot"},
                              "runs": []}
    for w in [int(x) for x in args.workers.split(",") if x.strip()]:
        run = run_workers(args, w)
        log(f"{w} worker(s): {run['jobs_per_s']} jobs/s")
        result["runs"].append(run)
    result["machine"]["loadavg_after"] = list(__import__("os").getloadavg())
    result["targets_met"] = {f"pipeline>=300_jobs/s_with_{r['workers']}_workers":
                             r["jobs_per_s"] >= 300 for r in result["runs"]}
    if args.plot:
        plot(result, args.plot)
        result["plot"] = args.plot
    emit(result)


if __name__ == "__main__":
    main()
