-- Fencing by generation (issue 11): a stale run's paid answer is kept as 'discarded'; the
-- attempt of a run that died or was fenced mid-call is closed 'abandoned' (an unknown outcome,
-- billed at the estimate written when it started); the sweeper backs off per job.

ALTER TABLE provider_attempt DROP CONSTRAINT provider_attempt_outcome_check;
ALTER TABLE provider_attempt ADD CONSTRAINT provider_attempt_outcome_check CHECK (outcome IN (
    'started', 'succeeded', 'transient_error', 'permanent_error', 'outcome_unknown',
    'cancelled', 'discarded', 'abandoned'));

-- What the attempt would cost if the provider did the work (USD): the budget's figure for an
-- attempt whose outcome nobody will learn.
ALTER TABLE provider_attempt ADD COLUMN est_cost_usd numeric(14, 8) NOT NULL DEFAULT 0;
CREATE INDEX provider_attempt_started ON provider_attempt (job_id, stage)
    WHERE outcome = 'started';

-- Sweeper re-drives of the job (each waits sweep_grace_s * 2^sweeps after the lease expired).
ALTER TABLE job ADD COLUMN sweeps integer NOT NULL DEFAULT 0;
ALTER TABLE job ADD COLUMN swept_at timestamptz;
