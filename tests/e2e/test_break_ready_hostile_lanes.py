"""consumer6's ready applier (jobstream/ready_applier.py: each batch's rows as ONE binary
array of composites per effect table, ``INSERT ... SELECT FROM unnest``, migration 0035) with
apply lanes (consumers/idempotent.py), from outside: a backlog of 420 ``job.ready`` on three
partitions with copies (the same message again, and on another partition) and hostile values
that stress the binary encoding -- non-BMP text at the schema's length limits, a 1 MB keyword,
integers in ``fields`` beyond 64 bits (orjson refuses them), charges at and past
``numeric(14, 8)``'s limits, infinity, 5e-324, half-way roundings, lone surrogates (escaped in
the JSON) in a keyword and in a field -- while the real ``consume-ready`` is killed (kill -9)
three times mid-lanes, then restarted.

Each event must be applied exactly once with exactly its values (what the per-event path,
:func:`jobstream.ready_applier.apply_ready`, would write) or, when Postgres or the encoder
refuses it, dead-lettered with a reason; the consumer never crashes on one, no partition is
blocked (every offset committed).
"""

from __future__ import annotations

import json
from decimal import ROUND_HALF_UP, Decimal
from typing import Any

import pytest

from jobstream.kafka import group_lag
from jobstream.settings import Settings
from schemas.events import encode_event
from tests.helpers import ProcessRunner, job_ready, produce_at, query, read_topic, wait_for

pytestmark = pytest.mark.e2e

EMOJI = "\U0001F600"



def _raw(name: str, charge: Any = 0.5, **result: Any) -> tuple[str, bytes]:
    """A ``job.ready`` as JSON bytes (dedup key, value) with ``result`` fields and the charge
    replaced in the JSON itself (so a lone surrogate travels escaped, and ``Infinity`` as the
    token Python's json writes)."""
    ev = job_ready(name)
    d = json.loads(encode_event(ev))
    d["payload"]["charge_usd"] = charge
    d["payload"]["result"].update(result)
    return ev.dedup_key, json.dumps(d).encode()


#: name -> (result overrides, charge, dead-lettered?)
HOSTILE: dict[str, tuple[dict[str, Any], Any, bool]] = {
    "nonbmp-limits": ({"title": EMOJI * 300, "summary": EMOJI * 4000,
                       "keywords": [EMOJI * 50] * 20}, 0.5, False),
    "nonbmp-filename": ({}, 0.5, False),  # filename set below (512 non-BMP characters)
    "huge-keyword": ({"keywords": ["k" * 1_000_000]}, 0.5, False),
    "bigint-fields": ({"fields": {"big": 10**400, "neg": -2**64, "u64": 2**64 - 1,
                                  "i64": -2**63, "": "", "l": [EMOJI, "é"]}}, 0.5, False),
    "charge-max": ({}, 999999.99999999, False),
    "charge-half": ({}, 0.123456785, False),
    "charge-tiny": ({}, 5e-324, False),
    "charge-1e22": ({}, 1e22, True),
    "charge-1e6": ({}, 1e6, True),
    "charge-1e308": ({}, 1e308, True),
    "charge-inf": ({}, float("inf"), True),
    "surrogate-keyword": ({"keywords": ["a\ud800b"]}, 0.5, True),
    "surrogate-field": ({"fields": {"k": "\udfff"}}, 0.5, True),
    "zero": ({}, -0.0, False),
}


