"""Breaker6: a ``consume-ready`` frozen (SIGSTOP, a VM pause) inside the ready applier's batch
apply statement (``apply_ready_rows``), with real consumer processes, the broker and Postgres.

The batch's ``processed_event`` rows are inserted before the effect rows, in the same
transaction, so a frozen consumer holds them, and the partitions' next owner waits on them,
until its session ends. The effect rows used to be written with a binary ``COPY ... FROM
STDIN``: a session waiting for COPY data is ``active`` (``ClientRead``), so
``idle_in_transaction_session_timeout`` (the library's bound for a paused consumer,
``transaction_idle_timeout_s``) never ended it and the partitions stayed held for as long as
the process was frozen (seen 1 run in 5 with a SIGSTOP at an arbitrary moment of a backlog).
Now each table gets one prepared ``INSERT ... SELECT * FROM unnest($1::<row type>[])``: once
the statement has run, the session is idle in transaction and the timeout ends it; a freeze
while its parameters are being sent is bounded the same way (the Bind of a prepared statement
follows a ReadyForQuery; docs/design-notes.md "A consumer frozen mid-apply").

Two probes. Frozen in the statement: made deterministic by holding a SHARE lock on the analysis
table so the consumer's INSERT waits to start, freezing the consumer there, then releasing it:
the INSERT completes and its answer waits for a client that does not read it. Frozen while
sending the statement's parameters: the consumer reaches Postgres through a TCP proxy that
forwards half of that Bind message and then nothing more (what a client frozen mid-send
leaves), and the consumer is SIGSTOPped; without ``prepare=True`` this one fails (checked).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import struct
import threading

import psycopg
import pytest
from confluent_kafka import Producer
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from jobstream.kafka import producer_config
from jobstream.settings import Settings
from schemas.events import encode_event
from tests.helpers import Proc, ProcessRunner, job_ready, processed_rows, query, wait_for

pytestmark = pytest.mark.e2e

N = 300


def _apply_session(url: str, *, state: str, wait_event: str | None
                   ) -> list[dict[str, object]]:
    # the apply statement, or the binary COPY it replaced (so the probe still fails with it)
    return query(url, "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                      "AND query ~ '^(INSERT INTO|COPY) downstream\\.document_analysis' "
                      "AND state = %s AND wait_event IS NOT DISTINCT FROM %s",
                 (state, wait_event))


def test_a_consumer_frozen_mid_apply_does_not_hold_the_partitions(
        settings: Settings, procs: ProcessRunner) -> None:
    url, topic = settings.database_url, settings.topic("job.ready")
    producer = Producer(producer_config(settings))
    events = [job_ready(f"copy{i}", charge_usd=0.5) for i in range(N)]
    for i, e in enumerate(events):
        producer.produce(topic, value=encode_event(e), key=str(e.job_id).encode(),
                         partition=i % 3)
    assert producer.flush(60) == 0
    env = {"JOBSTREAM_CONSUMER_TRANSACTION_IDLE_TIMEOUT_S": "3"}
    blocker = psycopg.connect(url)
    blocker.execute("LOCK TABLE downstream.document_analysis IN SHARE MODE")
    frozen = procs.start("consume-ready", name="consumer-frozen", **env)
    try:
        waiting = wait_for(lambda: _apply_session(url, state="active", wait_event="relation"),
                           60, "the consumer's apply statement waiting to start", procs.logs,
                           every_s=0.05)
        os.kill(frozen.popen.pid, signal.SIGSTOP)
        blocker.rollback()  # the INSERT runs; its client is frozen
        procs.start("consume-ready", name="consumer-next", **env)
        wait_for(lambda: processed_rows(url)[0] == N, 25, "the next owner to apply every "
                 "event while the first consumer is frozen mid-apply", procs.logs, every_s=0.5)
        # the frozen consumer's session was ended (idle_in_transaction_session_timeout)
        wait_for(lambda: not query(url, "SELECT 1 FROM pg_stat_activity WHERE pid = %s",
                                   (waiting[0]["pid"],)), 10,
                 "the frozen consumer's session to be gone", procs.logs)
    finally:
        blocker.close()
        os.kill(frozen.popen.pid, signal.SIGCONT)
    rows = query(url, "SELECT dedup_key, count(*) AS n FROM downstream.document_analysis "
                      "GROUP BY dedup_key")
    assert len(rows) == N and {r["n"] for r in rows} == {1}, rows[:5]


class _StallingProxy:
    """A TCP proxy in front of Postgres (the client connects with ``sslmode=disable``) that
    forwards the wire protocol and, once, stalls in the middle of the Bind message of the
    statement whose Parse contained ``marker``: it forwards the Bind's header and the first
    half of its bytes, then nothing more from that client. Postgres then sees exactly what a
    client frozen while sending its parameters leaves it with. ``stalled`` is set then.
    ``whole_bind``: forward the whole Bind and stall right after it (its Execute and Sync
    withheld: the session is then ``active``, ``ClientRead``, no idle timeout armed)."""

    def __init__(self, host: str, port: int, marker: bytes, *, whole_bind: bool = False
                 ) -> None:
        self._target, self._marker, self._whole = (host, port), marker, whole_bind
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.stalled = threading.Event()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = [self._listener]
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for s in self._sockets:
                with contextlib.suppress(OSError):
                    s.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self._target, timeout=10)
            except OSError:
                client.close()
                return
            server.settimeout(None)
            with self._lock:
                self._sockets += (client, server)
                if self._closed:  # accepted while closing
                    client.close()
                    server.close()
                    return
            threading.Thread(target=self._to_client, args=(server, client), daemon=True).start()
            threading.Thread(target=self._to_server, args=(client, server), daemon=True).start()

    @staticmethod
    def _to_client(server: socket.socket, client: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := server.recv(65536):
                client.sendall(data)
            client.shutdown(socket.SHUT_WR)  # Postgres ended the session: the client sees it

    def _to_server(self, client: socket.socket, server: socket.socket) -> None:
        def exact(n: int) -> bytes:
            buf = b""
            while len(buf) < n:
                got = client.recv(n - len(buf))
                if not got:
                    raise OSError("client closed")
                buf += got
            return buf

        names: set[bytes] = set()
        with contextlib.suppress(OSError):
            head = exact(4)  # the startup message: no type byte
            server.sendall(head + exact(struct.unpack(">i", head)[0] - 4))
            while True:
                head = exact(5)
                body = exact(struct.unpack(">i", head[1:])[0] - 4)
                if head[:1] == b"P" and self._marker in body:
                    names.add(body.split(b"\0", 1)[0])  # the statement's name ("" unnamed)
                elif head[:1] == b"B" and body.split(b"\0", 2)[1] in names:
                    with self._lock:
                        stall = not self.stalled.is_set()
                        self.stalled.set()
                    if stall:
                        server.sendall(head + (body if self._whole else body[:len(body) // 2]))
                        return  # nothing more from this client; both sockets stay open
                server.sendall(head + body)


def _consumer_behind_proxy(settings: Settings, procs: ProcessRunner, prefix: str, *,
                           whole_bind: bool) -> tuple[_StallingProxy, Proc, dict[str, str]]:
    """``N`` events on three partitions, then a ``consume-ready`` that reaches Postgres through
    a :class:`_StallingProxy` of the analysis insert (``whole_bind`` as there): the proxy, the
    consumer and the environment (idle limit 3 s) a next owner is started with."""
    url, topic = settings.database_url, settings.topic("job.ready")
    producer = Producer(producer_config(settings))
    events = [job_ready(f"{prefix}{i}", charge_usd=0.5) for i in range(N)]
    for i, e in enumerate(events):
        producer.produce(topic, value=encode_event(e), key=str(e.job_id).encode(),
                         partition=i % 3)
    assert producer.flush(60) == 0
    info = conninfo_to_dict(url)
    proxy = _StallingProxy(str(info.get("host") or "127.0.0.1"), int(info.get("port") or 5432),
                           b"INSERT INTO downstream.document_analysis", whole_bind=whole_bind)
    proxied = make_conninfo(url, host="127.0.0.1", port=str(proxy.port), sslmode="disable",
                            gssencmode="disable")
    env = {"JOBSTREAM_CONSUMER_TRANSACTION_IDLE_TIMEOUT_S": "3"}
    frozen = procs.start("consume-ready", name="consumer-frozen", JOBSTREAM_DATABASE_URL=proxied,
                         **env)
    return proxy, frozen, env


def test_a_consumer_frozen_while_sending_its_apply_parameters_does_not_hold_the_partitions(
        settings: Settings, procs: ProcessRunner) -> None:
    """Frozen mid-Bind of the analysis insert: Postgres has read part of its parameters (the
    batch's rows) and waits for the rest. The statement is prepared (``prepare=True``), so the
    Bind follows a ReadyForQuery and the session is ``idle in transaction``: the timeout ends
    it. Unprepared (Parse, Bind, Execute, Sync sent together) the session stayed ``active``,
    ``ClientRead``, and held the batch's ``processed_event`` rows for good."""
    url = settings.database_url
    proxy, frozen, env = _consumer_behind_proxy(settings, procs, "bind", whole_bind=False)
    try:
        wait_for(proxy.stalled.is_set, 60, "the consumer's analysis insert sending its rows",
                 procs.logs, every_s=0.05)
        os.kill(frozen.popen.pid, signal.SIGSTOP)
        procs.start("consume-ready", name="consumer-next", **env)
        wait_for(lambda: processed_rows(url)[0] == N, 25, "the next owner to apply every "
                 "event while the first consumer is frozen mid-Bind", procs.logs, every_s=0.5)
    finally:
        os.kill(frozen.popen.pid, signal.SIGCONT)
        proxy.close()
    rows = query(url, "SELECT dedup_key, count(*) AS n FROM downstream.document_analysis "
                      "GROUP BY dedup_key")
    assert len(rows) == N and {r["n"] for r in rows} == {1}, rows[:5]


def test_a_consumer_frozen_right_after_its_apply_bind_does_not_hold_the_partitions(
        settings: Settings, procs: ProcessRunner) -> None:
    """flakes10: frozen after the analysis insert's whole Bind reached Postgres, before its
    Execute/Sync (seen once in test_break_apply_lanes_sigstop.py: 84 s). The session is
    ``active``/``ClientRead`` in an open transaction: no idle timeout is armed and
    ``statement_timeout`` is ignored while a command is read, so nothing on the server ends it.
    The next owner, waiting on its ``processed_event`` rows, ends it once the frozen consumer
    has left the group (consumers/holders.py); without that it waits as long as the freeze."""
    url = settings.database_url
    proxy, frozen, env = _consumer_behind_proxy(settings, procs, "afterbind", whole_bind=True)
    try:
        wait_for(proxy.stalled.is_set, 60, "the consumer's analysis insert bound", procs.logs,
                 every_s=0.05)
        held = wait_for(lambda: _apply_session(url, state="active", wait_event="ClientRead"),
                        20, "the insert's session active/ClientRead (Bind read, no Execute)",
                        procs.logs, every_s=0.1)
        os.kill(frozen.popen.pid, signal.SIGSTOP)
        nxt = procs.start("consume-ready", name="consumer-next", **env)
        wait_for(lambda: processed_rows(url)[0] == N, 45, "the next owner to apply every "
                 "event while the first consumer is frozen after its Bind", procs.logs,
                 every_s=0.5)
        assert not query(url, "SELECT 1 FROM pg_stat_activity WHERE pid = %s",
                         (held[0]["pid"],)), "the frozen session is still there"
    finally:
        os.kill(frozen.popen.pid, signal.SIGCONT)
        proxy.close()
    assert f"ended Postgres session {held[0]['pid']} " in nxt.log_text(), procs.logs()
    assert frozen.popen.poll() is None and nxt.popen.poll() is None, procs.logs()
    rows = query(url, "SELECT dedup_key, count(*) AS n FROM downstream.document_analysis "
                      "GROUP BY dedup_key")
    assert len(rows) == N and {r["n"] for r in rows} == {1}, rows[:5]
