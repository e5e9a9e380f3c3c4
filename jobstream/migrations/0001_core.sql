-- jobstream core schema: documents, jobs, idempotency records, stage checkpoints, chunks,
-- the provider call log, the transactional outbox and the idempotent-consumer table.

CREATE TABLE document (
    tenant_id     text        NOT NULL,
    sha256        text        NOT NULL,
    content_type  text        NOT NULL,
    size_bytes    bigint      NOT NULL CHECK (size_bytes >= 0),
    content       bytea       NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, sha256)
);

CREATE TABLE job (
    job_id           uuid        PRIMARY KEY,
    tenant_id        text        NOT NULL,
    idempotency_key  text        NOT NULL,          -- the first client intent that created it
    request_hash     text        NOT NULL,
    dedup_key        text        NOT NULL,
    request_id       text        NOT NULL,
    document_sha256  text        NOT NULL,
    filename         text        NOT NULL,
    content_type     text        NOT NULL,
    pipeline         text        NOT NULL,
    prompt_version   text        NOT NULL,
    model_profile    text        NOT NULL,
    lane             text        NOT NULL CHECK (lane IN ('interactive', 'batch')),
    status           text        NOT NULL DEFAULT 'queued'
                     CHECK (status IN ('queued', 'running', 'succeeded', 'failed', 'cancelled')),
    current_stage    text        NOT NULL DEFAULT 'uploaded',
    cancel_requested boolean     NOT NULL DEFAULT false,
    error_code       text,
    error            text,
    cost_usd         numeric(14, 8) NOT NULL DEFAULT 0,
    charge_usd       numeric(14, 8) NOT NULL DEFAULT 0,
    created_at       timestamptz NOT NULL DEFAULT now(),
    updated_at       timestamptz NOT NULL DEFAULT now(),
    finished_at      timestamptz,
    UNIQUE (tenant_id, idempotency_key),
    FOREIGN KEY (tenant_id, document_sha256) REFERENCES document (tenant_id, sha256)
);
-- One computation, one job: this subsumes "one success per dedup_key" (docs/design-notes.md).
CREATE UNIQUE INDEX job_one_per_dedup_key ON job (tenant_id, dedup_key);
CREATE INDEX job_status ON job (status) WHERE status IN ('queued', 'running');

-- Idempotency records: every (tenant, idempotency_key) a client used, and the job it maps to.
CREATE TABLE job_request (
    tenant_id        text        NOT NULL,
    idempotency_key  text        NOT NULL,
    request_hash     text        NOT NULL,
    job_id           uuid        NOT NULL REFERENCES job (job_id) ON DELETE CASCADE,
    request_id       text        NOT NULL,
    created_at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, idempotency_key)
);
CREATE INDEX job_request_job ON job_request (job_id);

-- Stage checkpoints: uploaded -> text_extracted -> chunks_ready -> llm_done -> validated -> published
CREATE TABLE job_stage (
    job_id        uuid        NOT NULL REFERENCES job (job_id) ON DELETE CASCADE,
    stage         text        NOT NULL CHECK (stage IN ('uploaded', 'text_extracted',
                              'chunks_ready', 'llm_done', 'validated', 'published')),
    status        text        NOT NULL DEFAULT 'pending'
                  CHECK (status IN ('pending', 'running', 'succeeded', 'failed')),
    attempt       integer     NOT NULL DEFAULT 0,
    run_token     uuid,                              -- fencing token of the current run
    lease_until   timestamptz,
    input_hash    text,
    code_version  text,
    output        jsonb,
    error_code    text,
    error         text,
    cost_usd      numeric(14, 8) NOT NULL DEFAULT 0,
    started_at    timestamptz,
    finished_at   timestamptz,
    updated_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (job_id, stage)
);
CREATE INDEX job_stage_running_lease ON job_stage (lease_until) WHERE status = 'running';

CREATE TABLE chunk (
    job_id       uuid    NOT NULL REFERENCES job (job_id) ON DELETE CASCADE,
    idx          integer NOT NULL CHECK (idx >= 0),
    char_start   integer NOT NULL,
    char_end     integer NOT NULL,
    text         text    NOT NULL,
    text_sha256  text    NOT NULL,
    llm_output   jsonb,
    llm_attempt_id bigint,
    PRIMARY KEY (job_id, idx)
);

-- The provider call log: one row per attempt, written before the request is sent.
CREATE TABLE provider_attempt (
    attempt_id        bigserial   PRIMARY KEY,
    job_id            uuid        NOT NULL REFERENCES job (job_id) ON DELETE CASCADE,
    stage             text        NOT NULL,
    chunk_idx         integer,
    attempt           integer     NOT NULL,
    run_token         uuid        NOT NULL,
    model_profile     text        NOT NULL,
    model             text        NOT NULL,
    outcome           text        NOT NULL DEFAULT 'started'
                      CHECK (outcome IN ('started', 'succeeded', 'transient_error',
                             'permanent_error', 'outcome_unknown', 'cancelled')),
    status_code       integer,
    latency_ms        double precision,
    prompt_tokens     integer,
    completion_tokens integer,
    cost_usd          numeric(14, 8) NOT NULL DEFAULT 0,
    error             text,
    started_at        timestamptz NOT NULL DEFAULT now(),
    finished_at       timestamptz
);
CREATE INDEX provider_attempt_job ON provider_attempt (job_id, stage, chunk_idx);

-- Transactional outbox: written in the same transaction as the state change it announces.
CREATE TABLE outbox (
    id             bigserial   PRIMARY KEY,
    topic          text        NOT NULL,
    kafka_key      text,
    payload        bytea       NOT NULL,
    headers        jsonb       NOT NULL DEFAULT '{}'::jsonb,
    event_id       uuid        NOT NULL,
    event_type     text        NOT NULL,
    created_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    published_at   timestamptz
);
CREATE INDEX outbox_unpublished ON outbox (id) WHERE published_at IS NULL;
CREATE INDEX outbox_published_at ON outbox (published_at) WHERE published_at IS NOT NULL;

-- Wake the relay on commit (NOTIFY is delivered at commit, never for a rolled-back insert).
CREATE FUNCTION outbox_notify_v1() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('outbox_v1', '');
    RETURN NULL;
END $$;
CREATE TRIGGER outbox_notify_v1 AFTER INSERT ON outbox
    FOR EACH STATEMENT EXECUTE FUNCTION outbox_notify_v1();

-- Idempotent-consumer table: (consumer group, dedup_key, event type) once per effect.
CREATE TABLE processed_event (
    consumer_group  text        NOT NULL,
    dedup_key       text        NOT NULL,
    event_type      text        NOT NULL,
    event_id        uuid        NOT NULL,
    job_id          uuid,
    processed_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer_group, dedup_key, event_type)
);
CREATE INDEX processed_event_processed_at ON processed_event (processed_at);
