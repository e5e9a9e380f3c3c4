-- The outbox is a queue table: every row is inserted, updated once (marked published) and
-- deleted by retention. With the default autovacuum settings (20 % of the table dead) a large
-- outbox is vacuumed rarely, and until then the partial index of unpublished rows keeps an
-- entry for every row marked since, which a fetch from a low id walks past (bench/README.md:
-- 0.7 -> 3.5 ms per 500-row fetch after 500k marks). Vacuum it after a fixed number of dead
-- rows instead, without the cost-based sleeps (it is a small, hot table), and keep its
-- statistics and visibility map current (the relay's id-only look below its last id can then
-- be an index-only scan). The relay no longer depends on it for speed while it drains a
-- backlog (it reads after its last id); this bounds what the look from its floor walks.
ALTER TABLE outbox SET (
    autovacuum_vacuum_scale_factor = 0,
    autovacuum_vacuum_threshold = 5000,
    autovacuum_vacuum_insert_scale_factor = 0,
    autovacuum_vacuum_insert_threshold = 20000,
    autovacuum_analyze_scale_factor = 0,
    autovacuum_analyze_threshold = 20000,
    autovacuum_vacuum_cost_delay = 0
);
