"""``jobstream``: run the pipeline's processes, the local services and the demo."""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import click

from jobstream.settings import get_settings
from schemas.pipeline import OLD_NAMES, PIPELINE, Pipeline

if TYPE_CHECKING:  # rich is imported where a table is printed: the relay, consume-ready and
    from rich.console import Console  # the other long-running commands never print one


def _quiet_http_client() -> None:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # no per-request INFO lines


def _logging(level: str) -> None:
    """Log to stderr at ``level`` in ``JOBSTREAM_LOG_FORMAT`` (text, or json lines)."""
    from jobstream.logs import configure
    configure(level, get_settings().log_format)


def worker_stage_choices(pipeline: Pipeline = PIPELINE) -> tuple[str, ...]:
    """What ``jobstream worker --stages`` accepts: every agent of ``pipeline``, in order."""
    return pipeline.agents()


def redrive_stage_choices(pipeline: Pipeline = PIPELINE) -> tuple[str, ...]:
    """What ``jobstream redrive --from`` accepts: every stage of ``pipeline`` after intake."""
    return tuple(s.name for s in pipeline.job_stages)


class StageName(click.Choice[str]):
    """A stage name among ``choices``; a checkpoint name from before migration 0019
    (``text_extracted``, ``llm_done``...) is still accepted, with a deprecation message."""

    def convert(self, value: object, param: click.Parameter | None,
                ctx: click.Context | None) -> str:
        if isinstance(value, str) and value in OLD_NAMES and OLD_NAMES[value] in self.choices:
            click.echo(f"warning: stage name {value!r} is deprecated; use "
                       f"{OLD_NAMES[value]!r}", err=True)
            value = OLD_NAMES[value]
        return str(super().convert(value, param, ctx))


def _stage_list(value: str | None, choices: tuple[str, ...]) -> list[str] | None:
    """A comma-separated list of names among ``choices`` (None when empty). Raises
    :class:`click.BadParameter` naming the unknown ones."""
    if not value:
        return None
    names = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [n for n in names if n not in choices]
    if unknown:
        raise click.BadParameter(f"unknown {unknown}; choose from {', '.join(choices)}")
    return names


def settings_error(exc: Exception) -> str:
    """One line per invalid setting, naming its environment variable: ``JOBSTREAM_X=...:
    why`` (a pydantic ``ValidationError``), or the message of a ``SettingsError`` (a value
    that is not the JSON its field needs)."""
    from pydantic import ValidationError
    if not isinstance(exc, ValidationError):
        import re
        m = re.search(r'field "(\w+)"', str(exc))
        if m:
            return (f"invalid settings: JOBSTREAM_{m.group(1).upper()} is not valid JSON (this "
                    f"setting is a JSON value, e.g. a list or an object)")
        return f"invalid settings: {exc}"
    lines = []
    for e in exc.errors():
        field = ".".join(str(x) for x in e["loc"])
        name = f"JOBSTREAM_{field.upper()}" if field else "settings"
        value = os.environ.get(name)
        shown = f"={value!r}" if value is not None and "secret" not in field \
            and "token" not in field and "url" not in field and "dsn" not in field else ""
        why = str(e["msg"]).removeprefix("Value error, ")
        lines.append(f"{name}{shown}: {why}" if field else why)
    if len(lines) == 1:
        return f"invalid settings: {lines[0]}"
    return "invalid settings:\n  " + "\n  ".join(lines)


class _Main(click.Group):
    """The ``jobstream`` group: a failure every one-off command may meet (Postgres down, a
    jobstream error) ends as one ``error: <code>: <message>`` line and exit 1, not a
    traceback."""

    def invoke(self, ctx: click.Context) -> object:
        import psycopg

        from jobstream.errors import JobstreamError
        try:
            return super().invoke(ctx)
        except psycopg.OperationalError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            click.echo(f"error: db_unavailable: {first}", err=True)
            sys.exit(1)
        except JobstreamError as exc:
            click.echo(f"error: {exc.code}: {exc}", err=True)
            sys.exit(1)


def _wants_help() -> bool:
    return any(a in ("-h", "--help") for a in sys.argv[1:])


def _console() -> Console:
    """Where tables go: the terminal's width on a terminal; 200 columns when stdout is a pipe
    or a file (CI logs, ``| less``), where rich would otherwise assume 80 and cut job ids and
    reason codes to an ellipsis. ``COLUMNS`` overrides both."""
    from rich.console import Console
    if sys.stdout.isatty() or os.environ.get("COLUMNS"):
        return Console()
    return Console(width=200)


@click.group(cls=_Main, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="jobstream", message="%(prog)s %(version)s")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
def main(log_level: str) -> None:
    """jobstream: documents in (document.uploaded), LLM results out (job.ready), exactly once.

    Configuration comes from JOBSTREAM_* environment variables (also DATABASE_URL and
    KAFKA_BOOTSTRAP_SERVERS); `jobstream config` shows the values in force.
    """
    from pydantic import ValidationError
    from pydantic_settings import SettingsError
    try:  # every process checks its settings at start (e.g. lease vs heartbeat): a clear error
        get_settings()
    except (ValidationError, SettingsError) as exc:
        if _wants_help():  # --help works with a broken environment too
            return
        raise click.ClickException(settings_error(exc)) from None
    _logging(log_level)


