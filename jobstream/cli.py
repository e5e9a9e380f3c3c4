"""``jobstream``: run the pipeline's processes, the local services and the demo."""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from jobstream.settings import get_settings


def _logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
def main(log_level: str) -> None:
    """jobstream: documents in (document.uploaded), LLM results out (job.ready), exactly once.

    Configuration comes from JOBSTREAM_* environment variables (also DATABASE_URL and
    KAFKA_BOOTSTRAP_SERVERS); `jobstream config` shows the values in force.
    """
    _logging(log_level)


@main.command()
@click.option("--tenant", help="Tenant id for this run (default: a fresh demo-<id>).")
@click.option("--timeout", "timeout_s", default=600.0, show_default=True,
              help="Give up after this many seconds.")
@click.option("--no-services", is_flag=True,
              help="Do not start local Kafka/Postgres; use the configured ones.")
def demo(tenant: str | None, timeout_s: float, no_services: bool) -> None:
    """Run the whole pipeline on /usr/share/common-licenses (+ PDFs) and check exactly-once.

    Exits 0 only when every job succeeded and every job.ready was applied exactly once.
    """
    from jobstream import demo as demo_mod
    logging.getLogger().setLevel(logging.WARNING)
    sys.exit(demo_mod.run(get_settings(), tenant=tenant, timeout_s=timeout_s,
                          services=not no_services))


@main.command()
@click.argument("action", type=click.Choice(["up", "down", "status", "env"]))
def services(action: str) -> None:
    """Install/start (up), stop (down) or check (status) local Kafka (KRaft) + PostgreSQL.

    Everything lives under ./.local; services that already answer are reused.
    """
    from jobstream.services import run_script
    sys.exit(run_script(action, get_settings()))


@main.command("migrate")
def migrate_cmd() -> None:
    """Apply missing SQL migrations (idempotent, safe to run concurrently)."""
    from jobstream.db import migrate
    applied = migrate(get_settings().database_url)
    click.echo("applied: " + ", ".join(applied) if applied else "schema up to date")


@main.command()
def topics() -> None:
    """Create the pipeline topics and their .dlq twins (partitions from settings)."""
    from jobstream.kafka import ensure_topics
    created = ensure_topics(get_settings())
    click.echo(f"created {len(created)} topics" + (": " + ", ".join(created) if created else ""))


@main.command()
def relay() -> None:
    """Run the outbox relay (one active, others stand by) until SIGTERM."""
    from outbox_relay.relay import main as relay_main
    sys.exit(relay_main(get_settings()))


@main.command()
@click.option("--stages", default="intake,extract,chunk,llm,validate,publish", show_default=True,
              help="Comma-separated agents to run in this process.")
def worker(stages: str) -> None:
    """Run the faust stage workers (consumer group <prefix>jobstream-streams)."""
    from faust import Worker

    from streams.app import create_app
    app, ctx = create_app(get_settings(), [s.strip() for s in stages.split(",") if s.strip()])
    Worker(app, loglevel=logging.getLevelName(logging.getLogger().level).lower(),
           quiet=True).execute_from_commandline()


@main.command("consume-ready")
def consume_ready() -> None:
    """Run the example downstream consumer that applies job.ready exactly once."""
    from consumers.idempotent import run_forever
    from consumers.ready_applier import build
    sys.exit(run_forever(build(get_settings())))


@main.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False,
                                                                    path_type=Path))
@click.option("--tenant", required=True, help="Tenant id.")
@click.option("--idempotency-key", help="Key of this intent (default: tenant:filename).")
@click.option("--lane", type=click.Choice(["interactive", "batch"]), default="interactive",
              show_default=True)
@click.option("--prompt-version", help="Prompt version (default from settings).")
@click.option("--model-profile", help="Model profile: local, openai, ollama, vllm, custom.")
def submit(files: tuple[Path, ...], tenant: str, idempotency_key: str | None, lane: str,
           prompt_version: str | None, model_profile: str | None) -> None:
    """Publish document.uploaded for FILES (inline bytes)."""
    from jobstream.producer import submit as do_submit
    from jobstream.producer import uploaded_event
    s = get_settings()
    if idempotency_key and len(files) > 1:
        raise click.UsageError("--idempotency-key names one intent: give one file")
    events = [uploaded_event(f, tenant_id=tenant, settings=s, lane=lane,
                             idempotency_key=idempotency_key or f"{tenant}:{f.name}",
                             prompt_version=prompt_version, model_profile=model_profile)
              for f in files]
    do_submit(s, events)
    for e in events:
        click.echo(f"submitted {e.payload.document.filename} key={e.idempotency_key}")


