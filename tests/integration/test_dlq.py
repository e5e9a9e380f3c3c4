"""Dead-letter topics on real Kafka + Postgres with real processes: bulk poison among good
uploads, ``jobstream dlq list``, and ``jobstream dlq replay`` (once, filtered, locked)."""

from __future__ import annotations

import json
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient

from jobstream.db import QUERIES
from jobstream.dlq import REPLAY_GROUP, REPLAY_LOCK_CLASS, REPLAYED_FROM_HEADER
from jobstream.producer import produce_raw, uploaded_event
from jobstream.settings import Settings
from schemas.events import encode_event
from tests.helpers import ProcessRunner, query, read_topic, wait_for

pytestmark = pytest.mark.integration

_NOUNS = ("harbour", "lantern", "meadow", "copper", "orchard", "glacier", "ferry", "violin",
          "compass", "granary", "beacon", "quarry", "tannery", "aqueduct", "archive", "kettle",
          "saddle", "telescope", "vineyard", "foundry", "lighthouse", "market", "bridge",
          "weaver", "miller", "cartographer", "falconer", "chandler", "cooper", "potter")
_VERBS = ("repairs", "measures", "records", "carries", "inspects", "paints", "guards",
          "counts", "polishes", "describes")


def _paragraph(i: int, rng: random.Random) -> str:
    """A short, distinct English paragraph (several sentences of four words or more)."""
    sentences = [f"Paragraph {i} tells how the {rng.choice(_NOUNS)} of district {i} "
                 f"{rng.choice(_VERBS)} the old {rng.choice(_NOUNS)}."]
    for _ in range(rng.randint(3, 6)):
        sentences.append(f"Every {rng.choice(('morning', 'evening', 'winter', 'market day'))} "
                         f"the {rng.choice(_NOUNS)} {rng.choice(_VERBS)} {rng.randint(2, 99)} "
                         f"{rng.choice(_NOUNS)}s near the {rng.choice(_NOUNS)}.")
    return " ".join(sentences) + "\n"


def _malformed(settings: Settings, folder: Path,
               n: int) -> tuple[list[tuple[bytes, bytes]], Counter[str]]:
    """``n`` poison uploads, an equal mix of five kinds, each with distinct bytes; returns the
    messages and how many of each reason code the DLQ must show."""
    out: list[tuple[bytes, bytes]] = []
    codes: Counter[str] = Counter()
    for i in range(n):
        key = f"bad-{i:03d}"
        f = folder / f"{key}.txt"
        f.write_text(f"Bad upload number {i} should never become a job at all.\n")
        ev = json.loads(encode_event(uploaded_event(f, tenant_id="acme", idempotency_key=key,
                                                    settings=settings)))
        kind = i % 5
        if kind == 0:
            value, code = f"not json #{i} {{".encode(), "not_json"
        elif kind == 1:
            del ev["tenant_id"]
            value, code = json.dumps(ev).encode(), "schema_violation"
        elif kind == 2:
            ev["event_type"] = "job.ready"
            value, code = json.dumps(ev).encode(), "unexpected_event_type"
        elif kind == 3:
            ev["payload"]["document"]["sha256"] = f"{i:064x}"
            value, code = json.dumps(ev).encode(), "document_hash_mismatch"
        else:
            ev["payload"]["model_profile"] = f"no-such-model-{i}"
            value, code = json.dumps(ev).encode(), "unknown_model_profile"
        out.append((key.encode(), value))
        codes[code] += 1
    return out, codes


def _jobs(settings: Settings, tenant: str = "acme") -> list[dict[str, Any]]:
    return query(settings.database_url,
                 "SELECT job_id, status, idempotency_key, dedup_key FROM job "
                 "WHERE tenant_id = %s", (tenant,))


def _applied(settings: Settings, tenant: str = "acme") -> Counter[str]:
    rows = query(settings.database_url,
                 "SELECT dedup_key FROM downstream.document_analysis WHERE tenant_id = %s",
                 (tenant,))
    return Counter(r["dedup_key"] for r in rows)


