"""The Debezium relay's pieces that need no services: names, the rendered connector config
(the header columns match what the Python relay sends), the slot metrics."""

from __future__ import annotations

import json
import uuid

import pytest

from jobstream.connect import TEMPLATE, names, render_config, slot_findings
from jobstream.metrics import postgres_families
from jobstream.settings import Settings
from jobstream.store import outbox_message
from schemas.events import TextExtracted, TextExtractedPayload
from tests.unit.test_metrics import SNAP, _samples

URL = "postgresql://jobstream:s3cret@db.example:5433/jobstream_t_ab12"


def test_names_derive_from_the_database_so_two_databases_never_share_a_slot() -> None:
    n = names(Settings(database_url=URL))
    assert n.slot == "jobstream_jobstream_t_ab12"
    assert n.connector == "jobstream-outbox-jobstream_t_ab12"
    assert n.publication == "jobstream_outbox"
    other = names(Settings(database_url=URL.replace("ab12", "cd34")))
    assert other.slot != n.slot and other.connector != n.connector
    s = Settings(database_url=URL, replication_slot="mine", connect_connector_name="c1")
    assert (names(s).slot, names(s).connector) == ("mine", "c1")


def test_config_is_rendered_from_the_settings_with_no_placeholder_left() -> None:
    cfg = render_config(Settings(database_url=URL))
    assert cfg["database.hostname"] == "db.example" and cfg["database.port"] == "5433"
    assert cfg["database.password"] == "s3cret"
    assert cfg["database.dbname"] == "jobstream_t_ab12"
    assert cfg["slot.name"] == "jobstream_jobstream_t_ab12"
    assert cfg["transforms.outbox.route.topic.replacement"] == "${routedByValue}"
    assert not any("{{" in v for v in cfg.values())
    assert not any(k.startswith("_") for k in cfg)
    assert cfg["value.converter"].endswith("ByteArrayConverter")
    assert cfg["key.converter"].endswith("StringConverter")
    assert cfg["header.converter"].endswith("StringConverter")
    assert cfg["table.include.list"] == "public.outbox"
    assert json.loads(TEMPLATE.read_text())["_comment"]
    # The heartbeat is an outbox row of our own topic: delivered, so the slot advances.
    s = Settings(database_url=URL, topic_prefix="p1.", connect_heartbeat_s=2.5)
    cfg = render_config(s)
    assert cfg["heartbeat.interval.ms"] == "2500"
    assert "INSERT INTO outbox" in cfg["heartbeat.action.query"]
    assert "'p1.relay.heartbeat'" in cfg["heartbeat.action.query"]
    with pytest.raises(ValueError):
        render_config(Settings(database_url=URL, topic_prefix="x'; DROP TABLE outbox; --"))


def test_header_columns_are_exactly_the_python_relays_headers_in_its_order() -> None:
    """The router adds one header per listed column, in list order; the Python relay sends
    the outbox row's jsonb headers in jsonb's key order (shorter keys first, then bytewise)."""
    ev = TextExtracted(tenant_id="t", idempotency_key="k", job_id=uuid.uuid4(),
                       dedup_key="d" * 64,
                       payload=TextExtractedPayload(text_sha256="0" * 64, char_count=1,
                                                    page_count=0))
    keys = [*outbox_message("x", ev).headers, "traceparent"]
    jsonb_order = sorted(keys, key=lambda k: (len(k.encode()), k.encode()))
    placement = render_config(Settings(database_url=URL))[
        "transforms.outbox.table.fields.additional.placement"]
    aliases = [p.split(":")[2] for p in placement.split(",")]
    assert aliases == jsonb_order
    assert all(p.split(":")[1] == "header" for p in placement.split(","))


def test_slot_metrics_carry_retained_bytes_and_active_per_slot() -> None:
    snap = {**SNAP, "replication_slots": [
        {"slot": "a", "active": True, "wal_status": "reserved", "retained_bytes": 100,
         "unconfirmed_bytes": 50},
        {"slot": "b", "active": False, "wal_status": "extended", "retained_bytes": 9 << 30,
         "unconfirmed_bytes": 9 << 30}]}
    m = _samples(postgres_families(snap))
    assert m[("jobstream_replication_slot_retained_bytes", (("slot", "a"),))] == 100
    assert m[("jobstream_replication_slot_active", (("slot", "a"),))] == 1
    assert m[("jobstream_replication_slot_retained_bytes", (("slot", "b"),))] == 9 << 30
    assert m[("jobstream_replication_slot_active", (("slot", "b"),))] == 0


def _slot(active: bool, retained: int) -> dict:
    return {"slot": "s1", "active": active, "wal_status": "reserved",
            "retained_bytes": retained, "unconfirmed_bytes": retained}


def test_slot_check_flags_an_inactive_slot_and_one_over_the_threshold() -> None:
    s = Settings(database_url=URL, slot_retained_alert_bytes=1000)
    [ok] = slot_findings([_slot(True, 999)], s)
    assert ok.ok and ok.severity == "info"
    [lag] = slot_findings([_slot(True, 1001)], s)
    assert not lag.ok and lag.severity == "warning" and "1001" in lag.message
    [down] = slot_findings([_slot(False, 10)], s)
    assert not down.ok and down.severity == "critical" and "inactive" in down.message
    assert slot_findings([], s)[0].ok  # the Python relay: no slot is fine
    [missing] = slot_findings([], s.model_copy(update={"relay": "debezium"}))
    assert not missing.ok and missing.severity == "critical" and "connect deploy" in missing.message
