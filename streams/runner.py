"""The claim/complete protocol every stage after intake runs (design.md, "Stage work"), and
the generic stage agent that feeds it.

Each stage follows the same rules: skip if the event was processed or the checkpoint is done;
claim with a lease and a fresh run token (fencing token), reading in the same transaction what
the stage needs (the stage module's ``READS``); do the work (the stage module's ``work``)
outside any transaction; then in ONE transaction write the fenced checkpoint, the next event's
outbox row and the idempotent-consumer row. A short, pure stage (its module's
``one_transaction(ctx, event)`` says so, and ``stage_one_transaction`` is on) claims, works and
completes in ONE transaction under the job's row lock instead (``Store.claim_and_complete``).
The agent commits the Kafka offset only after :func:`run_stage` returns (``streams.offsets``).

Errors that escape: :class:`RetryableError` / :class:`OutcomeUnknown` (the caller retries the
same message later; nothing was checkpointed) and :class:`PoisonMessage` (dead-letter it).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import importlib
import logging
import time
from collections.abc import Callable
from types import ModuleType
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
from streams.batchthread import BatchThread
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


def module_of(stage: str) -> ModuleType:
    """The module of ``stage``: ``streams.<stage>`` (its ``work``, and optionally ``READS``
    and ``one_transaction``). Raises ``ModuleNotFoundError``."""
    return importlib.import_module(f"streams.{stage}")


def work_of(stage: str) -> Callable[[StageContext, Claim, Any], StageResult]:
    """The work function of ``stage``: ``streams.<stage>.work(ctx, claim, event)``. Raises
    ``ModuleNotFoundError`` / ``AttributeError`` for a stage without a module."""
    work = module_of(stage).work
    return cast(Callable[[StageContext, Claim, Any], StageResult], work)


def register_stage(app: faust.App, ctx: StageContext, stage: Stage, *, lane: str | None = None,
                   concurrency: int | None = None) -> Any:
    """Register the agent of ``stage`` (``<name>_<lane>`` on the lane's topic when ``lane``
    is given) running :func:`run_stage`, and its retry agent. Returns the main agent.

    ``concurrency``: events the agent holds at once. A stage whose module has
    ``one_transaction`` runs its events through a :class:`GroupCommit` (up to
    ``stage_batch_max`` per transaction), holding ``stage_concurrency`` events by default;
    with ``stage_batch_max`` = 1, one event at a time, as before. Its events that cannot
    share a transaction run ``concurrency`` at once when it is given, else one at a time."""
    from streams.base import register_stage_agent  # faust: only the worker needs it

    s = ctx.settings
    module = module_of(stage.name)
    runner = (GroupCommit(ctx, s.stage_batch_max, alone=concurrency or 1).run
              if hasattr(module, "one_transaction") and s.stage_batch_max > 1 else None)
    return register_stage_agent(
        app, ctx, name=stage.name if lane is None else f"{stage.name}_{lane}",
        consumes=stage.consumes, topic_name=None if lane is None else stage.lanes[lane],
        handler=run_stage, concurrency=concurrency or (s.stage_concurrency if runner else 1),
        runner=runner)


class _Plan:
    """What :func:`run_stage` needs of one event before it claims: its stage, the claim's
    arguments, whether it runs in ONE transaction, and how a result becomes a completion."""

    def __init__(self, ctx: StageContext, ev: Any) -> None:
        self.stage = stage = PIPELINE.consumer_of(ev.event_type)
        self.emits = EVENT_MODELS[stage.emits]
        self.module = module = module_of(stage.name)
        self.group = group = ctx.group(stage.name)
        self.common: dict[str, Any] = {
            "tenant_id": ev.tenant_id, "request_id": ev.request_id, "job_id": ev.job_id,
            "dedup_key": ev.dedup_key, "generation": ev.generation}
        self.later = PIPELINE.later(stage.name)
        self.claim_kw: dict[str, Any] = {
            "job_id": ev.job_id, "stage": stage.name, "group": group,
            "dedup_key": ev.dedup_key, "event_type": ev.event_type, "event_id": ev.event_id,
            "lease_s": ctx.settings.lease_s, "code_version": ctx.code_version(stage.name),
            "generation": ev.generation, "reads": getattr(module, "READS", ())}
        self.single = shares_transaction(ctx, ev)
        self.ctx, self.ev = ctx, ev

    def completion(self, claim: Claim, result: StageResult) -> dict[str, Any]:
        """The :meth:`Store.complete` arguments of a run whose work returned ``result``."""
        ctx, ev = self.ctx, self.ev
        next_event = self.emits(**{**self.common, "idempotency_key": claim.job.idempotency_key},
                                payload=result.payload)
        return {"output": result.output, "input_hash": result.input_hash,
                "code_version": result.code_version, "cost_usd": result.cost_usd,
                "group": self.group, "event_type": ev.event_type, "event_id": ev.event_id,
                "next_msg": outbox_msg(ctx, next_event, claim.job.lane),
                "chunks": result.chunks, "charge_usd": result.charge_usd,
                "later_stages": self.later, "local_answers": result.local_answers}

    def work_and_completion(self, claim: Claim) -> dict[str, Any]:
        """Run the stage's work on ``claim``; its completion arguments."""
        return self.completion(claim, self.module.work(self.ctx, claim, self.ev))

    def one_transaction_work(self, claim: Claim) -> dict[str, Any]:
        """:meth:`work_and_completion` inside a one-transaction attempt. Raises
        :class:`TwoTransactions` when the stage module's ``claim_in_one_transaction(ctx,
        claim)`` says this run must not hold the transaction open (the llm stage of a job on
        a remote provider): the claim then commits alone."""
        check = getattr(self.module, "claim_in_one_transaction", None)
        if check is not None and not check(self.ctx, claim):
            raise TwoTransactions(f"stage {claim.stage} of job {claim.job.job_id}: runs in "
                                  "two transactions")
        return self.work_and_completion(claim)


