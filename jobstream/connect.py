"""The Debezium relay: the outbox on Kafka Connect (``JOBSTREAM_RELAY=debezium``).

Debezium's PostgreSQL connector reads the ``outbox`` table through a publication limited to it
and a logical replication slot; its Outbox Event Router turns each inserted row into one Kafka
message: topic = the row's ``topic`` (already ``<prefix><name>``), key = ``kafka_key`` (the job
id), value = ``payload`` (bytes, unchanged), headers = the ``hdr_*`` columns migration 0013
fills from the row's ``headers``. The messages are byte-identical to the Python relay's
(``tests/e2e/test_debezium_relay.py`` compares them).

The connector config is the project's own file ``jobstream/debezium/outbox-connector.json``,
rendered from the settings by :func:`render_config` and registered over Connect's REST API by
:func:`deploy` (``jobstream connect deploy``). Deploying also enables the outbox's two
Debezium triggers: rows get their header columns and are deleted in the transaction that
inserted them (logical decoding still streams the insert), so the outbox never grows.

The replication slot is what can hurt: while the connector is down the slot keeps every WAL
segment since the last LSN Debezium confirmed. :func:`slot_stats` reads it (exported by
``/metrics`` as ``jobstream_replication_slot_retained_bytes`` / ``..._active``) and
:func:`check_replication_slot` flags an inactive slot or one over
``slot_retained_alert_bytes``.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from jobstream.db import QUERIES as Q
from jobstream.db import connect
from jobstream.settings import Settings

TEMPLATE = Path(__file__).resolve().parent / "debezium" / "outbox-connector.json"
#: The active-relay advisory lock of outbox_relay.relay (kept here to avoid importing it).
RELAY_LOCK_ID = 0x6F757462
_SLOT_CHARS = re.compile(r"[^a-z0-9_]")
_TOPIC_CHARS = re.compile(r"^[A-Za-z0-9._-]+$")
#: The one table of the connector's publication.
PUBLISHED = {"public.outbox"}
#: Logical topic of the relay's heartbeat events (``<prefix>relay.heartbeat``): the connector
#: writes one outbox row every ``connect_heartbeat_s`` (``heartbeat.action.query``) so its
#: slot advances on a quiet database while other databases of the server write WAL (without
#: it the slot held 2.4 GB behind an active connector here). Events the router drops (like
#: Debezium's own heartbeat records) do not advance the slot; a delivered one does.
HEARTBEAT_TOPIC = "relay.heartbeat"


class ConnectError(Exception):
    """Kafka Connect refused or did not answer, or the connector did not start in time."""


@dataclass(frozen=True)
class Names:
    """What the Debezium relay of one database is called: ``connector`` (Connect), ``slot``
    (replication slot, cluster-wide), ``publication`` (per database), ``logical_name``
    (Debezium's ``topic.prefix``: names its metrics and offsets)."""

    connector: str
    slot: str
    publication: str
    logical_name: str


@dataclass(frozen=True)
class Finding:
    """One result of a check: ``check`` (its name), ``ok``, ``severity`` (``info``,
    ``warning``, ``critical``), ``message`` and ``details`` (numbers, names)."""

    check: str
    ok: bool
    severity: str
    message: str
    details: dict[str, Any] = field(default_factory=dict)


def _dbname(settings: Settings) -> str:
    return str(conninfo_to_dict(settings.database_url).get("dbname") or "jobstream")


def names(settings: Settings) -> Names:
    """The connector, slot and publication names in force (settings, or derived from the
    database name so two databases on one server never share a slot)."""
    db = _dbname(settings)
    slot = settings.replication_slot or _SLOT_CHARS.sub("_", f"jobstream_{db}".lower())[:63]
    connector = settings.connect_connector_name or f"jobstream-outbox-{db}"
    return Names(connector, slot, settings.publication, _SLOT_CHARS.sub("_", connector.lower()))


def render_config(settings: Settings) -> dict[str, str]:
    """The connector config (Connect's ``{key: string}``) rendered from the template file.

    Raises ``KeyError`` when the template names a placeholder this function does not know.
    """
    info = conninfo_to_dict(settings.database_url)
    n = names(settings)
    values = {
        "db_host": str(info.get("host") or "127.0.0.1"), "db_port": str(info.get("port") or 5432),
        "db_user": str(info.get("user") or "postgres"),
        "db_password": str(info.get("password") or ""), "db_name": _dbname(settings),
        "slot": n.slot, "publication": n.publication, "logical_name": n.logical_name,
        "heartbeat_ms": str(int(settings.connect_heartbeat_s * 1000)),
        "heartbeat_topic": settings.topic(HEARTBEAT_TOPIC),
    }
    if not _TOPIC_CHARS.match(values["heartbeat_topic"]):
        raise ValueError(f"not a Kafka topic name: {values['heartbeat_topic']!r}")
    raw = json.loads(TEMPLATE.read_text())
    return {k: re.sub(r"\{\{(\w+)\}\}", lambda m: values[m.group(1)], v)
            for k, v in raw.items() if not k.startswith("_")}


def _client(settings: Settings) -> httpx.Client:
    return httpx.Client(base_url=settings.connect_url, timeout=30.0)


def _request(settings: Settings, method: str, path: str, **kw: Any) -> httpx.Response:
    try:
        with _client(settings) as c:
            return c.request(method, path, **kw)
    except httpx.HTTPError as exc:
        raise ConnectError(f"Kafka Connect at {settings.connect_url} did not answer: "
                           f"{exc}") from None


def connector_status(settings: Settings) -> dict[str, Any] | None:
    """Connect's status of the outbox connector (``{"connector": {"state"}, "tasks": [...]}``)
    or ``None`` when it is not registered. Raises :class:`ConnectError` when Connect is down."""
    r = _request(settings, "GET", f"/connectors/{names(settings).connector}/status")
    if r.status_code == 404:
        return None
    if r.status_code != 200:
        raise ConnectError(f"GET status: HTTP {r.status_code} {r.text[:300]}")
    return dict(r.json())


def slot_stats(settings: Settings) -> list[dict[str, Any]]:
    """Every logical replication slot of the settings' database: ``slot``, ``active``
    (a walsender streams from it), ``wal_status``, ``retained_bytes`` (WAL kept for it:
    current LSN - restart_lsn, bytes) and ``unconfirmed_bytes`` (current LSN -
    confirmed_flush_lsn, bytes)."""
    with connect(settings.database_url, autocommit=True) as conn:
        return [dict(r) for r in conn.execute(Q["replication_slots"])]


def debezium_in_force(settings: Settings) -> str | None:
    """Why the Python relay must not publish this outbox, or ``None`` when it may: the
    Debezium relay is selected (``JOBSTREAM_RELAY``), its triggers are enabled (deployed), or
    its replication slot exists. Raises ``psycopg.OperationalError`` when Postgres is down."""
    if settings.relay == "debezium":
        return ("JOBSTREAM_RELAY=debezium: the outbox is published by the Debezium connector "
                "(jobstream connect deploy)")
    n = names(settings)
    with connect(settings.database_url, autocommit=True) as conn:
        on = [r["name"] for r in conn.execute(Q["debezium_triggers"]) if r["enabled"]]
        slots = [r["slot"] for r in conn.execute(Q["replication_slots"])]
    if on:
        return (f"the Debezium outbox connector is deployed on this database (triggers "
                f"{', '.join(on)} enabled); run `jobstream connect delete` first")
    if n.slot in slots:
        return (f"the replication slot {n.slot} of the Debezium relay exists; run "
                "`jobstream connect delete` first")
    return None


def _wait_running(settings: Settings, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    st: dict[str, Any] | None = None
    while time.monotonic() < deadline:
        st = connector_status(settings)
        tasks = (st or {}).get("tasks") or []
        if any(t.get("state") == "FAILED" for t in tasks):
            raise ConnectError(f"connector task failed: {tasks[0].get('trace', '')[:2000]}")
        if (st and st["connector"]["state"] == "RUNNING" and tasks
                and all(t["state"] == "RUNNING" for t in tasks)):
            return st
        time.sleep(0.5)
    raise ConnectError(f"connector not RUNNING after {timeout_s:.0f}s: {st}")


def _wait_slot(settings: Settings, slot: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(s["slot"] == slot and s["active"] for s in slot_stats(settings)):
            return
        time.sleep(0.5)
    raise ConnectError(f"replication slot {slot} not active after {timeout_s:.0f}s")


def _ensure_heartbeat_topic(settings: Settings) -> None:
    """Create ``<prefix>relay.heartbeat`` (1 partition, 1 hour retention) if missing."""
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import AdminClient, NewTopic

    from jobstream.kafka import base_config
    topic = settings.topic(HEARTBEAT_TOPIC)
    admin = AdminClient(base_config(settings))
    fut = admin.create_topics([NewTopic(topic, num_partitions=1,
                                        replication_factor=settings.topic_replication,
                                        config={"retention.ms": "3600000"})])[topic]
    try:
        fut.result(30)
    except KafkaException as exc:
        if exc.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
            raise ConnectError(f"could not create {topic}: {exc}") from None


def deploy(settings: Settings, *, timeout_s: float = 120.0) -> dict[str, Any]:
    """Register (or update) the outbox connector and switch the outbox to the Debezium relay.

    Steps: refuse while a Python relay holds the active-relay lock; create the publication
    (the outbox only); create the heartbeat topic; enable the header trigger; register the
    connector (new: created stopped, stale offsets of that name reset, resumed; existing: its
    config updated); wait until
    the task runs and its slot is active; enable the delete-on-insert trigger; re-insert
    rows the Python relay left unpublished so the connector streams them too. Idempotent.
    Returns :func:`status`. Raises :class:`ConnectError` (Connect refused, task failed, not
    running within ``timeout_s`` seconds) or ``RuntimeError`` (a Python relay is active).
    """
    n = names(settings)
    with connect(settings.database_url, autocommit=True) as conn:
        row = conn.execute(Q["relay_lock_holders"], (RELAY_LOCK_ID,)).fetchone()
        if row and row["n"]:
            raise RuntimeError("a Python relay is running on this database (it holds the "
                               "active-relay lock): stop it before deploying the connector")
        if not conn.execute(Q["debezium_publication_exists"], (n.publication,)).fetchone():
            conn.execute(sql.SQL("CREATE PUBLICATION {} FOR TABLE outbox").format(
                sql.Identifier(n.publication)))
        tables = {r["t"] for r in conn.execute(Q["debezium_publication_tables"],
                                              (n.publication,))}
        if tables != PUBLISHED:
            raise RuntimeError(f"publication {n.publication} carries {sorted(tables)}, "
                               f"not {sorted(PUBLISHED)}")
        conn.execute(Q["debezium_enable_headers"])
    _ensure_heartbeat_topic(settings)
    cfg = render_config(settings)
    if connector_status(settings) is None:
        # New: created STOPPED (KIP-980) and any offsets a former connector of this name
        # left are reset, so it starts at its slot's position, then resumed.
        r = _request(settings, "POST", "/connectors", json={
            "name": n.connector, "config": cfg, "initial_state": "STOPPED"})
        if r.status_code not in (200, 201):
            raise ConnectError(f"POST connector: HTTP {r.status_code} {r.text[:500]}")
        r = _request(settings, "DELETE", f"/connectors/{n.connector}/offsets")
        if r.status_code not in (200, 404):
            raise ConnectError(f"DELETE offsets: HTTP {r.status_code} {r.text[:500]}")
        r = _request(settings, "PUT", f"/connectors/{n.connector}/resume")
        if r.status_code not in (200, 202, 204):
            raise ConnectError(f"PUT resume: HTTP {r.status_code} {r.text[:500]}")
    else:
        r = _request(settings, "PUT", f"/connectors/{n.connector}/config", json=cfg)
        if r.status_code not in (200, 201):
            raise ConnectError(f"PUT config: HTTP {r.status_code} {r.text[:500]}")
    _wait_running(settings, timeout_s)
    _wait_slot(settings, n.slot, timeout_s)
    with connect(settings.database_url) as conn, conn.transaction():
        conn.execute(Q["debezium_enable_forget"])
        conn.execute(Q["debezium_handover"])
    return status(settings)


def delete(settings: Settings, *, timeout_s: float = 60.0) -> list[str]:
    """Unregister the connector (stopped, its offsets reset, deleted), drop its replication
    slot and publication, and switch the outbox back to the Python relay (triggers off).
    Returns what was done (lines). Connect being down only skips the unregistering (the slot
    is dropped once no walsender uses it; ``RuntimeError`` when it stays active
    ``timeout_s`` seconds)."""
    n = names(settings)
    done: list[str] = []
    try:
        done += _unregister(settings, n.connector, timeout_s)
    except ConnectError as exc:
        done.append(f"connector {n.connector}: not deleted ({exc})")
    deadline = time.monotonic() + timeout_s
    with connect(settings.database_url, autocommit=True) as conn:
        conn.execute(Q["debezium_disable_triggers"])
        done.append("outbox triggers disabled (the Python relay may run)")
        while True:
            slots = {r["slot"]: r for r in conn.execute(Q["replication_slots"])}
            if n.slot not in slots:
                break
            if not slots[n.slot]["active"]:
                conn.execute(Q["replication_slot_drop"], (n.slot,))
                done.append(f"replication slot {n.slot} dropped")
                continue
            if time.monotonic() > deadline:
                raise RuntimeError(f"replication slot {n.slot} still active after "
                                   f"{timeout_s:.0f}s; is another connector using it?")
            time.sleep(0.5)
        conn.execute(sql.SQL("DROP PUBLICATION IF EXISTS {}").format(
            sql.Identifier(n.publication)))
        done.append(f"publication {n.publication} dropped")
    return done


def _unregister(settings: Settings, connector: str, timeout_s: float) -> list[str]:
    """Stop the connector, reset its source offsets, delete it. Connect keeps a deleted
    connector's offsets (the LSN it had reached) under its name: a later deploy with a new
    slot would resume from that LSN, which the new slot no longer has, and fail. Offsets can
    only be reset on a STOPPED connector (KIP-875)."""
    r = _request(settings, "PUT", f"/connectors/{connector}/stop")
    if r.status_code == 404:
        return [f"connector {connector}: not registered"]
    if r.status_code not in (200, 202, 204):
        raise ConnectError(f"PUT stop: HTTP {r.status_code} {r.text[:300]}")
    deadline = time.monotonic() + timeout_s
    while (st := connector_status(settings)) and st["connector"]["state"] != "STOPPED":
        if time.monotonic() > deadline:
            raise ConnectError(f"connector {connector} not STOPPED after {timeout_s:.0f}s")
        time.sleep(0.3)
    out = []
    r = _request(settings, "DELETE", f"/connectors/{connector}/offsets")
    out.append(f"connector {connector}: offsets "
               + ("reset" if r.status_code == 200 else f"not reset (HTTP {r.status_code})"))
    r = _request(settings, "DELETE", f"/connectors/{connector}")
    out.append(f"connector {connector}: "
               + ("deleted" if r.status_code in (200, 204) else f"HTTP {r.status_code}"))
    return out


def status(settings: Settings) -> dict[str, Any]:
    """``{"connector": name, "state": ..., "tasks": [{"id", "state", "worker_id"}],
    "slots": slot_stats(...), "connect_error": str | None}``; Connect being down is reported,
    not raised."""
    n = names(settings)
    out: dict[str, Any] = {"connector": n.connector, "slot": n.slot,
                           "publication": n.publication, "state": None, "tasks": [],
                           "connect_error": None}
    try:
        st = connector_status(settings)
        if st is None:
            out["state"] = "NOT_REGISTERED"
        else:
            out["state"] = st["connector"]["state"]
            out["tasks"] = [{k: t.get(k) for k in ("id", "state", "worker_id", "trace")}
                            for t in st.get("tasks", [])]
    except ConnectError as exc:
        out["connect_error"] = str(exc)
    out["slots"] = slot_stats(settings)
    return out


def check_replication_slot(settings: Settings) -> list[Finding]:
    """The verify check of the Debezium relay's slot(s): one finding per logical slot of the
    database. ``critical`` when a slot is inactive (nothing consumes it: it retains WAL until
    the disk fills), ``warning`` when it retains more than ``slot_retained_alert_bytes``,
    ``ok`` otherwise. No slot: one ``ok`` finding, unless ``JOBSTREAM_RELAY=debezium`` (then
    the missing slot is ``critical``: nothing publishes the outbox). Postgres being down
    raises ``psycopg.OperationalError``."""
    return slot_findings(slot_stats(settings), settings)


def slot_findings(stats: list[dict[str, Any]], settings: Settings) -> list[Finding]:
    """:func:`check_replication_slot` on given :func:`slot_stats` rows (no I/O)."""
    limit = settings.slot_retained_alert_bytes
    if not stats:
        if settings.relay == "debezium":
            return [Finding("replication_slot", False, "critical",
                            f"JOBSTREAM_RELAY=debezium but slot {names(settings).slot} does "
                            "not exist: run `jobstream connect deploy`")]
        return [Finding("replication_slot", True, "info", "no logical replication slot")]
    out = []
    for s in stats:
        d = {"slot": s["slot"], "active": s["active"], "retained_bytes": s["retained_bytes"],
             "threshold_bytes": limit}
        if not s["active"]:
            out.append(Finding("replication_slot", False, "critical",
                               f"slot {s['slot']} is inactive and retains "
                               f"{s['retained_bytes']} bytes of WAL: Kafka Connect or the "
                               "connector is down (README: when the slot grows)", d))
        elif s["retained_bytes"] > limit:
            out.append(Finding("replication_slot", False, "warning",
                               f"slot {s['slot']} retains {s['retained_bytes']} bytes of WAL "
                               f"(> {limit}): the connector lags", d))
        else:
            out.append(Finding("replication_slot", True, "info",
                               f"slot {s['slot']} active, retains {s['retained_bytes']} bytes",
                               d))
    return out


def relay_refusal(settings: Settings) -> str | None:
    """:func:`debezium_in_force` for the Python relay's start, Postgres errors included as
    ``None`` (the relay's own reconnect loop reports an unreachable database)."""
    try:
        return debezium_in_force(settings)
    except psycopg.OperationalError:
        return None
