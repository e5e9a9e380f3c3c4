-- A NOTIFY serialises the commits of every transaction that sends one: PostgreSQL takes a
-- server-wide lock in PreCommit_Notify and holds it until the commit record is flushed, so
-- notifying transactions cannot share a WAL flush (group commit). Measured on the shared 2-core
-- server (bench/README.md, "Relay, third pass"): ten writer processes committing one row each
-- reached 0.9-2.1k commits/s with the outbox's NOTIFY trigger against 4.2-4.9k/s without, and
-- the committing writers spent their time in `Lock:object` waits. The outbox trigger now
-- notifies only while the relay is *armed* (outbox_relay_armed = 1, a sequence: read and set
-- outside transactions, so a writer sees the relay's latest word at once). With
-- JOBSTREAM_RELAY_NOTIFY_BELOW_RATE > 0 the active relay disarms it (0) while rows arrive faster
-- than that and polls every relay_in_flight_wait_s instead, and re-arms it when they slow down
-- (docs/design-notes.md, "NOTIFY only while the relay waits"; off by default: see
-- bench/README.md). It starts armed, and every relay arms it when it takes the lock: a relay
-- that does not know the flag, and the default, get a NOTIFY per commit as before.
CREATE SEQUENCE outbox_relay_armed MINVALUE 0 MAXVALUE 1 START 1;

CREATE OR REPLACE FUNCTION outbox_notify_v1() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF (SELECT last_value FROM outbox_relay_armed) <> 0 THEN
        PERFORM pg_notify('outbox_v1', '');
    END IF;
    RETURN NULL;
END $$;
