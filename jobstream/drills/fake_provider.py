"""A scriptable fake OpenAI-compatible provider: a real HTTP server on loopback.

Tests (and people, via ``jobstream fake-provider``) script it to misbehave the way real providers
do, then ask it how often it was called. It answers ``POST /v1/chat/completions`` with the local
extractive model (``jobstream.llm.local``) unless the script says otherwise.

Script (JSON; ``PUT /_control/script`` or the constructor):

- ``sequence``: a list of behaviours used by the first requests, in order; afterwards
  ``default`` applies. ``per_key``: behaviours by ``Idempotency-Key`` header, each a list used in
  order for that key's requests.
- a behaviour: ``{"status": 429, "retry_after": "1"}``, ``{"status": 503}``, ``{"status": 400}``,
  ``{"hang_s": 30}`` (sleep before answering: past the client timeout), ``{"latency_s": 0.2}``
  (then answer normally), ``{"malformed": true}`` (200 with a body that is not a completion),
  ``{"refuse": true}`` (``finish_reason: content_filter``), ``{}`` (answer normally).
- ``max_concurrency``: answer 429 (Retry-After 1) while more requests than this are in flight.

Control endpoints: ``GET /_control/calls`` -> ``{"total": n, "by_key": {key: n}, "statuses":
{code: n}, "max_in_flight": n}``; ``PUT /_control/script`` replaces the script and keeps the
counters; ``POST /_control/reset`` zeroes them and restarts the script.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from jobstream.llm.local import chat_completion


class FakeProvider:
    """The server. ``start()`` binds ``127.0.0.1:<port>`` (0 = any free port) in a thread."""

    def __init__(self, script: dict[str, Any] | None = None, port: int = 0,
                 model: str = "fake-model") -> None:
        self.model = model
        self._lock = threading.Lock()
        self.reset(script or {})
        self._server = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        """The OpenAI-compatible root, e.g. ``http://127.0.0.1:41234/v1``."""
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}/v1"

    def set_script(self, script: dict[str, Any]) -> None:
        """Replace the script; the call counters go on counting (``PUT /_control/script``: a
        drill changes behaviour mid-run and still compares every call with the call log)."""
        with self._lock:
            self.script = script
            self._seq = list(script.get("sequence", []))
            self._per_key = {k: list(v) for k, v in script.get("per_key", {}).items()}

    def reset(self, script: dict[str, Any] | None = None) -> None:
        """Zero the counters and start the script (``script``, else the current one) from its
        beginning (``POST /_control/reset``)."""
        self.set_script(self.script if script is None else script)
        with self._lock:
            self.calls: Counter[str] = Counter()
            self.statuses: Counter[int] = Counter()
            self.total = 0
            self.in_flight = 0
            self.max_in_flight = 0

    def snapshot(self) -> dict[str, Any]:
        """Counters: total calls, calls per Idempotency-Key, answers per status, max in flight."""
        with self._lock:
            return {"total": self.total, "by_key": dict(self.calls),
                    "statuses": {str(k): v for k, v in self.statuses.items()},
                    "max_in_flight": self.max_in_flight}

    def _next_behaviour(self, key: str) -> dict[str, Any]:
        with self._lock:
            self.total += 1
            self.calls[key] += 1
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            limit = self.script.get("max_concurrency")
            if limit is not None and self.in_flight > int(limit):
                return {"status": 429, "retry_after": "1"}
            if self._per_key.get(key):
                return self._per_key[key].pop(0)
            if self._seq:
                return self._seq.pop(0)
            return dict(self.script.get("default", {}))

    def _done(self, status: int) -> None:
        with self._lock:
            self.in_flight -= 1
            self.statuses[status] += 1

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *_: Any) -> None:  # quiet
                pass

            def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None
                      ) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    self.wfile.write(body)

            def do_GET(self) -> None:  # noqa: N802 - http.server API
                if self.path == "/_control/calls":
                    self._send(200, json.dumps(fake.snapshot()).encode())
                else:
                    self._send(404, b'{"error": {"message": "not found"}}')

            def do_PUT(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path == "/_control/script":
                    fake.set_script(json.loads(body or b"{}"))
                    self._send(200, b"{}")
                else:
                    self._send(404, b"{}")

            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path == "/_control/reset":
                    fake.reset()
                    self._send(200, b"{}")
                    return
                if not self.path.endswith("/chat/completions"):
                    self._send(404, b'{"error": {"message": "not found"}}')
                    return
                key = self.headers.get("Idempotency-Key", "")
                b = fake._next_behaviour(key)
                status = int(b.get("status", 200))
                try:
                    if "hang_s" in b:
                        time.sleep(float(b["hang_s"]))
                    if "latency_s" in b:
                        time.sleep(float(b["latency_s"]))
                    if status != 200:
                        headers = {"Retry-After": str(b["retry_after"])} if "retry_after" in b \
                            else {}
                        self._send(status, json.dumps({"error": {"message": f"scripted {status}"
                                                                 }}).encode(), headers)
                        return
                    if b.get("malformed"):
                        self._send(200, b'{"choices": "not a list"')
                        return
                    try:
                        req = json.loads(body)
                    except json.JSONDecodeError:
                        status = 400
                        self._send(400, b'{"error": {"message": "body is not JSON"}}')
                        return
                    answer = chat_completion(req, fake.model)
                    if b.get("refuse"):
                        answer["choices"][0]["finish_reason"] = "content_filter"
                    self._send(200, json.dumps(answer).encode())
                finally:
                    fake._done(status)

        return Handler

    def start(self) -> FakeProvider:
        """Serve in a daemon thread; returns self."""
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Serve in the calling thread (the CLI)."""
        self._server.serve_forever()

    def stop(self) -> None:
        """Stop serving and close the socket."""
        if self._thread is not None:  # shutdown() waits for serve_forever: only if serving
            self._server.shutdown()
            self._thread.join(5)
            self._thread = None
        self._server.server_close()

    def __enter__(self) -> FakeProvider:
        return self.start()

    def __exit__(self, *_: Any) -> None:
        self.stop()
