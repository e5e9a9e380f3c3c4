"""The HTTP API (FastAPI): durable jobs clients can create, query, follow, cancel and batch.

The tenant comes from the bearer token (``JOBSTREAM_API_TOKENS``), never from the body. Job
creation goes through the same transactional intake as ``document.uploaded``
(:func:`streams.intake.handle_intake`): the job, its idempotency record, its first checkpoint
and its outbox row commit together before the 202 is sent. ``Idempotency-Key`` is required:
the same key again returns the same job (200, ``Idempotent-Replayed: true``); the same key with
another body is 409 (IETF draft "The Idempotency-Key HTTP Header Field", §2.7).

Hostile requests get a 4xx with ``{"code", "message"}``, never a 500: a body over
``JOBSTREAM_API_MAX_BODY_BYTES`` is refused while it is read, before any parsing (413
``request_too_large``), a batch's documents over ``JOBSTREAM_API_MAX_BATCH_BYTES`` together are
413 ``batch_too_large``, malformed JSON is 400 ``malformed_json``, control characters in a
filename or identifier are 422 ``invalid_request``, and data Postgres refuses is 422
``invalid_data``.

Run it with ``jobstream api``; the OpenAPI document is served at ``/openapi.json``.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import (
    APIRouter,
    Depends,
    FastAPI,
    File,
    Form,
    Header,
    HTTPException,
    Request,
    Response,
    UploadFile,
)
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from psycopg import DataError, IntegrityError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from jobstream import idempotency, logs, metrics, tracing
from jobstream.db import QUERIES as Q
from jobstream.errors import IdempotencyConflict, PoisonMessage, RetryableError
from jobstream.settings import Settings
from jobstream.store import STAGES, TERMINAL, IntakeResult, Store
from schemas.events import (
    NO_CONTROL_CHARS,
    DocumentRef,
    DocumentUploaded,
    DocumentUploadedPayload,
)
from streams.context import StageContext
from streams.intake import handle_intake

MAX_BATCH = 1000
#: States in which a job waits for a person, and who: the SSE stream ends on them.
WAITING_FOR_PERSON = {"needs_reconciliation": "operator"}
_DEDUP_MESSAGES = {
    "new": "a new job",
    "replayed": "the same Idempotency-Key again: the same job, no new work",
    "reused": "the same computation already succeeded or is running: its job, no new work",
    "restarted": "the same computation had failed or was cancelled: a new run of its job "
                 "started",
}
_bearer = HTTPBearer(auto_error=False)


class JobRequest(BaseModel):
    """One document to analyse: ``text`` or ``content_b64`` (exactly one), plus options."""

    model_config = ConfigDict(extra="forbid")

    filename: str = Field("document.txt", min_length=1, max_length=512,
                          pattern=NO_CONTROL_CHARS)
    text: str | None = Field(None, description="The document as UTF-8 text.")
    content_b64: str | None = Field(None, description="The document's bytes, base64.")
    content_type: Literal["text/plain", "application/pdf"] = "text/plain"
    pipeline: str | None = Field(None, min_length=1, max_length=100, pattern=NO_CONTROL_CHARS)
    prompt_version: str | None = Field(None, min_length=1, max_length=100,
                                       pattern=NO_CONTROL_CHARS)
    model_profile: str | None = Field(None, min_length=1, max_length=100,
                                      pattern=NO_CONTROL_CHARS)
    lane: Literal["interactive", "batch"] | None = None

    @model_validator(mode="after")
    def _one_source(self) -> JobRequest:
        if (self.text is None) == (self.content_b64 is None):
            raise ValueError("give exactly one of text and content_b64")
        return self

    def content(self) -> bytes:
        """The document's bytes. Raises ``ValueError`` for invalid base64."""
        if self.text is not None:
            return self.text.encode()
        return base64.b64decode(self.content_b64 or "", validate=True)


class BatchRequest(BaseModel):
    """Up to 1000 documents in one intent; options apply to every document."""

    model_config = ConfigDict(extra="forbid")

    documents: list[JobRequest] = Field(min_length=1, max_length=MAX_BATCH)
    lane: Literal["interactive", "batch"] = "batch"


