-- The Python relay deletes an outbox row once the broker acknowledged it, instead of marking
-- it (UPDATE published_at): a DELETE logs the row's key, an UPDATE with wal_level=logical the
-- whole ~1 KB row, and the table no longer grows with published rows waiting for retention
-- (bench/README.md, "Relay: delete instead of mark"). What readers need of a published row
-- (the crash-matrix invariants, `jobstream verify`, bench.pipeline's relay hop) is kept in
-- outbox_published, a compact row (~100 bytes, no payload, no headers, no index but a BRIN on
-- published_at), written by the same statement that deletes the outbox row
-- (JOBSTREAM_RELAY_PUBLISHED_LOG=false leaves it out). Retention deletes it after
-- outbox_retention_s, as it did the published outbox rows.
CREATE TABLE outbox_published (
    id           bigint      NOT NULL,  -- the outbox row's id
    event_id     uuid        NOT NULL,
    event_type   text        NOT NULL,
    kafka_key    text,
    created_at   timestamptz NOT NULL,  -- the outbox row's created_at
    published_at timestamptz NOT NULL   -- when the relay saw the broker's acknowledgement
);
CREATE INDEX outbox_published_at_brin ON outbox_published USING brin (published_at);
ALTER TABLE outbox_published SET (autovacuum_vacuum_insert_scale_factor = 0,
                                  autovacuum_vacuum_insert_threshold = 100000);

-- Rows marked by the relay before this migration move over (an older relay still running
-- during a rolling upgrade keeps marking; its rows are skipped by the new relay, which reads
-- published_at IS NULL, and retention still deletes them).
INSERT INTO outbox_published (id, event_id, event_type, kafka_key, created_at, published_at)
SELECT id, event_id, event_type, kafka_key, created_at, published_at
  FROM outbox WHERE published_at IS NOT NULL ORDER BY published_at;
DELETE FROM outbox WHERE published_at IS NOT NULL;

-- Every outbox row is now unpublished: the partial index of unpublished rows duplicated the
-- primary key (one more index entry per insert, and per vacuum); the relay reads by primary
-- key. The partial index of published rows stays: it holds only rows an older relay marked
-- (costs an insert nothing) and keeps retention's gc_outbox from scanning the whole outbox.
DROP INDEX outbox_unpublished;
