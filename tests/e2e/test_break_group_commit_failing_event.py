"""Breaker (session 6): group commit WITHOUT a savepoint per event
(``Store.claim_and_complete_many``: the events of a shared stage transaction run without
savepoints first; when one raises, the whole transaction rolls back and they run again, a
savepoint each) and the one-statement completion (``complete_stage_emit``: checkpoint, job
advance, outbox row and processed_event row in one statement), with ONE event whose completion
Postgres refuses.

The refusal is real: a trigger the test installs raises on the INSERT of the ``job.llm_done``
outbox rows of some jobs (what a constraint or a refused value does), inside
``complete_stage_emit`` (one job at extract, three at llm). Twelve documents are submitted at
once, so the one-transaction stages take several events into one shared transaction (printed:
timing-dependent for llm; extract's arrive together).
Whatever shares a transaction with the refused event must come out exactly once: every other
job succeeds with one llm run (attempt 1), one local answer per chunk, one ``job.llm_done``
published, one result applied; the refused jobs get no event past the refusal and no answer.
Real processes (relay, worker, applier), shared services.
"""

from __future__ import annotations

import psycopg
import pytest

from jobstream.producer import produce_raw
from jobstream.settings import Settings
from schemas.events import encode_event
from tests.helpers import ProcessRunner, query, text_uploaded, wait_for

pytestmark = pytest.mark.e2e

GOOD = 8
POISON = "gc-poison"
#: Jobs whose completion is refused: at extract (its events share a transaction almost
#: always: they arrive together) and at llm (the local answers; shared when timing allows).
POISONS = [f"{POISON}-{i}-{t}" for i, t in enumerate(
    ["job.text_extracted", "job.llm_done", "job.llm_done", "job.llm_done"])]
#: Several chunks at chunk_size_chars=400.
TEXT = " ".join(f"Paragraph {i}: the local model answers this chunk inside a transaction it "
                f"shares with the other documents' events." for i in range(12))


def test_a_refused_completion_in_a_shared_transaction_doubles_nothing_for_the_others(
        settings: Settings, procs: ProcessRunner) -> None:
    url = settings.database_url
    with psycopg.connect(url, autocommit=True) as conn:  # test-only DDL: the refusal
        conn.execute(f"""
        CREATE FUNCTION break_refuse_llm_done() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
          IF EXISTS (SELECT 1 FROM job WHERE job_id::text = NEW.kafka_key
                        AND idempotency_key LIKE '{POISON}-%'
                        AND idempotency_key LIKE '%-' || NEW.event_type) THEN
            RAISE EXCEPTION 'refused by the test: % of %', NEW.event_type, NEW.kafka_key;
          END IF;
          RETURN NEW;
        END $$;
        CREATE TRIGGER break_refuse_llm_done BEFORE INSERT ON outbox
          FOR EACH ROW EXECUTE FUNCTION break_refuse_llm_done();""")
    env = {"JOBSTREAM_CHUNK_SIZE_CHARS": "400"}
    keys = [f"gc-{i}" for i in range(GOOD)]
    keys[1:1] = POISONS[:2]
    keys[5:5] = POISONS[2:]
    produce_raw(settings, settings.topic("document.uploaded"),
                [(k.encode(), encode_event(text_uploaded(k, f"{k}: {TEXT}"))) for k in keys])
    procs.pipeline(**env)

    def settled() -> bool:
        rows = query(url, "SELECT idempotency_key, status FROM job")
        done = {r["idempotency_key"] for r in rows if r["status"] == "succeeded"}
        return len(done) == GOOD and query(
            url, "SELECT count(*) AS n FROM downstream.document_analysis")[0]["n"] >= GOOD
    wait_for(settled, 120, "every job but the refused one to succeed and be applied",
             procs.logs, every_s=1.0)
    worker = procs.procs[1].log_text()
    shared = [ln.split("[INFO] ")[-1] for ln in worker.splitlines()
              if "shared stage transaction:" in ln]
    good = query(url, "SELECT job_id FROM job WHERE idempotency_key NOT LIKE %s",
                 (POISON + "-%",))
    poisons = query(url, "SELECT job_id, idempotency_key, status FROM job "
                         "WHERE idempotency_key LIKE %s", (POISON + "-%",))
    print("refused events that shared a transaction:",
          [p["idempotency_key"] for p in poisons if any(str(p["job_id"]) in ln and
           ("extract" if p["idempotency_key"].endswith("extracted") else " llm,") in ln
           for ln in shared)])
    assert len(good) == GOOD and len(poisons) == len(POISONS), (good, poisons)
    for j in good:
        job_id = j["job_id"]
        runs = query(url, "SELECT stage, attempt FROM job_stage WHERE job_id = %s "
                          "AND attempt <> 1", (job_id,))
        assert runs == [], (job_id, runs)
        attempts = query(url, "SELECT chunk_idx, count(*) AS n FROM provider_attempt "
                              "WHERE job_id = %s GROUP BY chunk_idx", (job_id,))
        assert attempts and {a["n"] for a in attempts} == {1}, (job_id, attempts)
        for table in ("outbox", "outbox_published"):
            n = query(url, f"SELECT event_type, count(*) AS n FROM {table} WHERE kafka_key = %s "
                           "GROUP BY event_type HAVING count(*) > 1", (str(job_id),))
            assert n == [], (job_id, table, n)
    for table in ("downstream.document_analysis", "downstream.ledger_charge"):
        n = query(url, f"SELECT count(*) AS n, count(DISTINCT dedup_key) AS d FROM {table}")[0]
        assert n["n"] == n["d"] == GOOD, (table, n)
    for p in poisons:  # refused: never past the stage, no answer, nothing published for it
        pid, refused = str(p["job_id"]), p["idempotency_key"].rsplit("-", 1)[1]
        assert p["status"] != "succeeded", p
        assert query(url, "SELECT count(*) AS n FROM provider_attempt WHERE job_id = %s "
                          "AND outcome = 'succeeded'", (pid,))[0]["n"] == 0, p
        assert query(url, "SELECT count(*) AS n FROM outbox_published WHERE kafka_key = %s "
                          "AND event_type = %s", (pid, refused))[0]["n"] == 0, p