def _check_database(url: str) -> None:
    """Fail fast (5 s) when Postgres does not answer, instead of a pool's 30 s wait: raises
    :class:`psycopg.OperationalError` (reported by the group as ``error: db_unavailable``)."""
    import psycopg
    psycopg.connect(url, connect_timeout=5).close()


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
    from jobstream.drills import demo as demo_mod
    logging.getLogger().setLevel(logging.WARNING)
    sys.exit(demo_mod.run(get_settings(), tenant=tenant, timeout_s=timeout_s,
                          services=not no_services))


@main.command()
@click.argument("action", type=click.Choice(["up", "down", "status", "env"]))
def services(action: str) -> None:
    """Install/start (up), stop (down) or check (status) local Kafka (KRaft) + PostgreSQL;
    env prints their addresses as shell exports.

    Everything lives under ./.local; services that already answer are reused.
    """
    from jobstream.services import run_script
    sys.exit(run_script(action, get_settings()))


@main.command("migrate")
def migrate_cmd() -> None:
    """Apply missing SQL migrations (idempotent, safe to run concurrently)."""
    from jobstream.db import migrate
    _check_database(get_settings().database_url)
    applied = migrate(get_settings().database_url)
    click.echo("applied: " + ", ".join(applied) if applied else "schema up to date")


@main.command()
def topics() -> None:
    """Create the pipeline topics and their .retry/.dlq twins (partitions from settings)."""
    from jobstream.kafka import all_topics, ensure_topics
    created = ensure_topics(get_settings())
    existed = len(all_topics(get_settings())) - len(created)
    click.echo(f"created {len(created)} topics" + (": " + ", ".join(created) if created else "")
               + (f"; {existed} already existed" if existed else ""))


@main.command()
@click.option("--housekeeping-only", is_flag=True,
              help="Only the stuck-stage sweeper and retention, no publishing (beside the "
                   "Debezium relay).")
def relay(housekeeping_only: bool) -> None:
    """Run the outbox relay (one active, others stand by) until SIGTERM."""
    from jobstream import health, outage
    from outbox_relay.relay import main as relay_main
    health.setup("relay", get_settings())  # its loop reports every poll (active or standby)
    outage.install(get_settings().kafka_bootstrap_servers)
    sys.exit(relay_main(get_settings(), housekeeping_only=housekeeping_only))


@main.group("connect")
def connect_group() -> None:
    """The Debezium relay on Kafka Connect (JOBSTREAM_RELAY=debezium): deploy, status, delete."""


@connect_group.command("deploy")
@click.option("--timeout", "timeout_s", default=120.0, show_default=True,
              help="Seconds to wait for the connector task and its slot.")
def connect_deploy(timeout_s: float) -> None:
    """Register the outbox connector (jobstream/debezium/outbox-connector.json, rendered from
    the settings) and switch the outbox to it."""
    from jobstream import connect
    try:
        st = connect.deploy(get_settings(), timeout_s=timeout_s)
    except (connect.ConnectError, RuntimeError) as exc:
        raise click.ClickException(str(exc)) from None
    _print_connect_status(st)


@connect_group.command("status")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def connect_status(as_json: bool) -> None:
    """Connector and task state, and the replication slot's retained WAL. Exit 3 unless the
    connector and all its tasks are RUNNING."""
    import json as _json

    from jobstream import connect
    st = connect.status(get_settings())
    if as_json:
        click.echo(_json.dumps(st, default=str))
    else:
        _print_connect_status(st)
    running = st["state"] == "RUNNING" and st["tasks"] and all(
        t["state"] == "RUNNING" for t in st["tasks"])
    sys.exit(0 if running else 3)


@connect_group.command("delete")
def connect_delete() -> None:
    """Unregister the connector, drop its slot and publication (the Python relay may run)."""
    from jobstream import connect
    try:
        for line in connect.delete(get_settings()):
            click.echo(line)
    except RuntimeError as exc:
        raise click.ClickException(str(exc)) from None


def _print_connect_status(st: dict) -> None:
    click.echo(f"connector {st['connector']}: {st['state'] or 'not deployed or unknown'}"
               + (f" ({st['connect_error']})" if st.get("connect_error") else ""))
    for t in st["tasks"]:
        click.echo(f"  task {t['id']}: {t['state']} on {t['worker_id']}")
        if t.get("trace"):
            click.echo("    " + t["trace"].splitlines()[0])
    if not st["slots"]:
        click.echo(f"replication slot {st['slot']}: none")
    for s in st["slots"]:
        click.echo(f"replication slot {s['slot']}: {'active' if s['active'] else 'INACTIVE'}, "
                   f"retains {s['retained_bytes']} bytes of WAL ({s['wal_status']})")


@main.command()
@click.option("--lane", type=click.Choice(["all", "interactive", "batch"]), default="all",
              show_default=True, help="all: every agent in one consumer group; interactive / "
              "batch: separate consumer pools for the stages with a batch lane ("
              + ", ".join(s.name for s in PIPELINE.stages if s.lanes) + "; run both kinds).")