class JobCreated(BaseModel):
    """202/200 answer of ``POST /v1/jobs`` (and of a cancel)."""

    job_id: uuid.UUID
    status: str
    dedup: Literal["new", "replayed", "reused", "restarted"] | None = Field(
        None, description="How the intent was bound to its job: `new` job (202); `replayed` "
        "(the same Idempotency-Key again: the same job, no new work); `reused` (another key "
        "for the same computation, which succeeded or is still running: its job, no new "
        "work); `restarted` (the same computation had failed or was cancelled: a new run of "
        "that job started, 202).")
    message: str | None = Field(None, description="What happened, in words.")


class StageView(BaseModel):
    """One checkpoint of a job."""

    stage: str
    status: str
    attempt: int
    code_version: str | None
    started_at: datetime | None
    finished_at: datetime | None
    cost_usd: float
    error_code: str | None


class AttemptView(BaseModel):
    """One provider attempt (the provider call log)."""

    chunk_idx: int | None
    attempt: int
    outcome: str
    status_code: int | None
    latency_ms: float | None
    prompt_tokens: int | None
    completion_tokens: int | None
    cost_usd: float
    started_at: datetime
    finished_at: datetime | None


class JobView(BaseModel):
    """``GET /v1/jobs/{id}``: where the job is, what it cost so far, and the result when
    ready. Times are ISO 8601; ``queue_wait_s`` and ``run_s`` are seconds."""

    job_id: uuid.UUID
    status: str
    current_stage: str
    stages_done: int
    stages_total: int
    lane: str
    filename: str
    pipeline: str
    prompt_version: str
    model_profile: str
    stage_runs: int = Field(description="Stage runs over the stages after intake (retries "
                            "included; intake is the acceptance itself, not a run).")
    provider_attempts: list[AttemptView]
    cost_so_far_usd: float = Field(description="Provider cost of every attempt so far (USD).")
    charge_usd: float = Field(description="What the client is charged: per accepted job (USD).")
    cancel_requested: bool
    error_code: str | None
    error: str | None
    created_at: datetime
    finished_at: datetime | None
    queue_wait_s: float | None
    run_s: float | None
    stages: list[StageView]
    result: dict[str, Any] | None


class BatchView(BaseModel):
    """``GET /v1/batches/{id}``: counts per status and cost so far."""

    batch_id: uuid.UUID
    lane: str
    cancel_requested: bool
    jobs: int
    queued: int
    running: int
    succeeded: int
    failed: int
    cancelled: int
    needs_reconciliation: int
    cost_so_far_usd: float
    job_ids: list[uuid.UUID]


class Problem(BaseModel):
    """An error answer: a stable ``code`` and a human ``message``."""

    code: str
    message: str


def _tenant(request: Request,
            creds: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> str:
    """The tenant of the bearer token (compared in constant time). Raises 401 for a missing or
    unknown token."""
    if creds is not None:
        given = creds.credentials.encode()
        for token, tenant in app_settings(request).api_tokens.items():
            if hmac.compare_digest(token.get_secret_value().encode(), given):
                return tenant
    raise HTTPException(401, detail={"code": "unauthorized",
                                     "message": "a valid bearer token is required"},
                        headers={"WWW-Authenticate": "Bearer"})


Tenant = Annotated[str, Depends(_tenant)]
IdemKey = Annotated[str, Header(alias="Idempotency-Key", min_length=1, max_length=200,
                                description="One key per client intent (required).")]


def _problem(status: int, code: str, message: str) -> HTTPException:
    return HTTPException(status, detail={"code": code, "message": message})


class _BodyTooLarge(HTTPException):
    """Raised by :class:`BodyLimitMiddleware`'s ``receive`` once the body passes the limit."""


class BodyLimitMiddleware:
    """ASGI middleware: refuse a request body over ``max_bytes`` with 413
    ``request_too_large`` before parsing. A declared ``Content-Length`` over the limit is
    refused before a byte of the body is read; otherwise the bytes are counted as they arrive
    (chunked or lying clients) and reading stops at the limit, so a request never holds more
    than ``max_bytes`` of body in memory."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _problem(self) -> dict[str, str]:
        return {"code": "request_too_large",
                "message": f"the request body is over the limit of {self.max_bytes} bytes"}

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.strip().isdigit() \
                and int(declared) > self.max_bytes:
            await JSONResponse(self._problem(), status_code=413,
                               headers={"Connection": "close"})(scope, receive, send)
            return
        seen = 0
        started = False

        async def limited_receive() -> Any:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _BodyTooLarge(413, detail=self._problem(),
                                        headers={"Connection": "close"})
            return message

        async def tracking_send(message: Any) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _BodyTooLarge:
            if started:
                raise
            await JSONResponse(self._problem(), status_code=413,
                               headers={"Connection": "close"})(scope, receive, send)


_REQUEST_ID_OK = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:")


class TraceMiddleware:
    """ASGI middleware: each HTTP request runs in a span continuing its ``traceparent``
    header (or a new trace) and in a log context with its ``request_id``: the client's
    ``X-Request-Id`` (up to 200 of ``[A-Za-z0-9._:-]``) or a new one, echoed in the response.
    Jobs created by the request carry that request id and trace."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        rid = headers.get(b"x-request-id", b"").decode("latin-1")
        if not rid or len(rid) > 200 or not set(rid) <= _REQUEST_ID_OK:
            rid = uuid.uuid4().hex

        async def send_with_id(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"x-request-id", rid.encode())]}
            await send(message)

        span = tracing.continue_from(headers.get(tracing.HEADER.encode()))
        with tracing.use(span), logs.log_context(request_id=rid):
            await self.app(scope, receive, send_with_id)


