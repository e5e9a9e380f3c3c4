"""Fixtures: real Kafka + real Postgres, never an in-memory fake.

Where the services come from, in order:
1. ``KAFKA_BOOTSTRAP_SERVERS`` / ``DATABASE_URL`` (or their ``JOBSTREAM_`` forms) when set;
2. testcontainers when a Docker engine answers;
3. the native services of ``scripts/services.sh up`` (installed and started when needed).

Isolation: each test gets its own database cloned from a migrated template
(``CREATE DATABASE … TEMPLATE …``) and its own topic/consumer-group prefix.
"""

from __future__ import annotations

import os
import queue
import shutil
import subprocess
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import psycopg
import pytest
from psycopg import sql

from jobstream.db import migrate
from jobstream.kafka import delete_topics, ensure_topics
from jobstream.services import SCRIPT, kafka_answers, postgres_answers
from jobstream.settings import DEFAULT_DATABASE_URL, DEFAULT_KAFKA, Settings
from tests.helpers import ProcessRunner

T = TypeVar("T")

#: Modules whose tests share an expensive module-scoped fixture (a private Kafka + Postgres, a
#: Kafka Connect worker): under pytest-xdist one worker runs each of them whole, so the fixture
#: starts once. Every other test is scheduled on its own (each has its own database and topic
#: prefix). A module added here must not depend on which other tests run beside it.
ONE_WORKER_MODULES = frozenset({
    # The matrices: a module fixture runs their selected points two at a time (each worker that
    # ran a part of the module would run every point).
    "tests/e2e/test_crash_matrix.py",
    "tests/e2e/test_pause.py",
    "tests/e2e/test_debezium_relay.py",
    "tests/e2e/test_service_restarts.py",
    "tests/e2e/test_starvation_and_outage.py",
})


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: unknown without it
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``-n N`` (``--dist load``; ``JOBSTREAM_TEST_WORKERS=2 bash scripts/test.sh``): tests one
    by one, except the modules of :data:`ONE_WORKER_MODULES`, each sent to one worker whole.
    (xdist's own ``--dist loadgroup`` cannot do it with pytest >= 9.2: it renames
    ``item._nodeid``, which pytest no longer reads.) Work units go out largest first (xdist's
    ``loadscope`` order)."""
    if config.getoption("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleFixtureScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return module if module in ONE_WORKER_MODULES else nodeid

    return ModuleFixtureScheduling(config, log)


@dataclass(frozen=True)
class Endpoints:
    """Where the services of this test session are."""

    database_url: str
    kafka: str
    source: str


def _docker_answers() -> bool:
    if not shutil.which("docker"):
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="session")
def endpoints() -> Iterator[Endpoints]:
    """The session's Kafka and Postgres (see the module docstring for the order)."""
    db = os.environ.get("JOBSTREAM_DATABASE_URL") or os.environ.get("DATABASE_URL")
    kafka = (os.environ.get("JOBSTREAM_KAFKA_BOOTSTRAP_SERVERS")
             or os.environ.get("KAFKA_BOOTSTRAP_SERVERS"))
    if db and kafka:
        yield Endpoints(db, kafka, "environment")
        return
    if not (db or kafka) and _docker_answers():  # pragma: no cover - no Docker engine here
        from testcontainers.kafka import KafkaContainer
        from testcontainers.postgres import PostgresContainer
        with PostgresContainer("postgres:16-alpine", driver=None) as pg, \
                KafkaContainer("confluentinc/cp-kafka:7.6.0").with_kraft() as kc:
            yield Endpoints(pg.get_connection_url(), kc.get_bootstrap_server(), "testcontainers")
        return
    db = db or DEFAULT_DATABASE_URL
    kafka = kafka or DEFAULT_KAFKA
    if not (postgres_answers(db) and kafka_answers(kafka)):
        env = {**os.environ, "JOBSTREAM_DATABASE_URL": db,
               "JOBSTREAM_KAFKA_BOOTSTRAP_SERVERS": kafka}
        rc = subprocess.call(["bash", str(SCRIPT), "up"], env=env)
        assert rc == 0, "scripts/services.sh up failed"
    assert postgres_answers(db), f"Postgres does not answer at {db}"
    assert kafka_answers(kafka), f"Kafka does not answer at {kafka}"
    yield Endpoints(db, kafka, "native")


