"""Hostile documents through the whole pipeline (issue 9, rows 4 and 8): each kind built here
with pypdf / fpdf2 fails its job permanently with its own code after bounded work, with no
provider call and no retry, and the worker keeps serving: a good document after them succeeds.

Documents travel as ``file://`` URIs under ``JOBSTREAM_DOCUMENT_ROOTS`` (the bytes actually read
are what intake checks) on ``document.uploaded``, as another service would send them.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from jobstream.drills.fake_provider import FakeProvider
from jobstream.producer import produce_raw
from jobstream.settings import Settings
from schemas.events import DocumentRef, DocumentUploaded, DocumentUploadedPayload, encode_event
from tests.helpers import ProcessRunner, query, read_topic, wait_for
from tests.hostile_documents import CORPUS, TEXT, good_pdf

pytestmark = pytest.mark.e2e

MAX_TEXT_CHARS = 100_000


def _event(path: Path, key: str, content_type: str, size_bytes: int | None = None,
           model_profile: str = "local") -> DocumentUploaded:
    data = path.read_bytes()
    doc = DocumentRef(filename=path.name, content_type=content_type,  # type: ignore[arg-type]
                      sha256=hashlib.sha256(data).hexdigest(),
                      size_bytes=len(data) if size_bytes is None else size_bytes,
                      uri=f"file://{path}")
    return DocumentUploaded(tenant_id="acme", idempotency_key=key,
                            payload=DocumentUploadedPayload(document=doc,
                                                            model_profile=model_profile))


def _publish(settings: Settings, events: list[DocumentUploaded]) -> None:
    produce_raw(settings, settings.topic("document.uploaded"),
                [(e.idempotency_key.encode(), encode_event(e)) for e in events])


def test_hostile_documents_fail_with_their_codes_without_provider_calls_or_retries(
        settings: Settings, procs: ProcessRunner, tmp_path: Path) -> None:
    root = tmp_path / "docs"
    root.mkdir()
    expected: dict[str, str] = {}
    events = []
    for kind, build in sorted(CORPUS.items()):
        data, content_type, code = build()
        path = root / f"{kind}.pdf"
        path.write_bytes(data)
        events.append(_event(path, kind, content_type, model_profile="custom"))
        expected[kind] = code
    too_much = root / "too_much_text.txt"
    too_much.write_text(TEXT * (MAX_TEXT_CHARS // len(TEXT) + 2))
    events.append(_event(too_much, "too_much_text", "text/plain", model_profile="custom"))
    expected["too_much_text"] = "extracted_text_too_large"

    with FakeProvider({"default": {}}) as fake:
        worker_env = {"JOBSTREAM_PROVIDER_BASE_URL": fake.base_url,
                      "JOBSTREAM_DOCUMENT_ROOTS": json.dumps([str(root)]),
                      "JOBSTREAM_EXTRACT_MAX_TEXT_CHARS": str(MAX_TEXT_CHARS)}
        running = procs.pipeline(**worker_env)
        _publish(settings, events)

        def all_failed() -> list[dict]:
            rows = query(settings.database_url,
                         "SELECT idempotency_key, status, error_code FROM job")
            return rows if len(rows) == len(expected) and all(
                r["status"] == "failed" for r in rows) else []
        rows = wait_for(all_failed, 180, "every hostile document's job to fail", procs.logs)
        got = {r["idempotency_key"]: r["error_code"] for r in rows}
        assert got == expected

        # No retry: one run of the extraction stage each, nothing on the retry topic, nothing
        # left running, and not a single provider call.
        stages = query(settings.database_url,
                       "SELECT stage, status, attempt FROM job_stage WHERE stage <> 'intake'")
        assert {(s["stage"], s["status"], s["attempt"]) for s in stages} == {
            ("extract", "failed", 1)}, stages
        assert read_topic(settings, settings.topic("job.accepted.retry")) == []
        assert query(settings.database_url, "SELECT count(*) AS n FROM provider_attempt"
                     )[0]["n"] == 0
        assert fake.snapshot()["total"] == 0
        failed_events = read_topic(settings, settings.topic("job.failed"))
        assert len(failed_events) == len(expected)

        # The worker keeps serving: the same process runs a good PDF to the end.
        good = root / "good.pdf"
        good.write_bytes(good_pdf(pages=2))
        _publish(settings, [_event(good, "good", "application/pdf", model_profile="custom")])

        def good_done() -> bool:
            r = query(settings.database_url,
                      "SELECT status FROM job WHERE idempotency_key = 'good'")
            return bool(r) and r[0]["status"] == "succeeded"
        wait_for(good_done, 120, "the good PDF to succeed", procs.logs)
        assert fake.snapshot()["total"] >= 1
        assert running["worker"].popen.poll() is None
        assert "Traceback" not in running["worker"].log_text()


def test_real_sizes_the_bytes_read_are_checked_not_the_declared_size(
        settings: Settings, procs: ProcessRunner, tmp_path: Path) -> None:
    # Row 4: a 12 MB file:// document declared as 10 bytes was accepted and stored whole.
    root = tmp_path / "docs"
    root.mkdir()
    big = root / "big.txt"
    with big.open("wb") as fh:
        for _ in range(12):
            fh.write(b"Twelve megabytes of words. " * (1024 * 1024 // 27 + 1))
    small = root / "small.txt"
    small.write_bytes(b"A short document with a wrong declared size.")
    ok = root / "ok.txt"
    ok.write_bytes(TEXT.encode())
    procs.pipeline(JOBSTREAM_DOCUMENT_ROOTS=json.dumps([str(root)]))
    _publish(settings, [_event(big, "big", "text/plain", size_bytes=10),
                        _event(small, "small", "text/plain", size_bytes=10),
                        _event(ok, "ok", "text/plain")])

    def ok_done() -> bool:
        r = query(settings.database_url, "SELECT status FROM job WHERE idempotency_key = 'ok'")
        return bool(r) and r[0]["status"] == "succeeded"
    wait_for(ok_done, 120, "the good document to succeed", procs.logs)

    def dead_lettered() -> dict[str, str]:
        out = {}
        for m in read_topic(settings, settings.topic("document.uploaded.dlq")):
            headers = {k: v.decode() for k, v in (m.headers() or [])}
            out[json.loads(m.value())["idempotency_key"]] = headers.get("dlq_reason_code")
        return out if len(out) == 2 else {}
    reasons = wait_for(dead_lettered, 60, "both bad uploads on the DLQ", procs.logs)
    assert reasons == {"big": "document_too_large", "small": "size_mismatch"}
    stored = query(settings.database_url, "SELECT max(size_bytes) AS n FROM document")
    assert stored[0]["n"] == len(TEXT.encode())  # nothing of the 12 MB was stored
