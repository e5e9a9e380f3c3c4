-- The shared provider limit (AIMD) gets TCP's slow start and its "one decrease per window" rule
-- (jobstream/limiter.py): ``ssthresh`` splits slow start (+1 per success) from congestion
-- avoidance (+1/window per success); ``recover_slot_id`` is the last slot that was in flight at
-- the latest decrease (NewReno's "recover", RFC 6582): a 429 on a slot up to it is part of the
-- overload already answered, not a new one.
-- Existing rows keep congestion avoidance at their current window (ssthresh = limit_now).

ALTER TABLE provider_limit
    ADD COLUMN ssthresh        double precision,
    ADD COLUMN recover_slot_id bigint NOT NULL DEFAULT 0;
UPDATE provider_limit SET ssthresh = limit_now;
ALTER TABLE provider_limit ALTER COLUMN ssthresh SET NOT NULL;
