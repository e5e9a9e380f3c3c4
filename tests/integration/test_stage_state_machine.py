"""Every edge of a stage's state machine (docs/stage-state-machine.md) on real Postgres, and the
fence that guards it: run token AND generation. Stage functions are driven directly with the
events the outbox holds; the provider is the fake one on loopback. Lease expiry is made by
moving ``lease_until`` into the past (the clock, not a simulated failure); pauses and kills of
real processes are in tests/e2e/test_pause.py."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path
from typing import Any

import pytest

from jobstream.db import connect
from jobstream.drills.fake_provider import FakeProvider
from jobstream.errors import PoisonMessage, StaleRun
from jobstream.producer import uploaded_event
from jobstream.settings import Settings
from jobstream.store import Claim, LeaseHeld, Skip, Store
from schemas.events import JobFailed, JobFailedPayload, LlmDone, LlmDonePayload
from streams.actions import give_up, redrive, sweep
from streams.context import StageContext, outbox_msg
from streams.intake import handle_intake
from streams.runner import run_stage, run_stage_batch
from tests.helpers import outbox_events, paragraphs_document, query, wait_for

pytestmark = pytest.mark.integration

GROUP = "g-llm"


@pytest.fixture
def job(settings: Settings, tmp_path: Path):
    """A job of three chunks, extracted and chunked; its LLM stage not claimed yet. Yields
    ``(ctx, fake provider, job.chunks_ready event)``."""
    doc = paragraphs_document(tmp_path / "doc.txt", 3)
    with FakeProvider() as fake:
        s = settings.model_copy(update={"chunk_size_chars": 400, "model_profile": "custom",
                                        "provider_base_url": fake.base_url,
                                        "sweep_grace_s": 0.0, "max_stage_attempts": 5})
        store = Store(s.database_url, max_size=4)
        ctx = StageContext(s, store)
        handle_intake(ctx, uploaded_event(doc, tenant_id="acme", idempotency_key="k",
                                          settings=s, model_profile="custom"))
        assert run_stage(ctx, outbox_events(s, "job.accepted")[-1]) == "done"
        assert run_stage(ctx, outbox_events(s, "job.text_extracted")[-1]) == "done"
        yield ctx, fake, outbox_events(s, "job.chunks_ready")[-1]
        ctx.close()
        store.close()


def _claim(ctx: StageContext, ev: Any, lease_s: float = 30.0) -> Any:
    return ctx.store.claim(job_id=ev.job_id, stage="llm", group=GROUP,
                           dedup_key=ev.dedup_key, event_type=ev.event_type,
                           event_id=ev.event_id, lease_s=lease_s,
                           code_version=ctx.code_version("llm"), generation=ev.generation)


def _expire(url: str, seconds_ago: float = 1.0) -> None:
    """Move the LLM stage's lease end ``seconds_ago`` into the past."""
    with connect(url) as conn:
        conn.execute("UPDATE job_stage SET lease_until = now() - make_interval(secs => %s) "
                     "WHERE stage = 'llm'", (seconds_ago,))


def _stage(url: str) -> dict[str, Any]:
    [row] = query(url, "SELECT status, attempt, run_token, error_code FROM job_stage "
                       "WHERE stage = 'llm'")
    return row


def _generation(url: str) -> int:
    [row] = query(url, "SELECT generation, sweeps FROM job")
    return int(row["generation"])


def _complete(ctx: StageContext, claim: Claim, ev: Any) -> None:
    """Complete ``claim`` with a dummy result (what run_stage does after the work)."""
    nxt = LlmDone(tenant_id=ev.tenant_id, request_id=ev.request_id, job_id=ev.job_id,
                         dedup_key=ev.dedup_key, generation=claim.generation,
                         idempotency_key=claim.job.idempotency_key,
                         payload=LlmDonePayload(chunk_count=1, output_sha256="0" * 64,
                                                       provider_calls=0, reused=True,
                                                       cost_usd=0.0))
    ctx.store.complete(claim, output={}, input_hash="h", code_version="llm-1", cost_usd=0.0,
                       group=GROUP, event_type=ev.event_type, event_id=ev.event_id,
                       next_msg=outbox_msg(ctx, nxt, claim.job.lane))