# ------------------------------------------------------------------------------ dependencies
# Routes live on APIRouters (``jobs``, ``batches``, ``ops``) and get what they need through
# FastAPI dependencies that read the app's state (:func:`bind_state`): a test mounts one router
# on a bare app with its own state and calls it alone.


def app_settings(request: Request) -> Settings:
    """The app's :class:`~jobstream.settings.Settings` (``app.state.settings``)."""
    settings: Settings = request.app.state.settings
    return settings


def stage_context(request: Request) -> StageContext:
    """The app's :class:`~streams.context.StageContext`: settings and the store (its pool of
    Postgres connections), ``app.state.ctx``."""
    ctx: StageContext = request.app.state.ctx
    return ctx


AppSettings = Annotated[Settings, Depends(app_settings)]
Ctx = Annotated[StageContext, Depends(stage_context)]


def bind_state(app: FastAPI, settings: Settings, store: Store) -> StageContext:
    """Give ``app`` what the routers' dependencies read: ``state.settings``, ``state.ctx``
    (settings + ``store``) and ``state.metrics_registry``. Returns the context."""
    ctx = StageContext(settings, store)
    app.state.settings = settings
    app.state.ctx = ctx
    app.state.metrics_registry = metrics.registry(settings, store)
    return ctx


def install_error_handlers(app: FastAPI) -> None:
    """Map every error a route can raise to a ``{"code", "message"}`` answer (never a 500 for
    the client's fault): HTTP errors, validation (400 ``malformed_json``,
    ``missing_idempotency_key``, ``idempotency_key_too_long``; 422 ``invalid_request``),
    idempotency-key conflicts (409), data Postgres refuses (422 ``invalid_data``), integrity
    conflicts (409) and outages (503 with ``Retry-After``)."""

    @app.exception_handler(StarletteHTTPException)  # also FastAPI's, and the router's 404/405
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        codes = {400: "bad_request", 404: "not_found", 405: "method_not_allowed",
                 413: "request_too_large", 415: "unsupported_media_type"}
        detail = exc.detail if isinstance(exc.detail, dict) else {
            "code": codes.get(exc.status_code, f"http_{exc.status_code}"),
            "message": str(exc.detail)}
        return JSONResponse(detail, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(IdempotencyConflict)
    async def _conflict(_: Request, exc: IdempotencyConflict) -> JSONResponse:
        return JSONResponse({"code": exc.code, "message": str(exc)}, status_code=409)

    @app.exception_handler(DataError)
    async def _data_error(_: Request, exc: DataError) -> JSONResponse:
        return JSONResponse({"code": "invalid_data",
                             "message": f"Postgres refused the request's data: {exc}"[:500]},
                            status_code=422)

    @app.exception_handler(IntegrityError)
    async def _integrity_error(_: Request, exc: IntegrityError) -> JSONResponse:
        return JSONResponse({"code": "conflict",
                             "message": f"the request conflicts with stored data: {exc}"[:500]},
                            status_code=409)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            return JSONResponse({"code": "malformed_json",
                                 "message": "the request body is not valid JSON"},
                                status_code=400)
        key_errors = [e for e in errors if e.get("loc", ())[:2] == ("header", "Idempotency-Key")]
        if any(e.get("type") == "string_too_long" for e in key_errors):
            return JSONResponse({"code": "idempotency_key_too_long",
                                 "message": "the Idempotency-Key header is longer than 200 "
                                            "characters"}, status_code=400)
        if key_errors:
            return JSONResponse({"code": "missing_idempotency_key",
                                 "message": "the Idempotency-Key header is required (one key "
                                            "per client intent)"}, status_code=400)
        detail = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}"
                           for e in errors[:5])
        hint = (" (send Content-Type: application/json)"
                if any(e.get("type") in ("model_attributes_type", "dict_type") for e in errors)
                else "")
        # Not the input itself: a hostile body is not echoed back.
        return JSONResponse({"code": "invalid_request", "message": detail + hint,
                             "errors": jsonable_encoder([{k: e.get(k) for k in ("type", "loc",
                                                                               "msg")}
                                                         for e in errors[:20]])},
                            status_code=422)

    @app.exception_handler(RetryableError)
    async def _unavailable(_: Request, exc: RetryableError) -> JSONResponse:
        retry_after = max(1, round(exc.retry_after_s)) if exc.retry_after_s else 1
        return JSONResponse({"code": exc.code, "message": str(exc)}, status_code=503,
                            headers={"Retry-After": str(retry_after)})


