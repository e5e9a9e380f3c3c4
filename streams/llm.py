"""Stage ``llm``: ``job.chunks_ready`` (``job.chunks_ready.batch`` for the batch lane) -> one
provider call per chunk, each attempt a ``provider_attempt`` row committed before the request
-> checkpoint ``llm`` -> ``job.llm_done``. A job on the in-process ``local`` profile claims,
answers and completes in ONE transaction, shared with other events of the agent (group commit,
``llm_local_one_transaction``); a remote provider's job keeps its claim transaction, lease and
shared limit.

The attempt loop lives here: in-process attempts with full-jitter backoff honouring
Retry-After, the job's budget (attempts per chunk, deadline, cost cap) checked before each,
a slot of the shared provider limit per remote call, and a :class:`Heartbeat` that keeps the
lease alive during provider waits and aborts the call once the run is fenced or cancelled.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from jobstream import faults
from jobstream.errors import OutcomeUnknown, PermanentError, RetryableError, StaleRun
from jobstream.keys import canonical_json, sha256_hex
from jobstream.limiter import Slot
from jobstream.llm.client import CallCancelled, ProviderClient, backoff_s
from jobstream.llm.profiles import ModelProfile, get_profile, get_prompt
from jobstream.store import ChunkRow, Claim, LocalAnswer
from schemas.events import LlmDonePayload
from schemas.pipeline import PIPELINE
from streams.context import JobCancelled, NeedsReconciliation, StageContext, StageResult
from streams.runner import register_stage

if TYPE_CHECKING:
    from datetime import datetime

    import faust

    from jobstream.settings import Settings

log = logging.getLogger("jobstream.streams")

STAGE = PIPELINE.stage("llm")
#: What the claim transaction reads for this stage (``Store.claim``'s ``reads``): the chunks
#: and the provider budget used so far (for the in-process model's budget checks).
READS = ("chunks", "budget")


def _enforce_budget(s: Settings, chunk_idx: int, done: int, created_at: datetime,
                    spent: float) -> None:
    """The job's provider budget, from figures already read: ``done`` attempts of this chunk
    (over every retry round) against ``provider_budget_attempts``, the job's age (seconds since
    ``created_at``) against ``job_deadline_s``, and ``spent`` (USD) against
    ``provider_cost_cap_usd``. Raises :class:`PermanentError` ``retry_budget_exhausted``,
    ``deadline_exceeded`` or ``cost_cap_exceeded``."""
    if done >= s.provider_budget_attempts:
        raise PermanentError(f"chunk {chunk_idx}: {done} provider attempts, budget "
                             f"{s.provider_budget_attempts}", code="retry_budget_exhausted")
    age_s = time.time() - created_at.timestamp()
    if age_s > s.job_deadline_s:
        raise PermanentError(f"job is {age_s:.0f}s old, deadline {s.job_deadline_s:.0f}s",
                             code="deadline_exceeded")
    if spent >= s.provider_cost_cap_usd and (spent > 0 or s.provider_cost_cap_usd == 0):
        raise PermanentError(f"provider cost cap reached: {spent:.6f} USD spent, cap "
                             f"{s.provider_cost_cap_usd:.6f} USD", code="cost_cap_exceeded")


def _check_budget(ctx: StageContext, claim: Claim, chunk_idx: int) -> int:
    """Enforce the job's provider budget (:func:`_enforce_budget`) from the store's current
    figures. Returns the number of the next attempt. Raises :class:`PermanentError`."""
    job = claim.job
    done = ctx.store.chunk_attempts(job.job_id, claim.stage, chunk_idx)
    _enforce_budget(ctx.settings, chunk_idx, done, job.created_at,
                    ctx.store.job_provider_cost(job.job_id))
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
            raise StaleRun(f"stage {self.claim.stage} of job {self.claim.job.job_id}: "
                           "the run was fenced off during a provider wait")
        if time.monotonic() - self._last < self.ctx.settings.heartbeat_s:
            return
        try:
            self.ctx.store.renew_lease(self.claim, self.ctx.settings.lease_s)
        except StaleRun:
            self.fenced = True
            raise
        except RetryableError as exc:  # Postgres away for a moment: the lease has slack
            log.warning("lease heartbeat of job %s failed: %s", self.claim.job.job_id, exc)
            return
        self._last = time.monotonic()

    def should_abort(self) -> bool:
        """The provider call's poll: True when the run is fenced or the job cancelled."""
        try:
            self.beat()
        except StaleRun:
            return True
        return self.ctx.store.cancel_requested(self.claim.job.job_id)

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
                   chunk: ChunkRow) -> tuple[dict[str, Any], int]:
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
    policy = s.outcome_unknown_policy.get(claim.job.lane, "retry")
    last: Exception | None = None
    retry_after: float | None = None
    # Remote calls poll while in flight: the heartbeat renews the lease (so a call longer
    # than the lease is not taken over and bought twice) and aborts the call once the run is
    # fenced or the job cancelled. The local model answers at once.
    hb = Heartbeat(ctx, claim)
    abort = hb.should_abort if profile.base_url else None
    est = estimate_cost_usd(profile, prompt, chunk.text)
    for round_attempt in range(1, s.provider_max_attempts + 1):
        ctx.store.renew_lease(claim, s.lease_s)
        attempt = _check_budget(ctx, claim, chunk.idx)
        slot = _take_slot(ctx, claim, profile) if profile.base_url else None
        outcome = "other"
        try:
            attempt_id = ctx.store.start_attempt(claim, chunk_idx=chunk.idx,
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
                 attempt, claim.job.job_id, chunk.idx, last, wait)
        hb.sleep(wait)  # a Retry-After may outlast the lease: keep it alive meanwhile
    raise RetryableError(f"provider still failing after {round_attempt} attempts: {last}",
                         code="provider_unavailable", retry_after_s=retry_after)


