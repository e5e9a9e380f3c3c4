"""Generate the AsyncAPI 3.0 document of jobstream's topics from the pydantic models.

``python -m schemas.asyncapi`` writes ``schemas/asyncapi.json``; ``--check`` exits 1 when the
committed file differs from what the models and the pipeline definition (``schemas.pipeline``)
generate (drift). ``jobstream
schemas`` (``schemas.generate``) writes and checks it together with the JSON Schema files.

The document describes jobstream as the application: the topics it receives (``document.uploaded``
from other services and the stage topics), the topics it sends (the stage topics, ``job.ready``,
``job.failed``), every ``.retry`` and ``.dlq`` twin, the message payloads (the event models'
JSON Schemas under ``components.schemas``), the Kafka key of each topic and the headers.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from schemas.events import EVENT_MODELS, SCHEMA_VERSION
from schemas.pipeline import PIPELINE, Pipeline

OUT = Path(__file__).parent / "asyncapi.json"
KAFKA_BINDING_VERSION = "0.5.0"

#: Headers the outbox relay writes on every event (``jobstream.store.outbox_message``).
EVENT_HEADERS: dict[str, str] = {
    "event_type": "The event type, e.g. job.ready (same as the value's event_type).",
    "schema_version": "Version of the event's schema (same as the value's schema_version).",
    "event_id": "UUID of this event (same as the value's event_id).",
    "request_id": "Ties the logs and traces of one run together (tracing only).",
    "tenant_id": "The tenant (same as the value's tenant_id).",
    "content-type": "Always application/json.",
}
#: Headers of job events only (``job.*``: a job exists).
JOB_HEADERS: dict[str, str] = {
    "job_id": "UUID of the job; also the Kafka key.",
    "dedup_key": "sha256 of the computation's inputs; consumers record (group, dedup_key, "
                 "event_type) to apply the event exactly once.",
}
#: Headers a message carries on a ``<topic>.retry`` twin (``streams/base.py``).
RETRY_HEADERS: dict[str, str] = {
    "retry_count": "Retry round of this copy (1-based).",
    "retry_not_before_ms": "Unix time (ms) before which the retry agent does not run it.",
    "retry_reason": "The transient failure that sent it here.",
    "retry_original_topic": "The topic the message was first consumed from.",
}
#: Headers a dead-lettered message carries on a ``<topic>.dlq`` twin.
DLQ_HEADERS: dict[str, str] = {
    "dlq_reason_code": "Why it was dead-lettered (not_json, schema_violation, "
                       "unexpected_event_type, idempotency_key_conflict, message_too_large, "
                       "json_too_deep, missing_key, invalid_data, unknown_job, "
                       "generation_ahead, unreadable_message, unhandled, ...; README, Bad input).",
    "dlq_reason": "Human-readable reason (at most 2000 characters).",
    "dlq_original_topic": "Topic the message was consumed from.",
    "dlq_original_partition": "Its partition there.",
    "dlq_original_offset": "Its offset there.",
    "dlq_consumer_group": "The consumer group that dead-lettered it (each group on a topic "
                          "dead-letters a bad message once).",
}
#: Headers a dead letter carries only in some cases (``consumers/routing.py``).
DLQ_OPTIONAL_HEADERS: dict[str, str] = {
    "dlq_consumed_topic": "Where it was actually read when that is not dlq_original_topic "
                          "(its .retry twin); the partition and offset are positions there.",
    "dlq_stored": "dead_letter:<id> when this is only a reference record (no value): the "
                  "original did not fit the DLQ and is kept in the Postgres dead_letter table.",
}
#: Header of a message re-produced by ``jobstream dlq replay``.
REPLAY_HEADERS: dict[str, str] = {
    "dlq_replayed_from": "<dlq topic>:<partition>:<offset> of the dead letter it was "
                         "replayed from.",
}

def produced_by(pipeline: Pipeline = PIPELINE) -> dict[str, str]:
    """Topic -> who produces it, for the channels' descriptions (from ``pipeline``)."""
    out = {pipeline.stages[0].consumes: "other services (jobstream submit for tests and demos)"}
    for before, stage in zip(pipeline.stages, pipeline.stages[1:], strict=False):
        out[stage.consumes] = f"stage {before.name}" + (" (interactive lane)" if stage.lanes
                                                        else "")
        for lane, topic in stage.lanes.items():
            out[topic] = f"stage {before.name} ({lane} lane)"
    out[pipeline.result_event] = f"stage {pipeline.stages[-1].name}"
    out[pipeline.failed_event] = "any stage (a job that ended without a result)"
    return out


