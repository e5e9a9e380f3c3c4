"""The job store: every database operation of the pipeline, in the project's vocabulary.

Each public method is one short transaction (or joins the caller's via ``conn=``). Driver errors
are translated here, and only here: ``psycopg.OperationalError`` (Postgres unreachable or
restarting) becomes :class:`RetryableError` ``db_unavailable``; ``psycopg.DataError`` (bytes or
strings the database cannot store, e.g. NUL) becomes :class:`PoisonMessage` ``invalid_data``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import time
import uuid
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import MISSING, dataclass, field, fields
from datetime import datetime
from decimal import Decimal
from typing import Any, TypeVar

import orjson
import psycopg
from psycopg.pq import ExecStatus, TransactionStatus
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb, set_json_dumps, set_json_loads
from psycopg_pool import ConnectionPool
from pydantic import BaseModel

from jobstream import faults, health, idempotency, tracing
from jobstream.db import QUERIES as Q
from jobstream.db import Conn
from jobstream.errors import PoisonMessage, RetryableError, StaleRun
from schemas.events import encode_event
from schemas.pipeline import PIPELINE

#: The checkpoint chain (design.md): one checkpoint per stage, named like the stage
#: (``schemas.pipeline``).
STAGES = PIPELINE.names
TERMINAL = ("succeeded", "failed", "cancelled")


R = TypeVar("R")
T = TypeVar("T")


def typed_row(cls: type[R], row: dict[str, Any]) -> R:
    """A typed row (a dataclass below) from a dict row; columns the class does not name (added
    by a later migration) are ignored. Raises ``TypeError`` when a named column is missing.

    A row that has every field of a plain frozen dataclass (no ``__post_init__``, no
    ``__slots__``, no default factory) is set into the new object's ``__dict__`` at once, which
    is what its ``__init__`` does one ``object.__setattr__`` at a time (issue 12, worker12:
    ``JobRow`` from a claim's row 10-16 -> 2-3 us); any other row goes through ``__init__``
    (its defaults, its ``TypeError``)."""
    shape = _SHAPES.get(cls)
    if shape is None:
        shape = _SHAPES[cls] = _shape(cls)
    names, plain = shape
    if plain and names <= row.keys():
        obj = object.__new__(cls)
        obj.__dict__.update({k: row[k] for k in names})
        return obj
    return cls(**{k: v for k, v in row.items() if k in names})


def _shape(cls: type) -> tuple[frozenset[str], bool]:
    """``cls``'s field names and whether :func:`typed_row` may fill its ``__dict__`` directly
    (a frozen dataclass whose ``__init__`` only sets its fields)."""
    fs = fields(cls)
    plain = (cls.__dataclass_params__.frozen  # type: ignore[attr-defined]  # a dataclass's
             and not hasattr(cls, "__post_init__") and not hasattr(cls, "__slots__")
             and all(f.init and f.default_factory is MISSING for f in fs))
    return frozenset(f.name for f in fs), plain


_SHAPES: dict[type, tuple[frozenset[str], bool]] = {}


@dataclass(frozen=True)
class JobRow:
    """One row of ``job``: a client's computation (money in USD, times timezone-aware)."""

    job_id: uuid.UUID
    tenant_id: str
    idempotency_key: str
    request_hash: str
    dedup_key: str
    request_id: str
    document_sha256: str
    filename: str
    content_type: str
    pipeline: str
    prompt_version: str
    model_profile: str
    lane: str
    status: str
    current_stage: str
    cancel_requested: bool
    error_code: str | None
    error: str | None
    cost_usd: Decimal
    charge_usd: Decimal
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None
    generation: int = 0
    cancel_requested_at: datetime | None = None
    trace_id: str | None = None
    sweeps: int = 0
    swept_at: datetime | None = None


@dataclass(frozen=True)
class ChunkRow:
    """One chunk of a job's text: position ``idx``, its text and hash, and the model's output
    (``None`` until answered)."""

    idx: int
    text: str
    text_sha256: str
    llm_output: Any = None


@dataclass(frozen=True)
class StageCheckpoint:
    """A stage's checkpoint as a re-drive plans from it: status, code version, the payload
    of the event it emitted (``None`` until it succeeded) and its lease end."""

    stage: str
    status: str
    code_version: str | None
    emitted: Any
    lease_until: datetime | None


@dataclass(frozen=True)
class ExpiredLease:
    """A running stage whose lease expired (the sweeper's work list): its run token and
    attempt number (runs so far)."""

    job_id: uuid.UUID
    stage: str
    run_token: uuid.UUID
    attempt: int
    lease_until: datetime


@dataclass(frozen=True)
class StalledJob:
    """An open job whose next stage was never claimed long after its last checkpoint (the
    sweeper's second work list): the stage that should run next (``stage``), the checkpoint
    before it and the payload that checkpoint emitted (the lost event's payload)."""

    job_id: uuid.UUID
    stage: str
    checkpoint: str
    emitted: Any


@dataclass(frozen=True)
class ProviderBudget:
    """What a job's provider budget has used so far: the stage's attempts per chunk index (all
    runs and retry rounds), the stage's attempts and cost, and the job's cost (USD, every
    stage)."""

    chunk_attempts: dict[int, int]
    stage_attempts: int
    stage_cost_usd: float
    job_cost_usd: float


#: The names a stage's ``READS`` may hold besides ``output:<stage>`` (:meth:`Store.claim`).
_READS = frozenset({"document", "chunks", "budget"})
#: The shortest idle limit a claim's transaction gets (seconds): its lease, but at least this,
#: so a lease shorter than a round trip (a test's lease made to expire at once) does not end
#: the claiming session between its own statements.
CLAIM_IDLE_FLOOR_S = 1.0


@dataclass(frozen=True)
class StageInputs:
    """What a stage reads, fetched in its claim transaction (see :meth:`Store.claim`'s
    ``reads``); ``None`` where not read (or not there): the document's bytes (``document``),
    the previous checkpoint's output (``output:<stage>``), the job's chunks (``chunks``), the
    provider budget used so far (``budget``)."""

    document: bytes | None = None
    previous_output: Any = None
    chunks: tuple[ChunkRow, ...] | None = None
    budget: ProviderBudget | None = None


@dataclass(frozen=True)
class LocalAnswer:
    """A chunk answered in-process (no remote provider): recorded as a ``succeeded`` provider
    attempt together with the chunk's output in the stage's completion transaction."""

    idx: int
    attempt: int
    model: str
    output: Any
    latency_ms: float
    prompt_tokens: int
    completion_tokens: int
    cost_usd: float


@dataclass(frozen=True)
class IntakeResult:
    """``job_id`` of the intent; ``created`` is False when the job already existed. ``dedup``:
    ``new`` (created), ``replayed`` (the same idempotency key again), ``reused`` (another key
    for the same computation, which succeeded or is still running) or ``restarted`` (the same
    computation had failed or was cancelled: a new run of its job started)."""

    job_id: uuid.UUID
    created: bool
    dedup: str = "replayed"


@dataclass(frozen=True)
class IntakeIntent:
    """One client intent for :meth:`Store.intake_batch`: the arguments of :meth:`Store.intake`
    (``job``: the job row's columns; ``accepted``: ``job_id -> JobAccepted``; ``topic``: the
    ``job.accepted`` topic, full name; ``restart``: ``(conn, job_id) -> bool``) and the span
    of the event it came from (``None``: a new trace)."""

    tenant_id: str
    idempotency_key: str
    request_hash: str
    request_id: str
    job: dict[str, Any]
    content: bytes
    accepted: Any
    topic: str
    extra: tuple[OutboxMessage, ...] = ()
    restart: Any = None
    span: tracing.SpanContext | None = None


@dataclass(frozen=True)
class Claim:
    """A claimed stage run: the fencing token (``run_token``), attempt number and lease end.
    The run's generation is ``job.generation`` (the job row read under the claim's lock):
    every move of the run is fenced by run token AND generation. ``inputs``: what the stage
    reads, fetched in the claim's transaction."""

    job: JobRow
    stage: str
    run_token: uuid.UUID
    attempt: int
    lease_until: datetime
    inputs: StageInputs = field(default_factory=StageInputs)

    @property
    def generation(self) -> int:
        """The job generation this run belongs to (a redrive starts a new one)."""
        return self.job.generation


@dataclass(frozen=True)
class Skip:
    """The event needs no work: ``reason`` is ``duplicate``, ``done``, ``terminal`` or
    ``cancelled`` (or ``superseded``); ``unknown_job`` and ``generation_ahead`` are poison
    for the caller (no such job; an event of a newer generation than its job's)."""

    reason: str


@dataclass(frozen=True)
class Done:
    """The stage already succeeded under the current code version but this event was not
    processed yet (a redrive): re-emit ``emitted`` (the payload of the stage's event)."""

    job: JobRow
    emitted: dict[str, Any]


@dataclass(frozen=True)
class LeaseHeld:
    """Another run holds a live lease on the stage until ``lease_until``."""

    lease_until: datetime


@dataclass(frozen=True)
class OutboxMessage:
    """One event to publish: topic, Kafka key, value bytes, headers."""

    topic: str
    key: str
    value: bytes
    headers: dict[str, str]


def outbox_message(topic: str, event: BaseModel) -> OutboxMessage:
    """Build the outbox row of ``event`` (key = job id; headers carry the routing facts)."""
    ev: Any = event
    headers = {
        "event_type": ev.event_type, "schema_version": str(ev.schema_version),
        "event_id": str(ev.event_id), "request_id": ev.request_id, "tenant_id": ev.tenant_id,
        "content-type": "application/json",
    }
    job_id = getattr(ev, "job_id", None)
    if job_id is not None:
        headers["job_id"] = str(job_id)
        headers["dedup_key"] = ev.dedup_key
    return OutboxMessage(topic, str(job_id or ev.idempotency_key), encode_event(event), headers)


#: Every ASCII digit as ``0``, every other byte as a space: a text whose translation holds
#: :data:`_LONG_RUN` has a run of 19 digits or more, which may be an integer orjson reads
#: differently from ``json`` (orjson 3.13 reads one outside int64 / uint64 as a float, e.g.
#: ``18446744073709551616`` or ``-9223372036854775809``, where ``json`` keeps the int). Ten
#: times faster than the regex ``\d{19}`` (0.46 vs 4.2 us on 460 bytes).
_DIGITS_AS_ZERO = bytes(0x30 if 0x30 <= b <= 0x39 else 0x20 for b in range(256))
_LONG_RUN = b"0" * 19


def loads_json(data: str | bytes) -> Any:
    """JSON text (a ``json`` / ``jsonb`` column, an encoded event) as Python values, exactly
    what ``json.loads`` gives: orjson (C, ~4x faster; issue 12, ``perf-worker8``) unless the
    text has a run of 19 or more digits or orjson refuses it (``NaN``, a lone surrogate, an
    overflowing float, nesting past 1024), then ``json.loads``. Raises what ``json.loads``
    raises. (Floats: orjson and ``json`` agreed on 250k random doubles and decimal texts.)
    ``str`` (psycopg passes bytes) goes to ``json.loads``."""
    if isinstance(data, bytes) and _LONG_RUN not in data.translate(_DIGITS_AS_ZERO):
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            pass
    return json.loads(data)


#: orjson options that make it refuse what ``json.dumps`` refuses: a dataclass, a datetime (and
#: date, time) and a subclass of str / int / dict / list go to :func:`_refuse` (orjson would
#: encode them itself), which sends them to ``json.dumps``.
_DUMPS_OPTIONS = (orjson.OPT_PASSTHROUGH_DATACLASS | orjson.OPT_PASSTHROUGH_DATETIME
                  | orjson.OPT_PASSTHROUGH_SUBCLASS)


def _refuse(value: Any) -> Any:
    """orjson's ``default``: every value it does not encode itself goes to ``json.dumps``."""
    raise TypeError(type(value).__name__)


def dumps_json(value: Any) -> bytes:
    """The JSON text (UTF-8) that Postgres reads as the same ``jsonb`` as ``json.dumps(value)``
    (psycopg's default for ``Jsonb``, and intake's text arrays), or the error ``json.dumps``
    raises: orjson (C, ~10x faster; issue 12, ``worker12``) unless orjson refuses the value
    (an int beyond 64 bits, a lone surrogate, a non-str key, nesting past 255, a dataclass,
    a datetime, a subclass: see :data:`_DUMPS_OPTIONS`) or the value holds a NaN or an
    infinity, which orjson writes as ``null`` (``json.dumps`` writes ``NaN``, which Postgres
    refuses: ``invalid_data``, as before); then ``json.dumps``. The value is walked for them
    (:func:`_non_finite`) only when orjson's text has a ``null`` (adv14: a ``None`` field or a
    text with the word "null" had been encoded twice). The texts differ in
    form only (non-ASCII unescaped, ``1e-05`` as ``1e-5``), not in the ``jsonb`` value.
    One difference: orjson writes a ``uuid.UUID`` (as its text) and an ``enum.Enum`` (as
    its value), where ``json.dumps`` raised ``TypeError``; no Store caller passes either."""
    try:
        out = orjson.dumps(value, default=_refuse, option=_DUMPS_OPTIONS)
    except TypeError:  # orjson.JSONEncodeError is one
        return json.dumps(value).encode()
    return json.dumps(value).encode() if b"null" in out and _non_finite(value) else out


def _non_finite(value: Any) -> bool:
    """Whether ``value`` (what orjson encoded: dicts, lists, tuples and scalars, nested at
    most 255 deep) holds a float NaN or infinity."""
    t = type(value)
    if t is float:
        return not math.isfinite(value)
    if t is dict:
        return any(_non_finite(v) for v in value.values())
    if t is list or t is tuple:
        return any(_non_finite(v) for v in value)
    return False


def _loads_event(value: bytes) -> dict[str, Any]:
    """An outbox message's value (an encoded event, JSON) as a dict (:func:`loads_json`)."""
    ev: dict[str, Any] = loads_json(value)
    return ev


def _configure(conn: Conn) -> None:
    """A new pooled connection: its ``json`` / ``jsonb`` columns are read by :func:`loads_json`
    (psycopg's default is ``json.loads``: ~1.4 % of a stage worker's batch threads) and its
    ``Jsonb`` parameters written by :func:`dumps_json` (psycopg's: ``json.dumps``)."""
    set_json_loads(loads_json, conn)
    set_json_dumps(dumps_json, conn)


class _StepRaised(Exception):  # noqa: N818 - a signal inside the store, not an error
    """A step of a savepoint-free shared stage transaction raised: the transaction rolls back
    and its steps run again, a savepoint each (:meth:`Store.claim_and_complete_many`)."""


@functools.cache
def _completion(chunks: bool, answers: bool) -> str:
    """The completion statement of a run: ``complete_stage_emit`` with the CTEs that write
    a first run's chunks (``chunks``) and the in-process model's answers (``answers``, adding
    ``answered`` to its row) only when that run has them (issue 12, perf-stage7; a
    data-modifying CTE opens its table and indexes at every execution, rows or not)."""
    head, sep, tail = Q["complete_stage_emit"].rpartition("\nSELECT (SELECT count(*) FROM done)")
    assert sep, "complete_stage_emit: its final SELECT moved"
    extra = ([Q["complete_stage_emit_chunks_cte"]] if chunks else []) + (
        [Q["complete_stage_emit_answers_cte"]] if answers else [])
    if answers:
        tail += ",\n       (SELECT count(*) FROM answered)::int AS answered"
    return ",\n".join([head, *extra]) + sep + tail


log = logging.getLogger(__name__)

#: The values of the ``outbox_notify`` setting: ``after_commit`` (a Store's connections wake
#: the relay after each commit that wrote outbox rows, the outbox trigger skips its NOTIFY in
#: their sessions; migration 0039) or ``in_transaction`` (the trigger's NOTIFY, inside the
#: writing transaction, as before 0039).
OUTBOX_NOTIFY_MODES = ("after_commit", "in_transaction")

#: The named queries that insert outbox rows from a Store's transactions: each call site marks
#: its connection (:func:`outbox_written`). ``tests/unit/test_outbox_wake.py`` fails when a
#: query of ``queries.sql`` inserts into the outbox and is neither here nor run outside Store
#: (``debezium_handover``).
OUTBOX_WRITES = frozenset({"outbox_insert", "intake_batch_outbox_insert", "complete_stage_emit"})

#: Connections whose open transaction wrote outbox rows (:func:`outbox_written`); the Store
#: that handed the connection out wakes the relay once that transaction committed
#: (:meth:`Store.connection`). Weak: a connection closed meanwhile simply leaves.
_OUTBOX_WRITTEN: weakref.WeakSet[Conn] = weakref.WeakSet()


def outbox_written(conn: Conn) -> None:
    """Note that ``conn``'s open transaction wrote outbox rows (one of
    :data:`OUTBOX_WRITES`): :meth:`Store.connection` wakes the relay after it commits. A
    rolled-back transaction's mark is dropped; a mark on a connection no Store handed out
    does nothing (its session has no ``jobstream.outbox_notify``, so the trigger NOTIFYs)."""
    _OUTBOX_WRITTEN.add(conn)


def outbox_notify_option(mode: str) -> str:
    """The libpq ``options`` that make a session wake the relay itself after its commits
    (``mode`` ``after_commit``: the outbox trigger skips its NOTIFY there, migration 0039), or
    ``""`` (``in_transaction``). Raises ``ValueError`` for another mode."""
    if mode not in OUTBOX_NOTIFY_MODES:
        raise ValueError(f"outbox_notify {mode!r}: use one of {OUTBOX_NOTIFY_MODES}")
    return "-c jobstream.outbox_notify=after_commit" if mode == "after_commit" else ""


#: :func:`wake_relay`'s statement as libpq takes it.
_OUTBOX_WAKE = Q["outbox_wake"].encode()


def wake_relay(conn: Conn) -> bool:
    """Wake the relay after a commit that wrote outbox rows (issue 12, perf-notify9):
    ``pg_notify('outbox_v1', '')`` in a transaction of its own on ``conn`` (idle, not in a
    transaction), committed asynchronously (``outbox_wake``), so it holds the notification
    queue's lock for microseconds where a NOTIFY inside the writing transaction held it
    through that transaction's WAL flush and serialised every notifying commit server-wide
    (bench/README.md, relay ninth pass). One round trip; ``conn`` must not be in pipeline
    mode.

    Returns False, and raises nothing, when it could not be sent (Postgres gone after the
    commit, the connection broken): a lost wake-up only delays the rows, which the relay's
    poll (``relay_poll_interval_s``) and its caught-up looks still find (docs/design-notes.md,
    "The relay's wake-up after the commit")."""
    faults.point("outbox_after_commit_before_wake")
    try:
        # One simple-protocol statement straight on libpq, an implicit transaction of its
        # own: no BEGIN / COMMIT round trips, and no cursor or autocommit switching in Python
        # (10-59 vs 67-131 us of client CPU per wake-up at load 14, bench/README.md ninth
        # pass). psycopg reads the session's transaction status from libpq, so it stays right.
        with conn.lock:
            res = conn.pgconn.exec_(_OUTBOX_WAKE)
    except psycopg.Error as exc:
        log.debug("relay wake-up not sent (the relay's poll finds the rows): %s", exc)
        return False
    if res.status != ExecStatus.TUPLES_OK:
        log.debug("relay wake-up not sent (the relay's poll finds the rows): %s",
                  res.error_message.decode(errors="replace"))
        return False
    return True


#: Postgres' error (SQLSTATE 0A000) for a prepared statement whose result columns changed
#: (a column added to a table it reads with ``*``): :meth:`Store.tx` retries it.
STALE_PLAN = "cached plan must not change result type"


class Store:
    """All DB operations, over a small connection pool (``max_size`` connections)."""

    def __init__(self, url: str, *, max_size: int = 8, min_size: int = 0,
                 max_idle_s: float = 30.0, timeout_s: float = 30.0,
                 name: str = "jobstream", check_idle_s: float = 1.0,
                 prepare_threshold: int | None = 0, plan_cache_mode: str | None = None,
                 outbox_notify: str = "after_commit") -> None:
        """A pool of at most ``max_size`` connections (``min_size`` kept open; one idle for
        ``max_idle_s`` seconds is closed, so an idle process gives its connections back);
        callers wait up to ``timeout_s`` seconds for one. ``name`` is the connections'
        ``application_name`` (pg_stat_activity shows who holds what). A connection idle for
        more than ``check_idle_s`` seconds is checked (an empty query) before it is handed
        out; one reused sooner is not (see ``db_pool_check_idle_s``). A statement is
        prepared on a connection after ``prepare_threshold`` executions on it (0: at once;
        None: never; ``db_prepare_threshold``). ``plan_cache_mode``: the connections'
        Postgres ``plan_cache_mode`` (None: the server's; ``db_worker_plan_cache_mode``).
        ``outbox_notify``: ``after_commit`` (the connections wake the relay after each commit
        that wrote outbox rows, :func:`wake_relay`) or ``in_transaction`` (the outbox
        trigger's NOTIFY inside the transaction); the ``outbox_notify`` setting. Raises
        ``ValueError`` for another value."""
        self.url = url
        self.timeout_s = timeout_s
        self.check_idle_s = check_idle_s
        self._last_used: dict[int, float] = {}
        kwargs: dict[str, Any] = {"row_factory": dict_row, "connect_timeout": 10,
                                  "application_name": name,
                                  "prepare_threshold": prepare_threshold}
        self.wakes_relay = outbox_notify == "after_commit"
        options = [outbox_notify_option(outbox_notify)]
        if plan_cache_mode is not None:
            options.append(f"-c plan_cache_mode={plan_cache_mode}")
        if any(options):  # set at connect: no statement per connection
            given = psycopg.conninfo.conninfo_to_dict(url).get("options")  # the URL's kept
            kwargs["options"] = " ".join(filter(None, [str(given or ""), *options]))
        self.pool: ConnectionPool[Conn] = ConnectionPool(
            url, min_size=min_size, max_size=max_size, connection_class=Conn,
            max_idle=max_idle_s, open=True, kwargs=kwargs, check=self._check,
            configure=_configure)

    def _check(self, conn: Conn) -> None:
        """The pool's check on hand-out: only for a connection idle over ``check_idle_s``."""
        if time.monotonic() - self._last_used.get(id(conn), 0.0) > self.check_idle_s:
            ConnectionPool.check_connection(conn)

    @classmethod
    def for_process(cls, settings: Any, process: str, max_size: int) -> Store:
        """The pool of one process (``worker``, ``api``, ``relay``…) sized by the
        ``db_pool_*`` settings (the connection budget, README "Connection budget"); the
        ``worker``'s connections plan with ``db_worker_plan_cache_mode``."""
        return cls(settings.database_url, max_size=max_size,
                   min_size=min(settings.db_pool_min_size, max_size),
                   max_idle_s=settings.db_pool_max_idle_s, timeout_s=settings.db_pool_timeout_s,
                   name=f"jobstream-{process}", check_idle_s=settings.db_pool_check_idle_s,
                   prepare_threshold=settings.db_prepare_threshold,
                   plan_cache_mode=(settings.db_worker_plan_cache_mode
                                    if process == "worker" else None),
                   outbox_notify=settings.outbox_notify)

    @contextmanager
    def connection(self) -> Iterator[Conn]:
        """A pooled connection (no transaction); reports to the process's readiness
        (:mod:`jobstream.health`). Raises ``psycopg.OperationalError`` (``PoolTimeout``
        included) when none can be had within ``timeout_s``.

        When the caller's block ends without an exception, its transaction committed and it
        wrote outbox rows (:func:`outbox_written`), the relay is woken (:func:`wake_relay`)
        before the connection goes back to the pool: every Store transaction that writes the
        outbox (``tx``, ``intake``, ``intake_batch``) commits inside this block."""
        try:
            with self.pool.connection(timeout=self.timeout_s) as conn:
                health.ok()
                try:
                    yield conn
                except BaseException:
                    _OUTBOX_WRITTEN.discard(conn)  # rolled back (or the pool rolls it back)
                    raise
                finally:
                    self._last_used[id(conn)] = time.monotonic()
                if conn in _OUTBOX_WRITTEN:
                    _OUTBOX_WRITTEN.discard(conn)
                    if (self.wakes_relay
                            and conn.info.transaction_status == TransactionStatus.IDLE):
                        wake_relay(conn)
        except psycopg.OperationalError as exc:
            if not isinstance(exc, psycopg.errors.QueryCanceled):  # a timeout is not an outage
                health.failed(exc)
            raise

    def probe(self) -> None:
        """One trivial query through the pool (the readiness probe of an idle process).
        Raises ``psycopg.OperationalError``."""
        with self.connection() as conn:
            conn.execute(Q["health_probe"])

    def close(self) -> None:
        """Close every pooled connection."""
        self.pool.close()

    @contextmanager
    def tx(self) -> Iterator[Conn]:
        """One transaction on a pooled connection; Postgres outages become RetryableError."""
        try:
            with self.connection() as conn, conn.transaction():
                yield conn
        except psycopg.errors.LockNotAvailable as exc:  # a lock_timeout the caller set
            raise RetryableError(f"a row this needs is locked by another transaction (a busy or "
                                 f"frozen worker): {exc}".strip(), code="row_locked",
                                 retry_after_s=5.0) from None
        except (psycopg.OperationalError,
                # The session was ended under a paused process (one_transaction_idle_limit):
                # an outage to retry, though SQLSTATE class 25 makes it an InternalError.
                psycopg.errors.IdleInTransactionSessionTimeout) as exc:
            raise RetryableError(f"database unavailable: {exc}", code="db_unavailable") from None
        except psycopg.errors.SerializationFailure as exc:
            raise RetryableError(f"serialization failure: {exc}", code="db_conflict") from None
        except psycopg.errors.FeatureNotSupported as exc:
            if STALE_PLAN not in str(exc):
                raise
            # A migration changed a table under a statement prepared on this connection (a
            # rolling upgrade): the transaction rolled back, and psycopg drops a connection's
            # prepared statements on a rollback, so the retry runs (breaker6:
            # tests/e2e/test_break_online_migration.py; it failed the job as a bug).
            raise RetryableError(f"a table changed under a prepared statement (a migration "
                                 f"while running): {exc}", code="db_schema_changed") from None
        except (psycopg.DataError, UnicodeEncodeError) as exc:  # NUL, out of range, surrogate
            raise PoisonMessage(f"data the database cannot store: {exc}",
                                code="invalid_data") from None

    # ------------------------------------------------------------------ outbox

    @staticmethod
    def add_outbox(conn: Conn, msg: OutboxMessage) -> None:
        """Write one outbox row inside the caller's transaction (the transactional outbox).

        The row's headers get a W3C ``traceparent`` unless they have one: a child of the
        current span (:func:`jobstream.tracing.current`), or with no span in force (sweeper,
        redrive) one in the job's stored trace, so every event of a job shares its trace-id.
        """
        ev = _loads_event(msg.value)
        conn.execute(Q["outbox_insert"], (msg.topic, msg.key, msg.value,
                                          Jsonb(Store._outbox_headers(conn, msg, ev)),
                                          ev["event_id"], ev["event_type"]))
        outbox_written(conn)

    @staticmethod
    def _outbox_headers(conn: Conn, msg: OutboxMessage, ev: dict[str, Any]
                        ) -> dict[str, Any]:
        """The headers :meth:`add_outbox` writes for ``msg`` (its event ``ev``, decoded): a
        ``traceparent`` added as described there."""
        headers = dict(msg.headers)
        if tracing.HEADER not in headers:
            trace_id = None
            if tracing.current() is None and ev.get("job_id"):
                trace_id = Store._job_trace_id(conn, ev["job_id"])
            headers[tracing.HEADER] = tracing.outgoing_header(trace_id)
        return headers

    @staticmethod
    def _job_trace_id(conn: Conn, job_id: str) -> str:
        """The job's trace-id; a job without one (created before traces) is given one."""
        row = conn.execute(Q["job_trace_id"], (job_id,)).fetchone()
        if row and row["trace_id"]:
            return str(row["trace_id"])
        conn.execute(Q["set_job_trace_id"], (tracing.new_trace_id(), job_id))
        row = conn.execute(Q["job_trace_id"], (job_id,)).fetchone()
        return str(row["trace_id"]) if row and row["trace_id"] else tracing.new_trace_id()

    # ------------------------------------------------------------------ intake

    def intake(self, *, tenant_id: str, idempotency_key: str, request_hash: str,
               request_id: str, job: dict[str, Any], content: bytes,
               accepted: Any, topic: str, conn: Conn | None = None,
               extra: Sequence[OutboxMessage] = (),
               restart: Any = None) -> IntakeResult:
        """Create a job for one client intent, in ONE transaction: document, job, idempotency
        record, ``intake`` checkpoint and the ``job.accepted`` outbox row (plus ``extra``
        outbox rows, e.g. a ``document.uploaded`` for other consumers).

        ``job``: the job row's columns (``job_id``, ``dedup_key``, …). ``accepted``: a callable
        ``job_id -> event`` building the outbox event. ``conn``: join the caller's transaction
        (a savepoint is used). The same (tenant, idempotency_key) again returns the same job
        with no new work; a second key for the same dedup_key is bound to the existing job.
        Raises :class:`~jobstream.errors.IdempotencyConflict` when the key was used with a
        different body (:func:`jobstream.idempotency.bound_target`).
        ``restart``: ``(conn, job_id) -> bool``, called when a new key is bound to a job that
        failed or was cancelled, in the same transaction; it starts a new run of that job and
        returns False when the job's state changed meanwhile (then the key reuses the job).

        Intake is where a job's trace starts: the job keeps the trace-id of the current span
        (the incoming event's or request's ``traceparent``), or of a new trace.
        """
        span = tracing.current() or tracing.start()
        job = {**job, "trace_id": span.trace_id}
        with tracing.use(span):
            if conn is not None:
                return self._intake_in(conn, tenant_id, idempotency_key, request_hash,
                                       request_id, job, content, accepted, topic, list(extra),
                                       restart)
            try:
                with self.connection() as own:
                    return self._intake_in(own, tenant_id, idempotency_key, request_hash,
                                           request_id, job, content, accepted, topic,
                                           list(extra), restart)
            except psycopg.OperationalError as exc:
                raise RetryableError(f"database unavailable: {exc}",
                                     code="db_unavailable") from None

    def _intake_in(self, conn: Conn, tenant_id: str, idempotency_key: str,
                   request_hash: str, request_id: str, job: dict[str, Any], content: bytes,
                   accepted: Any, topic: str, extra: list[OutboxMessage],
                   restart: Any = None,
                   begin: Callable[[Conn], contextlib.AbstractContextManager[Any]] | None = None,
                   idle_limit_s: float | None = None) -> IntakeResult:
        """One intent's rows (:meth:`intake`) in ``conn.transaction()`` (a savepoint when
        ``conn`` is in a transaction), or in ``begin(conn)`` (:meth:`_intake_one`: the
        transaction itself and its fault point); each attempt of the insert race in a new one.
        ``idle_limit_s``: the transaction's idle limit (seconds), set by its first statement
        (the key's look-up); None: left as it is."""
        idle_ms = None if idle_limit_s is None else str(int(idle_limit_s * 1000))
        for _ in range(3):  # a concurrent identical intent may win the insert race: re-read
            try:
                with conn.transaction() if begin is None else begin(conn):
                    # The key's record and the job it created first, in one round trip.
                    found = conn.execute(Q["find_request_and_job_by_key"],
                                         {"tenant_id": tenant_id, "key": idempotency_key,
                                          "idle_ms": idle_ms}).fetchone()
                    assert found is not None  # one row, NULLs where there is nothing
                    bound = idempotency.bound_target(
                        found if found["job_id"] is not None else None,
                        key=idempotency_key, request_hash=request_hash, target="job")
                    if bound is not None:
                        return IntakeResult(bound, False)
                    # The key's record expired (retention)? Its job remembers it.
                    bound = idempotency.bound_target(
                        {"job_id": found["key_job_id"], "request_hash": found["key_request_hash"]}
                        if found["key_job_id"] is not None else None,
                        key=idempotency_key, request_hash=request_hash, target="job")
                    if bound is not None:
                        conn.execute(Q["insert_request"], (tenant_id, idempotency_key,
                                                           request_hash, bound, request_id))
                        return IntakeResult(bound, False)
                    conn.execute(Q["insert_document"], (tenant_id, job["document_sha256"],
                                                        job["content_type"], len(content), content))
                    created = conn.execute(Q["insert_job"], job).fetchone()
                    if created is None:
                        existing = conn.execute(Q["job_by_dedup_key"],
                                                (tenant_id, job["dedup_key"])).fetchone()
                        assert existing is not None
                        conn.execute(Q["insert_request"], (tenant_id, idempotency_key,
                                                           request_hash, existing["job_id"],
                                                           request_id))
                        if (restart is not None and existing["status"] in ("failed", "cancelled")
                                and restart(conn, existing["job_id"])):
                            return IntakeResult(existing["job_id"], False, "restarted")
                        return IntakeResult(existing["job_id"], False, "reused")
                    job_id = created["job_id"]
                    conn.execute(Q["insert_request"], (tenant_id, idempotency_key, request_hash,
                                                       job_id, request_id))
                    event = accepted(job_id)
                    conn.execute(Q["insert_done_stage"], (
                        job_id, STAGES[0], job["document_sha256"], PIPELINE.stages[0].code_version,
                        Jsonb({"filename": job["filename"]}),
                        Jsonb(event.payload.model_dump(mode="json"))))
                    self.add_outbox(conn, outbox_message(topic, event))
                    for msg in extra:
                        self.add_outbox(conn, msg)
                    return IntakeResult(job_id, True, "new")
            except psycopg.errors.UniqueViolation:
                continue
            except psycopg.DataError as exc:  # e.g. a NUL in a text column: the request's fault
                raise PoisonMessage(f"Postgres refused the request's data: {exc}"[:500],
                                    code="invalid_data") from None
        raise RetryableError("intake kept losing a uniqueness race", code="db_conflict")

    def intake_batch(self, intents: Sequence[IntakeIntent], *, idle_limit_s: float | None = None
                     ) -> list[IntakeResult | Exception]:
        """Accept many client intents in ONE transaction: per intent exactly what
        :meth:`intake` does (idempotency record, dedup key, job, ``intake`` checkpoint and the
        ``job.accepted`` outbox row together), each in its own savepoint, so an intent Postgres
        refuses (``invalid_data``), a key reused with another body
        (:class:`~jobstream.errors.IdempotencyConflict`) or a bug in one intent rolls back that
        intent alone and the others commit.

        Returns one entry per intent, in the order given: its :class:`IntakeResult`, or the
        exception that intent raised (nothing of it was written). Intents are written in
        document-hash order (the intents of one key keep their order: the first wins), so
        concurrent batches sharing documents lock rows in one order. The same key twice in a
        batch is one job (the second is a replay), as in two transactions. When Postgres is
        unreachable, or the commit fails, every intent that did not fail on its own gets a
        :class:`RetryableError` (``db_unavailable``) or, when the commit itself was refused, is
        accepted again one transaction per intent (:meth:`intake`).

        ``idle_limit_s`` (seconds): the transaction may sit idle that long
        (``idle_in_transaction_session_timeout``, set locally), so a process frozen inside it
        (SIGSTOP, a VM pause) loses its session and the row locks of the batch's documents,
        which the partitions' next owner needs for the same events; its commit then fails as an
        outage (``db_unavailable``) and the events come back as replays.
        """
        out: list[IntakeResult | Exception | None] = [None] * len(intents)
        if not intents:
            return []
        if len(intents) == 1:  # an idle pipeline's document: no savepoint, no pipeline
            return [self._intake_one(intents[0], idle_limit_s)]
        first: dict[tuple[str, str], str] = {}
        for it in intents:
            first.setdefault((it.tenant_id, it.idempotency_key), it.job["document_sha256"])
        order = sorted(range(len(intents)), key=lambda i: (
            intents[i].tenant_id, first[(intents[i].tenant_id, intents[i].idempotency_key)], i))
        try:
            with self.connection() as conn, conn.transaction():
                limit = {"ms": str(int((idle_limit_s or 0) * 1000))}
                if idle_limit_s is not None:
                    conn.execute(Q["one_transaction_idle_limit"], limit)
                slow = self._intake_fast(conn, intents, order, out)
                if idle_limit_s is not None and len(order) > 1:
                    # Postgres arms the idle timeout only after a statement outside a
                    # pipeline: after _intake_fast's pipeline a process frozen until the
                    # COMMIT would keep its session (and locks) for good.
                    conn.execute(Q["one_transaction_idle_limit"], limit)
                for i in slow:
                    it = intents[i]
                    span = it.span or tracing.start()
                    with tracing.use(span):
                        try:
                            out[i] = self._intake_in(
                                conn, it.tenant_id, it.idempotency_key, it.request_hash,
                                it.request_id, {**it.job, "trace_id": span.trace_id},
                                it.content, it.accepted, it.topic, list(it.extra), it.restart)
                        except psycopg.OperationalError:
                            raise
                        except Exception as exc:  # its savepoint rolled back; the rest stands
                            out[i] = exc
                faults.point("intake_batch_before_commit")
        except (psycopg.OperationalError,
                # The session was ended under a frozen process (idle_limit_s): an outage.
                psycopg.errors.IdleInTransactionSessionTimeout) as exc:
            err = RetryableError(f"database unavailable: {exc}", code="db_unavailable")
            return [r if isinstance(r, PoisonMessage) else err for r in out]
        except psycopg.Error:  # the COMMIT refused (e.g. a deferred constraint): one by one
            return [r if isinstance(r, Exception) else self._intake_alone(it)
                    for r, it in zip(out, intents, strict=True)]
        return [r for r in out if r is not None]

    def _intake_one(self, it: IntakeIntent, idle_limit_s: float | None
                    ) -> IntakeResult | Exception:
        """:meth:`intake_batch` of ONE intent (an idle pipeline's document; issue 12, idle12):
        the same rows, idle limit, fault point and outcomes, with the intent's transaction
        as its own instead of a savepoint in the batch's: 8 round trips instead of 12 (no
        SAVEPOINT, no RELEASE, the idle limit set by the key's look-up, which is one
        statement, not two), each a wake-up of the backend and of this thread on the idle
        job's critical path (bench/README.md, "The idle job, per hop"). The set-based path
        (:meth:`_intake_fast`) is no shorter for one intent: its pipeline took 22-26 ms per
        intent against this path's 8-11 ms at load 12-14 (idle12).

        Returns the :class:`IntakeResult` or the exception, as :meth:`intake_batch` does per
        intent: :class:`RetryableError` (``db_unavailable``) when Postgres is unreachable or
        the session was ended (``idle_limit_s``); when Postgres refuses the intent or its
        commit (not its data: ``invalid_data`` is returned as such), it is accepted once more
        alone (:meth:`_intake_alone`), as a batch whose commit failed."""
        @contextmanager
        def begin(conn: Conn) -> Iterator[None]:
            with conn.transaction():
                yield
                faults.point("intake_batch_before_commit")

        span = it.span or tracing.start()
        try:
            with tracing.use(span), self.connection() as conn:
                return self._intake_in(
                    conn, it.tenant_id, it.idempotency_key, it.request_hash, it.request_id,
                    {**it.job, "trace_id": span.trace_id}, it.content, it.accepted, it.topic,
                    list(it.extra), it.restart, begin=begin,
                    # A frozen worker loses the session (and the rows' locks): set by the
                    # transaction's first statement, no round trip of its own.
                    idle_limit_s=idle_limit_s)
        except (psycopg.OperationalError,
                psycopg.errors.IdleInTransactionSessionTimeout) as exc:
            return RetryableError(f"database unavailable: {exc}", code="db_unavailable")
        except psycopg.Error:  # refused (e.g. a deferred constraint at the commit): alone
            return self._intake_alone(it)
        except Exception as exc:  # noqa: BLE001 - PoisonMessage, IdempotencyConflict...: its own
            return exc

    _JOB_COLUMNS = ("job_id", "tenant_id", "idempotency_key", "request_hash", "dedup_key",
                    "request_id", "document_sha256", "filename", "content_type", "pipeline",
                    "prompt_version", "model_profile", "lane", "trace_id")

    def _intake_fast(self, conn: Conn, intents: Sequence[IntakeIntent], order: list[int],
                     out: list[IntakeResult | Exception | None]) -> list[int]:
        """The batch's plainly new intents (a key never seen, the first of its key and of its
        dedup key in the batch) with one statement per table instead of one per row, in a
        savepoint. Fills ``out`` for the jobs it created and returns the indices left for
        the one-intent path (replays, conflicts, reuses, restarts), in ``order``. A race lost
        to a concurrent intake or a row Postgres refuses undoes the savepoint: then every
        intent takes the one-intent path, which tells them apart."""
        if len(order) < 2:
            return order
        with conn.pipeline():  # fewer round trips: 3 instead of 8
            return self._intake_fast_in(conn, intents, order, out)

    def _intake_fast_in(self, conn: Conn, intents: Sequence[IntakeIntent], order: list[int],
                        out: list[IntakeResult | Exception | None]) -> list[int]:
        known = {(r["tenant_id"], r["idempotency_key"]) for r in conn.execute(
            Q["intake_batch_known_keys"], ([intents[i].tenant_id for i in order],
                                           [intents[i].idempotency_key for i in order]))}
        fresh: list[int] = []
        keys: set[tuple[str, str]] = set()
        dedups: set[tuple[str, str]] = set()
        for i in order:
            it = intents[i]
            key, dk = (it.tenant_id, it.idempotency_key), (it.tenant_id, it.job["dedup_key"])
            if key not in known and key not in keys and dk not in dedups and not it.extra:
                fresh.append(i)
            keys.add(key)
            dedups.add(dk)
        if not fresh:
            return order
        spans = {i: intents[i].span or tracing.start() for i in fresh}
        jobs = {i: {**intents[i].job, "trace_id": spans[i].trace_id} for i in fresh}
        try:
            with conn.transaction():
                docs: dict[tuple[str, str], IntakeIntent] = {}
                for i in fresh:
                    docs.setdefault((intents[i].tenant_id, jobs[i]["document_sha256"]),
                                    intents[i])
                conn.execute(Q["intake_batch_insert_documents"], (
                    [t for t, _ in docs], [h for _, h in docs],
                    [d.job["content_type"] for d in docs.values()],
                    [len(d.content) for d in docs.values()],
                    [d.content for d in docs.values()]))
                created = {r["job_id"] for r in conn.execute(
                    Q["intake_batch_insert_jobs"],
                    {c: [jobs[i][c] for i in fresh] for c in self._JOB_COLUMNS})}
                made = [i for i in fresh if jobs[i]["job_id"] in created]
                if made:
                    self._intake_fast_rows(conn, intents, made, jobs, spans)
        except psycopg.OperationalError:
            raise
        except (psycopg.Error, UnicodeEncodeError):
            return order
        for i in made:
            out[i] = IntakeResult(jobs[i]["job_id"], True, "new")
        done = set(made)
        return [i for i in order if i not in done]

    @staticmethod
    def _intake_fast_rows(conn: Conn, intents: Sequence[IntakeIntent], made: list[int],
                          jobs: dict[int, dict[str, Any]],
                          spans: dict[int, tracing.SpanContext]) -> None:
        """The idempotency records, ``intake`` checkpoints and ``job.accepted`` outbox rows of
        the jobs :meth:`_intake_fast` created (one statement each, as :meth:`_intake_in`
        writes them one by one)."""
        msgs: list[OutboxMessage] = []
        emitted: list[str] = []
        for i in made:
            event = intents[i].accepted(jobs[i]["job_id"])
            msg = outbox_message(intents[i].topic, event)
            if tracing.HEADER not in msg.headers:
                with tracing.use(spans[i]):
                    msg.headers[tracing.HEADER] = tracing.outgoing_header()
            msgs.append(msg)
            emitted.append(dumps_json(event.payload.model_dump(mode="json")).decode())
        ids = [jobs[i]["job_id"] for i in made]
        conn.execute(Q["intake_batch_insert_requests"], (
            [intents[i].tenant_id for i in made], [intents[i].idempotency_key for i in made],
            [intents[i].request_hash for i in made], ids,
            [intents[i].request_id for i in made]))
        conn.execute(Q["intake_batch_insert_done_stages"], (
            STAGES[0], PIPELINE.stages[0].code_version, ids,
            [jobs[i]["document_sha256"] for i in made],
            [dumps_json({"filename": jobs[i]["filename"]}).decode() for i in made], emitted))
        # The event's id and type from the headers outbox_message set from the same event
        # (not a second JSON parse of every value).
        conn.execute(Q["intake_batch_outbox_insert"], (
            [m.topic for m in msgs], [m.key for m in msgs], [m.value for m in msgs],
            [dumps_json(m.headers).decode() for m in msgs], [m.headers["event_id"] for m in msgs],
            [m.headers["event_type"] for m in msgs]))
        outbox_written(conn)

    def _intake_alone(self, it: IntakeIntent) -> IntakeResult | Exception:
        """:meth:`intake` of one intent of a batch whose commit failed; its exception returned."""
        try:
            with tracing.use(it.span):
                return self.intake(tenant_id=it.tenant_id, idempotency_key=it.idempotency_key,
                                   request_hash=it.request_hash, request_id=it.request_id,
                                   job=it.job, content=it.content, accepted=it.accepted,
                                   topic=it.topic, extra=it.extra, restart=it.restart)
        except Exception as exc:
            return exc

    # ------------------------------------------------------------------ stages

    def claim(self, *, job_id: uuid.UUID, stage: str, group: str, dedup_key: str,
              event_type: str, event_id: uuid.UUID, lease_s: float, code_version: str,
              generation: int = 0, reads: tuple[str, ...] = ()
              ) -> Claim | Skip | Done | LeaseHeld:
        """Claim ``stage`` of a job for one run (short transaction, no lock kept).

        Returns :class:`Skip` for a duplicate delivery (the idempotent-consumer row exists) or a
        terminal/cancelled/parked job (recording the event as processed); :class:`Done` when the
        stage already succeeded under ``code_version`` (a redrive: re-emit, don't redo);
        :class:`LeaseHeld` when another run's lease is live; else a :class:`Claim` with a fresh
        fencing token (also when the checkpoint was made by another code version). An event of
        an older ``generation`` than the job's (in flight before a redrive) is skipped as
        ``superseded`` without being recorded, so the new generation's event is not taken for
        its duplicate. The generation is checked BEFORE the idempotent-consumer row: an old
        generation's event is ``superseded``, whatever a stale run may have recorded. An event
        of a NEWER generation than the job's is :class:`Skip` ``generation_ahead``, not
        recorded and nothing claimed (the caller refuses it as poison): a redrive bumps the
        generation in the transaction that writes its event, so only a forged event is ahead.

        ``reads``: what the stage reads, fetched in the same transaction into
        ``Claim.inputs`` (:class:`StageInputs`): ``document``, ``output:<stage>`` (a succeeded
        checkpoint's output), ``chunks``, ``budget`` (provider attempts per chunk and the
        job's provider cost).

        A claim that takes the stage over closes the orphan attempts of the runs it replaces
        (``abandoned``, see :meth:`close_orphans`).

        The claim's transaction holds the job's row lock until it commits, so it is bounded as
        :meth:`claim_and_complete`'s (robust11; breaker10 left the two-transaction claims of a
        PDF's extract and a remote provider's llm stage without a limit): idle at most
        ``lease_s`` seconds (``idle_in_transaction_session_timeout``), and as long with its
        answer unread (``tcp_user_timeout``, Linux: the answer carries the document), both set
        by the claim's statement. A process frozen inside it (SIGSTOP, a VM pause) loses its
        session, the claim rolls back and the lock is released, so another worker takes the
        stage; psycopg then raises ``OperationalError`` in the frozen one, an outage for it.
        """
        with self.tx() as conn:
            got = self._claim_in(conn, job_id=job_id, stage=stage, group=group,
                                 dedup_key=dedup_key, event_type=event_type,
                                 event_id=event_id, lease_s=lease_s,
                                 code_version=code_version, generation=generation,
                                 reads=reads, idle_limit=True)
            faults.point("stage_inside_claim_transaction")
            return got

    def claim_and_complete(self, work: Callable[[Claim], dict[str, Any]], **claim_kw: Any
                           ) -> tuple[Claim | Skip | Done | LeaseHeld, Exception | None]:
        """Claim (as :meth:`claim`, ``claim_kw``), run ``work(claim)`` and complete (as
        :meth:`complete`, with the keyword arguments ``work`` returns) in ONE transaction,
        the job row locked throughout: for short, pure stages (no call leaves the process).

        When ``work`` raises, the claim alone commits and ``(claim, exception)`` is returned:
        the caller ends the run as after a two-transaction claim (fail, release, cancel), so
        failure paths do not change. A crash during ``work`` rolls the claim back: the
        redelivered event claims again. Returns ``(claim result, None)`` otherwise (the run
        completed when the result is a :class:`Claim`). When Postgres refuses the completion
        (``invalid_data``, a constraint...), the claim rolls back with it and is made again
        alone: ``(claim, exception)``. Raises :class:`StaleRun` like
        :meth:`complete` (not expected: the lock is held).

        The transaction may stay idle at most ``lease_s`` seconds
        (``idle_in_transaction_session_timeout``, set locally): a process paused longer loses
        its session, the claim rolls back and the row lock is released, so a frozen worker
        never holds a job (psycopg then raises ``OperationalError``, handled as a crash). The
        same limit bounds a pause before the claim's answer was read (the document: more than
        the socket buffers hold, the session is ``active``/``ClientWrite``, no idle limit):
        ``tcp_user_timeout`` (Linux), set by the claim's statement too (breaker10).
        """
        try:
            with self.tx() as conn:
                # Paused past its lease, the process loses the session (and the row lock):
                # the claim's statement sets the idle limit (claim_job_and_stage).
                return self.claim_and_complete_in(conn, work, **claim_kw)
        except (PoisonMessage, psycopg.Error) as exc:
            # Postgres refused the completion (its data: invalid_data; or anything else it
            # raises that is not an outage, e.g. a constraint): the claim rolled back with it.
            # Claim again, alone, so the run ends like a two-transaction one (job failed)
            # instead of leaving the job open with no run to end it.
            return self.claim(**claim_kw), exc

    def claim_and_complete_in(self, conn: Conn, work: Callable[[Claim], dict[str, Any]],
                              **claim_kw: Any) -> tuple[Claim | Skip | Done | LeaseHeld,
                                                        Exception | None]:
        """:meth:`claim_and_complete`'s claim, work and completion inside the caller's
        transaction ``conn`` (the caller sets the idle limit and commits)."""
        got = self._claim_in(conn, idle_limit=True, **claim_kw)
        if not isinstance(got, Claim):
            return got, None
        try:
            done = work(got)
        except Exception as exc:  # noqa: BLE001 - handed back, the claim commits
            return got, exc
        faults.point("stage_inside_one_transaction")
        self._complete_in(conn, got, locked=True, **done)
        return got, None

    def claim_and_complete_many(self, steps: Sequence[Callable[[Conn], T]], lease_s: float
                                ) -> list[T | None]:
        """Several one-transaction stage runs (each ``step(conn)`` calls
        :meth:`claim_and_complete_in` for one event) in ONE transaction, each inside its own
        savepoint: a step that raises is rolled back alone and its slot is ``None`` (the
        caller runs that event again on its own, which reports its error as usual), the others
        commit together. Every run is fenced as in :meth:`claim_and_complete` (job row locked,
        run token, generation); the idle limit is ``lease_s`` seconds, as there (each step's
        claim sets it from its own ``lease_s``, this one).

        The steps run first WITHOUT savepoints (a savepoint per step is two round trips and
        a subtransaction in Postgres; issue 12, perf-worker4): when one of them raises, that
        whole transaction rolls back (nothing of it was committed) and the steps run again,
        each in its own savepoint as above. A step may therefore run twice; a step is a claim,
        pure work and a completion, so its second run starts from the same rows.

        Raises :class:`RetryableError` / :class:`PoisonMessage` like :meth:`tx` when the
        transaction itself fails (nothing of it committed, or - a lost COMMIT - all of it).
        """
        if len(steps) > 1:
            try:
                return self._steps_in_one_transaction(steps, savepoints=False)
            except _StepRaised:
                pass  # rolled back as a whole: once more, a savepoint per step
        return self._steps_in_one_transaction(steps, savepoints=True)

    def _steps_in_one_transaction(self, steps: Sequence[Callable[[Conn], T]], *,
                                  savepoints: bool) -> list[T | None]:
        """:meth:`claim_and_complete_many`'s transaction; without ``savepoints``, a step
        that raises rolls it all back (:class:`_StepRaised`)."""
        out: list[T | None] = []
        with self.tx() as conn:
            # No statement of its own for the idle limit: each step's claim sets it
            # (claim_job_and_stage) before its job row lock is held.
            for step in steps:
                try:
                    if not savepoints:
                        out.append(step(conn))
                        continue
                    with conn.transaction():  # a savepoint
                        out.append(step(conn))
                except (psycopg.OperationalError, psycopg.errors.InFailedSqlTransaction,
                        psycopg.errors.IdleInTransactionSessionTimeout):
                    raise  # the session is gone: the whole transaction fails (an outage)
                except Exception as exc:  # noqa: BLE001 - rolled back to the savepoint; run alone
                    if not savepoints:
                        raise _StepRaised from exc  # the whole transaction rolls back
                    out.append(None)
        return out

    def _claim_in(self, conn: Conn, *, job_id: uuid.UUID, stage: str, group: str,
                  dedup_key: str, event_type: str, event_id: uuid.UUID, lease_s: float,
                  code_version: str, generation: int = 0, reads: tuple[str, ...] = (),
                  idle_limit: bool = False) -> Claim | Skip | Done | LeaseHeld:
        """:meth:`claim` in the caller's transaction; ``idle_limit``: the transaction may stay
        idle (or leave its answer unread) at most ``lease_s`` (at least
        :data:`CLAIM_IDLE_FLOOR_S`) while it holds the job's row lock (set by the claim's
        statement, see :meth:`claim` and :meth:`claim_and_complete`)."""
        # The job lock, the duplicate check and the stage's claim in one round trip: the
        # claim is made only when the checks below would let it go on (claim_job_and_stage),
        # and then returns what the stage reads too (``reads``, migration 0036).
        for what in reads:
            if what not in _READS and not what.startswith("output:"):
                raise ValueError(f"unknown stage read {what!r}")
        row = conn.execute(Q["claim_job_and_stage"], {
            "job_id": job_id, "group": group, "dedup_key": dedup_key,
            "event_type": event_type, "stage": stage, "run_token": uuid.uuid4(),
            "lease_s": lease_s, "code_version": code_version, "generation": generation,
            "idle_ms": (str(int(max(float(lease_s), CLAIM_IDLE_FLOOR_S) * 1000))
                        if idle_limit else None),
            "reads": list(reads)}).fetchone()
        if row is None:
            return Skip("unknown_job")
        job = typed_row(JobRow, row)
        if generation < job.generation:
            return Skip("superseded")
        if generation > job.generation:  # forged (policy12): the SQL claimed nothing
            return Skip("generation_ahead")
        if row["processed"]:
            return Skip("duplicate")
        if job.status in (*TERMINAL, "needs_reconciliation") or job.cancel_requested:
            if job.cancel_requested:
                conn.execute(Q["cancel_job"], (job_id,))
            conn.execute(Q["record_processed"], (group, dedup_key, event_type, event_id,
                                                 job_id))
            return Skip("cancelled" if job.cancel_requested else "terminal")
        if row["claim_run_token"] is None:
            cur = conn.execute(Q["get_stage"], (job_id, stage)).fetchone()
            assert cur is not None
            if cur["status"] == "succeeded":
                return Done(job, cur["emitted"])
            if cur["status"] in ("failed", "needs_reconciliation"):
                return Skip("terminal")
            return LeaseHeld(cur["lease_until"])
        attempt = row["claim_attempt"]
        if attempt > 1:  # a takeover or a re-run: earlier runs may have left attempts
            conn.execute(Q["close_orphan_attempts"], {"job_id": job_id, "stage": stage})
        return Claim(job, stage, row["claim_run_token"], attempt, row["claim_lease_until"],
                     self._claimed_inputs(row, reads))

    def provider_budget(self, job_id: uuid.UUID, stage: str) -> ProviderBudget:
        """What the job's provider budget has used so far (:class:`ProviderBudget`)."""
        with self.tx() as conn:
            return self._budget_in(conn, job_id, stage)

    @staticmethod
    def _budget_in(conn: Conn, job_id: uuid.UUID, stage: str) -> ProviderBudget:
        row = conn.execute(Q["job_provider_budget"], {"job_id": job_id, "stage": stage}
                           ).fetchone()
        assert row is not None
        return ProviderBudget(
            chunk_attempts={int(k): int(v) for k, v in (row["attempts"] or {}).items()},
            stage_attempts=int(row["stage_attempts"]), stage_cost_usd=float(row["stage_cost_usd"]),
            job_cost_usd=float(row["cost_usd"]))

    @staticmethod
    def _claimed_inputs(row: dict[str, Any], reads: tuple[str, ...]) -> StageInputs:
        """The :class:`StageInputs` named by ``reads`` (see :meth:`claim`), from the claim
        statement's ``r_*`` columns (``stage_claim_reads``, migration 0036: read after the job
        row was locked, with a fresh snapshot, as the separate statements did before)."""
        if not reads:
            return StageInputs()
        kw: dict[str, Any] = {}
        for what in reads:
            if what == "document":
                doc = row["r_document"]
                kw["document"] = None if doc is None else bytes(doc)
            elif what.startswith("output:"):
                kw["previous_output"] = row["r_previous_output"]
            elif what == "chunks":
                kw["chunks"] = tuple(ChunkRow(c["idx"], c["text"], c["text_sha256"],
                                              c["llm_output"]) for c in row["r_chunks"] or ())
            elif what == "budget":
                b = row["r_budget"]
                kw["budget"] = ProviderBudget(
                    chunk_attempts={int(k): int(v) for k, v in b["attempts"].items()},
                    stage_attempts=int(b["stage_attempts"]),
                    stage_cost_usd=float(b["stage_cost_usd"]),
                    job_cost_usd=float(b["cost_usd"]))
        return StageInputs(**kw)

    def reemit(self, *, job: JobRow, group: str, event_type: str,
               event_id: uuid.UUID, next_msg: OutboxMessage, final: bool) -> bool:
        """Re-emit a finished stage's event and record the input event as processed, in ONE
        transaction; ``final`` (the ``publish`` stage) also closes the job as succeeded.
        Returns False (writing nothing) if another delivery got there first."""
        with self.tx() as conn:
            if conn.execute(Q["record_processed"], (group, job.dedup_key, event_type,
                                                    event_id, job.job_id)).fetchone() is None:
                return False
            if final:
                conn.execute(Q["succeed_job"], (job.charge_usd, job.job_id))
            self.add_outbox(conn, next_msg)
            return True

    def renew_lease(self, claim: Claim, lease_s: float) -> None:
        """Extend the lease of a running claim by ``lease_s`` seconds from now. Raises
        :class:`StaleRun` if the run was fenced (taken over, or the job re-driven)."""
        with self.tx() as conn:
            row = conn.execute(Q["renew_lease"], {
                "lease_s": lease_s, "job_id": claim.job.job_id, "stage": claim.stage,
                "run_token": claim.run_token, "generation": claim.generation}).fetchone()
        if row is None:
            raise StaleRun(f"stage {claim.stage} of job {claim.job.job_id} has a newer run")

    @staticmethod
    def _fence(conn: Conn, claim: Claim) -> None:
        """Lock the job row and check the run's generation (the run token is checked by the
        fenced UPDATE that follows). Raises :class:`StaleRun` when a redrive started a newer
        generation: the caller's transaction then writes nothing."""
        row = conn.execute(Q["job_generation_for_update"], (claim.job.job_id,)).fetchone()
        if row is None or row["generation"] != claim.generation:
            raise StaleRun(f"stage {claim.stage} of job {claim.job.job_id}: run "
                           f"{claim.run_token} of generation {claim.generation} was fenced off "
                           "by a redrive; result discarded")

    def complete(self, claim: Claim, *, output: Any, input_hash: str, code_version: str,
                 cost_usd: float, group: str, event_type: str, event_id: uuid.UUID,
                 next_msg: OutboxMessage,
                 chunks: list[tuple[int, int, int, str, str]] | None = None,
                 charge_usd: float | None = None, later_stages: tuple[str, ...] = (),
                 local_answers: tuple[LocalAnswer, ...] = ()) -> None:
        """Finish a stage run in ONE transaction: fenced checkpoint, stage side rows (chunks),
        job progress, the next event's outbox row and the idempotent-consumer row.

        A stage that really ran invalidates ``later_stages`` (reset to pending): their inputs
        may have changed. ``local_answers``: chunks answered in-process (no remote provider),
        recorded here as ``succeeded`` attempts with the chunks' outputs (fenced like the
        checkpoint). Raises :class:`StaleRun` (and writes nothing) when the run token no
        longer owns the stage.
        """
        with self.tx() as conn:
            self._complete_in(conn, claim, output=output, input_hash=input_hash,
                              code_version=code_version, cost_usd=cost_usd, group=group,
                              event_type=event_type, event_id=event_id, next_msg=next_msg,
                              chunks=chunks, charge_usd=charge_usd, later_stages=later_stages,
                              local_answers=local_answers)

    def _complete_in(self, conn: Conn, claim: Claim, *, output: Any,
                     input_hash: str, code_version: str, cost_usd: float, group: str,
                     event_type: str, event_id: uuid.UUID, next_msg: OutboxMessage,
                     chunks: list[tuple[int, int, int, str, str]] | None = None,
                     charge_usd: float | None = None, later_stages: tuple[str, ...] = (),
                     local_answers: tuple[LocalAnswer, ...] = (), locked: bool = False
                     ) -> None:
        """:meth:`complete` in the caller's transaction; ``locked``: the caller claimed in
        this transaction (the job row is locked and its generation read under the lock)."""
        job_id = claim.job.job_id
        if not locked:
            self._fence(conn, claim)
        # The fenced checkpoint, the job's advance (or success, with a charge), the next
        # event's outbox row and the idempotent-consumer row in one statement; a first run's
        # chunks too (a re-run replaces the old ones below), and the in-process model's
        # answers (each an attempt and its chunk's output, fenced like the checkpoint).
        ev = _loads_event(next_msg.value)
        first_chunks = bool(chunks) and claim.attempt == 1
        cols: list[list[Any] | None] = ([list(col) for col in zip(*chunks, strict=True)]
                                        if chunks and first_chunks else [None] * 5)
        row = conn.execute(_completion(first_chunks, bool(local_answers)), {
            "chunk_idx": cols[0], "chunk_start": cols[1], "chunk_end": cols[2],
            "chunk_text": cols[3], "chunk_sha256": cols[4],
            "local_answers": Jsonb([{
                "idx": a.idx, "attempt": a.attempt, "model": a.model,
                "latency_ms": a.latency_ms, "prompt_tokens": a.prompt_tokens,
                "completion_tokens": a.completion_tokens, "cost_usd": a.cost_usd,
                "output": a.output} for a in local_answers]) if local_answers else None,
            "model_profile": claim.job.model_profile,
            "output": Jsonb(output), "input_hash": input_hash, "code_version": code_version,
            "cost_usd": cost_usd, "job_id": job_id, "stage": claim.stage,
            "run_token": claim.run_token, "emitted": Jsonb(ev["payload"]),
            "charge_usd": charge_usd, "topic": next_msg.topic, "kafka_key": next_msg.key,
            "payload": next_msg.value, "headers": Jsonb(self._outbox_headers(conn, next_msg, ev)),
            "next_event_id": ev["event_id"], "next_event_type": ev["event_type"],
            "group": group, "dedup_key": claim.job.dedup_key, "event_type": event_type,
            "event_id": event_id}).fetchone()
        outbox_written(conn)
        if row is None or row["completed"] != 1:
            raise StaleRun(f"stage {claim.stage} of job {job_id}: run {claim.run_token} "
                           "was fenced off; result discarded")
        if local_answers and row["answered"] != len(local_answers):
            raise StaleRun(f"stage {claim.stage} of job {job_id}: run {claim.run_token}: a "
                           "chunk was answered meanwhile; result discarded")
        if later_stages and claim.attempt > 1:  # a first run has no later checkpoints yet
            conn.execute(Q["reset_later_stages"], (job_id, list(later_stages)))
        if chunks is not None and not first_chunks:
            if claim.attempt > 1:  # a re-run replaces the chunks of an earlier one
                conn.execute(Q["delete_chunks"], (job_id,))
            if chunks:
                conn.execute(Q["insert_chunks"], (job_id, *(list(col) for col in zip(
                    *chunks, strict=True))))

    def fail(self, claim: Claim, *, error_code: str, error: str, group: str, event_type: str,
             event_id: uuid.UUID, failed_msg: OutboxMessage) -> None:
        """Fail the stage and the job in ONE transaction (fenced) with a ``job.failed`` outbox
        row. Raises :class:`StaleRun` when the run was fenced off."""
        job_id = claim.job.job_id
        with self.tx() as conn:
            self._fence(conn, claim)
            cur = conn.execute(Q["fail_stage"], {"error_code": error_code, "error": error[:4000],
                                                 "job_id": job_id, "stage": claim.stage,
                                                 "run_token": claim.run_token})
            if cur.rowcount != 1:
                raise StaleRun(f"stage {claim.stage} of job {job_id} has a newer run")
            conn.execute(Q["fail_job"], (error_code, error[:4000], job_id))
            self.add_outbox(conn, failed_msg)
            conn.execute(Q["record_processed"], (group, claim.job.dedup_key, event_type,
                                                 event_id, job_id))

    def release(self, claim: Claim, *, error_code: str, error: str,
                retry_wait_s: float = 0.0) -> None:
        """Give a stage back after a transient failure (fenced; no-op if fenced off).
        ``retry_wait_s``: seconds within which its retry is due (the sweeper counts a stall
        only from then, :meth:`stalled_jobs`)."""
        with self.tx() as conn:
            try:
                self._fence(conn, claim)
            except StaleRun:
                return
            conn.execute(Q["release_stage"], {"error_code": error_code, "error": error[:4000],
                                              "retry_wait_s": retry_wait_s,
                                              "job_id": claim.job.job_id,
                                              "stage": claim.stage,
                                              "run_token": claim.run_token})

    def add_retry_round(self, *, job_id: uuid.UUID, stage: str, generation: int) -> int | None:
        """Count one more retry round of ``stage``'s event for the job's ``generation`` (its own
        transaction, migration 0044) and return the rounds spent so far, this one included;
        None when the job does not exist. The stage agent decides an exhausted retry budget by
        this count, not by the message's ``retry_count`` header, which anyone who can write to
        a ``.retry`` topic can forge (breaker11). Raises :class:`RetryableError` if Postgres
        is down. None too for a ``generation`` above the job's (a forged event; not counted)."""
        with self.tx() as conn:
            row = conn.execute(Q["add_retry_round"], {"job_id": job_id, "stage": stage,
                                                      "generation": generation}).fetchone()
            return None if row is None else int(row["rounds"])

    def give_up(self, *, job_id: uuid.UUID, stage: str, error_code: str, error: str,
                group: str, event_type: str, event_id: uuid.UUID, dedup_key: str,
                failed_msg: OutboxMessage, generation: int) -> bool:
        """Fail an open job whose stage event exhausted its retry budget (ONE transaction,
        with ``job.failed``). Fenced by ``generation`` (the event's): an event from before a
        redrive fails nothing, like any other write of a superseded generation. Returns False
        when the job was already terminal or the event is of another generation."""
        with self.tx() as conn:
            job = conn.execute(Q["get_job_for_update"], (job_id,)).fetchone()
            if job is None or job["status"] in TERMINAL or job["generation"] != generation:
                return False
            conn.execute(Q["fail_open_job"], (error_code, error[:4000], job_id, stage))
            conn.execute(Q["fail_job"], (error_code, error[:4000], job_id))
            self.add_outbox(conn, failed_msg)
            conn.execute(Q["record_processed"], (group, dedup_key, event_type, event_id,
                                                 job_id))
            return True

    def chunk_attempts(self, job_id: uuid.UUID, stage: str, chunk_idx: int) -> int:
        """How many provider attempts a chunk had, over all runs and retry rounds."""
        with self.tx() as conn:
            row = conn.execute(Q["count_provider_attempts"], (job_id, stage, chunk_idx)
                               ).fetchone()
        assert row is not None
        return int(row["n"])

    def job_provider_cost(self, job_id: uuid.UUID) -> float:
        """Provider cost of every attempt of a job (USD)."""
        with self.tx() as conn:
            row = conn.execute(Q["job_provider_cost"], (job_id,)).fetchone()
        assert row is not None
        return float(row["cost_usd"])

    def cancel_requested(self, job_id: uuid.UUID) -> bool:
        """True when the job's cancel flag is set (cheap; polled during provider calls)."""
        with self.tx() as conn:
            row = conn.execute(Q["cancel_requested"], (job_id,)).fetchone()
        return bool(row and row["cancel_requested"])

    def cancel_run(self, claim: Claim, *, group: str, event_type: str,
                   event_id: uuid.UUID) -> None:
        """End a run stopped by the user's cancel (ONE fenced transaction): stage failed
        ``cancelled_by_user``, job ``cancelled``, event recorded as processed.
        Raises :class:`StaleRun` when the run was fenced off."""
        job_id = claim.job.job_id
        with self.tx() as conn:
            self._fence(conn, claim)
            cur = conn.execute(Q["cancel_stage"], (job_id, claim.stage, claim.run_token,
                                                   claim.generation))
            if cur.rowcount != 1:
                raise StaleRun(f"stage {claim.stage} of job {job_id} has a newer run")
            conn.execute(Q["cancel_job"], (job_id,))
            conn.execute(Q["record_processed"], (group, claim.job.dedup_key, event_type,
                                                 event_id, job_id))

    def park(self, claim: Claim, *, error_code: str, error: str, group: str, event_type: str,
             event_id: uuid.UUID) -> None:
        """Park the stage and the job in ``needs_reconciliation`` (ONE fenced transaction): a
        provider call's outcome is unknown and the lane's policy is not to guess.
        Raises :class:`StaleRun` when the run was fenced off."""
        job_id = claim.job.job_id
        with self.tx() as conn:
            self._fence(conn, claim)
            cur = conn.execute(Q["park_stage"], {"error_code": error_code, "error": error[:4000],
                                                 "job_id": job_id, "stage": claim.stage,
                                                 "run_token": claim.run_token})
            if cur.rowcount != 1:
                raise StaleRun(f"stage {claim.stage} of job {job_id} has a newer run")
            conn.execute(Q["park_job"], (error_code, error[:4000], job_id))
            conn.execute(Q["record_processed"], (group, claim.job.dedup_key, event_type,
                                                 event_id, job_id))

    def redrive(self, job_id: uuid.UUID, *, plan: Any, allowed: tuple[str, ...],
                fence: tuple[str, uuid.UUID, float] | None = None,
                conn: Conn | None = None) -> str:
        """Re-drive a job (ONE transaction): forget the stage workers' idempotent-consumer rows
        for the job, reopen failed or parked stages, reopen the job, and write the first
        stage's input event to the outbox.

        ``plan(job, stage_rows) -> (OutboxMessage, stages, groups, event_types)`` decides where
        to restart: the event to write (of generation ``job["generation"] + 1``: the job's new
        generation), the stages to reopen and the (group, event type) rows to forget.
        Succeeded stages keep their checkpoints: they are re-emitted, not redone, unless
        their code version changed. Running stages among them are reset too: the runs they
        replace are fenced in this transaction (their run tokens and generation stop being
        valid), and their orphan attempts are closed ``abandoned``.

        ``fence=(stage, run_token, grace_s)`` (the sweeper): re-check, in this transaction,
        that ``run_token`` still owns ``stage`` under a lease expired over ``grace_s`` seconds
        (times the job's sweep backoff) ago; the re-drive counts one sweep of the job. Returns
        the job's previous status. Raises ``KeyError`` (no such job), ``ValueError`` (status not
        in ``allowed``) or :class:`StaleRun` (``fence`` no longer holds: nothing written).
        ``conn``: in the caller's transaction instead (intake's new run of a failed or
        cancelled job). A cancelled job's cancel request is cleared: its new run is not
        cancelled.
        """
        with self.tx() if conn is None else contextlib.nullcontext(conn) as conn:
            if fence is not None:  # the sweeper: never stall behind a frozen transaction
                conn.execute(Q["sweeper_lock_timeout"])
            job = conn.execute(Q["get_job_for_update"], (job_id,)).fetchone()
            if job is None:
                raise KeyError(f"no job {job_id}")
            if job["status"] not in allowed:
                raise ValueError(f"job {job_id} is {job['status']}; redrive needs one of "
                                 f"{list(allowed)}")
            if fence is not None:
                self._fence_expired(conn, job_id, *fence)
                conn.execute(Q["count_sweep"], (job_id,))
            rows = {r["stage"]: typed_row(StageCheckpoint, r)
                    for r in conn.execute(Q["list_stages"], (job_id,))}
            msg, stages, groups, event_types = plan(typed_row(JobRow, job), rows)
            conn.execute(Q["forget_processed"], (job["dedup_key"], groups, event_types))
            conn.execute(Q["reopen_stages"], (job_id, list(stages)))
            conn.execute(Q["reopen_job"], (job["generation"] + 1, job_id))
            for st in stages:
                conn.execute(Q["close_orphan_attempts"], {"job_id": job_id, "stage": st})
            if job["status"] == "cancelled":
                conn.execute(Q["clear_cancel"], (job_id,))
            self.add_outbox(conn, msg)
            return str(job["status"])

    @staticmethod
    def _fence_expired(conn: Conn, job_id: uuid.UUID, stage: str,
                       run_token: uuid.UUID, grace_s: float) -> int:
        """Fence the expired run ``run_token`` of ``stage`` (stage back to pending) if it still
        owns it with a lease expired past the grace; returns its attempt number. Raises
        :class:`StaleRun` when the run renewed, was taken over or was already re-driven."""
        row = conn.execute(Q["fence_expired_run"], {
            "job_id": job_id, "stage": stage, "run_token": run_token,
            "grace_s": grace_s}).fetchone()
        if row is None:
            raise StaleRun(f"stage {stage} of job {job_id}: run {run_token} renewed its lease, "
                           "was taken over or was already re-driven")
        return int(row["attempt"])

    def fail_expired(self, job_id: uuid.UUID, *, stage: str, run_token: uuid.UUID,
                     grace_s: float, error_code: str, error: str,
                     failed_msg: OutboxMessage) -> None:
        """The sweeper's end of a stage out of runs (ONE transaction): re-check that the
        expired run still owns the stage (as :meth:`redrive` with ``fence``), then fail the
        stage and the job with ``job.failed``, closing the run's orphan attempts. Raises
        :class:`StaleRun` (nothing written) when the re-check fails."""
        with self.tx() as conn:
            conn.execute(Q["sweeper_lock_timeout"])
            job = conn.execute(Q["get_job_for_update"], (job_id,)).fetchone()
            if job is None or job["status"] in TERMINAL:
                raise StaleRun(f"job {job_id} is gone or finished")
            self._fence_expired(conn, job_id, stage, run_token, grace_s)
            conn.execute(Q["fail_open_job"], (error_code, error[:4000], job_id, stage))
            conn.execute(Q["fail_job"], (error_code, error[:4000], job_id))
            conn.execute(Q["close_orphan_attempts"], {"job_id": job_id, "stage": stage})
            self.add_outbox(conn, failed_msg)

    def close_orphans(self) -> int:
        """Close every orphan provider attempt: ``started`` by a run that no longer owns its
        stage (fenced, taken over, re-driven, finished). Each becomes ``abandoned``, billed at
        its estimate (USD) for the budget. Returns how many were closed (the sweeper's pass)."""
        n = 0
        with self.tx() as conn:
            conn.execute(Q["sweeper_lock_timeout"])
            for r in conn.execute(Q["orphan_attempt_stages"]).fetchall():
                n += conn.execute(Q["close_orphan_attempts"], dict(r)).rowcount
        return n

    def fail_parked(self, job_id: uuid.UUID, *, error_code: str, error: str,
                    failed_msg: OutboxMessage) -> None:
        """Resolve a parked job as failed (ONE transaction, with the ``job.failed`` outbox row).
        Raises ``ValueError`` when the job is not ``needs_reconciliation``."""
        with self.tx() as conn:
            job = conn.execute(Q["get_job_for_update"], (job_id,)).fetchone()
            if job is None or job["status"] != "needs_reconciliation":
                raise ValueError(f"job {job_id} does not need reconciliation")
            conn.execute(Q["fail_parked_stage"], (error_code, error, job_id))
            conn.execute(Q["fail_job"], (error_code, error, job_id))
            self.add_outbox(conn, failed_msg)

    def parked_jobs(self) -> list[dict[str, Any]]:
        """Jobs in ``needs_reconciliation`` with their count of unknown-outcome attempts."""
        with self.tx() as conn:
            return list(conn.execute(Q["jobs_needing_reconciliation"]))

    def expired_leases(self, grace_s: float) -> list[ExpiredLease]:
        """Running stages whose lease expired over ``grace_s`` seconds ago."""
        with self.tx() as conn:
            return [typed_row(ExpiredLease, r)
                    for r in conn.execute(Q["expired_leases"], (grace_s,))]

    @staticmethod
    def _stalled_params(grace_s: float, job_id: uuid.UUID | None) -> dict[str, Any]:
        return {"stages": list(STAGES[:-1]), "nexts": list(STAGES[1:]), "grace_s": grace_s,
                "job_id": job_id}

    def stalled_jobs(self, grace_s: float) -> list[StalledJob]:
        """Open jobs whose last checkpoint succeeded over ``grace_s`` seconds ago (times the
        job's sweep backoff, ``2 ** sweeps``) while the next stage was never claimed and no
        outbox row of the job waits for the relay: the next stage's event was lost. At most
        100, oldest checkpoint first."""
        with self.tx() as conn:
            return [typed_row(StalledJob, r) for r in conn.execute(
                Q["stalled_jobs"], self._stalled_params(grace_s, None))]

    def reemit_stalled(self, job_id: uuid.UUID, *, stage: str, grace_s: float,
                       build: Callable[[JobRow, Any], OutboxMessage]) -> None:
        """Re-emit the lost input event of ``stage`` (ONE transaction, under the job's row
        lock, which every claim takes first): re-check that the job is still stalled before
        ``stage`` (:meth:`stalled_jobs`), count one sweep of the job (its backoff) and write
        ``build(job, emitted)`` to the outbox: the event of the job's CURRENT generation, so a
        late delivery of the lost one is a duplicate for the idempotent consumer. Raises
        :class:`StaleRun` (nothing written) when the re-check fails: the stage was claimed
        meanwhile, the job finished, or another pass re-emitted it."""
        with self.tx() as conn:
            conn.execute(Q["sweeper_lock_timeout"])
            job = conn.execute(Q["get_job_for_update"], (job_id,)).fetchone()
            if job is None:
                raise StaleRun(f"job {job_id} is gone")
            rows = [r for r in conn.execute(Q["stalled_jobs"],
                                            self._stalled_params(grace_s, job_id))
                    if r["stage"] == stage]
            if not rows:
                raise StaleRun(f"job {job_id} is no longer stalled before {stage}")
            conn.execute(Q["count_sweep"], (job_id,))
            self.add_outbox(conn, build(typed_row(JobRow, job), rows[0]["emitted"]))

    def stage_output(self, job_id: uuid.UUID, stage: str) -> Any:
        """The output of a succeeded stage checkpoint (``None`` if not succeeded)."""
        with self.tx() as conn:
            row = conn.execute(Q["get_stage"], (job_id, stage)).fetchone()
        return row["output"] if row and row["status"] == "succeeded" else None

    def document(self, tenant_id: str, sha256: str) -> tuple[bytes, str]:
        """``(content, content_type)`` of a stored document. Raises ``KeyError`` if absent."""
        with self.tx() as conn:
            row = conn.execute(Q["get_document"], (tenant_id, sha256)).fetchone()
        if row is None:
            raise KeyError(f"document {sha256} of tenant {tenant_id} not stored")
        return bytes(row["content"]), row["content_type"]

    def chunks(self, job_id: uuid.UUID) -> list[ChunkRow]:
        """The job's chunks in order (:class:`ChunkRow`)."""
        with self.tx() as conn:
            return [typed_row(ChunkRow, r) for r in conn.execute(Q["list_chunks"], (job_id,))]

    def job(self, job_id: uuid.UUID) -> JobRow | None:
        """The job row, or ``None``."""
        with self.tx() as conn:
            row = conn.execute(Q["get_job"], (job_id,)).fetchone()
        return None if row is None else typed_row(JobRow, row)

    # ------------------------------------------------------------------ provider log

    def start_attempt(self, claim: Claim, *, chunk_idx: int, attempt: int,
                      model: str, est_cost_usd: float = 0.0) -> int | None:
        """Record a provider attempt as ``started`` (committed before the request is sent),
        fenced by run token and generation. ``est_cost_usd``: what the attempt costs if the
        provider does the work (USD; billed if the attempt is ever ``abandoned``).
        Returns ``None`` (and records nothing) when the job's cancel was committed first.
        Raises :class:`StaleRun` when the run no longer owns the stage: no call is made."""
        with self.tx() as conn:
            row = conn.execute(Q["start_provider_attempt"], {
                "stage": claim.stage, "chunk_idx": chunk_idx, "attempt": attempt,
                "run_token": claim.run_token, "model_profile": claim.job.model_profile,
                "model": model, "est_cost_usd": est_cost_usd, "job_id": claim.job.job_id,
                "generation": claim.generation}).fetchone()
            if row:
                return int(row["attempt_id"])
            cancel = conn.execute(Q["cancel_requested"], (claim.job.job_id,)).fetchone()
        if cancel and cancel["cancel_requested"]:
            return None
        raise StaleRun(f"stage {claim.stage} of job {claim.job.job_id}: run "
                       f"{claim.run_token} was fenced off before its provider call")

    def finish_attempt(self, attempt_id: int, *, outcome: str, status_code: int | None = None,
                       latency_ms: float | None = None, prompt_tokens: int | None = None,
                       completion_tokens: int | None = None, cost_usd: float = 0.0,
                       error: str | None = None) -> None:
        """Record the outcome of a provider attempt (``succeeded``, ``transient_error``,
        ``permanent_error``, ``outcome_unknown``, ``cancelled``, ``discarded`` or
        ``abandoned``); a finished attempt keeps its outcome, an ``abandoned`` one takes the
        real one (cost in USD)."""
        with self.tx() as conn:
            conn.execute(Q["finish_provider_attempt"], {
                "outcome": outcome, "status_code": status_code, "latency_ms": latency_ms,
                "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "cost_usd": cost_usd, "error": error and error[:2000], "attempt_id": attempt_id})

    def close_attempt(self, attempt_id: int) -> None:
        """Close a ``started`` attempt as ``abandoned`` (its run stopped the call because it
        was fenced), billed at its estimate (USD)."""
        with self.tx() as conn:
            conn.execute(Q["abandon_attempt"], (attempt_id,))

    def stage_provider_cost(self, job_id: uuid.UUID, stage: str) -> tuple[float, int]:
        """``(cost_usd, attempts)`` of every provider attempt of a job's stage, all runs."""
        with self.tx() as conn:
            row = conn.execute(Q["stage_provider_cost"], (job_id, stage)).fetchone()
        assert row is not None
        return float(row["cost_usd"]), int(row["calls"])

    def succeed_chunk_attempt(self, claim: Claim, attempt_id: int, *, idx: int, output: Any,
                              status_code: int | None, latency_ms: float | None,
                              prompt_tokens: int | None, completion_tokens: int | None,
                              cost_usd: float) -> None:
        """Record a succeeded provider attempt AND keep the chunk's model output, in ONE
        transaction (the output fenced by the run token): a ``succeeded`` attempt always has its
        output stored, so a retry after a crash or a Postgres outage between the two never pays
        for the chunk a second time. When a newer run or generation owns the stage the answer
        is recorded as ``discarded`` (cost kept: it was paid for), the output is dropped and
        :class:`StaleRun` is raised. When the run still owns the stage but the chunk was
        answered meanwhile (a paused run's transaction committed late) the answer is
        ``discarded`` too and the run goes on with the saved output."""
        fence = {"job_id": claim.job.job_id, "stage": claim.stage,
                 "run_token": claim.run_token, "generation": claim.generation}
        with self.tx() as conn:
            cur = conn.execute(Q["save_chunk_output"], {
                "output": Jsonb(output), "attempt_id": attempt_id, "idx": idx, **fence})
            saved = cur.rowcount == 1
            owner = saved or conn.execute(Q["run_owns_stage"], fence).fetchone() is not None
            conn.execute(Q["finish_provider_attempt"], {
                "outcome": "succeeded" if saved else "discarded", "status_code": status_code,
                "latency_ms": latency_ms, "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens, "cost_usd": cost_usd,
                "error": None if saved else ("chunk answered meanwhile: discarded" if owner
                                             else "answer of a fenced run: discarded"),
                "attempt_id": attempt_id})
        if not owner:
            raise StaleRun(f"LLM stage of job {claim.job.job_id} has a newer run")

    # ------------------------------------------------------------------ metrics

    def metrics_snapshot(self, *, window_s: float, bounds: list[float],
                         timeout_s: float) -> dict[str, list[dict[str, Any]]]:
        """Everything the metrics collector reads from Postgres, in ONE read-only transaction
        (one snapshot) whose statements are each cut off after ``timeout_s`` seconds.

        Returns rows per key: ``jobs`` (lane, status, n), ``stage_runs`` (stage, runs,
        retries, lease_takeovers, expired_now), ``provider_attempts`` (outcome,
        model_profile, n, cost_usd), ``outbox`` (n, oldest_s), ``replication_slots`` (slot,
        active, wal_status, retained_bytes, unconfirmed_bytes), ``provider_limit`` (profile,
        limit_now, max_limit, interactive_reserved, decreases, in_flight), ``dead_letters``
        (source, reason_code, n: dead_letter rows not replayed), and
        ``stage_durations`` /
        ``queue_waits`` (stage, lane, idx, n, sum_s: counts per bucket ``idx`` of ``bounds``,
        seconds, over stages finished in the last ``window_s`` seconds), ``provider_latency``
        (model_profile, lane, idx, n, sum_s: the same over provider attempts). Raises
        :class:`RetryableError` when Postgres is unavailable or a statement timed out.
        """
        stages = list(STAGES[1:])
        with self.tx() as conn:
            conn.execute(Q["metrics_read_only"])
            conn.execute(Q["metrics_statement_timeout"], (str(int(timeout_s * 1000)),))
            window = {"window_s": window_s, "bounds": bounds}
            return {
                "jobs": list(conn.execute(Q["metrics_jobs"])),
                "stage_runs": list(conn.execute(Q["metrics_stage_runs"])),
                "provider_attempts": list(conn.execute(Q["metrics_provider_attempts"])),
                "outbox": list(conn.execute(Q["outbox_backlog"])),
                "replication_slots": list(conn.execute(Q["replication_slots"])),
                "provider_limit": list(conn.execute(Q["limit_state"])),
                "dead_letters": list(conn.execute(Q["metrics_dead_letters"])),
                "stage_durations": list(conn.execute(Q["metrics_stage_durations"], window)),
                "provider_latency": list(conn.execute(Q["metrics_provider_latency"], window)),
                "queue_waits": list(conn.execute(Q["metrics_queue_waits"], {
                    **window, "stages": stages, "prevs": list(STAGES[:-1])})),
            }

    # ------------------------------------------------------------------ retention

    def gc_batch(self, table: str, *, horizon_s: float, limit: int) -> int:
        """Delete up to ``limit`` expired rows of ``table`` (``outbox``, ``outbox_published``,
        ``processed_event`` or ``job_request``; see ``gc_<table>`` in queries.sql) older
        than ``horizon_s`` seconds, in ONE short transaction; returns how many were deleted.
        Raises ``KeyError`` for another table, :class:`RetryableError` when Postgres is
        unavailable."""
        query = Q[f"gc_{table}"]
        with self.tx() as conn:
            return conn.execute(query, {"horizon_s": horizon_s, "limit": limit}).rowcount