def _writes(url: str) -> dict[str, int]:
    """Counts of what a stage run can add: outbox rows, processed rows."""
    [row] = query(url, "SELECT (SELECT count(*) FROM outbox) AS outbox, "
                       "(SELECT count(*) FROM processed_event) AS processed")
    return dict(row)


# ----------------------------------------------------------------- pending/absent -> running

def test_claim_takes_a_new_stage_and_a_live_lease_holds_off_a_second_claim(job) -> None:
    ctx, _fake, ev = job
    first = _claim(ctx, ev)
    assert isinstance(first, Claim) and first.attempt == 1 and first.generation == 0
    assert isinstance(_claim(ctx, ev), LeaseHeld)
    assert _stage(ctx.settings.database_url)["status"] == "running"


# ----------------------------------------------------------------- running -> running (takeover)

def test_a_takeover_fences_the_old_token_and_closes_its_orphan_attempt(job) -> None:
    ctx, _fake, ev = job
    url = ctx.settings.database_url
    old = _claim(ctx, ev)
    orphan = ctx.store.start_attempt(old, chunk_idx=0, attempt=1, model="m", est_cost_usd=0.25)
    _expire(url)
    new = _claim(ctx, ev)
    assert isinstance(new, Claim) and new.run_token != old.run_token and new.attempt == 2
    [a] = query(url, "SELECT outcome, cost_usd FROM provider_attempt WHERE attempt_id = %s",
                (orphan,))
    assert a["outcome"] == "abandoned" and float(a["cost_usd"]) == 0.25  # unknown, estimated
    before = _writes(url)
    with pytest.raises(StaleRun):
        ctx.store.renew_lease(old, 30)
    with pytest.raises(StaleRun):
        ctx.store.start_attempt(old, chunk_idx=1, attempt=1, model="m")
    with pytest.raises(StaleRun):
        _complete(ctx, old, ev)
    assert _writes(url) == before
    ctx.store.renew_lease(new, 30)  # the new owner is unaffected


def test_an_answer_for_a_chunk_answered_meanwhile_is_discarded_and_the_run_goes_on(
        job) -> None:
    ctx, _fake, ev = job
    url = ctx.settings.database_url
    run = _claim(ctx, ev)
    first = ctx.store.start_attempt(run, chunk_idx=0, attempt=1, model="m")
    second = ctx.store.start_attempt(run, chunk_idx=0, attempt=2, model="m")
    answer = {"status_code": 200, "latency_ms": 1.0, "prompt_tokens": 10,
              "completion_tokens": 5, "cost_usd": 0.001}
    ctx.store.succeed_chunk_attempt(run, first, idx=0, output={"summary": "a"}, **answer)
    ctx.store.succeed_chunk_attempt(run, second, idx=0, output={"summary": "b"}, **answer)
    rows = query(url, "SELECT outcome FROM provider_attempt ORDER BY attempt_id")
    assert [r["outcome"] for r in rows] == ["succeeded", "discarded"]
    assert query(url, "SELECT llm_output, llm_attempt_id FROM chunk WHERE idx = 0") == [
        {"llm_output": {"summary": "a"}, "llm_attempt_id": first}]
    ctx.store.renew_lease(run, 30)  # still the owner


# ----------------------------------------------------------------- running -> pending (sweeper)

