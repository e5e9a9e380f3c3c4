-- Dead-letter replays (jobstream dlq replay, jobstream/dlq.py): one row per message of a
-- <topic>.dlq topic that was re-produced to its original topic. A row is written only after the
-- broker acknowledged the re-produced message, and a message with a row is never replayed
-- again. Rows are keyed by the DLQ message's position, so messages left out by one replay's
-- filter stay replayable by another (docs/design-notes.md, "Replaying the DLQ").

CREATE TABLE dlq_replay (
    dlq_topic          text        NOT NULL,
    dlq_partition      integer     NOT NULL CHECK (dlq_partition >= 0),
    dlq_offset         bigint      NOT NULL CHECK (dlq_offset >= 0),
    reason_code        text,                    -- dlq_reason_code header at replay time
    original_topic     text        NOT NULL,    -- where it was re-produced (dlq_original_topic)
    original_partition integer,
    original_offset    bigint,
    replayed_partition integer     NOT NULL,    -- where the re-produced copy landed
    replayed_offset    bigint      NOT NULL,
    replayed_at        timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (dlq_topic, dlq_partition, dlq_offset)
);