def _charges(settings: Settings, tenant: str = "acme") -> Counter[str]:
    rows = query(settings.database_url,
                 "SELECT dedup_key FROM downstream.ledger_charge WHERE tenant_id = %s", (tenant,))
    return Counter(r["dedup_key"] for r in rows)


def _headers(msg: Any) -> dict[str, bytes]:
    return dict(msg.headers() or [])


def _committed(settings: Settings, topic: str) -> dict[int, int]:
    """Offsets committed by the replay group on ``topic`` (partitions with none left out)."""
    c = Consumer({"bootstrap.servers": settings.kafka_bootstrap_servers,
                  "group.id": settings.group(REPLAY_GROUP), "enable.auto.commit": False})
    try:
        parts = c.list_topics(topic, timeout=10).topics[topic].partitions
        got = c.committed([TopicPartition(topic, p) for p in parts], timeout=10)
        return {tp.partition: tp.offset for tp in got if tp.offset >= 0}
    finally:
        c.close()


def _replay(procs: ProcessRunner, *args: str) -> dict[str, Any]:
    r = procs.run("dlq", "replay", "--topic", "document.uploaded", "--json", *args)
    assert r.returncode == 0, f"rc={r.returncode}\n{r.stdout}\n{r.stderr}"
    return json.loads(r.stdout)


def test_hundred_malformed_uploads_among_hundred_good_ones_are_dead_lettered_and_listed(
        settings: Settings, procs: ProcessRunner, tmp_path: Path) -> None:
    rng = random.Random(1729)
    topic = settings.topic("document.uploaded")
    folder = tmp_path / "docs"
    folder.mkdir()
    good = []
    for i in range(100):
        f = folder / f"paragraph-{i:03d}.txt"
        f.write_text(_paragraph(i, rng))
        good.append(uploaded_event(f, tenant_id="acme", idempotency_key=f"good-{i:03d}",
                                   settings=settings))
    bad, expected = _malformed(settings, folder, 100)
    messages = [(e.idempotency_key.encode(), encode_event(e)) for e in good] + bad
    rng.shuffle(messages)
    procs.pipeline()
    produce_raw(settings, topic, messages)

    def all_applied() -> bool:
        jobs = _jobs(settings)
        return (len(jobs) == 100 and all(j["status"] == "succeeded" for j in jobs)
                and len(_applied(settings)) == 100)
    wait_for(all_applied, 100, "100 jobs succeeded and applied", procs.logs, every_s=1.0)
    wait_for(lambda: len(read_topic(settings, topic + ".dlq")) >= 100, 30,
             "100 messages on the DLQ", procs.logs)
    time.sleep(2)  # anything extra (a good upload dead-lettered, a redelivery) shows up now
    dlq = read_topic(settings, topic + ".dlq")
    assert len(dlq) == 100
    assert Counter(_headers(m)["dlq_reason_code"].decode() for m in dlq) == expected
    sent = dict(bad)
    for m in dlq:
        h = _headers(m)
        assert h["dlq_reason"].strip(), "every dead letter says why"
        assert h["dlq_original_topic"].decode() == topic
        assert int(h["dlq_original_offset"]) >= 0 and int(h["dlq_original_partition"]) >= 0
        assert sent[m.key()] == m.value(), "original key and bytes are kept"
    jobs = _jobs(settings)
    assert sorted(j["idempotency_key"] for j in jobs) == sorted(e.idempotency_key for e in good)
    assert set(_applied(settings).values()) == {1}
    assert len(_charges(settings)) == 100 and set(_charges(settings).values()) == {1}

    # dlq list --json: every dead letter with its reason, the same positions as on the topic.
    r = procs.run("dlq", "list", "--topic", "document.uploaded", "--json", "--limit", "500")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert len(rows) == 100
    assert Counter(row["dlq_reason_code"] for row in rows) == expected
    assert all(row["dlq_reason"] for row in rows)
    assert ({(row["partition"], row["offset"]) for row in rows}
            == {(m.partition(), m.offset()) for m in dlq})
    by_pos = {(m.partition(), m.offset()): m for m in dlq}
    for row in rows:
        m = by_pos[(row["partition"], row["offset"])]
        assert row["key"] == m.key().decode()
        assert row["original_offset"] == int(_headers(m)["dlq_original_offset"])
        assert row["value_size"] == len(m.value())
        assert m.value().decode().startswith(row["value_head"])
    r = procs.run("dlq", "list", "--topic", "document.uploaded", "--json", "--limit", "7")
    assert len(json.loads(r.stdout)) == 7
    # The table over every DLQ topic.
    r = procs.run("dlq", "list", COLUMNS="250")
    assert r.returncode == 0, r.stderr
    assert "not_json" in r.stdout and "unknown_model_profile" in r.stdout
    # Listing joined no group and committed nothing.
    admin = AdminClient({"bootstrap.servers": settings.kafka_bootstrap_servers})
    groups = [g.group_id for g in admin.list_consumer_groups().result(timeout=10).valid]
    assert not [g for g in groups if g.startswith(settings.group("jobstream-dlq"))], groups


