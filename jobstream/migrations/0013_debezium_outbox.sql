-- The outbox read by Debezium (JOBSTREAM_RELAY=debezium, docs/relays.md).
--
-- The Outbox Event Router puts table COLUMNS into Kafka headers; jobstream keeps its headers
-- in one jsonb column. So the headers the Python relay sends are copied into one text column
-- each (hdr_<name>), by a BEFORE INSERT trigger from the same jsonb: the Python relay and
-- every writer stay unchanged, and the two relays send byte-identical headers. (Generated
-- columns would not do: PostgreSQL 15 does not publish them through logical replication.)
ALTER TABLE outbox
    ADD COLUMN hdr_job_id         text,
    ADD COLUMN hdr_event_id       text,
    ADD COLUMN hdr_dedup_key      text,
    ADD COLUMN hdr_tenant_id      text,
    ADD COLUMN hdr_event_type     text,
    ADD COLUMN hdr_request_id     text,
    ADD COLUMN hdr_traceparent    text,
    ADD COLUMN hdr_content_type   text,
    ADD COLUMN hdr_schema_version text;

CREATE FUNCTION outbox_headers_v1() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.hdr_job_id         := NEW.headers ->> 'job_id';
    NEW.hdr_event_id       := NEW.headers ->> 'event_id';
    NEW.hdr_dedup_key      := NEW.headers ->> 'dedup_key';
    NEW.hdr_tenant_id      := NEW.headers ->> 'tenant_id';
    NEW.hdr_event_type     := NEW.headers ->> 'event_type';
    NEW.hdr_request_id     := NEW.headers ->> 'request_id';
    NEW.hdr_traceparent    := NEW.headers ->> 'traceparent';
    NEW.hdr_content_type   := NEW.headers ->> 'content-type';
    NEW.hdr_schema_version := NEW.headers ->> 'schema_version';
    RETURN NEW;
END $$;
CREATE TRIGGER outbox_headers_v1 BEFORE INSERT ON outbox
    FOR EACH ROW EXECUTE FUNCTION outbox_headers_v1();

-- With Debezium the row is deleted in the transaction that inserted it: logical decoding
-- still streams the INSERT to the connector, and the outbox never grows (no retention job,
-- no "mark published" write). The DELETE event is dropped by the Outbox Event Router.
CREATE FUNCTION outbox_forget_v1() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM outbox WHERE id = NEW.id;
    RETURN NULL;
END $$;
CREATE TRIGGER outbox_forget_v1 AFTER INSERT ON outbox
    FOR EACH ROW EXECUTE FUNCTION outbox_forget_v1();

-- Both are off for the Python relay (the default): it reads the jsonb and must see its rows.
-- `jobstream connect deploy` enables them, `jobstream connect delete` disables them again.
ALTER TABLE outbox DISABLE TRIGGER outbox_headers_v1;
ALTER TABLE outbox DISABLE TRIGGER outbox_forget_v1;

