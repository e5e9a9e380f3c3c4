"""The pipeline's stage logic, independent of Kafka: intake and the five checkpointed stages.

Each stage follows the seeds' rules (design.md, "Stage work"): skip if the event was processed
or the checkpoint is done; claim with a lease and a fresh run token (fencing token); do the work
outside any transaction; then in ONE transaction write the fenced checkpoint, the next event's
outbox row and the idempotent-consumer row. The caller (a faust agent) commits the Kafka offset
only after :func:`run_stage` returns.

Errors that escape: :class:`RetryableError` / :class:`OutcomeUnknown` (the caller retries the
same message later; nothing was checkpointed) and :class:`PoisonMessage` (dead-letter it).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError

from jobstream import faults
from jobstream.errors import (
    OutcomeUnknown,
    PermanentError,
    PoisonMessage,
    RetryableError,
    StaleRun,
)
from jobstream.keys import canonical_json, dedup_key, request_hash, sha256_hex
from jobstream.llm.client import ProviderClient, backoff_s
from jobstream.llm.profiles import PIPELINES, ModelProfile, get_profile, get_prompt
from jobstream.settings import Settings
from jobstream.store import Claim, IntakeResult, LeaseHeld, Skip, Store, outbox_message
from jobstream.textproc import CHUNK_VERSION, EXTRACT_VERSION, chunk_text, extract_text
from schemas.events import (
    ChunksReady,
    ChunksReadyPayload,
    DocumentAnalysis,
    DocumentUploaded,
    JobAccepted,
    JobAcceptedPayload,
    JobFailed,
    JobFailedPayload,
    JobReady,
    JobReadyPayload,
    LlmDone,
    LlmDonePayload,
    TextExtracted,
    TextExtractedPayload,
    Validated,
    ValidatedPayload,
)

log = logging.getLogger("jobstream.stages")

LLM_VERSION = "llm-1"
VALIDATE_VERSION = "validate-1"
PUBLISH_VERSION = "publish-1"


@dataclass
class StageContext:
    """What stage code needs: settings, the store, and one provider client per profile."""

    settings: Settings
    store: Store
    _clients: dict[str, ProviderClient] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def group(self, stage: str) -> str:
        """Idempotent-consumer group name of a stage (prefixed like Kafka groups)."""
        return self.settings.group(f"jobstream-{stage}")

    def client(self, profile: ModelProfile) -> ProviderClient:
        """The (cached) provider client of ``profile``; base URL/key overridable by settings."""
        with self._lock:
            if profile.name not in self._clients:
                base = self.settings.provider_base_url if profile.base_url else None
                key = self.settings.provider_api_key or (
                    os.environ.get(profile.api_key_env) if profile.api_key_env else None)
                self._clients[profile.name] = ProviderClient(
                    profile, timeout_s=self.settings.provider_timeout_s, base_url=base,
                    api_key=key)
            return self._clients[profile.name]

    def close(self) -> None:
        """Close provider clients (the store is closed by its owner)."""
        for c in self._clients.values():
            c.close()


# ---------------------------------------------------------------------------------- intake

def handle_intake(ctx: StageContext, ev: DocumentUploaded) -> IntakeResult:
    """Turn one ``document.uploaded`` into a job (one transaction, see :meth:`Store.intake`).

    Raises :class:`PoisonMessage` for requests that can never succeed (unknown pipeline, prompt
    or profile; unreadable, oversized or hash-mismatched document; idempotency-key conflict).
    """
    p = ev.payload
    try:
        if p.pipeline not in PIPELINES:
            raise PermanentError(f"unknown pipeline {p.pipeline!r}", code="unknown_pipeline")
        get_prompt(p.prompt_version)
        get_profile(p.model_profile)
    except PermanentError as exc:
        raise PoisonMessage(str(exc), code=exc.code) from None
    if p.document.size_bytes > ctx.settings.max_inline_document_bytes:
        raise PoisonMessage(f"document of {p.document.size_bytes} bytes exceeds the limit of "
                            f"{ctx.settings.max_inline_document_bytes}", code="document_too_large")
    try:
        content = p.document.content()
    except (OSError, ValueError) as exc:
        raise PoisonMessage(f"document unreadable: {exc}", code="document_unreadable") from None
    actual = sha256_hex(content)
    if actual != p.document.sha256:
        raise PoisonMessage(f"document sha256 is {actual}, event says {p.document.sha256}",
                            code="document_hash_mismatch")
    dk = dedup_key(tenant_id=ev.tenant_id, document_hash=actual, pipeline=p.pipeline,
                   prompt_version=p.prompt_version, model_profile=p.model_profile)
    rh = request_hash(document_hash=actual, pipeline=p.pipeline, prompt_version=p.prompt_version,
                      model_profile=p.model_profile, lane=p.lane)
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

    return ctx.store.intake(tenant_id=ev.tenant_id, idempotency_key=ev.idempotency_key,
                            request_hash=rh, request_id=ev.request_id, job=job, content=content,
                            accepted=accepted, topic=ctx.settings.topic("job.accepted"))


# ---------------------------------------------------------------------------------- stages

@dataclass(frozen=True)
class StageResult:
    """What a stage's work produced: checkpoint output, input hash, code version, cost (USD),
    the next event's payload, and side rows (chunks) or the user charge (publish)."""

    output: Any
    input_hash: str
    code_version: str
    payload: BaseModel
    cost_usd: float = 0.0
    chunks: list[tuple[int, int, int, str, str]] | None = None
    charge_usd: float | None = None


