"""The job store: every database operation of the pipeline, in the project's vocabulary.

Each public method is one short transaction (or joins the caller's via ``conn=``). Driver errors
are translated here, and only here: ``psycopg.OperationalError`` (Postgres unreachable or
restarting) becomes :class:`RetryableError` ``db_unavailable``.
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

from jobstream.db import QUERIES as Q
from jobstream.errors import IdempotencyConflict, RetryableError, StaleRun
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

    # ------------------------------------------------------------------ outbox

    @staticmethod
    def add_outbox(conn: psycopg.Connection, msg: OutboxMessage) -> None:
        """Write one outbox row inside the caller's transaction (the transactional outbox)."""
        ev = json.loads(msg.value)
        conn.execute(Q["outbox_insert"], (msg.topic, msg.key, msg.value, Jsonb(msg.headers),
                                          ev["event_id"], ev["event_type"]))

    # ------------------------------------------------------------------ intake

    def intake(self, *, tenant_id: str, idempotency_key: str, request_hash: str,
               request_id: str, job: dict[str, Any], content: bytes,
               accepted: Any, topic: str) -> IntakeResult:
        """Create a job for one client intent, in ONE transaction: document, job, idempotency
        record, ``uploaded`` checkpoint and the ``job.accepted`` outbox row.

        ``job``: the job row's columns (``job_id``, ``dedup_key``, …). ``accepted``: a callable
        ``job_id -> event`` building the outbox event. The same (tenant, idempotency_key) again
        returns the same job with no new work; a second key for the same dedup_key is bound to
        the existing job. Raises :class:`IdempotencyConflict` when the key was used with a
        different body.
        """
        for _ in range(3):  # a concurrent identical intent may win the insert race: re-read
            try:
                with self.tx() as conn:
                    row = conn.execute(Q["find_request"], (tenant_id, idempotency_key)).fetchone()
                    if row:
                        if row["request_hash"] != request_hash:
                            raise IdempotencyConflict(
                                f"idempotency key {idempotency_key!r} was used for another "
                                f"request body (job {row['job_id']})")
                        return IntakeResult(row["job_id"], False)
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
                    conn.execute(Q["insert_done_stage"], (job_id, "uploaded",
                                                          job["document_sha256"], "intake-1",
                                                          Jsonb({"filename": job["filename"]})))
                    self.add_outbox(conn, outbox_message(topic, accepted(job_id)))
                    return IntakeResult(job_id, True)
            except psycopg.errors.UniqueViolation:
                continue
        raise RetryableError("intake kept losing a uniqueness race", code="db_conflict")

    # ------------------------------------------------------------------ stages

    def claim(self, *, job_id: uuid.UUID, stage: str, group: str, dedup_key: str,
              event_type: str, event_id: uuid.UUID, lease_s: float) -> Claim | Skip | LeaseHeld:
        """Claim ``stage`` of a job for one run (short transaction, no lock kept).

        Returns :class:`Skip` for a duplicate delivery (the idempotent-consumer row exists), a
        finished stage, or a terminal/cancelled job (recording the event as processed);
        :class:`LeaseHeld` when another run's lease is live; else a :class:`Claim` with a fresh
        fencing token.
        """
        with self.tx() as conn:
            if conn.execute(Q["is_processed"], (group, dedup_key, event_type)).fetchone():
                return Skip("duplicate")
            job = conn.execute(Q["get_job_for_update"], (job_id,)).fetchone()
            if job is None:
                return Skip("unknown_job")
            if job["status"] in TERMINAL or job["cancel_requested"]:
                if job["cancel_requested"]:
                    conn.execute(Q["cancel_job"], (job_id,))
                conn.execute(Q["record_processed"], (group, dedup_key, event_type, event_id,
                                                     job_id))
                return Skip("cancelled" if job["cancel_requested"] else "terminal")
            row = conn.execute(Q["claim_stage"], {"job_id": job_id, "stage": stage,
                                                  "run_token": uuid.uuid4(),
                                                  "lease_s": lease_s}).fetchone()
            if row is None:
                cur = conn.execute(Q["get_stage"], (job_id, stage)).fetchone()
                assert cur is not None
                if cur["status"] == "succeeded":
                    conn.execute(Q["record_processed"], (group, dedup_key, event_type, event_id,
                                                         job_id))
                    return Skip("done")
                if cur["status"] == "failed":
                    return Skip("terminal")
                return LeaseHeld(cur["lease_until"])
            return Claim(dict(job), stage, row["run_token"], row["attempt"], row["lease_until"])

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
                 charge_usd: float | None = None) -> None:
        """Finish a stage run in ONE transaction: fenced checkpoint, stage side rows (chunks),
        job progress, the next event's outbox row and the idempotent-consumer row.

        Raises :class:`StaleRun` (and writes nothing) when the run token no longer owns the stage.
        """
        job_id = claim.job["job_id"]
        with self.tx() as conn:
            cur = conn.execute(Q["complete_stage"], {
                "output": Jsonb(output), "input_hash": input_hash, "code_version": code_version,
                "cost_usd": cost_usd, "job_id": job_id, "stage": claim.stage,
                "run_token": claim.run_token})
            if cur.rowcount != 1:
                raise StaleRun(f"stage {claim.stage} of job {job_id}: run {claim.run_token} "
                               "was fenced off; result discarded")
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

    def start_attempt(self, claim: Claim, *, chunk_idx: int, attempt: int, model: str) -> int:
        """Record a provider attempt as ``started`` (committed before the request is sent)."""
        with self.tx() as conn:
            row = conn.execute(Q["start_provider_attempt"], (
                claim.job["job_id"], claim.stage, chunk_idx, attempt, claim.run_token,
                claim.job["model_profile"], model)).fetchone()
        assert row is not None
        return int(row["attempt_id"])

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

    def record_answer(self, claim: Claim, idx: int, attempt_id: int, output: Any, *,
                      status_code: int, latency_ms: float, prompt_tokens: int,
                      completion_tokens: int, cost_usd: float) -> None:
        """Record a provider attempt as ``succeeded`` and keep its answer as chunk ``idx``'s
        output, in ONE transaction: a crash leaves either both or neither (the attempt still
        ``started``), never a paid success whose answer is lost.

        The output is kept only while ``claim`` still owns the LLM stage (fenced); otherwise
        the attempt is still recorded (the provider answered and billed it), the answer is
        discarded and :class:`StaleRun` raised.
        """
        with self.tx() as conn:
            conn.execute(Q["finish_provider_attempt"], {
                "outcome": "succeeded", "status_code": status_code, "latency_ms": latency_ms,
                "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "cost_usd": cost_usd, "error": None, "attempt_id": attempt_id})
            cur = conn.execute(Q["save_chunk_output"], {
                "output": Jsonb(output), "attempt_id": attempt_id, "job_id": claim.job["job_id"],
                "idx": idx, "run_token": claim.run_token})
        if cur.rowcount != 1:
            raise StaleRun(f"LLM stage of job {claim.job['job_id']} has a newer run; the answer "
                           f"of attempt {attempt_id} for chunk {idx} is discarded")
