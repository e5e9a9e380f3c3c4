"""The claim/complete protocol every stage after intake runs (design.md, "Stage work"), and
the generic stage agent that feeds it.

Each stage follows the same rules: skip if the event was processed or the checkpoint is done;
claim with a lease and a fresh run token (fencing token); do the work (the stage module's
``work``) outside any transaction; then in ONE transaction write the fenced checkpoint, the
next event's outbox row and the idempotent-consumer row. The agent commits the Kafka offset
only after :func:`run_stage` returns (``streams.offsets``).

Errors that escape: :class:`RetryableError` / :class:`OutcomeUnknown` (the caller retries the
same message later; nothing was checkpointed) and :class:`PoisonMessage` (dead-letter it).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import psycopg

from jobstream.errors import (
    OutcomeUnknown,
    PermanentError,
    PoisonMessage,
    RetryableError,
    StaleRun,
)
from jobstream.store import Claim, Done, LeaseHeld, Skip
from schemas.events import EVENT_MODELS, JobFailed, JobFailedPayload
from schemas.pipeline import PIPELINE, Stage
from streams.context import (
    JobCancelled,
    NeedsReconciliation,
    StageContext,
    StageResult,
    outbox_msg,
)

if TYPE_CHECKING:
    import faust

log = logging.getLogger("jobstream.streams")


def work_of(stage: str) -> Callable[[StageContext, Claim, Any], StageResult]:
    """The work function of ``stage``: ``streams.<stage>.work(ctx, claim, event)``. Raises
    ``ModuleNotFoundError`` / ``AttributeError`` for a stage without a module."""
    work = importlib.import_module(f"streams.{stage}").work
    return cast(Callable[[StageContext, Claim, Any], StageResult], work)


def register_stage(app: faust.App, ctx: StageContext, stage: Stage, *, lane: str | None = None,
                   concurrency: int = 1) -> Any:
    """Register the agent of ``stage`` (``<name>_<lane>`` on the lane's topic when ``lane``
    is given) running :func:`run_stage`, and its retry agent. Returns the main agent."""
    from streams.base import register_stage_agent  # faust: only the worker needs it

    return register_stage_agent(
        app, ctx, name=stage.name if lane is None else f"{stage.name}_{lane}",
        consumes=stage.consumes, topic_name=None if lane is None else stage.lanes[lane],
        handler=run_stage, concurrency=concurrency)


def run_stage(ctx: StageContext, ev: Any) -> str:
    """Process one stage event end to end; returns what happened, for logs and tests:
    ``done``, ``reused`` (re-emitted a finished checkpoint after a redrive),
    ``skipped:<reason>``, ``failed:<error code>``, ``parked``, ``cancelled`` or ``stale``.

    Waits (sleeping) while another run holds a live lease; a lease that expires is taken over.
    Raises :class:`RetryableError` / :class:`OutcomeUnknown` for the caller to retry later.
    """
    stage = PIPELINE.consumer_of(ev.event_type)
    emits = EVENT_MODELS[stage.emits]
    group = ctx.group(stage.name)
    common = {"tenant_id": ev.tenant_id, "request_id": ev.request_id, "job_id": ev.job_id,
              "dedup_key": ev.dedup_key, "generation": ev.generation}
    while True:
        got = ctx.store.claim(job_id=ev.job_id, stage=stage.name, group=group,
                              dedup_key=ev.dedup_key, event_type=ev.event_type,
                              event_id=ev.event_id, lease_s=ctx.settings.lease_s,
                              code_version=ctx.code_version(stage.name),
                              generation=ev.generation)
        if isinstance(got, Skip):
            if got.reason == "unknown_job":  # no job ever had this id: not our event
                raise PoisonMessage(f"no job {ev.job_id}", code="unknown_job")
            return f"skipped:{got.reason}"
        if isinstance(got, Done):
            nxt = emits(**common, idempotency_key=got.job["idempotency_key"],
                             payload=got.emitted)
            ok = ctx.store.reemit(job=got.job, group=group, event_type=ev.event_type,
                                  event_id=ev.event_id,
                                  next_msg=outbox_msg(ctx, nxt, got.job["lane"]),
                                  final=stage.name == PIPELINE.names[-1])
            return "reused" if ok else "skipped:duplicate"
        if isinstance(got, LeaseHeld):
            wait = max(0.2, got.lease_until.timestamp() - time.time() + 0.1)
            log.info("stage %s of job %s is leased by another run; waiting %.1fs",
                     stage.name, ev.job_id, wait)
            time.sleep(min(wait, 5.0))
            continue
        claim = got
        break
    common["idempotency_key"] = claim.job["idempotency_key"]
    later = PIPELINE.later(stage.name)
    try:
        try:
            result = work_of(stage.name)(ctx, claim, ev)
            next_event = emits(**common, payload=result.payload)
            ctx.store.complete(claim, output=result.output, input_hash=result.input_hash,
                               code_version=result.code_version, cost_usd=result.cost_usd,
                               group=group, event_type=ev.event_type, event_id=ev.event_id,
                               next_msg=outbox_msg(ctx, next_event, claim.job["lane"]),
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
        log.warning("job %s parked at %s: %s", ev.job_id, stage.name, exc)
        return "parked"
    except PermanentError as exc:
        failed = JobFailed(**common, payload=JobFailedPayload(stage=stage.name,
                                                              error_code=exc.code,
                                                              error=str(exc)[:4000]))
        try:
            ctx.store.fail(claim, error_code=exc.code, error=str(exc), group=group,
                           event_type=ev.event_type, event_id=ev.event_id,
                           failed_msg=outbox_msg(ctx, failed))
        except StaleRun:
            return "stale"
        log.warning("job %s failed at %s: %s (%s)", ev.job_id, stage.name, exc, exc.code)
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
                       failed_msg=outbox_msg(ctx, failed))
        log.error("job %s failed at %s: %s (%s)", ev.job_id, claim.stage, error, code)
    except StaleRun:
        pass
    except Exception as fail_exc:  # noqa: BLE001 - the original error is what gets raised
        log.error("could not fail job %s after %s: %s", ev.job_id, code, fail_exc)

