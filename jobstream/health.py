"""Readiness of one process: can it get a database connection?

Each long-running process (``worker``, ``relay``, ``consume-ready``, ``api``) reports every
database success and failure here (:func:`ok`, :func:`failed`; the store's pool does it for
every transaction). The process turns **unhealthy** when it has not been able to get a
connection for ``health_fail_after_s`` seconds (a Postgres outage, or ``max_connections``
exhausted by other clients: "too many clients"), and healthy again at the first success.

Where it shows:

- ``GET /healthz`` on ``JOBSTREAM_HEALTH_PORT`` (worker, relay, consume-ready; 0 = off) and on
  the API's own port: ``200 {"status": "ok", ...}`` or ``503 {"status": "unhealthy", ...}``;
- one log line when the database becomes unreachable, one when the process turns unhealthy,
  and one when it is reachable again (with the outage's duration) — never one per retry.

An idle process would learn nothing, so a probe thread runs ``probe()`` (one short query
through the process's own pool or connection) whenever no success was reported for
``health_probe_interval_s``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger("jobstream.health")


class Readiness:
    """Database reachability of this process (thread-safe). ``fail_after_s``: seconds of
    failures before :attr:`healthy` turns False."""

    def __init__(self, process: str, fail_after_s: float) -> None:
        self.process = process
        self.fail_after_s = fail_after_s
        self._lock = threading.Lock()
        self.last_ok = time.monotonic()
        self.failing_since: float | None = None
        self.last_error: str | None = None
        self._announced_unhealthy = False

    def ok(self) -> None:
        """A database operation succeeded."""
        with self._lock:
            self.last_ok = time.monotonic()
            if self.failing_since is None:
                return
            took = self.last_ok - self.failing_since
            self.failing_since, self._announced_unhealthy = None, False
        log.warning("database reachable again after %.1fs (%s is healthy)", took, self.process)

    def failed(self, exc: BaseException | str) -> None:
        """A database operation could not get a connection (or lost it)."""
        with self._lock:
            self.last_error = str(exc).strip().splitlines()[0][:300] if str(exc) else repr(exc)
            if self.failing_since is not None:
                return
            self.failing_since = time.monotonic()
        log.warning("database unreachable: %s (%s turns unhealthy after %.0fs; retrying "
                    "quietly)", self.last_error, self.process, self.fail_after_s)

    @property
    def healthy(self) -> bool:
        """False once the database has been unreachable for ``fail_after_s``."""
        with self._lock:
            since = self.failing_since
        healthy = since is None or time.monotonic() - since < self.fail_after_s
        if not healthy and not self._announced_unhealthy:
            self._announced_unhealthy = True
            log.error("%s is unhealthy: no database connection for %.0fs (%s)", self.process,
                      time.monotonic() - (since or 0), self.last_error)
        return healthy

    def status(self) -> dict[str, Any]:
        """``{"status", "process", "db_failing_for_s", "last_error"}`` for /healthz."""
        healthy = self.healthy
        with self._lock:
            failing = (time.monotonic() - self.failing_since
                       if self.failing_since is not None else 0.0)
            return {"status": "ok" if healthy else "unhealthy", "process": self.process,
                    "db_failing_for_s": round(failing, 1), "last_error": self.last_error}


_current: Readiness | None = None


def setup(process: str, settings: Any, *, probe: Callable[[], None] | None = None,
          serve: bool = True) -> Readiness:
    """Make this process's :class:`Readiness` (what :func:`ok` and :func:`failed` report to),
    start the probe thread when ``probe`` is given, and serve ``/healthz`` on
    ``settings.health_port`` when ``serve`` and the port is not 0. Raises ``OSError`` when the
    port is taken."""
    global _current
    _current = Readiness(process, settings.health_fail_after_s)
    pool_log = logging.getLogger("psycopg.pool")
    if not any(isinstance(f, _PoolErrors) for f in pool_log.filters):
        pool_log.addFilter(_PoolErrors())
    if probe is not None:
        threading.Thread(target=_probe_loop, args=(_current, probe,
                                                   settings.health_probe_interval_s),
                         name="jobstream-health-probe", daemon=True).start()
    if serve and settings.health_port:
        start_server(_current, settings.health_host, settings.health_port)
    return _current


def current() -> Readiness | None:
    """The process's readiness, if :func:`setup` ran."""
    return _current


def ok() -> None:
    """Report a database success (no-op before :func:`setup`)."""
    if _current is not None:
        _current.ok()


def failed(exc: BaseException | str) -> None:
    """Report a database failure (no-op before :func:`setup`)."""
    if _current is not None:
        _current.failed(exc)


class _PoolErrors(logging.Filter):
    """psycopg_pool logs a WARNING per failed connection attempt; the first one is reported
    as the start of an outage (one line, :meth:`Readiness.failed`), the rest are dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING and "error connecting" in str(record.msg):
            failed(record.getMessage())
            return False
        return True


def _probe_loop(readiness: Readiness, probe: Callable[[], None], interval_s: float) -> None:
    while True:
        time.sleep(interval_s)
        if time.monotonic() - readiness.last_ok < interval_s and readiness.failing_since is None:
            continue  # real work proved the database answers
        try:
            probe()
            readiness.ok()
        except Exception as exc:  # any failure to get a connection counts
            readiness.failed(exc)
        readiness.healthy  # noqa: B018 - logs the turn to unhealthy once


def start_server(readiness: Readiness, host: str, port: int) -> ThreadingHTTPServer:
    """Serve ``GET /healthz`` (200 or 503, JSON) on ``host:port`` in a daemon thread."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server API
            if self.path.split("?", 1)[0] not in ("/healthz", "/readyz"):
                self.send_error(404)
                return
            body = json.dumps(readiness.status()).encode()
            self.send_response(200 if readiness.healthy else 503)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: Any) -> None:  # no access log line per probe
            return

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, name="jobstream-healthz",
                     daemon=True).start()
    log.info("readiness of %s on http://%s:%d/healthz", readiness.process, host, port)
    return server