@click.option("--stages", default=None,
              help="Comma-separated agents (default: the lane's): "
                   + ", ".join(worker_stage_choices()) + ".")
def worker(lane: str, stages: str | None) -> None:
    """Run faust stage workers (consumer group <prefix>jobstream-streams[-<lane>])."""
    from faust import Worker

    from jobstream.logs import faust_logging_config
    from streams.app import create_app
    try:
        chosen = _stage_list(stages, worker_stage_choices())
    except click.BadParameter as exc:
        raise click.UsageError(f"--stages: {exc.message}") from None
    try:
        app, ctx = create_app(get_settings(), chosen, lane=lane)
    except KeyError as exc:
        raise click.UsageError(str(exc)) from None
    from jobstream import health, outage
    health.setup("worker", get_settings(), probe=ctx.store.probe)
    outage.install(get_settings().kafka_bootstrap_servers)
    level = logging.getLevelName(logging.getLogger().level).lower()
    worker_ = Worker(app, loglevel=level, quiet=True,
                     logging_config=faust_logging_config(level, get_settings().log_format))
    # No terminal spinner: at --log-level warning and above faust sets the root logger to
    # DEBUG (for good) so that every record advances it, and then every debug call of
    # aiokafka and faust builds a LogRecord: ~15% of a busy worker's CPU.
    worker_.spinner = None
    worker_.execute_from_commandline()


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8080, show_default=True, type=int)
def api(host: str, port: int) -> None:
    """Serve the HTTP API (OpenAPI at /openapi.json, docs at /docs).

    Tenants come from bearer tokens: JOBSTREAM_API_TOKENS='{"<token>": "<tenant>"}'.
    """
    from jobstream.api import main as api_main
    sys.exit(api_main(get_settings(), host, port))


@main.command("metrics")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=9464, show_default=True, type=int)
def metrics_cmd(host: str, port: int) -> None:
    """Serve Prometheus metrics at /metrics without the API (the same numbers: read from
    Postgres and Kafka at scrape time)."""
    from jobstream.metrics import serve
    sys.exit(serve(get_settings(), host, port))


@main.command("consume-ready")
def consume_ready() -> None:
    """Run the example downstream consumer that applies job.ready exactly once."""
    from consumers.idempotent import run_forever
    from jobstream import health, outage
    from jobstream.ready_applier import build
    consumer = build(get_settings())
    outage.install(get_settings().kafka_bootstrap_servers)
    health.setup("consume-ready", get_settings(), probe=consumer.db_probe)
    sys.exit(run_forever(consumer))


@main.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False,
                                                                    path_type=Path))
@click.option("--tenant", required=True, help="Tenant id.")
@click.option("--idempotency-key", help="Key of this intent (default: tenant:filename).")
@click.option("--lane", type=click.Choice(["interactive", "batch"]), default="interactive",
              show_default=True)
@click.option("--prompt-version", help="Prompt version (default from settings).")
@click.option("--model-profile", help="Model profile: local, openai, ollama, vllm, custom.")
def publish(files: tuple[Path, ...], tenant: str, idempotency_key: str | None, lane: str,
            prompt_version: str | None, model_profile: str | None) -> None:
    """Publish document.uploaded to Kafka for FILES (as another service would)."""
    from jobstream.producer import submit as do_submit
    from jobstream.producer import uploaded_event
    s = get_settings()
    if idempotency_key and len(files) > 1:
        raise click.UsageError("--idempotency-key names one intent: give one file")
    for f in files:  # the limit intake applies, which also fits a Kafka message (settings)
        if f.stat().st_size > s.max_inline_document_bytes:
            raise click.UsageError(
                f"{f} has {f.stat().st_size} bytes; documents travel inline up to "
                f"JOBSTREAM_MAX_INLINE_DOCUMENT_BYTES={s.max_inline_document_bytes}")
    events = [uploaded_event(f, tenant_id=tenant, settings=s, lane=lane,
                             idempotency_key=idempotency_key or f"{tenant}:{f.name}",
                             prompt_version=prompt_version, model_profile=model_profile)
              for f in files]
    from confluent_kafka import KafkaException
    try:
        do_submit(s, events)
    except (KafkaException, RuntimeError) as exc:  # refused by the client or the broker
        _fail(exc)
    for e in events:
        click.echo(f"published {e.payload.document.filename} key={e.idempotency_key}")


@main.command()
@click.option("--tenant", required=True, help="Tenant id.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line (every column).")
def jobs(tenant: str, as_json: bool) -> None:
    """List a tenant's jobs from the database: stage, status, provider calls, cost."""
    from jobstream.db import QUERIES, connect
    _check_database(get_settings().database_url)
    with connect(get_settings().database_url) as conn:
        rows = conn.execute(QUERIES["jobs_of_tenant"], (tenant,)).fetchall()
    if as_json:
        import json
        for r in rows:
            click.echo(json.dumps(dict(r), default=str))
        return
    from rich.table import Table
    t = Table(title=f"jobs of {tenant}")
    t.add_column("job id", no_wrap=True, min_width=36)  # what redrive/status/cancel need
    for c in ("document", "status", "stage", "stages", "calls", "cost USD", "error"):
        t.add_column(c)
    for r in rows:
        t.add_row(str(r["job_id"]), r["filename"], r["status"], r["current_stage"],
                  f"{r['stages_done']}/{len(PIPELINE.stages)}", str(r["provider_calls"]),
                  f"{r['cost_usd']:.6f}", r["error_code"] or "")
    _console().print(t)


