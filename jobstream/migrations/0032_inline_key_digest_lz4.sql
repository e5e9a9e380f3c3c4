-- Issue 12 (perf-pg5): two things Postgres did on every stage transaction that cost CPU and
-- bought nothing (bench/README.md, "Postgres and the broker per job").
--
-- 1. processed_event_key (migration 0026) was declared IMMUTABLE while its body calls
--    convert_to(), which Postgres marks STABLE. The planner inlines a SQL function only when
--    its body is no more volatile than its declaration, so every call went through fmgr_sql:
--    the body parsed and planned again in each statement that used it (the claim's "was this
--    event processed" probe and the completion's processed_event insert, ~9 calls per job),
--    4.5 % of the Postgres backends' CPU in a perf profile of bench.pipeline. Declared
--    STABLE, the call is replaced by its expression at planning (the same bytes: a test
--    compares the SQL digest with consumers.ddl.key_digest). No index, constraint or generated
--    column uses the function, which is what IMMUTABLE would be needed for.
CREATE OR REPLACE FUNCTION processed_event_key(consumer_group text, event_type text,
                                               dedup_key text)
    RETURNS bytea LANGUAGE sql STABLE STRICT PARALLEL SAFE
    RETURN substr(sha256(convert_to(consumer_group, 'UTF8') || '\x00'::bytea
                         || convert_to(event_type, 'UTF8') || '\x00'::bytea
                         || convert_to(dedup_key, 'UTF8')), 1, 16);

-- 2. Values over ~2 KB (a document, its chunk's text, a stage's output, an event's payload)
--    were compressed with pglz, Postgres' default and its slowest codec (pglz_compress was
--    ~1.2 % of the backends' CPU). lz4 compresses several times faster at a similar ratio.
--    Only values written from now on use it; older ones stay readable as they are. A
--    catalog change only: no rewrite, a brief ACCESS EXCLUSIVE lock per table.
ALTER TABLE document ALTER COLUMN content SET COMPRESSION lz4;
ALTER TABLE chunk ALTER COLUMN text SET COMPRESSION lz4;
ALTER TABLE chunk ALTER COLUMN llm_output SET COMPRESSION lz4;
ALTER TABLE job_stage ALTER COLUMN output SET COMPRESSION lz4;
ALTER TABLE outbox ALTER COLUMN payload SET COMPRESSION lz4;
