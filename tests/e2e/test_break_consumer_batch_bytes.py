"""The consumer's byte cap on a batch (``consumer_batch_max_bytes``) from outside: real
``consume-ready`` processes, real big messages on three partitions: SIGKILLed inside a big
batch's transaction and between a commit and its offsets, then restarted; and SIGSTOPped
holding messages fetched past the cap while a second member takes over, then resumed.

Each event must be applied exactly once and whole (its blob's length), each charge once; no
transaction of more than one event may hold more bytes than the cap (each applied row's
``xmin`` is its transaction); a message over the cap (valid or poison, up to the topic's
limit) is applied or dead-lettered alone and holds nothing back; the bad positions are
dead-lettered (at least once: a SIGKILL between the DLQ's acknowledgement and the marker's
commit may send one again), nothing goes to the ``dead_letter`` table, and the group ends at
lag 0.
"""

from __future__ import annotations

import collections
import os
import signal
import time
from typing import Any

import pytest

from jobstream.kafka import group_lag
from jobstream.settings import Settings
from schemas.events import JobReady, encode_event
from tests.helpers import (
    ProcessRunner,
    job_ready,
    processed_rows,
    query,
    read_topic,
    stopped,
    wait_for,
)

pytestmark = pytest.mark.e2e

CAP_BYTES = 1_000_000
PARTITIONS = 3


def _ready(name: str, blob_chars: int) -> JobReady:
    """A ``job.ready`` of about ``blob_chars`` bytes (the result's ``fields``)."""
    return job_ready(name, charge_usd=0.01, blob_chars=blob_chars)


def _produce(settings: Settings, topic: str, parts: list[tuple[int, bytes, bytes]],
             bad: list[int]) -> set[tuple[int, int]]:
    """Produce ``(partition, key, value)`` to ``topic`` and wait for every acknowledgement
    (60 s); returns the ``(partition, offset)`` each index of ``bad`` got."""
    from confluent_kafka import Producer

    from jobstream.kafka import producer_config
    producer = Producer(producer_config(settings))
    got: set[tuple[int, int]] = set()
    errors: list[object] = []

    def acked(j: int) -> Any:
        def cb(err: object, msg: Any) -> None:
            if err:
                errors.append(err)
            elif j in bad:
                got.add((msg.partition(), msg.offset()))
        return cb
    for j, (partition, key, value) in enumerate(parts):
        producer.produce(topic, value=value, key=key, partition=partition,
                         on_delivery=acked(j))
        producer.poll(0)
    assert producer.flush(60) == 0 and not errors, errors
    assert len(got) == len(bad)
    return got


class Corpus:
    """The probe's messages on ``job.ready``, produced: per partition eight events (3 of
    ~300 kB fit under the cap, a 4th does not; the 5th is over the cap by itself, 1.5 MB;
    partition 0's last one nearly at the topic's limit, 7.5 of 8 MiB) and, after the third, a
    2 MB poison message (not JSON; on partition 1 a schema violation)."""

    def __init__(self, settings: Settings) -> None:
        self.settings, self.url = settings, settings.database_url
        self.topic = settings.topic("job.ready")
        self.blobs: dict[str, int] = {}  # event name -> its blob's length
        self.sizes: dict[str, int] = {}  # event name -> its message's key + value bytes
        parts: list[tuple[int, bytes, bytes]] = []
        bad: list[int] = []  # indexes into parts
        for p in range(PARTITIONS):
            for i in range(8):
                chars = 1_500_000 if i == 4 else 7_500_000 if (p, i) == (0, 7) else 300_000
                ev = _ready(f"p{p}-{i}", chars)
                key, value = str(ev.job_id).encode(), encode_event(ev)
                self.blobs[ev.payload.filename] = chars
                self.sizes[ev.payload.filename] = len(key) + len(value)
                parts.append((p, key, value))
                if i == 2:
                    bad.append(len(parts))
                    parts.append((p, b"k", b"\xff" * 2_000_000 if p != 1 else encode_event(
                        _ready(f"bad{p}", 2_000_000)).replace(b'"word_count":1',
                                                              b'"word_count":-1')))
        self.poison = _produce(settings, self.topic, parts, bad)

    def applied(self) -> int:
        """Rows of ``downstream.document_analysis``."""
        return int(query(self.url, "SELECT count(*) AS n FROM downstream.document_analysis"
                         )[0]["n"])

    def wait_done(self, procs: ProcessRunner, more: str = "") -> None:
        """Wait (90 s) until every event is applied and the ready applier's group has lag 0."""
        group = self.settings.group("downstream-ready-applier")

        def lag() -> int:
            return int(group_lag(self.settings, group, [self.topic]))
        wait_for(lambda: self.applied() == len(self.blobs) and lag() == 0, 90,
                 "every event applied and lag 0", lambda: f"applied {self.applied()} of "
                 f"{len(self.blobs)}, lag {lag()}\n{procs.logs()}", every_s=0.5)

    def check(self, max_copies: int) -> None:
        """Each event applied once and whole, each charge once, no transaction of several
        events over the cap, each message over the cap alone in its own; each poison
        position dead-lettered, at most ``max_copies`` times; nothing in ``dead_letter``."""
        blobs, sizes = self.blobs, self.sizes
        rows = query(self.url, "SELECT filename, xmin::text AS tx, length(fields->>'blob') AS "
                     "blob, (SELECT count(*) FROM downstream.ledger_charge c WHERE c.dedup_key "
                     "= a.dedup_key) AS charges FROM downstream.document_analysis a")
        assert sorted(r["filename"] for r in rows) == sorted(blobs), "not each event once"
        assert all(r["blob"] == blobs[r["filename"]] and r["charges"] == 1 for r in rows), \
            [r for r in rows if r["blob"] != blobs[r["filename"]] or r["charges"] != 1]
        by_tx: dict[str, list[str]] = collections.defaultdict(list)
        for r in rows:
            by_tx[r["tx"]].append(r["filename"])
        over = [names for names in by_tx.values()
                if len(names) > 1 and sum(sizes[n] for n in names) > CAP_BYTES]
        assert not over, f"transactions over the cap of {CAP_BYTES} bytes: {over}"
        for name, chars in blobs.items():
            if chars > CAP_BYTES:
                assert [name] in by_tx.values(), f"{name} (over the cap) shared a transaction"
        assert processed_rows(self.url)[0] == len(blobs)
        dlq: collections.Counter[tuple[int, int]] = collections.Counter()
        for m in read_topic(self.settings, self.topic + ".dlq"):
            h = dict(m.headers() or [])
            dlq[int(h["dlq_original_partition"]), int(h["dlq_original_offset"])] += 1
        assert set(dlq) == self.poison, (sorted(dlq), sorted(self.poison))
        assert max(dlq.values()) <= max_copies, dlq
        assert query(self.url, "SELECT count(*) AS n FROM dead_letter")[0]["n"] == 0


