-- Every SQL statement of jobstream, one named query each (parsed by jobstream/db.py).

-- name: migrate_lock
SELECT pg_advisory_xact_lock(%s);

-- name: create_migration_table
CREATE TABLE IF NOT EXISTS schema_migration (
    version integer PRIMARY KEY,
    name text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);

-- name: applied_migrations
SELECT version FROM schema_migration ORDER BY version;

-- name: record_migration
INSERT INTO schema_migration (version, name) VALUES (%s, %s);

-- ---------------------------------------------------------------- intake

-- name: find_request
-- The idempotency record of one client intent.
SELECT r.job_id, r.request_hash, j.status
  FROM job_request r JOIN job j USING (job_id)
 WHERE r.tenant_id = %s AND r.idempotency_key = %s;

-- name: insert_document
INSERT INTO document (tenant_id, sha256, content_type, size_bytes, content)
VALUES (%s, %s, %s, %s, %s)
ON CONFLICT (tenant_id, sha256) DO NOTHING;

-- name: insert_job
-- One job per (tenant, dedup_key): a second intent for the same computation gets nothing back.
INSERT INTO job (job_id, tenant_id, idempotency_key, request_hash, dedup_key, request_id,
                 document_sha256, filename, content_type, pipeline, prompt_version,
                 model_profile, lane, trace_id)
VALUES (%(job_id)s, %(tenant_id)s, %(idempotency_key)s, %(request_hash)s, %(dedup_key)s,
        %(request_id)s, %(document_sha256)s, %(filename)s, %(content_type)s, %(pipeline)s,
        %(prompt_version)s, %(model_profile)s, %(lane)s, %(trace_id)s)
ON CONFLICT (tenant_id, dedup_key) DO NOTHING
RETURNING job_id;

-- name: find_job_by_key
-- The job a key created first (job.idempotency_key, job.request_hash): it outlives the
-- idempotency record, which retention may have deleted.
SELECT job_id, request_hash FROM job WHERE tenant_id = %s AND idempotency_key = %s;

-- name: job_by_dedup_key
SELECT job_id, status FROM job WHERE tenant_id = %s AND dedup_key = %s;

-- name: insert_request
INSERT INTO job_request (tenant_id, idempotency_key, request_hash, job_id, request_id)
VALUES (%s, %s, %s, %s, %s);

-- name: insert_done_stage
-- The intake checkpoint: the "intake" stage is done when the job exists.
INSERT INTO job_stage (job_id, stage, status, attempt, input_hash, code_version, output,
                       emitted, started_at, finished_at)
VALUES (%s, %s, 'succeeded', 1, %s, %s, %s, %s, now(), now());

-- name: intake_batch_known_keys
-- (The intake_batch_* statements take their parameters in binary, %b: psycopg's text format
-- escapes every element of a text or bytea array with a regular expression, ~4 ms per batch
-- of 16 documents in the worker; binary ~0.03 ms. Issue 12, perf-worker4.)
-- Intake batches: which of the batch's (tenant, idempotency key) pairs have an idempotency
-- record or a job already (those take the one-intent path: replay, conflict, rebind).
SELECT k.tenant_id, k.idempotency_key
  FROM unnest(%b::text[], %b::text[]) AS k (tenant_id, idempotency_key)
 WHERE EXISTS (SELECT 1 FROM job_request r
                WHERE r.tenant_id = k.tenant_id AND r.idempotency_key = k.idempotency_key)
    OR EXISTS (SELECT 1 FROM job j
                WHERE j.tenant_id = k.tenant_id AND j.idempotency_key = k.idempotency_key);

-- name: intake_batch_insert_documents
-- Intake batches: the documents of the batch's new intents, one statement.
INSERT INTO document (tenant_id, sha256, content_type, size_bytes, content)
SELECT * FROM unnest(%b::text[], %b::text[], %b::text[], %b::bigint[], %b::bytea[])
ON CONFLICT (tenant_id, sha256) DO NOTHING;

-- name: intake_batch_insert_jobs
-- Intake batches: the jobs of the batch's new intents; an existing dedup_key returns nothing
-- for its row (that intent then takes the one-intent path: reuse or restart).
INSERT INTO job (job_id, tenant_id, idempotency_key, request_hash, dedup_key, request_id,
                 document_sha256, filename, content_type, pipeline, prompt_version,
                 model_profile, lane, trace_id)
SELECT * FROM unnest(%(job_id)b::uuid[], %(tenant_id)b::text[], %(idempotency_key)b::text[],
                     %(request_hash)b::text[], %(dedup_key)b::text[], %(request_id)b::text[],
                     %(document_sha256)b::text[], %(filename)b::text[], %(content_type)b::text[],
                     %(pipeline)b::text[], %(prompt_version)b::text[],
                     %(model_profile)b::text[], %(lane)b::text[], %(trace_id)b::text[])
ON CONFLICT (tenant_id, dedup_key) DO NOTHING
RETURNING job_id;

-- name: intake_batch_insert_requests
-- Intake batches: the idempotency records of the jobs the batch created.
INSERT INTO job_request (tenant_id, idempotency_key, request_hash, job_id, request_id)
SELECT * FROM unnest(%b::text[], %b::text[], %b::text[], %b::uuid[], %b::text[]);

-- name: intake_batch_insert_done_stages
-- Intake batches: the intake checkpoints of the jobs the batch created (as insert_done_stage).
INSERT INTO job_stage (job_id, stage, status, attempt, input_hash, code_version, output,
                       emitted, started_at, finished_at)
SELECT x.job_id, %b, 'succeeded', 1, x.input_hash, %b, x.output::jsonb, x.emitted::jsonb,
       now(), now()
  FROM unnest(%b::uuid[], %b::text[], %b::text[], %b::text[])
       AS x (job_id, input_hash, output, emitted);

-- name: intake_batch_outbox_insert
-- Intake batches: the job.accepted outbox rows of the jobs the batch created, in order.
INSERT INTO outbox (topic, kafka_key, payload, headers, event_id, event_type)
SELECT x.topic, x.kafka_key, x.payload, x.headers::jsonb, x.event_id, x.event_type
  FROM unnest(%b::text[], %b::text[], %b::bytea[], %b::text[], %b::uuid[], %b::text[])
       WITH ORDINALITY AS x (topic, kafka_key, payload, headers, event_id, event_type, n)
 ORDER BY x.n;

-- ---------------------------------------------------------------- stages

-- name: get_job
SELECT * FROM job WHERE job_id = %s;

-- name: get_job_for_update
SELECT * FROM job WHERE job_id = %s FOR UPDATE;

-- name: get_stage
SELECT * FROM job_stage WHERE job_id = %s AND stage = %s;

-- name: renew_lease
-- Fenced by run token AND generation: a run of an older generation renews nothing.
UPDATE job_stage s
   SET lease_until = now() + make_interval(secs => %(lease_s)s), updated_at = now()
 WHERE s.job_id = %(job_id)s AND s.stage = %(stage)s AND s.run_token = %(run_token)s
   AND s.status = 'running'
   AND EXISTS (SELECT 1 FROM job j WHERE j.job_id = s.job_id
                AND j.generation = %(generation)s)
RETURNING lease_until;

-- name: job_generation_for_update
-- The fence of every terminal move of a run: the job row locked (a redrive takes the same
-- lock to bump the generation), so "generation unchanged" holds until commit.
SELECT generation, status FROM job WHERE job_id = %s FOR UPDATE;

-- name: close_orphan_attempts
-- Attempts left 'started' by runs of (job, stage) that no longer own it (fenced, taken over,
-- re-driven, or the stage finished): closed 'abandoned', billed at their estimate (an unknown
-- outcome: the provider may have done the work). A later real answer replaces the estimate.
UPDATE provider_attempt a
   SET outcome = 'abandoned', cost_usd = a.est_cost_usd, finished_at = now(),
       error = 'run fenced or dead before the answer was recorded'
 WHERE a.job_id = %(job_id)s AND a.stage = %(stage)s AND a.outcome = 'started'
   AND NOT EXISTS (SELECT 1 FROM job_stage s
                    WHERE s.job_id = a.job_id AND s.stage = a.stage
                      AND s.run_token = a.run_token AND s.status = 'running')
RETURNING attempt_id;

-- name: orphan_attempt_stages
-- (job, stage) pairs holding an orphan attempt (see close_orphan_attempts), for the sweeper.
SELECT DISTINCT a.job_id, a.stage FROM provider_attempt a
 WHERE a.outcome = 'started'
   AND NOT EXISTS (SELECT 1 FROM job_stage s
                    WHERE s.job_id = a.job_id AND s.stage = a.stage
                      AND s.run_token = a.run_token AND s.status = 'running')
 LIMIT 100;

-- name: fence_expired_run
-- The sweeper's re-check, in the transaction that re-drives: the run it saw is still the
-- stage's owner and its lease still expired past the job's backoff. Zero rows: renewed, taken
-- over or already re-driven; nothing to do. Resets the stage to pending (the run is fenced).
UPDATE job_stage s
   SET status = 'pending', run_token = NULL, lease_until = NULL, updated_at = now(),
       error_code = 'lease_expired', error = 'the run stopped renewing its lease'
  FROM job j
 WHERE s.job_id = %(job_id)s AND s.stage = %(stage)s AND s.run_token = %(run_token)s
   AND s.status = 'running' AND j.job_id = s.job_id
   AND s.lease_until < now() - make_interval(secs => %(grace_s)s * power(2, least(j.sweeps, 6)))
RETURNING s.attempt;

-- name: run_owns_stage
-- Does the run (token, generation) still own its stage? (Why a fenced write matched no row.)
SELECT 1 AS owns FROM job_stage s JOIN job j USING (job_id)
 WHERE s.job_id = %(job_id)s AND s.stage = %(stage)s AND s.run_token = %(run_token)s
   AND s.status = 'running' AND j.generation = %(generation)s;

