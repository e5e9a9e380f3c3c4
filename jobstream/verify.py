"""``jobstream verify``: an auditor of a RUNNING system's guarantees, safe in production.

Every check reads only (each in its own ``READ ONLY`` transaction with a statement timeout,
plus Kafka admin reads for the lag) and returns :class:`Finding` objects naming the jobs
concerned. The checks are a registry, ``CHECKS`` (name -> function), so another module adds
one with :func:`check`::

    from jobstream.verify import Finding, VerifyContext, check

    @check("replication_slot")
    def replication_slot(ctx: VerifyContext) -> list[Finding]:
        rows = ctx.query("my_slot_query")          # a named query of jobstream/sql/queries.sql
        return [Finding("replication_slot", [], f"slot {r['slot_name']} inactive") for r in rows]

The checks of this module:

=================== ===============================================================================
name                broken when
=================== ===============================================================================
applied_twice       a downstream applied one dedup_key more than once (per downstream plug-in)
not_applied         a job succeeded more than ``grace_s`` ago and a downstream never applied it
stuck_jobs          an open job has no live lease, no unpublished event and no progress for
                    ``grace_s`` (nothing will move it)
stranded_stages     a stage succeeded more than ``grace_s`` ago, its job is open and the next stage
                    was never claimed
orphan_attempts     a provider attempt is still ``started`` while its run holds no live lease
outbox_unpublished  an outbox row is unpublished longer than ``outbox_age_s``
paid_twice          a chunk has more than one succeeded (billed) provider attempt (with why)
consumer_lag        a consumer group is more than ``max_lag`` messages behind
replication_slot    a logical replication slot is inactive or retains more WAL than
                    ``slot_retained_alert_bytes`` (the Debezium relay; :mod:`jobstream.connect`)
=================== ===============================================================================

Downstreams are plug-ins too (``DOWNSTREAMS``: name -> :class:`Downstream`); the example
downstream (``jobstream/ready_applier.py``) is ``ready-applier``. ``Settings.verify_downstreams``
picks the ones a deployment runs.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import psycopg

from jobstream.db import QUERIES as Q
from jobstream.db import Conn, connect
from jobstream.settings import Settings
from jobstream.store import STAGES


@dataclass(frozen=True)
class Finding:
    """One broken guarantee: the ``check`` that found it, the job ids concerned (may be
    empty, e.g. for consumer lag) and a human sentence."""

    check: str
    job_ids: list[str]
    detail: str

    def __str__(self) -> str:
        jobs = f" [jobs {', '.join(self.job_ids)}]" if self.job_ids else ""
        return f"{self.check}: {self.detail}{jobs}"


@dataclass
class VerifyContext:
    """What a check may use: the settings, the bounds, an optional tenant filter and a
    read-only query helper over one connection."""

    settings: Settings
    conn: Conn
    tenant: str | None = None
    grace_s: float = 300.0
    outbox_age_s: float = 60.0
    max_lag: int = 10_000

    def query(self, name: str, **params: Any) -> list[dict[str, Any]]:
        """Run named query ``name`` in its own read-only transaction, bounded by
        ``metrics_timeout_s``; ``tenant``, ``grace_s`` and ``outbox_age_s`` are passed as
        parameters too. Raises ``psycopg.Error``."""
        args = {"tenant": self.tenant, "grace_s": self.grace_s,
                "outbox_age_s": self.outbox_age_s, **params}
        with self.conn.transaction():
            self.conn.execute(Q["metrics_read_only"])
            self.conn.execute(Q["metrics_statement_timeout"],
                              (str(int(self.settings.metrics_timeout_s * 1000)),))
            return self.conn.execute(Q[name], args).fetchall()


CheckFn = Callable[[VerifyContext], list[Finding]]
#: The registry: check name -> function returning its findings (empty = holds).
CHECKS: dict[str, CheckFn] = {}


def check(name: str) -> Callable[[CheckFn], CheckFn]:
    """Decorator registering a check under ``name`` in :data:`CHECKS`. Raises ``ValueError``
    when the name is taken."""
    def register(fn: CheckFn) -> CheckFn:
        if name in CHECKS:
            raise ValueError(f"verify check {name!r} is already registered")
        CHECKS[name] = fn
        return fn
    return register


class Downstream(Protocol):
    """A downstream's view for :func:`applied_twice` and :func:`not_applied`."""

    def applied_twice(self, ctx: VerifyContext) -> list[Finding]:
        """dedup_keys this downstream applied more than once."""
        ...

    def not_applied(self, ctx: VerifyContext) -> list[Finding]:
        """Jobs succeeded more than ``ctx.grace_s`` ago that this downstream never applied."""
        ...