def _extract(ctx: StageContext, claim: Claim, ev: Any) -> StageResult:
    job = claim.job
    content, ctype = ctx.store.document(job["tenant_id"], job["document_sha256"])
    ex = extract_text(content, ctype)
    return StageResult(
        output={"text": ex.text, "page_count": ex.page_count},
        input_hash=job["document_sha256"], code_version=EXTRACT_VERSION,
        payload=TextExtractedPayload(text_sha256=sha256_hex(ex.text), char_count=len(ex.text),
                                     page_count=ex.page_count))


def _chunk(ctx: StageContext, claim: Claim, ev: Any) -> StageResult:
    extracted = ctx.store.stage_output(claim.job["job_id"], "text_extracted")
    if extracted is None:
        raise RetryableError("text_extracted checkpoint not visible yet", code="not_ready")
    text = extracted["text"]
    chunks = chunk_text(text, ctx.settings.chunk_size_chars)
    rows = [(c.idx, c.start, c.end, c.text, sha256_hex(c.text)) for c in chunks]
    digest = sha256_hex(canonical_json([r[4] for r in rows]))
    return StageResult(
        output={"chunk_count": len(rows), "chunks_sha256": digest,
                "chunk_size_chars": ctx.settings.chunk_size_chars},
        input_hash=sha256_hex(text), code_version=CHUNK_VERSION, chunks=rows,
        payload=ChunksReadyPayload(chunk_count=len(rows), chunks_sha256=digest))


