"""The LLM stage's records on real Postgres, without Kafka: stage functions driven directly with
the events the outbox holds, the provider a fake one on loopback."""

from __future__ import annotations

from pathlib import Path

import pytest

from jobstream.db import connect
from jobstream.drills.fake_provider import FakeProvider
from jobstream.errors import StaleRun
from jobstream.producer import uploaded_event
from jobstream.settings import Settings
from jobstream.store import Claim, Store
from schemas.events import decode_event
from streams import llm
from streams.context import StageContext
from streams.intake import handle_intake
from streams.runner import run_stage
from tests.helpers import outbox_events, paragraphs_document, query

pytestmark = pytest.mark.integration


def _next_event(settings: Settings, event_type: str):
    events = outbox_events(settings, event_type)
    assert events, f"no {event_type} in the outbox"
    return events[-1]


@pytest.fixture
def chunked_job(settings: Settings, tmp_path: Path):
    """A job of three chunks, extracted and chunked, whose LLM stage is not claimed yet."""
    doc = paragraphs_document(tmp_path / "doc.txt", 3)
    with FakeProvider() as fake:
        s = settings.model_copy(update={"chunk_size_chars": 400, "model_profile": "custom",
                                        "provider_base_url": fake.base_url})
        store = Store(s.database_url, max_size=2)
        ctx = StageContext(s, store)
        handle_intake(ctx, uploaded_event(doc, tenant_id="acme", idempotency_key="k",
                                          settings=s, model_profile="custom"))
        assert run_stage(ctx, _next_event(s, "job.accepted")) == "done"
        assert run_stage(ctx, _next_event(s, "job.text_extracted")) == "done"
        yield ctx, fake, _next_event(s, "job.chunks_ready")
        ctx.close()
        store.close()


def _claim(ctx: StageContext, ev, lease_s: float) -> Claim:
    got = ctx.store.claim(job_id=ev.job_id, stage="llm", group="g", dedup_key=ev.dedup_key,
                          event_type=ev.event_type, event_id=ev.event_id, lease_s=lease_s,
                          code_version=ctx.code_version("llm"))
    assert isinstance(got, Claim), got
    return got


def test_a_fenced_off_answer_is_logged_as_paid_but_never_becomes_the_chunks_output(
        chunked_job) -> None:
    ctx, _fake, ev = chunked_job
    url = ctx.settings.database_url
    stale = _claim(ctx, ev, lease_s=0.001)  # expires at once: the next claim takes over
    attempt = ctx.store.start_attempt(stale, chunk_idx=0, attempt=1, model="m")
    fresh = _claim(ctx, ev, lease_s=30)
    assert fresh.run_token != stale.run_token
    with pytest.raises(StaleRun):
        ctx.store.succeed_chunk_attempt(stale, attempt, idx=0, output={"summary": "stale"},
                                        status_code=200, latency_ms=1.0, prompt_tokens=10,
                                        completion_tokens=5, cost_usd=0.001)
    [a] = query(url, "SELECT outcome, cost_usd FROM provider_attempt WHERE attempt_id = %s",
                (attempt,))
    assert a["outcome"] == "discarded" and float(a["cost_usd"]) == 0.001  # billed: logged
    [c] = query(url, "SELECT llm_output, llm_attempt_id FROM chunk WHERE idx = 0")
    assert c == {"llm_output": None, "llm_attempt_id": None}


def test_the_llm_stage_answers_each_chunk_once_and_keeps_the_successful_attempt(
        chunked_job) -> None:
    ctx, fake, ev = chunked_job
    url = ctx.settings.database_url
    assert run_stage(ctx, ev) == "done"
    chunks = query(url, "SELECT idx, llm_attempt_id FROM chunk ORDER BY idx")
    attempts = query(url, "SELECT attempt_id, chunk_idx, outcome FROM provider_attempt "
                          "ORDER BY attempt_id")
    assert len(chunks) >= 3
    assert [(a["chunk_idx"], a["outcome"]) for a in attempts] == [
        (c["idx"], "succeeded") for c in chunks]
    assert [c["llm_attempt_id"] for c in chunks] == [a["attempt_id"] for a in attempts]
    assert sorted(fake.snapshot()["by_key"].values()) == [1] * len(chunks)


def test_a_run_resuming_after_a_dead_one_pays_nothing_again_and_reports_the_stage_cost(
        chunked_job) -> None:
    ctx, fake, ev = chunked_job
    url = ctx.settings.database_url
    dead = _claim(ctx, ev, lease_s=30)
    llm.work(ctx, dead, ev)  # every chunk answered and saved; then the run "dies"
    with connect(url) as conn:  # ... and its lease runs out
        conn.execute("UPDATE job_stage SET lease_until = now() WHERE stage = 'llm'")
    calls = fake.snapshot()["total"]
    assert run_stage(ctx, ev) == "done"  # the lease expired: taken over, nothing left to ask
    assert fake.snapshot()["total"] == calls
    [row] = query(url, "SELECT payload FROM outbox WHERE event_type = 'job.llm_done'")
    payload = decode_event(bytes(row["payload"])).payload
    n_chunks = len(query(url, "SELECT idx FROM chunk"))
    assert payload.provider_calls == n_chunks and payload.reused is False
    assert payload.cost_usd > 0
