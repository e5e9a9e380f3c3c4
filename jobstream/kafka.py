"""Kafka plumbing shared by the relay, the consumers and the CLI: client configs and topics.

Topic names are logical names plus ``Settings.topic_prefix``. Every consumed topic has a
``<topic>.dlq`` twin (poison messages, with the reason in headers); every topic the stage
workers consume also has a ``<topic>.retry`` twin (transient failures, with a not-before time).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import re
import threading
import time
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from consumers.headers import HEADERS_UNREADABLE, dlq_headers, read_headers  # noqa: F401
from jobstream.settings import Settings
from schemas.pipeline import PIPELINE, Pipeline

#: Logical topics of the pipeline, in flow order, from the one definition
#: (``schemas.pipeline``). The costly stage has one topic per lane: batch work waits in its own
#: topic and consumer pool, never ahead of a person's document.
PIPELINE_TOPICS = PIPELINE.topics()
#: Topics the faust stage workers consume, hence with ``.retry`` and ``.dlq`` twins.
STAGE_TOPICS = PIPELINE.stage_topics()
#: Topics something consumes, hence with a dead-letter twin.
CONSUMED_TOPICS = PIPELINE.consumed_topics()
#: Event types whose topic depends on the job's lane: event type -> topic of the batch lane.
LANE_TOPICS = PIPELINE.lane_topics()


def topic_for(event_type: str, lane: str | None) -> str:
    """Logical topic of an event of ``event_type`` for a job of ``lane``."""
    return PIPELINE.topic_for(event_type, lane)


def logical_topics(pipeline: Pipeline = PIPELINE) -> list[str]:
    """Every logical topic of ``pipeline`` (unprefixed): its topics, then a ``.retry`` twin
    of each stage topic and a ``.dlq`` twin of each consumed topic."""
    return (list(pipeline.topics()) + [f"{t}.retry" for t in pipeline.stage_topics()]
            + [f"{t}.dlq" for t in pipeline.consumed_topics()])


def all_topics(settings: Settings, pipeline: Pipeline = PIPELINE) -> list[str]:
    """Every topic jobstream uses (pipeline topics, ``.retry`` and ``.dlq`` twins), prefixed."""
    return [settings.topic(n) for n in logical_topics(pipeline)]


class LibrdkafkaLogger:
    """Where librdkafka's log lines go (the ``logger`` client setting) instead of raw
    ``%4|<time>|<FAC>|<client>| ...`` lines on stderr: the Python logger
    ``jobstream.rdkafka``, WARNING and above only, as ``librdkafka <FACILITY>: <text>``.

    A line that repeats (same level, facility and text, numbers aside) within ``window_s``
    seconds is counted, not written again; the count is written as ``... (repeated N times in
    Xs)`` with the next different line or the next repeat after the window. Thread-safe:
    librdkafka calls it from its own threads.
    """

    def __init__(self, name: str = "jobstream.rdkafka", window_s: float = 60.0) -> None:
        self.out = logging.getLogger(name)
        self.window_s = window_s
        self._lock = threading.Lock()
        self._last: tuple[int, str, str] | None = None
        self._last_text = ""
        self._since = 0.0
        self._repeats = 0

    def _flush(self) -> None:
        if self._last is not None and self._repeats:
            level, fac, _ = self._last
            self.out.log(level, "librdkafka %s: %s (repeated %d times in %.0fs)", fac,
                         self._last_text, self._repeats, time.monotonic() - self._since)
        self._repeats = 0

    def log(self, level: int, fmt: str, *args: Any) -> None:
        """Called by confluent-kafka as ``logger.log(level, "%s [%s] %s", facility, client,
        text)`` with a Python logging level."""
        if level < logging.WARNING or not self.out.isEnabledFor(level):
            return
        fac = str(args[0]) if args else "?"
        text = (fmt % args) if args else fmt
        if len(args) == 3:
            text = f"[{args[1]}] {args[2]}"
        key = (level, fac, re.sub(r"\d+", "N", text))
        with self._lock:
            now = time.monotonic()
            if key == self._last and now - self._since < self.window_s:
                self._repeats += 1
                return
            self._flush()
            self._last, self._last_text, self._since = key, text, now
            self.out.log(level, "librdkafka %s: %s", fac, text)


#: One per process: repeats are folded over every client of the process.
LIBRDKAFKA_LOG = LibrdkafkaLogger()


def base_config(settings: Settings) -> dict[str, Any]:
    """librdkafka settings common to every client (bootstrap + pass-through extras), with its
    log routed through Python logging (:class:`LibrdkafkaLogger`, logger
    ``jobstream.rdkafka`` = :data:`jobstream.outage.RDKAFKA_LOGGER`, where an outage collapses
    to one line at its start and one at its end)."""
    return {"bootstrap.servers": settings.kafka_bootstrap_servers, "logger": LIBRDKAFKA_LOG,
            **settings.kafka_extra}


def producer_config(settings: Settings, **extra: Any) -> dict[str, Any]:
    """An idempotent producer: ``enable.idempotence=true`` and ``acks=all`` (design.md), that
    refuses messages over ``kafka_message_max_bytes`` (``message.max.bytes``) at produce()."""
    return {**base_config(settings), "enable.idempotence": True, "acks": "all",
            "linger.ms": 5, "compression.type": "lz4",
            "message.max.bytes": settings.kafka_message_max_bytes, **extra}


def topic_max_message_bytes(settings: Settings, name: str) -> int:
    """``max.message.bytes`` a topic is created with (bytes): ``kafka_message_max_bytes``, and
    ``dlq_headroom_bytes`` more for a ``.dlq`` topic, whose messages are the originals plus the
    ``dlq_*`` headers (so a DLQ always fits what its source topic accepted)."""
    extra = settings.dlq_headroom_bytes if name.endswith(".dlq") else 0
    return settings.kafka_message_max_bytes + extra


def topic_config(settings: Settings, name: str) -> dict[str, str]:
    """The configuration a topic is created with: ``max.message.bytes``
    (:func:`topic_max_message_bytes`), and for a ``.retry`` topic
    ``message.timestamp.type=LogAppendTime``: the retry agent bounds a message's wait by its
    timestamp plus ``retry_cap_s`` (``streams.base.retry_wait_s``), so that timestamp must be
    the broker's, not a CreateTime a producer may forge (design-notes.md, "A forged
    retry_not_before_ms")."""
    config = {"max.message.bytes": str(topic_max_message_bytes(settings, name))}
    if name.endswith(".retry"):
        config["message.timestamp.type"] = "LogAppendTime"
    return config


