-- The consumer library's tables (consumers.ddl.create_tables runs this file).
-- Placeholders are psycopg.sql identifiers, never string formatting: {schema}, {processed}
-- (schema-qualified processed_event table), {processed_at_idx}, {event_id_idx},
-- {dead_letter} (schema-qualified dead_letter table), {dl_position_idx}, {dl_outbox_idx},
-- {dl_topic_idx}. Idempotent: safe to run at every start.

CREATE SCHEMA IF NOT EXISTS {schema};

-- The idempotent consumer's table: (consumer group, dedup key, event type) once per effect,
-- written in the same transaction as the effect. Its primary key is key_digest, a fixed-width
-- digest of the three (the first 16 bytes of sha256(group || 0x00 || event_type || 0x00 ||
-- dedup_key), UTF-8; consumers.ddl.key_digest): a 16-byte key instead of ~100 bytes of text
-- makes the insert and the duplicate probe cheaper (bench/README.md). The readable columns
-- stay for operators; look a key up with the digest expression (docs/design-notes.md).
-- Tables created before this shape (primary key on the three columns) keep working; convert
-- them with consumers.ddl.upgrade_tables (consumers/sql/upgrade_key_digest.sql).
CREATE TABLE IF NOT EXISTS {processed} (
    key_digest      bytea       PRIMARY KEY,
    consumer_group  text        NOT NULL,
    dedup_key       text        NOT NULL,
    event_type      text        NOT NULL,
    event_id        uuid        NOT NULL,
    job_id          uuid,
    processed_at    timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS {processed_at_idx} ON {processed} (processed_at);
-- One event id is one event: reusing it with other content is event_id_conflict (poison).
CREATE UNIQUE INDEX IF NOT EXISTS {event_id_idx} ON {processed} (consumer_group, event_id);

-- Dead letters <topic>.dlq did not take (too large, refused, broker away): never lost.
-- Same shape as jobstream's migration 0008, so `jobstream dlq list|replay` can read it.
CREATE TABLE IF NOT EXISTS {dead_letter} (
    id                 bigserial   PRIMARY KEY,
    source             text        NOT NULL CHECK (source IN ('consumer', 'relay')),
    consumer_group     text        NOT NULL DEFAULT '',
    topic              text        NOT NULL,
    consumed_topic     text,
    kafka_partition    integer,
    kafka_offset       bigint,
    outbox_id          bigint,
    job_id             uuid,
    kafka_key          bytea,
    value              bytea,
    header_names       text[]      NOT NULL DEFAULT '{{}}',
    header_values      bytea[]     NOT NULL DEFAULT '{{}}',
    reason_code        text        NOT NULL,
    reason             text        NOT NULL,
    dlq_error          text,
    created_at         timestamptz NOT NULL DEFAULT now(),
    replayed_at        timestamptz,
    replayed_partition integer,
    replayed_offset    bigint
);
CREATE UNIQUE INDEX IF NOT EXISTS {dl_position_idx} ON {dead_letter} (
    consumer_group, consumed_topic, kafka_partition, kafka_offset)
    WHERE kafka_partition IS NOT NULL;
CREATE UNIQUE INDEX IF NOT EXISTS {dl_outbox_idx} ON {dead_letter} (outbox_id)
    WHERE outbox_id IS NOT NULL;
CREATE INDEX IF NOT EXISTS {dl_topic_idx} ON {dead_letter} (topic, id);
