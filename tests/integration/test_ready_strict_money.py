"""Money fields are strict on every decoding path: a ``job.ready`` whose ``charge_usd`` is
``true``, the string ``"1.5"`` or ``1e400`` (beyond a double: infinity) is dead-lettered with
its reason by the ready applier (real Kafka + Postgres, decode-ahead and batch path), never
charged as 1.0, 1.5 or infinity; its neighbours are applied once."""

from __future__ import annotations

import uuid

import pytest

from jobstream.errors import PoisonMessage
from jobstream.producer import produce_raw
from jobstream.ready_applier import build
from jobstream.settings import Settings
from schemas.events import (
    DocumentAnalysis,
    JobReady,
    JobReadyPayload,
    decode_event,
    encode_event,
)
from tests.helpers import query, read_topic, run_until_handled

pytestmark = pytest.mark.integration

HOSTILE = {"true": b"true", "string": b'"1.5"', "overflow": b"1e400"}


def _ready(name: str) -> bytes:
    raw = encode_event(JobReady(
        tenant_id="acme", idempotency_key=name, job_id=uuid.uuid4(),
        dedup_key=uuid.uuid4().hex * 2,
        payload=JobReadyPayload(
            result=DocumentAnalysis(title=name, summary="s", keywords=["a"], word_count=1,
                                    chunk_count=1),
            document_sha256="a" * 64, filename=name, cost_usd=0.0, charge_usd=0.25)))
    assert raw.count(b'"charge_usd":0.25') == 1
    return raw


def _hostile(name: str, value: bytes) -> bytes:
    return _ready(name).replace(b'"charge_usd":0.25', b'"charge_usd":' + value)


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_decode_event_refuses_a_lax_charge(name: str) -> None:
    """The decoder every consumer uses (its fast path and its fallback) refuses them."""
    with pytest.raises(PoisonMessage) as exc:
        decode_event(_hostile(name, HOSTILE[name]), expected="job.ready")
    assert exc.value.code == "schema_violation"
    assert "charge_usd" in str(exc.value)


def test_lax_charges_are_dead_lettered_with_a_reason_by_the_ready_applier(
        settings: Settings) -> None:
    values = [_ready("ok0")]
    for name, value in sorted(HOSTILE.items()):
        values += [_hostile(name, value), _ready(f"ok-after-{name}")]
    produce_raw(settings, settings.topic("job.ready"), [(b"k", v) for v in values])
    consumer = build(settings)
    run_until_handled(consumer, len(values))
    assert (consumer.stats.applied, consumer.stats.dead_lettered) == (4, 3), consumer.stats
    charges = query(settings.database_url,
                    "SELECT amount_usd::text AS usd, count(*) AS n FROM downstream.ledger_charge "
                    "WHERE tenant_id = 'acme' GROUP BY 1")
    assert [(r["usd"], r["n"]) for r in charges] == [("0.25000000", 4)]
    dlq = read_topic(settings, settings.topic("job.ready.dlq"))
    by_value = {m.value(): dict(m.headers() or []) for m in dlq}
    assert len(dlq) == len(by_value) == 3
    for name, value in HOSTILE.items():
        got = [h for v, h in by_value.items() if b'"charge_usd":' + value in v]
        assert len(got) == 1, (name, by_value)
        assert got[0]["dlq_reason_code"] == b"schema_violation", (name, got[0])
        assert b"charge_usd" in got[0]["dlq_reason"], (name, got[0])
