-- The example downstream service (consumers/ready_applier.py) keeps its own tables in its own
-- schema. They deliberately carry NO unique constraint on dedup_key: exactly-once application
-- is the idempotent consumer's job (processed_event in the same transaction), and tests count
-- rows here to prove it rather than leaning on a constraint that would hide a double apply.

CREATE SCHEMA IF NOT EXISTS downstream;

CREATE TABLE downstream.document_analysis (
    id          bigserial   PRIMARY KEY,
    tenant_id   text        NOT NULL,
    dedup_key   text        NOT NULL,
    job_id      uuid        NOT NULL,
    filename    text        NOT NULL,
    title       text        NOT NULL,
    summary     text        NOT NULL,
    keywords    text[]      NOT NULL,
    fields      jsonb       NOT NULL,
    applied_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX document_analysis_dedup ON downstream.document_analysis (tenant_id, dedup_key);

CREATE TABLE downstream.ledger_charge (
    id          bigserial      PRIMARY KEY,
    tenant_id   text           NOT NULL,
    dedup_key   text           NOT NULL,
    job_id      uuid           NOT NULL,
    amount_usd  numeric(14, 8) NOT NULL,
    charged_at  timestamptz    NOT NULL DEFAULT now()
);
CREATE INDEX ledger_charge_dedup ON downstream.ledger_charge (tenant_id, dedup_key);
