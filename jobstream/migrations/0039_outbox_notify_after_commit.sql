-- The outbox trigger's NOTIFY is skipped in a session that wakes the relay after its commits
-- instead (issue 12, perf-notify9): jobstream's own pools set the session setting
-- jobstream.outbox_notify = 'after_commit' at connect (Store, setting outbox_notify), and send
-- pg_notify('outbox_v1', '') in a transaction of their own, committed asynchronously, once a
-- transaction that wrote outbox rows has committed (queries.sql outbox_wake). A transaction that
-- NOTIFYs takes the notification queue's lock before its commit record and holds it through its
-- WAL flush, so every notifying commit in the cluster waited for the previous one's fsync
-- (bench/README.md, relay eighth pass: 182-584 commits/s with the NOTIFY in the transaction,
-- 698-1,836 with it after the commit). Every other session (the relay's own connection, an older
-- jobstream, another tool writing the outbox) gets the NOTIFY in its transaction, as before. A
-- wake-up lost (a writer killed between its commit and its NOTIFY) leaves the row to the relay's
-- poll (relay_poll_interval_s). Old code on this schema: its sessions do not set the setting, so
-- they notify as before; new code on the old schema: a NOTIFY in the transaction and one after
-- it, harmless.
CREATE OR REPLACE FUNCTION outbox_notify_v1() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('jobstream.outbox_notify', true) IS DISTINCT FROM 'after_commit' THEN
        PERFORM pg_notify('outbox_v1', '');
    END IF;
    RETURN NULL;
END $$;
