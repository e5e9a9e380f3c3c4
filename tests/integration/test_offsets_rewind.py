"""The stage workers' "seek back to the committed offsets" really rewinds, also where the group
committed nothing or 0 (real broker, a real aiokafka consumer as faust runs it).

faust drops records it fetched while its flow was stopped (a rebalance) and relies on this seek
to read them again. aiokafka's own ``seek_to_committed`` does not seek when the committed offset
is 0 or absent: the resumed worker of test_pause ``sigstop`` lost offsets 0 and 1 of its
``job.chunks_ready`` partition that way, and its job stayed ``running`` forever.
"""

from __future__ import annotations

import asyncio

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.structs import OffsetAndMetadata
from confluent_kafka import Producer

from jobstream.settings import Settings
from streams.offsets import rewind_to_committed

pytestmark = pytest.mark.integration


async def _read(c: AIOKafkaConsumer, tp: TopicPartition, n: int) -> list[int]:
    """The offsets of the next ``n`` records of ``tp`` (at most 20 s)."""
    got: list[int] = []
    async with asyncio.timeout(20):
        while len(got) < n:
            batch = await c.getmany(tp, timeout_ms=500)
            got += [r.offset for r in batch.get(tp, [])]
    return got


@pytest.mark.parametrize("committed", [None, 0, 1])
def test_rewind_to_committed_re_reads_from_the_committed_offset(
        settings: Settings, committed: int | None) -> None:
    topic = settings.topic("job.chunks_ready")
    producer = Producer({"bootstrap.servers": settings.kafka_bootstrap_servers})
    for i in range(2):
        producer.produce(topic, key=b"job", value=b"%d" % i, partition=0)
    assert producer.flush(20) == 0
    tp = TopicPartition(topic, 0)

    def consumer() -> AIOKafkaConsumer:
        return AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap_servers,
                                group_id=settings.group("rewind-test"),
                                enable_auto_commit=False, auto_offset_reset="earliest")

    async def scenario() -> None:
        if committed is not None:  # committed BEFORE the consumer under test is assigned: a
            c0 = consumer()        # commit after assign() races its first position lookup
            await c0.start()
            try:
                c0.assign([tp])
                await c0.commit({tp: OffsetAndMetadata(committed, "")})
            finally:
                await c0.stop()
        c = consumer()
        await c.start()
        try:
            c.assign([tp])
            assert await _read(c, tp, 2 - (committed or 0)) == [0, 1][committed or 0:]
            # ... fetched, then dropped (as faust does at a rebalance): read them again.
            assert await rewind_to_committed(c) == {tp: committed}
            assert await c.position(tp) == (committed or 0)
            assert await _read(c, tp, 2 - (committed or 0)) == [0, 1][committed or 0:]
        finally:
            await c.stop()

    asyncio.run(scenario())
