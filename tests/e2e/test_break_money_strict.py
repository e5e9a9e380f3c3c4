"""Hostile money fields on ``job.ready`` from outside: ``consume-ready`` (group A) and the
consumer library (group B, ``two_groups_consumer.py``) in real processes on one topic.

``charge_usd`` and ``cost_usd`` are JSON numbers, finite and not negative. A bool, a numeric
string, a number that overflows a float (``1e400``, a 400-digit integer), ``Infinity`` / ``NaN``
literals (Python's ``json`` reads them), ``null``, a list, an object, 10^6 USD or more, or a
value that rounds to 10^6 at ``numeric(14, 8)``'s 8 decimals must each be
dead-lettered by each group with ``schema_violation`` and a reason naming the field, and never
applied (no analysis row, no ledger charge, no ``processed_event`` effect row); well-formed
neighbours, an integer charge and an exponent among them, are applied once each.
"""

from __future__ import annotations

import collections
import math
from pathlib import Path
from typing import Any

import psycopg
import pytest

from consumers import create_tables
from jobstream.kafka import group_lag
from jobstream.settings import Settings
from schemas.events import encode_event
from tests.helpers import (
    ProcessRunner,
    ScriptRig,
    job_ready,
    processed_rows,
    query,
    read_topic,
    wait_for,
)

pytestmark = pytest.mark.e2e

SCHEMA = "money_lib"
SCRIPT = Path(__file__).with_name("two_groups_consumer.py")
PARTITIONS = 3
#: (field, raw JSON text of its value): each must be refused
HOSTILE = [("charge_usd", v) for v in (
    b"true", b"false", b'"1.5"', b'"0"', b"1e400", b"1E400", b"-1e400", b"1" + b"0" * 400,
    b"Infinity", b"-Infinity", b"NaN", b'"Infinity"', b'"inf"', b'"1e400"', b"null",
    b"[0.5]", b'{"usd": 0.5}', b"-0.5", b"1e6", b"1000000",
    # below 10^6 as a float, but 10^6 once rounded to numeric(14, 8)'s 8 decimals: Postgres
    # refused it after the event was accepted (invalid_data), not the schema
    b"999999.999999995", b"999999.999999999")] + [("cost_usd", v) for v in (
        b"true", b'"1.5"', b"1e400", b"Infinity")]
#: well-formed: (raw JSON text, the value it means)
GOOD = [(b"2", 2.0), (b"1.5e2", 150.0), (b"0", 0.0), (b"0.5", 0.5),
        (b"999999.99999999", 999999.99999999), (b"0.000000004", 0.0)]


def _with(field: str, raw: bytes, value: bytes) -> bytes:
    """``value`` (an encoded job.ready whose field is 0.5 or 0.0) with ``field`` set to the
    raw JSON text ``raw``."""
    for old in (b'"%s":0.5' % field.encode(), b'"%s":0.0' % field.encode()):
        if old in value:
            return value.replace(old, b'"%s":%s' % (field.encode(), raw), 1)
    raise AssertionError(f"{field} not found in {value[:300]!r}")