_api_url = click.option("--api", "api_url", envvar="JOBSTREAM_API_URL",
                        default="http://127.0.0.1:8080", show_default=True,
                        help="API base URL (env JOBSTREAM_API_URL).")
_api_token = click.option("--token", envvar="JOBSTREAM_API_TOKEN", required=True,
                          help="Bearer token of your tenant (env JOBSTREAM_API_TOKEN).")
_TERMINAL = ("succeeded", "failed", "cancelled", "needs_reconciliation")


def _client(api_url: str, token: str):
    from jobstream.client import ApiClient
    _quiet_http_client()
    return ApiClient(api_url, token)


def _api_errors(fn):
    import functools

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        from jobstream.client import ApiError
        try:
            return fn(*a, **kw)
        except ApiError as exc:
            raise click.ClickException(str(exc)) from None
    return wrapper


def _follow(client, ids: list[str], what: str) -> list[dict]:
    """Poll jobs until each has ended or waits for a person, with a progress bar of jobs
    finished (a failed job is finished too: the bar never stops short); returns the final
    views."""
    import time

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn
    with Progress("{task.description}", BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn()) as bar:
        task = bar.add_task(what, total=len(ids))
        while True:
            views = [client.job(i) for i in ids]
            bar.update(task, completed=sum(v["status"] in _TERMINAL for v in views))
            if all(v["status"] in _TERMINAL for v in views):
                return views
            time.sleep(0.5)


def _print_jobs(views: list[dict]) -> None:
    """One row per job: status, the stage it is at (for a failed job: the stage that failed),
    the error code."""
    from rich.table import Table
    t = Table()
    t.add_column("job id", no_wrap=True, min_width=36)  # what redrive/status/cancel need
    for c in ("document", "status", "stage", "stages", "provider calls", "cost USD", "error"):
        t.add_column(c)
    for v in views:
        t.add_row(v["job_id"], v["filename"], v["status"], v["current_stage"],
                  f"{v['stages_done']}/{len(PIPELINE.stages)}", str(len(v["provider_attempts"])),
                  f"{v['cost_so_far_usd']:.6f}", v["error_code"] or "")
    _console().print(t)


def _summary(views: list[dict]) -> int:
    """Print the summary table of finished jobs (succeeded / failed with their stages and error
    codes / cancelled / waiting for an operator); returns the exit code: 1 when a job failed
    or waits for reconciliation, else 0 (a cancelled job is what its owner asked for)."""
    from collections import Counter
    by: dict[str, list[dict]] = {}
    for v in views:
        by.setdefault(v["status"], []).append(v)

    def codes(vs: list[dict]) -> str:
        c = Counter(f"{v['error_code'] or '?'} at {v['current_stage']}" for v in vs)
        return ", ".join(f"{k} ×{n}" if n > 1 else k for k, n in sorted(c.items()))
    from rich.table import Table
    t = Table(title=f"{len(views)} jobs")
    t.add_column("result")
    t.add_column("jobs", justify="right")
    t.add_column("error codes (at stage)")
    t.add_row("succeeded", str(len(by.get("succeeded", []))), "")
    t.add_row("failed", str(len(by.get("failed", []))), codes(by.get("failed", [])))
    t.add_row("cancelled", str(len(by.get("cancelled", []))), "")
    if by.get("needs_reconciliation"):
        t.add_row("needs reconciliation (jobstream reconcile)",
                  str(len(by["needs_reconciliation"])), codes(by["needs_reconciliation"]))
    _console().print(t)
    return 1 if by.get("failed") or by.get("needs_reconciliation") else 0


@main.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False,
                                                                    path_type=Path))
@_api_url
@_api_token
@click.option("--idempotency-key", help="Key of this intent (one file; default: a hash of "
              "the file name and bytes, so submitting the same file again is the same intent).")
@click.option("--lane", type=click.Choice(["interactive", "batch"]), default="interactive",
              show_default=True)
@click.option("--prompt-version", help="Prompt version (default: the server's).")
@click.option("--model-profile", help="Model profile: local, openai, ollama, vllm, custom.")
@click.option("--wait/--no-wait", default=True, show_default=True,
              help="Follow the jobs to the end with a progress bar.")
@_api_errors
def submit(files: tuple[Path, ...], api_url: str, token: str, idempotency_key: str | None,
           lane: str, prompt_version: str | None, model_profile: str | None,
           wait: bool) -> None:
    """Create one job per FILE through the HTTP API (and follow them).

    With --wait (the default) the bar counts jobs that ended; a table per job and a summary
    (succeeded / failed with error codes / cancelled) follow. Exit code 1 when a job failed or
    waits for reconciliation.
    """
    import hashlib

    from jobstream.client import document_body
    if idempotency_key and len(files) > 1:
        raise click.UsageError("--idempotency-key names one intent: give one file")
    client = _client(api_url, token)
    ids = []
    for f in files:
        body = document_body(f, lane=lane, prompt_version=prompt_version,
                             model_profile=model_profile)
        key = idempotency_key or "cli-" + hashlib.sha256(
            f.name.encode() + b"\0" + f.read_bytes()).hexdigest()[:32]
        r = client.create_job(body, key)
        ids.append(r["job_id"])
        click.echo(f"{f.name}: job {r['job_id']} ({r['status']})")
    if wait:
        views = _follow(client, ids, "jobs finished")
        _print_jobs(views)
        sys.exit(_summary(views))


