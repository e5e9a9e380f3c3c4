"""The shared body of every stage agent: decode, run, dead-letter, retry in place."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable
from typing import Any

import faust

from jobstream import faults
from jobstream.errors import OutcomeUnknown, PoisonMessage, RetryableError
from jobstream.stages import StageContext
from schemas.events import decode_event

log = logging.getLogger("jobstream.streams")

#: In-place retry of transient failures (Postgres restarting, a checkpoint not visible yet):
#: full-jitter backoff, capped (seconds). The message is never acked while it is retried.
RETRY_BASE_S = 0.5
RETRY_CAP_S = 15.0


def dlq_headers(reason_code: str, reason: str, topic: str, partition: int,
                offset: int) -> dict[str, bytes]:
    """Headers of a dead-lettered message: the reason and where it came from."""
    return {
        "dlq_reason_code": reason_code.encode(),
        "dlq_reason": reason[:2000].encode(),
        "dlq_original_topic": topic.encode(),
        "dlq_original_partition": str(partition).encode(),
        "dlq_original_offset": str(offset).encode(),
    }


def register_stage_agent(app: faust.App, ctx: StageContext, *, name: str, consumes: str,
                         handler: Callable[[StageContext, Any], Any]) -> Any:
    """Register one agent on topic ``consumes`` (logical name) running ``handler(ctx, event)``.

    Poison messages (undecodable, schema-violating, wrong type, or rejected by the handler as
    :class:`PoisonMessage`) go to ``<topic>.dlq`` with the reason in headers; then the agent
    moves on. :class:`RetryableError` / :class:`OutcomeUnknown` retry the same message in place.
    An unexpected exception also dead-letters the message (reason ``unhandled``) rather than
    crash-looping the partition.
    """
    topic = app.topic(ctx.settings.topic(consumes), value_serializer="raw",
                      key_serializer="raw", partitions=ctx.settings.topic_partitions)
    dlq = app.topic(ctx.settings.topic(consumes + ".dlq"), value_serializer="raw",
                    key_serializer="raw", partitions=ctx.settings.topic_partitions)

    async def dead_letter(event: faust.EventT, code: str, reason: str) -> None:
        msg = event.message
        log.warning("dead-lettering %s[%d]@%d: %s: %s", msg.topic, msg.partition, msg.offset,
                    code, reason)
        fut = await dlq.send(key=msg.key, value=msg.value,
                             headers=dlq_headers(code, reason, msg.topic, msg.partition,
                                                 msg.offset))
        await fut  # delivered (acks=all) before the original is acked

    async def agent(stream: faust.StreamT) -> None:
        async for event in stream.events():
            try:
                ev = decode_event(event.message.value, expected=consumes)
            except PoisonMessage as exc:
                await dead_letter(event, exc.code, str(exc))
                continue
            attempt = 0
            while True:
                try:
                    outcome = await asyncio.to_thread(handler, ctx, ev)
                    log.info("%s %s job=%s -> %s", name, ev.event_type,
                             getattr(ev, "job_id", "-"), outcome)
                    break
                except PoisonMessage as exc:
                    await dead_letter(event, exc.code, str(exc))
                    break
                except (RetryableError, OutcomeUnknown) as exc:
                    wait = random.uniform(0, min(RETRY_CAP_S, RETRY_BASE_S * 2 ** attempt))
                    attempt += 1
                    log.warning("%s: transient failure (%s), retry %d in %.1fs", name, exc,
                                attempt, wait)
                    await asyncio.sleep(wait)
                except Exception as exc:  # a bug must not crash-loop the partition
                    log.exception("%s: unhandled error; dead-lettering", name)
                    await dead_letter(event, "unhandled", f"{type(exc).__name__}: {exc}")
                    break
            faults.point("stage_after_commit_before_offset")

    agent.__name__ = name
    return app.agent(topic, name=name, concurrency=1)(agent)
