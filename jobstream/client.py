"""A small client of the HTTP API, used by ``jobstream submit|status|cancel|batch``.

Base URL and token come from ``JOBSTREAM_API_URL`` / ``JOBSTREAM_API_TOKEN`` or the command
line. Errors come back as :class:`ApiError` with the API's ``code`` and ``message``.
"""

from __future__ import annotations

import base64
import uuid
from pathlib import Path
from typing import Any

import httpx

from jobstream.producer import content_type_of


class ApiError(Exception):
    """The API answered an error: HTTP ``status``, stable ``code``, human ``message``."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{status} {code}: {message}" if status else f"{code}: {message}")
        self.status, self.code, self.message = status, code, message


def document_body(path: Path, **options: Any) -> dict[str, Any]:
    """The JSON body of one document (text or base64 bytes) plus non-empty ``options``."""
    ctype = content_type_of(path)
    data = path.read_bytes()
    body: dict[str, Any] = {"filename": path.name, "content_type": ctype}
    if ctype == "text/plain":
        try:
            body["text"] = data.decode()
        except UnicodeDecodeError:
            body["content_b64"] = base64.b64encode(data).decode()
    else:
        body["content_b64"] = base64.b64encode(data).decode()
    body.update({k: v for k, v in options.items() if v is not None})
    return body


class ApiClient:
    """``base_url``: e.g. ``http://127.0.0.1:8080``; ``token``: the tenant's bearer token."""

    def __init__(self, base_url: str, token: str, timeout_s: float = 60.0) -> None:
        self.http = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout_s,
                                 headers={"Authorization": f"Bearer {token}"})

    def _call(self, method: str, path: str, **kw: Any) -> dict[str, Any]:
        try:
            r = self.http.request(method, path, **kw)
        except httpx.HTTPError as exc:
            raise ApiError(0, "unreachable", f"no API at {self.http.base_url} ({exc}); is "
                           "`jobstream api` running, and is --api right?") from None
        if r.status_code >= 400:
            try:
                body = r.json()
                code, msg = body.get("code", "error"), body.get("message", r.text)
            except ValueError:
                code, msg = "error", r.text
            raise ApiError(r.status_code, str(code), str(msg))
        return dict(r.json())

    def create_job(self, body: dict[str, Any], key: str) -> dict[str, Any]:
        """POST /v1/jobs with ``Idempotency-Key: key``."""
        return self._call("POST", "/v1/jobs", json=body, headers={"Idempotency-Key": key})

    def job(self, job_id: uuid.UUID | str) -> dict[str, Any]:
        """GET /v1/jobs/{id}."""
        return self._call("GET", f"/v1/jobs/{job_id}")

    def cancel(self, job_id: uuid.UUID | str) -> dict[str, Any]:
        """POST /v1/jobs/{id}/cancel."""
        return self._call("POST", f"/v1/jobs/{job_id}/cancel")

    def create_batch(self, docs: list[dict[str, Any]], key: str, lane: str) -> dict[str, Any]:
        """POST /v1/batches with ``Idempotency-Key: key``."""
        return self._call("POST", "/v1/batches", json={"documents": docs, "lane": lane},
                          headers={"Idempotency-Key": key})

    def batch(self, batch_id: uuid.UUID | str) -> dict[str, Any]:
        """GET /v1/batches/{id}."""
        return self._call("GET", f"/v1/batches/{batch_id}")

    def cancel_batch(self, batch_id: uuid.UUID | str) -> dict[str, Any]:
        """POST /v1/batches/{id}/cancel."""
        return self._call("POST", f"/v1/batches/{batch_id}/cancel")