def _call_provider(ctx: StageContext, claim: Claim, profile: ModelProfile, prompt: str,
                   chunk: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """One chunk through the provider under the budget: attempts AND deadline (seconds).

    Every attempt is a ``provider_attempt`` row committed before the request is sent; the
    answer that succeeds is recorded together with the chunk's output (one transaction, see
    :meth:`Store.record_answer`). Returns ``(model output, attempt_id)``. Raises
    :class:`PermanentError` (including an exhausted budget, code ``retry_budget_exhausted``)
    and :class:`StaleRun` when a newer run owns the stage.
    """
    s = ctx.settings
    client = ctx.client(profile)
    deadline = time.monotonic() + s.provider_timeout_s * s.provider_max_attempts + 60
    last: Exception | None = None
    for attempt in range(1, s.provider_max_attempts + 1):
        ctx.store.renew_lease(claim, s.lease_s)
        attempt_id = ctx.store.start_attempt(claim, chunk_idx=chunk["idx"], attempt=attempt,
                                             model=client.model)
        try:
            done = client.complete(prompt, chunk["text"],
                                   idempotency_key=f"{claim.job['job_id']}:{chunk['idx']}")
        except RetryableError as exc:
            ctx.store.finish_attempt(attempt_id, outcome="transient_error", error=str(exc))
            wait = max(exc.retry_after_s or 0.0,
                       backoff_s(attempt - 1, s.provider_backoff_base_s, s.provider_backoff_cap_s))
            last = exc
        except OutcomeUnknown as exc:
            # Interactive policy: retry (the provider's Idempotency-Key header lets it dedupe).
            ctx.store.finish_attempt(attempt_id, outcome="outcome_unknown", error=str(exc))
            wait = backoff_s(attempt - 1, s.provider_backoff_base_s, s.provider_backoff_cap_s)
            last = exc
        except PermanentError as exc:
            ctx.store.finish_attempt(attempt_id, outcome="permanent_error", error=str(exc),
                                     status_code=_status_of(exc))
            raise
        else:
            cost = profile.cost_usd(done.prompt_tokens, done.completion_tokens)
            faults.point("llm_chunk_answered_before_save")
            ctx.store.record_answer(claim, chunk["idx"], attempt_id, done.content,
                                    status_code=done.status_code, latency_ms=done.latency_ms,
                                    prompt_tokens=done.prompt_tokens,
                                    completion_tokens=done.completion_tokens, cost_usd=cost)
            return done.content, attempt_id
        if attempt == s.provider_max_attempts or time.monotonic() + wait > deadline:
            break
        log.info("provider attempt %d for job %s chunk %d failed (%s); retrying in %.2fs",
                 attempt, claim.job["job_id"], chunk["idx"], last, wait)
        time.sleep(wait)
    raise PermanentError(f"provider retry budget exhausted after {attempt} attempts: {last}",
                         code="retry_budget_exhausted")


def _status_of(exc: Exception) -> int | None:
    code = getattr(exc, "code", "")
    return int(code[5:]) if code.startswith("http_") and code[5:].isdigit() else None


def _llm(ctx: StageContext, claim: Claim, ev: Any) -> StageResult:
    job = claim.job
    profile = get_profile(job["model_profile"])
    prompt = get_prompt(job["prompt_version"])
    chunks = ctx.store.chunks(job["job_id"])
    if not chunks:
        raise RetryableError("chunks not visible yet", code="not_ready")
    for ch in chunks:
        if ch["llm_output"] is not None:
            continue  # answered in an earlier run of this stage: never paid for twice
        _call_provider(ctx, claim, profile, prompt, ch)  # saves the chunk's output
    faults.point("llm_after_provider_before_checkpoint")
    outputs = [c["llm_output"] for c in ctx.store.chunks(job["job_id"])]
    if any(o is None for o in outputs):
        raise StaleRun("a chunk lost its output: a newer run owns the stage")
    # Every run's attempts: a run that resumes after a crash reports what the stage cost,
    # not only its own (possibly zero) calls.
    cost, attempts = ctx.store.stage_provider_cost(job["job_id"], "llm_done")
    digest = sha256_hex(canonical_json(outputs))
    return StageResult(
        output={"chunk_count": len(outputs), "output_sha256": digest, "model": profile.model,
                "provider_attempts": attempts},
        input_hash=sha256_hex(canonical_json([c["text_sha256"] for c in chunks])),
        code_version=LLM_VERSION, cost_usd=cost,
        payload=LlmDonePayload(chunk_count=len(outputs), output_sha256=digest,
                               provider_calls=attempts, reused=attempts == 0, cost_usd=cost))


class ChunkAnalysis(BaseModel):
    """What the model must answer for one chunk (validated leniently, extra keys ignored)."""

    title: str | None = None
    summary: str
    keywords: list[str]
    word_count: int = 0
    fields: dict[str, Any] = {}


def merge_analyses(filename: str, outputs: list[Any]) -> DocumentAnalysis:
    """Merge per-chunk model outputs into one validated :class:`DocumentAnalysis`.

    Raises :class:`PermanentError` ``invalid_model_output`` when a chunk answer or the merged
    result violates its schema (the model is not asked again: same input, same answer).
    """
    try:
        parts = [ChunkAnalysis.model_validate(o) for o in outputs]
        kw: Counter[str] = Counter()
        for rank_list in (p.keywords for p in parts):
            for rank, word in enumerate(rank_list):
                kw[word.lower()] += max(1, 10 - rank)
        fields: dict[str, Any] = {}
        for p in parts:
            for k, v in p.fields.items():
                if isinstance(v, list):
                    fields[k] = sorted(set(fields.get(k, [])) | {str(x) for x in v})[:20]
                elif k not in fields and isinstance(v, str | int):
                    fields[k] = v
        summary = " ".join(p.summary for p in parts[:3] if p.summary).strip()
        return DocumentAnalysis(
            title=next((p.title for p in parts if p.title), filename),
            summary=summary[:4000],
            keywords=[w for w, _ in sorted(kw.items(), key=lambda t: (-t[1], t[0]))[:10]],
            word_count=sum(p.word_count for p in parts),
            chunk_count=len(parts),
            fields=fields,
        )
    except ValidationError as exc:
        raise PermanentError(f"model output failed validation: {exc.errors()[:3]}",
                             code="invalid_model_output") from None


def _validate(ctx: StageContext, claim: Claim, ev: Any) -> StageResult:
    chunks = ctx.store.chunks(claim.job["job_id"])
    outputs = [c["llm_output"] for c in chunks]
    analysis = merge_analyses(claim.job["filename"], outputs)
    out = analysis.model_dump(mode="json")
    return StageResult(output=out, input_hash=sha256_hex(canonical_json(outputs)),
                       code_version=VALIDATE_VERSION,
                       payload=ValidatedPayload(output_sha256=sha256_hex(canonical_json(out))))


def _publish(ctx: StageContext, claim: Claim, ev: Any) -> StageResult:
    job = claim.job
    analysis = ctx.store.stage_output(job["job_id"], "validated")
    if analysis is None:
        raise RetryableError("validated checkpoint not visible yet", code="not_ready")
    cost = float(job["cost_usd"])
    charge = ctx.settings.charge_per_job_usd
    return StageResult(
        output={"published": True}, input_hash=sha256_hex(canonical_json(analysis)),
        code_version=PUBLISH_VERSION, charge_usd=charge,
        payload=JobReadyPayload(result=DocumentAnalysis.model_validate(analysis),
                                document_sha256=job["document_sha256"],
                                filename=job["filename"], cost_usd=cost, charge_usd=charge))


@dataclass(frozen=True)
class StageSpec:
    """A stage: the event type it consumes, the checkpoint it writes, the event it emits."""

    consumes: str
    stage: str
    emits: type[BaseModel]
    work: Any


SPECS: dict[str, StageSpec] = {s.consumes: s for s in (
    StageSpec("job.accepted", "text_extracted", TextExtracted, _extract),
    StageSpec("job.text_extracted", "chunks_ready", ChunksReady, _chunk),
    StageSpec("job.chunks_ready", "llm_done", LlmDone, _llm),
    StageSpec("job.llm_done", "validated", Validated, _validate),
    StageSpec("job.validated", "published", JobReady, _publish),
)}


def run_stage(ctx: StageContext, ev: Any) -> str:
    """Process one stage event end to end; returns what happened, for logs and tests:
    ``done``, ``skipped:<reason>``, ``failed:<error code>`` or ``stale``.

    Waits (sleeping) while another run holds a live lease; a lease that expires is taken over.
    Raises :class:`RetryableError` / :class:`OutcomeUnknown` for the caller to retry later.
    """
    spec = SPECS[ev.event_type]
    group = ctx.group(spec.stage)
    while True:
        got = ctx.store.claim(job_id=ev.job_id, stage=spec.stage, group=group,
                              dedup_key=ev.dedup_key, event_type=ev.event_type,
                              event_id=ev.event_id, lease_s=ctx.settings.lease_s)
        if isinstance(got, Skip):
            return f"skipped:{got.reason}"
        if isinstance(got, LeaseHeld):
            wait = max(0.2, got.lease_until.timestamp() - time.time() + 0.1)
            log.info("stage %s of job %s is leased by another run; waiting %.1fs",
                     spec.stage, ev.job_id, wait)
            time.sleep(min(wait, 5.0))
            continue
        claim = got
        break
    common = {"tenant_id": ev.tenant_id, "idempotency_key": claim.job["idempotency_key"],
              "request_id": ev.request_id, "job_id": ev.job_id, "dedup_key": ev.dedup_key}
    try:
        result = spec.work(ctx, claim, ev)
        next_event = spec.emits(**common, payload=result.payload)
        ctx.store.complete(claim, output=result.output, input_hash=result.input_hash,
                           code_version=result.code_version, cost_usd=result.cost_usd,
                           group=group, event_type=ev.event_type, event_id=ev.event_id,
                           next_msg=outbox_message(
                               ctx.settings.topic(next_event.event_type),  # type: ignore[attr-defined]
                               next_event),
                           chunks=result.chunks, charge_usd=result.charge_usd)
        return "done"
    except PermanentError as exc:
        failed = JobFailed(**common, payload=JobFailedPayload(stage=spec.stage,
                                                              error_code=exc.code,
                                                              error=str(exc)[:4000]))
        try:
            ctx.store.fail(claim, error_code=exc.code, error=str(exc), group=group,
                           event_type=ev.event_type, event_id=ev.event_id,
                           failed_msg=outbox_message(ctx.settings.topic("job.failed"), failed))
        except StaleRun:
            return "stale"
        log.warning("job %s failed at %s: %s (%s)", ev.job_id, spec.stage, exc, exc.code)
        return f"failed:{exc.code}"
    except StaleRun as exc:
        log.warning("discarding a stale run: %s", exc)
        return "stale"
