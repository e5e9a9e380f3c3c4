"""The faust app of the stage workers: ``jobstream worker`` runs it.

One consumer group (``<prefix>jobstream-streams``) for all agents; topics are created by
``jobstream topics`` beforehand (``topic_allow_declare=False``), so partition counts are
configuration, not a side effect of whichever worker started first.
"""

from __future__ import annotations

import importlib
import os
import tempfile
from collections.abc import Callable, Iterable
from time import monotonic
from typing import Any

import faust
from faust.sensors import Monitor

from jobstream.settings import Settings
from jobstream.store import Store
from schemas.pipeline import PIPELINE, Pipeline
from streams import delivery, offsets, records
from streams.context import StageContext
from streams.tables import NoTablesManager


def agents(pipeline: Pipeline = PIPELINE) -> dict[str, Callable[[faust.App, StageContext], Any]]:
    """Agent name -> its register function, in flow order, derived from ``pipeline``: the
    stage ``<name>`` is ``streams.<name>.register``; its lane ``<lane>`` is
    ``streams.<name>.register_<lane>`` (agent ``<name>_<lane>``). Raises
    ``ModuleNotFoundError`` / ``AttributeError`` for a stage without its module."""
    out: dict[str, Callable[[faust.App, StageContext], Any]] = {}
    for stage in pipeline.stages:
        module = importlib.import_module(f"streams.{stage.name}")
        out[stage.name] = module.register
        for lane in stage.lanes:
            out[f"{stage.name}_{lane}"] = getattr(module, f"register_{lane}")
    return out


def lanes(pipeline: Pipeline = PIPELINE) -> dict[str, tuple[str, ...]]:
    """Which agents a worker of each lane runs. ``all`` is one process for everything; the
    lanes split each stage that has a batch lane into two consumer pools (run one or the other
    style, not both): ``batch`` runs only the lane agents, ``interactive`` the others."""
    every = pipeline.agents()
    batch = tuple(f"{s.name}_batch" for s in pipeline.stages if "batch" in s.lanes)
    return {"all": every, "interactive": tuple(a for a in every if a not in batch),
            "batch": batch}


class QuietMonitor(Monitor):
    """faust's Monitor without its per-message bookkeeping (issue 12): faust calls it four
    times per message (message in/out, stream event in/out) and once per produce, to keep
    counters and per-stream timings that only faust's web views read, and the workers run
    with ``web_enabled=False``. Offset commits, end offsets and rebalances are still tracked
    (the base class), and so is ``stream_inbound_time`` (when a stream last took an event of
    a partition, monotonic s): faust's consumer reads it in its livelock check, and without it
    a worker older than ``stream_processing_timeout`` (300 s) logged ERROR "Stream has not
    started processing" for every partition with a backlog beyond its fetch position (breaker7).
    """

    def on_message_in(self, tp: Any, offset: int, message: Any) -> None:
        """Not tracked."""

    def on_stream_event_in(self, tp: Any, offset: int, stream: Any, event: Any) -> None:
        """Only the partition's inbound time (faust's livelock check reads it)."""
        self.stream_inbound_time[tp] = monotonic()

    def on_stream_event_out(self, tp: Any, offset: int, stream: Any, event: Any,
                            state: Any = None) -> None:
        """Not tracked."""

    def on_message_out(self, tp: Any, offset: int, message: Any) -> None:
        """Not tracked."""

    def on_send_initiated(self, producer: Any, topic: str, message: Any, keysize: int,
                          valsize: int) -> None:
        """Not tracked."""

    def on_send_completed(self, producer: Any, state: Any, metadata: Any) -> None:
        """Not tracked."""

    def on_send_error(self, producer: Any, exc: BaseException, state: Any) -> None:
        """Not tracked."""


AGENTS = agents()
#: Which agents a worker of each lane runs (:func:`lanes`).
LANES = lanes()


def create_app(settings: Settings, stages: Iterable[str] | None = None,
               store: Store | None = None, lane: str = "all") -> tuple[faust.App, StageContext]:
    """Build the faust app of one worker process.

    ``lane`` picks the agents (:data:`LANES`) and the consumer group
    (``<prefix>jobstream-streams`` for ``all``, ``…-interactive`` / ``…-batch`` for a lane);
    ``stages`` narrows the agents further. Raises ``KeyError`` for an unknown lane or stage.
    """
    if lane not in LANES:
        raise KeyError(f"unknown lane {lane!r}; known: {list(LANES)}")
    names = list(stages or LANES[lane])
    unknown = [n for n in names if n not in AGENTS]
    if unknown:
        raise KeyError(f"unknown stages {unknown}; known: {list(AGENTS)}")
    session_s = settings.consumer_session_timeout_ms / 1000
    group = settings.group("jobstream-streams" + ("" if lane == "all" else f"-{lane}"))
    # faust keeps its table/leader state in ``datadir`` (default: ./<app id>-data in the working
    # directory); with memory:// stores nothing there outlives the process. faust does not create
    # the parent folder.
    records.install()  # a header name that is not UTF-8 must not crash the fetcher
    delivery.install()  # no four tasks per fetched message (streams/delivery.py)
    datadir = os.path.join(tempfile.gettempdir(), "jobstream-faust")
    os.makedirs(datadir, exist_ok=True)
    datadir = os.path.join(datadir, group)
    app = faust.App(
        group,
        broker=[f"kafka://{h.strip()}" for h in settings.kafka_bootstrap_servers.split(",")],
        store="memory://",
        datadir=datadir,
        web_enabled=False,
        topic_disable_leader=True,
        topic_allow_declare=False,
        topic_partitions=settings.topic_partitions,
        consumer_auto_offset_reset="earliest",
        broker_session_timeout=session_s,
        broker_heartbeat_interval=max(0.5, session_s / 5),
        broker_commit_interval=1.0,
        producer_acks=-1,
        # Retry copies are the originals (up to kafka_message_max_bytes) plus retry headers.
        producer_max_request_size=settings.kafka_message_max_bytes + settings.dlq_headroom_bytes,
        processing_guarantee="at_least_once",
        # Offsets follow completion (streams/offsets.py), so a rebalance or a stop need not
        # wait for running stage work (it is redelivered), and faust prints no actor
        # tracebacks while it would wait.
        stream_wait_empty=False,
        monitor=QuietMonitor(),
        TableManager=NoTablesManager,  # no faust tables: no 1 s start-up pause for them
    )
    offsets.install(app)
    ctx = StageContext(settings=settings, store=store or Store.for_process(
        settings, "worker", settings.db_pool_worker_max))
    for name in names:
        AGENTS[name](app, ctx)
    return app, ctx
