"""Pydantic v2 event models: one envelope, one payload model per event type.

Every event is a frozen, versioned contract (``extra="forbid"``, explicit ``schema_version``).
The envelope carries the three keys that are never merged (design.md, "Three keys"):
``request_id`` (tracing), ``idempotency_key`` (one client intent) and ``dedup_key`` (one
computation). Messages carry ids, hashes and small data; stage outputs live in Postgres.
"""

from __future__ import annotations

import base64
import json
import os
import re
import uuid
from collections.abc import Container
from datetime import UTC, datetime
from typing import Annotated, Any, Final, Literal
from urllib.parse import unquote, urlparse

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from schemas.errors import PoisonMessage

SCHEMA_VERSION: Final = 1

Sha256Hex = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$", description="sha256, lowercase hex")]
#: No control characters (Unicode category Cc: U+0000-U+001F, U+007F-U+009F) where an
#: identifier or a filename is expected: a schema violation, never a database error later.
NO_CONTROL_CHARS = r"^[^\x00-\x1f\x7f-\x9f]*$"
Lane = Literal["interactive", "batch"]
#: Counts and money are strict: a JSON number, never ``true``, ``"1.5"`` or ``"12"`` (pydantic's
#: lax mode would coerce those). Money is finite and at most 999,999.99999999 USD, what the
#: ``numeric(14, 8)`` columns hold (a larger charge is a schema violation, not a database error
#: after the event was accepted; ``lt=10^6`` let 999999.999999995 through, which rounds to 10^6
#: at 8 decimals: breaker9). An integer-valued count sent as ``5.0`` is rejected too.
USD_MAX = 999_999.99999999
Usd = Annotated[float, Field(ge=0, le=USD_MAX, strict=True, allow_inf_nan=False)]
#: The largest count an event may carry: what a Postgres ``bigint`` (int8) holds. A larger one
#: is a schema violation at the consumer's edge, not a database error after it was accepted
#: (``generation`` too: an event's generation is only compared with the job's ``integer``
#: column, never stored).
INT8_MAX: Final = 2**63 - 1


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DocumentRef(_Frozen):
    """The uploaded document: inline bytes (``content_b64``) or a ``file://`` URI, and its hash.

    Exactly one of ``content_b64`` and ``uri`` is set. ``sha256`` is checked against the bytes
    at intake; a mismatch dead-letters the event.
    """

    filename: str = Field(min_length=1, max_length=512, pattern=NO_CONTROL_CHARS)
    content_type: Literal["text/plain", "application/pdf"] = "text/plain"
    sha256: Sha256Hex
    size_bytes: int = Field(strict=True, ge=0, le=INT8_MAX,
                            description="Size of the document (bytes).")
    content_b64: str | None = Field(None, description="The document's bytes, base64.")
    uri: str | None = Field(None, pattern=r"^file://", description="file:// URI of the bytes.")

    @model_validator(mode="after")
    def _one_source(self) -> DocumentRef:
        if (self.content_b64 is None) == (self.uri is None):
            raise ValueError("exactly one of content_b64 and uri must be set")
        return self

    def content(self, roots: list[str] | tuple[str, ...] = (),
                max_bytes: int | None = None) -> bytes:
        """The document's bytes. A ``file://`` URI is read only when its resolved path lies
        under one of ``roots`` (directories) and names a regular file; at most
        ``max_bytes + 1`` bytes of it are read (so the caller sees it is too large without
        reading all of it). Raises ``PermissionError`` (outside the roots), ``OSError``
        (unreadable) or ``ValueError`` (bad base64 or URI, not a regular file)."""
        if self.content_b64 is not None:
            return base64.b64decode(self.content_b64, validate=True)
        assert self.uri is not None
        parsed = urlparse(self.uri)
        if parsed.netloc not in ("", "localhost"):
            raise ValueError(f"file URI names a host: {self.uri!r}")
        path = os.path.realpath(unquote(parsed.path))
        allowed = [os.path.realpath(r) for r in roots]
        if not any(os.path.commonpath([path, r]) == r for r in allowed):
            raise PermissionError(f"{path} is outside the allowed document roots {allowed}")
        if os.path.exists(path) and not os.path.isfile(path):  # a FIFO would block forever
            raise ValueError(f"{path} is not a regular file")
        with open(path, "rb") as fh:
            return fh.read() if max_bytes is None else fh.read(max_bytes + 1)


