"""A PRIVATE Kafka + Postgres for tests that stop, restart or starve a service.

``scripts/services.sh`` runs the instance under a temporary ``JOBSTREAM_HOME`` on free ports,
so a test may stop and start it without disturbing the shared dev services (9092/9093/55432)
every other test uses. Each test then gets its own database and topic prefix on it
(:func:`private_database`), as the shared fixtures in ``tests/conftest.py`` do.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from jobstream.db import migrate
from jobstream.kafka import ensure_topics
from jobstream.services import SCRIPT, kafka_answers, postgres_answers
from jobstream.settings import Settings

#: The shared dev services: never stopped by a private instance's tests.
SHARED_PORTS = {9092, 9093, 55432}


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports that are free on 127.0.0.1 now (and not the shared ones)."""
    ports: set[int] = set()
    while len(ports) < n:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in SHARED_PORTS:
            ports.add(port)
    return sorted(ports)


@dataclass
class PrivateServices:
    """A Kafka + Postgres instance of one test module alone, driven by ``scripts/services.sh``."""

    home: Path
    env: dict[str, str]
    kafka: str
    database_url: str

    def script(self, *args: str, timeout_s: float = 240.0) -> str:
        """Run ``services.sh <args>`` against this instance; fails the test if it fails."""
        r = subprocess.run(["bash", str(SCRIPT), *args], env=self.env, capture_output=True,
                           text=True, timeout=timeout_s)
        assert r.returncode == 0, f"services.sh {' '.join(args)} failed:\n{r.stdout}{r.stderr}"
        return r.stdout

    def stop(self, service: str, *, immediate: bool = False) -> None:
        """Stop one service (``--immediate``: SIGKILL / ``pg_ctl -m immediate``)."""
        t0 = time.monotonic()
        self.script("stop", service, *(["--immediate"] if immediate else []))
        print(f"{service} stopped{' (immediate)' if immediate else ''} in "
              f"{time.monotonic() - t0:.1f}s")

    def start(self, service: str) -> None:
        """Start one service again (waits until it answers)."""
        t0 = time.monotonic()
        self.script("start", service)
        print(f"{service} started in {time.monotonic() - t0:.1f}s")


@contextmanager
def private_services(prefix: str, *, prepare: Callable[[PrivateServices], None] | None = None,
                     ) -> Iterator[PrivateServices]:
    """Start a private Kafka + Postgres on free ports; stop and delete them on exit.

    ``prepare`` runs once the instance answers (e.g. to lower ``max_connections`` and restart
    Postgres). The home is a ``/tmp/<prefix>*`` directory, not pytest's ``tmp_path``:
    ``/tmp/pytest-of-root`` is 0700, which the ``postgres`` OS user (the cluster's owner when
    we run as root) cannot traverse, and unix socket paths are limited to ~100 bytes.
    """
    home = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    home.chmod(0o755)
    kafka_port, controller_port, pg_port = free_ports(3)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("JOBSTREAM_") and k not in ("DATABASE_URL",
                                                           "KAFKA_BOOTSTRAP_SERVERS")}
    env.update(JOBSTREAM_HOME=str(home), JOBSTREAM_KAFKA_PORT=str(kafka_port),
               JOBSTREAM_KAFKA_CONTROLLER_PORT=str(controller_port),
               JOBSTREAM_PG_PORT=str(pg_port))
    svc = PrivateServices(
        home, env, f"127.0.0.1:{kafka_port}",
        f"postgresql://jobstream:jobstream@127.0.0.1:{pg_port}/jobstream")
    try:
        svc.script("up")
        if prepare is not None:
            prepare(svc)
        assert kafka_answers(svc.kafka) and postgres_answers(svc.database_url)
        yield svc
    finally:
        subprocess.run(["bash", str(SCRIPT), "down"], env=env, capture_output=True,
                       timeout=120)
        shutil.rmtree(home, ignore_errors=True)


@contextmanager
def private_database(svc: PrivateServices, prefix: str, **settings: Any) -> Iterator[Settings]:
    """Settings of one test on ``svc``: its own migrated database and topic prefix.

    ``settings`` are passed to :class:`Settings` over the defaults of these tests (6 s session
    timeout, 0.2 s relay poll, 30 s lease, 0.05 s provider back-off, a dead holder's provider
    slots freed 5 s after its provider timeout, as in ``tests/conftest.py``). The database is
    dropped afterwards, best effort: the service may be the one a failed test left stopped.
    """
    name = f"jobstream_{prefix}_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(svc.database_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    url = psycopg.conninfo.make_conninfo(svc.database_url, dbname=name)
    migrate(url)
    options: dict[str, Any] = dict(
        consumer_session_timeout_ms=6000, relay_poll_interval_s=0.2, lease_s=30.0,
        provider_backoff_base_s=0.05, provider_slot_margin_s=5.0)
    options.update(settings)
    s = Settings(database_url=url, kafka_bootstrap_servers=svc.kafka,
                 topic_prefix=f"{prefix}{uuid.uuid4().hex[:8]}.", **options)
    ensure_topics(s)
    try:
        yield s
    finally:
        try:
            with psycopg.connect(svc.database_url, autocommit=True, connect_timeout=5) as conn:
                conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                    sql.Identifier(name)))
        except psycopg.OperationalError:
            pass
