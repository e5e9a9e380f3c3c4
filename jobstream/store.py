"""The job store: every database operation of the pipeline, in the project's vocabulary.

Each public method is one short transaction (or joins the caller's via ``conn=``). Driver errors
are translated here, and only here: ``psycopg.OperationalError`` (Postgres unreachable or
restarting) becomes :class:`RetryableError` ``db_unavailable``; ``psycopg.DataError`` (bytes or
strings the database cannot store, e.g. NUL) becomes :class:`PoisonMessage` ``invalid_data``.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb
from psycopg_pool import ConnectionPool
from pydantic import BaseModel

from jobstream import tracing
from jobstream.db import QUERIES as Q
from jobstream.errors import IdempotencyConflict, PoisonMessage, RetryableError, StaleRun
from schemas.events import encode_event

#: The checkpoint chain (design.md): each stage is named by the fact it establishes.
STAGES = ("uploaded", "text_extracted", "chunks_ready", "llm_done", "validated", "published")
TERMINAL = ("succeeded", "failed", "cancelled")


@dataclass(frozen=True)
class IntakeResult:
    """``job_id`` of the intent; ``created`` is False when the job already existed."""

    job_id: uuid.UUID
    created: bool


@dataclass(frozen=True)
class Claim:
    """A claimed stage run: the fencing token (``run_token``), attempt number and lease end."""

    job: dict[str, Any]
    stage: str
    run_token: uuid.UUID
    attempt: int
    lease_until: datetime


@dataclass(frozen=True)
class Skip:
    """The event needs no work: ``reason`` is ``duplicate``, ``done``, ``terminal`` or
    ``cancelled``."""

    reason: str


@dataclass(frozen=True)
class Done:
    """The stage already succeeded under the current code version but this event was not
    processed yet (a redrive): re-emit ``emitted`` (the payload of the stage's event)."""

    job: dict[str, Any]
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


class Store:
    """All DB operations, over a small connection pool (``max_size`` connections)."""

    def __init__(self, url: str, *, max_size: int = 8) -> None:
        self.url = url
        self.pool = ConnectionPool(url, min_size=1, max_size=max_size, open=True,
                                   kwargs={"row_factory": dict_row, "connect_timeout": 10},
                                   check=ConnectionPool.check_connection)

    def close(self) -> None:
        """Close every pooled connection."""
        self.pool.close()

    @contextmanager
    def tx(self) -> Iterator[psycopg.Connection]:
        """One transaction on a pooled connection; Postgres outages become RetryableError."""
        try:
            with self.pool.connection(timeout=30) as conn, conn.transaction():
                yield conn
        except psycopg.OperationalError as exc:
            raise RetryableError(f"database unavailable: {exc}", code="db_unavailable") from None
        except psycopg.errors.SerializationFailure as exc:
            raise RetryableError(f"serialization failure: {exc}", code="db_conflict") from None
        except (psycopg.DataError, UnicodeEncodeError) as exc:  # NUL, out of range, surrogate
            raise PoisonMessage(f"data the database cannot store: {exc}",
                                code="invalid_data") from None

    # ------------------------------------------------------------------ outbox

    @staticmethod
    def add_outbox(conn: psycopg.Connection, msg: OutboxMessage) -> None:
        """Write one outbox row inside the caller's transaction (the transactional outbox).

        The row's headers get a W3C ``traceparent`` unless they have one: a child of the
        current span (:func:`jobstream.tracing.current`), or with no span in force (sweeper,
        redrive) one in the job's stored trace, so every event of a job shares its trace-id.
        """
        ev = json.loads(msg.value)
        headers = dict(msg.headers)
        if tracing.HEADER not in headers:
            trace_id = None
            if tracing.current() is None and ev.get("job_id"):
                trace_id = Store._job_trace_id(conn, ev["job_id"])
            headers[tracing.HEADER] = tracing.outgoing_header(trace_id)
        conn.execute(Q["outbox_insert"], (msg.topic, msg.key, msg.value, Jsonb(headers),
                                          ev["event_id"], ev["event_type"]))

    @staticmethod
    def _job_trace_id(conn: psycopg.Connection, job_id: str) -> str:
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
               accepted: Any, topic: str, conn: psycopg.Connection | None = None,
               extra: list[OutboxMessage] = ()) -> IntakeResult:  # type: ignore[assignment]
        """Create a job for one client intent, in ONE transaction: document, job, idempotency
        record, ``uploaded`` checkpoint and the ``job.accepted`` outbox row (plus ``extra``
        outbox rows, e.g. a ``document.uploaded`` for other consumers).

        ``job``: the job row's columns (``job_id``, ``dedup_key``, …). ``accepted``: a callable
        ``job_id -> event`` building the outbox event. ``conn``: join the caller's transaction
        (a savepoint is used). The same (tenant, idempotency_key) again returns the same job
        with no new work; a second key for the same dedup_key is bound to the existing job.
        Raises :class:`IdempotencyConflict` when the key was used with a different body.

        Intake is where a job's trace starts: the job keeps the trace-id of the current span
        (the incoming event's or request's ``traceparent``), or of a new trace.
        """
        span = tracing.current() or tracing.start()
        job = {**job, "trace_id": span.trace_id}
        with tracing.use(span):
            if conn is not None:
                return self._intake_in(conn, tenant_id, idempotency_key, request_hash,
                                       request_id, job, content, accepted, topic, list(extra))
            try:
                with self.pool.connection(timeout=30) as own:
                    return self._intake_in(own, tenant_id, idempotency_key, request_hash,
                                           request_id, job, content, accepted, topic,
                                           list(extra))
            except psycopg.OperationalError as exc:
                raise RetryableError(f"database unavailable: {exc}",
                                     code="db_unavailable") from None

    def _intake_in(self, conn: psycopg.Connection, tenant_id: str, idempotency_key: str,
                   request_hash: str, request_id: str, job: dict[str, Any], content: bytes,
                   accepted: Any, topic: str, extra: list[OutboxMessage]) -> IntakeResult:
        for _ in range(3):  # a concurrent identical intent may win the insert race: re-read
            try:
                with conn.transaction():
                    row = conn.execute(Q["find_request"], (tenant_id, idempotency_key)).fetchone()
                    if row:
                        if row["request_hash"] != request_hash:
                            raise IdempotencyConflict(
                                f"idempotency key {idempotency_key!r} was used for another "
                                f"request body (job {row['job_id']})")
                        return IntakeResult(row["job_id"], False)
                    first = conn.execute(Q["find_job_by_key"],
                                         (tenant_id, idempotency_key)).fetchone()
                    if first:  # the key's record expired (retention); its job remembers it
                        if first["request_hash"] != request_hash:
                            raise IdempotencyConflict(
                                f"idempotency key {idempotency_key!r} was used for another "
                                f"request body (job {first['job_id']})")
                        conn.execute(Q["insert_request"], (tenant_id, idempotency_key,
                                                           request_hash, first["job_id"],
                                                           request_id))
                        return IntakeResult(first["job_id"], False)
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
                        return IntakeResult(existing["job_id"], False)
                    job_id = created["job_id"]
                    conn.execute(Q["insert_request"], (tenant_id, idempotency_key, request_hash,
                                                       job_id, request_id))
                    event = accepted(job_id)
                    conn.execute(Q["insert_done_stage"], (
                        job_id, "uploaded", job["document_sha256"], "intake-1",
                        Jsonb({"filename": job["filename"]}),
                        Jsonb(event.payload.model_dump(mode="json"))))
                    self.add_outbox(conn, outbox_message(topic, event))
                    for msg in extra:
                        self.add_outbox(conn, msg)
                    return IntakeResult(job_id, True)
            except psycopg.errors.UniqueViolation:
                continue
            except psycopg.DataError as exc:  # e.g. a NUL in a text column: the request's fault
                raise PoisonMessage(f"Postgres refused the request's data: {exc}"[:500],
                                    code="invalid_data") from None
        raise RetryableError("intake kept losing a uniqueness race", code="db_conflict")

    # ------------------------------------------------------------------ stages

    def claim(self, *, job_id: uuid.UUID, stage: str, group: str, dedup_key: str,
              event_type: str, event_id: uuid.UUID, lease_s: float, code_version: str,
              generation: int = 0) -> Claim | Skip | Done | LeaseHeld:
        """Claim ``stage`` of a job for one run (short transaction, no lock kept).

        Returns :class:`Skip` for a duplicate delivery (the idempotent-consumer row exists) or a
        terminal/cancelled/parked job (recording the event as processed); :class:`Done` when the
        stage already succeeded under ``code_version`` (a redrive: re-emit, don't redo);
        :class:`LeaseHeld` when another run's lease is live; else a :class:`Claim` with a fresh
        fencing token (also when the checkpoint was made by another code version). An event of
        an older ``generation`` than the job's (in flight before a redrive) is skipped as
        ``superseded`` without being recorded, so the new generation's event is not taken for
        its duplicate.
        """
        with self.tx() as conn:
            if conn.execute(Q["is_processed"], (group, dedup_key, event_type)).fetchone():
                return Skip("duplicate")
            job = conn.execute(Q["get_job_for_update"], (job_id,)).fetchone()
            if job is None:
                return Skip("unknown_job")
            if generation < job["generation"]:
                return Skip("superseded")
            if job["status"] in (*TERMINAL, "needs_reconciliation") or job["cancel_requested"]:
                if job["cancel_requested"]:
                    conn.execute(Q["cancel_job"], (job_id,))
                conn.execute(Q["record_processed"], (group, dedup_key, event_type, event_id,
                                                     job_id))
                return Skip("cancelled" if job["cancel_requested"] else "terminal")
            row = conn.execute(Q["claim_stage"], {"job_id": job_id, "stage": stage,
                                                  "run_token": uuid.uuid4(),
                                                  "lease_s": lease_s,
                                                  "code_version": code_version}).fetchone()
            if row is None:
                cur = conn.execute(Q["get_stage"], (job_id, stage)).fetchone()
                assert cur is not None
                if cur["status"] == "succeeded":
                    return Done(dict(job), cur["emitted"])
                if cur["status"] in ("failed", "needs_reconciliation"):
                    return Skip("terminal")
                return LeaseHeld(cur["lease_until"])
            return Claim(dict(job), stage, row["run_token"], row["attempt"], row["lease_until"])

    def reemit(self, *, job: dict[str, Any], group: str, event_type: str,
               event_id: uuid.UUID, next_msg: OutboxMessage, final: bool) -> bool:
        """Re-emit a finished stage's event and record the input event as processed, in ONE
        transaction; ``final`` (the ``published`` stage) also closes the job as succeeded.
        Returns False (writing nothing) if another delivery got there first."""
        with self.tx() as conn:
            if conn.execute(Q["record_processed"], (group, job["dedup_key"], event_type,
                                                    event_id, job["job_id"])).fetchone() is None:
                return False
            if final:
                conn.execute(Q["succeed_job"], (job["charge_usd"], job["job_id"]))
            self.add_outbox(conn, next_msg)
            return True

    def renew_lease(self, claim: Claim, lease_s: float) -> None:
        """Extend the lease of a running claim. Raises :class:`StaleRun` if it was taken over."""
        with self.tx() as conn:
            row = conn.execute(Q["renew_lease"], (lease_s, claim.job["job_id"], claim.stage,
                                                  claim.run_token)).fetchone()
        if row is None:
            raise StaleRun(f"stage {claim.stage} of job {claim.job['job_id']} has a newer run")

    def complete(self, claim: Claim, *, output: Any, input_hash: str, code_version: str,
                 cost_usd: float, group: str, event_type: str, event_id: uuid.UUID,
                 next_msg: OutboxMessage,
                 chunks: list[tuple[int, int, int, str, str]] | None = None,
                 charge_usd: float | None = None, later_stages: tuple[str, ...] = ()) -> None:
        """Finish a stage run in ONE transaction: fenced checkpoint, stage side rows (chunks),
        job progress, the next event's outbox row and the idempotent-consumer row.

        A stage that really ran invalidates ``later_stages`` (reset to pending): their inputs
        may have changed. Raises :class:`StaleRun` (and writes nothing) when the run token no
        longer owns the stage.
        """
        job_id = claim.job["job_id"]
        emitted = json.loads(next_msg.value)["payload"]
        with self.tx() as conn:
            cur = conn.execute(Q["complete_stage"], {
                "output": Jsonb(output), "input_hash": input_hash, "code_version": code_version,
                "cost_usd": cost_usd, "job_id": job_id, "stage": claim.stage,
                "run_token": claim.run_token, "emitted": Jsonb(emitted)})
            if cur.rowcount != 1:
                raise StaleRun(f"stage {claim.stage} of job {job_id}: run {claim.run_token} "
                               "was fenced off; result discarded")
            if later_stages:
                conn.execute(Q["reset_later_stages"], (job_id, list(later_stages)))
            if chunks is not None:
                conn.execute(Q["delete_chunks"], (job_id,))
                with conn.cursor() as c:
                    c.executemany(Q["insert_chunk"], [(job_id, *ch) for ch in chunks])
            if charge_usd is not None:
                conn.execute(Q["advance_job"], (claim.stage, cost_usd, job_id))
                conn.execute(Q["succeed_job"], (charge_usd, job_id))
            else:
                conn.execute(Q["advance_job"], (claim.stage, cost_usd, job_id))
            self.add_outbox(conn, next_msg)
            conn.execute(Q["record_processed"], (group, claim.job["dedup_key"], event_type,
                                                 event_id, job_id))

    def fail(self, claim: Claim, *, error_code: str, error: str, group: str, event_type: str,
             event_id: uuid.UUID, failed_msg: OutboxMessage) -> None:
        """Fail the stage and the job in ONE transaction (fenced) with a ``job.failed`` outbox
        row. Raises :class:`StaleRun` when the run was fenced off."""
        job_id = claim.job["job_id"]
        with self.tx() as conn:
            cur = conn.execute(Q["fail_stage"], {"error_code": error_code, "error": error[:4000],
                                                 "job_id": job_id, "stage": claim.stage,
                                                 "run_token": claim.run_token})
            if cur.rowcount != 1:
                raise StaleRun(f"stage {claim.stage} of job {job_id} has a newer run")
            conn.execute(Q["fail_job"], (error_code, error[:4000], job_id))
            self.add_outbox(conn, failed_msg)
            conn.execute(Q["record_processed"], (group, claim.job["dedup_key"], event_type,
                                                 event_id, job_id))

    def release(self, claim: Claim, *, error_code: str, error: str) -> None:
        """Give a stage back after a transient failure (fenced; no-op if fenced off)."""
        with self.tx() as conn:
            conn.execute(Q["release_stage"], {"error_code": error_code, "error": error[:4000],
                                              "job_id": claim.job["job_id"],
                                              "stage": claim.stage,
                                              "run_token": claim.run_token})

    def give_up(self, *, job_id: uuid.UUID, stage: str, error_code: str, error: str,
                group: str, event_type: str, event_id: uuid.UUID, dedup_key: str,
                failed_msg: OutboxMessage) -> bool:
        """Fail an open job whose stage event exhausted its retry budget (ONE transaction,
        with ``job.failed``). Returns False when the job was already terminal."""
        with self.tx() as conn:
            job = conn.execute(Q["get_job_for_update"], (job_id,)).fetchone()
            if job is None or job["status"] in TERMINAL:
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
        job_id = claim.job["job_id"]
        with self.tx() as conn:
            cur = conn.execute(Q["cancel_stage"], (job_id, claim.stage, claim.run_token))
            if cur.rowcount != 1:
                raise StaleRun(f"stage {claim.stage} of job {job_id} has a newer run")
            conn.execute(Q["cancel_job"], (job_id,))
            conn.execute(Q["record_processed"], (group, claim.job["dedup_key"], event_type,
                                                 event_id, job_id))

    def park(self, claim: Claim, *, error_code: str, error: str, group: str, event_type: str,
             event_id: uuid.UUID) -> None:
        """Park the stage and the job in ``needs_reconciliation`` (ONE fenced transaction): a
        provider call's outcome is unknown and the lane's policy is not to guess.
        Raises :class:`StaleRun` when the run was fenced off."""
        job_id = claim.job["job_id"]
        with self.tx() as conn:
            cur = conn.execute(Q["park_stage"], {"error_code": error_code, "error": error[:4000],
                                                 "job_id": job_id, "stage": claim.stage,
                                                 "run_token": claim.run_token})
            if cur.rowcount != 1:
                raise StaleRun(f"stage {claim.stage} of job {job_id} has a newer run")
            conn.execute(Q["park_job"], (error_code, error[:4000], job_id))
            conn.execute(Q["record_processed"], (group, claim.job["dedup_key"], event_type,
                                                 event_id, job_id))

    def redrive(self, job_id: uuid.UUID, *, plan: Any, allowed: tuple[str, ...]) -> str:
        """Re-drive a job (ONE transaction): forget the stage workers' idempotent-consumer rows
        for the job, reopen failed or parked stages, reopen the job, and write the first
        stage's input event to the outbox.

        ``plan(job, stage_rows) -> (OutboxMessage, stages, groups, event_types)`` decides where
        to restart: the event to write (of generation ``job["generation"] + 1``: the job's new
        generation), the stages to reopen and the (group, event type) rows to forget.
        Succeeded stages keep their checkpoints: they are re-emitted, not redone, unless
        their code version changed. Returns the job's previous status. Raises ``KeyError`` (no
        such job) or ``ValueError`` (status not in ``allowed``).
        """
        with self.tx() as conn:
            job = conn.execute(Q["get_job_for_update"], (job_id,)).fetchone()
            if job is None:
                raise KeyError(f"no job {job_id}")
            if job["status"] not in allowed:
                raise ValueError(f"job {job_id} is {job['status']}; redrive needs one of "
                                 f"{list(allowed)}")
            rows = {r["stage"]: r for r in conn.execute(Q["list_stages"], (job_id,))}
            msg, stages, groups, event_types = plan(dict(job), rows)
            conn.execute(Q["forget_processed"], (job["dedup_key"], groups, event_types))
            conn.execute(Q["reopen_stages"], (job_id, list(stages)))
            conn.execute(Q["reopen_job"], (job["generation"] + 1, job_id))
            self.add_outbox(conn, msg)
            return str(job["status"])

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

    def expired_leases(self, grace_s: float) -> list[dict[str, Any]]:
        """``(job_id, stage)`` of running stages whose lease expired over ``grace_s`` ago."""
        with self.tx() as conn:
            return list(conn.execute(Q["expired_leases"], (grace_s,)))

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

    def chunks(self, job_id: uuid.UUID) -> list[dict[str, Any]]:
        """The job's chunks in order: ``idx``, ``text``, ``text_sha256``, ``llm_output``."""
        with self.tx() as conn:
            return list(conn.execute(Q["list_chunks"], (job_id,)))

    def job(self, job_id: uuid.UUID) -> dict[str, Any] | None:
        """The job row, or ``None``."""
        with self.tx() as conn:
            return conn.execute(Q["get_job"], (job_id,)).fetchone()

    # ------------------------------------------------------------------ provider log

    def start_attempt(self, claim: Claim, *, chunk_idx: int, attempt: int,
                      model: str) -> int | None:
        """Record a provider attempt as ``started`` (committed before the request is sent).
        Returns ``None`` (and records nothing) when the job's cancel was committed first."""
        with self.tx() as conn:
            row = conn.execute(Q["start_provider_attempt"], (
                claim.stage, chunk_idx, attempt, claim.run_token, claim.job["model_profile"],
                model, claim.job["job_id"])).fetchone()
        return int(row["attempt_id"]) if row else None

    def finish_attempt(self, attempt_id: int, *, outcome: str, status_code: int | None = None,
                       latency_ms: float | None = None, prompt_tokens: int | None = None,
                       completion_tokens: int | None = None, cost_usd: float = 0.0,
                       error: str | None = None) -> None:
        """Record the outcome of a provider attempt (``succeeded``, ``transient_error``,
        ``permanent_error``, ``outcome_unknown`` or ``cancelled``)."""
        with self.tx() as conn:
            conn.execute(Q["finish_provider_attempt"], {
                "outcome": outcome, "status_code": status_code, "latency_ms": latency_ms,
                "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "cost_usd": cost_usd, "error": error and error[:2000], "attempt_id": attempt_id})

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
        for the chunk a second time. When a newer run owns the stage the attempt's outcome is
        still committed (it was paid for) and :class:`StaleRun` is raised."""
        with self.tx() as conn:
            conn.execute(Q["finish_provider_attempt"], {
                "outcome": "succeeded", "status_code": status_code, "latency_ms": latency_ms,
                "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "cost_usd": cost_usd, "error": None, "attempt_id": attempt_id})
            cur = conn.execute(Q["save_chunk_output"], {
                "output": Jsonb(output), "attempt_id": attempt_id, "job_id": claim.job["job_id"],
                "idx": idx, "run_token": claim.run_token})
            saved = cur.rowcount == 1
        if not saved:
            raise StaleRun(f"LLM stage of job {claim.job['job_id']} has a newer run")

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
        seconds, over stages finished in the last ``window_s`` seconds). Raises
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
                "queue_waits": list(conn.execute(Q["metrics_queue_waits"], {
                    **window, "stages": stages, "prevs": list(STAGES[:-1])})),
            }

    # ------------------------------------------------------------------ retention

    def gc_batch(self, table: str, *, horizon_s: float, limit: int) -> int:
        """Delete up to ``limit`` expired rows of ``table`` (``outbox``, ``processed_event``
        or ``job_request``; see ``gc_<table>`` in queries.sql) older than ``horizon_s``
        seconds, in ONE short transaction; returns how many were deleted. Raises ``KeyError``
        for another table, :class:`RetryableError` when Postgres is unavailable."""
        query = Q[f"gc_{table}"]
        with self.tx() as conn:
            return conn.execute(query, {"horizon_s": horizon_s, "limit": limit}).rowcount
