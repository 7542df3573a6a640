-- Coalesced wake-ups (issue 5). Producers used to NOTIFY in every
-- transaction while any replica was registered as waiting, and at a steady
-- rate that delivery keeps up with, relays are idle between events, so the
-- registration never lapsed: every producer commit took NOTIFY's global
-- lock, and `outboxd bench` measured 650 events/s against an insert ceiling
-- of 9,200 (top wait: Lock:object).
--
-- Now a registration is consumed: the first producer statement that finds
-- one deletes it (SKIP LOCKED, so concurrent producers never wait for each
-- other) and notifies; the others find none. A replica registers again only
-- when its sessions have idled once more, so NOTIFY runs at most once per
-- idle period per replica, not once per event. Events committed between a
-- notification and the next registration are found by the sessions' short
-- polls, as before.

-- +goose Up

-- The row trigger no longer notifies; event_wake_listeners does, once per
-- statement.
-- +goose StatementBegin
CREATE OR REPLACE FUNCTION outbox.event_before_insert() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_max_payload integer;
    v_last bigint;
    v_delivered bigint;
    v_new_aggregate boolean := false;
BEGIN
    IF NEW.stream IS NULL OR NEW.stream !~ '^[a-z][a-z0-9_.-]{0,127}$' THEN
        RAISE EXCEPTION 'outbox: stream % is malformed', coalesce(quote_literal(NEW.stream), 'NULL')
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'A stream name matches ^[a-z][a-z0-9_.-]{0,127}$, for example sales_order.';
    END IF;
    IF NEW.aggregate_key IS NULL OR NEW.aggregate_key = '' THEN
        RAISE EXCEPTION 'outbox: aggregate_key must not be empty'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF NEW.event_type IS NULL OR NEW.event_type = '' THEN
        RAISE EXCEPTION 'outbox: event_type must not be empty'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF NEW.payload IS NULL THEN
        RAISE EXCEPTION 'outbox: payload must not be NULL'
            USING ERRCODE = 'invalid_parameter_value', HINT = 'Use a JSON value such as {}.';
    END IF;
    IF NEW.headers IS NULL OR jsonb_typeof(NEW.headers) <> 'object' THEN
        RAISE EXCEPTION 'outbox: headers must be a JSON object, not %',
                coalesce(jsonb_typeof(NEW.headers), 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF NEW.headers <> '{}' AND EXISTS (
            SELECT 1 FROM jsonb_each(NEW.headers) h WHERE jsonb_typeof(h.value) <> 'string') THEN
        RAISE EXCEPTION 'outbox: header values must be strings'
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Brokers carry headers as strings; encode other values as text.';
    END IF;
    IF NEW.revision IS NOT NULL AND NEW.revision <= 0 THEN
        RAISE EXCEPTION 'outbox: revision must be positive, got %', NEW.revision
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT s.max_payload_bytes INTO v_max_payload FROM outbox.settings s;
    IF octet_length(NEW.payload::text) > v_max_payload THEN
        RAISE EXCEPTION 'outbox: payload is % bytes, over the limit of % bytes',
                octet_length(NEW.payload::text), v_max_payload
            USING ERRCODE = 'program_limit_exceeded',
                  HINT = 'The limit is outbox.settings.max_payload_bytes.';
    END IF;

    -- The aggregate row is the producers' order lock, held to commit: producers
    -- of one aggregate serialise here, producers of others do not meet.
    IF NEW.revision IS NULL THEN
        INSERT INTO outbox.aggregate AS a (stream, aggregate_key, last_revision)
        VALUES (NEW.stream, NEW.aggregate_key, 1)
        ON CONFLICT (stream, aggregate_key)
            DO UPDATE SET last_revision = a.last_revision + 1
        RETURNING a.last_revision, (a.xmax = 0) INTO NEW.revision, v_new_aggregate;
    ELSE
        INSERT INTO outbox.aggregate (stream, aggregate_key, last_revision)
        VALUES (NEW.stream, NEW.aggregate_key, NEW.revision)
        ON CONFLICT (stream, aggregate_key) DO NOTHING;
        v_new_aggregate := FOUND;
        IF NOT v_new_aggregate THEN
            SELECT a.last_revision INTO v_last FROM outbox.aggregate a
            WHERE a.stream = NEW.stream AND a.aggregate_key = NEW.aggregate_key
            FOR UPDATE;
            IF NEW.revision > v_last THEN
                UPDATE outbox.aggregate a SET last_revision = NEW.revision
                WHERE a.stream = NEW.stream AND a.aggregate_key = NEW.aggregate_key;
            ELSE
                -- A late revision below the counter. Delivery may already have
                -- moved past it (the aggregate's first revision, or a gap an
                -- operator accepted); then it could never be delivered.
                SELECT d.delivered_revision INTO v_delivered FROM outbox.delivery d
                WHERE d.stream = NEW.stream AND d.aggregate_key = NEW.aggregate_key;
                IF NEW.revision <= v_delivered THEN
                    RAISE EXCEPTION 'outbox: revision % of %/% is at or below its delivery cursor %',
                            NEW.revision, NEW.stream, NEW.aggregate_key, v_delivered
                        USING ERRCODE = 'unique_violation',
                              DETAIL = 'Delivery already passed this revision (it precedes the aggregate''s first event, or an operator accepted a gap there), so the event could never be delivered.';
                END IF;
            END IF;
        END IF;
    END IF;

    IF v_new_aggregate THEN
        INSERT INTO outbox.delivery (stream, aggregate_key, state, delivered_revision, claimable_at, pending_since)
        VALUES (NEW.stream, NEW.aggregate_key, 'ready', NEW.revision - 1, NEW.created_at, NEW.created_at);
    ELSE
        -- Wake the aggregate if the server had nothing for it. Under the order
        -- lock taken above the server cannot be deciding idle or gap right now.
        UPDATE outbox.delivery d
        SET state = 'ready', claimable_at = NEW.created_at,
            pending_since = least(d.pending_since, NEW.created_at), gap_revision = NULL
        WHERE d.stream = NEW.stream AND d.aggregate_key = NEW.aggregate_key
          AND d.state IN ('idle', 'gap');
    END IF;
    RETURN NEW;
END
$$;
-- +goose StatementEnd

-- +goose StatementBegin
CREATE FUNCTION outbox.wake_listeners() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    v_fresh boolean;
BEGIN
    -- The common case under load: nobody is waiting, the table is empty.
    PERFORM 1 FROM outbox.listener LIMIT 1;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    WITH consumed AS (
        DELETE FROM outbox.listener l
        WHERE l.replica_id IN (SELECT w.replica_id FROM outbox.listener w FOR UPDATE SKIP LOCKED)
        RETURNING l.waiting_until
    )
    SELECT bool_or(c.waiting_until > now()) INTO v_fresh FROM consumed c;
    IF v_fresh THEN
        PERFORM pg_notify('outbox_wakeup', '');
    END IF;
    RETURN NULL;
END
$$;
-- +goose StatementEnd

CREATE TRIGGER event_wake_listeners
    AFTER INSERT ON outbox.event
    FOR EACH STATEMENT EXECUTE FUNCTION outbox.wake_listeners();

-- +goose Down
DROP TRIGGER event_wake_listeners ON outbox.event;
DROP FUNCTION outbox.wake_listeners();
-- The row trigger stays without its NOTIFY: replicas of this version
-- register expecting consumption, and the previous server's polling finds
-- every event anyway.
