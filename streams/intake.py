"""Stage ``intake``: ``document.uploaded`` -> one transaction creating the job, its ``intake``
checkpoint and the ``job.accepted`` outbox row. A reused idempotency key maps to the same job;
a reused key with another body is dead-lettered (``idempotency_key_conflict``).

The worker's intake agent accepts events in batches (issue 12): it runs up to
``intake_batch_max`` events at once, and :class:`IntakeBatcher` gathers their intents into ONE
transaction (:meth:`Store.intake_batch`, a savepoint per intent), so a burst is accepted at
Postgres' batched rate instead of one commit per document. Each event still goes through the
one guard of ``streams/base.py`` (decode, dead letter, retry) and is done, and its offset
committable, only after its batch committed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jobstream import idempotency, tracing
from jobstream.errors import PermanentError, PoisonMessage
from jobstream.keys import dedup_key, sha256_hex
from jobstream.llm.profiles import PIPELINES, get_profile, get_prompt
from jobstream.store import IntakeIntent, IntakeResult
from jobstream.textproc import extractor_for
from schemas.events import DocumentUploaded, JobAccepted, JobAcceptedPayload
from schemas.pipeline import PIPELINE
from streams.actions import redrive
from streams.batchthread import BatchThread
from streams.context import StageContext, outbox_msg

if TYPE_CHECKING:
    import faust

STAGE = PIPELINE.stage("intake")
log = logging.getLogger("jobstream.streams")


def handle_intake(ctx: StageContext, ev: DocumentUploaded, *, conn: Any = None,
                  emit_uploaded: bool = False) -> IntakeResult:
    """Turn one ``document.uploaded`` into a job (one transaction, see :meth:`Store.intake`).

    ``conn`` joins the caller's transaction (the API's batches); ``emit_uploaded`` also writes
    the ``document.uploaded`` event itself to the outbox, for other consumers (the API path).

    Raises :class:`PoisonMessage` for requests that can never succeed (unknown pipeline, prompt
    or profile; unreadable, oversized, size- or hash-mismatched document (the bytes actually
    read are checked); idempotency-key conflict; data Postgres refuses: ``invalid_data``).
    """
    it = intake_intent(ctx, ev, emit_uploaded=emit_uploaded)
    return ctx.store.intake(tenant_id=it.tenant_id, idempotency_key=it.idempotency_key,
                            request_hash=it.request_hash, request_id=it.request_id, job=it.job,
                            content=it.content, accepted=it.accepted, topic=it.topic,
                            conn=conn, extra=it.extra, restart=it.restart)


def intake_intent(ctx: StageContext, ev: DocumentUploaded, *, emit_uploaded: bool = False,
                  span: tracing.SpanContext | None = None) -> IntakeIntent:
    """Check one ``document.uploaded`` and build its intent (no database access): the job row,
    the document's bytes, the ``job.accepted`` builder. ``span``: the trace the job joins.

    Raises :class:`PoisonMessage` as :func:`handle_intake` does for the checks made before
    Postgres (pipeline, prompt, profile, document size, readability and hash).
    """
    p = ev.payload
    try:
        if p.pipeline not in PIPELINES:
            raise PermanentError(f"unknown pipeline {p.pipeline!r}", code="unknown_pipeline")
        get_prompt(p.prompt_version)
        get_profile(p.model_profile)
    except PermanentError as exc:
        raise PoisonMessage(str(exc), code=exc.code) from None
    limit = ctx.settings.max_inline_document_bytes
    if p.document.size_bytes > limit:
        raise PoisonMessage(f"document of {p.document.size_bytes} bytes exceeds the limit of "
                            f"{limit}", code="document_too_large")
    try:
        content = p.document.content(ctx.settings.document_roots, max_bytes=limit)
    except PermissionError as exc:
        raise PoisonMessage(f"document URI not allowed: {exc}",
                            code="document_uri_not_allowed") from None
    except (OSError, ValueError) as exc:
        raise PoisonMessage(f"document unreadable: {exc}", code="document_unreadable") from None
    # The bytes actually read, not the declared size, are what the limit is about.
    if len(content) > limit:
        raise PoisonMessage(f"the document has more than {limit} bytes (the limit); the event "
                            f"declares {p.document.size_bytes}", code="document_too_large")
    if len(content) != p.document.size_bytes:
        raise PoisonMessage(f"the document has {len(content)} bytes, the event declares "
                            f"{p.document.size_bytes}", code="size_mismatch")
    actual = sha256_hex(content)
    if actual != p.document.sha256:
        raise PoisonMessage(f"document sha256 is {actual}, event says {p.document.sha256}",
                            code="document_hash_mismatch")
    try:
        extractor = extractor_for(p.document.content_type)
    except PermanentError as exc:
        raise PoisonMessage(str(exc), code=exc.code) from None
    dk = dedup_key(tenant_id=ev.tenant_id, document_hash=actual, pipeline=p.pipeline,
                   prompt_version=p.prompt_version, model_profile=p.model_profile,
                   extractor=extractor)
    rh = idempotency.document_request_hash(p, document_hash=actual)
    job = {
        "job_id": uuid.uuid4(), "tenant_id": ev.tenant_id, "idempotency_key": ev.idempotency_key,
        "request_hash": rh, "dedup_key": dk, "request_id": ev.request_id,
        "document_sha256": actual, "filename": p.document.filename,
        "content_type": p.document.content_type, "pipeline": p.pipeline,
        "prompt_version": p.prompt_version, "model_profile": p.model_profile, "lane": p.lane,
    }

    def accepted(job_id: uuid.UUID) -> JobAccepted:
        return JobAccepted(
            tenant_id=ev.tenant_id, idempotency_key=ev.idempotency_key,
            request_id=ev.request_id, job_id=job_id, dedup_key=dk,
            payload=JobAcceptedPayload(
                document_sha256=actual, content_type=p.document.content_type,
                pipeline=p.pipeline, prompt_version=p.prompt_version,
                model_profile=p.model_profile, lane=p.lane))

    def restart(conn: Any, job_id: uuid.UUID) -> bool:
        # A new intent for a computation that failed or was cancelled: a new run of its job
        # (a redrive: new generation, finished stages re-emitted, not redone).
        try:
            redrive(ctx, job_id, allowed=("failed", "cancelled"), conn=conn)
        except ValueError:
            return False  # its state changed meanwhile: the key reuses the job as it is
        return True

    extra = (outbox_msg(ctx, ev),) if emit_uploaded else ()
    return IntakeIntent(tenant_id=ev.tenant_id, idempotency_key=ev.idempotency_key,
                        request_hash=rh, request_id=ev.request_id, job=job, content=content,
                        accepted=accepted, topic=ctx.settings.topic(STAGE.emits), extra=extra,
                        restart=restart, span=span)


@dataclass
class _Pending:
    ev: DocumentUploaded
    span: tracing.SpanContext | None
    fut: asyncio.Future[IntakeResult]
    since: float  # loop time it arrived (seconds)


class IntakeBatcher:
    """Gathers the ``document.uploaded`` events a worker's intake agent runs at once into
    batches accepted in ONE transaction each (:meth:`Store.intake_batch`).

    :meth:`handle` is the agent's handler (``streams/base.py`` awaits it inside its guard, one
    call per event): it queues the event and returns its :class:`IntakeResult` once its batch
    committed, or raises what that event alone raised (:class:`PoisonMessage` and its
    ``IdempotencyConflict``, ``invalid_data``; :class:`RetryableError` when Postgres was
    unreachable), which the guard routes as for a one-event transaction. A batch is cut at
    ``max_n`` events or ``max_bytes`` declared document bytes, or when its first event waited
    ``wait_s`` seconds; events arriving while a batch commits form the next one. Batches run
    one at a time on the batcher's own thread (the intake lane: never queued behind other
    stages' work in the shared default executor).
    """

    def __init__(self, ctx: StageContext, *, max_n: int, wait_s: float, max_bytes: int) -> None:
        self.ctx = ctx
        self.max_n = max_n
        self.wait_s = wait_s
        self.max_bytes = max_bytes
        self._pending: list[_Pending] = []
        self._pending_bytes = 0  # the declared sizes of _pending's documents (bytes)
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._thread = BatchThread("intake-batch")

    async def handle(self, ctx: StageContext, ev: DocumentUploaded) -> IntakeResult:
        """The intake of ``ev`` in the next batch (see the class). Raises what the event's
        intent raised, or ``CancelledError`` when the worker stops first (not done: the event
        is redelivered, and a batch that committed meanwhile makes it a replay)."""
        loop = asyncio.get_running_loop()
        item = _Pending(ev, tracing.current(), loop.create_future(), loop.time())
        self._pending.append(item)
        self._pending_bytes += ev.payload.document.size_bytes
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = loop.create_task(self._run(), name="intake-batcher")
        elif self._wake is not None and self._full():
            self._wake.set()
        return await item.fut

    def _full(self) -> bool:
        # A running total: a sum over the pending events was up to 100 reads per event.
        return len(self._pending) >= self.max_n or self._pending_bytes >= self.max_bytes

    def _cut(self) -> list[_Pending]:
        batch: list[_Pending] = []
        size = 0
        while self._pending and len(batch) < self.max_n and (not batch or size < self.max_bytes):
            item = self._pending.pop(0)
            self._pending_bytes -= item.ev.payload.document.size_bytes
            if item.fut.done():  # its event was cancelled (stopping): not ours to run
                continue
            batch.append(item)
            size += item.ev.payload.document.size_bytes
        return batch

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._wake is not None
        while self._pending:
            wait = self._pending[0].since + self.wait_s - loop.time()
            if wait > 0 and not self._full():
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), wait)
            batch = self._cut()
            if not batch:
                continue
            try:
                results = await self._thread.run(functools.partial(self._accept, batch))
            except Exception as exc:  # a bug: each event's guard dead-letters it (unhandled)
                for item in batch:
                    if not item.fut.done():
                        item.fut.set_exception(exc)
                continue
            except BaseException:  # stopping: the events are not done, offsets held back
                for item in batch:
                    item.fut.cancel()
                raise
            for item, result in zip(batch, results, strict=True):
                if item.fut.done():
                    continue
                if isinstance(result, BaseException):
                    item.fut.set_exception(result)
                else:
                    item.fut.set_result(result)

    def _accept(self, batch: list[_Pending]) -> list[IntakeResult | Exception]:
        """In the batcher's thread: each event's checks, then one transaction for the intents
        that passed them."""
        out: list[IntakeResult | Exception | None] = [None] * len(batch)
        intents: list[IntakeIntent] = []
        where: list[int] = []
        t0 = time.monotonic()
        for i, item in enumerate(batch):
            try:
                with tracing.use(item.span):
                    intents.append(intake_intent(self.ctx, item.ev, span=item.span))
                where.append(i)
            except Exception as exc:  # PoisonMessage (or a bug): this event alone
                out[i] = exc
        t1 = time.monotonic()
        # A worker frozen inside the batch's transaction longer than the lease loses it (and
        # the documents' row locks the partitions' next owner needs).
        results = self.ctx.store.intake_batch(intents, idle_limit_s=self.ctx.settings.lease_s)
        for i, result in zip(where, results, strict=True):
            out[i] = result
        log.info("intake batch of %d events (%d to Postgres): %.1f ms checks, %.1f ms "
                 "transaction", len(batch), len(intents), (t1 - t0) * 1000,
                 (time.monotonic() - t1) * 1000)
        return [r for r in out if r is not None]


def register(app: faust.App, ctx: StageContext) -> Any:
    """Register the intake agent on ``document.uploaded`` (prefixed by settings): up to
    ``intake_batch_max`` events at once, accepted in batches (:class:`IntakeBatcher`)."""
    from streams.base import register_stage_agent  # faust: only the worker needs it

    s = ctx.settings
    batcher = IntakeBatcher(ctx, max_n=s.intake_batch_max, wait_s=s.intake_batch_wait_s,
                            max_bytes=s.intake_batch_max_bytes)
    return register_stage_agent(app, ctx, name=STAGE.name, consumes=STAGE.consumes,
                                handler=batcher.handle, concurrency=s.intake_batch_max)