def test_hostile_money_fields_are_dead_lettered_by_each_group_and_never_applied(
        settings: Settings, procs: ProcessRunner, tmp_path: Path) -> None:
    url, topic = settings.database_url, settings.topic("job.ready")
    with psycopg.connect(url) as conn:
        create_tables(conn, SCHEMA)
    parts: list[tuple[int, bytes, bytes, str | None]] = []  # partition, key, value, bad field
    charges: dict[str, float] = {}  # good dedup key -> its charge
    bad_keys: set[str] = set()
    for i in range(30):
        ev = job_ready(f"money-good{i}")
        value = encode_event(ev)
        charge = 0.5
        if i < len(GOOD):
            value, charge = _with("charge_usd", GOOD[i][0], value), GOOD[i][1]
        charges[ev.dedup_key] = charge
        parts.append((i % PARTITIONS, str(ev.job_id).encode(), value, None))
    for j, (field, raw) in enumerate(HOSTILE):
        ev = job_ready(f"money-bad{j}")
        bad_keys.add(ev.dedup_key)
        parts.insert(3 * j + 1, (j % PARTITIONS, str(ev.job_id).encode(),
                                 _with(field, raw, encode_event(ev)), field))
    hostile = _produce(settings, topic, parts)
    assert len(hostile) == len(HOSTILE)
    ga, gb = settings.group("downstream-ready-applier"), settings.group("money-lib")
    procs.start("consume-ready", name="group-a")
    rig = ScriptRig(tmp_path, SCRIPT.read_text(), [
        settings.kafka_bootstrap_servers, url, settings.topic_prefix, gb, SCHEMA], ("group-b",))
    try:
        rig.start("group-b", FREEZE="")
        wait_for(lambda: group_lag(settings, ga, [topic]) == 0
                 and group_lag(settings, gb, [topic]) == 0, 60, "both groups at lag 0",
                 lambda: rig.all_logs() + procs.logs(), every_s=0.5)
    finally:
        rig.close()

    per: dict[str, dict[tuple[int, int], list[tuple[str, str]]]] = collections.defaultdict(
        lambda: collections.defaultdict(list))
    for m in read_topic(settings, topic + ".dlq"):
        h = {k: (v or b"").decode() for k, v in m.headers() or []}
        per[h["dlq_consumer_group"]][int(h["dlq_original_partition"]),
                                     int(h["dlq_original_offset"])].append(
            (h["dlq_reason_code"], h["dlq_reason"]))
    assert set(per) == {ga, gb}, set(per)
    for g, got in per.items():
        wrong = {hostile[pos]: got.get(pos) for pos in hostile
                 if [c for c, _r in got.get(pos, [])] != ["schema_violation"]
                 or hostile[pos][0] not in got[pos][0][1]}
        assert not wrong, f"group {g}: not dead-lettered once as a schema violation of the " \
                          f"field: {wrong}"
        assert set(got) == set(hostile), (g, sorted(set(got) - set(hostile)))

    rows = query(url, "SELECT a.dedup_key, (SELECT array_agg(c.amount_usd::text) FROM "
                      "downstream.ledger_charge c WHERE c.dedup_key = a.dedup_key) AS amounts "
                      "FROM downstream.document_analysis a")
    assert sorted(r["dedup_key"] for r in rows) == sorted(charges), \
        f"applied hostile: {sorted({r['dedup_key'] for r in rows} & bad_keys)}"
    amounts = {r["dedup_key"]: r["amounts"] for r in rows}
    for key, charge in charges.items():
        assert amounts[key] is not None and len(amounts[key]) == 1, (key, amounts[key])
        assert math.isclose(float(amounts[key][0]), charge), (key, amounts[key], charge)
    assert processed_rows(url, SCHEMA) == (len(charges), len(hostile)), "library: effects, marks"
    assert processed_rows(url) == (len(charges), len(hostile)), "consume-ready: effects, marks"


def _produce(settings: Settings, topic: str, parts: list[tuple[int, bytes, bytes, str | None]]
             ) -> dict[tuple[int, int], tuple[str, bytes]]:
    """Produce ``parts`` and wait for each acknowledgement (60 s); returns (partition,
    offset) -> (field, raw value) of each message with a bad field."""
    from confluent_kafka import Producer

    from jobstream.kafka import producer_config
    producer = Producer(producer_config(settings))
    got: dict[tuple[int, int], tuple[str, bytes]] = {}
    errors: list[object] = []

    def acked(field: str | None, value: bytes) -> Any:
        def cb(err: object, msg: Any) -> None:
            if err:
                errors.append(err)
            elif field is not None:
                raw = value.split(b'"%s":' % field.encode(), 1)[1][:20]
                got[msg.partition(), msg.offset()] = (field, raw)
        return cb
    for partition, key, value, field in parts:
        producer.produce(topic, value=value, key=key, partition=partition,
                         on_delivery=acked(field, value))
        producer.poll(0)
    assert producer.flush(60) == 0 and not errors, errors
    return got