def create_app(settings: Settings, store: Store | None = None) -> FastAPI:
    """Build the API app: the ``jobs``, ``batches`` and ``ops`` routers, the error handlers and
    the middlewares. ``store`` defaults to a pool on ``settings.database_url``."""
    app = FastAPI(title="jobstream", version="1", description=__doc__,
                  responses={401: {"model": Problem}, 404: {"model": Problem}})
    bind_state(app, settings, store or Store.for_process(settings, "api",
                                                         settings.db_pool_api_max))
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.api_max_body_bytes)
    app.add_middleware(TraceMiddleware)
    install_error_handlers(app)
    app.include_router(jobs)
    app.include_router(batches)
    app.include_router(ops)
    return app


# ------------------------------------------------------------------------------ shared steps

def _invalid_request(exc: ValidationError) -> HTTPException:
    return _problem(422, "invalid_request", "; ".join(
        f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:5]))


def event_for(settings: Settings, tenant: str, key: str, req: JobRequest,
              lane: str | None = None) -> DocumentUploaded:
    """The ``document.uploaded`` event of one requested document (options defaulted from
    ``settings``; ``lane`` is the batch's, used when the document names none). Raises
    ``HTTPException`` 422 ``invalid_content`` / ``empty_document`` / ``invalid_request``, 413
    ``document_too_large``."""
    try:
        data = req.content()
    except ValueError as exc:
        raise _problem(422, "invalid_content", f"content_b64 is not base64: {exc}") from None
    if not data.strip():
        raise _problem(422, "empty_document", "the document is empty")
    if len(data) > settings.max_inline_document_bytes:
        raise _problem(413, "document_too_large", f"{len(data)} bytes; the limit is "
                                                  f"{settings.max_inline_document_bytes}")
    rid = logs.current_context().get("request_id")
    try:
        doc = DocumentRef(filename=req.filename, content_type=req.content_type,
                          sha256=hashlib.sha256(data).hexdigest(), size_bytes=len(data),
                          content_b64=base64.b64encode(data).decode())
        return DocumentUploaded(
            tenant_id=tenant, idempotency_key=key, **({"request_id": rid} if rid else {}),
            payload=DocumentUploadedPayload(
                document=doc, pipeline=req.pipeline or settings.pipeline,
                prompt_version=req.prompt_version or settings.prompt_version,
                model_profile=req.model_profile or settings.model_profile,
                lane=req.lane or lane or "interactive"))
    except ValidationError as exc:  # e.g. a control character in the Idempotency-Key
        raise _invalid_request(exc) from None