def test_replay_after_the_cause_is_fixed_runs_the_job_once_and_a_second_replay_does_nothing(
        settings: Settings, procs: ProcessRunner, tmp_path: Path) -> None:
    topic = settings.topic("document.uploaded")
    dlq_topic = topic + ".dlq"
    doc = tmp_path / "arrives-late.txt"
    doc.write_text(_paragraph(7, random.Random(7)))
    ev = uploaded_event(doc, tenant_id="acme", idempotency_key="late-1", settings=settings,
                        inline=False)
    content = doc.read_bytes()
    doc.unlink()  # the event points at a file that is not there yet
    raw = encode_event(ev)
    procs.pipeline(JOBSTREAM_DOCUMENT_ROOTS=json.dumps([str(tmp_path)]))
    produce_raw(settings, topic, [(b"late-1", raw)])
    [dead] = wait_for(lambda: read_topic(settings, dlq_topic), 60,
                      "the upload to be dead-lettered", procs.logs)
    h = _headers(dead)
    assert h["dlq_reason_code"] == b"document_unreadable"
    assert b"No such file" in h["dlq_reason"]
    assert _jobs(settings) == []

    doc.write_bytes(content)  # the cause is fixed
    report = _replay(procs)
    ref = f"{dlq_topic}:{dead.partition()}:{dead.offset()}"
    assert [it["ref"] for it in report["replayed"]] == [ref]
    assert report["failed"] == [] and report["skipped"] == 0
    assert report["committed"] == {str(dead.partition()): dead.offset() + 1}

    def applied() -> bool:
        jobs = _jobs(settings)
        return (len(jobs) == 1 and jobs[0]["status"] == "succeeded"
                and bool(_applied(settings)))
    wait_for(applied, 90, "the replayed upload to be processed and applied", procs.logs)
    uploads = read_topic(settings, topic)
    assert len(uploads) == 2
    copy = uploads[0] if REPLAYED_FROM_HEADER in _headers(uploads[0]) else uploads[1]
    assert _headers(copy)[REPLAYED_FROM_HEADER].decode() == ref
    assert copy.value() == raw and copy.key() == b"late-1", "original bytes and key"
    assert copy.partition() == int(h["dlq_original_partition"]), "original partition"
    assert report["replayed"][0]["replayed_offset"] == copy.offset()

    again = _replay(procs)
    assert again["replayed"] == [] and again["failed"] == [] and again["committed"] == {}
    time.sleep(2)
    assert len(read_topic(settings, topic)) == 2, "the second replay produced nothing"
    assert len(_jobs(settings)) == 1
    assert list(_applied(settings).values()) == [1]
    assert list(_charges(settings).values()) == [1]
    rows = query(settings.database_url, "SELECT dlq_partition, dlq_offset, reason_code, "
                 "replayed_offset FROM dlq_replay")
    assert rows == [{"dlq_partition": dead.partition(), "dlq_offset": dead.offset(),
                     "reason_code": "document_unreadable", "replayed_offset": copy.offset()}]