class DocumentUploadedPayload(_Frozen):
    """What another service asks for: analyse this document with this pipeline/prompt/model."""

    document: DocumentRef
    pipeline: str = Field("document-analysis", min_length=1, max_length=100,
                          pattern=NO_CONTROL_CHARS)
    prompt_version: str = Field("analysis-v1", min_length=1, max_length=100,
                                pattern=NO_CONTROL_CHARS)
    model_profile: str = Field("local", min_length=1, max_length=100, pattern=NO_CONTROL_CHARS)
    lane: Lane = "interactive"


class JobAcceptedPayload(_Frozen):
    """The job exists (intake committed); extraction may start."""

    document_sha256: Sha256Hex
    content_type: str = Field(max_length=100, pattern=NO_CONTROL_CHARS)
    pipeline: str = Field(max_length=100, pattern=NO_CONTROL_CHARS)
    prompt_version: str = Field(max_length=100, pattern=NO_CONTROL_CHARS)
    model_profile: str = Field(max_length=100, pattern=NO_CONTROL_CHARS)
    lane: Lane


class TextExtractedPayload(_Frozen):
    """Text extraction finished; the text is in the ``extract`` checkpoint."""

    text_sha256: Sha256Hex
    char_count: int = Field(strict=True, ge=0, le=INT8_MAX)
    page_count: int = Field(strict=True, ge=0, le=INT8_MAX,
                            description="PDF pages; 0 for plain text.")


class ChunksReadyPayload(_Frozen):
    """Chunking finished; the chunks are rows of ``chunk``."""

    chunk_count: int = Field(strict=True, ge=1, le=INT8_MAX)
    chunks_sha256: Sha256Hex


class LlmDonePayload(_Frozen):
    """Every chunk has a model output (from the provider or reused by dedup key)."""

    chunk_count: int = Field(strict=True, ge=1, le=INT8_MAX)
    output_sha256: Sha256Hex
    provider_calls: int = Field(strict=True, ge=0, le=INT8_MAX,
                                description="Provider attempts of this stage, over all its "
                                "runs (0 if reused).")
    reused: bool = Field(strict=True)
    cost_usd: Usd = Field(description="Provider cost of this stage (USD).")


class ValidatedPayload(_Frozen):
    """The merged model output passed schema validation."""

    output_sha256: Sha256Hex


class DocumentAnalysis(_Frozen):
    """The product: what the pipeline says about one document (validated model output)."""

    title: str = Field(min_length=1, max_length=300)
    summary: str = Field(min_length=1, max_length=4000)
    keywords: list[str] = Field(min_length=1, max_length=20)
    word_count: int = Field(strict=True, ge=1, le=INT8_MAX)
    chunk_count: int = Field(strict=True, ge=1, le=INT8_MAX)
    fields: dict[str, str | StrictInt | list[str]] = Field(
        default_factory=dict, description="Extracted fields, e.g. licence_name, version, years."
    )


class JobReadyPayload(_Frozen):
    """The result, ready to be applied downstream exactly once (per dedup_key)."""

    result: DocumentAnalysis
    document_sha256: Sha256Hex
    filename: str = Field(max_length=512, pattern=NO_CONTROL_CHARS)
    cost_usd: Usd = Field(description="Provider cost of the job (USD).")
    charge_usd: Usd = Field(description="What the client is charged for it (USD).")


class JobFailedPayload(_Frozen):
    """The job ended without a result."""

    stage: str = Field(max_length=100, pattern=NO_CONTROL_CHARS)
    error_code: str = Field(max_length=100, pattern=NO_CONTROL_CHARS)
    error: str = Field(max_length=4000)


class _Envelope(_Frozen):
    event_id: uuid.UUID = Field(default_factory=uuid.uuid4)
    schema_version: Literal[1] = SCHEMA_VERSION
    occurred_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    tenant_id: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:-]+$")
    idempotency_key: str = Field(min_length=1, max_length=200, pattern=NO_CONTROL_CHARS)
    request_id: str = Field(default_factory=lambda: uuid.uuid4().hex, max_length=200,
                            pattern=NO_CONTROL_CHARS)

    @field_validator("schema_version", mode="before")
    @classmethod
    def _version_is_an_integer(cls, value: Any) -> Any:
        """``schema_version`` is the JSON integer 1: ``Literal[1]`` alone compares by equality,
        so ``true`` and ``1.0`` passed as version 1 (flakes10). Anything else is left to the
        literal check (``2``, ``"1"``: its own message)."""
        if isinstance(value, bool | float):
            raise ValueError(f"must be the integer {SCHEMA_VERSION}, not {value!r}")
        return value


