"""The shared body of every stage agent: decode, run, dead-letter, retry.

Routing (style.md lesson 4: agents stay thin, failures are routed explicitly):

- poison (undecodable, schema-violating, wrong type, rejected by the handler) -> ``<topic>.dlq``
  with ``dlq_reason_code``, ``dlq_reason`` and the original topic/partition/offset in headers;
- transient (:class:`RetryableError`, :class:`OutcomeUnknown`): retried in place
  ``retry_in_place`` times with full-jitter backoff (a Postgres blip), then sent to
  ``<topic>.retry`` with ``retry_count`` and ``retry_not_before_ms`` headers and acked, so the
  partition moves on. A retry agent re-runs it after the not-before time; after
  ``retry_rounds`` rounds the job fails (``retry_budget_exhausted``) and the message is
  dead-lettered for inspection;
- a bug (any other exception) -> dead-lettered with reason ``unhandled``, never a crash loop.

Offsets follow completion: the committed offset of a partition is the lowest one whose message
is not done yet (``streams/offsets.py``), never faust's ack tracking, so the offset commit
always follows the stage's Postgres transaction (or the retry/DLQ produce, which is awaited
until acknowledged), whatever the agent's concurrency.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from typing import Any

import faust

from jobstream import faults, logs
from jobstream.errors import OutcomeUnknown, PoisonMessage, RetryableError
from jobstream.kafka import dlq_headers
from jobstream.stages import SPECS, StageContext, give_up
from schemas.events import decode_event
from streams import offsets

log = logging.getLogger("jobstream.streams")

IN_PLACE_BASE_S = 0.5
IN_PLACE_CAP_S = 5.0


def _items(headers: Any) -> list[tuple[str, bytes]]:
    """faust message headers (a dict or a list of pairs) as ``(name, bytes)`` pairs."""
    items = (headers or {}).items() if isinstance(headers, dict | None) else headers
    return [(k, v if isinstance(v, bytes) else str(v).encode()) for k, v in items]


def _header(event: faust.EventT, name: str) -> str | None:
    for k, v in _items(event.message.headers):
        if k == name:
            return v.decode() if isinstance(v, bytes) else str(v)
    return None


def retry_delay_s(round_no: int, base_s: float, cap_s: float, retry_after_s: float | None
                  ) -> float:
    """Delay before retry round ``round_no`` (1-based): full-jitter exponential backoff
    (Brooker 2015), never shorter than the provider's Retry-After (seconds)."""
    jitter = random.uniform(0, min(cap_s, base_s * 2 ** (round_no - 1)))
    return max(retry_after_s or 0.0, jitter)


