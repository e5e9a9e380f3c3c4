"""Submitting documents: build ``document.uploaded`` events and produce them to Kafka."""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path

from confluent_kafka import Producer

from jobstream.kafka import producer_config
from jobstream.settings import Settings
from schemas.events import DocumentRef, DocumentUploaded, DocumentUploadedPayload, encode_event


def content_type_of(path: Path) -> str:
    """``application/pdf`` for ``.pdf`` files (or files starting with ``%PDF``), else text."""
    if path.suffix.lower() == ".pdf":
        return "application/pdf"
    with path.open("rb") as fh:
        return "application/pdf" if fh.read(5) == b"%PDF-" else "text/plain"


def uploaded_event(path: Path, *, tenant_id: str, idempotency_key: str, settings: Settings,
                   lane: str = "interactive", inline: bool = True,
                   prompt_version: str | None = None, model_profile: str | None = None,
                   filename: str | None = None) -> DocumentUploaded:
    """A ``document.uploaded`` for the file at ``path`` (inline bytes or a ``file://`` URI)."""
    data = path.read_bytes()
    doc = DocumentRef(
        filename=filename or path.name, content_type=content_type_of(path),
        sha256=hashlib.sha256(data).hexdigest(), size_bytes=len(data),
        content_b64=base64.b64encode(data).decode() if inline else None,
        uri=None if inline else f"file://{path.resolve()}")
    return DocumentUploaded(
        tenant_id=tenant_id, idempotency_key=idempotency_key,
        payload=DocumentUploadedPayload(
            document=doc, pipeline=settings.pipeline,
            prompt_version=prompt_version or settings.prompt_version,
            model_profile=model_profile or settings.model_profile, lane=lane))


#: linger.ms of the submitting producer (milliseconds): :func:`produce_raw` ends with
#: ``flush()``, which sends what the linger holds at once, so a long linger delays nothing; it
#: only lets a burst go in full produce requests (one per partition and ``batch.size``) rather
#: than one per 5 ms of a produce loop slowed by a busy machine (bench/README.md, Latency).
SUBMIT_LINGER_MS = 1000


def submit_producer(settings: Settings) -> Producer:
    """A producer for :func:`submit` / :func:`produce_raw` to keep and reuse: idempotent
    (:func:`producer_config`), with a linger of :data:`SUBMIT_LINGER_MS`."""
    return Producer(producer_config(settings, **{"linger.ms": SUBMIT_LINGER_MS}))


def produce_raw(settings: Settings, topic: str, values: list[tuple[bytes | None, bytes | None]],
                headers: list[tuple[str, str | bytes | None]] | None = None, *,
                producer: Producer | None = None) -> None:
    """Produce ``(key, value)`` pairs to ``topic`` (full name) and wait for every delivery.

    ``producer``: a long-lived producer (:func:`submit_producer`) to reuse. A new idempotent
    producer needs its producer ID before it sends anything, and librdkafka asks for it again
    only after 500 ms when the broker was not connected yet at creation: ~0.5 s added to the
    first send of every new producer (bench/README.md, "Latency"). Pass one to send promptly.

    Raises ``RuntimeError`` if any message was not acknowledged within 60 s.
    """
    errors: list[object] = []
    p = producer if producer is not None else submit_producer(settings)
    for key, value in values:
        p.produce(topic, key=key, value=value, headers=headers,
                  on_delivery=lambda err, _m: errors.append(err) if err else None)
        p.poll(0)
    left = p.flush(60)
    if left or errors:
        raise RuntimeError(f"{left} undelivered, errors: {errors[:3]}")


def submit(settings: Settings, events: list[DocumentUploaded], *,
           producer: Producer | None = None) -> None:
    """Produce ``document.uploaded`` events (key = idempotency key) and wait for delivery
    (``producer``: reuse one, see :func:`produce_raw`). Raises ``RuntimeError`` as
    :func:`produce_raw` does."""
    produce_raw(settings, settings.topic("document.uploaded"),
                [(e.idempotency_key.encode(), encode_event(e)) for e in events],
                producer=producer)
