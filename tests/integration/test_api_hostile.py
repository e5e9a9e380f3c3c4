"""The HTTP API against hostile requests (issue 9, rows 5-7, 9-11), as a real uvicorn process
against real Postgres: a 4xx with ``{code, message}`` for each, never a 500, and the API's memory
stays flat while a body far over the limit is streamed at it."""

from __future__ import annotations

import base64
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from jobstream.settings import Settings
from tests.helpers import Proc, ProcessRunner, free_port, query
from tests.hostile_documents import good_pdf

pytestmark = pytest.mark.integration

TOKENS = {"tok-acme-hostile": "acme"}
ACME = {"Authorization": "Bearer tok-acme-hostile"}
MiB = 1024 * 1024


def _start_api(procs: ProcessRunner, **env: str) -> tuple[str, Proc]:
    return procs.start_api(TOKENS, **env)


@pytest.fixture
def api(procs: ProcessRunner) -> Iterator[str]:
    url, _ = _start_api(procs, JOBSTREAM_API_MAX_BATCH_BYTES=str(2 * MiB))
    yield url


def _post(url: str, path: str, key: str, body: object) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, headers={**ACME, "Idempotency-Key": key},
                      timeout=60)


def _is_problem(r: httpx.Response, status: int, code: str | None = None) -> None:
    assert r.status_code == status, (r.status_code, r.text[:500])
    body = r.json()
    assert isinstance(body.get("code"), str) and isinstance(body.get("message"), str), body
    if code is not None:
        assert body["code"] == code, body


def test_control_characters_are_422_on_every_creation_route_and_nothing_is_stored(
        api: str, settings: Settings) -> None:
    # Row 5: U+0000 in the filename was a psycopg DataError, a 500.
    _is_problem(_post(api, "/v1/jobs", "n1", {"filename": "a\x00b.txt", "text": "Hello."}),
                422, "invalid_request")
    _is_problem(_post(api, "/v1/batches", "n2", {"documents": [
        {"filename": "ok.txt", "text": "Fine."}, {"filename": "b\x00.txt", "text": "Bad."}]}),
        422, "invalid_request")
    # httpx would percent-encode the NUL: write the multipart body by hand, raw byte included.
    for i, raw_name in enumerate((b"c\x00.txt", b"d\x1b[31m.txt")):
        body = (b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"" + raw_name
                + b"\"\r\nContent-Type: text/plain\r\n\r\nSome text.\r\n--XyZ--\r\n")
        up = httpx.post(f"{api}/v1/jobs/upload", content=body, timeout=30, headers={
            **ACME, "Idempotency-Key": f"n3-{i}",
            "Content-Type": "multipart/form-data; boundary=XyZ"})
        _is_problem(up, 422, "invalid_request")
    for field in ("prompt_version", "model_profile", "pipeline"):
        _is_problem(_post(api, "/v1/jobs", f"n4-{field}", {"text": "x", field: "v\x01"}), 422,
                    "invalid_request")
    # A C1 control character in the Idempotency-Key header (latin-1 obs-text passes HTTP).
    r = httpx.post(f"{api}/v1/jobs", content=json.dumps({"text": "Hello."}).encode(),
                   headers={**ACME, "Content-Type": "application/json",
                            "Idempotency-Key": "k\x85ey".encode("latin-1")}, timeout=30)
    _is_problem(r, 422)
    assert query(settings.database_url, "SELECT count(*) AS n FROM job")[0]["n"] == 0