class ReadyApplier:
    """The example downstream (``jobstream/ready_applier.py``): one analysis row and one
    ledger charge per dedup_key."""

    def applied_twice(self, ctx: VerifyContext) -> list[Finding]:
        return [Finding("applied_twice", sorted(r["job_ids"]),
                        f"{r['what']} has {r['n']} rows for dedup_key {r['dedup_key'][:16]}… "
                        f"of tenant {r['tenant_id']} (exactly one expected)")
                for r in ctx.query("verify_applied_twice")]

    def not_applied(self, ctx: VerifyContext) -> list[Finding]:
        rows = ctx.query("verify_not_applied")
        if not rows:
            return []
        return [Finding("not_applied", [str(r["job_id"]) for r in rows],
                        f"{len(rows)} job(s) succeeded over {ctx.grace_s:.0f}s ago and never "
                        "applied by the ready-applier downstream")]


#: Downstream plug-ins: name -> implementation (``Settings.verify_downstreams`` picks).
DOWNSTREAMS: dict[str, Downstream] = {"ready-applier": ReadyApplier()}


def _downstreams(ctx: VerifyContext) -> Iterator[Downstream]:
    for name in ctx.settings.verify_downstreams:
        if name not in DOWNSTREAMS:
            raise KeyError(f"unknown downstream {name!r}; known: {sorted(DOWNSTREAMS)}")
        yield DOWNSTREAMS[name]


@check("applied_twice")
def applied_twice(ctx: VerifyContext) -> list[Finding]:
    """A dedup_key applied more than once by a downstream."""
    return [f for d in _downstreams(ctx) for f in d.applied_twice(ctx)]


@check("not_applied")
def not_applied(ctx: VerifyContext) -> list[Finding]:
    """A job succeeded more than the grace ago and never applied by a downstream."""
    return [f for d in _downstreams(ctx) for f in d.not_applied(ctx)]


@check("stuck_jobs")
def stuck_jobs(ctx: VerifyContext) -> list[Finding]:
    """Open jobs that nothing will move: no live lease, no pending event, no progress."""
    return [Finding("stuck_jobs", [str(r["job_id"])],
                    f"{r['status']} at {r['current_stage']}, no live lease, no unpublished "
                    f"event and no progress since {r['updated_at']:%Y-%m-%d %H:%M:%S%z}")
            for r in ctx.query("verify_stuck_jobs")]


@check("stranded_stages")
def stranded_stages(ctx: VerifyContext) -> list[Finding]:
    """A succeeded stage whose next stage was never claimed within the grace."""
    return [Finding("stranded_stages", [str(r["job_id"])],
                    f"{r['stage']} succeeded at {r['finished_at']:%H:%M:%S%z}, "
                    f"{r['next_stage']} never claimed")
            for r in ctx.query("verify_stranded_stages", stages=list(STAGES))]


@check("orphan_attempts")
def orphan_attempts(ctx: VerifyContext) -> list[Finding]:
    """Provider attempts left ``started`` by a run that no longer holds its lease."""
    return [Finding("orphan_attempts", [str(r["job_id"])],
                    f"attempt {r['attempt_id']} ({r['stage']} chunk {r['chunk_idx']}) "
                    f"started {r['started_at']:%H:%M:%S%z} is still 'started'; its run "
                    + ("lost its lease" if r["same_run"] else "was replaced or is gone"))
            for r in ctx.query("verify_orphan_attempts")]


@check("outbox_unpublished")
def outbox_unpublished(ctx: VerifyContext) -> list[Finding]:
    """Outbox rows waiting longer than the bound (is a relay active?)."""
    rows = ctx.query("verify_outbox_unpublished")
    if not rows:
        return []
    jobs = sorted({r["kafka_key"] for r in rows if r["kafka_key"]})
    return [Finding("outbox_unpublished", jobs,
                    f"{len(rows)} outbox row(s) unpublished for over {ctx.outbox_age_s:.0f}s, "
                    f"oldest id {rows[0]['id']} ({rows[0]['event_type']}) written "
                    f"{rows[0]['created_at']:%H:%M:%S%z}")]


@check("paid_twice")
def paid_twice(ctx: VerifyContext) -> list[Finding]:
    """Chunks billed more than once, with the likely cause."""
    out = []
    for r in ctx.query("verify_paid_twice"):
        if r["overlapping"]:
            why = ("concurrent calls of two runs: a run took the stage over while the first "
                   "call was still running (lease shorter than the call, or a run not fenced)")
        elif r["runs"] > 1:
            why = ("sequential calls of different runs: a later run asked again (answer not "
                   "kept, a redrive that re-ran the LLM stage, or a stale run not fenced)")
        else:
            why = "one run succeeded more than once for the chunk (a retry after a success)"
        out.append(Finding("paid_twice", [str(r["job_id"])],
                           f"chunk {r['chunk_idx']}: {r['n']} succeeded attempts "
                           f"{list(r['attempt_ids'])} costing {float(r['cost_usd']):.6f} USD; "
                           f"{why}"))
    return out


@check("consumer_lag")
def consumer_lag(ctx: VerifyContext) -> list[Finding]:
    """Consumer groups more than ``max_lag`` messages behind (from Kafka)."""
    from jobstream.metrics import KafkaLag
    return [Finding("consumer_lag", [], f"group {gl.group} is {gl.total} messages behind "
                    f"(bound {ctx.max_lag}): {gl.topics}")
            for gl in KafkaLag(ctx.settings).lag() if gl.total > ctx.max_lag]


