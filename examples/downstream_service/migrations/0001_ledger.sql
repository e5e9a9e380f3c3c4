-- The downstream service's own table, in its own schema ({schema}: a psycopg.sql.Identifier).
-- One charge per job.ready: the consumer library's processed_event row (same transaction)
-- makes a redelivered or re-published event a no-op, and the unique dedup_key is a second
-- line of defence.
CREATE SCHEMA IF NOT EXISTS {schema};

CREATE TABLE IF NOT EXISTS {ledger} (
    id          bigserial     PRIMARY KEY,
    tenant_id   text          NOT NULL,
    dedup_key   text          NOT NULL UNIQUE,
    job_id      uuid          NOT NULL,
    filename    text          NOT NULL,
    amount_usd  numeric(12,6) NOT NULL CHECK (amount_usd >= 0),
    charged_at  timestamptz   NOT NULL DEFAULT now()
);
