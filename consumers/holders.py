"""Ending a frozen previous owner's session: the bound Postgres does not give (flakes10).

A consumer frozen (SIGSTOP, a VM pause) in the middle of an extended-protocol exchange, after
its Bind reached Postgres and before its Execute/Sync did, leaves its session ``active``
(``ClientRead``) in an open transaction. No server timeout ends that: the idle timeouts are
armed only after a ReadyForQuery (so not between Bind and Sync) and ``statement_timeout`` is
ignored while the backend reads a command (postgres.c, ``ProcessInterrupts``: "If we are
reading a command from the client, just ignore the cancel request"). The client cannot help
either: it is frozen, libpq flushes a large Bind in 8 KB steps and the kernel may take a
partial write, so "send the exchange in one write" is not a bound. The frozen session keeps
the batch's ``processed_event`` rows locked and the partitions' next owner waits on them for as
long as the freeze lasts (84 s seen in ``tests/e2e/test_break_apply_lanes_sigstop.py``).

So the next owner ends it: while one of its applies has waited for a lock longer than
``held_s`` (the consumer's ``transaction_idle_timeout_s``: what an idle holder gets), a
watcher thread asks Postgres which sessions block it (``pg_blocking_pids``); of those, the
sessions of the same consumer group (``application_name`` :func:`session_name`) that have not
changed state for ``held_s`` and whose consumer is no longer a member of the group (the Kafka
group coordinator's member list, by the ``client.id`` token) are terminated
(``pg_terminate_backend``: same role). Fencing holds: terminating a session rolls its
transaction back, effects and dedup rows together; the frozen consumer, resumed, finds its
connection gone (an outage: it reconnects, rejoins the group and is handed whatever it owns
then, from the committed offsets). A live member is never ended, whatever it holds.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg

log = logging.getLogger(__name__)

#: Sessions of this group's consumers (``application_name`` LIKE the group's prefix) that
#: block a session of this consumer (``application_name`` = ``mine``) on a lock, unchanged for
#: ``held_s`` seconds: pid and application_name.
BLOCKING_HOLDERS = """
SELECT DISTINCT b.pid, b.application_name
  FROM pg_stat_activity w
 CROSS JOIN LATERAL unnest(pg_blocking_pids(w.pid)) AS bp(pid)
  JOIN pg_stat_activity b ON b.pid = bp.pid
 WHERE w.application_name = %(mine)s AND w.wait_event_type = 'Lock'
   AND b.application_name LIKE %(group_like)s AND b.application_name <> %(mine)s
   AND b.state_change < now() - make_interval(secs => %(held_s)s)
"""
#: End one session (its open transaction rolls back) if it is still the one looked at: the same
#: pid with the same ``application_name``, unchanged for ``held_s`` seconds (the member lookup
#: in between takes up to 10 s: a pid could end and be reused, or the holder move on). One row,
#: true when it was signalled; no row when it is no longer that session.
TERMINATE = """
SELECT pg_terminate_backend(pid) AS ended
  FROM pg_stat_activity
 WHERE pid = %(pid)s AND application_name = %(name)s
   AND state_change < now() - make_interval(secs => %(held_s)s)
"""


def session_name(group: str, token: str) -> str:
    """The ``application_name`` of a consumer's Postgres sessions: ``jsc.<8 hex digits of
    sha256(group)>.<token>`` (at most 63 bytes whatever the group's name; ``token``: the
    consumer's own, also the end of its Kafka ``client.id``)."""
    return f"jsc.{hashlib.sha256(group.encode()).hexdigest()[:8]}.{token}"


class FrozenHolderWatch:
    """The watcher thread of one consumer (see the module's docstring).

    Parameters
    ----------
    group
        The consumer group.
    token
        This consumer's token (:func:`session_name`; its Kafka ``client.id`` ends with
        ``-<token>``).
    dsn
        Postgres connection string (the watcher's own session, autocommit).
    admin_config
        librdkafka settings of the AdminClient that reads the group's members.
    held_s
        Seconds an apply must have waited, and a blocker stood still, before it is looked at.
    busy_since
        When (``time.monotonic()``) the consumer's current apply started, None when idle.
    """

    def __init__(
        self,
        *,
        group: str,
        token: str,
        dsn: str,
        admin_config: dict[str, Any],
        held_s: float,
        busy_since: Callable[[], float | None],
    ) -> None:
        self.group, self.token, self.dsn = group, token, dsn
        self.admin_config, self.held_s, self.busy_since = admin_config, held_s, busy_since
        self.mine = session_name(group, token)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._conn: psycopg.Connection[Any] | None = None
        self._admin: Any = None

    def start(self) -> None:
        """Start the watcher thread (a daemon)."""
        self._thread = threading.Thread(
            target=self._loop, daemon=True, name=f"holders-{self.group}"
        )
        self._thread.start()

    def close(self) -> None:
        """Stop the thread (waits for its current check) and close its connection."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
        if self._conn is not None:
            self._conn.close()

    def _loop(self) -> None:
        every = max(0.2, min(1.0, self.held_s / 3))
        while not self._stop.wait(every):
            since = self.busy_since()
            if since is None or time.monotonic() - since < self.held_s:
                continue
            try:
                self.check()
            except psycopg.errors.InsufficientPrivilege as exc:  # said once per round
                log.warning(
                    "cannot end a frozen holder's session (grant the consumers' "
                    "role pg_signal_backend, or use one role): %s",
                    exc,
                )
            except Exception as exc:  # noqa: BLE001 - a watcher must not die: next round
                log.debug("frozen-holder check failed: %s", exc)
                if self._conn is not None:
                    with contextlib.suppress(Exception):
                        self._conn.close()
                    self._conn = None

    def member_client_ids(self) -> set[str] | None:
        """The client.id of every current member of the group, None when the coordinator
        did not answer within 5 s."""
        from confluent_kafka.admin import AdminClient

        if self._admin is None:
            self._admin = AdminClient(self.admin_config)
        try:
            desc = self._admin.describe_consumer_groups([self.group], request_timeout=5)
            got = desc[self.group].result(timeout=5)
        except Exception as exc:  # noqa: BLE001 - unknown membership: end nobody
            log.debug("members of group %s unknown: %s", self.group, exc)
            return None
        return {m.client_id for m in got.members}

    def check(self) -> list[int]:
        """One look: the pids of the frozen holders ended (see the module's docstring).
        Raises ``psycopg.Error`` when Postgres cannot be asked."""
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(
                self.dsn, autocommit=True, connect_timeout=10, application_name=f"{self.mine}.watch"
            )
        prefix = self.mine.rsplit(".", 1)[0] + "."
        rows = self._conn.execute(
            BLOCKING_HOLDERS, {"mine": self.mine, "group_like": prefix + "%", "held_s": self.held_s}
        ).fetchall()
        if not rows:
            return []
        members = self.member_client_ids()
        if members is None:
            return []
        ended: list[int] = []
        for pid, name in rows:
            token = str(name).rsplit(".", 1)[-1]
            if token.endswith("watch") or any(c.endswith(f"-{token}") for c in members):
                continue  # a live member (or a watcher): never ended
            row = self._conn.execute(
                TERMINATE, {"pid": pid, "name": name, "held_s": self.held_s}
            ).fetchone()
            if row and row[0]:
                ended.append(pid)
                log.warning(
                    "ended Postgres session %s (%s): it held locks this consumer waited on "
                    "for over %.0fs, unchanged, and its consumer is no longer a member of "
                    "group %s (frozen mid-statement?); its transaction is rolled back",
                    pid,
                    name,
                    self.held_s,
                    self.group,
                )
        return ended
