-- Convert a processed_event table of the first shape (PRIMARY KEY (consumer_group, dedup_key,
-- event_type)) to the key_digest shape of consumer.sql (consumers.ddl.upgrade_tables runs
-- this in one transaction). Placeholders: {processed} (schema-qualified table), {processed_name}
-- (the same as a string literal), {pkey_idx}
-- (name of the new primary key's index). Idempotent: a table already converted is left as
-- it is. Takes an ACCESS EXCLUSIVE lock on the table and rewrites it (one sha256 per row):
-- stop the table's consumers first, and expect about a second per million rows.
DO $upgrade$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_attribute
                WHERE attrelid = {processed_name}::regclass AND attname = 'key_digest'
                  AND NOT attisdropped) THEN
        RETURN;
    END IF;
    LOCK TABLE {processed} IN ACCESS EXCLUSIVE MODE;
    ALTER TABLE {processed} ADD COLUMN key_digest bytea;
    UPDATE {processed} SET key_digest = substr(sha256(
        convert_to(consumer_group, 'UTF8') || '\x00'::bytea || convert_to(event_type, 'UTF8')
        || '\x00'::bytea || convert_to(dedup_key, 'UTF8')), 1, 16);
    ALTER TABLE {processed} ALTER COLUMN key_digest SET NOT NULL;
    CREATE UNIQUE INDEX {pkey_idx} ON {processed} (key_digest);
    EXECUTE format('ALTER TABLE %s DROP CONSTRAINT %I', {processed_name}::regclass,
                   (SELECT conname FROM pg_constraint
                     WHERE conrelid = {processed_name}::regclass AND contype = 'p'));
    ALTER TABLE {processed} ADD PRIMARY KEY USING INDEX {pkey_idx};
END
$upgrade$;
