"""The faust app of the stage workers: ``jobstream worker`` runs it.

One consumer group (``<prefix>jobstream-streams``) for all agents; topics are created by
``jobstream topics`` beforehand (``topic_allow_declare=False``), so partition counts are
configuration, not a side effect of whichever worker started first.
"""

from __future__ import annotations

from collections.abc import Iterable

import faust

from jobstream.settings import Settings
from jobstream.stages import StageContext
from jobstream.store import Store
from streams import chunk, extract, intake, llm, publish, validate

AGENT_MODULES = {"intake": intake, "extract": extract, "chunk": chunk, "llm": llm,
                 "validate": validate, "publish": publish}


def create_app(settings: Settings, stages: Iterable[str] | None = None,
               store: Store | None = None) -> tuple[faust.App, StageContext]:
    """Build the faust app with the agents of ``stages`` (default: all six).

    Raises ``KeyError`` for an unknown stage name.
    """
    names = list(stages or AGENT_MODULES)
    unknown = [n for n in names if n not in AGENT_MODULES]
    if unknown:
        raise KeyError(f"unknown stages {unknown}; known: {list(AGENT_MODULES)}")
    session_s = settings.consumer_session_timeout_ms / 1000
    app = faust.App(
        settings.group("jobstream-streams"),
        broker=[f"kafka://{h.strip()}" for h in settings.kafka_bootstrap_servers.split(",")],
        store="memory://",
        web_enabled=False,
        topic_disable_leader=True,
        topic_allow_declare=False,
        topic_partitions=settings.topic_partitions,
        consumer_auto_offset_reset="earliest",
        broker_session_timeout=session_s,
        broker_heartbeat_interval=max(0.5, session_s / 5),
        broker_commit_interval=1.0,
        producer_acks=-1,
        processing_guarantee="at_least_once",
    )
    ctx = StageContext(settings=settings, store=store or Store(settings.database_url))
    for name in names:
        AGENT_MODULES[name].register(app, ctx)
    return app, ctx