class TwoTransactions(Exception):  # noqa: N818 - a signal between runner and store, not an error
    """A one-transaction attempt found, once claimed, that the run needs a claim transaction
    and a completion transaction (work outside any transaction, e.g. a remote provider call
    with its lease and shared limit): the claim commits alone and :func:`run_stage` goes on
    as for a two-transaction stage."""


class _Deferred(Exception):  # noqa: N818 - carries a committed claim, not an error
    """Raised by :func:`run_stage` called with ``defer=True`` (a :class:`GroupCommit`'s
    drain) for a run that goes on in two transactions: ``first`` (the committed claim) is
    handed back, so its slow work runs on a thread of its own, not in the drain."""

    def __init__(self, plan: _Plan, first: Attempt) -> None:
        super().__init__("two-transaction run deferred")
        self.plan, self.first = plan, first


Attempt = tuple[Claim | Skip | Done | LeaseHeld, Exception | None]


def run_stage(ctx: StageContext, ev: Any, *, plan: _Plan | None = None,
              first: Attempt | None = None, defer: bool = False) -> str:
    """Process one stage event end to end; returns what happened, for logs and tests:
    ``done``, ``reused`` (re-emitted a finished checkpoint after a redrive),
    ``skipped:<reason>``, ``failed:<error code>``, ``parked``, ``cancelled`` or ``stale``.

    ``first``: the outcome of a one-transaction attempt already made for this event (by
    :func:`run_stage_batch`, inside a shared transaction that has committed); the run goes on
    from there exactly as after its own :meth:`Store.claim_and_complete`.

    ``defer``: a one-transaction attempt whose claim turned out to need two transactions
    (:class:`TwoTransactions`) raises :class:`_Deferred` with its committed claim instead of
    doing the work here (the caller runs it elsewhere with ``first``).

    Waits (sleeping) while another run holds a live lease; a lease that expires is taken over.
    Raises :class:`RetryableError` / :class:`OutcomeUnknown` for the caller to retry later.
    """
    p = plan or _Plan(ctx, ev)
    stage, emits, group, common = p.stage, p.emits, p.group, p.common
    claim_kw, single = p.claim_kw, p.single
    failure: Exception | None = None
    while True:
        if first is not None:  # attempted in a shared transaction (run_stage_batch)
            (got, failure), first = first, None
        elif single:  # claim, work and complete in ONE transaction (a short, pure stage)
            got, failure = ctx.store.claim_and_complete(p.one_transaction_work, **claim_kw)
        else:
            got = ctx.store.claim(**claim_kw)
        if isinstance(got, Skip):
            if got.reason == "unknown_job":  # no job ever had this id: not our event
                raise PoisonMessage(f"no job {ev.job_id}", code="unknown_job")
            if got.reason == "generation_ahead":  # no legitimate event is ahead of its job
                raise PoisonMessage(f"event of generation {ev.generation} is ahead of its job "
                                    f"{ev.job_id} (forged: a redrive's events carry the job's "
                                    "generation)", code="generation_ahead")
            return f"skipped:{got.reason}"
        if isinstance(got, Done):
            nxt = emits(**common, idempotency_key=got.job.idempotency_key, payload=got.emitted)
            ok = ctx.store.reemit(job=got.job, group=group, event_type=ev.event_type,
                                  event_id=ev.event_id,
                                  next_msg=outbox_msg(ctx, nxt, got.job.lane),
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
    if single and isinstance(failure, TwoTransactions):  # the claim committed alone
        if defer:
            raise _Deferred(p, (claim, failure))
        single, failure = False, None
    common["idempotency_key"] = claim.job.idempotency_key
    try:
        try:
            if single:
                if failure is not None:  # the work failed; its claim committed alone
                    raise failure
                return "done"
            ctx.store.complete(claim, **p.work_and_completion(claim))
        except (RetryableError, OutcomeUnknown) as exc:
            # Give the stage back so the retry claims it at once instead of waiting for this
            # run's lease; then let the caller retry. Also when the completing transaction
            # itself failed (Postgres restarting, a serialization failure): it rolled back, or
            # it committed and the fenced release finds the stage succeeded and changes nothing.
            with contextlib.suppress(RetryableError):
                # Its retry (retry topic) is due within the cap, or the provider's
                # Retry-After: the sweeper does not take it for a lost event meanwhile.
                ctx.store.release(claim, error_code=exc.code, error=str(exc), retry_wait_s=max(
                    ctx.settings.retry_cap_s, getattr(exc, "retry_after_s", None) or 0.0))
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


def run_stage_batch(ctx: StageContext, events: list[Any], *, defer: bool = False
                    ) -> list[str | Exception]:
    """Run several events (of one agent, taken while earlier ones were committing) as
    :func:`run_stage` would one by one, with ONE transaction for the claim, work and
    completion of all of them that qualify for one (:meth:`Store.claim_and_complete_many`):
    each run is still fenced by its own run token and generation under its job's row lock,
    in its own savepoint. Each event is then finished on its own (a work that failed ends its
    run as in :func:`run_stage`; a run whose savepoint rolled back runs again alone, which
    reports its error), so one failing event fails no other.

    Returns one entry per event, in order: :func:`run_stage`'s outcome or the exception it
    raised (the caller routes it per event: retry, dead letter); with ``defer``, a
    :class:`_Deferred` for a run whose claim needs two transactions (:func:`run_stage`).
    Each event's work runs in the ``contextvars`` context of its own message when ``events``
    are ``(event, context)`` pairs (its log fields and trace span), else in the caller's.
    """
    items: list[tuple[Any, contextvars.Context | None]] = [
        e if isinstance(e, tuple) else (e, None) for e in events]
    plans: list[_Plan | Exception] = []
    for ev, cv in items:
        try:
            plans.append(cv.run(_Plan, ctx, ev) if cv else _Plan(ctx, ev))
        except Exception as exc:  # noqa: BLE001 - reported for this event only
            plans.append(exc)
    # In the jobs' order (stable: one job's events keep theirs), so two workers' shared
    # transactions lock job rows in the same order and never deadlock each other.
    shared = sorted((i for i, p in enumerate(plans) if isinstance(p, _Plan) and p.single),
                    key=lambda i: str(items[i][0].job_id))
    firsts: dict[int, Attempt | None] = {}
    if len(shared) > 1:
        def step(i: int) -> Callable[[Any], Attempt]:
            plan = cast(_Plan, plans[i])
            cv = items[i][1]

            def run(conn: Any) -> Attempt:
                call = functools.partial(ctx.store.claim_and_complete_in, conn,
                                         plan.one_transaction_work, **plan.claim_kw)
                return cv.run(call) if cv else call()
            return run
        if log.isEnabledFor(logging.INFO):  # the jobs' list only when it is logged
            log.info("shared stage transaction: %d events of %s, jobs %s", len(shared),
                     cast(_Plan, plans[shared[0]]).stage.name,
                     " ".join(str(items[i][0].job_id) for i in shared))
        try:
            got = ctx.store.claim_and_complete_many([step(i) for i in shared],
                                                    lease_s=ctx.settings.lease_s)
            firsts = dict(zip(shared, got, strict=True))
        except Exception as exc:  # noqa: BLE001 - nothing shared committed: each runs alone
            log.warning("shared stage transaction of %d events failed (%s); running them one "
                        "by one", len(shared), exc)
    out: list[str | Exception] = []
    for i, (ev, cv) in enumerate(items):
        plan = plans[i]
        if isinstance(plan, Exception):
            out.append(plan)
            continue
        call = functools.partial(run_stage, ctx, ev, plan=plan, first=firsts.get(i),
                                 defer=defer)
        try:
            out.append(cv.run(call) if cv else call())
        except Exception as exc:  # noqa: BLE001 - handed to the caller for this event
            out.append(exc)
    return out


def shares_transaction(ctx: StageContext, ev: Any) -> bool:
    """Whether ``ev`` runs in ONE transaction (``stage_one_transaction`` and its module's
    ``one_transaction``), hence may share it with other events (:class:`GroupCommit`)."""
    module = module_of(PIPELINE.consumer_of(ev.event_type).name)
    return bool(ctx.settings.stage_one_transaction and hasattr(module, "one_transaction")
                and module.one_transaction(ctx, ev))


class GroupCommit:
    """Runs one agent's stage events, sharing a transaction among those that arrive while
    an earlier batch is being committed (group commit): an event on an idle agent runs at
    once, alone; under load up to ``max_batch`` queued events run as :func:`run_stage_batch`.
    Needs the agent to hold more than one event at once (``stage_concurrency``).

    :meth:`run` is what the agent awaits per decoded event; it raises what :func:`run_stage`
    raises for that event. Events that cannot share a transaction (a PDF's extract) run on a
    thread of their own, ``alone`` at a time (1: as before); a run whose claim turns out to
    need two transactions (:class:`TwoTransactions`, the llm stage of a remote provider's job)
    has its claim committed in the shared transaction and its work run on a thread of its own,
    so a provider call never holds up the drain.
    """

    def __init__(self, ctx: StageContext, max_batch: int, alone: int = 1) -> None:
        self.ctx, self.max_batch, self.alone = ctx, max(1, max_batch), max(1, alone)
        self._queue: list[tuple[Any, contextvars.Context, asyncio.Future[str]]] = []
        self._draining = False
        self._task: asyncio.Task[None] | None = None  # the drain running (a strong reference)
        self._alone: asyncio.Semaphore | None = None
        self._deferred: set[asyncio.Task[None]] = set()  # two-transaction runs (strong refs)
        self._thread = BatchThread("group-commit")  # the drain's batches, one at a time

    async def run(self, ev: Any) -> str:
        """Run ``ev`` (a decoded stage event); returns :func:`run_stage`'s outcome."""
        if self.max_batch == 1 or not shares_transaction(self.ctx, ev):
            if self._alone is None:
                self._alone = asyncio.Semaphore(self.alone)
            async with self._alone:  # one at a time by default (a PDF's parser: memory)
                return await asyncio.to_thread(run_stage, self.ctx, ev)
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._queue.append((ev, contextvars.copy_context(), fut))
        if not self._draining:
            self._draining = True
            self._task = asyncio.get_running_loop().create_task(self._drain())
        return await fut

    def _later(self, ev: Any, cv: contextvars.Context, fut: asyncio.Future[str],
               deferred: _Deferred) -> None:
        """Finish a run whose claim committed alone (:class:`TwoTransactions`: e.g. a remote
        provider's calls) on a thread of its own; ``fut`` gets its outcome. The agent's
        ``concurrency`` still bounds how many run at once (each holds its event's slot)."""
        async def finish() -> None:
            try:
                res = await asyncio.to_thread(
                    cv.run, functools.partial(run_stage, self.ctx, ev, plan=deferred.plan,
                                              first=deferred.first))
                if not fut.done():
                    fut.set_result(res)
            except asyncio.CancelledError:
                fut.cancel()
                raise
            except Exception as exc:  # noqa: BLE001 - routed by the agent, for this event
                if not fut.done():
                    fut.set_exception(exc)
        task = asyncio.get_running_loop().create_task(finish())
        self._deferred.add(task)
        task.add_done_callback(self._deferred.discard)

    async def _drain(self) -> None:
        try:
            while self._queue:
                batch = self._queue[:self.max_batch]
                del self._queue[:self.max_batch]
                batch = [b for b in batch if not b[2].cancelled()]
                if not batch:
                    continue
                try:
                    got = await self._thread.run(functools.partial(  # as to_thread: a copy
                        contextvars.copy_context().run, run_stage_batch, self.ctx,
                        [(ev, cv) for ev, cv, _ in batch], defer=True))
                except Exception as exc:  # noqa: BLE001 - a bug in the batching itself
                    got = [exc] * len(batch)
                for (ev, cv, fut), res in zip(batch, got, strict=True):
                    if fut.done():
                        continue
                    if isinstance(res, _Deferred):  # its work must not hold up the drain
                        self._later(ev, cv, fut, res)
                    elif isinstance(res, Exception):
                        fut.set_exception(res)
                    else:
                        fut.set_result(res)
        finally:
            self._draining = False
            for _, _, fut in self._queue:  # only when cancelled itself (stopping)
                if not fut.done():
                    fut.cancel()
            self._queue.clear()


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

