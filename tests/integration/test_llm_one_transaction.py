"""The llm stage in ONE transaction on the in-process model, shared by several events (group
commit; issue 12), on real Postgres with the fake provider on loopback: the ``local`` jobs of a
batch claim, answer and complete in the batch's one transaction, each fenced by its own run
token; a remote provider's job in the same batch has its claim committed there and its call
made afterwards, outside any transaction (attempt row first, then the completion), on a
thread of its own so it never holds up the drain. Jobs are made through ``handle_intake`` and
taken through extract and chunk by ``run_stage`` (no Kafka).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from jobstream.drills.fake_provider import FakeProvider
from jobstream.producer import uploaded_event
from jobstream.settings import Settings
from jobstream.store import Store
from streams.context import StageContext
from streams.intake import handle_intake
from streams.runner import GroupCommit, run_stage
from tests.helpers import outbox_events, query

pytestmark = pytest.mark.integration


@pytest.fixture
def chunked(settings: Settings, tmp_path: Path) -> Iterator[tuple[StageContext, FakeProvider,
                                                                  dict[str, Any]]]:
    """Three one-chunk jobs, extracted and chunked, llm not claimed: ``local1``, ``local2``
    (in-process model) and ``remote`` (the ``custom`` profile: the fake provider)."""
    with FakeProvider() as fake:
        s = settings.model_copy(update={"provider_base_url": fake.base_url})
        store = Store(s.database_url, max_size=3)
        ctx = StageContext(s, store)
        ids = {}
        for name, profile in (("local1", "local"), ("remote", "custom"), ("local2", "local")):
            doc = tmp_path / f"{name}.txt"
            doc.write_text(f"{name}: harbour lanterns and copper kettles, sentence after "
                           "sentence. " * 8)
            ids[name] = handle_intake(ctx, uploaded_event(
                doc, tenant_id="acme", idempotency_key=name, settings=s,
                model_profile=profile)).job_id
        for ev in outbox_events(s, "job.accepted"):
            assert run_stage(ctx, ev) == "done"
        for ev in outbox_events(s, "job.text_extracted"):
            assert run_stage(ctx, ev) == "done"
        by_job = {ev.job_id: ev for ev in outbox_events(s, "job.chunks_ready")}
        yield ctx, fake, {name: by_job[job_id] for name, job_id in ids.items()}
        ctx.close()
        store.close()


def test_local_answers_share_one_transaction_and_a_remote_call_stays_outside_it(
        chunked: tuple[StageContext, FakeProvider, dict[str, Any]], settings: Settings
) -> None:
    ctx, fake, evs = chunked
    url = settings.database_url
    commit = GroupCommit(ctx, max_batch=16, alone=4)

    async def all_three() -> list[str]:
        # Started together: the three are queued before the drain runs, so they are ONE batch.
        return list(await asyncio.gather(*(commit.run(evs[n])
                                           for n in ("local1", "remote", "local2"))))

    assert asyncio.run(all_three()) == ["done", "done", "done"]
    rows = {r["job_id"]: r for r in query(
        url, "SELECT job_id, status, started_at, finished_at FROM job_stage "
        "WHERE stage = 'llm'")}
    local1, local2, remote = (rows[evs[n].job_id] for n in ("local1", "local2", "remote"))
    assert local1["status"] == local2["status"] == remote["status"] == "succeeded"
    # now() is the transaction's start time: one transaction claimed all three and completed
    # the two local ones; the remote one was completed in a later transaction of its own.
    assert local1["started_at"] == local1["finished_at"] == local2["finished_at"] \
        == remote["started_at"]
    assert remote["finished_at"] > remote["started_at"]
    # The provider was asked once, for the remote job only; its attempt row was written
    # before the request (not with the completion) and ended succeeded.
    assert fake.snapshot()["total"] == 1
    attempts = query(url, "SELECT job_id, model_profile, outcome, started_at, finished_at "
                     "FROM provider_attempt ORDER BY job_id")
    by_profile = {a["model_profile"]: a for a in attempts}
    assert len(attempts) == 3 and set(by_profile) == {"local", "custom"}
    assert by_profile["custom"]["job_id"] == evs["remote"].job_id
    assert by_profile["custom"]["started_at"] < remote["finished_at"]
    assert all(a["outcome"] == "succeeded" for a in attempts)
    assert query(url, "SELECT count(*) AS n FROM outbox WHERE event_type = 'job.llm_done'"
                 ) == [{"n": 3}]
    # Each completion advanced its job in the same statement as its checkpoint.
    assert query(url, "SELECT status, current_stage, count(*) AS n FROM job "
                 "GROUP BY 1, 2") == [{"status": "running", "current_stage": "llm", "n": 3}]
    # A redelivery of each is a duplicate, in the batch as alone.
    again = asyncio.run(all_three())
    assert again == ["skipped:duplicate"] * 3
    assert fake.snapshot()["total"] == 1


def test_with_the_setting_off_a_local_answer_is_claimed_and_completed_apart(
        chunked: tuple[StageContext, FakeProvider, dict[str, Any]], settings: Settings
) -> None:
    ctx, _, evs = chunked
    ctx.settings = ctx.settings.model_copy(update={"llm_local_one_transaction": False})
    assert run_stage(ctx, evs["local1"]) == "done"
    [row] = query(settings.database_url, "SELECT started_at, finished_at FROM job_stage "
                  "WHERE stage = 'llm'")
    assert row["finished_at"] > row["started_at"]