def consumer_config(settings: Settings, group: str, **extra: Any) -> dict[str, Any]:
    """An at-least-once consumer: offsets are stored by hand after the effect's transaction
    commits (``enable.auto.offset.store=false``) and auto-committed from that store."""
    return {**base_config(settings), "group.id": group, "enable.auto.commit": True,
            "auto.commit.interval.ms": 1000, "enable.auto.offset.store": False,
            "auto.offset.reset": "earliest", "isolation.level": "read_committed",
            "session.timeout.ms": settings.consumer_session_timeout_ms,
            "heartbeat.interval.ms": max(500, settings.consumer_session_timeout_ms // 5),
            **extra}


def topic_partitions(settings: Settings, name: str) -> int:
    """Partitions a topic is created with: ``retry_topic_partitions`` for a ``.retry`` topic
    (transient failures only, consumed by every stage worker: each partition is decoded in
    every fetch), ``topic_partitions`` for the others."""
    if name.endswith(".retry"):
        return settings.retry_topic_partitions
    return settings.topic_partitions


def ensure_topics(settings: Settings, timeout_s: float = 30.0) -> list[str]:
    """Create missing topics (partitions (:func:`topic_partitions`) and replication from
    settings, configuration from :func:`topic_config`); returns those created. Existing topics
    keep their configuration.

    Raises ``KafkaException`` when the broker refuses or does not answer within ``timeout_s``.
    """
    admin = AdminClient(base_config(settings))
    existing = set(admin.list_topics(timeout=timeout_s).topics)
    wanted = [t for t in all_topics(settings) if t not in existing]
    if not wanted:
        return []
    futures = admin.create_topics(
        [NewTopic(t, num_partitions=topic_partitions(settings, t),
                  replication_factor=settings.topic_replication,
                  config=topic_config(settings, t))
         for t in wanted],
        operation_timeout=timeout_s)
    created = []
    for name, fut in futures.items():
        try:
            fut.result(timeout=timeout_s)
            created.append(name)
        except KafkaException as exc:
            if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise
    # Metadata propagates asynchronously; wait until every topic is visible with leaders.
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        md = admin.list_topics(timeout=timeout_s).topics
        if all(t in md and md[t].error is None and md[t].partitions for t in wanted):
            break
        time.sleep(0.2)
    return created


def delete_topics(settings: Settings, timeout_s: float = 30.0) -> list[str]:
    """Delete every topic and every empty consumer group of ``settings.topic_prefix`` (a
    non-empty prefix is required: this is for tests and throwaway runs such as benchmarks and
    chaos points). Returns the topic names deleted; errors are ignored (a group that still has
    members stays)."""
    if not settings.topic_prefix:
        raise ValueError("refusing to delete topics without a topic prefix")
    admin = AdminClient(base_config(settings))
    with contextlib.suppress(KafkaException, TimeoutError, concurrent.futures.TimeoutError):
        groups = [g.group_id for g in admin.list_consumer_groups(
            request_timeout=timeout_s).result(timeout=timeout_s).valid
            if g.group_id.startswith(settings.topic_prefix)]
        for gfut in (admin.delete_consumer_groups(groups, request_timeout=timeout_s).values()
                     if groups else ()):
            with contextlib.suppress(KafkaException):
                gfut.result(timeout=timeout_s)
    try:
        names = [t for t in admin.list_topics(timeout=timeout_s).topics
                 if t.startswith(settings.topic_prefix)]
    except KafkaException:
        return []
    if not names:
        return []
    for fut in admin.delete_topics(names, operation_timeout=timeout_s).values():
        with contextlib.suppress(KafkaException):
            fut.result(timeout=timeout_s)
    return names


def read_to_end(settings: Settings, topics: list[str], timeout_s: float = 30.0) -> list[Message]:
    """Every message of ``topics`` (full names) up to their end offsets at call time, read
    with a throwaway, never-committing consumer that joins no group.

    Raises ``RuntimeError`` when a partition cannot be read to its end within ``timeout_s``.
    """
    c = Consumer({**base_config(settings), "group.id": f"jobstream-reader-{time.time_ns()}",
                  "enable.auto.commit": False, "auto.offset.reset": "earliest"})
    try:
        ends: dict[tuple[str, int], int] = {}
        starts: list[TopicPartition] = []
        for topic in topics:
            for p in c.list_topics(topic, timeout=10).topics[topic].partitions:
                lo, hi = c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)
                if hi > lo:
                    ends[(topic, p)] = hi
                    starts.append(TopicPartition(topic, p, lo))
        if not starts:
            return []
        c.assign(starts)
        todo, out = set(ends), []
        deadline = time.monotonic() + timeout_s
        while todo and time.monotonic() < deadline:
            m = c.poll(0.5)
            if m is None:
                continue
            err = m.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    continue
                raise KafkaException(err)
            tp, offset = (m.topic() or "", m.partition() or 0), m.offset() or 0
            if tp in ends and offset < ends[tp]:
                out.append(m)
            if tp in ends and offset >= ends[tp] - 1:
                todo.discard(tp)
        if todo:
            raise RuntimeError(f"could not read {sorted(todo)} to their end offsets")
        return out
    finally:
        c.close()