def test_every_4xx_has_the_documented_error_shape(api: str) -> None:
    bad_json = httpx.post(f"{api}/v1/jobs", content=b'{"text": "x",', timeout=30,
                          headers={**ACME, "Idempotency-Key": "m1",
                                   "Content-Type": "application/json"})
    _is_problem(bad_json, 400, "malformed_json")
    _is_problem(httpx.get(f"{api}/v1/no-such-route", headers=ACME), 404, "not_found")
    _is_problem(httpx.delete(f"{api}/v1/jobs", headers=ACME), 405, "method_not_allowed")
    _is_problem(httpx.get(f"{api}/v1/jobs/not-a-uuid", headers=ACME), 422, "invalid_request")
    _is_problem(httpx.get(f"{api}/v1/jobs/00000000-0000-0000-0000-000000000000"), 401,
                "unauthorized")
    # The 422 does not echo the (possibly huge) input back.
    r = _post(api, "/v1/jobs", "m2", {"text": "x" * 10_000, "lane": "nope"})
    _is_problem(r, 422, "invalid_request")
    assert "x" * 1000 not in r.text


def test_eight_concurrent_identical_batches_make_one_batch_and_seven_replays(
        api: str, settings: Settings) -> None:
    # Row 6: seven of eight were 500 (unique violation).
    docs = [{"filename": f"d{i}.txt", "text": f"Document {i}. " + "Words here. " * 20}
            for i in range(150)]
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: _post(api, "/v1/batches", "same", {"documents": docs}),
                                range(8)))
    codes = sorted(a.status_code for a in answers)
    assert codes == [200] * 7 + [202], [a.text[:300] for a in answers]
    assert len({a.json()["batch_id"] for a in answers}) == 1
    assert all(a.json()["jobs"] == 150 for a in answers)
    assert sum(a.headers.get("Idempotent-Replayed") == "true" for a in answers) == 7
    rows = query(settings.database_url, "SELECT (SELECT count(*) FROM batch) AS batches, "
                 "(SELECT count(*) FROM job) AS jobs")
    assert rows == [{"batches": 1, "jobs": 150}]


def test_a_batch_over_its_total_bytes_limit_is_413(api: str, settings: Settings) -> None:
    # Row 7, second half: 12 x 4.5 MB documents were accepted. Here: the limit is 2 MiB.
    doc = base64.b64encode(b"A long document. " * 40_000).decode()  # 680 KB each
    r = _post(api, "/v1/batches", "big", {"documents": [
        {"filename": f"d{i}.txt", "content_b64": doc} for i in range(4)]})
    _is_problem(r, 413, "batch_too_large")
    assert query(settings.database_url, "SELECT count(*) AS n FROM batch")[0]["n"] == 0
    ok = _post(api, "/v1/batches", "small", {"documents": [
        {"filename": f"d{i}.txt", "content_b64": doc} for i in range(2)]})
    assert ok.status_code == 202, ok.text[:300]


def test_the_request_hash_covers_the_filename_and_the_extractor_is_in_the_dedup_key(
        api: str, settings: Settings) -> None:
    # Row 9: the same key with only another filename was a 200 replay of the first job.
    first = _post(api, "/v1/jobs", "f1", {"filename": "a.txt", "text": "Same words."})
    assert first.status_code == 202, first.text
    assert _post(api, "/v1/jobs", "f1", {"filename": "a.txt", "text": "Same words."}
                 ).status_code == 200
    _is_problem(_post(api, "/v1/jobs", "f1", {"filename": "b.txt", "text": "Same words."}),
                409, "idempotency_key_conflict")
    # Row 10: the same bytes as text/plain, then (new key) as application/pdf, were bound to
    # the first job, which had read raw PDF syntax as text.
    b64 = base64.b64encode(good_pdf()).decode()
    as_text = _post(api, "/v1/jobs", "t1", {"filename": "x.pdf", "content_b64": b64,
                                             "content_type": "text/plain"})
    as_pdf = _post(api, "/v1/jobs", "t2", {"filename": "x.pdf", "content_b64": b64,
                                            "content_type": "application/pdf"})
    assert as_text.status_code == 202 and as_pdf.status_code == 202, (as_text.text, as_pdf.text)
    assert as_text.json()["job_id"] != as_pdf.json()["job_id"]
    rows = query(settings.database_url, "SELECT content_type FROM job WHERE job_id IN (%s, %s) "
                 "ORDER BY content_type", (as_text.json()["job_id"], as_pdf.json()["job_id"]))
    assert [r["content_type"] for r in rows] == ["application/pdf", "text/plain"]
    # Same content type, new key: still one job per computation.
    again = _post(api, "/v1/jobs", "t3", {"filename": "x.pdf", "content_b64": b64,
                                          "content_type": "application/pdf"})
    assert again.json()["job_id"] == as_pdf.json()["job_id"]


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _sample_rss(pid: int, stop: threading.Event, out: list[int]) -> None:
    while not stop.is_set():
        out.append(_rss_bytes(pid))
        time.sleep(0.02)