-- name: one_transaction_idle_limit
-- A one-transaction stage (claim + work + complete under the job's row lock) may sit idle in
-- its transaction for at most its lease: a process paused (SIGSTOP, VM freeze) past that has its
-- session ended by Postgres, the claim rolls back and the lock is released, so a frozen worker
-- cannot hold a job forever (issue 11). %(ms)s: milliseconds, as text.
SELECT set_config('idle_in_transaction_session_timeout', %(ms)s, true);

-- name: api_lock_timeout
-- An API request never waits long on a job's row lock (a worker frozen inside a one-transaction
-- stage holds it until its session is ended, up to the lease): 503 row_locked, retry instead.
SET LOCAL lock_timeout = '3s';

-- name: sweeper_lock_timeout
-- The sweeper never waits long on a row lock (a frozen process may hold one for minutes): the
-- job is skipped this pass instead of stalling every other one.
SET LOCAL lock_timeout = '2s';

-- name: count_sweep
UPDATE job SET sweeps = sweeps + 1, swept_at = now() WHERE job_id = %s;

-- name: job_provider_budget
-- The LLM stage's budget, read in its claim transaction: the stage's provider attempts per
-- chunk index (all runs and retry rounds: a jsonb object {"idx": n}), the stage's attempts
-- and cost, and the job's provider cost (USD, every stage).
SELECT coalesce(jsonb_object_agg(a.chunk_idx, a.n) FILTER (WHERE a.chunk_idx IS NOT NULL
                                                           AND a.n > 0), '{}'::jsonb)
           AS attempts,
       coalesce(sum(a.n), 0)::int AS stage_attempts,
       coalesce(sum(a.stage_cost), 0)::float8 AS stage_cost_usd,
       coalesce(sum(a.cost), 0)::float8 AS cost_usd
  FROM (SELECT chunk_idx, count(*) FILTER (WHERE stage = %(stage)s) AS n,
               coalesce(sum(cost_usd) FILTER (WHERE stage = %(stage)s), 0) AS stage_cost,
               sum(cost_usd) AS cost
          FROM provider_attempt WHERE job_id = %(job_id)s GROUP BY chunk_idx) a;

-- name: fail_stage
UPDATE job_stage
   SET status = 'failed', error_code = %(error_code)s, error = %(error)s, lease_until = NULL,
       finished_at = now(), updated_at = now()
 WHERE job_id = %(job_id)s AND stage = %(stage)s AND run_token = %(run_token)s
   AND status = 'running';

-- name: reset_later_stages
-- A stage that really re-ran invalidates every checkpoint after it.
UPDATE job_stage SET status = 'pending', run_token = NULL, lease_until = NULL, updated_at = now()
 WHERE job_id = %s AND stage = ANY(%s) AND status <> 'pending';

-- name: release_stage
-- Fenced: a run that hit a transient failure gives the stage back so a retry can claim it
-- at once instead of waiting for the lease to expire. ``lease_until`` of the pending row: when
-- its retry is due at the latest (%(retry_wait_s)s: the retry topic's cap or the provider's
-- Retry-After); the sweeper's stall clock starts there (stalled_jobs), not at the checkpoint.
UPDATE job_stage
   SET status = 'pending', run_token = NULL,
       lease_until = now() + make_interval(secs => %(retry_wait_s)s),
       error_code = %(error_code)s, error = %(error)s, updated_at = now()
 WHERE job_id = %(job_id)s AND stage = %(stage)s AND run_token = %(run_token)s
   AND status = 'running';

-- name: add_retry_round
-- One more retry round of a stage event (migration 0044), in its own transaction: the rounds
-- the job's (stage, generation) has spent, this one included. A job already gone: no row back.
-- policy12: no row back either for a generation ahead of the job's (forged: no round of it is
-- counted, and such an uncounted round never fails the job).
INSERT INTO stage_retry_round AS r (job_id, stage, generation, rounds)
SELECT j.job_id, %(stage)s, %(generation)s, 1 FROM job j
 WHERE j.job_id = %(job_id)s AND %(generation)s <= j.generation
ON CONFLICT (job_id, stage, generation)
DO UPDATE SET rounds = r.rounds + 1, updated_at = now()
RETURNING r.rounds;

-- name: fail_open_job
-- Give up on a job whose stage event exhausted the retry budget (no run owns the stage).
UPDATE job_stage SET status = 'failed', error_code = %s, error = %s, lease_until = NULL,
                     finished_at = now(), updated_at = now()
 WHERE job_id = %s AND stage = %s AND status IN ('pending', 'running');

-- name: cancel_requested
SELECT cancel_requested FROM job WHERE job_id = %s;

-- name: cancel_stage
-- Fenced: the run stopped because the user cancelled the job.
UPDATE job_stage SET status = 'failed', error_code = 'cancelled_by_user',
                     error = 'cancelled by user', lease_until = NULL, finished_at = now(),
                     updated_at = now()
 WHERE job_id = %s AND stage = %s AND run_token = %s AND status = 'running'
   AND EXISTS (SELECT 1 FROM job j WHERE j.job_id = job_stage.job_id AND j.generation = %s);

-- name: request_cancel
-- "Cancelled by user": the flag workers check between and during stages. A finished job is
-- left as it is (no row: see api_job_status).
UPDATE job SET cancel_requested = true, cancel_requested_at = coalesce(cancel_requested_at, now()),
               updated_at = now()
 WHERE job_id = %s AND tenant_id = %s AND status NOT IN ('succeeded', 'failed', 'cancelled')
RETURNING status;

-- name: api_job_status
SELECT status, cancel_requested FROM job WHERE job_id = %s AND tenant_id = %s;

-- name: clear_cancel
-- A new run of a cancelled job (a new intent for the same computation) is not cancelled.
UPDATE job SET cancel_requested = false, cancel_requested_at = NULL, updated_at = now()
 WHERE job_id = %s;

-- name: request_cancel_batch
UPDATE job SET cancel_requested = true, cancel_requested_at = coalesce(cancel_requested_at, now()),
               updated_at = now()
 WHERE job_id IN (SELECT job_id FROM batch_job WHERE batch_id = %s)
   AND status NOT IN ('succeeded', 'failed', 'cancelled');

-- name: mark_batch_cancelled
UPDATE batch SET cancel_requested = true WHERE batch_id = %s AND tenant_id = %s
RETURNING batch_id;

-- name: cancel_waiting_jobs
-- Jobs with no running stage end 'cancelled' at once; running ones end at their next check.
UPDATE job j SET status = 'cancelled', error_code = 'cancelled_by_user', finished_at = now(),
                 updated_at = now()
 WHERE j.job_id = ANY(%s) AND j.cancel_requested
   AND j.status IN ('queued', 'running', 'needs_reconciliation')
   AND NOT EXISTS (SELECT 1 FROM job_stage s WHERE s.job_id = j.job_id AND s.status = 'running'
                   AND s.lease_until > now());

-- name: park_stage
-- Fenced: the run's provider call has an unknown outcome; wait for reconciliation.
UPDATE job_stage
   SET status = 'needs_reconciliation', error_code = %(error_code)s, error = %(error)s,
       lease_until = NULL, updated_at = now()
 WHERE job_id = %(job_id)s AND stage = %(stage)s AND run_token = %(run_token)s
   AND status = 'running';

-- name: park_job
-- current_stage becomes the parked stage (parked in the same transaction, before this).
UPDATE job SET status = 'needs_reconciliation', error_code = %s, error = %s, updated_at = now(),
               current_stage = coalesce((SELECT s.stage FROM job_stage s
                                          WHERE s.job_id = job.job_id
                                            AND s.status = 'needs_reconciliation'
                                          ORDER BY s.updated_at DESC LIMIT 1), current_stage)
 WHERE job_id = %s AND status NOT IN ('succeeded', 'failed', 'cancelled');

-- name: jobs_needing_reconciliation
SELECT j.job_id, j.tenant_id, j.filename, j.lane, j.current_stage, j.error, j.updated_at,
       (SELECT count(*) FROM provider_attempt a
         WHERE a.job_id = j.job_id AND a.outcome = 'outcome_unknown') AS unknown_attempts
  FROM job j WHERE j.status = 'needs_reconciliation' ORDER BY j.updated_at;

-- name: list_stages
SELECT stage, status, code_version, emitted, lease_until FROM job_stage WHERE job_id = %s;

-- name: forget_processed
-- A redrive makes the stage workers process the job's events again.
-- Parameters: dedup key, groups, event types (every pair of a group and a type).
DELETE FROM processed_event
 WHERE key_digest IN (SELECT processed_event_key(g, t, %s)
                        FROM unnest(%s::text[]) AS g, unnest(%s::text[]) AS t);

-- name: reopen_stages
-- A redrive fences the runs it replaces: a running stage is reset too, so the old run token
-- stops being valid in this very transaction.
UPDATE job_stage SET status = 'pending', run_token = NULL, lease_until = NULL,
                     error_code = NULL, error = NULL, updated_at = now()
 WHERE job_id = %s AND stage = ANY(%s)
   AND status IN ('failed', 'needs_reconciliation', 'running');

-- name: reopen_job
UPDATE job SET status = 'running', error_code = NULL, error = NULL, finished_at = NULL,
               generation = %s, updated_at = now()
 WHERE job_id = %s;

-- name: fail_parked_stage
UPDATE job_stage SET status = 'failed', error_code = %s, error = %s, updated_at = now()
 WHERE job_id = %s AND status = 'needs_reconciliation';

-- name: expired_leases
-- Stages whose run died (lease expired long ago) while their job is still open: the sweeper
-- re-drives them so a crash never leaves a job stuck.
-- A job re-driven before waits longer: grace * 2^sweeps (per-job backoff, capped at 2^6).
SELECT s.job_id, s.stage, s.run_token, s.attempt, s.lease_until FROM job_stage s
  JOIN job j USING (job_id)
 WHERE s.status = 'running'
   AND s.lease_until < now() - make_interval(secs => %s * power(2, least(j.sweeps, 6)))
   AND j.status IN ('queued', 'running')
 ORDER BY s.lease_until LIMIT 100;

