-- Issue 12 (pg12): the document's text stored once less. A text/plain document's extract
-- checkpoint (job_stage.output) held {"text": <the whole text>}, a second copy of
-- document.content (2.1 KB of WAL per job in perf-pg9's burst: a TOAST insert, its index
-- entry, the jsonb built and compressed). The text of a text/plain document is a pure function
-- of its bytes (jobstream.textproc.plain_text), so the extract stage now writes only its
-- digest and size, and the chunk stage derives the text again from the document, checked
-- against that digest (streams/chunk.py). A PDF's checkpoint keeps its text (parsing is the
-- expensive part).
--
-- stage_claim_reads (migration 0036) gets one more read for that: 'document:if-no-text', the
-- document's bytes (r_document) only when the previous checkpoint read before it in p_reads
-- ('output:<stage>') succeeded and holds no "text" key: the chunk stage of a PDF job reads no
-- document (up to 5 MiB), and a checkpoint written before this migration (with its text)
-- still reads as before. Everything else as in 0036.
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
        ELSIF what = 'document:if-no-text' THEN
            -- After an 'output:<stage>' read: the document only when that checkpoint holds no
            -- "text" (a text/plain extract checkpoint, which no longer stores its text).
            IF r_previous_output IS NOT NULL AND NOT r_previous_output ? 'text' THEN
                SELECT d.content INTO r_document FROM document d
                 WHERE d.tenant_id = p_tenant_id AND d.sha256 = p_document_sha256;
            END IF;
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
