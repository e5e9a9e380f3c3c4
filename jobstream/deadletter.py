"""jobstream's view of the one message-routing component, :mod:`consumers.routing`.

Classification (poison / transient / bug), :class:`FailureCounter` and the durable dead-letter
sink live in the consumer library (``consumers/routing.py``) so the stage agents
(``streams/base.py``), the relay and every idempotent consumer share one implementation of
"route this message". This module only re-exports them and builds the sink from jobstream's
:class:`~jobstream.settings.Settings`.
"""

from __future__ import annotations

from consumers.routing import (  # noqa: F401 - re-exported
    CONSUMED_TOPIC_HEADER,
    DLQ_SUFFIX,
    HANDLER_ERROR,
    INVALID_DATA,
    STORED_HEADER,
    UNHANDLED,
    FailureCounter,
    Headers,
    Routed,
    classify,
    describe,
    safe_text,
    store_dead_letter,
)
from consumers.routing import DeadLetterSink as _Sink
from jobstream.kafka import producer_config
from jobstream.settings import Settings


class DeadLetterSink(_Sink):
    """:class:`consumers.routing.DeadLetterSink` configured from jobstream's ``settings``
    (producer config with its logger and ``kafka_extra``, ``database_url``, sizes, timeout)."""

    def __init__(self, settings: Settings, *, group: str) -> None:
        self.settings = settings
        super().__init__(producer_config(settings), dsn=settings.database_url, group=group,
                         max_message_bytes=settings.kafka_message_max_bytes,
                         dlq_produce_timeout_s=settings.dlq_produce_timeout_s,
                         dlq_headroom_bytes=settings.dlq_headroom_bytes)