@main.command()
@click.option("--tenant", required=True, help="Tenant id.")
def status(tenant: str) -> None:
    """Show the jobs of a tenant: stage, status, provider calls, cost."""
    from jobstream.db import QUERIES, connect
    with connect(get_settings().database_url) as conn:
        rows = conn.execute(QUERIES["jobs_of_tenant"], (tenant,)).fetchall()
    t = Table(title=f"jobs of {tenant}")
    for c in ("job id", "document", "status", "stage", "stages", "calls", "cost USD", "error"):
        t.add_column(c)
    for r in rows:
        t.add_row(str(r["job_id"]), r["filename"], r["status"], r["current_stage"],
                  f"{r['stages_done']}/6", str(r["provider_calls"]), f"{r['cost_usd']:.6f}",
                  r["error_code"] or "")
    Console().print(t)


@main.command()
@click.option("--points", help="Comma-separated fault specs <point>[:<event_type>][@N] "
              "(default: every point, each fired mid-batch; see jobstream/chaos.py).")
@click.option("--jobs", default=5, show_default=True, help="Documents submitted per point.")
@click.option("--keep", is_flag=True, help="Keep every scratch database and topic, not only "
              "those of failed points.")
def chaos(points: str | None, jobs: int, keep: bool) -> None:
    """Crash matrix: per fault point, SIGKILL the owning process there, restart it, and check
    the exactly-once invariants (Postgres, topics, the fake provider's call counts).

    Each point runs in a scratch database and topic prefix on the configured servers, with a
    fake OpenAI-compatible provider on loopback. Exits 0 only when every point passed.
    """
    from jobstream import chaos as chaos_mod
    faults = [p.strip() for p in points.split(",") if p.strip()] if points else list(
        chaos_mod.DEFAULT_PLAN)
    try:
        for f in faults:
            chaos_mod.owner_of(f)
    except KeyError as exc:
        raise click.BadParameter(str(exc.args[0]), param_hint="--points") from None
    console = Console(width=max(120, Console().width))
    root = Path(os.environ.get("JOBSTREAM_HOME", Path(__file__).resolve().parents[1] / ".local"))
    logging.getLogger().setLevel(logging.WARNING)
    # SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so the run's child processes, which
    # live in their own sessions, are stopped rather than orphaned.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    def show(res: chaos_mod.PointResult) -> None:
        console.print(res.report(), style="green" if res.ok else "red", highlight=False,
                      markup=False)

    results = chaos_mod.run_matrix(get_settings(), faults, jobs=jobs, workdir=root / "chaos",
                                   keep=keep, on_result=show)
    t = Table(title=f"crash matrix, {jobs} jobs per point")
    for c in ("fault", "process", "killed", "seconds", "provider calls", "re-published",
              "retaken stages", "result"):
        t.add_column(c, no_wrap=c == "fault")
    for r in results:
        e = r.effects
        t.add_row(r.fault, r.owner, str(r.killed_rc), f"{r.seconds:.0f}",
                  str(e.get("provider_calls", "-")), str(e.get("republished", "-")),
                  str(e.get("retaken_stages", "-")), "PASS" if r.ok else "FAIL")
    console.print(t)
    for r in results:
        if not r.ok or keep:
            run = r.logdir.name if r.logdir else "?"
            console.print(f"{r.fault}: kept database {run} and topic prefix {run}. "
                          f"(logs in {r.logdir})", highlight=False)
    sys.exit(0 if all(r.ok for r in results) else 1)


@main.command("fake-provider")
@click.option("--port", default=8089, show_default=True, help="Port on 127.0.0.1.")
@click.option("--script", "script_json", default="{}", show_default=True,
              help='Behaviour script as JSON, e.g. \'{"sequence": [{"status": 429, '
                   '"retry_after": "1"}]}\' (see jobstream/llm/fake_provider.py).')
def fake_provider(port: int, script_json: str) -> None:
    """Serve a scriptable fake OpenAI-compatible provider on loopback (for fault drills).

    Point jobs at it with JOBSTREAM_MODEL_PROFILE=custom and
    JOBSTREAM_PROVIDER_BASE_URL=http://127.0.0.1:PORT/v1.
    """
    import json

    from jobstream.llm.fake_provider import FakeProvider
    fp = FakeProvider(json.loads(script_json), port=port)
    click.echo(f"fake provider at {fp.base_url} (GET /_control/calls for counts)")
    try:
        fp.serve_forever()
    except KeyboardInterrupt:
        fp.stop()


@main.command()
@click.option("--check", is_flag=True, help="Fail if committed JSON Schema files drifted.")
def schemas(check: bool) -> None:
    """Generate the JSON Schema files of every event into schemas/json."""
    from schemas.generate import main as gen
    sys.exit(gen(["--check"] if check else []))


@main.command()
def config() -> None:
    """Print the settings in force (secrets masked)."""
    s = get_settings().model_dump()
    for k, v in s.items():
        if "key" in k and v:
            v = "***"
        click.echo(f"{k} = {v}")


if __name__ == "__main__":
    main()