def _stream_body(port: int, head: bytes, chunks: Callable[[], Iterator[bytes]]
                 ) -> tuple[int, bytes]:
    """Send ``head`` then the chunks on a raw socket until the server stops reading; returns
    ``(body bytes sent, whatever answer was read)``."""
    sent = 0
    answer = b""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head)
        try:
            for chunk in chunks():
                sock.sendall(chunk)
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            pass
        try:
            sock.settimeout(10)
            while part := sock.recv(65536):
                answer += part
        except (ConnectionResetError, TimeoutError):
            pass
    return sent, answer


def test_the_api_memory_stays_flat_while_a_50_mb_body_is_streamed_at_it(
        procs: ProcessRunner) -> None:
    # Row 7: a 50 MB JSON body was parsed whole before the 422 (API RSS +130 MB).
    url, proc = _start_api(procs, JOBSTREAM_API_MAX_BODY_BYTES=str(MiB))
    port = int(url.rsplit(":", 1)[1])
    pid = proc.popen.pid
    for _ in range(3):  # warm up: first requests load code paths
        httpx.post(f"{url}/v1/jobs", json={"text": "warm"}, timeout=30,
                   headers={**ACME, "Idempotency-Key": f"w{_}"})
    baseline = _rss_bytes(pid)
    body_size = 50 * MiB
    piece = b'{"text": "' + b"x" * (64 * 1024 - 10)

    def chunked() -> Iterator[bytes]:
        left = body_size
        while left > 0:
            n = min(len(piece), left)
            yield f"{n:x}\r\n".encode() + piece[:n] + b"\r\n"
            left -= n
        yield b"0\r\n\r\n"

    def plain() -> Iterator[bytes]:
        left = body_size
        while left > 0:
            n = min(len(piece), left)
            yield piece[:n]
            left -= n

    samples: list[int] = []
    stop = threading.Event()
    sampler = threading.Thread(target=_sample_rss, args=(pid, stop, samples), daemon=True)
    sampler.start()
    try:
        common = (b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer tok-acme-hostile"
                  b"\r\nIdempotency-Key: big\r\nContent-Type: application/json\r\n")
        # No Content-Length: the server must count while it reads.
        sent_chunked, answer_chunked = _stream_body(
            port, common + b"Transfer-Encoding: chunked\r\n\r\n", chunked)
        # An honest Content-Length over the limit: refused before the body is read.
        sent_plain, answer_plain = _stream_body(
            port, common + f"Content-Length: {body_size}\r\n\r\n".encode(), plain)
    finally:
        stop.set()
        sampler.join(5)
    growth = max(samples) - baseline
    assert growth < 16 * MiB, f"RSS grew by {growth / MiB:.1f} MiB (baseline {baseline / MiB:.0f})"
    for sent, answer in ((sent_chunked, answer_chunked), (sent_plain, answer_plain)):
        # Either the server said 413 or it stopped reading long before 50 MB arrived.
        assert b" 413 " in answer.split(b"\r\n", 1)[0] or sent < body_size, (sent, answer[:300])
        if answer:
            assert b'"request_too_large"' in answer, answer[:500]
    assert proc.popen.poll() is None  # still serving
    r = httpx.post(f"{url}/v1/jobs", json={"text": "after"}, timeout=30,
                   headers={**ACME, "Idempotency-Key": "after"})
    assert r.status_code == 202, r.text