def intake_result(ctx: StageContext, ev: DocumentUploaded, conn: Any = None) -> IntakeResult:
    """Transactional intake of one event (:func:`streams.intake.handle_intake`); ``conn``
    joins the caller's transaction. Raises :class:`IdempotencyConflict` (409 by the app's
    handler) and ``HTTPException`` 422 with the poison message's code."""
    try:
        return handle_intake(ctx, ev, conn=conn, emit_uploaded=ctx.settings.api_emit_uploaded)
    except IdempotencyConflict:
        raise
    except PoisonMessage as exc:
        raise _problem(422, exc.code, str(exc)) from None


def _replayed(response: Response) -> None:
    """Answer a replayed Idempotency-Key: 200 with ``Idempotent-Replayed: true`` (jobs and
    batches alike)."""
    response.status_code = 200
    response.headers["Idempotent-Replayed"] = "true"


def _job_status(ctx: StageContext, job_id: uuid.UUID) -> str:
    job = ctx.store.job(job_id)
    return job.status if job else "unknown"


def created_answer(ctx: StageContext, r: IntakeResult, response: Response) -> JobCreated:
    """202 for new work (a new job, or a new run of a failed/cancelled one), else 200."""
    if r.dedup == "replayed":
        _replayed(response)
    elif r.dedup not in ("new", "restarted"):
        response.status_code = 200
    return JobCreated(job_id=r.job_id, status=_job_status(ctx, r.job_id), dedup=r.dedup,
                      message=_DEDUP_MESSAGES[r.dedup])


def job_view(ctx: StageContext, tenant: str, job_id: uuid.UUID) -> JobView:
    """The tenant's job as a :class:`JobView`. Raises ``HTTPException`` 404 for another
    tenant's or an unknown job."""
    with ctx.store.tx() as conn:
        job = conn.execute(Q["api_job"], (job_id, tenant)).fetchone()
        if job is None:
            raise _problem(404, "not_found", f"no job {job_id}")
        stages = list(conn.execute(Q["api_job_stages"], (job_id,)))
        attempts = list(conn.execute(Q["api_job_attempts"], (job_id,)))
        result = None
        if job["status"] == "succeeded":
            row = conn.execute(Q["get_stage"], (job_id, "validate")).fetchone()
            result = row["output"] if row else None
    started, finished = job["first_started_at"], job["finished_at"]
    return JobView(
        job_id=job_id, status=job["status"], current_stage=job["current_stage"],
        stages_done=sum(s["status"] == "succeeded" for s in stages),
        stages_total=len(STAGES), lane=job["lane"], filename=job["filename"],
        pipeline=job["pipeline"], prompt_version=job["prompt_version"],
        model_profile=job["model_profile"],
        stage_runs=sum(s["attempt"] for s in stages if s["stage"] != STAGES[0]),
        provider_attempts=[AttemptView(**a) for a in attempts],
        cost_so_far_usd=job["cost_so_far_usd"], charge_usd=float(job["charge_usd"]),
        cancel_requested=job["cancel_requested"], error_code=job["error_code"],
        error=job["error"], created_at=job["created_at"], finished_at=finished,
        queue_wait_s=(started - job["created_at"]).total_seconds() if started else None,
        run_s=(finished - started).total_seconds() if started and finished else None,
        stages=[StageView(**s) for s in sorted(stages, key=lambda s: STAGES.index(s["stage"]))],
        result=result)


def batch_view(ctx: StageContext, tenant: str, batch_id: uuid.UUID) -> BatchView:
    """The tenant's batch as a :class:`BatchView` (one query for the counts). Raises
    ``HTTPException`` 404 for another tenant's or an unknown batch."""
    with ctx.store.tx() as conn:
        row = conn.execute(Q["api_batch"], (batch_id, tenant)).fetchone()
        if row is None:
            raise _problem(404, "not_found", f"no batch {batch_id}")
        ids = [r["job_id"] for r in conn.execute(Q["batch_job_ids"], (batch_id, tenant))]
    return BatchView(**{k: row[k] for k in BatchView.model_fields if k != "job_ids"},
                     job_ids=ids)


# ------------------------------------------------------------------------------ jobs router

#: ``/v1/jobs``: create (JSON or upload), read, follow (SSE) and cancel one job.
jobs = APIRouter(tags=["jobs"])


