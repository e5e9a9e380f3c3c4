-- Observability and retention (docs/design-notes.md, "Metrics", "Trace context",
-- "Retention horizons").

-- The W3C trace every event of the job belongs to (32 hex digits), chosen at intake: the
-- incoming document.uploaded's (or API request's) traceparent, else a new trace. Events written
-- with no span in force (sweeper, redrive, reconcile) take it from here. NULL for jobs created
-- before this migration until their next event is written.
ALTER TABLE job ADD COLUMN trace_id text CHECK (trace_id ~ '^[0-9a-f]{32}$');

-- How many claims of this stage took over a run whose lease had expired (a worker that died or
-- hung): counted by claim_stage itself, so the metric needs no log and survives restarts.
ALTER TABLE job_stage ADD COLUMN lease_takeovers integer NOT NULL DEFAULT 0;

-- Metrics: stage-duration and queue-wait histograms read the stages finished recently.
CREATE INDEX job_stage_finished_at ON job_stage (finished_at) WHERE finished_at IS NOT NULL;

-- Retention: idempotency records are expired by age (and their job's end).
CREATE INDEX job_request_created_at ON job_request (created_at);