-- name: stalled_jobs
-- Open jobs whose last checkpoint succeeded over the grace ago (times the job's sweep backoff)
-- while the next stage was never claimed (no row, or pending: re-driven, not yet claimed):
-- the next stage's event was lost (never delivered, or its offset committed past it). The
-- sweeper re-emits that event. %(stages)s / %(nexts)s: each stage paired with the one after it.
-- A job with a row still in the outbox (published rows are deleted) is left alone: the relay
-- is behind or parked it, the event is not lost. %(job_id)s: one job (the re-check, under the
-- job's row lock), or NULL for every job. A next stage given back for a retry (pending, its
-- event on the retry topic) counts from when it was given back (n.updated_at) and from when
-- its retry is due at the latest (n.lease_until, set by release_stage: retry_cap_s or the
-- provider's Retry-After, which may be longer than the grace), so an event waiting out its
-- backoff is not re-emitted past it (breaker4: tests/e2e/test_break_stall_reemit.py).
-- A job whose cancel was requested is re-emitted too: a cancel under a live lease leaves the
-- job to the next stage's claim, which ends it 'cancelled'; if that event was lost, nothing
-- else would (breaker6: tests/e2e/test_break_stall_cancel.py).
SELECT j.job_id, p.next AS stage, p.stage AS checkpoint, s.emitted
  FROM job j
  JOIN job_stage s ON s.job_id = j.job_id AND s.status = 'succeeded'
  JOIN unnest(%(stages)s::text[], %(nexts)s::text[]) AS p (stage, next) ON p.stage = s.stage
  LEFT JOIN job_stage n ON n.job_id = j.job_id AND n.stage = p.next
 WHERE j.status IN ('queued', 'running')
   AND (%(job_id)s::uuid IS NULL OR j.job_id = %(job_id)s::uuid)
   AND (n.job_id IS NULL OR n.status = 'pending')
   AND greatest(s.updated_at, j.updated_at, j.swept_at, n.updated_at, n.lease_until)
       < now() - make_interval(secs => %(grace_s)s * power(2, least(j.sweeps, 6)))
       -- greatest() skips NULL
   AND NOT EXISTS (SELECT 1 FROM outbox o WHERE o.kafka_key = j.job_id::text)
 ORDER BY s.updated_at LIMIT 100;

-- name: succeed_job
UPDATE job SET status = 'succeeded', current_stage = 'publish', charge_usd = %s,
               finished_at = now(), updated_at = now()
 WHERE job_id = %s AND status NOT IN ('succeeded', 'failed', 'cancelled');

-- name: fail_job
-- current_stage becomes the stage that failed (its checkpoint is failed in the same
-- transaction, before this), not the last one that succeeded.
UPDATE job SET status = 'failed', error_code = %s, error = %s, finished_at = now(),
               updated_at = now(),
               current_stage = coalesce((SELECT s.stage FROM job_stage s
                                          WHERE s.job_id = job.job_id AND s.status = 'failed'
                                          ORDER BY s.updated_at DESC LIMIT 1), current_stage)
 WHERE job_id = %s AND status NOT IN ('succeeded', 'failed', 'cancelled');

-- name: cancel_job
-- current_stage becomes the stage the cancel stopped (cancel_stage, in the same transaction,
-- before this), not the last one that succeeded; a job cancelled between stages keeps it.
UPDATE job SET status = 'cancelled', error_code = 'cancelled_by_user', finished_at = now(),
               updated_at = now(),
               current_stage = coalesce((SELECT s.stage FROM job_stage s
                                          WHERE s.job_id = job.job_id AND s.status = 'failed'
                                            AND s.error_code = 'cancelled_by_user'
                                          ORDER BY s.updated_at DESC LIMIT 1), current_stage)
 WHERE job_id = %s AND status NOT IN ('succeeded', 'failed', 'cancelled');

-- name: get_document
SELECT content, content_type FROM document WHERE tenant_id = %s AND sha256 = %s;

-- name: insert_chunks
-- A chunk stage's chunks in one statement (was one INSERT per chunk through executemany, i.e.
-- psycopg's pipeline machinery even for one chunk); arrays in binary (%b): no text escaping.
INSERT INTO chunk (job_id, idx, char_start, char_end, text, text_sha256)
SELECT %b::uuid, x.* FROM unnest(%b::integer[], %b::integer[], %b::integer[], %b::text[],
                                 %b::text[]) AS x;

-- name: delete_chunks
DELETE FROM chunk WHERE job_id = %s;

-- name: list_chunks
SELECT idx, text, text_sha256, llm_output FROM chunk WHERE job_id = %s ORDER BY idx;

-- name: save_chunk_output
-- Fenced: the chunk's model output is kept only while this run still owns the LLM stage.
UPDATE chunk c SET llm_output = %(output)s, llm_attempt_id = %(attempt_id)s
 WHERE c.job_id = %(job_id)s AND c.idx = %(idx)s AND c.llm_output IS NULL
   AND EXISTS (SELECT 1 FROM job_stage s
                WHERE s.job_id = c.job_id AND s.stage = 'llm'
                  AND s.run_token = %(run_token)s AND s.status = 'running')
   AND EXISTS (SELECT 1 FROM job j WHERE j.job_id = c.job_id
                AND j.generation = %(generation)s);

-- name: start_provider_attempt
-- Written (and committed) before the request is sent: a crash mid-call leaves 'started'. Not
-- written once the job's cancel is committed: FOR SHARE serialises it with the cancel's UPDATE,
-- so no provider call starts after a committed cancel.
-- Fenced: only while the run owns the stage under the job's generation (else no row, and the
-- caller asks start_attempt_blocker why).
INSERT INTO provider_attempt (job_id, stage, chunk_idx, attempt, run_token, model_profile, model,
                              est_cost_usd)
SELECT j.job_id, %(stage)s, %(chunk_idx)s, %(attempt)s, %(run_token)s, %(model_profile)s,
       %(model)s, %(est_cost_usd)s
  FROM job j
 WHERE j.job_id = %(job_id)s AND NOT j.cancel_requested AND j.generation = %(generation)s
   AND EXISTS (SELECT 1 FROM job_stage s WHERE s.job_id = j.job_id AND s.stage = %(stage)s
                AND s.run_token = %(run_token)s AND s.status = 'running')
   FOR SHARE OF j
RETURNING attempt_id;

-- name: finish_provider_attempt
-- A finished attempt keeps its outcome; an 'abandoned' one (closed while its run was paused)
-- takes the real outcome and cost when the answer arrives after all.
UPDATE provider_attempt
   SET outcome = %(outcome)s, status_code = %(status_code)s, latency_ms = %(latency_ms)s,
       prompt_tokens = %(prompt_tokens)s, completion_tokens = %(completion_tokens)s,
       cost_usd = %(cost_usd)s, error = %(error)s, finished_at = now()
 WHERE attempt_id = %(attempt_id)s AND outcome IN ('started', 'abandoned');

-- name: abandon_attempt
-- The run stopped its own call because it was fenced: unknown outcome, billed at the estimate.
UPDATE provider_attempt
   SET outcome = 'abandoned', cost_usd = est_cost_usd, finished_at = now(),
       error = 'call stopped: the run was fenced off'
 WHERE attempt_id = %s AND outcome = 'started';

-- name: count_provider_attempts
SELECT count(*) AS n FROM provider_attempt WHERE job_id = %s AND stage = %s AND chunk_idx = %s;

-- name: job_provider_cost
SELECT coalesce(sum(cost_usd), 0)::float8 AS cost_usd FROM provider_attempt WHERE job_id = %s;

-- ---------------------------------------------------------------- idempotent consumer

-- name: complete_stage_emit
-- Issue 12 (perf-worker4): a stage's whole completion in ONE round trip: the fenced
-- checkpoint, the job's advance (or, with a charge, its success: what succeed_job does), the
-- next event's outbox row and the idempotent-consumer row. The job advances and the two rows
-- are written only when the fenced UPDATE took the checkpoint; ``completed`` = 0 means a newer
-- run owns the stage (the caller raises StaleRun and rolls back). ``recorded`` = 0: the
-- processed_event row already existed (not expected: the claim checked it under the job lock).
-- Issue 12 (perf-stage7): Store._complete_in adds complete_stage_emit_chunks_cte and
-- complete_stage_emit_answers_cte after ``recorded`` for the runs that write chunks or
-- local answers (only then: each data-modifying CTE opens its table and indexes at every
-- execution, rows or not).
WITH done AS (
    UPDATE job_stage
       SET status = 'succeeded', output = %(output)s, input_hash = %(input_hash)s,
           code_version = %(code_version)s, cost_usd = %(cost_usd)s, emitted = %(emitted)s,
           lease_until = NULL, finished_at = now(), updated_at = now()
     WHERE job_id = %(job_id)s AND stage = %(stage)s AND run_token = %(run_token)s
       AND status = 'running'
    RETURNING job_id),
advanced AS (
    UPDATE job
       SET status = CASE WHEN %(charge_usd)s::numeric IS NULL THEN 'running'
                         ELSE 'succeeded' END,
           current_stage = %(stage)s, cost_usd = cost_usd + %(cost_usd)s,
           charge_usd = coalesce(%(charge_usd)s::numeric, charge_usd),
           finished_at = CASE WHEN %(charge_usd)s::numeric IS NULL THEN finished_at
                              ELSE now() END,
           updated_at = now()
     WHERE job_id IN (SELECT job_id FROM done)
       AND status NOT IN ('succeeded', 'failed', 'cancelled')),
emitted_row AS (
    INSERT INTO outbox (topic, kafka_key, payload, headers, event_id, event_type)
    SELECT %(topic)s, %(kafka_key)s, %(payload)s, %(headers)s, %(next_event_id)s,
           %(next_event_type)s
      FROM done),
recorded AS (
    INSERT INTO processed_event (key_digest, consumer_group, dedup_key, event_type, event_id,
                                 job_id)
    SELECT processed_event_key(%(group)s, %(event_type)s, %(dedup_key)s), %(group)s,
           %(dedup_key)s, %(event_type)s, %(event_id)s, job_id
      FROM done
    ON CONFLICT (key_digest) DO NOTHING
    RETURNING 1)
SELECT (SELECT count(*) FROM done)::int AS completed,
       (SELECT count(*) FROM recorded)::int AS recorded;

-- name: complete_stage_emit_chunks_cte
-- Not a statement: a CTE Store._complete_in puts into complete_stage_emit (after ``recorded``)
-- for a chunk stage's first run (issue 12, perf-stage7): its chunks (the %(chunk_*)s arrays,
-- binary) written with the completion, fenced like the checkpoint (only when ``done`` took
-- it). A re-run deletes the old chunks and writes its own with insert_chunks after the
-- completion. One statement less per job.
chunked AS (
    INSERT INTO chunk (job_id, idx, char_start, char_end, text, text_sha256)
    SELECT done.job_id, x.*
      FROM done, unnest(%(chunk_idx)b::integer[], %(chunk_start)b::integer[],
                        %(chunk_end)b::integer[], %(chunk_text)b::text[],
                        %(chunk_sha256)b::text[]) AS x)

