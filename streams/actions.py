"""Operator actions on jobs, outside the normal flow of events: :func:`redrive` (send a job
through its stages again), :func:`reconcile` (resolve a job parked on an unknown provider
outcome), :func:`give_up` (fail the job of an event whose retry budget is spent) and
:func:`sweep` (un-stick stages whose lease expired; run by the active relay).

Every action is fenced like a stage run: a re-drive starts a new generation of the job and
fences the runs it replaces (see :meth:`jobstream.store.Store.redrive`).
"""

from __future__ import annotations

import functools
import logging
import uuid
from typing import Any

from jobstream.errors import RetryableError, StaleRun
from jobstream.store import JobRow, OutboxMessage, StageCheckpoint
from schemas.events import EVENT_MODELS, JobFailed, JobFailedPayload
from schemas.pipeline import PIPELINE
from streams.context import StageContext, outbox_msg

log = logging.getLogger("jobstream.streams")

#: The checkpoint chain, intake first.
STAGES = PIPELINE.names
#: The event type each stage after intake consumes.
CONSUMES = {s.name: s.consumes for s in PIPELINE.job_stages}


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
    def plan(job: JobRow, rows: dict[str, StageCheckpoint]) -> tuple[Any, ...]:
        nonlocal from_stage
        if from_stage is None:
            from_stage = next((st for st in STAGES[1:]
                               if st not in rows or rows[st].status != "succeeded"), STAGES[1])
        if from_stage not in CONSUMES:
            raise KeyError(f"unknown stage {from_stage!r}; stages: {list(CONSUMES)}")
        prev = rows.get(STAGES[STAGES.index(from_stage) - 1])
        if prev is None or prev.status != "succeeded" or prev.emitted is None:
            raise ValueError(f"stage before {from_stage} has no checkpoint to restart from")
        model = EVENT_MODELS[CONSUMES[from_stage]]
        ev = model(tenant_id=job.tenant_id, idempotency_key=job.idempotency_key,
                   job_id=job.job_id, dedup_key=job.dedup_key,
                   request_id=job.request_id, generation=job.generation + 1,
                   payload=prev.emitted)
        stages_from = list(STAGES[STAGES.index(from_stage):])
        return (outbox_msg(ctx, ev, job.lane), stages_from,
                [ctx.group(st) for st in stages_from], [CONSUMES[st] for st in stages_from])

    ctx.store.redrive(job_id, plan=plan, allowed=allowed, fence=fence, conn=conn)
    assert from_stage is not None
    return from_stage


def reconcile(ctx: StageContext, job_id: uuid.UUID, resolution: str) -> str:
    """Resolve a job parked in ``needs_reconciliation``: ``retry`` re-drives the parked stage
    (chunks already answered are not sent again); ``fail`` ends the job ``failed`` with a
    ``job.failed`` event. Returns a one-line description. Raises ``ValueError``."""
    job = ctx.store.job(job_id)
    if job is None or job.status != "needs_reconciliation":
        raise ValueError(f"job {job_id} does not need reconciliation")
    if resolution == "retry":
        stage = redrive(ctx, job_id, allowed=("needs_reconciliation",))
        return f"job {job_id} re-driven from {stage}"
    if resolution == "fail":
        ev = JobFailed(tenant_id=job.tenant_id, idempotency_key=job.idempotency_key,
                       job_id=job_id, dedup_key=job.dedup_key, request_id=job.request_id,
                       generation=job.generation,
                       payload=JobFailedPayload(stage=job.current_stage,
                                                error_code="outcome_unknown_unresolved",
                                                error="resolved as failed by an operator"))
        ctx.store.fail_parked(job_id, error_code="outcome_unknown_unresolved",
                              error="resolved as failed by an operator",
                              failed_msg=outbox_msg(ctx, ev))
        return f"job {job_id} failed"
    raise ValueError(f"resolution must be retry or fail, not {resolution!r}")