def test_hostile_ready_values_in_lanes_under_kill9_are_applied_once_or_dead_lettered(
        settings: Settings, procs: ProcessRunner) -> None:
    topic, url = settings.topic("job.ready"), settings.database_url
    valid = [job_ready(f"ok{i}", charge_usd=0.25) for i in range(400)]
    parts = [(i % 3, str(e.job_id).encode(), encode_event(e)) for i, e in enumerate(valid)]
    parts += [((i + 1) % 3, str(e.job_id).encode(), encode_event(e))
              for i, e in enumerate(valid) if i % 5 == 0]  # copies on another partition
    hostile: dict[str, tuple[str, bytes]] = {}
    for name, (result, charge, _) in HOSTILE.items():
        key, value = _raw(name, charge, **result)
        if name == "nonbmp-filename":
            d = json.loads(value)
            d["payload"]["filename"] = EMOJI * 512
            value = json.dumps(d).encode()
        hostile[name] = (key, value)
    for j, (name, (_, value)) in enumerate(hostile.items()):
        at = 37 + j * 25  # spread among the valid ones, each sent twice
        parts.insert(at, (j % 3, name.encode(), value))
        parts.insert(at + 90, (j % 3, name.encode(), value))
    produce_at(settings, topic, parts)
    env = {"JOBSTREAM_CONSUMER_APPLY_LANES": "2", "JOBSTREAM_CONSUMER_BATCH_SIZE": "400",
           "JOBSTREAM_CONSUMER_APPLY_LANES_MIN_BATCH": "2"}

    def done() -> int:
        return int(query(url, "SELECT count(*) AS n FROM processed_event")[0]["n"])

    at_kill = []
    for step in (60, 180, 300):
        consumer = procs.start("consume-ready", **env)
        wait_for(lambda step=step: done() >= step, 90, f"{step} events recorded", procs.logs,
                 every_s=0.02)
        procs.kill9(consumer)
        at_kill.append(done())
    consumer = procs.start("consume-ready", **env)
    group = settings.group("downstream-ready-applier")
    wait_for(lambda: group_lag(settings, group, [topic]) == 0, 120,
             "every offset committed (no partition blocked)", procs.logs, every_s=0.5)
    rows = query(url, "SELECT a.dedup_key, a.filename, a.title, a.summary, a.keywords, "
                      "a.fields, (SELECT array_agg(c.amount_usd) FROM downstream.ledger_charge c "
                      "WHERE c.dedup_key = a.dedup_key) AS charges, "
                      "(SELECT count(*) FROM downstream.document_analysis b "
                      "WHERE b.dedup_key = a.dedup_key) AS n FROM downstream.document_analysis a")
    got = {r["dedup_key"]: r for r in rows}
    assert all(r["n"] == 1 and len(r["charges"]) == 1 for r in rows), \
        [r["dedup_key"] for r in rows if r["n"] != 1 or len(r["charges"]) != 1]
    for e in valid:
        assert got[e.dedup_key]["charges"] == [Decimal("0.25")]
    dlq: dict[str, set[str]] = {}
    for m in read_topic(settings, topic + ".dlq"):
        headers = {k: (v or b"").decode(errors="replace") for k, v in m.headers() or []}
        reason = " ".join(v for k, v in headers.items() if "reason" in k or "code" in k)
        dlq.setdefault(m.key().decode(), set()).add(reason)
    expect_dead = {n for n, (_, _, dead) in HOSTILE.items() if dead}
    assert set(dlq) == expect_dead, (dlq, procs.logs())
    assert all(r.strip() for rs in dlq.values() for r in rs), dlq
    for name, (result, charge, dead) in HOSTILE.items():
        key = hostile[name][0]
        if dead:
            assert key not in got, name
            continue
        row = got.get(key)
        assert row is not None, (name, procs.logs())
        for field in ("title", "summary", "keywords", "fields"):
            if field in result:
                assert row[field] == result[field], (name, field)
        if name == "nonbmp-filename":
            assert row["filename"] == EMOJI * 512
        want = Decimal(repr(charge)).quantize(Decimal("1e-8"), rounding=ROUND_HALF_UP)
        assert row["charges"] == [want], (name, row["charges"], want)
    assert len(got) == len(valid) + len(HOSTILE) - len(expect_dead)
    assert at_kill[-1] < len(got), ("drained before the kills: probe too small", at_kill)
    print("DLQ reasons:", dlq, "recorded at each kill:", at_kill)
    assert consumer.popen.poll() is None and "Traceback" not in consumer.log_text(), \
        procs.logs()
