"""The shared body of every stage agent: decode, run, dead-letter, retry.

Routing (style.md lesson 4: agents stay thin, failures are routed explicitly):

- every message runs inside one guard (:func:`register_stage_agent`'s ``guarded``): whatever
  escapes decoding, handling or routing is dead-lettered, the agent never crashes;
- poison (no key, over ``kafka_message_max_bytes``, nested deeper than ``max_json_depth``,
  undecodable, schema-violating, wrong type, rejected by the handler, data Postgres cannot store
  -> ``invalid_data``) -> ``<topic>.dlq`` with ``dlq_reason_code``, ``dlq_reason`` and the
  original topic/partition/offset in headers, or, when the DLQ does not take it, the Postgres
  ``dead_letter`` table (:class:`jobstream.deadletter.DeadLetterSink`); the message is acked only
  once one of them holds it;
- transient (:class:`RetryableError`, :class:`OutcomeUnknown`): retried in place
  ``retry_in_place`` times with full-jitter backoff (a Postgres blip), then sent to
  ``<topic>.retry`` with ``retry_count`` and ``retry_not_before_ms`` headers and acked, so the
  partition moves on. A retry agent re-runs it after the not-before time; after
  ``retry_rounds`` rounds the job fails (``retry_budget_exhausted``) and the message is
  dead-lettered for inspection;
- a bug (any other exception) -> dead-lettered with reason ``unhandled``, never a crash loop;
  the stage run already ended (:func:`streams.runner.run_stage` fails the job with
  ``internal_error`` and a ``job.failed`` event).

Offsets follow completion: the committed offset of a partition is the lowest one whose message
is not done yet (``streams/offsets.py``), never faust's ack tracking, so the offset commit
always follows the stage's Postgres transaction (or the retry/DLQ produce, which is awaited
until acknowledged), whatever the agent's concurrency.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

import faust
import psycopg

from jobstream import faults, logs
from jobstream.deadletter import UNHANDLED, DeadLetterSink, classify, describe
from jobstream.errors import OutcomeUnknown, PoisonMessage, RetryableError
from jobstream.settings import Settings
from schemas.events import decode_event
from schemas.pipeline import PIPELINE
from streams import offsets
from streams.actions import give_up
from streams.context import StageContext

log = logging.getLogger("jobstream.streams")

IN_PLACE_BASE_S = 0.5
IN_PLACE_CAP_S = 5.0


def _items(headers: Any) -> list[tuple[str, bytes | None]]:
    """faust message headers (a dict or a list of pairs) as ``(name, bytes)`` pairs; a null
    value stays ``None`` (a dead letter or retry copy keeps it null, not ``b"None"``)."""
    items = (headers or {}).items() if isinstance(headers, dict | None) else headers
    return [(k, v if v is None or isinstance(v, bytes) else str(v).encode()) for k, v in items]


def _header(event: faust.EventT[Any], name: str) -> str | None:
    for k, v in _items(event.message.headers):
        if k == name:
            return None if v is None else v.decode("utf-8", "replace")
    return None


_SINKS: dict[str, DeadLetterSink] = {}


def _sink(settings: Settings, group: str) -> DeadLetterSink:
    """The dead-letter sink of a worker's consumer group (one per process)."""
    if group not in _SINKS:
        _SINKS[group] = DeadLetterSink(settings, group=group)
    return _SINKS[group]


def retry_delay_s(round_no: int, base_s: float, cap_s: float, retry_after_s: float | None
                  ) -> float:
    """Delay before retry round ``round_no`` (1-based): full-jitter exponential backoff
    (Brooker 2015), never shorter than the provider's Retry-After (seconds)."""
    jitter = random.uniform(0, min(cap_s, base_s * 2 ** (round_no - 1)))
    return max(retry_after_s or 0.0, jitter)