def test_the_sweeper_re_drive_fences_the_paused_run_in_the_same_transaction(job) -> None:
    ctx, fake, ev = job
    url = ctx.settings.database_url
    paused = _claim(ctx, ev)
    attempt = ctx.store.start_attempt(paused, chunk_idx=0, attempt=1, model="m",
                                      est_cost_usd=0.1)
    _expire(url)
    assert sweep(ctx) == [f"re-drove {ev.job_id} from llm"]
    st = _stage(url)
    assert st["status"] == "pending" and st["run_token"] is None
    assert _generation(url) == 1
    [a] = query(url, "SELECT outcome FROM provider_attempt WHERE attempt_id = %s", (attempt,))
    assert a["outcome"] == "abandoned"

    # The paused run wakes up: its answer is discarded (cost kept), it emits nothing.
    before = _writes(url)
    with pytest.raises(StaleRun):
        ctx.store.succeed_chunk_attempt(paused, attempt, idx=0, output={"summary": "stale"},
                                        status_code=200, latency_ms=1.0, prompt_tokens=10,
                                        completion_tokens=5, cost_usd=0.002)
    [a] = query(url, "SELECT outcome, cost_usd FROM provider_attempt WHERE attempt_id = %s",
                (attempt,))
    assert a["outcome"] == "discarded" and float(a["cost_usd"]) == 0.002
    with pytest.raises(StaleRun):
        _complete(ctx, paused, ev)
    with pytest.raises(StaleRun):
        ctx.store.renew_lease(paused, 30)
    assert _writes(url) == before
    assert query(url, "SELECT count(*) AS n FROM chunk WHERE llm_output IS NOT NULL") == [
        {"n": 0}]

    # The generation-0 event again is superseded; the new generation's runs to the end.
    assert run_stage(ctx, ev) == "skipped:superseded"
    [ev0, ev1] = outbox_events(ctx.settings, "job.chunks_ready")
    assert (ev0.generation, ev1.generation) == (0, 1)
    assert run_stage(ctx, ev1) == "done"
    [done] = outbox_events(ctx.settings, "job.llm_done")
    assert done.generation == 1
    assert fake.snapshot()["total"] == len(query(url, "SELECT idx FROM chunk"))


def test_the_sweeper_re_drives_an_expired_lease_once(job) -> None:
    ctx, _fake, ev = job
    url = ctx.settings.database_url
    assert isinstance(_claim(ctx, ev), Claim)
    _expire(url)
    assert len(sweep(ctx)) == 1
    assert sweep(ctx) == [] and sweep(ctx) == []
    assert len(outbox_events(ctx.settings, "job.chunks_ready")) == 2  # the original + one re-drive
    assert query(url, "SELECT generation, sweeps FROM job") == [{"generation": 1, "sweeps": 1}]


def test_the_sweeper_backs_off_per_job(job) -> None:
    ctx, _fake, ev = job
    url = ctx.settings.database_url
    ctx.settings.sweep_grace_s = 10.0
    assert isinstance(_claim(ctx, ev), Claim)
    _expire(url, 11)
    assert len(sweep(ctx)) == 1  # first re-drive: lease expired over grace ago
    [ev1] = outbox_events(ctx.settings, "job.chunks_ready")[1:]
    assert isinstance(_claim(ctx, ev1), Claim)
    _expire(url, 11)
    assert sweep(ctx) == []  # second: the job waits 2 x grace
    _expire(url, 21)
    assert len(sweep(ctx)) == 1
    assert query(url, "SELECT sweeps FROM job") == [{"sweeps": 2}]


def test_a_sweeper_pass_racing_a_takeover_re_drives_nothing(job) -> None:
    ctx, _fake, ev = job
    url = ctx.settings.database_url
    old = _claim(ctx, ev)
    _expire(url)
    # The sweeper sees the expired lease; before its re-drive, a worker takes the stage over.
    [seen] = ctx.store.expired_leases(0.0)
    assert seen.run_token == old.run_token
    new = _claim(ctx, ev)
    assert isinstance(new, Claim)
    outbox_before = _writes(url)["outbox"]
    assert _try_redrive(ctx, ev.job_id, seen) == "stale"  # re-checked in its transaction
    st = _stage(url)
    assert st["run_token"] == new.run_token and st["status"] == "running"
    assert query(url, "SELECT generation, sweeps FROM job") == [{"generation": 0, "sweeps": 0}]
    assert _writes(url)["outbox"] == outbox_before
    assert sweep(ctx) == []  # and a whole pass finds nothing: the new lease is live
    ctx.store.renew_lease(new, 30)


def test_the_sweeper_does_not_stall_behind_a_frozen_transaction(job) -> None:
    ctx, _fake, ev = job
    url = ctx.settings.database_url
    assert isinstance(_claim(ctx, ev), Claim)
    _expire(url)
    with connect(url) as frozen:  # a transaction of a frozen process holding the job row
        frozen.execute("SELECT 1 FROM job WHERE job_id = %s FOR UPDATE", (ev.job_id,))
        result: list[list[str]] = []
        sweeper = threading.Thread(target=lambda: result.append(sweep(ctx)))
        sweeper.start()
        sweeper.join(30)
        assert result == [[]], "the sweeper waited on the lock instead of postponing the job"
        frozen.rollback()
    assert sweep(ctx) == [f"re-drove {ev.job_id} from llm"]