def register_stage_agent(app: faust.App, ctx: StageContext, *, name: str, consumes: str,
                         handler: Callable[[StageContext, Any], Any],
                         topic_name: str | None = None, concurrency: int = 1) -> Any:
    """Register the agent of topic ``topic_name`` (logical name; default ``consumes``, the
    event type it accepts) running ``handler(ctx, event)`` in up to ``concurrency`` events at
    once, and its retry agent on ``<topic>.retry``. Returns the main agent."""
    s = ctx.settings
    kw: dict[str, Any] = {"value_serializer": "raw", "key_serializer": "raw",
                          "partitions": s.topic_partitions}
    source = topic_name or consumes
    topic = app.topic(s.topic(source), **kw)
    retry_topic = app.topic(s.topic(source + ".retry"), **kw)
    dlq = app.topic(s.topic(source + ".dlq"), **kw)
    # Log context + trace span of each message (intake is where a trace may start).
    scope = {"stage": SPECS[consumes].stage if consumes in SPECS else "uploaded",
             "group": app.conf.id, "start_trace": consumes == "document.uploaded"}

    async def dead_letter(event: faust.EventT, code: str, reason: str) -> None:
        msg = event.message
        src_topic = _header(event, "retry_original_topic") or msg.topic
        log.warning("dead-lettering %s[%d]@%d: %s: %s", msg.topic, msg.partition, msg.offset,
                    code, reason)
        headers = {k: v for k, v in _items(msg.headers)
                   if not k.startswith(("dlq_", "retry_"))}  # keep request_id, event_id, ...
        headers.update(dlq_headers(code, reason, src_topic, msg.partition, msg.offset))
        fut = await dlq.send(key=msg.key, value=msg.value, headers=headers)
        await fut  # acknowledged by the broker before the original is acked

    async def to_retry(event: faust.EventT, exc: Exception, round_no: int) -> None:
        delay = retry_delay_s(round_no, s.retry_base_s, s.retry_cap_s,
                              getattr(exc, "retry_after_s", None))
        msg = event.message
        headers = {k: v for k, v in _items(msg.headers) if not k.startswith("retry_")}
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

    async def process(event: faust.EventT, round_no: int) -> None:
        """Run one message: round 0 from the main topic, round N>=1 from the retry topic."""
        try:
            ev = decode_event(event.message.value, expected=consumes)
        except PoisonMessage as exc:
            await dead_letter(event, exc.code, str(exc))
            return
        logs.bind(request_id=ev.request_id, tenant=ev.tenant_id, event_type=ev.event_type,
                  job_id=getattr(ev, "job_id", None))
        attempt = 0
        while True:
            try:
                outcome = await asyncio.to_thread(handler, ctx, ev)
                log.info("%s %s job=%s round=%d -> %s", name, ev.event_type,
                         getattr(ev, "job_id", "-"), round_no, outcome)
                return
            except PoisonMessage as exc:
                await dead_letter(event, exc.code, str(exc))
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
                    if hasattr(ev, "job_id"):
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
                log.exception("%s: unhandled error; dead-lettering", name)
                await dead_letter(event, "unhandled", f"{type(exc).__name__}: {exc}")
                return

    tracker = getattr(app, "completion_tracker", None) or offsets.install(app)

    async def run_one(event: faust.EventT, epoch: int) -> None:
        msg = event.message
        try:
            with logs.message_scope(msg.headers, **scope):
                await process(event, 0)
        except asyncio.CancelledError:
            raise  # stopping: not done, so its offset is never committed (redelivered)
        except Exception:  # e.g. the dead-letter produce failed: not done either
            log.exception("%s: %s[%d]@%d not done; its offset is held back until it is "
                          "redelivered", name, msg.topic, msg.partition, msg.offset)
            return
        faults.point("stage_after_commit_before_offset")
        tracker.done(msg.tp, msg.offset, epoch)

    def current(event: faust.EventT) -> bool:
        """False for an event taken before a rebalance that happened while it waited for a
        slot (faust's own generation check, repeated): the partition's next owner, maybe
        this worker again, re-reads it from the committed offset. Registering it now would
        let the commit jump past the messages re-read before it."""
        return (app.flow_control.is_active()
                and event.message.generation_id == app.consumer_generation_id)

    async def agent(stream: faust.StreamT) -> None:
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
                task = asyncio.create_task(run_one(event, epoch))
                running.add(task)
                task.add_done_callback(running.discard)
                task.add_done_callback(lambda _t: slots.release())
        finally:
            for task in running:  # stopping: their offsets stay uncommitted (redelivered)
                task.cancel()

    async def retry_agent(stream: faust.StreamT) -> None:
        async for event in stream.events():
            msg = event.message
            epoch = tracker.received(msg.tp, msg.offset)
            try:
                not_before = int(_header(event, "retry_not_before_ms") or 0) / 1000
                wait = not_before - time.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                with logs.message_scope(msg.headers, **scope):
                    await process(event, int(_header(event, "retry_count") or 1))
            except asyncio.CancelledError:
                raise  # stopping: not done, its offset is not committed
            tracker.done(msg.tp, msg.offset, epoch)

    agent.__name__ = name
    retry_agent.__name__ = f"{name}_retry"
    app.agent(retry_topic, name=f"{name}_retry", concurrency=1)(retry_agent)
    return app.agent(topic, name=name, concurrency=1)(agent)
