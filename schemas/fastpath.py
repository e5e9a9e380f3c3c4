"""A compiled fast path for decoding ``job.ready``: msgspec ``Struct`` s that accept a strict
subset of what :class:`schemas.events.JobReady` accepts, and build the same pydantic models.

Why: the idempotent ready applier spends ~6.6 us of Python per event in pydantic's
``validate_json`` (bench/README.md, "Idempotent consumer"); msgspec parses and checks the same
event in ~1-2 us. The pydantic models stay the contract and the only thing handlers see:

- :func:`decode_job_ready` returns a :class:`~schemas.events.JobReady` (frozen models, the
  same field values and ``model_fields_set`` as ``validate_json`` gives) or ``None``;
- ``None`` means "not shown valid here", never "invalid": :func:`schemas.events.decode_event`
  then runs pydantic as before, which decides the outcome and gives the reason and code.

So the rule that keeps the outcome of every input unchanged is one-sided: whatever these
structs accept, pydantic must accept with the same values. They are therefore stricter where
the two libraries differ: every field is required (pydantic's defaults are left to pydantic);
the patterns are checked in :func:`decode_job_ready` (anchored with ``\\Z``: Python's ``$``
also matches before a final newline, pydantic's Rust regex does not; "no control character"
as ``str.isprintable()``, which refuses more); counts are bounded to int8 (``bigint``);
``occurred_at`` goes through msgspec's RFC 3339 parser, refused with more than 6 fractional
digits (msgspec rounds them, pydantic truncates). ``tests/unit/test_decode_fastpath.py``
checks the equivalence (fields and bounds against the models' JSON Schema; edge values of every
field; hypothesis-mutated events and bytes): a change to ``JobReady`` not made here fails it.

:func:`decode_ready` stops before the models: it returns the checked :class:`Ready` struct (the
models' attribute names and values, ``occurred_at`` as text), which :func:`to_model` turns into
the same models later, if ever. The idempotent consumer's batch path reads only fields, so
for a batch handler whose ``prepare`` takes the struct (``on_batch(..., light=True)``) it
builds no model unless a handler or hook asks for one.
"""

from __future__ import annotations

import datetime as dt
import functools
import re
import uuid
from typing import Annotated, Any, Final, Literal

import msgspec
from pydantic import BaseModel

from schemas.events import INT8_MAX, USD_MAX, DocumentAnalysis, JobReady, JobReadyPayload

#: The characters of a sha256 in lowercase hex (``[0-9a-f]``), as bytes to delete: an ASCII
#: string is lowercase hex exactly when deleting these from its bytes leaves nothing
#: (:func:`_lower_hex`).
_HEX_DIGITS: Final = b"0123456789abcdef"
#: ``[A-Za-z0-9._:-]+``, as pydantic's pattern for ``tenant_id`` (``\Z``: Python's ``$`` also
#: matches before a final newline, pydantic's Rust regex does not).
_TENANT: Final = re.compile(r"[A-Za-z0-9._:-]+\Z")


Count = Annotated[int, msgspec.Meta(ge=0, le=INT8_MAX)]
PositiveCount = Annotated[int, msgspec.Meta(ge=1, le=INT8_MAX)]
Usd = Annotated[float, msgspec.Meta(ge=0, le=USD_MAX)]
Key = Annotated[str, msgspec.Meta(min_length=1, max_length=200)]
Name = Annotated[str, msgspec.Meta(max_length=200)]
Title = Annotated[str, msgspec.Meta(min_length=1, max_length=300)]
Summary = Annotated[str, msgspec.Meta(min_length=1, max_length=4000)]
Filename = Annotated[str, msgspec.Meta(max_length=512)]
Keywords = Annotated[list[str], msgspec.Meta(min_length=1, max_length=20)]
FieldInt = Annotated[int, msgspec.Meta(ge=-INT8_MAX - 1, le=INT8_MAX)]


