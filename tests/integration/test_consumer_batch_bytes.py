"""The idempotent consumer's byte cap on a batch (``batch_max_bytes``), with real big messages
through the ready applier on real Kafka + Postgres: no transaction applies more bytes than the
cap (unless it holds a single message), a message bigger than the cap is applied alone, and
nothing is lost, doubled or held back behind it."""

from __future__ import annotations

import pytest

from jobstream.producer import produce_raw
from jobstream.ready_applier import build
from jobstream.settings import Settings
from schemas.events import JobReady, encode_event
from tests.helpers import job_ready, processed_rows, query, read_topic, run_until_handled

pytestmark = pytest.mark.integration

CAP_BYTES = 300_000


def _ready(name: str, blob_chars: int) -> JobReady:
    """A ``job.ready`` whose value is about ``blob_chars`` bytes (the result's ``fields``)."""
    return job_ready(name, charge_usd=0.01, blob_chars=blob_chars)


def test_batches_stay_under_the_byte_cap_and_a_bigger_message_is_applied_alone(
        settings: Settings) -> None:
    """21 messages on one partition (one key), ~1.6 MB in all, for a cap of 300 kB: ten of
    ~90 kB (three fit in a batch, not four), one of ~700 kB (over the cap) after the fifth,
    then ten small ones. Each applied effect row's ``xmin`` is its batch transaction: every
    transaction of more than one row holds at most the cap, the big one is alone in its own,
    and every event is applied exactly once (the big one whole), nothing dead-lettered."""
    events = [_ready(f"big{i}", 90_000) for i in range(10)]
    events.insert(5, _ready("huge", 700_000))
    events += [_ready(f"small{i}", 10) for i in range(10)]
    values = [encode_event(ev) for ev in events]
    key = b"k"
    size = {ev.payload.filename: len(v) + len(key) for ev, v in zip(events, values, strict=True)}
    assert size["huge"] > CAP_BYTES > 3 * size["big0"] and 4 * size["big0"] > CAP_BYTES
    produce_raw(settings, settings.topic("job.ready"), [(key, v) for v in values])

    consumer = build(settings.model_copy(update={"consumer_batch_max_bytes": CAP_BYTES}))
    assert consumer.settings.batch_max_bytes == CAP_BYTES
    run_until_handled(consumer, len(events))

    rows = query(settings.database_url,
                 "SELECT filename, xmin::text AS tx, length(fields->>'blob') AS blob "
                 "FROM downstream.document_analysis WHERE tenant_id = 'acme'")
    assert sorted(r["filename"] for r in rows) == sorted(size), "not each event exactly once"
    assert {r["filename"]: r["blob"] for r in rows}["huge"] == 700_000
    by_tx: dict[str, list[str]] = {}
    for r in rows:
        by_tx.setdefault(r["tx"], []).append(r["filename"])
    batches = sorted(by_tx.values(), key=lambda names: min(n for n in names))
    for names in batches:
        if len(names) > 1:
            assert sum(size[n] for n in names) <= CAP_BYTES, (names, batches)
    assert ["huge"] in batches, f"the message over the cap shared a transaction: {batches}"
    assert any(len(names) > 1 for names in batches), f"no batch was formed: {batches}"
    charges = query(settings.database_url,
                    "SELECT count(*) AS n FROM downstream.ledger_charge WHERE tenant_id = 'acme'")
    assert charges[0]["n"] == len(events)
    assert (consumer.stats.applied, consumer.stats.duplicates,
            consumer.stats.dead_lettered) == (len(events), 0, 0)
    assert processed_rows(settings.database_url) == (len(events), 0)
    assert read_topic(settings, settings.topic("job.ready.dlq"), timeout_s=2) == []