#: Errors a topic answers with for a moment after it was created (its leader being elected).
SETTLING_ERRORS = frozenset((KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE,
                             KafkaError.UNKNOWN_TOPIC_OR_PART))


def group_lag(settings: Settings, group: str, topics: list[str], *,
              settle_s: float = 10.0) -> int:
    """Messages of ``topics`` (full names) that consumer group ``group`` has not committed
    yet (0 = the group has processed and committed everything there is). Joins no group.

    A retriable broker error (a topic created a moment ago answers "not leader for
    partition" while its leader is elected) is asked again for up to ``settle_s`` seconds;
    raises ``KafkaException`` after that, or at once for any other error."""
    c = Consumer({**base_config(settings), "group.id": group, "enable.auto.commit": False})
    deadline = time.monotonic() + settle_s
    try:
        while True:
            try:
                tps = [TopicPartition(t, p) for t in topics
                       for p in c.list_topics(t, timeout=10).topics[t].partitions]
                lag = 0
                for tp in c.committed(tps, timeout=10):
                    lo, hi = c.get_watermark_offsets(TopicPartition(tp.topic, tp.partition),
                                                     timeout=10)
                    lag += max(0, hi - max(tp.offset, lo))
                return lag
            except KafkaException as exc:
                err = exc.args[0] if exc.args else None
                if not (isinstance(err, KafkaError)
                        and (err.retriable() or err.code() in SETTLING_ERRORS)
                        and time.monotonic() < deadline):
                    raise
                time.sleep(0.2)
    finally:
        c.close()
