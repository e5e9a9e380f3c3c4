-- breaker11: a stage event's retry rounds counted in Postgres, not only in the retry message's
-- `retry_count` header. A copy of a real job's event written to a `.retry` topic with a forged
-- `retry_count: 1000` spent the real job's whole budget on its first transient failure and
-- failed the job (`retry_budget_exhausted`) in the middle of a provider outage it would have
-- survived (tests/e2e/test_break_forged_early_event.py::
-- test_a_forged_retry_count_does_not_fail_a_job_through_an_outage). The stage agent now adds
-- one round here per transient failure of a stage event (its own transaction: a one-transaction
-- stage's failure rolled back its claim), and a chain's rounds are its header's count but never
-- more than this count (streams/base.py, rounds_spent): a forged header spends no more than the
-- job's real rounds. Keyed by the job's generation: a re-drive starts a new budget, as its new
-- events did before. Rows go with their job (retention).
CREATE TABLE IF NOT EXISTS stage_retry_round (
    job_id     uuid        NOT NULL REFERENCES job (job_id) ON DELETE CASCADE,
    stage      text        NOT NULL,
    generation bigint      NOT NULL,
    rounds     integer     NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (job_id, stage, generation)
);
