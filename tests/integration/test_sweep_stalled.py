"""The sweeper's backstop for a job stalled between stages (streams.actions.sweep, second pass)
on real Postgres: the next stage's event was lost after the checkpoint before it committed
(here: its outbox row deleted, what a lost message leaves behind), so the job would stay
``running`` forever. Stage functions are driven directly with the events the outbox holds; the
provider is the fake one on loopback. Ages are made by moving timestamps into the past (the
clock, not a simulated failure). The same backstop with real processes:
tests/e2e/test_stall_backstop.py."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from jobstream.drills.fake_provider import FakeProvider
from jobstream.errors import StaleRun
from jobstream.producer import uploaded_event
from jobstream.settings import Settings
from jobstream.store import Store
from streams.actions import sweep
from streams.context import StageContext
from streams.intake import handle_intake
from streams.runner import run_stage
from tests.helpers import outbox_events, paragraphs_document, query

pytestmark = pytest.mark.integration


def _lose_events(url: str) -> None:
    """Every outbox row is gone (published rows are deleted; these never reached a consumer)."""
    query(url, "DELETE FROM outbox RETURNING id")


def _age(url: str, seconds: float) -> None:
    """Move every checkpoint, job update and sweep ``seconds`` into the past."""
    query(url, "UPDATE job_stage SET updated_at = updated_at - make_interval(secs => %s) "
               "RETURNING 1", (seconds,))
    query(url, "UPDATE job SET updated_at = updated_at - make_interval(secs => %s), "
               "swept_at = swept_at - make_interval(secs => %s) RETURNING 1", (seconds, seconds))


@pytest.fixture
def chunked(settings: Settings, tmp_path: Path) -> Iterator[tuple[StageContext, Any]]:
    """A job extracted and chunked; its job.chunks_ready still in the outbox, the llm stage
    not claimed. Yields ``(ctx, job.chunks_ready event)``; ``sweep_stall_grace_s`` is 0."""
    doc = paragraphs_document(tmp_path / "doc.txt", 2)
    with FakeProvider() as fake:
        s = settings.model_copy(update={"chunk_size_chars": 400, "model_profile": "custom",
                                        "provider_base_url": fake.base_url,
                                        "sweep_stall_grace_s": 0.0})
        store = Store(s.database_url, max_size=4)
        ctx = StageContext(s, store)
        handle_intake(ctx, uploaded_event(doc, tenant_id="acme", idempotency_key="k",
                                          settings=s, model_profile="custom"))
        assert run_stage(ctx, outbox_events(s, "job.accepted")[-1]) == "done"
        assert run_stage(ctx, outbox_events(s, "job.text_extracted")[-1]) == "done"
        yield ctx, outbox_events(s, "job.chunks_ready")[-1]
        ctx.close()
        store.close()


def test_a_lost_stage_event_is_re_emitted_once_and_the_job_finishes(chunked) -> None:
    ctx, lost = chunked
    url = ctx.settings.database_url
    _lose_events(url)
    assert sweep(ctx) == [f"re-emitted job.chunks_ready of {lost.job_id}: llm never claimed "
                          "after chunk"]
    [again] = outbox_events(ctx.settings, "job.chunks_ready")
    assert (again.generation, again.dedup_key, again.payload) == (
        lost.generation, lost.dedup_key, lost.payload)
    assert sweep(ctx) == []  # its row waits in the outbox: not lost (yet)
    assert run_stage(ctx, again) == "done"
    # The lost copy, delivered late after all, is a duplicate for the idempotent consumer.
    assert run_stage(ctx, lost) == "skipped:duplicate"
    for ev_type in ("job.llm_done", "job.validated"):
        assert run_stage(ctx, outbox_events(ctx.settings, ev_type)[-1]) == "done"
    assert query(url, "SELECT status, generation, sweeps FROM job") == [
        {"status": "succeeded", "generation": 0, "sweeps": 1}]
    _lose_events(url)
    assert sweep(ctx) == []  # a finished job is never re-emitted


def test_nothing_is_re_emitted_while_the_event_waits_in_the_outbox(chunked) -> None:
    ctx, _ = chunked
    assert sweep(ctx) == []  # the relay is behind (or parked the row): not a lost event
    assert query(ctx.settings.database_url, "SELECT sweeps FROM job") == [{"sweeps": 0}]


def test_a_claimed_stage_is_not_stalled(chunked) -> None:
    ctx, ev = chunked
    url = ctx.settings.database_url
    claim = ctx.store.claim(job_id=ev.job_id, stage="llm", group=ctx.group("llm"),
                            dedup_key=ev.dedup_key, event_type=ev.event_type,
                            event_id=ev.event_id, lease_s=30.0,
                            code_version=ctx.code_version("llm"), generation=ev.generation)
    assert claim.run_token
    _lose_events(url)
    assert sweep(ctx) == []  # a running stage is the lease sweeper's (expired_leases)


def test_the_re_check_under_the_job_lock_sees_a_claim_made_after_the_list(chunked) -> None:
    ctx, ev = chunked
    _lose_events(ctx.settings.database_url)
    [row] = ctx.store.stalled_jobs(0.0)
    assert (row.job_id, row.stage, row.checkpoint) == (ev.job_id, "llm", "chunk")
    assert run_stage(ctx, ev) == "done"  # the event arrived after all, between list and re-emit
    with pytest.raises(StaleRun):
        ctx.store.reemit_stalled(row.job_id, stage=row.stage, grace_s=0.0,
                                 build=lambda job, emitted: pytest.fail("re-emitted"))
    assert query(ctx.settings.database_url, "SELECT sweeps FROM job") == [{"sweeps": 0}]


def test_the_stall_grace_backs_off_per_job(chunked) -> None:
    ctx, _ = chunked
    url = ctx.settings.database_url
    ctx.settings.sweep_stall_grace_s = 10.0
    _lose_events(url)
    assert sweep(ctx) == []  # the checkpoint is younger than the grace
    _age(url, 15)
    assert len(sweep(ctx)) == 1
    _lose_events(url)  # lost again
    _age(url, 15)
    assert sweep(ctx) == []  # the second time the job waits 2 x grace
    _age(url, 10)
    assert len(sweep(ctx)) == 1
    assert query(url, "SELECT sweeps FROM job") == [{"sweeps": 2}]


def test_a_stage_given_back_for_a_retry_waits_out_its_backoff_before_a_re_emission(
        chunked) -> None:
    """The llm stage released after a transient failure (pending, its event on the retry
    topic): the grace counts from the release, not from the checkpoint before it."""
    ctx, lost = chunked
    url = ctx.settings.database_url
    ctx.settings = ctx.settings.model_copy(update={"sweep_stall_grace_s": 60.0})
    _lose_events(url)
    _age(url, 120)  # the chunk checkpoint is two graces old
    query(url, "INSERT INTO job_stage (job_id, stage, status, attempt, error_code, error) "
               "VALUES (%s, 'llm', 'pending', 1, 'provider_unavailable', '503') RETURNING 1",
          (lost.job_id,))
    assert sweep(ctx) == []  # given back a moment ago: its retry is due within the backoff
    _age(url, 120)
    assert sweep(ctx) == [f"re-emitted job.chunks_ready of {lost.job_id}: llm never claimed "
                          "after chunk"]