class Analysis(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """:class:`schemas.events.DocumentAnalysis`."""

    title: Title
    summary: Summary
    keywords: Keywords
    word_count: PositiveCount
    chunk_count: PositiveCount
    fields: dict[str, str | FieldInt | list[str]]


class ReadyPayload(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """:class:`schemas.events.JobReadyPayload` (``document_sha256`` and ``filename``'s
    patterns are checked by :func:`decode_job_ready`)."""

    result: Analysis
    document_sha256: str
    filename: Filename
    cost_usd: Usd
    charge_usd: Usd


class Ready(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """:class:`schemas.events.JobReady`, every field required (the string fields' patterns
    and ``occurred_at`` are checked by :func:`decode_job_ready`)."""

    event_id: uuid.UUID
    schema_version: Literal[1]
    occurred_at: str
    tenant_id: Key
    idempotency_key: Key
    request_id: Name
    job_id: uuid.UUID
    dedup_key: str
    generation: Count
    event_type: Literal["job.ready"]
    payload: ReadyPayload


_DECODER: Final = msgspec.json.Decoder(Ready)
_new = object.__new__
#: BaseModel's slots' setters (faster than object.__setattr__ by name).
_SET_DICT, _SET_FIELDS_SET, _SET_EXTRA, _SET_PRIVATE = (
    BaseModel.__dict__[slot].__set__
    for slot in (
        "__dict__",
        "__pydantic_fields_set__",
        "__pydantic_extra__",
        "__pydantic_private__",
    )
)


def _model(cls: type[BaseModel], values: dict[str, Any]) -> Any:
    """An instance of ``cls`` holding ``values`` (already validated), as pydantic's
    ``model_construct`` builds it without its per-field Python loop: every field was given,
    so every field is in ``model_fields_set``, as after ``validate_json``."""
    m = _new(cls)
    _SET_DICT(m, values)
    _SET_FIELDS_SET(m, set(values))
    _SET_EXTRA(m, None)
    _SET_PRIVATE(m, None)
    return m


def _lower_hex(text: str) -> bool:
    """``text`` is lowercase hex only (``[0-9a-f]`` to its end, as the models' sha256 patterns):
    ASCII, and nothing left once those 16 bytes are deleted from its bytes (one C loop, ~4x
    faster than the regex for an event's two digests: 128 characters)."""
    return text.isascii() and not text.encode().translate(None, _HEX_DIGITS)


@functools.lru_cache(maxsize=1024)
def _tenant_ok(tenant: str) -> bool:
    """``tenant`` matches ``tenant_id``'s pattern (cached: a few tenants repeat)."""
    return _TENANT.match(tenant) is not None


def _occurred_at(text: str) -> dt.datetime | None:
    """msgspec's RFC 3339 parser (C) on ``text``; ``None`` when it refuses it or when the
    fraction has more than 6 digits (msgspec rounds to microseconds, pydantic truncates)."""
    # msgspec takes only YYYY-MM-DD?HH:MM:SS first, so a fraction's dot is at index 19.
    if text[19:20] == "." and len(digits := text[20:27]) == 7 and digits.isdigit():
        return None
    try:
        return msgspec.convert(text, dt.datetime)
    except msgspec.ValidationError:
        return None


def decode_ready(raw: bytes) -> Ready | None:
    """The :class:`Ready` struct of the JSON text ``raw`` (bytes) when this fast path shows it
    valid, else ``None`` (the caller then validates it with pydantic, which decides and says
    why). Every check of :func:`decode_job_ready` is made here, so a struct returned is exactly
    an event :func:`to_model` turns into the :class:`~schemas.events.JobReady` pydantic gives:
    the same attribute names and values, except ``occurred_at``, which the struct keeps as its
    (checked) RFC 3339 text. For readers that need only fields, such as the ready applier's
    batch rows (``jobstream.ready_applier.copy_rows``): the three models (~3 us per event)
    are then never built. Never raises for any input."""
    got = _checked(raw)
    return None if got is None else got[0]


def _checked(raw: bytes) -> tuple[Ready, dt.datetime] | None:
    """:func:`decode_ready`'s struct with its parsed ``occurred_at``, or ``None``."""
    try:
        ev = _DECODER.decode(raw)
    except (msgspec.DecodeError, ValueError, TypeError, RecursionError):
        return None
    p = ev.payload
    # The patterns, by str methods (each ~50 ns; msgspec's Meta(pattern=) calls re.search, ~2 us
    # for the six). isprintable() is stricter than "no control character" (it refuses other
    # non-printing characters too): those events go to pydantic, which decides.
    if not (
        ev.idempotency_key.isprintable()
        and ev.request_id.isprintable()
        and p.filename.isprintable()
        and len(ev.dedup_key) == 64
        and len(p.document_sha256) == 64
        and _lower_hex(ev.dedup_key + p.document_sha256)
        and _tenant_ok(ev.tenant_id)
    ):
        return None
    when = _occurred_at(ev.occurred_at)
    return None if when is None else (ev, when)


def decode_job_ready(raw: bytes) -> JobReady | None:
    """The :class:`~schemas.events.JobReady` of the JSON text ``raw`` (bytes), or ``None`` when
    this fast path does not show it valid (the caller then validates it with pydantic, which
    decides and says why). Never raises for any input."""
    got = _checked(raw)
    return None if got is None else _build(*got)


def to_model(ev: Ready) -> JobReady:
    """The :class:`~schemas.events.JobReady` of a struct :func:`decode_ready` returned (frozen
    models holding the struct's values, as ``validate_json`` of the same text gives them).
    Raises ``ValueError`` for a struct whose ``occurred_at`` that function would have refused
    (a struct it did not return)."""
    when = _occurred_at(ev.occurred_at)
    if when is None:
        raise ValueError(f"occurred_at {ev.occurred_at!r} is not an RFC 3339 time")
    return _build(ev, when)


def _build(ev: Ready, when: dt.datetime) -> JobReady:
    """The three models of ``ev`` (checked) with ``occurred_at`` = ``when``."""
    p, r = ev.payload, ev.payload.result
    result = _model(
        DocumentAnalysis,
        {
            "title": r.title,
            "summary": r.summary,
            "keywords": r.keywords,
            "word_count": r.word_count,
            "chunk_count": r.chunk_count,
            "fields": r.fields,
        },
    )
    payload = _model(
        JobReadyPayload,
        {
            "result": result,
            "document_sha256": p.document_sha256,
            "filename": p.filename,
            "cost_usd": p.cost_usd,
            "charge_usd": p.charge_usd,
        },
    )
    event: JobReady = _model(
        JobReady,
        {
            "event_id": ev.event_id,
            "schema_version": 1,
            "occurred_at": when,
            "tenant_id": ev.tenant_id,
            "idempotency_key": ev.idempotency_key,
            "request_id": ev.request_id,
            "job_id": ev.job_id,
            "dedup_key": ev.dedup_key,
            "generation": ev.generation,
            "event_type": "job.ready",
            "payload": payload,
        },
    )
    return event