@jobs.post("/v1/jobs", status_code=202, response_model=JobCreated,
           responses={200: {"model": JobCreated, "description": "replayed intent"},
                      409: {"model": Problem}, 422: {"model": Problem}})
def create_job(req: JobRequest, t: Tenant, idempotency_key: IdemKey, response: Response,
               ctx: Ctx) -> JobCreated:
    """Create a job (202), or return the job of a replayed Idempotency-Key (200). Another
    key for a computation that already succeeded or is running returns its job (200,
    ``dedup: reused``); for one that failed or was cancelled it starts a new run of that
    job (202, ``dedup: restarted``)."""
    return created_answer(ctx, intake_result(ctx, event_for(ctx.settings, t, idempotency_key,
                                                             req)), response)


@jobs.post("/v1/jobs/upload", status_code=202, response_model=JobCreated,
           responses={200: {"model": JobCreated, "description": "replayed intent"},
                      409: {"model": Problem}, 422: {"model": Problem}})
async def upload_job(t: Tenant, idempotency_key: IdemKey, response: Response, ctx: Ctx,
                     file: Annotated[UploadFile, File(description="The document.")],
                     lane: Annotated[Literal["interactive", "batch"] | None, Form()] = None,
                     prompt_version: Annotated[str | None, Form()] = None,
                     model_profile: Annotated[str | None, Form()] = None) -> JobCreated:
    """Create a job from a multipart/form-data upload (``file`` plus optional fields);
    the same rules as ``POST /v1/jobs``. PDFs are recognised by type or ``%PDF-``."""
    settings = ctx.settings
    data = await file.read()
    if len(data) > settings.max_inline_document_bytes:
        raise _problem(413, "document_too_large",
                       f"{len(data)} bytes; the limit is {settings.max_inline_document_bytes}")
    is_pdf = file.content_type == "application/pdf" or data[:5] == b"%PDF-"
    try:
        req = JobRequest(filename=(file.filename or "document")[:512] or "document",
                         content_b64=base64.b64encode(data).decode(),
                         content_type="application/pdf" if is_pdf else "text/plain",
                         lane=lane, prompt_version=prompt_version,
                         model_profile=model_profile)
    except ValidationError as exc:  # e.g. a control character in the file's name
        raise _invalid_request(exc) from None
    return await asyncio.to_thread(lambda: created_answer(
        ctx, intake_result(ctx, event_for(settings, t, idempotency_key, req)), response))


@jobs.get("/v1/jobs/{job_id}", response_model=JobView)
def get_job(job_id: uuid.UUID, t: Tenant, ctx: Ctx) -> JobView:
    """The job's status, stages, provider attempts, cost so far and result. Another
    tenant's job is 404."""
    return job_view(ctx, t, job_id)


@jobs.post("/v1/jobs/{job_id}/cancel", status_code=202, response_model=JobCreated,
           responses={200: {"model": JobCreated, "description": "the job had already "
                                                                "ended: nothing changed"}})
def cancel_job(job_id: uuid.UUID, t: Tenant, response: Response, ctx: Ctx) -> JobCreated:
    """Ask the job to stop: workers stop before the next provider call and abort an
    in-flight one; a job with no running stage ends ``cancelled`` at once (202).
    Cancelling a finished job changes nothing, not even ``cancel_requested`` (200, the
    state it ended in)."""
    with ctx.store.tx() as conn:
        conn.execute(Q["api_lock_timeout"])  # a frozen worker's row lock: 503, not a hang
        row = conn.execute(Q["request_cancel"], (job_id, t)).fetchone()
        if row is None:
            ended = conn.execute(Q["api_job_status"], (job_id, t)).fetchone()
            if ended is None:
                raise _problem(404, "not_found", f"no job {job_id}")
            response.status_code = 200
            return JobCreated(job_id=job_id, status=ended["status"],
                              message=f"the job had already ended ({ended['status']}): "
                                      "nothing to cancel")
        conn.execute(Q["cancel_waiting_jobs"], ([job_id],))
    return JobCreated(job_id=job_id, status=_job_status(ctx, job_id),
                      message="cancel requested: the job stops before its next provider "
                              "call")