def retry_wait_s(not_before_ms: str | None, timestamp_s: float | None, now_s: float,
                 cap_s: float) -> float:
    """Seconds the retry agent waits before running a ``.retry`` message (0: run now).

    ``not_before_ms``: its ``retry_not_before_ms`` header (Unix ms, text; missing or not a
    number: run now). ``timestamp_s``: the message's Kafka timestamp (Unix seconds; None or
    not positive: unknown). The wait ends at the header's time, but never later than the
    message's timestamp plus ``cap_s`` (a real retry's jitter is at most ``cap_s``,
    :func:`retry_delay_s`; a longer Retry-After was already cut to ``cap_s`` here), nor
    later than ``cap_s`` from ``now_s``. A timestamp in the future counts as ``now_s``: a
    producer's CreateTime can be forged, so ``jobstream topics`` creates ``.retry`` topics with
    ``message.timestamp.type=LogAppendTime`` (the broker's clock). So forged far-future
    headers on messages written at time T hold the lane until T + ``cap_s`` at most, all
    of them together, not ``cap_s`` each one after the other (adv12; design-notes.md, "A
    forged retry_not_before_ms")."""
    try:
        not_before = int(not_before_ms or 0) / 1000
    except (ValueError, OverflowError):  # forged (e.g. 400 digits): run now
        return 0.0
    sent = timestamp_s if timestamp_s is not None and 0 < timestamp_s < now_s else now_s
    return max(0.0, min(not_before, sent + cap_s) - now_s)


