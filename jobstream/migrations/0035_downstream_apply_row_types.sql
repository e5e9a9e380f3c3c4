-- consumer6 (the ready applier's batch path, jobstream/ready_applier.py): the rows of a batch
-- reach Postgres as ONE binary array parameter per effect table, of these composite types,
-- inserted with `INSERT ... SELECT * FROM unnest($1::downstream.ready_analysis_row[])`, instead
-- of a binary `COPY ... FROM STDIN` per table.
--
-- Why: the batch's processed_event rows are inserted first in the same transaction. A consumer
-- frozen (SIGSTOP, a VM pause) while its COPY was receiving data held those rows, and the
-- partitions' next owner waiting on them, for as long as it stayed frozen: a session waiting
-- for COPY data is `active` (ClientRead), so idle_in_transaction_session_timeout never ends it
-- and statement_timeout is not acted on while the backend waits for its client
-- (tests/e2e/test_break_consumer_copy_frozen.py). The statement's parameters arrive in a Bind
-- message that, the statement being prepared first (psycopg `prepare=True`), is the first
-- message after a ReadyForQuery: the session is `idle in transaction` while it reads it, so
-- the timeout bounds a freeze there too (docs/design-notes.md, "A consumer frozen mid-apply").
--
-- The field order and types are those of the binary rows copy_rows() builds; amount_usd is
-- numeric without typmod (the INSERT casts to the column's numeric(14, 8), refusing an
-- overflow with a DataError as the COPY did). Types only: no table is touched.
CREATE TYPE downstream.ready_analysis_row AS (
    tenant_id text, dedup_key text, job_id uuid, filename text, title text, summary text,
    keywords text[], fields jsonb);
CREATE TYPE downstream.ready_charge_row AS (
    tenant_id text, dedup_key text, job_id uuid, amount_usd numeric);