@check("replication_slot")
def replication_slot(ctx: VerifyContext) -> list[Finding]:
    """Logical replication slots of this database that are inactive (they retain WAL until
    the disk fills) or retain more than ``slot_retained_alert_bytes``, and a missing slot when
    ``JOBSTREAM_RELAY=debezium`` (:func:`jobstream.connect.check_replication_slot`)."""
    from jobstream.connect import check_replication_slot
    return [Finding("replication_slot", [], f"{f.severity}: {f.message}")
            for f in check_replication_slot(ctx.settings) if not f.ok]


@dataclass
class Report:
    """The result of one verification: findings per check run, and checks that could not run
    (``errors``: check -> reason)."""

    findings: dict[str, list[Finding]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def broken(self) -> list[Finding]:
        """Every finding, check by check."""
        return [f for fs in self.findings.values() for f in fs]

    @property
    def exit_code(self) -> int:
        """1 when anything is broken, 2 when a check could not run, 0 when clean."""
        return 1 if self.broken else 2 if self.errors else 0

    def as_json(self) -> str:
        """The report as one JSON object: ``ok``, ``checks`` (name -> findings), ``errors``."""
        return json.dumps({"ok": not self.broken and not self.errors,
                           "checks": {k: [asdict(f) for f in v]
                                      for k, v in self.findings.items()},
                           "errors": self.errors, "seconds": round(self.seconds, 3)})

    def text(self) -> str:
        """One line per check, then one per finding."""
        lines = []
        for name, fs in self.findings.items():
            lines.append(f"{'BROKEN' if fs else 'ok':6} {name}" + (f" ({len(fs)})" if fs else ""))
            lines += [f"       - {f}" for f in fs]
        for name, why in self.errors.items():
            lines.append(f"ERROR  {name}: {why}")
        return "\n".join(lines)


def run(settings: Settings, *, checks: list[str] | None = None, skip: tuple[str, ...] = (),
        tenant: str | None = None, grace_s: float | None = None,
        outbox_age_s: float | None = None, max_lag: int | None = None) -> Report:
    """Run the registered checks (all, or ``checks``, minus ``skip``) on the running system
    and return the :class:`Report`. Bounds default to the ``verify_*`` settings; ``tenant``
    restricts the job checks to one tenant. Reads only. Raises ``KeyError`` for an unknown
    check name; a check that fails (a service down, a timeout) is reported in ``errors``."""
    names = list(checks or CHECKS)
    unknown = [n for n in (*names, *skip) if n not in CHECKS]
    if unknown:
        raise KeyError(f"unknown checks {unknown}; known: {sorted(CHECKS)}")
    report = Report()
    t0 = time.monotonic()
    try:
        conn = connect(settings.database_url, autocommit=True)
    except psycopg.OperationalError as exc:
        report.errors = {n: f"postgres unavailable: {exc}" for n in names if n not in skip}
        return report
    with conn:
        ctx = VerifyContext(settings, conn, tenant=tenant,
                            grace_s=settings.verify_grace_s if grace_s is None else grace_s,
                            outbox_age_s=(settings.verify_outbox_age_s if outbox_age_s is None
                                          else outbox_age_s),
                            max_lag=settings.verify_max_lag if max_lag is None else max_lag)
        for name in names:
            if name in skip:
                continue
            try:
                report.findings[name] = CHECKS[name](ctx)
            except Exception as exc:  # one check down must not hide the others
                first = (str(exc).strip().splitlines() or [""])[0]
                report.errors[name] = f"{type(exc).__name__}: {first}"
    report.seconds = time.monotonic() - t0
    return report


class VerifyCollector:
    """Prometheus collector: ``jobstream_verify_broken{check}`` (findings of each check;
    0 = the guarantee holds) and ``jobstream_verify_check_failed{check}`` (1 when the check
    could not run), from a :func:`run` at most every ``verify_interval_s`` seconds."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._lock = threading.Lock()
        self._cached: tuple[float, Report] | None = None

    def describe(self) -> list[Any]:
        """Nothing: registering must not query anything."""
        return []

    def collect(self) -> Iterator[Any]:
        """The two gauge families of the latest (possibly cached) run."""
        from prometheus_client.core import GaugeMetricFamily
        with self._lock:
            now = time.monotonic()
            if self._cached is None or now - self._cached[0] >= self.settings.verify_interval_s:
                self._cached = (now, run(self.settings))
            report = self._cached[1]
        broken = GaugeMetricFamily("jobstream_verify_broken", "Findings of each jobstream "
                                   "verify check (0: the guarantee holds).", labels=["check"])
        failed = GaugeMetricFamily("jobstream_verify_check_failed", "1 when the verify check "
                                   "could not run (a service down, a timeout).",
                                   labels=["check"])
        for name in CHECKS:
            if name in report.findings:
                broken.add_metric([name], len(report.findings[name]))
            failed.add_metric([name], 1 if name in report.errors else 0)
        return iter([broken, failed])