def _take_slot(ctx: StageContext, claim: Claim, profile: ModelProfile) -> Slot:
    """Wait for a slot of the shared limit, renewing the lease and honouring a cancel."""
    job_id = claim.job.job_id
    last_renew = time.monotonic()

    def on_wait() -> None:
        nonlocal last_renew
        if time.monotonic() - last_renew > ctx.settings.lease_s / 3:
            ctx.store.renew_lease(claim, ctx.settings.lease_s)
            if ctx.store.cancel_requested(job_id):
                raise JobCancelled("cancelled while waiting for a provider slot")
            last_renew = time.monotonic()

    return ctx.limiter.acquire(profile.name, claim.job.lane, job_id,
                               timeout_s=ctx.settings.provider_deadline_s, on_wait=on_wait)


def _one_attempt(ctx: StageContext, claim: Claim, client: ProviderClient, profile: ModelProfile,
                 prompt: str, chunk: ChunkRow, attempt_id: int, abort: Any, policy: str,
                 round_attempt: int, retry_after: float | None, last: Exception | None,
                 hb: Heartbeat | None = None
                 ) -> tuple[tuple[dict[str, Any], int] | None, str, float, Exception | None,
                            float | None]:
    """One provider request and its record. Returns ``(answer or None, limiter outcome,
    wait before the next attempt (s), last error, retry_after)``; raises what must end the
    stage run (permanent, cancelled, needs reconciliation)."""
    s = ctx.settings
    job_id = claim.job.job_id
    try:
        done = client.complete(prompt, chunk.text,
                               idempotency_key=f"{job_id}:{chunk.idx}",
                               should_abort=abort)
    except CallCancelled as exc:
        if hb is not None and hb.fenced:
            # Fenced mid-call: the answer could not be used any more. The provider may still
            # do (and bill) the work: an unknown outcome, billed at the estimate.
            ctx.store.close_attempt(attempt_id)
            raise StaleRun(f"chunk {chunk.idx}: run fenced off during the provider call; "
                           "call stopped") from None
        # "External call cancelled": a fact of the attempt, not of the job.
        ctx.store.finish_attempt(attempt_id, outcome="cancelled", error=str(exc))
        raise JobCancelled(f"chunk {chunk.idx}: {exc}") from None
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
            raise NeedsReconciliation(f"chunk {chunk.idx}: {exc}") from None
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
    ctx.store.succeed_chunk_attempt(claim, attempt_id, idx=chunk.idx, output=done.content,
                                    status_code=done.status_code, latency_ms=done.latency_ms,
                                    prompt_tokens=done.prompt_tokens,
                                    completion_tokens=done.completion_tokens, cost_usd=cost)
    return (done.content, attempt_id), "succeeded", 0.0, last, retry_after


def _status_of(exc: Exception) -> int | None:
    code = getattr(exc, "code", "")
    return int(code[5:]) if code.startswith("http_") and code[5:].isdigit() else None


def work(ctx: StageContext, claim: Claim, ev: Any) -> StageResult:
    """The llm checkpoint: every chunk answered by the job's model profile (each answer paid
    for once over all runs). A remote provider goes through :func:`_call_provider` (attempt
    rows committed before each request); the in-process model through :func:`_work_local`.
    Raises :class:`RetryableError` ``not_ready`` while the chunks are not visible."""
    job = claim.job
    profile = get_profile(job.model_profile)
    prompt = get_prompt(job.prompt_version)
    chunks = claim.inputs.chunks
    if chunks is None:
        chunks = tuple(ctx.store.chunks(job.job_id))
    if not chunks:
        raise RetryableError("chunks not visible yet", code="not_ready")
    if profile.base_url is None:
        return _work_local(ctx, claim, profile, prompt, chunks)
    for ch in chunks:
        if ch.llm_output is not None:
            continue  # answered in an earlier run of this stage: never paid for twice
        if ctx.store.cancel_requested(job.job_id):
            raise JobCancelled("cancelled before the next provider call")
        _call_provider(ctx, claim, profile, prompt, ch)  # stores the chunk's output
    faults.point("llm_after_provider_before_checkpoint")
    outputs = [c.llm_output for c in ctx.store.chunks(job.job_id)]
    if any(o is None for o in outputs):
        raise StaleRun("a chunk lost its output: a newer run owns the stage")
    # Every run's attempts: a run that resumes after a crash reports what the stage cost,
    # not only its own (possibly zero) calls.
    cost, attempts = ctx.store.stage_provider_cost(job.job_id, STAGE.name)
    return _result(ctx, chunks, profile, outputs, cost, attempts)