class _JobEnvelope(_Envelope):
    job_id: uuid.UUID
    dedup_key: Sha256Hex
    generation: int = Field(0, strict=True, ge=0, le=INT8_MAX,
                            description="The job's redrive generation: a redrive starts a new "
                            "one and events of older generations are ignored; a stage event of "
                            "a newer generation than its job's is poison (generation_ahead).")


class DocumentUploaded(_Envelope):
    """``document.uploaded``: produced by other services; no job or dedup key exists yet."""

    event_type: Literal["document.uploaded"] = "document.uploaded"
    payload: DocumentUploadedPayload


class JobAccepted(_JobEnvelope):
    """``job.accepted``: intake created the job."""

    event_type: Literal["job.accepted"] = "job.accepted"
    payload: JobAcceptedPayload


class TextExtracted(_JobEnvelope):
    """``job.text_extracted``."""

    event_type: Literal["job.text_extracted"] = "job.text_extracted"
    payload: TextExtractedPayload


class ChunksReady(_JobEnvelope):
    """``job.chunks_ready``."""

    event_type: Literal["job.chunks_ready"] = "job.chunks_ready"
    payload: ChunksReadyPayload


class LlmDone(_JobEnvelope):
    """``job.llm_done``."""

    event_type: Literal["job.llm_done"] = "job.llm_done"
    payload: LlmDonePayload


class Validated(_JobEnvelope):
    """``job.validated``."""

    event_type: Literal["job.validated"] = "job.validated"
    payload: ValidatedPayload


class JobReady(_JobEnvelope):
    """``job.ready``: delivered at-least-once, applied exactly once per dedup_key."""

    event_type: Literal["job.ready"] = "job.ready"
    payload: JobReadyPayload


class JobFailed(_JobEnvelope):
    """``job.failed``: the job reached the terminal state ``failed``."""

    event_type: Literal["job.failed"] = "job.failed"
    payload: JobFailedPayload


Event = Annotated[
    DocumentUploaded | JobAccepted | TextExtracted | ChunksReady | LlmDone | Validated
    | JobReady | JobFailed,
    Field(discriminator="event_type"),
]
EVENT_MODELS: dict[str, type[BaseModel]] = {
    m.model_fields["event_type"].default: m
    for m in (DocumentUploaded, JobAccepted, TextExtracted, ChunksReady, LlmDone, Validated,
              JobReady, JobFailed)
}
EVENT_TYPES = tuple(EVENT_MODELS)
_ADAPTER: TypeAdapter[Any] = TypeAdapter(Event)


def encode_event(event: BaseModel) -> bytes:
    """Serialise an event to UTF-8 JSON bytes (the Kafka value and the outbox payload)."""
    return event.model_dump_json().encode()


#: Bounds :func:`decode_event` applies before parsing (the settings ``kafka_message_max_bytes``
#: and ``max_json_depth`` default to these).
MAX_MESSAGE_BYTES = 8 * 1024 * 1024
MAX_JSON_DEPTH = 64
# A JSON string (escapes included): its brackets are not structure.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
# The JSON escape of U+0000 (not preceded by an escaped backslash). A raw NUL byte is not JSON.
_JSON_NUL = re.compile(rb"(?<!\\)(?:\\\\)*\\u0000")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_PAIR = re.compile(rb"\[\]|\{\}")  # an innermost (empty) array or object: one level


