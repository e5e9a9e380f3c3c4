"""Intake batches on real Postgres (issue 12): many intents in ONE transaction, each still
idempotent, and a row Postgres refuses in the middle costs only its own intent."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import psycopg
import pytest

from jobstream.errors import IdempotencyConflict, PoisonMessage
from jobstream.settings import Settings
from jobstream.store import IntakeResult, Store
from schemas.events import DocumentUploaded
from streams.context import StageContext
from streams.intake import IntakeBatcher, intake_intent
from tests.helpers import query
from tests.helpers import text_uploaded as _uploaded

pytestmark = pytest.mark.integration


def test_one_transaction_for_the_batch_and_a_refused_row_loses_only_itself(
        settings: Settings) -> None:
    ctx = StageContext(settings, Store(settings.database_url, max_size=2))
    try:
        good = [intake_intent(ctx, _uploaded(f"k{i}", f"document {i}")) for i in range(5)]
        # Postgres itself refuses these rows mid-batch, after the document row of each was
        # written in its savepoint: a CHECK violation (lane) and text with a NUL.
        bad_lane = intake_intent(ctx, _uploaded("bad-lane", "refused by a CHECK"))
        bad_lane = dataclasses.replace(bad_lane, job={**bad_lane.job, "lane": "bogus"})
        bad_nul = intake_intent(ctx, _uploaded("bad-nul", "refused: NUL"))
        bad_nul = dataclasses.replace(bad_nul, job={**bad_nul.job, "filename": "a\x00b"})
        again = intake_intent(ctx, _uploaded("k1", "document 1"))      # same key, same body
        reused = intake_intent(ctx, _uploaded("k9", "document 2"))     # other key, same doc
        conflict = intake_intent(ctx, _uploaded("k3", "another body"))  # key reused
        batch = [good[0], good[1], bad_lane, good[2], again, bad_nul, reused, good[3],
                 conflict, good[4]]

        out = ctx.store.intake_batch(batch)

        assert len(out) == len(batch)
        created = [r for r in out if isinstance(r, IntakeResult) and r.created]
        assert len(created) == 5
        assert isinstance(out[2], psycopg.errors.CheckViolation), out[2]
        assert isinstance(out[5], PoisonMessage) and out[5].code == "invalid_data", out[5]
        assert isinstance(out[8], IdempotencyConflict), out[8]
        assert isinstance(out[4], IntakeResult) and isinstance(out[1], IntakeResult)
        assert out[4].job_id == out[1].job_id and out[4].dedup == "replayed"
        assert isinstance(out[6], IntakeResult) and isinstance(out[3], IntakeResult)
        assert out[6].job_id == out[3].job_id and out[6].dedup == "reused"

        url = settings.database_url
        jobs = query(url, "SELECT idempotency_key, created_at FROM job")
        assert sorted(j["idempotency_key"] for j in jobs) == [f"k{i}" for i in range(5)]
        # ONE transaction: every job has the same transaction timestamp.
        assert len({j["created_at"] for j in jobs}) == 1
        # Each job with its checkpoint and its job.accepted outbox row; nothing of the refused
        # rows (their documents rolled back with their savepoints).
        assert query(url, "SELECT count(*) AS n FROM job_stage WHERE stage = 'intake'"
                     )[0]["n"] == 5
        assert query(url, "SELECT count(*) AS n FROM outbox WHERE event_type = 'job.accepted'"
                     )[0]["n"] == 5
        assert query(url, "SELECT count(*) AS n FROM document")[0]["n"] == 5
        assert sorted(r["idempotency_key"] for r in query(
            url, "SELECT idempotency_key FROM job_request")) == sorted(
            [f"k{i}" for i in range(5)] + ["k9"])

        # The whole batch again (a redelivery after a crash before the offset commit): no new
        # job, no new outbox row, the same answers.
        out2 = ctx.store.intake_batch(batch)
        assert [r.job_id for r in out2 if isinstance(r, IntakeResult)] == [
            r.job_id for r in out if isinstance(r, IntakeResult)]
        assert not any(r.created for r in out2 if isinstance(r, IntakeResult))
        assert query(url, "SELECT count(*) AS n FROM outbox WHERE event_type = 'job.accepted'"
                     )[0]["n"] == 5
    finally:
        ctx.store.close()


def test_new_intents_in_one_statement_per_table_and_the_rest_one_by_one(
        settings: Settings) -> None:
    """No refused row: the plainly new intents take the set-based path, the replays, reuses
    and conflicts of the same batch the one-intent path after them, in one transaction."""
    ctx = StageContext(settings, Store(settings.database_url, max_size=2))
    try:
        first = ctx.store.intake_batch([intake_intent(ctx, _uploaded("old", "known before"))])
        assert isinstance(first[0], IntakeResult) and first[0].created
        batch = [intake_intent(ctx, _uploaded(k, t)) for k, t in [
            ("a", "doc a"), ("b", "doc b"), ("a", "doc a"), ("b2", "doc b"),
            ("old", "known before"), ("a", "a's key, another body"), ("c", "doc c"),
            ("old2", "known before")]]
        out = ctx.store.intake_batch(batch)
        res = [r if isinstance(r, IntakeResult) else type(r).__name__ for r in out]
        a, b, a2, b2, old, conflict, c, old2 = res
        assert isinstance(a, IntakeResult) and a.dedup == "new"
        assert isinstance(b, IntakeResult) and b.dedup == "new"
        assert isinstance(c, IntakeResult) and c.dedup == "new"
        assert isinstance(a2, IntakeResult) and (a2.job_id, a2.dedup) == (a.job_id, "replayed")
        assert isinstance(b2, IntakeResult) and (b2.job_id, b2.dedup) == (b.job_id, "reused")
        assert isinstance(old, IntakeResult) and old.job_id == first[0].job_id
        assert isinstance(old2, IntakeResult) and (old2.job_id, old2.dedup) == (
            first[0].job_id, "reused")
        assert conflict == "IdempotencyConflict"
        url = settings.database_url
        new_jobs = query(url, "SELECT created_at FROM job WHERE idempotency_key <> 'old'")
        assert len(new_jobs) == 3 and len({j["created_at"] for j in new_jobs}) == 1
        rows = query(url, "SELECT o.kafka_key, o.headers, s.emitted FROM outbox o JOIN job_stage"
                          " s ON s.job_id::text = o.kafka_key AND s.stage = 'intake'"
                          " WHERE o.event_type = 'job.accepted'")
        assert len(rows) == 4
        assert all(r["headers"]["traceparent"] and r["headers"]["job_id"] == r["kafka_key"]
                   and r["emitted"]["document_sha256"] for r in rows), rows
    finally:
        ctx.store.close()


def test_intake_batch_of_settings_defaults() -> None:
    s = Settings()
    assert s.intake_batch_max >= 1 and s.intake_batch_wait_s >= 0
    assert s.intake_batch_max_bytes >= s.max_inline_document_bytes


def test_the_batcher_cuts_batches_by_count_and_bytes_and_answers_each_event(
        settings: Settings) -> None:
    """IntakeBatcher (the intake agent's handler) on real Postgres: concurrent events share a
    transaction up to max_n events or max_bytes; a hostile event fails its own caller only."""
    ctx = StageContext(settings, Store(settings.database_url, max_size=2))

    async def burst(batcher: IntakeBatcher, events: list[DocumentUploaded]) -> list[Any]:
        return await asyncio.gather(*(batcher.handle(ctx, ev) for ev in events),
                                    return_exceptions=True)

    try:
        events = [_uploaded(f"n{i}", f"count doc {i}") for i in range(5)]
        events.insert(2, _uploaded("bad-hash", "hash mismatch", sha256="0" * 64))
        got = asyncio.run(burst(IntakeBatcher(ctx, max_n=2, wait_s=0.05, max_bytes=10**9),
                                events))
        assert isinstance(got[2], PoisonMessage) and got[2].code == "document_hash_mismatch"
        assert all(isinstance(r, IntakeResult) and r.created for i, r in enumerate(got)
                   if i != 2), got
        rows = query(settings.database_url,
                     "SELECT created_at FROM job WHERE left(idempotency_key, 1) = 'n'")
        assert len(rows) == 5 and len({r["created_at"] for r in rows}) == 3  # n0 n1, bad n2, n3 n4

        sized = [_uploaded(f"s{i}", f"bytes doc {i}") for i in range(3)]
        got = asyncio.run(burst(IntakeBatcher(ctx, max_n=100, wait_s=0.05, max_bytes=1),
                                sized))
        assert all(isinstance(r, IntakeResult) and r.created for r in got), got
        rows = query(settings.database_url,
                     "SELECT created_at FROM job WHERE left(idempotency_key, 1) = 's'")
        assert len({r["created_at"] for r in rows}) == 3  # one document per batch
    finally:
        ctx.store.close()


def test_a_lone_intent_is_its_own_transaction_with_the_batch_outcomes(
        settings: Settings, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch of ONE intent (an idle pipeline's document) runs in a transaction of its own,
    without the batch's savepoint (two round trips fewer on the idle job's critical path:
    bench/README.md, idle12), and gives what the batch path gives: new, replayed, reused, an
    idempotency conflict, invalid data and a row Postgres refuses; its transaction has the
    idle limit and passes the fault point before its commit."""
    savepoints: list[str] = []
    limits: list[str] = []
    hits: list[str] = []
    transaction = psycopg.Connection.transaction

    def spy_transaction(conn: psycopg.Connection[Any], *a: Any, **kw: Any) -> Any:
        if conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS:
            savepoints.append("savepoint")
        return transaction(conn, *a, **kw)

    add_outbox = Store.add_outbox

    def spy_add_outbox(conn: Any, msg: Any) -> None:
        limits.append(conn.execute("SHOW idle_in_transaction_session_timeout").fetchone()[
            "idle_in_transaction_session_timeout"])
        add_outbox(conn, msg)

    monkeypatch.setattr(psycopg.Connection, "transaction", spy_transaction)
    monkeypatch.setattr(Store, "add_outbox", staticmethod(spy_add_outbox))
    monkeypatch.setattr("jobstream.faults.point", hits.append)
    ctx = StageContext(settings, Store(settings.database_url, max_size=2))
    try:
        def one(key: str, text: str, **job: Any) -> IntakeResult | Exception:
            it = intake_intent(ctx, _uploaded(key, text))
            if job:
                it = dataclasses.replace(it, job={**it.job, **job})
            out = ctx.store.intake_batch([it], idle_limit_s=7.0)
            assert len(out) == 1
            return out[0]

        new = one("k1", "document 1")
        assert isinstance(new, IntakeResult) and new.created and new.dedup == "new"
        assert not savepoints, "a lone intent took a savepoint in a batch transaction"
        assert limits == ["7s"], limits  # set in the intent's transaction, before its rows
        assert [h for h in hits if h.startswith("intake")] == ["intake_batch_before_commit"]
        again = one("k1", "document 1")
        assert isinstance(again, IntakeResult) and (again.job_id, again.dedup) == (
            new.job_id, "replayed") and not again.created
        reused = one("k2", "document 1")
        assert isinstance(reused, IntakeResult) and (reused.job_id, reused.dedup) == (
            new.job_id, "reused")
        assert isinstance(one("k1", "another body"), IdempotencyConflict)
        bad_nul = one("bad-nul", "refused: NUL", filename="a\x00b")
        assert isinstance(bad_nul, PoisonMessage) and bad_nul.code == "invalid_data", bad_nul
        assert isinstance(one("bad-lane", "refused by a CHECK", lane="bogus"),
                          psycopg.errors.CheckViolation)
        assert not savepoints
        url = settings.database_url
        assert [j["idempotency_key"] for j in query(url, "SELECT idempotency_key FROM job")
                ] == ["k1"]
        assert query(url, "SELECT count(*) AS n FROM outbox WHERE event_type = 'job.accepted'"
                     )[0]["n"] == 1
        assert query(url, "SELECT count(*) AS n FROM document")[0]["n"] == 1
    finally:
        ctx.store.close()