def consumed_by(pipeline: Pipeline = PIPELINE) -> dict[str, str]:
    """Topic -> who consumes it, for the channels' and operations' descriptions."""
    out = {}
    for stage in pipeline.stages:
        out[stage.consumes] = f"stage {stage.name}" + (
            f" (interactive lane, agent {stage.name})" if stage.lanes else "")
        for lane, topic in stage.lanes.items():
            out[topic] = f"stage {stage.name} ({lane} lane, agent {stage.name}_{lane})"
    out[pipeline.result_event] = ("downstream services (the consumers/ library; see "
                                  "examples/downstream_service/)")
    return out


def _id(topic: str) -> str:
    """A component/channel id for a topic name: dots become underscores."""
    return topic.replace(".", "_").replace("-", "_")


def _event_headers(topic: str) -> dict[str, str]:
    """The routing headers of an event of ``topic`` (the original headers, kept on retries
    and dead letters)."""
    return {**EVENT_HEADERS, **(JOB_HEADERS if topic != "document.uploaded" else {})}


def _headers(names: dict[str, str], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {"type": "object",
            "properties": {k: {"type": "string", "description": v} for k, v in names.items()},
            **({"required": list(required)} if required else {})}


def _key(topic: str) -> dict[str, Any]:
    if topic == "document.uploaded":
        return {"type": "string", "description": "The event's idempotency_key (no job "
                "exists yet); keeps copies of one intent on one partition."}
    return {"type": "string", "format": "uuid",
            "description": "job_id: every event of a job on one partition (per-job order)."}


def render(pipeline: Pipeline = PIPELINE,
           models: dict[str, type[BaseModel]] | None = None) -> dict[str, Any]:
    """The AsyncAPI 3.0 document of ``pipeline`` as a dict (deterministic).

    ``models`` maps each event type to its pydantic model (default
    ``schemas.events.EVENT_MODELS``); every topic's event type must have one (``KeyError``).
    """
    models = EVENT_MODELS if models is None else models
    _, top = models_json_schema([(m, "serialization") for m in models.values()],
                                ref_template="#/components/schemas/{model}")
    schemas: dict[str, Any] = dict(sorted(top["$defs"].items()))
    model_name = {t: m.__name__ for t, m in models.items()}
    event_type_of = pipeline.event_type_of
    produced, consumed = produced_by(pipeline), consumed_by(pipeline)
    intake = pipeline.stages[0]

    messages: dict[str, Any] = {}
    channels: dict[str, Any] = {}
    operations: dict[str, Any] = {}
    topic_binding = {"kafka": {"bindingVersion": KAFKA_BINDING_VERSION,
                               "topicConfiguration": {"cleanup.policy": ["delete"]}}}

    for topic in pipeline.topics():
        job_event = topic != intake.consumes
        headers = {**_event_headers(topic), **REPLAY_HEADERS}
        required = (tuple(EVENT_HEADERS) + tuple(JOB_HEADERS)) if job_event else ()
        mid = _id(topic)
        etype = event_type_of(topic)
        model = models[etype]
        messages[mid] = {
            "name": topic, "title": topic,
            "summary": (model.__doc__ or topic).strip().splitlines()[0],
            "contentType": "application/json",
            "headers": _headers(headers, required),
            "payload": {"$ref": f"#/components/schemas/{model_name[etype]}"},
            "correlationId": {"location": "$message.header#/request_id",
                              "description": "request_id: one attempt chain, for tracing."},
            "bindings": {"kafka": {"key": _key(topic),
                                   "bindingVersion": KAFKA_BINDING_VERSION}},
        }
        if not job_event:
            messages[mid]["description"] = (
                "Produced by other services. Headers are optional here; validate the value "
                f"against schemas/json/document.uploaded.v{SCHEMA_VERSION}.schema.json "
                "before producing.")
        channels[mid] = {
            "address": topic, "title": topic,
            "description": f"Produced by {produced[topic]}"
                           + (f"; consumed by {consumed[topic]}." if topic in consumed
                              else "; not consumed by jobstream."),
            "messages": {mid: {"$ref": f"#/components/messages/{mid}"}},
            "bindings": topic_binding,
        }
        if job_event:
            operations[f"send_{mid}"] = {
                "action": "send", "channel": {"$ref": f"#/channels/{mid}"},
                "summary": f"{produced[topic]} writes it to the outbox; the relay "
                           "publishes it (at-least-once, idempotent producer, acks=all).",
                "messages": [{"$ref": f"#/channels/{mid}/messages/{mid}"}]}
        if topic in pipeline.consumed_topics():
            operations[f"receive_{mid}"] = {
                "action": "receive", "channel": {"$ref": f"#/channels/{mid}"},
                "summary": f"{consumed[topic]}: applied exactly once per (consumer group, "
                           "dedup_key, event_type)" if job_event else
                           f"{intake.name}: one job per (tenant, idempotency_key) and per "
                           "dedup_key.",
                "messages": [{"$ref": f"#/channels/{mid}/messages/{mid}"}]}

    for topic in pipeline.stage_topics():
        twin, src = f"{topic}.retry", _id(topic)
        mid = _id(twin)
        messages[mid] = {
            "name": twin, "title": twin,
            "summary": f"A {topic} message whose processing failed transiently, to be "
                       "retried after retry_not_before_ms.",
            "contentType": "application/json",
            "headers": _headers({**_event_headers(topic), **RETRY_HEADERS},
                                tuple(RETRY_HEADERS)),
            "payload": {"$ref": f"#/components/schemas/{model_name[event_type_of(topic)]}"},
            "bindings": messages[src]["bindings"],
        }
        channels[mid] = {
            "address": twin, "title": twin,
            "description": f"Transient failures of {topic}: the same key and value bytes; "
                           "the stage workers' retry agent re-runs them.",
            "messages": {mid: {"$ref": f"#/components/messages/{mid}"}},
            "bindings": topic_binding}
        for action in ("send", "receive"):
            operations[f"{action}_{mid}"] = {
                "action": action, "channel": {"$ref": f"#/channels/{mid}"},
                "messages": [{"$ref": f"#/channels/{mid}/messages/{mid}"}]}

    for topic in pipeline.consumed_topics():
        twin = f"{topic}.dlq"
        mid = _id(twin)
        messages[mid] = {
            "name": twin, "title": twin,
            "summary": f"A dead-lettered message of {topic}: the original key and value "
                       "bytes (possibly not JSON at all) with the reason in headers.",
            "headers": _headers({**_event_headers(topic), **DLQ_HEADERS,
                                 **DLQ_OPTIONAL_HEADERS}, tuple(DLQ_HEADERS)),
            "payload": {"description": "The original value bytes, unchanged (the "
                                       f"{model_name[event_type_of(topic)]} schema when it "
                                       "was valid JSON)."},
            "bindings": {"kafka": {"key": {"type": "string",
                                           "description": "The original key, unchanged."},
                                   "bindingVersion": KAFKA_BINDING_VERSION}},
        }
        channels[mid] = {
            "address": twin, "title": twin,
            "description": f"Poison messages of {topic} (undecodable, schema-violating, "
                           "refused); `jobstream dlq list|replay` reads them.",
            "messages": {mid: {"$ref": f"#/components/messages/{mid}"}},
            "bindings": topic_binding}
        operations[f"send_{mid}"] = {
            "action": "send", "channel": {"$ref": f"#/channels/{mid}"},
            "messages": [{"$ref": f"#/channels/{mid}/messages/{mid}"}]}
        operations[f"receive_{mid}"] = {
            "action": "receive", "channel": {"$ref": f"#/channels/{mid}"},
            "summary": "jobstream dlq replay: re-produces a dead letter to its original "
                       "topic with the dlq_replayed_from header.",
            "messages": [{"$ref": f"#/channels/{mid}/messages/{mid}"}]}

    return {
        "asyncapi": "3.0.0",
        "info": {
            "title": "jobstream events",
            "version": f"{SCHEMA_VERSION}.0.0",
            "description": (
                "Documents in (document.uploaded), LLM results out (job.ready), applied "
                "exactly once. Values are JSON envelopes (event_id, event_type, "
                "schema_version, occurred_at, tenant_id, idempotency_key, request_id, "
                "payload; job events add job_id, dedup_key and generation). Every topic name "
                "takes the deployment's JOBSTREAM_TOPIC_PREFIX. Generated from schemas/ by "
                "`python -m schemas.asyncapi`; do not edit by hand."),
            "license": {"name": "Apache-2.0"},
        },
        "defaultContentType": "application/json",
        "servers": {
            "local": {"host": "127.0.0.1:9092", "protocol": "kafka",
                      "description": "`jobstream services up` (KRaft, one node)"},
            "compose": {"host": "kafka:9092", "protocol": "kafka",
                        "description": "docker-compose.yml's broker, inside the network"},
        },
        "channels": channels,
        "operations": operations,
        "components": {"messages": messages, "schemas": schemas},
    }


def render_text(pipeline: Pipeline = PIPELINE) -> str:
    """The document as committed: JSON, 2-space indent, trailing newline."""
    return json.dumps(render(pipeline), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write (or with ``--check`` compare) ``schemas/asyncapi.json``; returns the exit code."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed file drifted")
    args = parser.parse_args(argv)
    text = render_text()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"AsyncAPI drift: {OUT.name} differs from the models; run "
                  "python -m schemas.asyncapi", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