def json_depth_exceeds(raw: bytes, max_depth: int) -> bool:
    """True when the JSON text ``raw`` nests arrays/objects deeper than ``max_depth``.

    A cheap scan run before any parser (Python's ``json`` raises ``RecursionError`` on deep
    input): strings are cut out, then innermost ``[]``/``{}`` pairs are removed one level per pass
    (at most ``max_depth + 1`` passes of one regex substitution). Malformed bracket
    sequences are left to the parser (they are not JSON anyway).
    """
    if raw.count(b"[") + raw.count(b"{") <= max_depth:
        return False
    brackets = _JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    for _ in range(max_depth):
        if not brackets:
            return False
        inner = _PAIR.sub(b"", brackets)
        if inner == brackets:
            return False  # unbalanced: not JSON, the parser says so
        brackets = inner
    # Still a level left after max_depth passes: deeper (unless only unbalanced residue).
    return bool(brackets) and _PAIR.sub(b"", brackets) != brackets


def schema_depth(schema: dict[str, Any]) -> int | None:
    """The deepest nesting of arrays/objects a JSON document valid against ``schema`` (a JSON
    Schema with local ``$defs``, as pydantic generates) can have: an object or array is one
    level, a scalar none. ``None`` when it is not bounded (a value of any type, a recursive
    reference, extra properties of any type)."""
    defs: dict[str, Any] = schema.get("$defs", {})

    def deepest(depths: list[int | None], plus: int = 0) -> int | None:
        bounded = [d for d in depths if d is not None]
        return None if len(bounded) < len(depths) else plus + max(bounded, default=0)

    def walk(node: Any, refs: tuple[str, ...]) -> int | None:
        if node is True or node == {} or not isinstance(node, dict):
            return None if node is not False else 0
        if "$ref" in node:
            name = node["$ref"].rsplit("/", 1)[-1]
            if name in refs or name not in defs:
                return None
            return walk(defs[name], (*refs, name))
        depths: list[int | None] = [
            walk(sub, refs) for key in ("anyOf", "oneOf", "allOf")
            for sub in node.get(key, ())]
        types = node.get("type")
        types = [types] if isinstance(types, str) else list(types or [])
        if not types and not depths and "const" not in node and "enum" not in node:
            return None  # no type given: anything, nested as deep as it likes
        for t in types:
            if t == "object":
                extra = node.get("additionalProperties", True)
                subs = [*node.get("properties", {}).values(),
                        *node.get("patternProperties", {}).values(), extra]
                depths.append(deepest([walk(sub, refs) for sub in subs], 1))
            elif t == "array":
                subs = [*node.get("prefixItems", ()), node.get("items", True)]
                depths.append(deepest([walk(sub, refs) for sub in subs], 1))
            else:
                depths.append(0)
        return deepest(depths)

    return walk(schema, ())


#: The deepest a valid event nests (see :func:`schema_depth`); None = unbounded. With a
#: ``max_depth`` at least this, :func:`decode_event` validates first and runs the depth scan
#: only for what failed validation: a valid event cannot be deeper, so the outcome is the same.
VALID_EVENT_DEPTH: Final = schema_depth(_ADAPTER.json_schema())


def decode_event(raw: bytes | str | None, expected: str | tuple[str, ...] | None = None, *,
                 max_bytes: int = MAX_MESSAGE_BYTES, max_depth: int = MAX_JSON_DEPTH,
                 light: Container[str] = ()) -> Any:
    """Parse and validate one event, bounded before parsing.

    ``expected``: the event type(s) this consumer accepts. ``max_bytes``: the largest value
    parsed (bytes); ``max_depth``: the deepest JSON nesting parsed. ``light``: event types
    whose light form may be returned; with ``"job.ready"`` in it, a ``job.ready`` that the
    compiled fast path accepts is returned as its checked struct
    (:class:`schemas.fastpath.Ready`: the model's attribute names and values, ``occurred_at``
    as text; :func:`as_model` gives the model) instead of the model; the outcome of every
    input is the same either way. Raises only
    :class:`PoisonMessage`, with a reason code (``empty``, ``message_too_large``,
    ``json_too_deep``, ``not_json``, ``schema_violation``, ``unexpected_event_type``); the
    caller dead-letters it. No string of an event may contain U+0000 (Postgres text cannot
    store it): ``schema_violation``.
    """
    if raw is None or raw in (b"", ""):
        raise PoisonMessage("empty message value", code="empty")
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogatepass")
    if len(raw) > max_bytes:
        raise PoisonMessage(f"value of {len(raw)} bytes exceeds the limit of {max_bytes}",
                            code="message_too_large")
    # The depth scan (~1 us per event of 1.3 KB, ~10 % of decoding) runs before anything
    # parses, unless every valid event is shallower than max_depth: then a value that passes
    # validation cannot be too deep, and only one that fails is scanned (before json.loads
    # below; pydantic-core's own parser stops at its recursion limit). Same outcome either way.
    scan_first = VALID_EVENT_DEPTH is None or max_depth < VALID_EVENT_DEPTH
    if scan_first and json_depth_exceeds(raw, max_depth):
        raise PoisonMessage(f"JSON nested deeper than {max_depth} levels", code="json_too_deep")
    # Cheapest test first: one byte (memchr, ~0.05 us; most events have no escape at all),
    # then the 6-byte substring (~1 us per 1.3 KB), then the regex (~27 us).
    if b"\\" in raw and b"\\u0000" in raw and _JSON_NUL.search(raw):
        if not scan_first and json_depth_exceeds(raw, max_depth):  # the same reason as before
            raise PoisonMessage(f"JSON nested deeper than {max_depth} levels",
                                code="json_too_deep")
        raise PoisonMessage("a string contains U+0000 (NUL), which no event field may hold",
                            code="schema_violation")
    try:
        return _decode(raw, expected, None if scan_first else max_depth, light)
    except PoisonMessage:
        raise
    except RecursionError:
        raise PoisonMessage("JSON nested too deep for the parser", code="json_too_deep") from None
    except Exception as exc:  # noqa: BLE001 - the contract: only PoisonMessage escapes
        raise PoisonMessage(f"undecodable: {type(exc).__name__}: {exc}"[:2000],
                            code="not_json") from None


