-- The Postgres dead-letter store (issue 9, docs/design-notes.md "A dead letter is never lost").
-- A consumer writes a row when producing a poison message to <topic>.dlq failed (too large,
-- refused, broker away past dlq_produce_timeout_s); the relay writes one for an outbox row the
-- broker can never take (too large, refused, unserialisable) and deletes that outbox row in the
-- same transaction. Rows keep the original bytes and headers; `jobstream dlq list|replay`
-- read them next to the <topic>.dlq topics.

CREATE TABLE dead_letter (
    id                 bigserial   PRIMARY KEY,
    source             text        NOT NULL CHECK (source IN ('consumer', 'relay')),
    consumer_group     text        NOT NULL DEFAULT '',  -- '' for the relay
    topic              text        NOT NULL,  -- full name of its topic (replay goes there)
    consumed_topic     text,                   -- consumer: where it was read (topic or .retry)
    kafka_partition    integer,                -- consumer: where it was read
    kafka_offset       bigint,
    outbox_id          bigint,                 -- relay: the outbox row it replaces
    job_id             uuid,
    kafka_key          bytea,
    value              bytea,
    header_names       text[]      NOT NULL DEFAULT '{}',
    header_values      bytea[]     NOT NULL DEFAULT '{}',  -- NULL elements: null headers
    reason_code        text        NOT NULL,
    reason             text        NOT NULL,
    dlq_error          text,       -- why <topic>.dlq did not take it (or the broker's refusal)
    created_at         timestamptz NOT NULL DEFAULT now(),
    replayed_at        timestamptz,
    replayed_partition integer,
    replayed_offset    bigint
);
-- A redelivered poison message is stored once per consumer group.
CREATE UNIQUE INDEX dead_letter_position ON dead_letter (consumer_group, consumed_topic,
                                                         kafka_partition, kafka_offset)
    WHERE kafka_partition IS NOT NULL;
CREATE UNIQUE INDEX dead_letter_outbox ON dead_letter (outbox_id) WHERE outbox_id IS NOT NULL;
CREATE INDEX dead_letter_topic ON dead_letter (topic, id);

-- One event id is one event: a message that reuses an event id with other content (another
-- dedup key or event type) is refused by the idempotent consumer (event_id_conflict).
CREATE UNIQUE INDEX processed_event_event_id ON processed_event (consumer_group, event_id);