def test_messages_left_out_by_a_filter_stay_replayable_and_replays_do_not_overlap(
        settings: Settings, procs: ProcessRunner, tmp_path: Path) -> None:
    topic = settings.topic("document.uploaded")
    dlq_topic = topic + ".dlq"
    doc = tmp_path / "later.txt"
    doc.write_text(_paragraph(3, random.Random(3)))
    ev = uploaded_event(doc, tenant_id="acme", idempotency_key="later-1", settings=settings,
                        inline=False)
    content = doc.read_bytes()
    doc.unlink()
    procs.start("worker", "--stages", "intake",
                JOBSTREAM_DOCUMENT_ROOTS=json.dumps([str(tmp_path)]))
    # One key: both land on the same partition, the one to be skipped first.
    produce_raw(settings, topic, [(b"same", b"definitely not json")])
    produce_raw(settings, topic, [(b"same", encode_event(ev))])
    dead = wait_for(lambda: (m := read_topic(settings, dlq_topic)) and len(m) >= 2 and m, 60,
                    "two dead letters", procs.logs)
    junk, late = sorted(dead, key=lambda m: m.offset())
    assert junk.partition() == late.partition()
    assert _headers(junk)["dlq_reason_code"] == b"not_json"
    assert _headers(late)["dlq_reason_code"] == b"document_unreadable"
    doc.write_bytes(content)

    dry = _replay(procs, "--reason-code", "document_unreadable", "--dry-run")
    assert [it["ref"] for it in dry["replayed"]] == [f"{dlq_topic}:{late.partition()}:"
                                                     f"{late.offset()}"]
    assert dry["skipped"] == 1 and dry["committed"] == {}
    assert len(read_topic(settings, topic)) == 2, "a dry run produces nothing"
    assert query(settings.database_url, "SELECT * FROM dlq_replay") == []

    # A replay of the same DLQ topic already running: this one refuses, touching nothing.
    with psycopg.connect(settings.database_url, autocommit=True) as holder:
        holder.execute(QUERIES["dlq_replay_try_lock"], (REPLAY_LOCK_CLASS, dlq_topic))
        r = procs.run("dlq", "replay", "--topic", "document.uploaded")
        assert r.returncode == 1 and "replay_in_progress" in r.stderr, (r.stdout, r.stderr)
    assert len(read_topic(settings, topic)) == 2

    first = _replay(procs, "--reason-code", "document_unreadable")
    assert len(first["replayed"]) == 1 and first["skipped"] == 1
    assert first["committed"] == {}, "the group never moves past the skipped message"
    wait_for(lambda: len(_jobs(settings)) == 1, 60, "the replayed upload's job", procs.logs)
    second = _replay(procs, "--reason-code", "document_unreadable")
    assert second["replayed"] == [] and second["already_replayed"] == 1
    assert second["skipped"] == 1

    third = _replay(procs, "--reason-code", "not_json")
    assert [it["ref"] for it in third["replayed"]] == [f"{dlq_topic}:{junk.partition()}:"
                                                       f"{junk.offset()}"]
    assert third["already_replayed"] == 1
    assert third["committed"] == {str(late.partition()): late.offset() + 1}
    assert _committed(settings, dlq_topic) == {late.partition(): late.offset() + 1}
    # Replayed junk is still junk: intake dead-letters the copy again, a new DLQ entry.
    dead = wait_for(lambda: (m := read_topic(settings, dlq_topic)) and len(m) >= 3 and m, 60,
                    "the replayed junk dead-lettered again", procs.logs)
    uploads = read_topic(settings, topic)
    assert len(uploads) == 4
    copies = {_headers(m)[REPLAYED_FROM_HEADER].decode(): m for m in uploads
              if REPLAYED_FROM_HEADER in _headers(m)}
    junk_copy = copies[f"{dlq_topic}:{junk.partition()}:{junk.offset()}"]
    [again] = [m for m in dead if (m.partition(), m.offset())
               not in {(junk.partition(), junk.offset()), (late.partition(), late.offset())}]
    assert _headers(again)["dlq_reason_code"] == b"not_json"
    assert int(_headers(again)["dlq_original_partition"]) == junk_copy.partition()
    assert int(_headers(again)["dlq_original_offset"]) == junk_copy.offset()
    assert len(_jobs(settings)) == 1
    assert sorted(r["dlq_offset"] for r in query(
        settings.database_url, "SELECT dlq_offset FROM dlq_replay")) == sorted(
            [junk.offset(), late.offset()])