@main.command()
@click.argument("job_id")
@_api_url
@_api_token
@click.option("--follow", is_flag=True, help="Wait for the end with a progress bar.")
@click.option("--json", "as_json", is_flag=True, help="Print the API's JSON.")
@_api_errors
def status(job_id: str, api_url: str, token: str, follow: bool, as_json: bool) -> None:
    """Show a job through the API: status, stages, provider attempts, cost, result.

    Exit code 1 when the job failed or waits for reconciliation, else 0 (as `submit`).
    """
    import json as _json
    client = _client(api_url, token)
    v = _follow(client, [job_id], "jobs finished")[0] if follow else client.job(job_id)
    if as_json:
        click.echo(_json.dumps(v, indent=2))
    else:
        _print_jobs([v])
        if v.get("result"):
            click.echo(f"title: {v['result']['title']}\nsummary: {v['result']['summary']}")
        elif v["status"] == "failed":
            click.echo(f"failed at stage {v['current_stage']}: {v['error_code']}: {v['error']}")
    sys.exit(1 if v["status"] in ("failed", "needs_reconciliation") else 0)


@main.command()
@click.argument("job_id")
@_api_url
@_api_token
@_api_errors
def cancel(job_id: str, api_url: str, token: str) -> None:
    """Cancel a job through the API (it stops before its next provider call)."""
    r = _client(api_url, token).cancel(job_id)
    if r.get("message"):
        click.echo(f"job {r['job_id']}: {r['message']} (now {r['status']})")
    elif r["status"] in ("succeeded", "failed", "cancelled"):
        click.echo(f"job {r['job_id']} had already ended ({r['status']}): nothing to cancel")
    else:
        click.echo(f"job {r['job_id']}: cancel requested (now {r['status']}; it stops before "
                   "its next provider call)")


@main.command()
@click.argument("files", nargs=-1, type=click.Path(exists=True, dir_okay=False, path_type=Path))
@_api_url
@_api_token
@click.option("--idempotency-key", help="Key of the batch (default: a hash of the files).")
@click.option("--lane", type=click.Choice(["interactive", "batch"]), default="batch",
              show_default=True)
@click.option("--status", "status_id", help="Show batch BATCH_ID instead of creating one.")
@click.option("--cancel", "cancel_id", help="Cancel batch BATCH_ID.")
@click.option("--wait/--no-wait", default=True, show_default=True)
@_api_errors
def batch(files: tuple[Path, ...], api_url: str, token: str, idempotency_key: str | None,
          lane: str, status_id: str | None, cancel_id: str | None, wait: bool) -> None:
    """Create a batch of up to 1000 FILES through the API (or --status / --cancel one).

    With --wait the bar counts jobs that ended (failed ones too), then a summary table
    (succeeded / failed with error codes / cancelled) follows; exit code 1 when a job failed or
    waits for reconciliation.
    """
    import hashlib
    import time

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    from jobstream.client import document_body
    client = _client(api_url, token)
    if cancel_id:
        b = client.cancel_batch(cancel_id)
    elif status_id:
        b = client.batch(status_id)
    else:
        if not files:
            raise click.UsageError("give FILES, --status BATCH_ID or --cancel BATCH_ID")
        docs = [document_body(f) for f in files]
        key = idempotency_key or "cli-batch-" + hashlib.sha256(
            b"".join(f.name.encode() + b"\0" + f.read_bytes() for f in files)).hexdigest()[:32]
        b = client.create_batch(docs, key, lane)
        click.echo(f"batch {b['batch_id']}: {b['jobs']} jobs")
        if wait:
            with Progress("{task.description}", BarColumn(), MofNCompleteColumn(),
                          TimeElapsedColumn()) as bar:
                task = bar.add_task("jobs finished", total=b["jobs"])
                while True:
                    b = client.batch(b["batch_id"])
                    done = (b["succeeded"] + b["failed"] + b["cancelled"]
                            + b["needs_reconciliation"])
                    bar.update(task, completed=done)
                    if done >= b["jobs"]:
                        break
                    time.sleep(0.5)
    counts = {k: b[k] for k in ("queued", "running", "succeeded", "failed", "cancelled",
                                "needs_reconciliation")}
    click.echo(f"batch {b['batch_id']}: " + ", ".join(f"{k} {v}" for k, v in counts.items())
               + f"; cost so far {b['cost_so_far_usd']:.6f} USD")
    if wait and not (cancel_id or status_id):
        sys.exit(_summary([client.job(i) for i in b["job_ids"]]))


def _ctx():
    from jobstream.store import Store
    from streams.context import StageContext
    s = get_settings()
    _check_database(s.database_url)
    return StageContext(s, Store(s.database_url, max_size=2))


