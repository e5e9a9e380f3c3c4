"""``jobstream demo``: the whole pipeline on the real documents this machine ships.

Starts the local services when none answer, migrates, creates topics, runs the relay, the stage
workers and the example downstream consumer as separate processes, submits every licence text
in ``/usr/share/common-licenses`` plus a few of them rendered to PDF (fpdf2), shows progress,
prints one row per document and checks that every ``job.ready`` was applied exactly once.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

from fpdf import FPDF
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from jobstream.db import QUERIES as Q
from jobstream.db import connect, migrate
from jobstream.drills.procs import Proc, ProcessRunner, child_env
from jobstream.kafka import ensure_topics
from jobstream.producer import submit, uploaded_event
from jobstream.services import kafka_answers, postgres_answers, run_script
from jobstream.settings import Settings
from schemas.pipeline import PIPELINE

LICENSES = Path("/usr/share/common-licenses")
PDF_SOURCES = ("Apache-2.0", "BSD", "MPL-2.0")
N_STAGES = len(PIPELINE.stages)


def make_pdf(text: str, out: Path, title: str) -> Path:
    """Render ``text`` to a real PDF at ``out`` with fpdf2 (core font, latin-1 text)."""
    pdf = FPDF(format="A4")
    pdf.set_title(title)
    pdf.set_auto_page_break(auto=True, margin=15)
    pdf.add_page()
    pdf.set_font("Helvetica", size=9)
    safe = text.encode("latin-1", "replace").decode("latin-1")
    for line in safe.splitlines():
        pdf.multi_cell(0, 4, line.rstrip() or " ", new_x="LMARGIN", new_y="NEXT")
    pdf.output(str(out))
    return out


def documents(workdir: Path) -> list[Path]:
    """The licence texts (symlinks included: they are real duplicates) plus PDF renderings."""
    texts = sorted(p for p in LICENSES.iterdir() if p.is_file())
    workdir.mkdir(parents=True, exist_ok=True)
    pdfs = [make_pdf((LICENSES / name).read_text(errors="replace"),
                     workdir / f"{name}.pdf", name)
            for name in PDF_SOURCES if (LICENSES / name).is_file()]
    return texts + pdfs


def run(settings: Settings, *, tenant: str | None, timeout_s: float, services: bool,
        console: Console | None = None) -> int:
    """Run the demo; returns 0 only when every job succeeded and every result was applied
    exactly once downstream."""
    console = console or Console(width=max(110, Console().width))
    root = Path(os.environ.get("JOBSTREAM_HOME", Path(__file__).resolve().parents[2] / ".local"))
    if services and not (postgres_answers(settings.database_url)
                         and kafka_answers(settings.kafka_bootstrap_servers)):
        console.print("[bold]Starting local Kafka + Postgres[/] (scripts/services.sh up)…")
        if run_script("up", settings) != 0:
            console.print("[red]services failed to start[/]")
            return 2
    for what, ok in (("Postgres", postgres_answers(settings.database_url)),
                     ("Kafka", kafka_answers(settings.kafka_bootstrap_servers))):
        if not ok:
            console.print(f"[red]{what} does not answer[/]; run `jobstream services up`")
            return 2
    migrate(settings.database_url)
    ensure_topics(settings)
    tenant = tenant or f"demo-{uuid.uuid4().hex[:8]}"
    run_dir = root / "demo" / tenant
    docs = documents(run_dir / "pdf")
    console.print(f"tenant [bold]{tenant}[/]: {len(docs)} documents "
                  f"({sum(d.suffix == '.pdf' for d in docs)} PDF); logs in {run_dir}")

    # The user's own JOBSTREAM_* settings pass on to the children, with these three on top.
    runner = ProcessRunner(child_env(
        keep_jobstream=True, JOBSTREAM_DATABASE_URL=settings.database_url,
        JOBSTREAM_KAFKA_BOOTSTRAP_SERVERS=settings.kafka_bootstrap_servers,
        JOBSTREAM_TOPIC_PREFIX=settings.topic_prefix), run_dir)
    if settings.relay == "debezium":
        # The Debezium relay publishes the outbox (no `jobstream relay`): register it.
        from jobstream.connect import ConnectError, deploy
        try:
            deploy(settings)
        except (ConnectError, RuntimeError) as exc:
            console.print(f"[red]the Debezium relay could not be deployed[/]: {exc}")
            return 2
        console.print(f"Debezium outbox connector running on {settings.connect_url}")
    else:
        runner.start("relay")
    runner.start("worker")
    runner.start("consume-ready", name="downstream")
    try:
        events = [uploaded_event(d, tenant_id=tenant, idempotency_key=f"{tenant}:{d.name}",
                                 settings=settings) for d in docs]
        submit(settings, events)
        ok = _watch(settings, tenant, len(docs), timeout_s, runner.procs, console)
    finally:
        runner.stop_all(20)
    return _report(settings, tenant, docs, console) if ok else 1


def _watch(settings: Settings, tenant: str, n_docs: int, timeout_s: float, procs: list[Proc],
           console: Console) -> bool:
    deadline = time.monotonic() + timeout_s
    cols = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn())
    with Progress(*cols, console=console) as bar, connect(settings.database_url,
                                                          autocommit=True) as conn:
        t_req = bar.add_task("documents accepted", total=n_docs)
        t_stage = bar.add_task("stages done", total=None)
        t_apply = bar.add_task("results applied downstream", total=None)
        while time.monotonic() < deadline:
            for p in procs:
                if p.popen.poll() is not None:
                    console.print(f"[red]{p.name} exited ({p.popen.returncode}); see {p.log}[/]")
                    return False
            requests = conn.execute(Q["requests_of_tenant"], (tenant,)).fetchall()
            jobs = conn.execute(Q["jobs_of_tenant"], (tenant,)).fetchall()
            applied = conn.execute(Q["applied_counts"], (tenant,)).fetchall()
            bar.update(t_req, completed=len(requests))
            bar.update(t_stage, total=N_STAGES * max(1, len(jobs)),
                       completed=sum(j["stages_done"] for j in jobs))
            succeeded = [j for j in jobs if j["status"] == "succeeded"]
            bar.update(t_apply, total=max(1, len(succeeded)),
                       completed=sum(1 for a in applied if a["analyses"] >= 1))
            terminal = all(j["status"] in ("succeeded", "failed", "cancelled") for j in jobs)
            all_applied = all(a["analyses"] >= 1 and a["charges"] >= 1 for a in applied)
            if len(requests) == n_docs and jobs and terminal and all_applied:
                time.sleep(2.0)  # let any straggling duplicate arrive before the check
                return True
            time.sleep(0.5)
    console.print(f"[red]timed out after {timeout_s:.0f}s[/]; logs: {procs[0].log.parent}")
    return False


def _report(settings: Settings, tenant: str, docs: list[Path], console: Console) -> int:
    with connect(settings.database_url, autocommit=True) as conn:
        jobs = {j["job_id"]: j for j in conn.execute(Q["jobs_of_tenant"], (tenant,))}
        requests = {r["idempotency_key"]: r["job_id"]
                    for r in conn.execute(Q["requests_of_tenant"], (tenant,))}
        applied = {a["dedup_key"]: a for a in conn.execute(Q["applied_counts"], (tenant,))}
    table = Table(title=f"jobstream demo — tenant {tenant}")
    for col in ("document", "job id", "stages", "status", "chunks", "provider calls",
                "cost USD", "applied"):
        table.add_column(col, justify="right" if col not in ("document", "status") else "left")
    problems = []
    for d in docs:
        job_id = requests.get(f"{tenant}:{d.name}")
        j = jobs.get(job_id) if job_id else None
        if j is None:
            problems.append(f"{d.name}: no job")
            continue
        a = applied.get(j["dedup_key"])
        n_applied = f"{a['analyses']}/{a['charges']}" if a else "-"
        table.add_row(d.name, str(job_id)[:8], f"{j['stages_done']}/{N_STAGES}", j["status"],
                      str(j["chunks"]), str(j["provider_calls"]), f"{float(j['cost_usd']):.4f}",
                      n_applied)
        if j["status"] != "succeeded":
            problems.append(f"{d.name}: {j['status']} {j['error_code'] or ''}")
    for dk, a in applied.items():
        if a["analyses"] != 1 or a["charges"] != 1:
            problems.append(f"dedup_key {dk[:12]}… applied {a['analyses']}x, charged "
                            f"{a['charges']}x")
    console.print(table)
    distinct = len({j["dedup_key"] for j in jobs.values()})
    console.print(f"{len(docs)} documents -> {len(jobs)} jobs ({distinct} distinct dedup keys; "
                  "identical texts share one job)")
    if problems:
        console.print("[bold red]CHECK FAILED[/]: " + "; ".join(problems))
        return 1
    console.print(f"[bold green]CHECK PASSED[/]: every job.ready applied exactly once "
                  f"({len(applied)} analyses, {len(applied)} ledger charges)")
    return 0