def _try_redrive(ctx: StageContext, job_id: uuid.UUID, seen: dict[str, Any]) -> str:
    try:
        redrive(ctx, job_id, from_stage=seen.stage, allowed=("queued", "running"),
                       fence=(seen.stage, seen.run_token, 0.0))
    except StaleRun:
        return "stale"
    return "re-driven"


# ----------------------------------------------------------------- running -> failed (sweeper)

def test_a_stage_out_of_runs_fails_once_with_its_orphans_closed(job) -> None:
    ctx, _fake, ev = job
    url = ctx.settings.database_url
    ctx.settings.max_stage_attempts = 2
    assert isinstance(_claim(ctx, ev), Claim)
    _expire(url)
    claim = _claim(ctx, ev)
    assert claim.attempt == 2
    ctx.store.start_attempt(claim, chunk_idx=0, attempt=1, model="m", est_cost_usd=0.3)
    _expire(url)
    assert sweep(ctx) == [f"failed {ev.job_id} at llm"]
    assert sweep(ctx) == []
    assert query(url, "SELECT status, error_code FROM job") == [
        {"status": "failed", "error_code": "stage_attempts_exhausted"}]
    assert _stage(url)["status"] == "failed"
    assert len(outbox_events(ctx.settings, "job.failed")) == 1
    assert query(url, "SELECT outcome FROM provider_attempt") == [{"outcome": "abandoned"}]


# ----------------------------------------------------------------- running -> terminal moves

@pytest.mark.parametrize("move", ["fail", "park", "cancel", "release", "complete", "give_up"])
def test_every_terminal_move_of_a_run_is_fenced_by_generation(job, move: str) -> None:
    ctx, _fake, ev = job
    url = ctx.settings.database_url
    old = _claim(ctx, ev)
    _expire(url)
    sweep(ctx)  # generation 1: the old run is fenced
    [ev1] = outbox_events(ctx.settings, "job.chunks_ready")[1:]
    new = _claim(ctx, ev1)
    assert isinstance(new, Claim) and new.generation == 1
    # Even with the old token put back (the worst case), the generation fence holds.
    with connect(url) as conn:
        conn.execute("UPDATE job_stage SET run_token = %s WHERE stage = 'llm'",
                     (old.run_token,))
    before = _writes(url)
    failed = outbox_msg(ctx, JobFailed(
        tenant_id=ev.tenant_id, idempotency_key="k", job_id=ev.job_id, dedup_key=ev.dedup_key,
        request_id=ev.request_id, generation=0,
        payload=JobFailedPayload(stage="llm", error_code="x", error="x")))
    kw = {"group": GROUP, "event_type": ev.event_type, "event_id": ev.event_id}
    if move == "release":
        ctx.store.release(old, error_code="x", error="x")  # a no-op, never an error
    elif move == "give_up":  # the generation-0 event's retry budget ran out after the redrive
        assert give_up(ctx, ev, "retry_budget_exhausted", "x") is False
    else:
        with pytest.raises(StaleRun):
            if move == "fail":
                ctx.store.fail(old, error_code="x", error="x", failed_msg=failed, **kw)
            elif move == "park":
                ctx.store.park(old, error_code="x", error="x", **kw)
            elif move == "cancel":
                ctx.store.cancel_run(old, **kw)
            else:
                _complete(ctx, old, ev)
    assert _writes(url) == before
    assert _stage(url)["status"] == "running"
    assert query(url, "SELECT status FROM job") == [{"status": "running"}]


# ----------------------------------------------------------------- claim: generation first