def _decode(raw: bytes, expected: str | tuple[str, ...] | None,
            scan_depth: int | None = None, light: Container[str] = ()) -> Any:
    """:func:`decode_event` after its bounds; ``scan_depth``: the depth limit still to check
    when validation fails (None: checked already); ``light``: see :func:`decode_event`."""
    wanted = (expected,) if isinstance(expected, str) else expected
    if wanted is not None and "job.ready" in wanted:
        # The compiled fast path (msgspec, schemas/fastpath.py): it accepts only what the
        # models below accept, with the same values; anything else goes on to pydantic.
        ready = (_fastpath.decode_ready if "job.ready" in light
                 else _fastpath.decode_job_ready)(raw)
        if ready is not None:
            return ready
    try:  # pydantic: parse and validate in one pass (pydantic-core), no Python dict between
        event = _ADAPTER.validate_json(raw)
    except ValidationError:
        pass  # the path below says what is wrong with it
    else:
        if wanted is not None and event.event_type not in wanted:
            raise PoisonMessage(f"event_type {event.event_type!r} not in {list(wanted)}",
                                code="unexpected_event_type")
        return event
    if scan_depth is not None and json_depth_exceeds(raw, scan_depth):
        raise PoisonMessage(f"JSON nested deeper than {scan_depth} levels",
                            code="json_too_deep")
    try:
        obj = json.loads(raw)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, int digits limit
        raise PoisonMessage(f"value is not JSON: {exc}"[:2000], code="not_json") from None
    if isinstance(obj, dict) and wanted is not None:
        if "event_type" not in obj and len(wanted) == 1:
            obj["event_type"] = wanted[0]  # the schema gives it a default: the topic's type
        if obj.get("event_type") not in wanted:
            raise PoisonMessage(f"event_type {obj.get('event_type')!r} not in {list(wanted)}",
                                code="unexpected_event_type")
    try:
        return _ADAPTER.validate_python(obj)
    except ValidationError as exc:
        errors = "; ".join(
            f"{'.'.join(map(str, e['loc'])) or '<root>'}: {e['msg']}" for e in exc.errors()[:5]
        )
        raise PoisonMessage(f"schema violation: {errors}", code="schema_violation") from None


def as_model(event: Any) -> Any:
    """The pydantic model of an event :func:`decode_event` returned: a ``light`` struct
    (:class:`schemas.fastpath.Ready`) becomes its :class:`JobReady`, built now (~3 us); a model
    is returned as is."""
    return _fastpath.to_model(event) if isinstance(event, _fastpath.Ready) else event


# Last: schemas.fastpath imports this module's models (a module, not a name, so importing
# schemas.fastpath first works too).
from schemas import fastpath as _fastpath  # noqa: E402
