-- Issue 12 (perf-stage7): what a stage reads (its module's READS: the document, the previous
-- checkpoint's output, the job's chunks, the provider budget) comes back with the claim's own
-- statement (claim_job_and_stage) instead of one more statement each: one round trip and one
-- Postgres statement less per stage run, six per job (bench/README.md, "Stage workers,
-- perf-stage7").
--
-- Why a function, and why VOLATILE: in READ COMMITTED a statement reads with the snapshot
-- taken when it started, BEFORE its FOR UPDATE waited for the job's row lock; a subquery of
-- the claim statement would miss what the lock holder committed meanwhile (a re-run of the
-- previous stage rewriting its output, a provider attempt recorded). A VOLATILE function takes
-- a fresh snapshot for each query it runs, and the claim calls it after the job row is locked
-- (tests/integration/test_stage_claim_reads.py holds the lock, commits a new output and
-- checks that the waiting claim reads it). plpgsql keeps each query's plan for the session.
--
-- claimed: false (the claim was not made: duplicate, leased, terminal...) reads nothing.
-- reads: the stage's READS ('document', 'output:<stage>', 'chunks', 'budget'); another
-- name raises (SQLSTATE 22023).
-- Returns r_document (the document's bytes), r_previous_output (the output of the named
-- stage's checkpoint when it succeeded, else NULL), r_chunks (jsonb array of {idx, text,
-- text_sha256, llm_output} in idx order), r_budget (jsonb: attempts {"idx": n} of this stage
-- per chunk, stage_attempts, stage_cost_usd, cost_usd: the job_provider_budget query's).
CREATE OR REPLACE FUNCTION stage_claim_reads(
        claimed boolean, p_job_id uuid, p_tenant_id text, p_document_sha256 text,
        p_stage text, p_reads text[],
        OUT r_document bytea, OUT r_previous_output jsonb, OUT r_chunks jsonb,
        OUT r_budget jsonb)
    LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    what text;
BEGIN
    IF NOT coalesce(claimed, false) OR p_reads IS NULL THEN
        RETURN;
    END IF;
    FOREACH what IN ARRAY p_reads LOOP
        IF what = 'document' THEN
            SELECT d.content INTO r_document FROM document d
             WHERE d.tenant_id = p_tenant_id AND d.sha256 = p_document_sha256;
        ELSIF what LIKE 'output:%' THEN
            SELECT s.output INTO r_previous_output FROM job_stage s
             WHERE s.job_id = p_job_id AND s.stage = substr(what, 8)
               AND s.status = 'succeeded';
        ELSIF what = 'chunks' THEN
            SELECT coalesce(jsonb_agg(jsonb_build_object(
                       'idx', c.idx, 'text', c.text, 'text_sha256', c.text_sha256,
                       'llm_output', c.llm_output) ORDER BY c.idx), '[]'::jsonb)
              INTO r_chunks FROM chunk c WHERE c.job_id = p_job_id;
        ELSIF what = 'budget' THEN
            SELECT jsonb_build_object(
                       'attempts', coalesce(jsonb_object_agg(a.chunk_idx, a.n)
                                            FILTER (WHERE a.chunk_idx IS NOT NULL
                                                    AND a.n > 0), '{}'::jsonb),
                       'stage_attempts', coalesce(sum(a.n), 0)::int,
                       'stage_cost_usd', coalesce(sum(a.stage_cost), 0)::float8,
                       'cost_usd', coalesce(sum(a.cost), 0)::float8)
              INTO r_budget
              FROM (SELECT pa.chunk_idx, count(*) FILTER (WHERE pa.stage = p_stage) AS n,
                           coalesce(sum(pa.cost_usd) FILTER (WHERE pa.stage = p_stage), 0)
                               AS stage_cost,
                           sum(pa.cost_usd) AS cost
                      FROM provider_attempt pa WHERE pa.job_id = p_job_id
                     GROUP BY pa.chunk_idx) a;
        ELSE
            RAISE EXCEPTION 'unknown stage read %', what USING ERRCODE = '22023';
        END IF;
    END LOOP;
END $$;