def test_api_refuses_placeholder_tokens_unless_the_development_flag_is_set(
        procs: ProcessRunner) -> None:
    # Row 11: docker-compose shipped the token change-me.
    for tokens in ({"change-me": "demo"}, {"": "demo"}):
        r = procs.run("api", "--port", str(free_port()), timeout_s=60,
                      JOBSTREAM_API_TOKENS=json.dumps(tokens))
        assert r.returncode != 0
        assert "placeholder" in r.stderr and "JOBSTREAM_API_ALLOW_DEV_TOKENS" in r.stderr
    url, _ = _start_api(procs, JOBSTREAM_API_TOKENS=json.dumps({"change-me": "demo"}),
                        JOBSTREAM_API_ALLOW_DEV_TOKENS="true")
    r = httpx.post(f"{url}/v1/jobs", json={"text": "dev"}, timeout=30,
                   headers={"Authorization": "Bearer change-me", "Idempotency-Key": "d1"})
    assert r.status_code == 202, r.text


def test_config_and_logs_never_print_tokens_or_passwords(procs: ProcessRunner,
                                                          settings: Settings) -> None:
    secret_db = settings.database_url  # its password is "jobstream"
    assert "password=jobstream" in secret_db or ":jobstream@" in secret_db
    env = {"JOBSTREAM_API_TOKENS": json.dumps({"tok-very-secret-1": "acme",
                                               "tok-very-secret-2": "other"}),
           "JOBSTREAM_PROVIDER_API_KEY": "sk-very-secret-key",
           "JOBSTREAM_DATABASE_URL": secret_db}
    r = procs.run("config", **env)
    assert r.returncode == 0, r.stderr
    out = r.stdout + r.stderr
    secrets = ("tok-very-secret", "sk-very-secret-key", ":jobstream@", "password=jobstream")
    for secret in secrets:
        assert secret not in out, secret
    assert "api_tokens" in out and "acme" in out and "other" in out
    url, proc = _start_api(procs, **env)
    httpx.post(f"{url}/v1/jobs", json={"text": "hi"}, timeout=30,
               headers={"Authorization": "Bearer tok-very-secret-1", "Idempotency-Key": "s1"})
    metrics = httpx.get(f"{url}/metrics", timeout=60).text
    for secret in secrets:
        assert secret not in metrics and secret not in proc.log_text(), secret


def test_concurrent_batches_sharing_documents_in_another_order_all_succeed(
        api: str, settings: Settings) -> None:
    # Found by the adversarial pass: six clients sending batches (their own keys) of the same
    # 30 documents in rotated orders deadlocked in Postgres (document and job rows locked in
    # request order): five of six got 503 db_unavailable "deadlock detected".
    docs = [{"filename": f"o{i}.txt", "text": f"Overlapping document {i}. " + "Words. " * 20}
            for i in range(30)]
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda n: _post(api, "/v1/batches", f"overlap-{n}",
                                                {"documents": docs[n * 5:] + docs[:n * 5]}),
                                range(6)))
    assert sorted(a.status_code for a in answers) == [202] * 6, [a.text[:300] for a in answers]
    rows = query(settings.database_url, "SELECT (SELECT count(*) FROM batch) AS batches, "
                 "(SELECT count(*) FROM job) AS jobs, "
                 "(SELECT count(*) FROM batch_job) AS members")
    assert rows == [{"batches": 6, "jobs": 30, "members": 180}]


def test_an_idempotency_key_over_its_length_is_invalid_not_missing(api: str) -> None:
    # Found by the adversarial pass: a 100,000-character key was answered "the
    # Idempotency-Key header is required" (missing_idempotency_key).
    body = {"filename": "k.txt", "text": "a document with an over-long key"}
    r = _post(api, "/v1/jobs", "k" * 201, body)
    assert r.status_code == 400 and r.json()["code"] == "idempotency_key_too_long", r.text
    assert "Idempotency-Key" in r.json()["message"]
    missing = httpx.post(f"{api}/v1/jobs", json=body, headers=ACME, timeout=30)
    assert missing.status_code == 400 and missing.json()["code"] == "missing_idempotency_key"
