-- The outbox trigger NOTIFYs on every commit again, as in 0001_core, and the arming flag of
-- migration 0025 is gone. 0025 let an opt-in relay setting (relay_notify_below_rate) silence
-- writers' NOTIFYs while rows came fast (a NOTIFY serialises the commits of every transaction
-- that sends one, server-wide) and poll instead; measured twice (bench/README.md, "Relay, fourth
-- pass"), the polling relay's commit -> broker p99 was 2.5-20x worse at ~1k commits/s and the
-- writers committed no faster on this machine, so the opt-in path was removed rather than kept
-- dead. The trigger's read of the flag goes with it (one sequence read per outbox statement).
-- Stop relays older than this migration before applying it: they set the flag when they take
-- the relay lock.
CREATE OR REPLACE FUNCTION outbox_notify_v1() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('outbox_v1', '');
    RETURN NULL;
END $$;

DROP SEQUENCE IF EXISTS outbox_relay_armed;