def register_stage_agent(app: faust.App, ctx: StageContext, *, name: str, consumes: str,
                         handler: Callable[[StageContext, Any], Any],
                         topic_name: str | None = None, concurrency: int = 1,
                         runner: Callable[[Any], Awaitable[Any]] | None = None) -> Any:
    """Register the agent of topic ``topic_name`` (logical name; default ``consumes``, the
    event type it accepts) running ``handler(ctx, event)`` in up to ``concurrency`` events at
    once, and its retry agent on ``<topic>.retry``. Returns the main agent.

    ``runner``: an async ``runner(event)`` that runs ``handler`` for a decoded event (and
    raises what it raises), e.g. :class:`streams.runner.GroupCommit`'s ``run``; default: the
    handler on a thread of its own."""
    s = ctx.settings
    kw: dict[str, Any] = {"value_serializer": "raw", "key_serializer": "raw",
                          "partitions": s.topic_partitions}
    source = topic_name or consumes
    topic = app.topic(s.topic(source), **kw)
    retry_topic = app.topic(s.topic(source + ".retry"),
                            **{**kw, "partitions": s.retry_topic_partitions})
    # Log context + trace span of each message (intake is where a trace may start).
    scope: dict[str, Any] = {"stage": PIPELINE.consumer_of(consumes).name, "group": app.conf.id,
                             "start_trace": consumes == PIPELINE.stages[0].consumes}

    sink = _sink(ctx.settings, app.conf.id)

    async def dead_letter(event: faust.EventT[Any], code: str, reason: str,
                          job_id: Any = None) -> None:
        """Make the dead letter durable (``<topic>.dlq``, else the dead_letter table); only
        then may faust ack the message. Waits (with backoff) while neither takes it."""
        msg = event.message
        # The agent's own topic, also for its .retry twin: never a header's say-so (a forged
        # retry_original_topic must not pick the DLQ or the replay target).
        src_topic = s.topic(source)
        headers = [(k, v) for k, v in _items(msg.headers) if not k.startswith("retry_")]
        backoff = IN_PLACE_BASE_S
        while True:
            try:
                await asyncio.to_thread(
                    sink.send, topic=src_topic, consumed_topic=msg.topic,
                    partition=msg.partition, offset=msg.offset, key=msg.key, value=msg.value,
                    headers=headers, code=code, reason=reason, job_id=job_id)
                return
            except Exception as exc:  # RetryableError: neither Kafka nor Postgres took it
                log.error("processing failed %s[%d]@%d: dead letter not durable (%s); next: "
                          "retry the dead letter in %.1fs", msg.topic, msg.partition,
                          msg.offset, describe(exc), backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, IN_PLACE_CAP_S * 6)

    async def to_retry(event: faust.EventT[Any], exc: Exception, round_no: int) -> None:
        delay = retry_delay_s(round_no, s.retry_base_s, s.retry_cap_s,
                              getattr(exc, "retry_after_s", None))
        msg = event.message
        headers: dict[str, bytes] = {k: v for k, v in _items(msg.headers)
                                     if not k.startswith("retry_") and v is not None}
        headers |= {
            "retry_count": str(round_no).encode(),
            "retry_not_before_ms": str(int((time.time() + delay) * 1000)).encode(),
            "retry_reason": f"{type(exc).__name__}: {exc}"[:2000].encode(),
            "retry_original_topic": (_header(event, "retry_original_topic")
                                     or msg.topic).encode(),
        }
        log.warning("%s: transient failure (%s); retry round %d in %.1fs via %s", name, exc,
                    round_no, delay, s.topic(source + ".retry"))
        fut = await retry_topic.send(key=msg.key, value=msg.value, headers=headers)
        await fut

    async def decode(event: faust.EventT[Any]) -> Any:
        """The decoded event of a message, or None once the message was dead-lettered (no
        key, poison)."""
        if event.message.key is None:
            await dead_letter(event, "missing_key", "message has no key (jobstream events are "
                              "keyed by job id, or idempotency key on document.uploaded)")
            return None
        try:
            ev = decode_event(event.message.value, expected=consumes,
                              max_bytes=s.kafka_message_max_bytes, max_depth=s.max_json_depth)
        except PoisonMessage as exc:
            await dead_letter(event, exc.code, str(exc))
            return None
        logs.bind(request_id=ev.request_id, tenant=ev.tenant_id, event_type=ev.event_type,
                  job_id=getattr(ev, "job_id", None))
        return ev

    async def process(event: faust.EventT[Any], round_no: int) -> None:
        """Run one message from the main topic (round 0)."""
        ev = await decode(event)
        if ev is not None:
            await run(event, ev, round_no)

    async def process_retry(event: faust.EventT[Any]) -> None:
        """Run one message from the retry topic: decoded and validated first (poison is
        dead-lettered at once, never waited for), then run after its not-before time, bounded
        by its Kafka timestamp plus ``retry_cap_s`` (:func:`retry_wait_s`)."""
        try:
            round_no = max(1, int(_header(event, "retry_count") or 1))
        except (ValueError, OverflowError):  # forged (e.g. 400 digits): round 1
            round_no = 1
        ev = await decode(event)
        if ev is None:
            return
        wait = retry_wait_s(_header(event, "retry_not_before_ms"), event.message.timestamp,
                            time.time(), s.retry_cap_s)
        if wait > 0:
            await asyncio.sleep(wait)
        await run(event, ev, round_no)

    async def run(event: faust.EventT[Any], ev: Any, round_no: int) -> None:
        """Run the decoded event ``ev`` of ``event`` (retry round ``round_no``; 0: first)."""
        attempt = 0
        while True:
            try:
                # A runner (group commit) or an async handler (intake's batcher) awaits its
                # own work; other handlers run in a thread.
                if runner is not None:
                    outcome = await runner(ev)
                elif inspect.iscoroutinefunction(handler):
                    outcome = await handler(ctx, ev)
                else:
                    outcome = await asyncio.to_thread(handler, ctx, ev)
                log.info("%s %s job=%s round=%d -> %s", name, ev.event_type,
                         getattr(ev, "job_id", "-"), round_no, outcome)
                return
            except (PoisonMessage, psycopg.DataError, UnicodeEncodeError) as exc:
                await dead_letter(event, classify(exc)[1], describe(exc),
                                  getattr(ev, "job_id", None))
                return
            except (RetryableError, OutcomeUnknown) as exc:
                if attempt < s.retry_in_place:
                    attempt += 1
                    wait = random.uniform(0, min(IN_PLACE_CAP_S, IN_PLACE_BASE_S * 2 ** attempt))
                    log.warning("%s: transient failure (%s), in-place retry %d in %.1fs", name,
                                exc, attempt, wait)
                    await asyncio.sleep(wait)
                    continue
                if round_no + 1 > s.retry_rounds:
                    reason = f"retry budget exhausted after {round_no} rounds: {exc}"
                    # not_ready: the stage's input (the previous checkpoint) never became
                    # visible, so this copy is ahead of its job (forged, or superseded by a
                    # re-run): only the copy is dead-lettered; failing the job would let one
                    # stray message end good work (adv12). A job really stuck is the
                    # sweeper's (expired leases, stalls between stages).
                    if hasattr(ev, "job_id") and getattr(exc, "code", None) != "not_ready":
                        try:
                            await asyncio.to_thread(give_up, ctx, ev, "retry_budget_exhausted",
                                                    reason)
                        except RetryableError as db_exc:
                            log.error("%s: could not fail job %s: %s", name, ev.job_id, db_exc)
                    await dead_letter(event, "retry_budget_exhausted", reason)
                    return
                await to_retry(event, exc, round_no + 1)
                return
            except Exception as exc:  # a bug must not crash-loop the partition
                # run_stage already ended the stage and failed the job (internal_error).
                log.exception("processing failed %s[%d]@%d: unhandled error; next: "
                              "dead-letter (unhandled)", event.message.topic,
                              event.message.partition, event.message.offset)
                await dead_letter(event, UNHANDLED, describe(exc), getattr(ev, "job_id", None))
                return

    tracker = getattr(app, "completion_tracker", None) or offsets.install(
        app, stuck_after_s=s.sweep_stall_grace_s)

    async def guarded(event: faust.EventT[Any], body: Callable[[], Awaitable[None]]) -> None:
        """The one guard around a consumed message (``body()`` processes it): whatever
        escapes decoding, handling or routing is dead-lettered (``unhandled``); the agent
        never crashes."""
        try:
            with logs.message_scope(event.message.headers, **scope):
                await body()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("processing failed %s[%d]@%d: %s; next: dead-letter (unhandled)",
                          event.message.topic, event.message.partition, event.message.offset,
                          describe(exc))
            await dead_letter(event, UNHANDLED, describe(exc))

    async def run_one(event: faust.EventT[Any], epoch: int) -> None:
        msg = event.message
        try:
            await guarded(event, functools.partial(process, event, 0))
        except asyncio.CancelledError:
            raise  # stopping: not done, so its offset is never committed (redelivered)
        except Exception:  # even the dead letter failed: not done either
            log.exception("%s: %s[%d]@%d not done; its offset is held back until it is "
                          "redelivered", name, msg.topic, msg.partition, msg.offset)
            return
        faults.point("stage_after_commit_before_offset")
        tracker.done(msg.tp, msg.offset, epoch)

    async def rewind_if_gap(event: faust.EventT[Any]) -> None:
        """Seek the event's partition back if messages between the position it was sought to
        and this event were fetched but never reached this agent (``streams/offsets.py``,
        "gap"): they are read again; the commit stays below them meanwhile."""
        msg = event.message
        back = tracker.take_rewind(msg.tp)
        if back is not None:
            log.warning("%s: %s[%d]@%d arrived but offsets from %d were never taken (dropped "
                        "after a seek); seeking back to %d", name, msg.topic, msg.partition,
                        msg.offset, back, back)
            try:
                await app.consumer.seek(msg.tp, back)
            except Exception as exc:  # noqa: BLE001 - revoked meanwhile: the next owner re-reads
                log.warning("%s: seek back of %s[%d] failed: %s", name, msg.topic,
                            msg.partition, describe(exc))

    def current(event: faust.EventT[Any]) -> bool:
        """False for an event taken before a rebalance that happened while it waited for a
        slot (faust's own generation check, repeated): the partition's next owner, maybe
        this worker again, re-reads it from the committed offset. Registering it now would
        let the commit jump past the messages re-read before it."""
        return (app.flow_control.is_active()
                and event.message.generation_id == app.consumer_generation_id)

    async def agent(stream: faust.StreamT[Any]) -> None:
        # One faust actor takes the events in partition order and runs up to `concurrency`
        # of them as tasks; the offset committed per partition is the lowest one not done
        # (streams/offsets.py), so a crash or a rebalance never skips an unfinished message.
        slots = asyncio.Semaphore(concurrency)
        running: set[asyncio.Task[None]] = set()
        try:
            async for event in stream.events():
                await slots.acquire()
                if not current(event):  # held while a rebalance happened: not ours to run
                    slots.release()
                    continue
                epoch = tracker.received(event.message.tp, event.message.offset)
                await rewind_if_gap(event)
                task = asyncio.create_task(run_one(event, epoch))
                running.add(task)
                task.add_done_callback(running.discard)
                task.add_done_callback(lambda _t: slots.release())
        finally:
            for task in running:  # stopping: their offsets stay uncommitted (redelivered)
                task.cancel()

    async def retry_agent(stream: faust.StreamT[Any]) -> None:
        async for event in stream.events():
            msg = event.message
            epoch = tracker.received(msg.tp, msg.offset)
            await rewind_if_gap(event)
            try:
                await guarded(event, functools.partial(process_retry, event))
            except asyncio.CancelledError:
                raise  # stopping: not done, its offset is not committed
            tracker.done(msg.tp, msg.offset, epoch)

    agent.__name__ = name
    retry_agent.__name__ = f"{name}_retry"
    app.agent(retry_topic, name=f"{name}_retry", concurrency=1)(retry_agent)
    return app.agent(topic, name=name, concurrency=1)(agent)
