-- The HTTP API: batches (one client intent for up to 1000 documents) and cancellation facts.

CREATE TABLE batch (
    batch_id         uuid        PRIMARY KEY,
    tenant_id        text        NOT NULL,
    idempotency_key  text        NOT NULL,
    request_hash     text        NOT NULL,
    lane             text        NOT NULL CHECK (lane IN ('interactive', 'batch')),
    cancel_requested boolean     NOT NULL DEFAULT false,
    created_at       timestamptz NOT NULL DEFAULT now(),
    UNIQUE (tenant_id, idempotency_key)
);

-- A job is one computation (one per dedup key), so it may belong to several batches.
CREATE TABLE batch_job (
    batch_id  uuid    NOT NULL REFERENCES batch (batch_id) ON DELETE CASCADE,
    idx       integer NOT NULL,
    job_id    uuid    NOT NULL REFERENCES job (job_id) ON DELETE CASCADE,
    PRIMARY KEY (batch_id, idx)
);
CREATE INDEX batch_job_job ON batch_job (job_id);

-- "Cancelled by user" (the request, on the job) and "external call cancelled" (an in-flight
-- provider attempt aborted: provider_attempt.outcome = 'cancelled') are separate facts.
ALTER TABLE job ADD COLUMN cancel_requested_at timestamptz;
