"""A dead letter is never lost (issue 9): when ``<topic>.dlq`` refuses a poison message (here
the broker: the DLQ topic's ``max.message.bytes`` is smaller than the message), the consumer
keeps it in the Postgres ``dead_letter`` table with a reference record on the DLQ, stores the
offset only after that, and moves on; ``jobstream dlq list`` shows it and ``jobstream dlq
replay`` re-produces the original bytes from the table once. Real ``consume-ready`` process,
Kafka and Postgres."""

from __future__ import annotations

import json
import os

import pytest
from confluent_kafka.admin import AdminClient, ConfigResource

from jobstream.kafka import base_config, group_lag
from jobstream.producer import produce_raw
from jobstream.settings import Settings
from schemas.events import encode_event
from tests.helpers import ProcessRunner, query, read_topic, set_topic_config, wait_for
from tests.integration.test_hostile_ready import _applied, _ready

pytestmark = pytest.mark.integration


def test_a_dead_letter_the_dlq_refuses_is_kept_in_postgres_and_replayable(
        settings: Settings, procs: ProcessRunner) -> None:
    dlq = settings.topic("job.ready.dlq")
    set_topic_config(settings, dlq, "max.message.bytes", "2000")
    poison = b'{"junk": "' + os.urandom(6000).hex().encode() + b'"}'  # 12 KB, incompressible
    good = _ready("acme", "after-the-poison")
    ready = settings.topic("job.ready")
    produce_raw(settings, ready, [(b"same-key", poison), (b"same-key", encode_event(good))])
    consumer = procs.start("consume-ready", JOBSTREAM_DLQ_PRODUCE_TIMEOUT_S="5")
    wait_for(lambda: _applied(settings, "acme") == {"after-the-poison": 1}, 60,
             "the message behind the poison applied", procs.logs)
    group = settings.group("downstream-ready-applier")
    wait_for(lambda: group_lag(settings, group, [ready]) == 0, 30, "lag 0", procs.logs)

    rows = query(settings.database_url,
                 "SELECT id, topic, kafka_partition, kafka_offset, value, reason_code, "
                 "dlq_error FROM dead_letter")
    assert len(rows) == 1, rows
    row = rows[0]
    assert (row["topic"], row["kafka_offset"], bytes(row["value"])) == (ready, 0, poison)
    assert row["reason_code"] == "schema_violation"
    assert "MSG_SIZE_TOO_LARGE" in row["dlq_error"], row["dlq_error"]
    refs = read_topic(settings, dlq)
    assert [(m.value(), dict(m.headers())["dlq_stored"]) for m in refs] == [
        (None, f"dead_letter:{row['id']}".encode())]

    listed = json.loads(procs.run("dlq", "list", "--json").stdout)
    assert [(r["source"], r["ref"], r["dlq_reason_code"]) for r in listed] == [
        ("table", f"dead_letter:{row['id']}", "schema_violation")]

    assert consumer.popen.poll() is None, consumer.log_text()[-3000:]
    # Stop the consumer: a replayed poison message would only be dead-lettered again.
    consumer.popen.terminate()
    consumer.popen.wait(30)
    replay = procs.run("dlq", "replay", "--topic", "job.ready", "--json")
    assert replay.returncode == 0, replay.stderr
    report = json.loads(replay.stdout)
    assert [it["ref"] for it in report["replayed"]] == [f"dead_letter:{row['id']}"]
    assert report["references"] == 1
    again = json.loads(procs.run("dlq", "replay", "--topic", "job.ready", "--json").stdout)
    assert again["replayed"] == [] and again["already_replayed"] == 1
    copies = [m for m in read_topic(settings, ready) if m.value() == poison]
    assert len(copies) == 2  # the original and the one replayed copy
    assert dict(copies[1].headers())["dlq_replayed_from"] == f"dead_letter:{row['id']}".encode()


def test_topics_are_created_with_sizes_that_agree(settings: Settings) -> None:
    """``jobstream topics`` (the settings fixture ran it): pipeline and .retry topics take
    ``kafka_message_max_bytes``, every .dlq topic that plus ``dlq_headroom_bytes``."""
    admin = AdminClient(base_config(settings))
    names = [settings.topic(t) for t in ("document.uploaded", "document.uploaded.retry",
                                         "job.ready", "document.uploaded.dlq", "job.ready.dlq")]
    got = {}
    for res, fut in admin.describe_configs(
            [ConfigResource(ConfigResource.Type.TOPIC, n) for n in names]).items():
        got[res.name] = int(fut.result(30)["max.message.bytes"].value)
    limit = settings.kafka_message_max_bytes
    assert got == {n: limit + (settings.dlq_headroom_bytes if n.endswith(".dlq") else 0)
                   for n in names}