def _result(ctx: StageContext, chunks: tuple[ChunkRow, ...], profile: ModelProfile,
            outputs: list[Any], cost: float, attempts: int,
            answers: tuple[LocalAnswer, ...] = ()) -> StageResult:
    digest = sha256_hex(canonical_json(outputs))
    return StageResult(
        output={"chunk_count": len(outputs), "output_sha256": digest, "model": profile.model,
                "provider_attempts": attempts},
        input_hash=sha256_hex(canonical_json([c.text_sha256 for c in chunks])),
        code_version=ctx.code_version(STAGE.name), cost_usd=cost, local_answers=answers,
        payload=LlmDonePayload(chunk_count=len(outputs), output_sha256=digest,
                               provider_calls=attempts, reused=attempts == 0, cost_usd=cost))


def _work_local(ctx: StageContext, claim: Claim, profile: ModelProfile, prompt: str,
                chunks: tuple[ChunkRow, ...]) -> StageResult:
    """The llm stage on the in-process model (no remote provider: nothing is sent or billed
    outside the process). No attempt row before the call, no lease renewal, no cancel poll,
    no shared-limit slot: the answers are recorded (``succeeded`` attempts with the chunks'
    outputs, fenced by run token and generation) by the completion transaction, and a crash
    before it loses only local CPU work. The budget (attempts per chunk, deadline, cost cap)
    is checked as on the remote path, from what the claim read. Raises
    :class:`PermanentError` (budget spent, or a malformed answer)."""
    s = ctx.settings
    job = claim.job
    budget = claim.inputs.budget or ctx.store.provider_budget(job.job_id, claim.stage)
    client = ctx.client(profile)
    spent = budget.job_cost_usd
    cost, attempts = budget.stage_cost_usd, budget.stage_attempts
    outputs: list[Any] = []
    answers: list[LocalAnswer] = []
    for ch in chunks:
        if ch.llm_output is not None:
            outputs.append(ch.llm_output)
            continue
        done = budget.chunk_attempts.get(ch.idx, 0)
        _enforce_budget(s, ch.idx, done, job.created_at, spent)
        answer = client.complete(prompt, ch.text, idempotency_key=f"{job.job_id}:{ch.idx}")
        price = profile.cost_usd(answer.prompt_tokens, answer.completion_tokens)
        spent += price
        cost += price
        attempts += 1
        outputs.append(answer.content)
        answers.append(LocalAnswer(
            idx=ch.idx, attempt=done + 1, model=client.model, output=answer.content,
            latency_ms=answer.latency_ms, prompt_tokens=answer.prompt_tokens,
            completion_tokens=answer.completion_tokens, cost_usd=price))
    return _result(ctx, chunks, profile, outputs, cost, attempts, tuple(answers))


def one_transaction(ctx: StageContext, ev: Any) -> bool:
    """Whether the stage may claim, answer and complete in ONE transaction (and share it with
    other events: group commit): only the in-process model can (``llm_local_one_transaction``),
    and the event does not say which profile its job uses, so the claim decides
    (:func:`claim_in_one_transaction`)."""
    return ctx.settings.llm_local_one_transaction


def claim_in_one_transaction(ctx: StageContext, claim: Claim) -> bool:
    """True for a job on the in-process model (no ``base_url``): its answers take
    milliseconds of local CPU, so the run holds its transaction (and the job's row lock)
    through them. A remote provider's job is False: its claim commits alone and the calls run
    outside any transaction, with the lease heartbeat and the shared limit, as before."""
    return get_profile(claim.job.model_profile).base_url is None


def register(app: faust.App, ctx: StageContext) -> Any:
    """Register the llm agent on ``job.chunks_ready`` (prefixed by settings)."""
    return register_stage(app, ctx, STAGE, concurrency=ctx.settings.llm_concurrency)


def register_batch(app: faust.App, ctx: StageContext) -> Any:
    """Register the batch lane's agent ``llm_batch`` on ``job.chunks_ready.batch``: its own
    topic and consumer pool, so batch work never queues ahead of an interactive document."""
    return register_stage(app, ctx, STAGE, lane="batch",
                          concurrency=ctx.settings.llm_concurrency)