@jobs.get("/v1/jobs/{job_id}/events")
async def job_events(job_id: uuid.UUID, t: Tenant, request: Request, ctx: Ctx,
                     poll_s: float = 0.5) -> StreamingResponse:
    """Server-Sent Events: a ``progress`` event (the JobView as JSON) whenever the job
    changes, and a ``: keep-alive`` comment every ``JOBSTREAM_SSE_KEEPALIVE_S`` seconds
    without one (proxies cut idle streams). The stream ends with an ``end`` event
    (``status``, ``current_stage``, ``error_code``, ``waiting_for``) on a terminal state
    and on every state that waits for a person (``needs_reconciliation``:
    ``waiting_for: operator``, see ``jobstream reconcile``)."""
    job_view(ctx, t, job_id)  # 404 before the stream starts
    keepalive_s = ctx.settings.sse_keepalive_s

    async def stream() -> AsyncIterator[str]:
        last = None
        quiet_since = time.monotonic()
        while not await request.is_disconnected():
            v = await asyncio.to_thread(job_view, ctx, t, job_id)
            body = v.model_dump_json()
            if body != last:
                yield f"event: progress\ndata: {body}\n\n"
                last, quiet_since = body, time.monotonic()
            elif time.monotonic() - quiet_since >= keepalive_s:
                yield ": keep-alive\n\n"
                quiet_since = time.monotonic()
            if v.status in TERMINAL or v.status in WAITING_FOR_PERSON:
                end = {"status": v.status, "current_stage": v.current_stage,
                       "error_code": v.error_code,
                       "waiting_for": WAITING_FOR_PERSON.get(v.status)}
                yield f"event: end\ndata: {json.dumps(end)}\n\n"
                return
            await asyncio.sleep(max(0.1, min(poll_s, 5.0, keepalive_s)))

    return StreamingResponse(stream(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})


# ------------------------------------------------------------------------------ batches router

#: ``/v1/batches``: create up to 1000 jobs in one transaction, read and cancel a batch.
batches = APIRouter(tags=["batches"])


@batches.post("/v1/batches", status_code=202, response_model=BatchView,
              responses={200: {"model": BatchView}, 409: {"model": Problem},
                         422: {"model": Problem}})
def create_batch(req: BatchRequest, t: Tenant, idempotency_key: IdemKey, response: Response,
                 ctx: Ctx) -> BatchView:
    """Create up to 1000 jobs in ONE transaction (document i gets the idempotency key
    ``<key>:<i>``). The same key again returns the same batch (200, ``Idempotent-Replayed:
    true``); another body is 409 — the same rules, and code, as ``POST /v1/jobs``."""
    settings = ctx.settings
    events: list[DocumentUploaded] = []
    total = 0
    for i, d in enumerate(req.documents):
        events.append(event_for(settings, t, f"{idempotency_key}:{i}", d, req.lane))
        total += events[-1].payload.document.size_bytes
        if total > settings.api_max_batch_bytes:
            raise _problem(413, "batch_too_large",
                           f"the batch's documents are over {settings.api_max_batch_bytes} "
                           f"bytes together (at document {i})")
    rh = idempotency.batch_request_hash(
        [idempotency.document_request_hash(e.payload) for e in events])
    with ctx.store.tx() as conn:
        # A concurrent identical request waits here for the first one's transaction; then
        # it finds the batch and replays it (no unique violation, no 500).
        new_id = uuid.uuid4()
        created = conn.execute(Q["insert_batch"],
                               (new_id, t, idempotency_key, rh, req.lane)).fetchone()
        if created is None:
            batch_id = idempotency.bound_target(
                conn.execute(Q["find_batch"], (t, idempotency_key)).fetchone(),
                key=idempotency_key, request_hash=rh, target="batch")
            assert batch_id is not None  # the insert conflicted: the record exists
            _replayed(response)
        else:
            batch_id = new_id
            # Document and job rows are locked in one global order (hash, content type),
            # not the request's: concurrent batches sharing documents in another order
            # deadlocked (503 for all but one).
            order = sorted(range(len(events)), key=lambda i: (
                events[i].payload.document.sha256, events[i].payload.document.content_type))
            for i in order:
                job_id = intake_result(ctx, events[i], conn).job_id
                conn.execute(Q["insert_batch_job"], (batch_id, i, job_id))
    return batch_view(ctx, t, batch_id)