ENV = {"JOBSTREAM_CONSUMER_BATCH_MAX_BYTES": str(CAP_BYTES),
       "JOBSTREAM_CONSUMER_TRANSACTION_IDLE_TIMEOUT_S": "3",
       "JOBSTREAM_CONSUMER_SESSION_TIMEOUT_MS": "6000"}


def test_big_batches_killed_mid_transaction_apply_each_event_once_under_the_cap(
        settings: Settings, procs: ProcessRunner) -> None:
    """SIGKILLed inside its 2nd batch's transaction, then between its 3rd commit and its
    offsets; restarted. A SIGKILL between a dead letter's acknowledgement and its marker's
    commit may send that one again: at most two copies."""
    corpus = Corpus(settings)
    for n, fault in enumerate(("consumer_inside_transaction@2",
                               "consumer_after_apply_before_offset@3")):
        proc = procs.start("consume-ready", name=f"killed{n}", JOBSTREAM_FAULT=fault, **ENV)
        wait_for(lambda p=proc: p.popen.poll() is not None, 60, f"the SIGKILL at {fault}",
                 procs.logs)
        assert proc.popen.returncode == -9, proc.log_text()[-3000:]
    assert corpus.applied() < len(corpus.blobs), "probe too small: all applied before the end"
    procs.start("consume-ready", name="last", **ENV)
    corpus.wait_done(procs)
    corpus.check(max_copies=2)


def test_a_member_paused_with_big_messages_fetched_past_the_cap_doubles_nothing(
        settings: Settings, procs: ProcessRunner) -> None:
    """A ``consume-ready`` SIGSTOPped inside its 3rd batch's transaction, holding messages
    fetched past the cap (the start of its next batch) and a batch fetched ahead; a second
    member takes the partitions over and applies everything; the first is resumed and works
    through what it held (its partitions revoked). Nothing applied, charged or dead-lettered
    twice (no SIGKILL: one DLQ record per poison position), nothing lost."""
    corpus = Corpus(settings)
    paused = procs.start("consume-ready", name="paused", **ENV,
                         JOBSTREAM_FAULT="consumer_inside_transaction@3=stop")
    wait_for(lambda: "SIGSTOP" in paused.log_text(), 60, "the first member to freeze",
             procs.logs)
    try:
        procs.start("consume-ready", name="next", **ENV)
        corpus.wait_done(procs)
        assert stopped(paused.popen.pid), "resumed early: inconclusive"
    finally:
        os.kill(paused.popen.pid, signal.SIGCONT)
    wait_for(lambda: "is no longer assigned" in paused.log_text(), 30,
             "the resumed member to work through its stale batch", procs.logs)
    time.sleep(2)  # and whatever else it held
    assert paused.popen.poll() is None, paused.log_text()[-3000:]
    corpus.wait_done(procs)
    corpus.check(max_copies=1)
