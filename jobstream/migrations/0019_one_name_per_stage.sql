-- One name per stage (issue 8): a stage's checkpoint is named like the stage itself
-- (schemas/pipeline.py), no longer after the fact it establishes:
--   uploaded -> intake, text_extracted -> extract, chunks_ready -> chunk, llm_done -> llm,
--   validated -> validate, published -> publish.
-- Existing rows are renamed in place: checkpoints, the job's current stage, the provider call
-- log, and the stage groups' idempotent-consumer rows (group ``<prefix>jobstream-<stage>``),
-- so an event redelivered after the upgrade is still recognised as processed.
-- Events already in the outbox or on Kafka are unaffected: they carry event types (topics),
-- not stage names; a job.failed written before the upgrade keeps the old name in its payload.

CREATE TEMPORARY TABLE stage_rename (old text PRIMARY KEY, new text NOT NULL) ON COMMIT DROP;
INSERT INTO stage_rename VALUES
    ('uploaded', 'intake'), ('text_extracted', 'extract'), ('chunks_ready', 'chunk'),
    ('llm_done', 'llm'), ('validated', 'validate'), ('published', 'publish');

ALTER TABLE job_stage DROP CONSTRAINT job_stage_stage_check;
UPDATE job_stage s SET stage = r.new FROM stage_rename r WHERE s.stage = r.old;
ALTER TABLE job_stage ADD CONSTRAINT job_stage_stage_check CHECK (stage IN (
    'intake', 'extract', 'chunk', 'llm', 'validate', 'publish'));

ALTER TABLE job ALTER COLUMN current_stage SET DEFAULT 'intake';
UPDATE job j SET current_stage = r.new FROM stage_rename r WHERE j.current_stage = r.old;

UPDATE provider_attempt a SET stage = r.new FROM stage_rename r WHERE a.stage = r.old;

UPDATE processed_event p
   SET consumer_group = left(p.consumer_group, length(p.consumer_group) - length(r.old)) || r.new
  FROM stage_rename r
 WHERE p.consumer_group LIKE '%jobstream-' || r.old;