@main.command()
@click.argument("job_id", type=click.UUID)
@click.option("--from", "from_stage",
              type=StageName(redrive_stage_choices()),
              help="Stage to restart at (default: the first one that did not succeed). "
                   "Finished stages with unchanged code are re-emitted, not redone.")
def redrive(job_id, from_stage: str | None) -> None:
    """Send a failed, parked or finished job through its stages again."""
    from streams.actions import redrive as do_redrive
    try:
        stage = do_redrive(_ctx(), job_id, from_stage)
    except (KeyError, ValueError) as exc:
        raise click.ClickException(str(exc.args[0] if exc.args else exc)) from None
    click.echo(f"job {job_id} re-driven from {stage}")


@main.command()
@click.argument("job_id", type=click.UUID, required=False)
@click.option("--retry", "resolution", flag_value="retry",
              help="Call the provider again for the chunks without an answer.")
@click.option("--fail", "resolution", flag_value="fail", help="End the job as failed.")
def reconcile(job_id, resolution: str | None) -> None:
    """List jobs parked in needs_reconciliation (no JOB_ID), or resolve one.

    A job is parked when a batch-lane provider call timed out after it was sent: the provider
    may have done (and billed) the work, so jobstream does not guess. Check the provider's
    records for the attempt's Idempotency-Key (<job_id>:<chunk>), then --retry or --fail.
    """
    from streams.actions import reconcile as do_reconcile
    ctx = _ctx()
    if job_id is None:
        rows = ctx.store.parked_jobs()
        if not rows:
            click.echo("no jobs need reconciliation")
            return
        from rich.table import Table
        t = Table(title="jobs needing reconciliation")
        for c in ("job id", "tenant", "document", "lane", "stage", "unknown attempts", "since"):
            t.add_column(c)
        for r in rows:
            t.add_row(str(r["job_id"]), r["tenant_id"], r["filename"], r["lane"],
                      r["current_stage"], str(r["unknown_attempts"]), str(r["updated_at"]))
        _console().print(t)
        return
    if resolution is None:
        raise click.UsageError("give --retry or --fail")
    try:
        click.echo(do_reconcile(ctx, job_id, resolution))
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None


@main.command()
@click.option("--json", "as_json", is_flag=True, help="One JSON object instead of text.")
@click.option("--check", "checks", multiple=True,
              help="Run only this check (repeatable; default: every registered check).")
@click.option("--skip", multiple=True, help="Skip this check (repeatable).")
@click.option("--tenant", default=None, help="Only this tenant's jobs.")
@click.option("--grace", "grace_s", type=float, default=None,
              help="Seconds without progress before a job/stage counts as stuck "
                   "(default JOBSTREAM_VERIFY_GRACE_S).")
@click.option("--outbox-age", "outbox_age_s", type=float, default=None,
              help="Oldest tolerated unpublished outbox row, seconds "
                   "(default JOBSTREAM_VERIFY_OUTBOX_AGE_S).")
@click.option("--max-lag", type=int, default=None,
              help="Most messages a consumer group may be behind (default "
                   "JOBSTREAM_VERIFY_MAX_LAG).")
def verify(as_json: bool, checks: tuple[str, ...], skip: tuple[str, ...], tenant: str | None,
           grace_s: float | None, outbox_age_s: float | None, max_lag: int | None) -> None:
    """Audit the RUNNING system's guarantees (read-only, safe in production).

    Reports every broken guarantee with its job ids: a dedup_key applied twice or a job never
    applied downstream, stuck jobs, stranded stages, orphan attempts, old unpublished outbox
    rows, chunks paid twice, consumer lag. Exit 1 when anything is broken, 2 when a check
    could not run, 0 when clean.
    """
    from jobstream import verify as verify_mod
    try:
        report = verify_mod.run(get_settings(), checks=list(checks) or None, skip=skip,
                                tenant=tenant, grace_s=grace_s, outbox_age_s=outbox_age_s,
                                max_lag=max_lag)
    except KeyError as exc:
        raise click.UsageError(str(exc.args[0] if exc.args else exc)) from None
    click.echo(report.as_json() if as_json else report.text())
    sys.exit(report.exit_code)


@main.command()
def sweep() -> None:
    """Re-drive stages whose lease expired long ago (the active relay also does this)."""
    from streams.actions import sweep as do_sweep
    for line in do_sweep(_ctx()) or ["nothing to sweep"]:
        click.echo(line)


