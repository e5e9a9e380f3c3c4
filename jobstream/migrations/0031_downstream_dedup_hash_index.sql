-- The example downstream's (jobstream/ready_applier.py) lookup indexes on dedup_key become hash
-- indexes on dedup_key alone instead of btrees on (tenant_id, dedup_key). The btree entry held
-- the tenant and the 64-character dedup key (~135 bytes per row in each table); a hash index
-- entry holds a 4-byte hash code (~60 bytes per row with the page overhead). Measured with
-- bench.consumer_pg (bench/README.md, "Idempotent consumer", fourth pass): Postgres CPU per
-- applied job.ready ~18-21 -> ~15-16 us, WAL ~2.6-2.9 -> ~2.3-2.4 KB. What the indexes served
-- still works: an equality lookup by dedup_key (verify_not_applied's NOT EXISTS, an operator's
-- "was this charged?") uses the hash index; the tenant-wide counts (inv_*, verify_applied_twice)
-- scan the table, as they did for a NULL tenant. Exactly-once never relied on these indexes
-- (migration 0002: no unique constraint here on purpose; processed_event decides).
-- CREATE INDEX takes a SHARE lock: the ready applier's inserts wait while it builds.

DROP INDEX downstream.document_analysis_dedup;
CREATE INDEX document_analysis_dedup ON downstream.document_analysis USING hash (dedup_key);

DROP INDEX downstream.ledger_charge_dedup;
CREATE INDEX ledger_charge_dedup ON downstream.ledger_charge USING hash (dedup_key);
