-- The provider concurrency limit shared by every worker of both lanes (AIMD), kept in Postgres
-- so all processes see it: one row per remote model profile, one row per call in flight.

CREATE TABLE provider_limit (
    profile              text             PRIMARY KEY,
    limit_now            double precision NOT NULL,  -- the AIMD window: calls allowed in flight
    max_limit            integer          NOT NULL,
    interactive_reserved integer          NOT NULL,
    decreases            bigint           NOT NULL DEFAULT 0,
    last_decrease_at     timestamptz      NOT NULL DEFAULT '-infinity',
    updated_at           timestamptz      NOT NULL DEFAULT now()
);

CREATE TABLE provider_slot (
    slot_id     bigserial   PRIMARY KEY,
    profile     text        NOT NULL,
    lane        text        NOT NULL CHECK (lane IN ('interactive', 'batch')),
    job_id      uuid,
    acquired_at timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz NOT NULL               -- a crashed holder's slot frees itself
);
CREATE INDEX provider_slot_profile ON provider_slot (profile, expires_at);