-- name: complete_stage_emit_answers_cte
-- Not a statement: CTEs Store._complete_in puts into complete_stage_emit (after ``recorded``),
-- with ``answered`` added to its result, for a run that answered chunks in-process (issue 12,
-- perf-stage7; was one record_local_answer statement per chunk): %(local_answers)s, a jsonb
-- array of {idx, attempt, model, latency_ms, prompt_tokens, completion_tokens, cost_usd,
-- output}, each written as a 'succeeded' provider attempt and its chunk's output, kept only
-- if the chunk has none yet, fenced by ``done`` (the caller checked the generation under the
-- job lock). ``answered`` < the answers given: a chunk was answered meanwhile (the caller
-- raises StaleRun and rolls back). One statement less per job.
answers AS (
    SELECT * FROM jsonb_to_recordset(%(local_answers)s::jsonb)
        AS x(idx integer, attempt integer, model text, latency_ms float8,
             prompt_tokens integer, completion_tokens integer, cost_usd float8, output jsonb)),
attempted AS (
    INSERT INTO provider_attempt (job_id, stage, chunk_idx, attempt, run_token, model_profile,
                                  model, outcome, latency_ms, prompt_tokens,
                                  completion_tokens, cost_usd, finished_at)
    SELECT done.job_id, %(stage)s, x.idx, x.attempt, %(run_token)s, %(model_profile)s,
           x.model, 'succeeded', x.latency_ms, x.prompt_tokens, x.completion_tokens,
           x.cost_usd, now()
      FROM done, answers x
    RETURNING attempt_id, chunk_idx),
answered AS (
    UPDATE chunk c SET llm_output = x.output, llm_attempt_id = a.attempt_id
      FROM attempted a JOIN answers x ON x.idx = a.chunk_idx
     WHERE c.job_id = %(job_id)s AND c.idx = a.chunk_idx AND c.llm_output IS NULL
    RETURNING 1)

-- name: claim_job_and_stage
-- Issue 12 (perf-worker4): the job lock and the stage's claim in ONE round trip (were two).
-- The job row is locked (its latest version: READ COMMITTED re-reads it after a lock wait)
-- with whether this event was processed; the stage is claimed only when the claim would go on
-- past those checks (an event of the job's generation, not processed, a job
-- neither terminal, parked nor cancelled: the checks Store._claim_in makes on the row, in the
-- same order). ``claim_run_token`` NULL with the checks passed: the stage is leased, done or
-- terminal (the caller reads it with get_stage).
-- With %(idle_ms)s (ms as text; NULL: no limit) it also sets the transaction's idle limit
-- (one_transaction_idle_limit) from the moment the job row is locked: a process paused past
-- it loses its session, the lock with it (a separate statement before, one round trip per
-- transaction). Every stage claim passes it, also a two-transaction claim (robust11).
-- Issue 12 (perf-stage7): with the claim made, it also returns what the stage reads
-- (%(reads)s: its READS, text[], '{}' for none) as r_document, r_previous_output, r_chunks and
-- r_budget, read by the VOLATILE stage_claim_reads (migration 0036) after the job row is
-- locked, with a fresh snapshot (was one statement per read).
-- breaker10: with %(idle_ms)s it also sets tcp_user_timeout (the server's TCP_USER_TIMEOUT,
-- Linux) to the same limit: a process frozen before it READ this statement's answer (the
-- document, up to 5 MiB, more than the socket buffers hold) leaves the session active in
-- ClientWrite, where no idle limit applies; unacknowledged data for that long ends it
-- (tests/e2e/test_break_claim_reads_frozen.py). Both limits end with the transaction.
-- policy12: only an event of the job's OWN generation claims (was ``>=``): an older one is
-- superseded, a newer one is poison (``generation_ahead``, Store._claim_in): a redrive bumps
-- the generation in the transaction that writes its event, so no legitimate event is ahead
-- of its job, and a forged one taken as current carried its generation downstream, out of
-- reach of every redrive's and give_up's fence (breaker11).
WITH j AS (
    SELECT j.*, EXISTS (SELECT 1 FROM processed_event p
                         WHERE p.key_digest = processed_event_key(%(group)s, %(event_type)s,
                                                                  %(dedup_key)s)) AS processed
      FROM job j WHERE j.job_id = %(job_id)s FOR UPDATE OF j),
c AS (
    INSERT INTO job_stage (job_id, stage, status, attempt, run_token, lease_until, started_at)
    SELECT j.job_id, %(stage)s, 'running', 1, %(run_token)s,
           now() + make_interval(secs => %(lease_s)s), now()
      FROM j
     WHERE %(generation)s = j.generation AND NOT j.processed
       AND j.status NOT IN ('succeeded', 'failed', 'cancelled', 'needs_reconciliation')
       AND NOT j.cancel_requested
    ON CONFLICT (job_id, stage) DO UPDATE
       SET status = 'running', attempt = job_stage.attempt + 1, run_token = EXCLUDED.run_token,
           lease_until = EXCLUDED.lease_until, started_at = now(), updated_at = now(),
           error_code = NULL, error = NULL,
           lease_takeovers = job_stage.lease_takeovers + (job_stage.status = 'running')::int
     WHERE job_stage.status = 'pending'
        OR (job_stage.status = 'running' AND job_stage.lease_until < now())
        OR (job_stage.status = 'succeeded'
            AND job_stage.code_version IS DISTINCT FROM %(code_version)s)
    RETURNING attempt, run_token, lease_until)
SELECT j.*, c.attempt AS claim_attempt, c.run_token AS claim_run_token,
       c.lease_until AS claim_lease_until,
       CASE WHEN %(idle_ms)s::text IS NOT NULL
            THEN set_config('idle_in_transaction_session_timeout', %(idle_ms)s, true)
       END AS idle_limit,
       CASE WHEN %(idle_ms)s::text IS NOT NULL
            THEN set_config('tcp_user_timeout', %(idle_ms)s, true)
       END AS write_limit,
       r.r_document, r.r_previous_output, r.r_chunks, r.r_budget
  FROM j LEFT JOIN c ON true
       CROSS JOIN LATERAL stage_claim_reads(c.run_token IS NOT NULL, j.job_id, j.tenant_id,
                                            j.document_sha256, %(stage)s, %(reads)s::text[]) r;

-- name: record_processed
-- The idempotent-consumer row, in the same transaction as the effect. No row back = duplicate.
-- Parameters: group, dedup key, event type, event id, job id; keyed by their 16-byte
-- processed_event_key (migration 0026).
INSERT INTO processed_event (key_digest, consumer_group, dedup_key, event_type, event_id, job_id)
SELECT processed_event_key(v.g, v.t, v.k), v.g, v.k, v.t, v.e, v.j
  FROM (VALUES (%s::text, %s::text, %s::text, %s::uuid, %s::uuid)) AS v(g, k, t, e, j)
ON CONFLICT (key_digest) DO NOTHING
RETURNING 1 AS inserted;

-- name: record_processed_batch
-- The idempotent-consumer rows of a batch (distinct keys), in the transaction of the batch's
-- effects. Returns the keys that were new; the others are duplicates.
INSERT INTO processed_event (key_digest, consumer_group, dedup_key, event_type, event_id, job_id)
SELECT processed_event_key(g.g, u.event_type, u.dedup_key), g.g, u.dedup_key, u.event_type,
       u.event_id, u.job_id
  FROM (VALUES (%s::text)) AS g(g),
       unnest(%s::text[], %s::text[], %s::uuid[], %s::uuid[])
       AS u(dedup_key, event_type, event_id, job_id)
ON CONFLICT (key_digest) DO NOTHING
RETURNING dedup_key, event_type;

-- name: is_processed
-- Parameters: group, dedup key, event type.
SELECT 1 FROM processed_event
 WHERE key_digest = (SELECT processed_event_key(v.g, v.t, v.k)
                       FROM (VALUES (%s::text, %s::text, %s::text)) AS v(g, k, t));

-- ---------------------------------------------------------------- outbox

-- name: outbox_insert
INSERT INTO outbox (topic, kafka_key, payload, headers, event_id, event_type)
VALUES (%s, %s, %s, %s, %s, %s);

-- name: outbox_wake
-- The relay's wake-up after a commit that wrote outbox rows (Store, migration 0039): run in a
-- transaction of its own (autocommit), committed asynchronously: it changes no data, so it need
-- not wait for a WAL flush, and holds the notification queue's lock for microseconds instead of
-- through the writer's fsync. 'outbox_v1' is the relay's channel (outbox_relay.relay.CHANNEL).
SELECT set_config('synchronous_commit', 'off', true), pg_notify('outbox_v1', '');

-- name: job_trace_id
-- The trace of a job's events, for an outbox row written with no span in force.
SELECT trace_id FROM job WHERE job_id = %s;

-- name: set_job_trace_id
-- A job created before traces were recorded gets one on its first event written since.
UPDATE job SET trace_id = %s WHERE job_id = %s AND trace_id IS NULL;

