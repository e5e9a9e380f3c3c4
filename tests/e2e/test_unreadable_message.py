"""A message the Kafka client fetches but cannot hand over (adv15): a zstd "bomb" on
``job.ready``, ~3 KB on the wire that unpacks to 101 MiB, past librdkafka's
``receive.message.max.bytes`` (100 MB). The client reports ``_BAD_COMPRESSION`` for its
position and fetches the same offset again and again, so ``consume-ready`` logged a warning
every 0.5 s and never applied anything behind it on that partition, with no dead letter.
Now it is dead-lettered ``unreadable_message`` and the consumer seeks past it: the good
``job.ready`` after it, same key (so the same partition), is applied exactly once."""
from __future__ import annotations

import json
from typing import Any

import pytest
from confluent_kafka import Producer

from jobstream.kafka import base_config
from jobstream.settings import Settings
from schemas.events import encode_event
from tests.e2e.test_hostile_corpus import _listed, _ready
from tests.helpers import ProcessRunner, query, wait_for

pytestmark = pytest.mark.e2e


def test_a_decompression_bomb_is_dead_lettered_and_its_partition_moves_on(
        settings: Settings, procs: ProcessRunner) -> None:
    consumer = procs.start("consume-ready")
    topic = settings.topic("job.ready")
    p = Producer({**base_config(settings), "message.max.bytes": 1_000_000_000,
                  "compression.type": "zstd", "linger.ms": 0})
    delivered: list[Any] = []
    p.produce(topic, key=b"bomb", value=b"\0" * (101 * 1024 * 1024),
              on_delivery=lambda err, m: delivered.append((err, m.partition(), m.offset())))
    good = _ready("after-the-bomb", "bomb")
    p.produce(topic, key=b"bomb", value=encode_event(good),
              on_delivery=lambda err, m: delivered.append((err, m.partition(), m.offset())))
    assert p.flush(120) == 0
    assert [d[0] for d in delivered] == [None, None], delivered
    (_, part, bomb_offset), (_, part2, _) = delivered
    assert part == part2  # one key, one partition: the good one waits behind the bomb

    def applied() -> int:
        return int(query(settings.database_url,
                         "SELECT count(*) AS n FROM downstream.ledger_charge "
                         "WHERE dedup_key = %s", (good.dedup_key,))[0]["n"])

    wait_for(lambda: applied() >= 1, 120, "the job.ready behind the bomb applied", procs.logs,
             every_s=1.0)
    rows: list[dict[str, Any]] = []

    def listed() -> bool:
        nonlocal rows
        rows = [r for r in _listed(procs) if r.get("dlq_reason_code") == "unreadable_message"]
        return bool(rows)

    wait_for(listed, 60, "the bomb dead-lettered as unreadable_message", procs.logs,
             every_s=2.0)
    assert len(rows) == 1, rows
    assert str(bomb_offset) in json.dumps(rows[0]), rows[0]
    assert applied() == 1
    assert consumer.popen.poll() is None, consumer.log_text()[-3000:]
