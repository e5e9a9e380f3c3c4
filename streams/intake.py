"""Stage ``intake``: ``document.uploaded`` -> one transaction creating the job, its ``intake``
checkpoint and the ``job.accepted`` outbox row. A reused idempotency key maps to the same job;
a reused key with another body is dead-lettered (``idempotency_key_conflict``).
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

from jobstream import idempotency
from jobstream.errors import PermanentError, PoisonMessage
from jobstream.keys import dedup_key, sha256_hex
from jobstream.llm.profiles import PIPELINES, get_profile, get_prompt
from jobstream.store import IntakeResult
from jobstream.textproc import extractor_for
from schemas.events import DocumentUploaded, JobAccepted, JobAcceptedPayload
from schemas.pipeline import PIPELINE
from streams.actions import redrive
from streams.context import StageContext, outbox_msg

if TYPE_CHECKING:
    import faust

STAGE = PIPELINE.stage("intake")


def handle_intake(ctx: StageContext, ev: DocumentUploaded, *, conn: Any = None,
                  emit_uploaded: bool = False) -> IntakeResult:
    """Turn one ``document.uploaded`` into a job (one transaction, see :meth:`Store.intake`).

    ``conn`` joins the caller's transaction (the API's batches); ``emit_uploaded`` also writes
    the ``document.uploaded`` event itself to the outbox, for other consumers (the API path).

    Raises :class:`PoisonMessage` for requests that can never succeed (unknown pipeline, prompt
    or profile; unreadable, oversized, size- or hash-mismatched document (the bytes actually
    read are checked); idempotency-key conflict; data Postgres refuses: ``invalid_data``).
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

    extra = [outbox_msg(ctx, ev)] if emit_uploaded else []
    return ctx.store.intake(tenant_id=ev.tenant_id, idempotency_key=ev.idempotency_key,
                            request_hash=rh, request_id=ev.request_id, job=job, content=content,
                            accepted=accepted, topic=ctx.settings.topic(STAGE.emits),
                            conn=conn, extra=extra, restart=restart)


def register(app: faust.App, ctx: StageContext) -> Any:
    """Register the intake agent on ``document.uploaded`` (prefixed by settings)."""
    from streams.base import register_stage_agent  # faust: only the worker needs it

    return register_stage_agent(app, ctx, name=STAGE.name, consumes=STAGE.consumes,
                                handler=handle_intake)