def test_the_claim_checks_the_generation_before_the_duplicate(job) -> None:
    ctx, _fake, ev = job
    url = ctx.settings.database_url
    _claim(ctx, ev)
    _expire(url)
    sweep(ctx)
    # A processed row for this stage's input exists (as a stale run would have left it): the
    # generation-0 event is superseded, not a duplicate; the new one is a duplicate.
    with connect(url) as conn:
        conn.execute("INSERT INTO processed_event (key_digest, consumer_group, dedup_key, "
                     "event_type, event_id, job_id) VALUES (processed_event_key(%s, %s, %s), "
                     "%s, %s, %s, %s, %s)",
                     (GROUP, ev.event_type, ev.dedup_key,
                      GROUP, ev.dedup_key, ev.event_type, ev.event_id, ev.job_id))
    assert _claim(ctx, ev) == Skip("superseded")
    [ev1] = outbox_events(ctx.settings, "job.chunks_ready")[1:]
    assert _claim(ctx, ev1) == Skip("duplicate")


def test_an_event_ahead_of_its_jobs_generation_is_poison_and_changes_nothing(job) -> None:
    """policy12 (breaker11's note): the claim took any generation ``>=`` the job's, so a forged
    ``job.chunks_ready`` of generation 1 (the job is at 0) did the llm stage's real work and
    its downstream events carried generation 1, beyond every redrive's and give_up's fence.
    No legitimate event is ahead of its job (a redrive bumps the generation in the transaction
    that writes its event): it is poison (``generation_ahead``), claims and records nothing,
    calls no provider and counts no retry round; the real event then runs as usual."""
    ctx, fake, ev = job
    url = ctx.settings.database_url
    ahead = ev.model_copy(update={"generation": 1, "event_id": uuid.uuid4()})
    before = _writes(url)
    with pytest.raises(PoisonMessage) as err:
        run_stage(ctx, ahead)
    assert err.value.code == "generation_ahead", err.value
    assert _writes(url) == before
    assert query(url, "SELECT 1 FROM job_stage WHERE stage = 'llm'") == []
    assert fake.snapshot()["total"] == 0
    assert ctx.store.add_retry_round(job_id=ev.job_id, stage="llm", generation=1) is None
    assert query(url, "SELECT 1 FROM stage_retry_round") == []
    # The one-transaction stages' shared transaction refuses it too (an already processed
    # text_extracted copy: ahead is checked before the duplicate), each event on its own.
    [extracted] = outbox_events(ctx.settings, "job.text_extracted")
    copies = [extracted.model_copy(update={"generation": g, "event_id": uuid.uuid4()})
              for g in (1, 7)]
    got = run_stage_batch(ctx, copies)
    assert [getattr(e, "code", e) for e in got] == ["generation_ahead"] * 2, got
    assert _writes(url) == before
    assert run_stage(ctx, ev) == "done"
    assert _generation(url) == 0


# ----------------------------------------------------------------- heartbeat

def test_a_call_longer_than_the_lease_keeps_its_lease_and_is_stopped_once_fenced(
        job) -> None:
    ctx, fake, ev = job
    url = ctx.settings.database_url
    ctx.settings.lease_s = 2.0  # heartbeat every 0.5 s
    fake.set_script({"default": {"latency_s": 4}})
    outcome: list[str] = []
    t = threading.Thread(target=lambda: outcome.append(run_stage(ctx, ev)))
    t.start()
    # The first call outlasts the lease: the heartbeat keeps it (no takeover possible).
    wait_for(lambda: fake.snapshot()["total"] >= 1, 30, "the first provider call")
    wait_for(lambda: fake.snapshot()["total"] >= 2, 30, "the second chunk's call")
    assert len(query(url, "SELECT 1 FROM provider_attempt")) == 2
    assert isinstance(_claim(ctx, ev), LeaseHeld)
    # Now the run is fenced (the lease moved into the past and another run takes over):
    # the heartbeat finds out, stops the call in flight and the run ends 'stale'.
    def take_over() -> bool:  # the heartbeat may renew between the two: try again
        _expire(url)
        return isinstance(_claim(ctx, ev), Claim)
    wait_for(take_over, 20, "a takeover of the stage")
    t.join(30)
    assert outcome == ["stale"]
    rows = query(url, "SELECT chunk_idx, outcome FROM provider_attempt ORDER BY attempt_id")
    assert [r["outcome"] for r in rows] == ["succeeded", "abandoned"]