def _with_db(url: str, dbname: str) -> str:
    return psycopg.conninfo.make_conninfo(url, dbname=dbname)


@pytest.fixture(scope="session")
def template_db(endpoints: Endpoints) -> Iterator[str]:
    """Name of a migrated template database, dropped at the end of the session."""
    name = f"jobstream_tpl_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(endpoints.database_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    migrate(_with_db(endpoints.database_url, name))
    yield name
    with psycopg.connect(endpoints.database_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
            sql.Identifier(name)))


class _Dropper:
    """Drops the test databases in a background thread, in order, while the next tests run.

    ``DROP DATABASE`` waits for a checkpoint of the whole (shared) server: 0.1-2 s each, which
    no test needs to wait for. :meth:`close` (session end) drops what is still queued and
    raises ``AssertionError`` if a drop failed, so no database is left behind silently."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.queue: queue.Queue[str | None] = queue.Queue()
        self.errors: list[str] = []
        self.thread = threading.Thread(target=self._run, name="drop-test-databases",
                                       daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (name := self.queue.get()) is not None:
            try:
                with psycopg.connect(self.url, autocommit=True) as conn:
                    conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                        sql.Identifier(name)))
            except Exception as exc:  # reported at session end
                self.errors.append(f"{name}: {exc!r}")

    def drop(self, name: str) -> None:
        """Queue database ``name`` for dropping (returns at once)."""
        self.queue.put(name)

    def close(self, timeout_s: float = 300.0) -> None:
        """Drop what is queued (``timeout_s`` at most), stop the thread, report failures."""
        self.queue.put(None)
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), f"test databases not dropped in {timeout_s}s"
        assert not self.errors, f"test databases not dropped: {self.errors}"


@pytest.fixture(scope="session")
def _database_dropper(endpoints: Endpoints) -> Iterator[_Dropper]:
    dropper = _Dropper(endpoints.database_url)
    yield dropper
    dropper.close()


class _Maker(Generic[T]):
    """Makes what tests take (``create()``) in a background thread, up to ``ahead`` before
    the tests take it: a fresh database cloned from the template, a topic prefix with its
    topics created.

    ``CREATE DATABASE ... TEMPLATE`` takes 0.2-0.7 s alone and up to ~10 s when others load
    the shared server, creating a prefix's topics 0.1-0.5 s: time a test's setup no longer
    waits for. Each test still gets its own, made for it alone from the same untouched
    template / topic layout. :meth:`take` raises what a ``create()`` raised. :meth:`close`
    (session end) hands what no test took to ``discard``."""

    def __init__(self, name: str, create: Callable[[], T], discard: Callable[[T], None],
                 ahead: int = 2) -> None:
        self.create, self.discard = create, discard
        self.ready: queue.Queue[T | BaseException] = queue.Queue(maxsize=ahead)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopping.is_set():
            item: T | BaseException
            try:
                item = self.create()
            except Exception as exc:  # raised by take()
                item = exc
            while True:
                if self.stopping.is_set():
                    if not isinstance(item, BaseException):
                        self.discard(item)
                    return
                try:
                    self.ready.put(item, timeout=0.2)
                    break
                except queue.Full:
                    continue
            if isinstance(item, BaseException):
                return

    def take(self, timeout_s: float = 120.0) -> T:
        """The next one made (waits ``timeout_s`` at most)."""
        try:
            item = self.ready.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(f"{self.thread.name}: nothing made in {timeout_s}s") from None
        if isinstance(item, BaseException):
            self.ready.put(item)  # every later test fails the same way
            raise item
        return item

    def close(self) -> None:
        """Stop making; discard what no test took."""
        self.stopping.set()
        self.thread.join(120)
        while True:
            try:
                item = self.ready.get_nowait()
            except queue.Empty:
                break
            if not isinstance(item, BaseException):
                self.discard(item)


@pytest.fixture(scope="session")
def _database_maker(endpoints: Endpoints, template_db: str,
                    _database_dropper: _Dropper) -> Iterator[_Maker[str]]:
    def create() -> str:
        name = f"jobstream_t_{uuid.uuid4().hex[:10]}"
        with psycopg.connect(endpoints.database_url, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                sql.Identifier(name), sql.Identifier(template_db)))
        return name
    maker = _Maker("create-test-databases", create, _database_dropper.drop)
    yield maker
    maker.close()


def _suite_settings(database_url: str, kafka: str, topic_prefix: str) -> Settings:
    """The suite's settings (see :func:`make_settings`)."""
    return Settings(database_url=database_url, kafka_bootstrap_servers=kafka,
                    topic_prefix=topic_prefix, consumer_session_timeout_ms=6000,
                    relay_poll_interval_s=0.2, lease_s=30.0, provider_backoff_base_s=0.05,
                    provider_slot_margin_s=5.0)


