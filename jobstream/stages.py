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

import contextlib
import logging
import os
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import psycopg
from pydantic import BaseModel, ValidationError

from jobstream import faults
from jobstream.errors import (
    JobstreamError,
    OutcomeUnknown,
    PermanentError,
    PoisonMessage,
    RetryableError,
    StaleRun,
)
from jobstream.kafka import topic_for
from jobstream.keys import canonical_json, dedup_key, request_hash, sha256_hex
from jobstream.limiter import SharedLimiter, Slot
from jobstream.llm.client import CallCancelled, ProviderClient, backoff_s
from jobstream.llm.profiles import PIPELINES, ModelProfile, get_profile, get_prompt
from jobstream.settings import Settings
from jobstream.store import (
    STAGES,
    Claim,
    Done,
    IntakeResult,
    LeaseHeld,
    OutboxMessage,
    Skip,
    Store,
    outbox_message,
)
from jobstream.textproc import (
    CHUNK_VERSION,
    EXTRACT_VERSION,
    ExtractLimits,
    chunk_text,
    extract_text,
    extractor_for,
)
from schemas.events import (
    EVENT_MODELS,
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
CODE_VERSIONS = {"text_extracted": EXTRACT_VERSION, "chunks_ready": CHUNK_VERSION,
                 "llm_done": LLM_VERSION, "validated": VALIDATE_VERSION,
                 "published": PUBLISH_VERSION}


class JobCancelled(JobstreamError):
    """The user cancelled the job; the run stops before its next provider call."""

    code = "cancelled_by_user"


class NeedsReconciliation(JobstreamError):
    """A provider call's outcome is unknown and the lane's policy is to park the job."""

    code = "outcome_unknown"


@dataclass
class StageContext:
    """What stage code needs: settings, the store, and one provider client per profile."""

    settings: Settings
    store: Store
    _clients: dict[str, ProviderClient] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _limiter: SharedLimiter | None = None

    @property
    def limiter(self) -> SharedLimiter:
        """The provider concurrency limit shared by all workers (made on first use)."""
        with self._lock:
            if self._limiter is None:
                s = self.settings
                self._limiter = SharedLimiter(self.store, max_limit=s.provider_max_concurrency,
                                              reserved=s.provider_interactive_reserved,
                                              hold_s=s.provider_timeout_s + 30)
            return self._limiter

    def code_version(self, stage: str) -> str:
        """The code version of ``stage`` in force (settings may override the built-in one)."""
        return self.settings.stage_code_versions.get(stage, CODE_VERSIONS[stage])

    def group(self, stage: str) -> str:
        """Idempotent-consumer group name of a stage (prefixed like Kafka groups)."""
        return self.settings.group(f"jobstream-{stage}")

    def client(self, profile: ModelProfile) -> ProviderClient:
        """The (cached) provider client of ``profile``; base URL/key overridable by settings."""
        with self._lock:
            if profile.name not in self._clients:
                base = self.settings.provider_base_url if profile.base_url else None
                secret = self.settings.provider_api_key
                key = (secret.get_secret_value() if secret else None) or (
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
    rh = request_hash(document_hash=actual, pipeline=p.pipeline, prompt_version=p.prompt_version,
                      model_profile=p.model_profile, lane=p.lane, filename=p.document.filename,
                      content_type=p.document.content_type)
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

    extra = [_msg(ctx, ev)] if emit_uploaded else []
    return ctx.store.intake(tenant_id=ev.tenant_id, idempotency_key=ev.idempotency_key,
                            request_hash=rh, request_id=ev.request_id, job=job, content=content,
                            accepted=accepted, topic=ctx.settings.topic("job.accepted"),
                            conn=conn, extra=extra, restart=restart)


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
    # The job's content type picks the extractor (part of its dedup key): the same bytes may
    # be stored once for another job that sent them as another type.
    content, _ = ctx.store.document(job["tenant_id"], job["document_sha256"])
    s = ctx.settings
    ex = extract_text(content, job["content_type"], ExtractLimits(
        max_pages=s.extract_max_pages, max_text_chars=s.extract_max_text_chars,
        max_stream_bytes=s.extract_max_stream_bytes,
        max_memory_bytes=s.extract_max_memory_bytes, timeout_s=s.extract_timeout_s))
    return StageResult(
        output={"text": ex.text, "page_count": ex.page_count},
        input_hash=job["document_sha256"], code_version=ctx.code_version("text_extracted"),
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
        input_hash=sha256_hex(text), code_version=ctx.code_version("chunks_ready"),
        chunks=rows,
        payload=ChunksReadyPayload(chunk_count=len(rows), chunks_sha256=digest))


def _check_budget(ctx: StageContext, claim: Claim, chunk_idx: int) -> int:
    """Enforce the job's provider budget: attempts per chunk (over every retry round) AND the
    job's deadline AND its cost cap. Returns the number of the next attempt. Raises
    :class:`PermanentError` ``retry_budget_exhausted``, ``deadline_exceeded`` or
    ``cost_cap_exceeded``."""
    s = ctx.settings
    job = claim.job
    done = ctx.store.chunk_attempts(job["job_id"], claim.stage, chunk_idx)
    if done >= s.provider_budget_attempts:
        raise PermanentError(f"chunk {chunk_idx}: {done} provider attempts, budget "
                             f"{s.provider_budget_attempts}", code="retry_budget_exhausted")
    age_s = time.time() - job["created_at"].timestamp()
    if age_s > s.job_deadline_s:
        raise PermanentError(f"job is {age_s:.0f}s old, deadline {s.job_deadline_s:.0f}s",
                             code="deadline_exceeded")
    spent = ctx.store.job_provider_cost(job["job_id"])
    if spent >= s.provider_cost_cap_usd and (spent > 0 or s.provider_cost_cap_usd == 0):
        raise PermanentError(f"provider cost cap reached: {spent:.6f} USD spent, cap "
                             f"{s.provider_cost_cap_usd:.6f} USD", code="cost_cap_exceeded")
    return done + 1


class Heartbeat:
    """Keeps a run's lease alive while it waits on the provider (a call in flight, a
    Retry-After or backoff wait): :meth:`beat` renews the lease every
    ``settings.heartbeat_s`` seconds; when the renewal finds the run fenced (taken over, or
    the job re-driven) :attr:`fenced` turns True and the call in flight is aborted.

    ``should_abort()`` is the provider client's poll (every 0.5 s during a call): it beats and
    answers True when the run is fenced or the job's cancel was requested.
    """

    def __init__(self, ctx: StageContext, claim: Claim) -> None:
        self.ctx = ctx
        self.claim = claim
        self.fenced = False
        self._last = time.monotonic()

    def beat(self) -> None:
        """Renew the lease if a heartbeat is due. Raises :class:`StaleRun` once fenced."""
        if self.fenced:
            raise StaleRun(f"stage {self.claim.stage} of job {self.claim.job['job_id']}: "
                           "the run was fenced off during a provider wait")
        if time.monotonic() - self._last < self.ctx.settings.heartbeat_s:
            return
        try:
            self.ctx.store.renew_lease(self.claim, self.ctx.settings.lease_s)
        except StaleRun:
            self.fenced = True
            raise
        except RetryableError as exc:  # Postgres away for a moment: the lease has slack
            log.warning("lease heartbeat of job %s failed: %s", self.claim.job["job_id"], exc)
            return
        self._last = time.monotonic()

    def should_abort(self) -> bool:
        """The provider call's poll: True when the run is fenced or the job cancelled."""
        try:
            self.beat()
        except StaleRun:
            return True
        return self.ctx.store.cancel_requested(self.claim.job["job_id"])

    def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` (a Retry-After or backoff), beating meanwhile. Raises
        :class:`StaleRun` when the run is fenced during the wait."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            time.sleep(min(left, 0.5))
            self.beat()


#: A rough completion size (tokens) for an attempt's cost estimate.
EST_COMPLETION_TOKENS = 512


def estimate_cost_usd(profile: ModelProfile, prompt: str, text: str) -> float:
    """What one attempt costs if the provider does the work (USD): prompt tokens estimated at
    4 characters each, plus :data:`EST_COMPLETION_TOKENS`. Billed for ``abandoned`` attempts."""
    return profile.cost_usd((len(prompt) + len(text)) // 4 + 1, EST_COMPLETION_TOKENS)


def _call_provider(ctx: StageContext, claim: Claim, profile: ModelProfile, prompt: str,
                   chunk: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """One chunk through the provider: up to ``provider_max_attempts`` in-process attempts
    (within ``provider_deadline_s`` seconds) with full-jitter backoff honouring Retry-After,
    each checked against the job's budget (:func:`_check_budget`).

    Every attempt is a ``provider_attempt`` row committed before the request is sent; a
    success is recorded together with the chunk's output (one transaction). Returns
    ``(model output, attempt_id)``. Raises :class:`PermanentError` (provider said no, or the
    budget is spent), :class:`NeedsReconciliation` (unknown outcome, lane policy
    ``reconcile``) or :class:`RetryableError` ``provider_unavailable`` when the in-process
    attempts ran out (the stage event then goes through the ``.retry`` topic).
    """
    s = ctx.settings
    client = ctx.client(profile)
    deadline = time.monotonic() + s.provider_deadline_s
    policy = s.outcome_unknown_policy.get(claim.job["lane"], "retry")
    last: Exception | None = None
    retry_after: float | None = None
    # Remote calls poll while in flight: the heartbeat renews the lease (so a call longer
    # than the lease is not taken over and bought twice) and aborts the call once the run is
    # fenced or the job cancelled. The local model answers at once.
    hb = Heartbeat(ctx, claim)
    abort = hb.should_abort if profile.base_url else None
    est = estimate_cost_usd(profile, prompt, chunk["text"])
    for round_attempt in range(1, s.provider_max_attempts + 1):
        ctx.store.renew_lease(claim, s.lease_s)
        attempt = _check_budget(ctx, claim, chunk["idx"])
        slot = _take_slot(ctx, claim, profile) if profile.base_url else None
        outcome = "other"
        try:
            attempt_id = ctx.store.start_attempt(claim, chunk_idx=chunk["idx"],
                                                 attempt=attempt, model=client.model,
                                                 est_cost_usd=est)
            if attempt_id is None:
                raise JobCancelled("cancelled before the next provider call")
            done, outcome, wait, last, retry_after = _one_attempt(
                ctx, claim, client, profile, prompt, chunk, attempt_id, abort, policy,
                round_attempt, retry_after, last, hb)
        finally:
            if slot is not None:
                ctx.limiter.release(slot, outcome)
        if done is not None:
            return done
        if round_attempt == s.provider_max_attempts or time.monotonic() + wait > deadline:
            break
        log.info("provider attempt %d for job %s chunk %d failed (%s); retrying in %.2fs",
                 attempt, claim.job["job_id"], chunk["idx"], last, wait)
        hb.sleep(wait)  # a Retry-After may outlast the lease: keep it alive meanwhile
    raise RetryableError(f"provider still failing after {round_attempt} attempts: {last}",
                         code="provider_unavailable", retry_after_s=retry_after)


def _take_slot(ctx: StageContext, claim: Claim, profile: ModelProfile) -> Slot:
    """Wait for a slot of the shared limit, renewing the lease and honouring a cancel."""
    job_id = claim.job["job_id"]
    last_renew = time.monotonic()

    def on_wait() -> None:
        nonlocal last_renew
        if time.monotonic() - last_renew > ctx.settings.lease_s / 3:
            ctx.store.renew_lease(claim, ctx.settings.lease_s)
            if ctx.store.cancel_requested(job_id):
                raise JobCancelled("cancelled while waiting for a provider slot")
            last_renew = time.monotonic()

    return ctx.limiter.acquire(profile.name, claim.job["lane"], job_id,
                               timeout_s=ctx.settings.provider_deadline_s, on_wait=on_wait)


def _one_attempt(ctx: StageContext, claim: Claim, client: ProviderClient, profile: ModelProfile,
                 prompt: str, chunk: dict[str, Any], attempt_id: int, abort: Any, policy: str,
                 round_attempt: int, retry_after: float | None, last: Exception | None,
                 hb: Heartbeat | None = None
                 ) -> tuple[Any, str, float, Exception | None, float | None]:
    """One provider request and its record. Returns ``(answer or None, limiter outcome,
    wait before the next attempt (s), last error, retry_after)``; raises what must end the
    stage run (permanent, cancelled, needs reconciliation)."""
    s = ctx.settings
    job_id = claim.job["job_id"]
    try:
        done = client.complete(prompt, chunk["text"],
                               idempotency_key=f"{job_id}:{chunk['idx']}",
                               should_abort=abort)
    except CallCancelled as exc:
        if hb is not None and hb.fenced:
            # Fenced mid-call: the answer could not be used any more. The provider may still
            # do (and bill) the work: an unknown outcome, billed at the estimate.
            ctx.store.close_attempt(attempt_id)
            raise StaleRun(f"chunk {chunk['idx']}: run fenced off during the provider call; "
                           "call stopped") from None
        # "External call cancelled": a fact of the attempt, not of the job.
        ctx.store.finish_attempt(attempt_id, outcome="cancelled", error=str(exc))
        raise JobCancelled(f"chunk {chunk['idx']}: {exc}") from None
    except RetryableError as exc:
        ctx.store.finish_attempt(attempt_id, outcome="transient_error", error=str(exc),
                                 status_code=_status_of(exc))
        wait = max(exc.retry_after_s or 0.0, backoff_s(
            round_attempt - 1, s.provider_backoff_base_s, s.provider_backoff_cap_s))
        return None, exc.code, wait, exc, exc.retry_after_s
    except OutcomeUnknown as exc:
        # Never recorded as a failure: the provider may have done (and billed) the work.
        ctx.store.finish_attempt(attempt_id, outcome="outcome_unknown", error=str(exc))
        if policy != "retry":
            raise NeedsReconciliation(f"chunk {chunk['idx']}: {exc}") from None
        # Interactive: retry (the Idempotency-Key header lets a provider dedupe it).
        wait = backoff_s(round_attempt - 1, s.provider_backoff_base_s,
                         s.provider_backoff_cap_s)
        return None, "outcome_unknown", wait, exc, retry_after
    except PermanentError as exc:
        ctx.store.finish_attempt(attempt_id, outcome="permanent_error", error=str(exc),
                                 status_code=_status_of(exc))
        raise
    cost = profile.cost_usd(done.prompt_tokens, done.completion_tokens)
    faults.point("llm_chunk_answered_before_save")
    # The attempt's success and the chunk's output in ONE transaction: a crash between two
    # would leave an answered chunk without output, and the retry would pay for it again.
    ctx.store.succeed_chunk_attempt(claim, attempt_id, idx=chunk["idx"], output=done.content,
                                    status_code=done.status_code, latency_ms=done.latency_ms,
                                    prompt_tokens=done.prompt_tokens,
                                    completion_tokens=done.completion_tokens, cost_usd=cost)
    return (done.content, attempt_id), "succeeded", 0.0, last, retry_after


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
        if ctx.store.cancel_requested(job["job_id"]):
            raise JobCancelled("cancelled before the next provider call")
        _call_provider(ctx, claim, profile, prompt, ch)  # stores the chunk's output
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
        code_version=ctx.code_version("llm_done"), cost_usd=cost,
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
                       code_version=ctx.code_version("validated"),
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
        code_version=ctx.code_version("published"), charge_usd=charge,
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
    ``done``, ``reused`` (re-emitted a finished checkpoint after a redrive),
    ``skipped:<reason>``, ``failed:<error code>``, ``parked``, ``cancelled`` or ``stale``.

    Waits (sleeping) while another run holds a live lease; a lease that expires is taken over.
    Raises :class:`RetryableError` / :class:`OutcomeUnknown` for the caller to retry later.
    """
    spec = SPECS[ev.event_type]
    group = ctx.group(spec.stage)
    common = {"tenant_id": ev.tenant_id, "request_id": ev.request_id, "job_id": ev.job_id,
              "dedup_key": ev.dedup_key, "generation": ev.generation}
    while True:
        got = ctx.store.claim(job_id=ev.job_id, stage=spec.stage, group=group,
                              dedup_key=ev.dedup_key, event_type=ev.event_type,
                              event_id=ev.event_id, lease_s=ctx.settings.lease_s,
                              code_version=ctx.code_version(spec.stage),
                              generation=ev.generation)
        if isinstance(got, Skip):
            if got.reason == "unknown_job":  # no job ever had this id: not our event
                raise PoisonMessage(f"no job {ev.job_id}", code="unknown_job")
            return f"skipped:{got.reason}"
        if isinstance(got, Done):
            nxt = spec.emits(**common, idempotency_key=got.job["idempotency_key"],
                             payload=got.emitted)
            ok = ctx.store.reemit(job=got.job, group=group, event_type=ev.event_type,
                                  event_id=ev.event_id, next_msg=_msg(ctx, nxt, got.job["lane"]),
                                  final=spec.stage == STAGES[-1])
            return "reused" if ok else "skipped:duplicate"
        if isinstance(got, LeaseHeld):
            wait = max(0.2, got.lease_until.timestamp() - time.time() + 0.1)
            log.info("stage %s of job %s is leased by another run; waiting %.1fs",
                     spec.stage, ev.job_id, wait)
            time.sleep(min(wait, 5.0))
            continue
        claim = got
        break
    common["idempotency_key"] = claim.job["idempotency_key"]
    later = STAGES[STAGES.index(spec.stage) + 1:]
    try:
        try:
            result = spec.work(ctx, claim, ev)
            next_event = spec.emits(**common, payload=result.payload)
            ctx.store.complete(claim, output=result.output, input_hash=result.input_hash,
                               code_version=result.code_version, cost_usd=result.cost_usd,
                               group=group, event_type=ev.event_type, event_id=ev.event_id,
                               next_msg=_msg(ctx, next_event, claim.job["lane"]),
                               chunks=result.chunks, charge_usd=result.charge_usd,
                               later_stages=later)
        except (RetryableError, OutcomeUnknown) as exc:
            # Give the stage back so the retry claims it at once instead of waiting for this
            # run's lease; then let the caller retry. Also when the completing transaction
            # itself failed (Postgres restarting, a serialization failure): it rolled back, or
            # it committed and the fenced release finds the stage succeeded and changes nothing.
            with contextlib.suppress(RetryableError):
                ctx.store.release(claim, error_code=exc.code, error=str(exc))
            raise
        return "done"
    except JobCancelled:
        try:
            ctx.store.cancel_run(claim, group=group, event_type=ev.event_type,
                                 event_id=ev.event_id)
        except StaleRun:
            return "stale"
        return "cancelled"
    except NeedsReconciliation as exc:
        try:
            ctx.store.park(claim, error_code=exc.code, error=str(exc), group=group,
                           event_type=ev.event_type, event_id=ev.event_id)
        except StaleRun:
            return "stale"
        log.warning("job %s parked at %s: %s", ev.job_id, spec.stage, exc)
        return "parked"
    except PermanentError as exc:
        failed = JobFailed(**common, payload=JobFailedPayload(stage=spec.stage,
                                                              error_code=exc.code,
                                                              error=str(exc)[:4000]))
        try:
            ctx.store.fail(claim, error_code=exc.code, error=str(exc), group=group,
                           event_type=ev.event_type, event_id=ev.event_id,
                           failed_msg=_msg(ctx, failed))
        except StaleRun:
            return "stale"
        log.warning("job %s failed at %s: %s (%s)", ev.job_id, spec.stage, exc, exc.code)
        return f"failed:{exc.code}"
    except StaleRun as exc:
        log.warning("discarding a stale run: %s", exc)
        return "stale"
    except (RetryableError, OutcomeUnknown):
        raise  # the stage was given back (released) above; the caller retries
    except Exception as exc:
        _end_run(ctx, claim, ev, group, common, exc)
        raise


def _end_run(ctx: StageContext, claim: Claim, ev: Any, group: str, common: dict[str, Any],
             exc: Exception) -> None:
    """A run that ended in an error nothing handles (a bug: ``internal_error``) or in poison
    found after the claim (e.g. ``invalid_data``): end the stage and fail the job at once, with
    a ``job.failed`` event (fenced by the run token), instead of leaving the stage ``running``
    for the sweeper. The caller re-raises: the message is dead-lettered."""
    code = exc.code if isinstance(exc, PoisonMessage) else "internal_error"
    if isinstance(exc, psycopg.DataError | UnicodeEncodeError):
        code = "invalid_data"
    error = f"{type(exc).__name__}: {exc}"[:4000].replace("\x00", "\\x00")
    failed = JobFailed(**common, payload=JobFailedPayload(stage=claim.stage, error_code=code,
                                                          error=error))
    try:
        ctx.store.fail(claim, error_code=code, error=error, group=group,
                       event_type=ev.event_type, event_id=ev.event_id,
                       failed_msg=_msg(ctx, failed))
        log.error("job %s failed at %s: %s (%s)", ev.job_id, claim.stage, error, code)
    except StaleRun:
        pass
    except Exception as fail_exc:  # noqa: BLE001 - the original error is what gets raised
        log.error("could not fail job %s after %s: %s", ev.job_id, code, fail_exc)


def _msg(ctx: StageContext, event: Any, lane: str | None = None) -> OutboxMessage:
    """The outbox row of ``event``, on the topic of the job's ``lane`` (see LANE_TOPICS)."""
    return outbox_message(ctx.settings.topic(topic_for(event.event_type, lane)), event)


#: The event type each checkpoint's stage consumes, and the stage before it.
CONSUMES = {spec.stage: spec.consumes for spec in SPECS.values()}


def redrive(ctx: StageContext, job_id: uuid.UUID, from_stage: str | None = None,
            allowed: tuple[str, ...] = ("failed", "needs_reconciliation", "succeeded"),
            fence: tuple[str, uuid.UUID, float] | None = None,
            conn: Any = None) -> str:
    """Send a job through its stages again from ``from_stage`` (default: the first stage that
    is not succeeded, else the first stage). Finished stages whose code version is unchanged are
    re-emitted, not redone; a stage that re-runs invalidates the stages after it. A result that
    was already applied downstream is not applied again (same dedup_key).

    Runs of the re-driven stages still in progress are fenced at once (see
    :meth:`Store.redrive`); ``fence=(stage, run_token, grace_s)`` is the sweeper's re-check.

    Returns the stage the job restarts at. Raises ``KeyError`` (no job / unknown stage),
    ``ValueError`` (job status not in ``allowed``, or nothing to restart from) and
    :class:`StaleRun` (``fence`` no longer holds). ``conn``: re-drive in the caller's
    transaction (intake's new run of a failed or cancelled job).
    """
    def plan(job: dict[str, Any], rows: dict[str, Any]) -> tuple[Any, ...]:
        nonlocal from_stage
        if from_stage is None:
            from_stage = next((st for st in STAGES[1:]
                               if rows.get(st, {}).get("status") != "succeeded"), STAGES[1])
        if from_stage not in CONSUMES:
            raise KeyError(f"unknown stage {from_stage!r}; stages: {list(CONSUMES)}")
        prev = rows.get(STAGES[STAGES.index(from_stage) - 1])
        if prev is None or prev["status"] != "succeeded" or prev["emitted"] is None:
            raise ValueError(f"stage before {from_stage} has no checkpoint to restart from")
        model = EVENT_MODELS[CONSUMES[from_stage]]
        ev = model(tenant_id=job["tenant_id"], idempotency_key=job["idempotency_key"],
                   job_id=job["job_id"], dedup_key=job["dedup_key"],
                   request_id=job["request_id"], generation=job["generation"] + 1,
                   payload=prev["emitted"])
        stages_from = list(STAGES[STAGES.index(from_stage):])
        return (_msg(ctx, ev, job["lane"]), stages_from, [ctx.group(st) for st in stages_from],
                [CONSUMES[st] for st in stages_from])

    ctx.store.redrive(job_id, plan=plan, allowed=allowed, fence=fence, conn=conn)
    assert from_stage is not None
    return from_stage


def reconcile(ctx: StageContext, job_id: uuid.UUID, resolution: str) -> str:
    """Resolve a job parked in ``needs_reconciliation``: ``retry`` re-drives the parked stage
    (chunks already answered are not sent again); ``fail`` ends the job ``failed`` with a
    ``job.failed`` event. Returns a one-line description. Raises ``ValueError``."""
    job = ctx.store.job(job_id)
    if job is None or job["status"] != "needs_reconciliation":
        raise ValueError(f"job {job_id} does not need reconciliation")
    if resolution == "retry":
        stage = redrive(ctx, job_id, allowed=("needs_reconciliation",))
        return f"job {job_id} re-driven from {stage}"
    if resolution == "fail":
        ev = JobFailed(tenant_id=job["tenant_id"], idempotency_key=job["idempotency_key"],
                       job_id=job_id, dedup_key=job["dedup_key"], request_id=job["request_id"],
                       generation=job["generation"],
                       payload=JobFailedPayload(stage=job["current_stage"],
                                                error_code="outcome_unknown_unresolved",
                                                error="resolved as failed by an operator"))
        ctx.store.fail_parked(job_id, error_code="outcome_unknown_unresolved",
                              error="resolved as failed by an operator",
                              failed_msg=_msg(ctx, ev))
        return f"job {job_id} failed"
    raise ValueError(f"resolution must be retry or fail, not {resolution!r}")


def give_up(ctx: StageContext, ev: Any, error_code: str, error: str) -> bool:
    """Fail the job of a stage event whose retry budget is spent (``job.failed``). Returns False
    when the job was already terminal. Raises :class:`RetryableError` if Postgres is down."""
    spec = SPECS[ev.event_type]
    job = ctx.store.job(ev.job_id)
    if job is None:
        return False
    failed = JobFailed(tenant_id=ev.tenant_id, idempotency_key=job["idempotency_key"],
                       request_id=ev.request_id, job_id=ev.job_id, dedup_key=ev.dedup_key,
                       generation=ev.generation,
                       payload=JobFailedPayload(stage=spec.stage, error_code=error_code,
                                                error=error[:4000]))
    return ctx.store.give_up(job_id=ev.job_id, stage=spec.stage, error_code=error_code,
                             error=error, group=ctx.group(spec.stage), event_type=ev.event_type,
                             event_id=ev.event_id, dedup_key=ev.dedup_key,
                             failed_msg=_msg(ctx, failed))


def sweep(ctx: StageContext) -> list[str]:
    """Un-stick jobs, idempotently: every stage whose lease expired more than
    ``sweep_grace_s`` ago (times ``2 ** sweeps`` of its job: a per-job backoff) is re-driven
    ONCE: the re-drive re-checks, in its own transaction, that the run it saw still owns the
    stage under an expired lease, fences that run (stage back to pending, new generation) and
    writes the stage's input event to the outbox again. A run that renewed its lease, was taken
    over or was already re-driven is left alone. After ``max_stage_attempts`` runs (every claim
    counts one, a re-driven run included) the stage and job fail with
    ``stage_attempts_exhausted`` instead. Finally, orphan provider attempts are closed
    ``abandoned`` (:meth:`Store.close_orphans`).

    Returns one line per action. A crash or a pause must never leave a job stuck forever.
    Raises :class:`RetryableError` when Postgres is unavailable.
    """
    actions = []
    grace = ctx.settings.sweep_grace_s
    for row in ctx.store.expired_leases(grace):
        job_id, stage, seen = row["job_id"], row["stage"], row["run_token"]
        try:
            if row["attempt"] >= ctx.settings.max_stage_attempts:
                job = ctx.store.job(job_id)
                assert job is not None
                error = f"{row['attempt']} runs of {stage} died or hung"
                ev = JobFailed(tenant_id=job["tenant_id"], idempotency_key=job["idempotency_key"],
                               job_id=job_id, dedup_key=job["dedup_key"],
                               request_id=job["request_id"], generation=job["generation"],
                               payload=JobFailedPayload(stage=stage,
                                                        error_code="stage_attempts_exhausted",
                                                        error=error))
                ctx.store.fail_expired(job_id, stage=stage, run_token=seen, grace_s=grace,
                                       error_code="stage_attempts_exhausted", error=error,
                                       failed_msg=_msg(ctx, ev))
                actions.append(f"failed {job_id} at {stage}")
            else:
                redrive(ctx, job_id, from_stage=stage, allowed=("queued", "running"),
                        fence=(stage, seen, grace))
                actions.append(f"re-drove {job_id} from {stage}")
        except (StaleRun, ValueError, KeyError) as exc:
            log.info("sweeper skipped %s/%s: %s", job_id, stage, exc)
        except RetryableError as exc:  # a row lock held too long (lock_timeout): next pass
            log.warning("sweeper postponed %s/%s: %s", job_id, stage, exc)
    try:
        if closed := ctx.store.close_orphans():
            actions.append(f"closed {closed} orphan provider attempts (abandoned)")
    except RetryableError as exc:
        log.warning("sweeper postponed closing orphan attempts: %s", exc)
    return actions