@batches.get("/v1/batches/{batch_id}", response_model=BatchView)
def get_batch(batch_id: uuid.UUID, t: Tenant, ctx: Ctx) -> BatchView:
    """Counts per status and cost so far of a batch (one query)."""
    return batch_view(ctx, t, batch_id)


@batches.post("/v1/batches/{batch_id}/cancel", status_code=202, response_model=BatchView)
def cancel_batch(batch_id: uuid.UUID, t: Tenant, ctx: Ctx) -> BatchView:
    """Cancel every unfinished job of the batch: queued stages are skipped when their
    events arrive, running ones stop before their next provider call."""
    with ctx.store.tx() as conn:
        conn.execute(Q["api_lock_timeout"])  # a frozen worker's row lock: 503, not a hang
        if conn.execute(Q["mark_batch_cancelled"], (batch_id, t)).fetchone() is None:
            raise _problem(404, "not_found", f"no batch {batch_id}")
        conn.execute(Q["request_cancel_batch"], (batch_id,))
        ids = [r["job_id"] for r in conn.execute(Q["batch_job_ids"], (batch_id, t))]
        conn.execute(Q["cancel_waiting_jobs"], (ids,))
    return batch_view(ctx, t, batch_id)


# ------------------------------------------------------------------------------ ops router

#: ``/metrics`` and ``/healthz`` (no token, not in the OpenAPI document).
ops = APIRouter(include_in_schema=False)


@ops.get("/metrics")
def prometheus_metrics(request: Request) -> Response:
    """Prometheus metrics of the whole pipeline, read from Postgres and Kafka now
    (:mod:`jobstream.metrics`); OpenMetrics when the scraper asks for it. No token: expose
    it to the monitoring network only."""
    from prometheus_client.exposition import choose_encoder
    encoder, content_type = choose_encoder(request.headers.get("accept", ""))
    return Response(encoder(request.app.state.metrics_registry),
                    headers={"Content-Type": content_type})


@ops.get("/healthz")
def healthz() -> JSONResponse:
    """Readiness (jobstream/health.py): 200 while the API can get a database connection,
    503 after ``health_fail_after_s`` without one."""
    from jobstream import health
    ready = health.current()
    if ready is None:
        return JSONResponse({"status": "ok", "process": "api"})
    return JSONResponse(ready.status(), status_code=200 if ready.healthy else 503)


#: Tokens that are examples, not secrets: the API refuses them unless allowed for development.
PLACEHOLDER_TOKENS = frozenset({"", "change-me", "changeme", "change_me", "secret", "token",
                                "password", "secret-token", "test", "dev"})


def placeholder_tokens(settings: Settings) -> list[str]:
    """The tenants whose API token is a placeholder (blank, ``change-me``...)."""
    return [tenant for token, tenant in settings.api_tokens.items()
            if token.get_secret_value().strip().lower() in PLACEHOLDER_TOKENS]


def main(settings: Settings, host: str, port: int) -> int:
    """Serve the API with uvicorn until SIGINT/SIGTERM; returns the exit code."""
    import uvicorn
    if not settings.api_tokens:
        raise SystemExit("no API tokens configured: set JOBSTREAM_API_TOKENS to a JSON object "
                         "token -> tenant, with a random token, e.g. JOBSTREAM_API_TOKENS="
                         "\"{\\\"$(openssl rand -hex 24)\\\": \\\"acme\\\"}\"")
    placeholders = placeholder_tokens(settings)
    if placeholders and not settings.api_allow_dev_tokens:
        raise SystemExit(f"refusing to start: {len(placeholders)} API token(s) are placeholders "
                         f"(for tenants {sorted(placeholders)}); set real tokens in "
                         "JOBSTREAM_API_TOKENS, or JOBSTREAM_API_ALLOW_DEV_TOKENS=true for "
                         "local development only")
    from jobstream import health
    app = create_app(settings)
    health.setup("api", settings, probe=app.state.ctx.store.probe, serve=False)
    # JSON logs: uvicorn's loggers propagate to the root handler instead of their own.
    extra: dict[str, Any] = {"log_config": None} if settings.log_format == "json" else {}
    uvicorn.run(app, host=host, port=port, log_level="info", **extra)
    return 0