-- name: outbox_fetch_after
-- Unpublished rows in id order after a floor (outbox_relay/relay.py, "the pipelined loop"):
-- the relay's last id while it drains a backlog (an index range scan that skips the entries
-- of rows marked since the last vacuum), else a floor a few seconds old, so that a
-- transaction that committed late with a lower id is still published on the next poll.
SELECT id, topic, kafka_key, payload, headers, event_type FROM outbox
 WHERE published_at IS NULL AND id > %s ORDER BY id LIMIT %s;

-- name: relay_session_async_commit
-- The relay's marks commit without waiting for the WAL flush: losing one in a crash only
-- re-publishes rows already delivered (at-least-once; consumers are idempotent).
SET synchronous_commit TO off;

-- name: relay_session_index_plans
-- The relay's sessions read and delete outbox rows by id only (an id list, or a range from an
-- id in id order with a LIMIT): every plan on them is an index scan in id order, whatever the
-- statistics said when the statement was prepared. psycopg prepares a statement at its 5th
-- execution and Postgres then keeps one generic plan, made while the outbox was as a relay
-- starts it (nearly empty, so a sequential scan looked cheapest), until the next ANALYZE:
-- through a burst that plan read the whole table three times per caught-up fetch (763-1,018
-- blocks per call; bench/README.md, "relay-plan9"). A bitmap scan is off too: it reads every
-- row in the range before the sort and LIMIT, the whole backlog for the rows after the last id.
SELECT set_config('enable_seqscan', 'off', false), set_config('enable_bitmapscan', 'off', false);

-- name: relay_park_sync_commit
-- Parking a row (dead_letter + failing its job) commits durably, as every stage write does.
SET LOCAL synchronous_commit TO on;

-- name: outbox_delete_published
-- The relay deletes the rows the broker acknowledged (migration 0022), and keeps the compact
-- outbox_published row its readers need; %(at)s is when the relay saw the acknowledgements.
WITH gone AS (DELETE FROM outbox WHERE id = ANY(%(ids)s::bigint[])
              RETURNING id, event_id, event_type, kafka_key, created_at)
INSERT INTO outbox_published (id, event_id, event_type, kafka_key, created_at, published_at)
SELECT id, event_id, event_type, kafka_key, created_at, %(at)s FROM gone;

-- name: outbox_delete_published_nolog
-- The same without the compact row (JOBSTREAM_RELAY_PUBLISHED_LOG=false).
DELETE FROM outbox WHERE id = ANY(%(ids)s::bigint[]);

-- name: outbox_delete_and_fetch
-- The relay caught up (outbox_relay/relay.py, "fewer transactions"): the rows acknowledged
-- since its last fetch are deleted and the next rows fetched in ONE statement (one round trip,
-- one transaction). The SELECTs see the snapshot taken before the DELETE: the rows being
-- deleted are in %(skip)s (or at or below %(hwm)s). Below the last id either the range from
-- the floor is read or, when the relay knows every id it read past without a row, those ids
-- (%(gaps)s) are probed and the range is empty (%(floor)s = %(hwm)s): the range walks the index
-- entries of every row deleted since the last vacuum (issue 12, perf-relay6). The range is
-- (%(floor)s, %(upto)s]: up to the last id, or, in the full rescan, up to the id above which the
-- relay knows every id it has not fetched (its gaps, probed; perf-relay7).
WITH gone AS (DELETE FROM outbox WHERE id = ANY(%(ids)s::bigint[])
              RETURNING id, event_id, event_type, kafka_key, created_at),
     kept AS (INSERT INTO outbox_published (id, event_id, event_type, kafka_key, created_at,
                                            published_at)
              SELECT id, event_id, event_type, kafka_key, created_at, %(at)s FROM gone
               WHERE %(log)s)
(SELECT id, topic, kafka_key, payload, headers, event_type FROM outbox
  WHERE published_at IS NULL AND id > %(floor)s AND id <= %(upto)s
    AND id <> ALL(%(skip)s::bigint[])
  ORDER BY id LIMIT %(n)s)
UNION ALL
(SELECT id, topic, kafka_key, payload, headers, event_type FROM outbox
  WHERE id = ANY(%(gaps)s::bigint[]) AND published_at IS NULL
    AND id <> ALL(%(skip)s::bigint[])
  ORDER BY id LIMIT %(n)s)
UNION ALL
(SELECT id, topic, kafka_key, payload, headers, event_type FROM outbox
  WHERE published_at IS NULL AND id > %(hwm)s ORDER BY id LIMIT %(n)s);

-- name: outbox_id_sequence_state
-- The relay's full rescan (perf-relay7): the outbox id sequence's last value (NULL before its
-- first nextval) and relfilenode (a new one after ALTER SEQUENCE ... RESTART): ids at or below
-- the relay's last id may be handed out again, so the rescan reads the whole range.
SELECT pg_sequence_last_value(pg_get_serial_sequence('outbox', 'id')::regclass) AS last_value,
       c.relfilenode::bigint AS filenode
  FROM pg_class c WHERE c.oid = pg_get_serial_sequence('outbox', 'id')::regclass;