def give_up(ctx: StageContext, ev: Any, error_code: str, error: str) -> bool:
    """Fail the job of a stage event whose retry budget is spent (``job.failed``). Returns False
    when the job was already terminal or was re-driven since the event (another generation).
    Raises :class:`RetryableError` if Postgres is down."""
    stage = PIPELINE.consumer_of(ev.event_type)
    job = ctx.store.job(ev.job_id)
    if job is None:
        return False
    failed = JobFailed(tenant_id=ev.tenant_id, idempotency_key=job.idempotency_key,
                       request_id=ev.request_id, job_id=ev.job_id, dedup_key=ev.dedup_key,
                       generation=ev.generation,
                       payload=JobFailedPayload(stage=stage.name, error_code=error_code,
                                                error=error[:4000]))
    return ctx.store.give_up(job_id=ev.job_id, stage=stage.name, error_code=error_code,
                             error=error, group=ctx.group(stage.name), event_type=ev.event_type,
                             event_id=ev.event_id, dedup_key=ev.dedup_key,
                             failed_msg=outbox_msg(ctx, failed), generation=ev.generation)


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

    Then every job stalled between stages (its last checkpoint succeeded over
    ``sweep_stall_grace_s`` ago, times ``2 ** sweeps``, the next stage was never claimed and
    no outbox row of the job waits for the relay) gets the next stage's input event re-emitted
    through the outbox: the event was lost on the way (e.g. its offset committed past it after
    a broker restart, docs/design-notes.md "Stalled between stages").

    Returns one line per action. A crash or a pause must never leave a job stuck forever.
    Raises :class:`RetryableError` when Postgres is unavailable.
    """
    actions = []
    grace = ctx.settings.sweep_grace_s
    for row in ctx.store.expired_leases(grace):
        job_id, stage, seen = row.job_id, row.stage, row.run_token
        try:
            if row.attempt >= ctx.settings.max_stage_attempts:
                job = ctx.store.job(job_id)
                assert job is not None
                error = f"{row.attempt} runs of {stage} died or hung"
                ev = JobFailed(tenant_id=job.tenant_id, idempotency_key=job.idempotency_key,
                               job_id=job_id, dedup_key=job.dedup_key,
                               request_id=job.request_id, generation=job.generation,
                               payload=JobFailedPayload(stage=stage,
                                                        error_code="stage_attempts_exhausted",
                                                        error=error))
                ctx.store.fail_expired(job_id, stage=stage, run_token=seen, grace_s=grace,
                                       error_code="stage_attempts_exhausted", error=error,
                                       failed_msg=outbox_msg(ctx, ev))
                actions.append(f"failed {job_id} at {stage}")
            else:
                redrive(ctx, job_id, from_stage=stage, allowed=("queued", "running"),
                        fence=(stage, seen, grace))
                actions.append(f"re-drove {job_id} from {stage}")
        except (StaleRun, ValueError, KeyError) as exc:
            log.info("sweeper skipped %s/%s: %s", job_id, stage, exc)
        except RetryableError as exc:  # a row lock held too long (lock_timeout): next pass
            log.warning("sweeper postponed %s/%s: %s", job_id, stage, exc)
    actions += _reemit_lost_events(ctx)
    try:
        if closed := ctx.store.close_orphans():
            actions.append(f"closed {closed} orphan provider attempts (abandoned)")
    except RetryableError as exc:
        log.warning("sweeper postponed closing orphan attempts: %s", exc)
    return actions


def _reemit_lost_events(ctx: StageContext) -> list[str]:
    """The sweeper's backstop for a lost stage event (see :func:`sweep`): re-emit, through
    the outbox, the input event of the next stage of every stalled job, of the job's current
    generation (the stage claims it normally; a late copy of the lost one is a duplicate).
    Returns one line per job re-emitted."""
    actions: list[str] = []
    grace = ctx.settings.sweep_stall_grace_s
    try:
        stalled = ctx.store.stalled_jobs(grace)
    except RetryableError as exc:
        log.warning("sweeper postponed the stalled-job pass: %s", exc)
        return actions

    def build(job: JobRow, emitted: Any, *, stage: str) -> OutboxMessage:
        model = EVENT_MODELS[CONSUMES[stage]]
        ev = model(tenant_id=job.tenant_id, idempotency_key=job.idempotency_key,
                   job_id=job.job_id, dedup_key=job.dedup_key, request_id=job.request_id,
                   generation=job.generation, payload=emitted)
        return outbox_msg(ctx, ev, job.lane)

    for row in stalled:
        try:
            ctx.store.reemit_stalled(row.job_id, stage=row.stage, grace_s=grace,
                                     build=functools.partial(build, stage=row.stage))
            actions.append(f"re-emitted {CONSUMES[row.stage]} of {row.job_id}: {row.stage} "
                           f"never claimed after {row.checkpoint}")
        except StaleRun as exc:
            log.info("sweeper skipped %s/%s: %s", row.job_id, row.stage, exc)
        except RetryableError as exc:  # a row lock held too long (lock_timeout): next pass
            log.warning("sweeper postponed %s/%s: %s", row.job_id, row.stage, exc)
    return actions