@pytest.fixture(scope="session")
def _topics_maker(endpoints: Endpoints) -> Iterator[_Maker[str]]:
    def settings_of(prefix: str) -> Settings:
        return _suite_settings(endpoints.database_url, endpoints.kafka, prefix)

    def create() -> str:
        prefix = f"t{uuid.uuid4().hex[:8]}."
        ensure_topics(settings_of(prefix))
        return prefix
    maker = _Maker("create-test-topics", create, lambda p: delete_topics(settings_of(p)))
    yield maker
    maker.close()


@contextmanager
def fresh_database(endpoints: Endpoints, maker: _Maker[str], dropper: _Dropper) -> Iterator[str]:
    """A fresh database cloned from the migrated template (ahead of time, by ``_Maker``);
    yields its URL, dropped afterwards in the background (``_Dropper``)."""
    name = maker.take()
    try:
        yield _with_db(endpoints.database_url, name)
    finally:
        dropper.drop(name)


@contextmanager
def make_settings(endpoints: Endpoints, database_url: str, topics: _Maker[str]
                  ) -> Iterator[Settings]:
    """Settings on ``database_url`` with their own topic prefix (topics created ahead by
    ``topics``, checked here, deleted afterwards) and the suite's short timeouts. A killed or
    frozen worker's provider slots free ``provider_timeout_s`` + 5 s after they were taken
    (default + 30 s): the fake providers answer on loopback, and a restarted worker need not
    wait 25 s more for them."""
    s = _suite_settings(database_url, endpoints.kafka, topics.take())
    ensure_topics(s)  # every topic there already: one metadata request
    try:
        yield s
    finally:
        delete_topics(s)


@pytest.fixture
def database_url(endpoints: Endpoints, _database_maker: _Maker[str],
                 _database_dropper: _Dropper) -> Iterator[str]:
    """A fresh database for one test, cloned from the migrated template (ahead of time, in
    the background: ``_Maker``; dropped after the test, in the background: ``_Dropper``)."""
    with fresh_database(endpoints, _database_maker, _database_dropper) as url:
        yield url


@pytest.fixture
def settings(endpoints: Endpoints, database_url: str,
             _topics_maker: _Maker[str]) -> Iterator[Settings]:
    """Settings of one test: own database, own topic prefix, short timeouts. The test's topics
    are deleted afterwards: a single-node broker's heap grows with every partition it holds,
    and a whole suite creates thousands."""
    with make_settings(endpoints, database_url, _topics_maker) as s:
        yield s


@pytest.fixture(scope="session")
def isolated_settings(endpoints: Endpoints, _database_maker: _Maker[str],
                      _database_dropper: _Dropper, _topics_maker: _Maker[str]
                      ) -> Callable[[], Any]:
    """A factory of context managers, each yielding :class:`Settings` exactly like the
    ``settings`` fixture's (own database, own topic prefix, short timeouts): for a module that
    runs independent points of one test function concurrently (``run_points_concurrently``)."""
    @contextmanager
    def make() -> Iterator[Settings]:
        with fresh_database(endpoints, _database_maker, _database_dropper) as url, \
                make_settings(endpoints, url, _topics_maker) as s:
            yield s
    return make


@pytest.fixture
def procs(settings: Settings, tmp_path) -> Iterator[ProcessRunner]:
    """Starts jobstream processes for the test and kills (SIGKILL) whatever is left at
    teardown (``ProcessRunner.kill_all``: the test is over, a graceful stop would only cost
    time)."""
    runner = ProcessRunner(settings, tmp_path / "logs")
    yield runner
    runner.kill_all()