-- name: relay_lock_session_timeout
-- The relay's lock session is ended by Postgres after %(ms)s milliseconds (text) idle, in or out
-- of a transaction: a relay frozen (SIGSTOP, VM pause) longer loses its advisory lock, so a
-- standby takes over instead of the outbox waiting for as long as the process is frozen.
-- tcp_user_timeout (breaker10; the server's TCP_USER_TIMEOUT, Linux): a relay frozen before
-- it read a big answer (a read-ahead of large rows) leaves the session active in ClientWrite,
-- where neither idle limit applies; data unacknowledged for %(ms)s ends it too
-- (tests/e2e/test_break_relay_readahead_frozen.py[big-rows]).
SELECT set_config('idle_session_timeout', %(ms)s, false),
       set_config('idle_in_transaction_session_timeout', %(ms)s, false),
       set_config('tcp_user_timeout', %(ms)s, false);

-- name: relay_touch
-- The active relay's sign of life on its lock session (see relay_lock_session_timeout).
SELECT 1 AS alive;

-- name: relay_try_lock
-- One active relay (others stand by): a session-level advisory lock held while relaying.
SELECT pg_try_advisory_lock(%s) AS locked;

-- name: outbox_backlog
SELECT count(*) AS n, coalesce(extract(epoch FROM now() - min(created_at)), 0) AS oldest_s
  FROM outbox WHERE published_at IS NULL;

-- ---------------------------------------------------------------- reporting

-- name: jobs_of_tenant
SELECT j.job_id, j.filename, j.status, j.current_stage, j.cost_usd, j.charge_usd, j.dedup_key,
       j.error_code, j.error,
       (SELECT count(*) FROM job_stage s WHERE s.job_id = j.job_id AND s.status = 'succeeded')
           AS stages_done,
       (SELECT count(*) FROM provider_attempt a WHERE a.job_id = j.job_id) AS provider_calls,
       (SELECT count(*) FROM chunk c WHERE c.job_id = j.job_id) AS chunks
  FROM job j WHERE j.tenant_id = %s ORDER BY j.created_at, j.filename;

-- name: requests_of_tenant
SELECT r.idempotency_key, r.job_id FROM job_request r WHERE r.tenant_id = %s;

-- name: applied_counts
-- How often the example downstream applied each dedup_key of a tenant (must be exactly 1).
SELECT j.dedup_key,
       (SELECT count(*) FROM downstream.document_analysis a
         WHERE a.tenant_id = j.tenant_id AND a.dedup_key = j.dedup_key) AS analyses,
       (SELECT count(*) FROM downstream.ledger_charge l
         WHERE l.tenant_id = j.tenant_id AND l.dedup_key = j.dedup_key) AS charges
  FROM job j WHERE j.tenant_id = %s AND j.status = 'succeeded';

-- name: apply_analysis
INSERT INTO downstream.document_analysis
       (tenant_id, dedup_key, job_id, filename, title, summary, keywords, fields)
VALUES (%s, %s, %s, %s, %s, %s, %s, %s);

-- name: apply_charge
INSERT INTO downstream.ledger_charge (tenant_id, dedup_key, job_id, amount_usd)
VALUES (%s, %s, %s, %s);

-- name: apply_analysis_batch
-- apply_analysis for a batch: one JSON array of rows (tenant_id, dedup_key, job_id, filename,
-- title, summary, keywords, fields), in array order.
INSERT INTO downstream.document_analysis
       (tenant_id, dedup_key, job_id, filename, title, summary, keywords, fields)
SELECT r.tenant_id, r.dedup_key, r.job_id, r.filename, r.title, r.summary,
       ARRAY(SELECT jsonb_array_elements_text(r.keywords)), r.fields
  FROM ROWS FROM (jsonb_to_recordset(%s::jsonb)
                  AS (tenant_id text, dedup_key text, job_id uuid, filename text, title text,
                      summary text, keywords jsonb, fields jsonb)) WITH ORDINALITY
       AS r(tenant_id, dedup_key, job_id, filename, title, summary, keywords, fields, ord)
 ORDER BY r.ord;

-- name: apply_charge_batch
-- apply_charge for a batch: one JSON array of rows (tenant_id, dedup_key, job_id, amount_usd).
INSERT INTO downstream.ledger_charge (tenant_id, dedup_key, job_id, amount_usd)
SELECT r.tenant_id, r.dedup_key, r.job_id, r.amount_usd
  FROM ROWS FROM (jsonb_to_recordset(%s::jsonb)
                  AS (tenant_id text, dedup_key text, job_id uuid, amount_usd numeric))
       WITH ORDINALITY AS r(tenant_id, dedup_key, job_id, amount_usd, ord)
 ORDER BY r.ord;

-- name: apply_analysis_rows
-- apply_analysis for a batch (the batch handler's fast path): one binary array of
-- downstream.ready_analysis_row (migration 0035), one row per event, in array order.
INSERT INTO downstream.document_analysis
       (tenant_id, dedup_key, job_id, filename, title, summary, keywords, fields)
SELECT * FROM unnest(%b::downstream.ready_analysis_row[]);

-- name: apply_charge_rows
-- apply_charge for a batch: one binary array of downstream.ready_charge_row, in array order.
INSERT INTO downstream.ledger_charge (tenant_id, dedup_key, job_id, amount_usd)
SELECT * FROM unnest(%b::downstream.ready_charge_row[]);

-- name: ready_row_type_oids
-- The oids of the ready applier's row types (an array's binary format names its element type).
SELECT to_regtype(%s)::oid AS analysis_row, to_regtype(%s)::oid AS charge_row;

-- name: stage_provider_cost
SELECT coalesce(sum(cost_usd), 0)::float8 AS cost_usd, count(*) AS calls
  FROM provider_attempt WHERE job_id = %s AND stage = %s;

-- ---------------------------------------------------------------- dead-letter replay

-- name: dlq_replay_try_lock
-- One replay per DLQ topic at a time: a session-level advisory lock (class, hashtext(topic)).
SELECT pg_try_advisory_lock(%s, hashtext(%s)) AS locked;

-- name: dlq_replayed_offsets
-- Offsets of one DLQ partition already replayed, within [from, to).
SELECT dlq_offset FROM dlq_replay
 WHERE dlq_topic = %s AND dlq_partition = %s AND dlq_offset >= %s AND dlq_offset < %s;

-- name: dlq_replay_record
-- Written after the broker acknowledged the re-produced message.
INSERT INTO dlq_replay (dlq_topic, dlq_partition, dlq_offset, reason_code, original_topic,
                        original_partition, original_offset, replayed_partition,
                        replayed_offset)
VALUES (%(dlq_topic)s, %(dlq_partition)s, %(dlq_offset)s, %(reason_code)s,
        %(original_topic)s, %(original_partition)s, %(original_offset)s,
        %(replayed_partition)s, %(replayed_offset)s)
ON CONFLICT (dlq_topic, dlq_partition, dlq_offset) DO NOTHING;

-- ---------------------------------------------------------------- HTTP API

-- name: api_job
SELECT j.job_id, j.tenant_id, j.status, j.current_stage, j.lane, j.filename, j.pipeline,
       j.prompt_version, j.model_profile, j.dedup_key, j.cancel_requested,
       j.cancel_requested_at, j.error_code, j.error, j.charge_usd, j.created_at,
       j.finished_at, j.generation,
       (SELECT min(s.started_at) FROM job_stage s
         WHERE s.job_id = j.job_id AND s.stage <> 'intake') AS first_started_at,
       (SELECT coalesce(sum(a.cost_usd), 0)::float8 FROM provider_attempt a
         WHERE a.job_id = j.job_id) AS cost_so_far_usd
  FROM job j WHERE j.job_id = %s AND j.tenant_id = %s;

-- name: api_job_stages
SELECT stage, status, attempt, code_version, started_at, finished_at, cost_usd::float8,
       error_code
  FROM job_stage WHERE job_id = %s;

-- name: api_job_attempts
SELECT chunk_idx, attempt, outcome, status_code, latency_ms, prompt_tokens,
       completion_tokens, cost_usd::float8, started_at, finished_at
  FROM provider_attempt WHERE job_id = %s ORDER BY attempt_id;

-- name: find_batch
SELECT batch_id, request_hash FROM batch WHERE tenant_id = %s AND idempotency_key = %s;

-- name: insert_batch
-- Nothing back when the (tenant, key) exists: a concurrent identical request replays it.
INSERT INTO batch (batch_id, tenant_id, idempotency_key, request_hash, lane)
VALUES (%s, %s, %s, %s, %s)
ON CONFLICT (tenant_id, idempotency_key) DO NOTHING
RETURNING batch_id;

-- name: insert_batch_job
INSERT INTO batch_job (batch_id, idx, job_id) VALUES (%s, %s, %s);

-- name: batch_job_ids
SELECT bj.job_id FROM batch_job bj JOIN batch b USING (batch_id)
 WHERE bj.batch_id = %s AND b.tenant_id = %s ORDER BY bj.idx;

-- name: api_batch
-- Counts per status and cost so far of one batch, in one query.
SELECT b.batch_id, b.lane, b.cancel_requested, b.created_at, count(*) AS jobs,
       count(*) FILTER (WHERE j.status = 'queued') AS queued,
       count(*) FILTER (WHERE j.status = 'running') AS running,
       count(*) FILTER (WHERE j.status = 'succeeded') AS succeeded,
       count(*) FILTER (WHERE j.status = 'failed') AS failed,
       count(*) FILTER (WHERE j.status = 'cancelled') AS cancelled,
       count(*) FILTER (WHERE j.status = 'needs_reconciliation') AS needs_reconciliation,
       coalesce(sum(c.cost), 0)::float8 AS cost_so_far_usd
  FROM batch b
  JOIN batch_job bj USING (batch_id)
  JOIN job j ON j.job_id = bj.job_id
  LEFT JOIN LATERAL (SELECT sum(a.cost_usd) AS cost FROM provider_attempt a
                      WHERE a.job_id = j.job_id) c ON true
 WHERE b.batch_id = %s AND b.tenant_id = %s
 GROUP BY b.batch_id;

-- ---------------------------------------------------------------- shared provider limit (AIMD)

-- name: limit_ensure
-- A new profile starts in slow start: the initial window, ssthresh at the ceiling.
INSERT INTO provider_limit (profile, limit_now, max_limit, interactive_reserved, ssthresh)
VALUES (%(profile)s, %(initial)s, %(max_limit)s, %(reserved)s, %(max_limit)s)
ON CONFLICT (profile) DO UPDATE SET max_limit = EXCLUDED.max_limit,
       interactive_reserved = EXCLUDED.interactive_reserved,
       limit_now = least(provider_limit.limit_now, EXCLUDED.max_limit),
       ssthresh = least(provider_limit.ssthresh, EXCLUDED.max_limit);

-- name: limit_lock
SELECT limit_now, max_limit, interactive_reserved FROM provider_limit WHERE profile = %s
   FOR UPDATE;

-- name: slots_expire
DELETE FROM provider_slot WHERE profile = %s AND expires_at < now();

-- name: slots_active
SELECT count(*) AS total, count(*) FILTER (WHERE lane = 'batch') AS batch
  FROM provider_slot WHERE profile = %s;

-- name: slot_insert
INSERT INTO provider_slot (profile, lane, job_id, expires_at)
VALUES (%s, %s, %s, now() + make_interval(secs => %s))
RETURNING slot_id;

-- name: slot_release
DELETE FROM provider_slot WHERE slot_id = %s;

-- name: limit_increase
-- A success (RFC 5681 §3.1): below ssthresh slow start, +1 (up to ssthresh); above it
-- congestion avoidance, +1/window (one slot per window's worth of successes). A call that was
-- in flight when the window last halved (slot_id <= recover_slot_id) does not grow it.
UPDATE provider_limit
   SET limit_now = least(max_limit, CASE WHEN limit_now < ssthresh
                                         THEN least(ssthresh, limit_now + 1)
                                         ELSE limit_now + 1.0 / greatest(limit_now, 1) END),
       updated_at = now()
 WHERE profile = %(profile)s AND %(slot_id)s > recover_slot_id;

-- name: limit_decrease
-- A 429 on a slot taken after the latest decrease (RFC 6582 §3.2 "recover"; once per window,
-- RFC 3168 §6.1.2): window and ssthresh become half the calls in flight (RFC 5681 eq. 4,
-- FlightSize/2, floor 1), and every call in flight now belongs to the answered overload. Run
-- with the profile's row locked (limit_lock) and before the slot is released, so the count
-- sees every slot taken so far, this one included.
UPDATE provider_limit l
   SET limit_now = greatest(1, least(l.limit_now, f.n) / 2.0),
       ssthresh = greatest(1, least(l.limit_now, f.n) / 2.0),
       recover_slot_id = f.last_slot_id, decreases = l.decreases + 1,
       last_decrease_at = now(), updated_at = now()
  FROM (SELECT count(*) AS n, coalesce(max(slot_id), 0) AS last_slot_id
          FROM provider_slot WHERE profile = %(profile)s) f
 WHERE l.profile = %(profile)s AND %(slot_id)s > l.recover_slot_id
RETURNING l.limit_now;

-- name: limit_state
SELECT profile, limit_now, max_limit, interactive_reserved, decreases,
       (SELECT count(*) FROM provider_slot s WHERE s.profile = l.profile
           AND s.expires_at > now()) AS in_flight
  FROM provider_limit l ORDER BY profile;

-- ---------------------------------------------------------------- metrics (read at scrape time)

-- name: metrics_read_only
-- A scrape only reads (first statement of its transaction).
SET TRANSACTION READ ONLY;

-- name: metrics_statement_timeout
-- Bound every statement of one scrape (milliseconds, this transaction only).
SELECT set_config('statement_timeout', %s, true);

-- name: metrics_jobs
-- Jobs per lane and status (jobs are never deleted, so the per-lane total only grows).
SELECT lane, status, count(*) AS n FROM job GROUP BY lane, status;

-- name: metrics_stage_runs
-- Stage runs per stage: every claim adds one to attempt, so runs = sum(attempt) and runs
-- that were a retry = sum(attempt - 1); lease takeovers as counted by claim_job_and_stage; running
-- stages whose lease has expired right now.
SELECT stage, coalesce(sum(attempt), 0)::bigint AS runs,
       coalesce(sum(greatest(attempt - 1, 0)), 0)::bigint AS retries,
       coalesce(sum(lease_takeovers), 0)::bigint AS lease_takeovers,
       count(*) FILTER (WHERE status = 'running' AND lease_until < now()) AS expired_now
  FROM job_stage WHERE stage <> 'intake' GROUP BY stage;

-- name: metrics_provider_attempts
-- Provider attempts per outcome and model profile, with their cost (USD) and how many the
-- provider answered 429.
SELECT outcome, model_profile, count(*) AS n, coalesce(sum(cost_usd), 0)::float8 AS cost_usd,
       count(*) FILTER (WHERE status_code = 429) AS rate_limited
  FROM provider_attempt GROUP BY outcome, model_profile;

-- name: metrics_stage_durations
-- Run time (finished_at - started_at, seconds) of stages that succeeded in the last
-- %(window_s)s seconds, per stage and lane, counted per bucket: idx = how many bucket bounds
-- (%(bounds)s, ascending) lie below the value, so the value is <= bounds[idx].
WITH d AS (
    SELECT s.stage, j.lane,
           greatest(extract(epoch FROM s.finished_at - s.started_at), 0)::float8 AS v
      FROM job_stage s JOIN job j USING (job_id)
     WHERE s.finished_at >= now() - make_interval(secs => %(window_s)s)
       AND s.status = 'succeeded' AND s.stage <> 'intake' AND s.started_at IS NOT NULL)
SELECT stage, lane,
       (SELECT count(*) FROM unnest(%(bounds)s::float8[]) AS b(le) WHERE b.le < d.v) AS idx,
       count(*) AS n, sum(v)::float8 AS sum_s
  FROM d GROUP BY stage, lane, idx;

-- name: metrics_provider_latency
-- Latency (seconds) of provider attempts that finished in the last %(window_s)s seconds, per
-- model profile and lane; buckets as in metrics_stage_durations.
WITH d AS (
    SELECT a.model_profile, j.lane, greatest(a.latency_ms / 1000.0, 0)::float8 AS v
      FROM provider_attempt a JOIN job j USING (job_id)
     WHERE a.finished_at >= now() - make_interval(secs => %(window_s)s)
       AND a.latency_ms IS NOT NULL)
SELECT model_profile, lane,
       (SELECT count(*) FROM unnest(%(bounds)s::float8[]) AS b(le) WHERE b.le < d.v) AS idx,
       count(*) AS n, sum(v)::float8 AS sum_s
  FROM d GROUP BY model_profile, lane, idx;

-- name: metrics_queue_waits
-- Queue wait (seconds) of stages that succeeded in the last %(window_s)s seconds: from the
-- previous checkpoint's finish (its event was written to the outbox) to this stage's latest
-- claim, per stage and lane; buckets as in metrics_stage_durations. %(stages)s and
-- %(prevs)s pair each stage with the one before it.
WITH pairs AS (SELECT * FROM unnest(%(stages)s::text[], %(prevs)s::text[]) AS p(stage, prev)),
d AS (
    SELECT s.stage, j.lane,
           greatest(extract(epoch FROM s.started_at - p.finished_at), 0)::float8 AS v
      FROM job_stage s
      JOIN pairs ON pairs.stage = s.stage
      JOIN job_stage p ON p.job_id = s.job_id AND p.stage = pairs.prev
      JOIN job j ON j.job_id = s.job_id
     WHERE s.finished_at >= now() - make_interval(secs => %(window_s)s)
       AND s.status = 'succeeded' AND s.started_at IS NOT NULL AND p.finished_at IS NOT NULL)
SELECT stage, lane,
       (SELECT count(*) FROM unnest(%(bounds)s::float8[]) AS b(le) WHERE b.le < d.v) AS idx,
       count(*) AS n, sum(v)::float8 AS sum_s
  FROM d GROUP BY stage, lane, idx;

-- ---------------------------------------------------------------- retention (jobstream gc)
-- Each deletes at most %(limit)s rows older than %(horizon_s)s seconds, oldest first, so one
-- transaction stays short; the caller repeats until fewer come back.

-- name: gc_outbox
-- Published outbox rows: never read again once the broker acknowledged them (the relay reads
-- published_at IS NULL only). Unpublished rows are never deleted, however old.
DELETE FROM outbox WHERE id IN (
    SELECT id FROM outbox
     WHERE published_at IS NOT NULL
       AND published_at < now() - make_interval(secs => %(horizon_s)s)
     ORDER BY published_at LIMIT %(limit)s);

-- name: gc_outbox_published
-- The compact rows of published events (migration 0022), oldest first.
DELETE FROM outbox_published WHERE ctid IN (
    SELECT ctid FROM outbox_published
     WHERE published_at < now() - make_interval(secs => %(horizon_s)s)
     ORDER BY published_at LIMIT %(limit)s);

-- name: gc_processed_event
-- Idempotent-consumer rows older than every redelivery window (checked against the topics'
-- retention by the caller).
DELETE FROM processed_event WHERE key_digest IN (
    SELECT key_digest FROM processed_event
     WHERE processed_at < now() - make_interval(secs => %(horizon_s)s)
     ORDER BY processed_at LIMIT %(limit)s);

-- name: gc_job_request
-- Idempotency records of jobs that finished long ago, themselves old. A job still open (or
-- parked) keeps every record. The job row keeps its first key and request hash.
DELETE FROM job_request WHERE (tenant_id, idempotency_key) IN (
    SELECT r.tenant_id, r.idempotency_key FROM job_request r JOIN job j USING (job_id)
     WHERE r.created_at < now() - make_interval(secs => %(horizon_s)s)
       AND j.status IN ('succeeded', 'failed', 'cancelled')
       AND j.finished_at < now() - make_interval(secs => %(horizon_s)s)
     ORDER BY r.created_at LIMIT %(limit)s);

-- ---------------------------------------------------------------- invariants (jobstream chaos)

-- name: inv_jobs
-- Every intent of a tenant and the job it maps to.
SELECT r.idempotency_key, j.job_id, j.status, j.dedup_key, j.current_stage, j.error_code
  FROM job_request r JOIN job j USING (job_id)
 WHERE r.tenant_id = %s ORDER BY r.idempotency_key;

-- name: inv_stages
SELECT s.job_id, s.stage, s.status, s.attempt, s.run_token, s.finished_at
  FROM job_stage s JOIN job j USING (job_id) WHERE j.tenant_id = %s;

-- name: inv_chunks
SELECT c.job_id, c.idx, c.llm_output IS NOT NULL AS answered, c.llm_attempt_id
  FROM chunk c JOIN job j USING (job_id) WHERE j.tenant_id = %s;

-- name: inv_attempts
SELECT a.attempt_id, a.job_id, a.stage, a.chunk_idx, a.attempt, a.run_token, a.outcome,
       a.started_at
  FROM provider_attempt a JOIN job j USING (job_id) WHERE j.tenant_id = %s;

-- name: inv_outbox
-- The outbox rows of a tenant's jobs (the Kafka key is the job id), with the event's job
-- generation (a re-drive writes the stage's input event again, one generation up).
-- Published rows are in outbox_published (migration 0022), which keeps no payload: their
-- generation is NULL here and read from the event on the topic by the caller.
SELECT o.id, o.event_id, o.event_type, o.kafka_key, o.published_at IS NOT NULL AS published,
       coalesce((convert_from(o.payload, 'UTF8')::jsonb ->> 'generation')::int, 0)
           AS generation
  FROM outbox o JOIN job j ON o.kafka_key = j.job_id::text WHERE j.tenant_id = %(tenant)s
UNION ALL
SELECT p.id, p.event_id, p.event_type, p.kafka_key, true, NULL
  FROM outbox_published p JOIN job j ON p.kafka_key = j.job_id::text
 WHERE j.tenant_id = %(tenant)s;

-- name: inv_processed
SELECT p.consumer_group, p.dedup_key, p.event_type, p.event_id, p.job_id
  FROM processed_event p JOIN job j USING (job_id) WHERE j.tenant_id = %s;

-- name: inv_analyses
SELECT dedup_key, count(*) AS n FROM downstream.document_analysis
 WHERE tenant_id = %s GROUP BY dedup_key;

-- name: inv_charges
SELECT dedup_key, count(*) AS n FROM downstream.ledger_charge
 WHERE tenant_id = %s GROUP BY dedup_key;

-- ---------------------------------------------------------------- jobstream verify (read-only)
-- Every query takes %(tenant)s (NULL: all tenants) and returns at most 1000 rows.

-- name: verify_applied_twice
-- Example downstream: a dedup_key whose analysis or ledger charge exists more than once.
SELECT 'downstream.ledger_charge' AS what, tenant_id, dedup_key, count(*) AS n,
       array_agg(DISTINCT job_id::text) AS job_ids
  FROM downstream.ledger_charge
 WHERE %(tenant)s::text IS NULL OR tenant_id = %(tenant)s
 GROUP BY tenant_id, dedup_key HAVING count(*) > 1
UNION ALL
SELECT 'downstream.document_analysis', tenant_id, dedup_key, count(*),
       array_agg(DISTINCT job_id::text)
  FROM downstream.document_analysis
 WHERE %(tenant)s::text IS NULL OR tenant_id = %(tenant)s
 GROUP BY tenant_id, dedup_key HAVING count(*) > 1
 LIMIT 1000;

-- name: verify_not_applied
-- Example downstream: jobs succeeded longer than the grace ago that it never applied.
SELECT j.job_id, j.finished_at FROM job j
 WHERE j.status = 'succeeded' AND j.finished_at < now() - make_interval(secs => %(grace_s)s)
   AND (%(tenant)s::text IS NULL OR j.tenant_id = %(tenant)s)
   AND NOT EXISTS (SELECT 1 FROM downstream.document_analysis a
                    WHERE a.tenant_id = j.tenant_id AND a.dedup_key = j.dedup_key)
 ORDER BY j.finished_at LIMIT 1000;

-- name: verify_stuck_jobs
-- Open jobs (not parked for reconciliation) with no live lease, no unpublished event and no
-- progress (job, stage or outbox) for the grace: nothing will move them.
SELECT j.job_id, j.status, j.current_stage, j.updated_at FROM job j
 WHERE j.status IN ('queued', 'running')
   AND (%(tenant)s::text IS NULL OR j.tenant_id = %(tenant)s)
   AND j.updated_at < now() - make_interval(secs => %(grace_s)s)
   AND NOT EXISTS (SELECT 1 FROM job_stage s WHERE s.job_id = j.job_id
                      AND ((s.status = 'running' AND s.lease_until > now())
                           OR s.updated_at > now() - make_interval(secs => %(grace_s)s)))
   AND NOT EXISTS (SELECT 1 FROM outbox o WHERE o.kafka_key = j.job_id::text
                      AND (o.published_at IS NULL
                           OR o.published_at > now() - make_interval(secs => %(grace_s)s)))
   AND NOT EXISTS (SELECT 1 FROM outbox_published p WHERE p.kafka_key = j.job_id::text
                      AND p.published_at > now() - make_interval(secs => %(grace_s)s))
 ORDER BY j.updated_at LIMIT 1000;

-- name: verify_stranded_stages
-- A stage that succeeded longer than the grace ago while its job is open and the next stage
-- was never claimed (row missing or pending). %(stages)s is the checkpoint chain in order.
SELECT s.job_id, s.stage, s.finished_at,
       (%(stages)s::text[])[array_position(%(stages)s::text[], s.stage) + 1] AS next_stage
  FROM job_stage s JOIN job j USING (job_id)
 WHERE s.status = 'succeeded' AND j.status IN ('queued', 'running')
   AND (%(tenant)s::text IS NULL OR j.tenant_id = %(tenant)s)
   AND array_position(%(stages)s::text[], s.stage) < array_length(%(stages)s::text[], 1)
   AND s.finished_at < now() - make_interval(secs => %(grace_s)s)
   AND j.updated_at < now() - make_interval(secs => %(grace_s)s)
   AND NOT EXISTS (
       SELECT 1 FROM job_stage n WHERE n.job_id = s.job_id AND n.status <> 'pending'
          AND n.stage = (%(stages)s::text[])[array_position(%(stages)s::text[], s.stage) + 1])
 ORDER BY s.finished_at LIMIT 1000;

-- name: verify_orphan_attempts
-- Provider attempts still 'started' whose run no longer holds a live lease on its stage.
SELECT a.attempt_id, a.job_id, a.stage, a.chunk_idx, a.started_at,
       s.status AS stage_status, s.run_token = a.run_token AS same_run
  FROM provider_attempt a JOIN job j USING (job_id)
  LEFT JOIN job_stage s ON s.job_id = a.job_id AND s.stage = a.stage
 WHERE a.outcome = 'started'
   AND (%(tenant)s::text IS NULL OR j.tenant_id = %(tenant)s)
   AND a.started_at < now() - make_interval(secs => %(grace_s)s)
   AND (s.run_token IS DISTINCT FROM a.run_token OR s.status <> 'running'
        OR s.lease_until < now())
 ORDER BY a.attempt_id LIMIT 1000;

-- name: verify_outbox_unpublished
-- Outbox rows not published longer than the bound after they were written.
SELECT o.id, o.event_type, o.kafka_key, o.created_at FROM outbox o
 WHERE o.published_at IS NULL
   AND o.created_at < now() - make_interval(secs => %(outbox_age_s)s)
   AND (%(tenant)s::text IS NULL OR EXISTS (
        SELECT 1 FROM job j WHERE j.job_id::text = o.kafka_key AND j.tenant_id = %(tenant)s))
 ORDER BY o.id LIMIT 1000;

-- name: verify_paid_twice
-- Chunks with more than one succeeded (billed) provider attempt, with what tells why.
SELECT a.job_id, a.chunk_idx, count(*) AS n, sum(a.cost_usd) AS cost_usd,
       count(DISTINCT a.run_token) AS runs,
       array_agg(a.attempt_id ORDER BY a.attempt_id) AS attempt_ids,
       bool_or(EXISTS (SELECT 1 FROM provider_attempt b
                        WHERE b.job_id = a.job_id AND b.chunk_idx = a.chunk_idx
                          AND b.outcome = 'succeeded' AND b.attempt_id <> a.attempt_id
                          AND b.started_at < a.finished_at
                          AND a.started_at < b.finished_at)) AS overlapping
  FROM provider_attempt a JOIN job j USING (job_id)
 WHERE a.outcome = 'succeeded' AND a.chunk_idx IS NOT NULL
   AND (%(tenant)s::text IS NULL OR j.tenant_id = %(tenant)s)
 GROUP BY a.job_id, a.chunk_idx HAVING count(*) > 1
 ORDER BY a.job_id, a.chunk_idx LIMIT 1000;

-- name: health_probe
-- Readiness: can this process get a connection and run a statement?
SELECT 1 AS ok;

-- ---------------------------------------------------------------- debezium relay (0013)

-- name: debezium_triggers
-- Which of the outbox's Debezium triggers are enabled (tgenabled 'D' = disabled).
SELECT tgname AS name, tgenabled <> 'D' AS enabled FROM pg_trigger
 WHERE tgrelid = 'outbox'::regclass AND tgname IN ('outbox_headers_v1', 'outbox_forget_v1');

-- name: debezium_enable_headers
ALTER TABLE outbox ENABLE TRIGGER outbox_headers_v1;

-- name: debezium_enable_forget
ALTER TABLE outbox ENABLE TRIGGER outbox_forget_v1;

-- name: debezium_disable_triggers
ALTER TABLE outbox DISABLE TRIGGER outbox_forget_v1, DISABLE TRIGGER outbox_headers_v1;

-- name: debezium_publication_exists
SELECT 1 FROM pg_publication WHERE pubname = %s;

-- name: debezium_publication_tables
-- The tables a publication carries (must be exactly the outbox).
SELECT schemaname || '.' || tablename AS t FROM pg_publication_tables WHERE pubname = %s;

-- name: debezium_handover
-- Rows the Python relay left unpublished are re-inserted (same id order, same bytes), so the
-- connector streams them: logical decoding only sees rows inserted after the slot existed.
-- The triggers fill their header columns and delete them again in this transaction.
WITH moved AS (
    DELETE FROM outbox WHERE published_at IS NULL
    RETURNING id, topic, kafka_key, payload, headers, event_id, event_type, created_at)
INSERT INTO outbox (topic, kafka_key, payload, headers, event_id, event_type, created_at)
SELECT topic, kafka_key, payload, headers, event_id, event_type, created_at
  FROM moved ORDER BY id;

-- name: replication_slots
-- Logical replication slots of this database: whether a walsender uses them, and the WAL
-- they hold back (bytes between the server's current LSN and what the consumer confirmed).
SELECT slot_name AS slot, active, wal_status,
       coalesce(pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn), 0)::bigint
           AS retained_bytes,
       coalesce(pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn), 0)::bigint
           AS unconfirmed_bytes
  FROM pg_replication_slots
 WHERE database = current_database() AND slot_type = 'logical'
 ORDER BY slot_name;

-- name: replication_slot_drop
SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots
 WHERE slot_name = %s AND NOT active;

-- name: relay_lock_holders
-- Sessions holding the active-relay advisory lock (a running Python relay).
SELECT count(*) AS n FROM pg_locks
 WHERE locktype = 'advisory' AND granted AND database = (
     SELECT oid FROM pg_database WHERE datname = current_database())
   AND objsubid = 1 AND ((classid::bigint << 32) | objid::bigint) = %s;

-- ---------------------------------------------------------------- dead-letter store (0008)

-- name: dead_letter_insert
-- Keep a dead letter in Postgres (its DLQ produce failed, or the relay cannot deliver it).
-- A redelivered message (same group and position, or same outbox row) keeps its first row.
INSERT INTO dead_letter (source, consumer_group, topic, consumed_topic, kafka_partition,
                         kafka_offset, outbox_id, job_id, kafka_key, value, header_names, header_values,
                         reason_code, reason, dlq_error)
VALUES (%(source)s, %(consumer_group)s, %(topic)s, %(consumed_topic)s, %(partition)s, %(offset)s, %(outbox_id)s,
        %(job_id)s, %(key)s, %(value)s, %(header_names)s, %(header_values)s, %(reason_code)s,
        %(reason)s, %(dlq_error)s)
ON CONFLICT DO NOTHING
RETURNING id;

-- name: dead_letter_find
-- The row an earlier delivery of the same message wrote.
SELECT id FROM dead_letter
 WHERE consumer_group = %s AND consumed_topic = %s AND kafka_partition = %s
   AND kafka_offset = %s;

-- name: dead_letter_find_outbox
SELECT id FROM dead_letter WHERE outbox_id = %s;

-- name: dead_letter_list
-- Dead letters kept in Postgres, oldest first: of some topics (full names), or (topics NULL)
-- of every topic with the prefix.
SELECT id, source, consumer_group, topic, consumed_topic, kafka_partition, kafka_offset,
       outbox_id, job_id, kafka_key, value, header_names, header_values, reason_code, reason,
       dlq_error, created_at, replayed_at, replayed_partition, replayed_offset
  FROM dead_letter
 WHERE CASE WHEN %(topics)s::text[] IS NULL THEN starts_with(topic, %(prefix)s)
            ELSE topic = ANY(%(topics)s::text[]) END
 ORDER BY id LIMIT %(limit)s;

-- name: dead_letter_mark_replayed
-- Written after the broker acknowledged the re-produced copy.
UPDATE dead_letter SET replayed_at = now(), replayed_partition = %s, replayed_offset = %s
 WHERE id = %s AND replayed_at IS NULL;

-- name: outbox_park
-- The relay moves an undeliverable row to dead_letter (same transaction): it is never fetched
-- again.
DELETE FROM outbox WHERE id = %s AND published_at IS NULL RETURNING id;

-- name: fail_open_stages
-- A job whose event could not be delivered: its open stages end failed.
UPDATE job_stage SET status = 'failed', error_code = %s, error = %s, lease_until = NULL,
                     finished_at = now(), updated_at = now()
 WHERE job_id = %s AND status IN ('pending', 'running');

-- name: metrics_dead_letters
-- Dead letters kept in Postgres and not replayed yet, per who stored them and why.
SELECT source, reason_code, count(*) AS n FROM dead_letter
 WHERE replayed_at IS NULL GROUP BY source, reason_code;