@main.command()
@click.option("--max-batches", type=click.IntRange(min=1),
              help="At most N delete transactions per table (default: until done).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def gc(max_batches: int | None, as_json: bool) -> None:
    """Expire old rows: published outbox rows, idempotent-consumer rows (processed_event)
    and idempotency records of finished jobs (job_request), each after its horizon
    (JOBSTREAM_OUTBOX_RETENTION_S, _PROCESSED_EVENT_RETENTION_S, _IDEMPOTENCY_RETENTION_S).

    processed_event rows are kept when their horizon is not longer than the topics'
    redelivery window (read from Kafka). The active relay runs this every
    JOBSTREAM_GC_INTERVAL_S as well.
    """
    import json

    from jobstream.errors import JobstreamError
    from jobstream.retention import collect
    from jobstream.store import Store
    s = get_settings()
    store = Store(s.database_url, max_size=1)
    try:
        report = collect(s, store, max_batches=max_batches)
    except JobstreamError as exc:
        _fail(exc)
    finally:
        store.close()
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
        return
    for table, n in report.deleted.items():
        click.echo(f"{table}: deleted {n} rows older than {report.horizons_s[table]:.0f}s")
    for table, why in report.skipped.items():
        click.echo(f"{table}: skipped: {why}")


@main.group()
def dlq() -> None:
    """Inspect and replay dead-lettered messages (<topic>.dlq topics, dead_letter table)."""


def _fail(exc: Exception) -> NoReturn:
    """Print a jobstream error (``code: message``) to stderr and exit 1."""
    from jobstream.errors import JobstreamError
    code = exc.code if isinstance(exc, JobstreamError) else type(exc).__name__
    click.echo(f"error: {code}: {exc}", err=True)
    sys.exit(1)


def _logical_topic(topic: str | None) -> None:
    """Reject a DLQ name where the logical topic is expected (a usage error, exit 2)."""
    if topic is not None and topic.endswith(".dlq"):
        raise click.BadParameter(f"give the logical topic: {topic.removesuffix('.dlq')!r}",
                                 param_hint="--topic")


@dlq.command("list")
@click.option("--topic", metavar="LOGICAL_TOPIC",
              help="Show the DLQ of this topic, e.g. document.uploaded (default: every DLQ).")
@click.option("--limit", default=100, show_default=True, type=click.IntRange(min=1),
              help="At most N messages per DLQ topic, oldest first.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON (one array) instead of a table.")
def dlq_list(topic: str | None, limit: int, as_json: bool) -> None:
    """Show dead-lettered messages: position, reason, origin, key, first bytes of the value.

    Lists the <topic>.dlq topics and the Postgres dead_letter table (dead letters the DLQ did
    not take, outbox rows the relay could not deliver: rows dead_letter:<id>, JSON "source":
    "table"). Read-only: the reader is assigned partitions and never commits, so no consumer group's
    offsets move.
    """
    import json

    from jobstream import dlq as dlq_mod
    from jobstream.errors import JobstreamError
    _logical_topic(topic)
    try:
        rows = [d.to_dict() for d in dlq_mod.list_dead_letters(get_settings(), topic,
                                                               limit=limit)]
        rows += dlq_mod.list_stored(get_settings(), topic, limit=limit)
    except (JobstreamError, ValueError) as exc:
        _fail(exc)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    prefix = get_settings().topic_prefix

    def short(name: str | None) -> str:
        return name[len(prefix):] if name and prefix and name.startswith(prefix) else name or "?"
    from rich.table import Table
    t = Table(title=f"dead letters ({len(rows)})" + (f", prefix {prefix!r}" if prefix else ""))
    t.add_column("dlq message", no_wrap=True)
    t.add_column("reason code", no_wrap=True)
    t.add_column("reason", overflow="fold", ratio=3)
    t.add_column("from", overflow="fold")
    t.add_column("key", overflow="fold")
    t.add_column("value", overflow="fold", ratio=2)
    for r in rows:
        t.add_row(r["ref"] if r["source"] == "table"
                  else f"{short(r['dlq_topic'])}[{r['partition']}]@{r['offset']}",
                  r["dlq_reason_code"] or "?", (r["dlq_reason"] or "")[:160],
                  f"{short(r['original_topic'])}[{r['original_partition']}]"
                  f"@{r['original_offset']}"
                  + (f" by {r['consumer_group']}" if r.get("consumer_group") else ""),
                  r["key"] or "", (r["value_head"] or "")[:48])
    _console().print(t)


@dlq.command("replay")
@click.option("--topic", metavar="LOGICAL_TOPIC", required=True,
              help="Replay <LOGICAL_TOPIC>.dlq back to LOGICAL_TOPIC, e.g. document.uploaded.")
@click.option("--reason-code", "reason_codes", multiple=True, metavar="CODE",
              help="Replay only messages with this dlq_reason_code (repeatable; default: all).")
@click.option("--group", "groups", multiple=True, metavar="GROUP",
              help="Replay only what this consumer group dead-lettered (header "
                   "dlq_consumer_group; repeatable; default: all). With several groups on a "
                   "topic each dead-letters a bad message once: one copy reaches them all.")
@click.option("--limit", type=click.IntRange(min=1), help="Replay at most N messages.")
@click.option("--dry-run", is_flag=True,
              help="Show what would be replayed; produce, record and commit nothing.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def dlq_replay(topic: str, reason_codes: tuple[str, ...], groups: tuple[str, ...],
               limit: int | None, dry_run: bool, as_json: bool) -> None:
    """Re-produce dead-lettered messages (original key and bytes) to their original topic.

    Each copy goes to its original topic and partition through an idempotent producer, with the
    header dlq_replayed_from=<dlq topic>:<partition>:<offset>. A message is recorded in the
    dlq_replay table only after the broker acknowledged its copy, and a recorded message is
    never replayed again: each message is replayed at most once per successful run, and running
    replay twice replays nothing new. (A crash between the acknowledgement and the record
    replays that message once more on the next run; the consumers' idempotency records
    absorb the copy.)

    Messages left out by --reason-code, --group or --limit stay replayable by a later run. The
    consumer group <prefix>jobstream-dlq-replay commits, per DLQ partition, the first offset not yet
    replayed (after the produce was acknowledged); later runs start reading there. One replay
    per DLQ topic runs at a time. Then the topic's rows of the Postgres dead_letter table not
    replayed yet are re-produced the same way (header dlq_replayed_from=dead_letter:<id>) and
    marked replayed once acknowledged. Exit code 1 when a delivery failed or on an error.
    """
    import json

    from jobstream import dlq as dlq_mod
    from jobstream.errors import JobstreamError
    _logical_topic(topic)
    try:
        report = dlq_mod.replay(get_settings(), topic, reason_codes=reason_codes, limit=limit,
                                dry_run=dry_run, groups=groups)
    except (JobstreamError, ValueError) as exc:
        _fail(exc)
    if as_json:
        click.echo(json.dumps(report.to_dict(), indent=2))
    else:
        verb = "would replay" if dry_run else "replayed"
        for it in report.replayed:
            where = ("" if it.replayed_offset is None
                     else f" -> {it.original_topic}[{it.replayed_partition}]@{it.replayed_offset}")
            click.echo(f"{verb} {it.ref} ({it.reason_code}){where}")
        for it in report.failed:
            click.echo(f"FAILED {it.ref} ({it.reason_code}): {it.error}")
        for ref, why in report.unreplayable:
            click.echo(f"unreplayable {ref}: {why}")
        click.echo(f"{report.dlq_topic}: {verb} {len(report.replayed)}, failed "
                   f"{len(report.failed)}, already replayed {report.already_replayed}, "
                   f"skipped by filter {report.skipped}, references to the dead_letter table "
                   f"{report.references}, unreplayable "
                   f"{len(report.unreplayable)}"
                   + (" (stopped at --limit)" if report.limit_reached else ""))
    if report.failed:
        sys.exit(1)

@main.command()
@click.option("--points", help="Comma-separated fault specs <point>[:<event_type>][@N] "
              "(default: every point, each fired mid-batch; see jobstream/drills/chaos.py).")
@click.option("--jobs", default=5, show_default=True, help="Documents submitted per point.")
@click.option("--keep", is_flag=True, help="Keep every scratch database and topic, not only "
              "those of failed points.")
@click.option("--mode", type=click.Choice(["kill", "pause"]), default="kill", show_default=True,
              help="kill: SIGKILL at the point, then restart. pause: SIGSTOP there for longer "
                   "than the lease (a second worker and the sweeper take over), then SIGCONT.")
def chaos(points: str | None, jobs: int, keep: bool, mode: str) -> None:
    """Crash matrix: per fault point, SIGKILL the owning process there, restart it, and check
    the exactly-once invariants (Postgres, topics, the fake provider's call counts). With
    --mode pause the pause matrix: the process freezes there past its lease, resumes, and
    its stale work must be discarded.

    Each point runs in a scratch database and topic prefix on the configured servers, with a
    fake OpenAI-compatible provider on loopback. Exits 0 only when every point passed.
    """
    from jobstream.drills import chaos as chaos_mod
    faults = [p.strip() for p in points.split(",") if p.strip()] if points else list(
        chaos_mod.PAUSE_PLAN if mode == "pause" else chaos_mod.DEFAULT_PLAN)
    try:
        for f in faults:
            chaos_mod.owner_of(f)
    except KeyError as exc:
        raise click.BadParameter(str(exc.args[0]), param_hint="--points") from None
    from rich.console import Console
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
                                   keep=keep, on_result=show, mode=mode)
    from rich.table import Table
    t = Table(title=f"{'pause' if mode == 'pause' else 'crash'} matrix, {jobs} jobs per point")
    for c in ("fault", "process", "killed", "seconds", "provider calls", "re-published",
              "retaken stages", "result"):
        t.add_column(c, no_wrap=c == "fault")
    for r in results:
        e = r.effects
        t.add_row(r.fault, r.owner, "paused" if r.paused else str(r.killed_rc),
                  f"{r.seconds:.0f}",
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
                   '"retry_after": "1"}]}\' (see jobstream/drills/fake_provider.py).')
def fake_provider(port: int, script_json: str) -> None:
    """Serve a scriptable fake OpenAI-compatible provider on loopback (for fault drills).

    Point jobs at it with JOBSTREAM_MODEL_PROFILE=custom and
    JOBSTREAM_PROVIDER_BASE_URL=http://127.0.0.1:PORT/v1.
    """
    import json

    from jobstream.drills.fake_provider import FakeProvider
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
    """Print the settings in force (secrets masked: tokens, keys, the database password).

    A setting left empty whose value is derived (the Debezium connector and replication slot
    names, from the database name) shows the derived value.
    """
    from jobstream.connect import names
    s = get_settings()
    n = names(s)
    derived = {"connect_connector_name": n.connector, "replication_slot": n.slot}
    for k, v in s.public_dump().items():
        if k in derived and not v:
            v = f"{derived[k]} (derived from the database name)"
        click.echo(f"{k} = {v}")


if __name__ == "__main__":
    main()
