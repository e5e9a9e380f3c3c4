"""Interactive latency on an idle system vs during a 100-document batch (issues 4 and 5).

Runs the real processes on a fresh database and topic prefix: one relay, one downstream, one
``worker --lane interactive`` and one ``worker --lane batch`` (separate consumer pools), all
calling the fake OpenAI-compatible provider over HTTP on loopback at a fixed latency
(``--latency``), under the shared provider concurrency limit (``--limit`` slots, one reserved
for interactive work). It measures ``--samples`` interactive documents one after another on the
idle system, then submits a ``--batch`` document batch and, once the batch is calling the
provider, the same number of interactive documents again.

Latency of a job = ``job.finished_at - job.created_at`` (intake commit -> job.ready written,
both Postgres timestamps). Prints one JSON object: idle and under-batch p50/p90/p99 (ms), the
ratio of the p50s, and whether it meets the targets (<= 1.5x, issue 4; <= 1.2x, issue 5).
"""

from __future__ import annotations

import time
from pathlib import Path
from tempfile import mkdtemp
from typing import Any

import psycopg
from psycopg.rows import dict_row

from bench.common import (
    base_parser,
    emit,
    ensure_all_topics,
    isolated,
    latency_summary,
    log,
    machine,
    start_cli,
    stop,
)
from jobstream.drills.fake_provider import FakeProvider
from jobstream.producer import submit, uploaded_event
from jobstream.settings import Settings


def _doc(folder: Path, name: str, chunks: int) -> Path:
    p = folder / name
    para = f"{name} is a document about things. " + "It has a sentence that says little. " * 20
    p.write_text("\n\n".join(f"Part {i}. {para}" for i in range(chunks)))
    return p


def _status(url: str, key: str) -> dict[str, Any] | None:
    with psycopg.connect(url, row_factory=dict_row) as conn:
        return conn.execute(
            "SELECT j.status, extract(epoch FROM j.finished_at - j.created_at) * 1000 AS ms "
            "FROM job j JOIN job_request r USING (job_id) WHERE r.idempotency_key = %s",
            (key,)).fetchone()


def _interactive(s: Settings, folder: Path, tag: str, n: int, chunks: int,
                 timeout_s: float) -> list[float]:
    out = []
    for i in range(n):
        key = f"{tag}-{i}"
        submit(s, [uploaded_event(_doc(folder, f"{key}.txt", chunks), tenant_id="people",
                                  idempotency_key=key, settings=s, lane="interactive",
                                  model_profile="custom")])
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            st = _status(s.database_url, key)
            if st and st["status"] == "succeeded":
                out.append(float(st["ms"]))
                break
            time.sleep(0.02)
        else:
            raise TimeoutError(f"interactive job {key} did not finish in {timeout_s}s")
    return out


def main() -> None:
    p = base_parser(__doc__)
    p.add_argument("--latency", type=float, default=0.2, help="provider latency (seconds)")
    p.add_argument("--limit", type=int, default=4, help="shared provider concurrency limit")
    p.add_argument("--batch", type=int, default=100, help="documents in the batch")
    p.add_argument("--samples", type=int, default=10, help="interactive documents per phase")
    p.add_argument("--chunks", type=int, default=2, help="chunks per document")
    p.add_argument("--timeout", type=float, default=120.0, help="max seconds per job")
    args = p.parse_args()
    folder = Path(mkdtemp(prefix="jsbench-iub-"))
    result: dict[str, Any] = {"benchmark": "interactive_under_batch", "machine": machine(),
                              "params": {k: v for k, v in vars(args).items() if k != "plot"}}
    with FakeProvider({"default": {"latency_s": args.latency}}) as fake, \
            isolated(args, "iub", provider_base_url=fake.base_url,
                     provider_max_concurrency=args.limit, provider_interactive_reserved=1,
                     llm_concurrency=args.limit, chunk_size_chars=900) as s:
        ensure_all_topics(s)
        logs = folder / "logs"
        procs = [start_cli(s, logs, "relay", "relay"),
                 start_cli(s, logs, "downstream", "consume-ready"),
                 start_cli(s, logs, "worker-interactive", "worker", "--lane", "interactive"),
                 start_cli(s, logs, "worker-batch", "worker", "--lane", "batch")]
        try:
            log("warming up")
            _interactive(s, folder, "warm", 2, args.chunks, args.timeout)
            log("idle phase")
            idle = _interactive(s, folder, "idle", args.samples, args.chunks, args.timeout)
            log(f"submitting a {args.batch}-document batch")
            submit(s, [uploaded_event(_doc(folder, f"batch-{i}.txt", args.chunks),
                                      tenant_id="bulk", idempotency_key=f"batch-{i}",
                                      settings=s, lane="batch", model_profile="custom")
                       for i in range(args.batch)])
            while fake.snapshot()["total"] < 2 * (args.samples + 2) * args.chunks + args.limit:
                time.sleep(0.05)  # the batch is calling the provider
            log("interactive phase under the batch")
            busy = _interactive(s, folder, "busy", args.samples, args.chunks, args.timeout)
            with psycopg.connect(s.database_url, row_factory=dict_row) as conn:
                left = conn.execute("SELECT count(*) AS n FROM job WHERE tenant_id = 'bulk' "
                                    "AND status <> 'succeeded'").fetchone()
            result["batch_jobs_unfinished_when_measured"] = left["n"] if left else None
        finally:
            stop(procs)
    i, b = latency_summary(idle), latency_summary(busy)
    ratio = (b["p50_ms"] / i["p50_ms"]) if i.get("p50_ms") else None
    result.update({"idle_ms": i, "under_batch_ms": b, "p50_ratio": ratio,
                   "provider_calls": fake.snapshot()["total"],
                   "targets_met": {"p50_under_batch<=1.5x_idle (issue 4)":
                                   ratio is not None and ratio <= 1.5,
                                   "p50_under_batch<=1.2x_idle (issue 5)":
                                   ratio is not None and ratio <= 1.2}})
    emit(result)


if __name__ == "__main__":
    main()
