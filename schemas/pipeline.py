"""The pipeline, defined once: the stages in order, each with its one name, the event it
consumes and the event it emits (each event type is also its topic) and its code version.

Everything else derives from :data:`PIPELINE` (or from a :class:`Pipeline` passed in, which
is how a test adds a stage): the topics ``jobstream topics`` creates and their ``.retry`` /
``.dlq`` twins (``jobstream.kafka``), the checkpoint chain the store writes
(``jobstream.store.STAGES``), the faust agents of ``jobstream worker`` (``streams.app``), the
CLI's stage choices (``worker --stages``, ``redrive --from``), the chaos invariants
(``jobstream.drills.chaos``), the AsyncAPI document (``schemas.asyncapi``), the demo's progress and
the ``stage`` label of the metrics.

A stage's name is the same everywhere: the faust agent, the checkpoint row
(``job_stage.stage``, ``job.current_stage``, ``provider_attempt.stage``), the ``stage`` field
of ``job.failed``, the CLI and the docs. Topics keep their event names (``job.accepted`` is
what intake emits and extract consumes).

This module is pure data (no jobstream import): ``schemas/`` must stay importable without the
service, and the AsyncAPI document is generated from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


@dataclass(frozen=True)
class Stage:
    """One stage of the pipeline.

    Attributes
    ----------
    name:
        The stage's one name: agent, checkpoint, CLI choice, metrics label, docs.
    consumes:
        The event type it consumes; also the logical topic it reads (before the deployment's
        topic prefix).
    emits:
        The event type it writes to the outbox when its checkpoint succeeds (also a topic).
    code_version:
        Version of the stage's code; a redrive recomputes a finished checkpoint whose code
        version changed (``Settings.stage_code_versions`` may override it).
    summary:
        A few words on what it does, for the docs and the AsyncAPI descriptions.
    lanes:
        Lane -> the topic the stage reads for jobs of that lane instead of ``consumes``
        (its own consumer pool, agent ``<name>_<lane>``). Events of type ``consumes`` for a
        job of that lane are written to that topic.
    """

    name: str
    consumes: str
    emits: str
    code_version: str
    summary: str = ""
    lanes: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))

    def agents(self) -> tuple[str, ...]:
        """Agent names of this stage: ``name``, then ``<name>_<lane>`` per lane."""
        return (self.name, *(f"{self.name}_{lane}" for lane in self.lanes))


@dataclass(frozen=True)
class Pipeline:
    """The stages in flow order, plus the terminal failure event every stage may emit.

    The first stage is intake (it creates the job, there is no job before it); the last
    stage's event is the pipeline's result, consumed by downstream services.
    Raises ``ValueError`` on construction when names repeat or the chain is broken (a stage
    must consume what the stage before it emits).
    """

    stages: tuple[Stage, ...]
    failed_event: str = "job.failed"

    def __post_init__(self) -> None:
        names = [s.name for s in self.stages]
        if len(set(names)) != len(names):
            raise ValueError(f"stage names repeat: {names}")
        for before, after in zip(self.stages, self.stages[1:], strict=False):
            if after.consumes != before.emits:
                raise ValueError(f"stage {after.name} consumes {after.consumes}, but "
                                 f"{before.name} emits {before.emits}")

    # ---------------------------------------------------------------- stages

    @property
    def names(self) -> tuple[str, ...]:
        """Stage names in order (the checkpoint chain)."""
        return tuple(s.name for s in self.stages)

    @property
    def job_stages(self) -> tuple[Stage, ...]:
        """The stages that run on an existing job (every stage after intake)."""
        return self.stages[1:]

    def stage(self, name: str) -> Stage:
        """The stage called ``name``. Raises ``KeyError`` naming the known stages."""
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(f"unknown stage {name!r}; stages: {list(self.names)}")

    def consumer_of(self, event_type: str) -> Stage:
        """The stage that consumes ``event_type``. Raises ``KeyError``."""
        for s in self.stages:
            if s.consumes == event_type:
                return s
        raise KeyError(f"no stage consumes {event_type!r}")

    def later(self, name: str) -> tuple[str, ...]:
        """Names of the stages after ``name``."""
        return self.names[self.names.index(name) + 1:]

    def previous(self, name: str) -> str:
        """Name of the stage before ``name``. Raises ``ValueError`` for the first stage."""
        i = self.names.index(name)
        if i == 0:
            raise ValueError(f"{name} is the first stage")
        return self.names[i - 1]

    def agents(self) -> tuple[str, ...]:
        """Every faust agent name, in order: each stage's name and its lane agents
        (``jobstream worker --stages`` choices)."""
        return tuple(a for s in self.stages for a in s.agents())

    # ---------------------------------------------------------------- topics

    @property
    def result_event(self) -> str:
        """The event of the last stage: what downstream services consume."""
        return self.stages[-1].emits

    def lane_topics(self) -> dict[str, str]:
        """Event type -> topic of the batch lane, for event types that have one."""
        return {s.consumes: topic for s in self.stages
                for lane, topic in s.lanes.items() if lane == "batch"}

    def topic_for(self, event_type: str, lane: str | None) -> str:
        """Logical topic of an event of ``event_type`` for a job of ``lane``."""
        for s in self.stages:
            if s.consumes == event_type and lane is not None and lane in s.lanes:
                return s.lanes[lane]
        return event_type

    def stage_topics(self) -> tuple[str, ...]:
        """Topics the stage workers consume (each stage's input and its lane topics), in
        flow order; each has ``.retry`` and ``.dlq`` twins."""
        return tuple(t for s in self.stages for t in (s.consumes, *s.lanes.values()))

    def topics(self) -> tuple[str, ...]:
        """Every logical topic of the pipeline in flow order: the stage topics, the result
        event and the failure event."""
        return (*self.stage_topics(), self.result_event, self.failed_event)

    def consumed_topics(self) -> tuple[str, ...]:
        """Topics something consumes (the stage topics and the result), hence with a
        ``.dlq`` twin."""
        return (*self.stage_topics(), self.result_event)

    def event_type_of(self, topic: str) -> str:
        """The event type ``topic`` carries (a lane topic carries its stage's input type)."""
        for s in self.stages:
            if topic in s.lanes.values():
                return s.consumes
        return topic


#: Checkpoint names before migration 0019 (one name per stage) -> the stage's name now.
#: The CLI still accepts the old names, with a deprecation message.
OLD_NAMES: Mapping[str, str] = MappingProxyType({
    "uploaded": "intake", "text_extracted": "extract", "chunks_ready": "chunk",
    "llm_done": "llm", "validated": "validate", "published": "publish"})

#: jobstream's pipeline.
PIPELINE = Pipeline(stages=(
    Stage("intake", "document.uploaded", "job.accepted", "intake-1",
          "creates the job (one per idempotency key and per dedup key)"),
    Stage("extract", "job.accepted", "job.text_extracted", "extract-1",
          "extracts the document's text (plain text; PDF via pypdf)"),
    Stage("chunk", "job.text_extracted", "job.chunks_ready", "chunk-1",
          "splits the text into chunks"),
    Stage("llm", "job.chunks_ready", "job.llm_done", "llm-1",
          "asks the model about each chunk (one recorded provider attempt per request)",
          lanes=MappingProxyType({"batch": "job.chunks_ready.batch"})),
    Stage("validate", "job.llm_done", "job.validated", "validate-1",
          "merges the chunk answers and validates them against DocumentAnalysis"),
    Stage("publish", "job.validated", "job.ready", "publish-1",
          "ends the job succeeded and publishes its result"),
))
