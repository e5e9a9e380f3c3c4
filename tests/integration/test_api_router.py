"""One API router on its own: the ``batches`` router mounted on a bare FastAPI app with its own
state (settings, a store on the test's real Postgres) and the error handlers, nothing else —
routes are testable one router at a time (issue 8)."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from pydantic import SecretStr

from jobstream import api
from jobstream.settings import Settings
from jobstream.store import Store
from tests.helpers import query

pytestmark = pytest.mark.integration

ACME = {"Authorization": "Bearer tok-router"}


class Client:
    """Calls the app in this process over ASGI (httpx), one request per call."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app

    def request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        async def call() -> httpx.Response:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app),
                                         base_url="http://router.test", timeout=30) as c:
                return await c.request(method, path, **kw)
        return asyncio.run(call())

    def post(self, path: str, **kw: Any) -> httpx.Response:
        return self.request("POST", path, **kw)

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return self.request("GET", path, **kw)


@pytest.fixture
def client(settings: Settings) -> Iterator[Client]:
    s = settings.model_copy(update={"api_tokens": {SecretStr("tok-router"): "acme"}})
    store = Store.for_process(s, "api-router-test", 4)
    app = FastAPI()
    api.bind_state(app, s, store)
    api.install_error_handlers(app)
    app.include_router(api.batches)
    try:
        yield Client(app)
    finally:
        store.close()


def _docs(*texts: str) -> dict:
    return {"documents": [{"filename": f"d{i}.txt", "text": t} for i, t in enumerate(texts)]}


def test_batches_router_alone_creates_replays_and_refuses_a_reused_key(
        client: Client, settings: Settings) -> None:
    body = _docs("first document", "second document")
    first = client.post("/v1/batches", json=body, headers={**ACME, "Idempotency-Key": "b1"})
    assert first.status_code == 202, first.text
    batch = first.json()
    assert batch["jobs"] == 2 and len(batch["job_ids"]) == 2
    assert "Idempotent-Replayed" not in first.headers

    # The same key, the same documents (one given as base64: the same bytes): a replay.
    same = {"documents": [body["documents"][0],
                          {"filename": "d1.txt",
                           "content_b64": base64.b64encode(b"second document").decode()}]}
    again = client.post("/v1/batches", json=same, headers={**ACME, "Idempotency-Key": "b1"})
    assert again.status_code == 200, again.text
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.json()["batch_id"] == batch["batch_id"]

    # The same key, another body: 409 with the job endpoint's code (one implementation).
    other = client.post("/v1/batches", json=_docs("another document"),
                        headers={**ACME, "Idempotency-Key": "b1"})
    assert other.status_code == 409, other.text
    assert other.json()["code"] == "idempotency_key_conflict"
    assert query(settings.database_url, "SELECT count(*) AS n FROM batch")[0]["n"] == 1
    assert query(settings.database_url, "SELECT count(*) AS n FROM job")[0]["n"] == 2

    # Only this router is mounted: the jobs routes are not there, and a token is still needed.
    assert client.get(f"/v1/jobs/{batch['job_ids'][0]}", headers=ACME).status_code == 404
    unauth = client.get(f"/v1/batches/{batch['batch_id']}")
    assert unauth.status_code == 401 and unauth.json()["code"] == "unauthorized"
    got = client.get(f"/v1/batches/{batch['batch_id']}", headers=ACME)
    assert got.status_code == 200 and got.json()["queued"] == 2, got.text
