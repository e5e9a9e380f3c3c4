-- Jobs and stages can be parked when a provider call's outcome is unknown (batch lane), and
-- every checkpoint keeps the payload of the event it emitted so a redrive can re-emit it
-- without redoing the stage. A redrive starts a new generation of the job: events of an older
-- generation still in flight are superseded and ignored.

ALTER TABLE job DROP CONSTRAINT job_status_check;
ALTER TABLE job ADD CONSTRAINT job_status_check CHECK (status IN (
    'queued', 'running', 'succeeded', 'failed', 'cancelled', 'needs_reconciliation'));

ALTER TABLE job_stage DROP CONSTRAINT job_stage_status_check;
ALTER TABLE job_stage ADD CONSTRAINT job_stage_status_check CHECK (status IN (
    'pending', 'running', 'succeeded', 'failed', 'needs_reconciliation'));

ALTER TABLE job_stage ADD COLUMN emitted jsonb;  -- payload of the event this stage emitted

ALTER TABLE job ADD COLUMN generation integer NOT NULL DEFAULT 0;
