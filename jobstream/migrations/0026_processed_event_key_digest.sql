-- jobstream's own processed_event on the 16-byte key_digest, like the consumer library's tables
-- (consumers/sql/consumer.sql): the stage agents' and the ready applier's idempotent-consumer
-- rows are keyed by the first 16 bytes of sha256(group || 0x00 || event_type || 0x00 ||
-- dedup_key) over UTF-8 (consumers.ddl.key_digest) instead of the ~100 bytes of text of
-- (consumer_group, dedup_key, event_type). The readable columns stay. Every existing row gets
-- its digest, so a copy of an event applied before the upgrade is still a duplicate after it
-- (tests/integration/test_processed_event_key_digest.py). The table is rewritten under an
-- ACCESS EXCLUSIVE lock (about a second per million rows): jobstream's processes wait for it.

-- The digest in SQL: the queries of jobstream/sql/queries.sql use it, so the stage agents
-- pass the same three values as before; the consumer library computes the same bytes in
-- Python. IMMUTABLE: the digest of given strings never changes (the database is UTF-8).
CREATE FUNCTION processed_event_key(consumer_group text, event_type text, dedup_key text)
    RETURNS bytea LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    RETURN substr(sha256(convert_to(consumer_group, 'UTF8') || '\x00'::bytea
                         || convert_to(event_type, 'UTF8') || '\x00'::bytea
                         || convert_to(dedup_key, 'UTF8')), 1, 16);

LOCK TABLE processed_event IN ACCESS EXCLUSIVE MODE;
ALTER TABLE processed_event ADD COLUMN key_digest bytea;
UPDATE processed_event SET key_digest = processed_event_key(consumer_group, event_type, dedup_key);
ALTER TABLE processed_event ALTER COLUMN key_digest SET NOT NULL;
CREATE UNIQUE INDEX processed_event_key_digest ON processed_event (key_digest);
ALTER TABLE processed_event DROP CONSTRAINT processed_event_pkey;
ALTER TABLE processed_event ADD PRIMARY KEY USING INDEX processed_event_key_digest;
