-- The outbox schema: what producers write (outbox.event), the producers'
-- per-aggregate order lock and revision counter (outbox.aggregate), and the
-- server's delivery bookkeeping (outbox.delivery). migrations/doc.go explains
-- why the last two are separate tables.

-- +goose Up

CREATE SCHEMA IF NOT EXISTS outbox;

-- Settings every producer transaction reads. One row.
CREATE TABLE outbox.settings (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    -- The largest payload accepted, in bytes of its JSON text.
    max_payload_bytes integer NOT NULL DEFAULT 1048576 CHECK (max_payload_bytes > 0)
);
INSERT INTO outbox.settings DEFAULT VALUES;

-- The key that signs lease tokens, shared by every replica through the
-- database so that an Ack can land on any of them. Producers need no access.
CREATE TABLE outbox.lease_key (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    key bytea NOT NULL CHECK (octet_length(key) >= 32)
);
-- 2 x 122 random bits from gen_random_uuid (built in; no pgcrypto needed).
INSERT INTO outbox.lease_key (key)
VALUES (decode(replace(gen_random_uuid()::text || gen_random_uuid()::text, '-', ''), 'hex'));

-- The event as its producer committed it. Immutable but for published_at.
-- published_at is deliberately in no index, so marking an event published is a
-- HOT update that writes no index entry.
CREATE TABLE outbox.event (
    event_id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    stream text NOT NULL,
    aggregate_key text NOT NULL,
    revision bigint NOT NULL,
    event_type text NOT NULL,
    payload jsonb NOT NULL,
    headers jsonb NOT NULL DEFAULT '{}',
    created_at timestamptz NOT NULL DEFAULT now(),
    published_at timestamptz,
    CONSTRAINT event_stream_aggregate_key_revision_key UNIQUE (stream, aggregate_key, revision),
    CONSTRAINT event_revision_check CHECK (revision > 0),
    CONSTRAINT event_stream_check CHECK (stream ~ '^[a-z][a-z0-9_.-]{0,127}$'),
    CONSTRAINT event_aggregate_key_check CHECK (aggregate_key <> ''),
    CONSTRAINT event_event_type_check CHECK (event_type <> ''),
    CONSTRAINT event_headers_check CHECK (jsonb_typeof(headers) = 'object')
) WITH (fillfactor = 90);

-- Retention (Purge) and ListEvents walk events by creation time.
CREATE INDEX event_created_at_idx ON outbox.event (created_at);

-- The producers' side of an aggregate: its revision counter, and the row that
-- concurrent producers of one aggregate serialise on (held to commit). The
-- server never waits for this lock; it only takes it with SKIP LOCKED.
CREATE TABLE outbox.aggregate (
    stream text NOT NULL,
    aggregate_key text NOT NULL,
    -- The highest revision any committed event of this aggregate has.
    last_revision bigint NOT NULL,
    PRIMARY KEY (stream, aggregate_key)
);

-- The server's side of an aggregate: cursor, lease, retries. Producers touch
-- a row only to wake it from idle or gap, which is when the server holds no
-- lease on it, so acks never wait for a producer.
CREATE TABLE outbox.delivery (
    stream text NOT NULL,
    aggregate_key text NOT NULL,
    state text NOT NULL CHECK (state IN ('idle', 'ready', 'leased', 'backoff', 'parked', 'gap')),
    -- Every revision up to this one is published or skipped (or predates the
    -- aggregate's first event). The next one to deliver is delivered_revision+1.
    delivered_revision bigint NOT NULL,
    -- When the aggregate may next be claimed, and the claim order: the head
    -- event's created_at when ready, the lease expiry when leased, the next
    -- attempt when backing off. NULL when idle, parked or held at a gap.
    claimable_at timestamptz,
    -- created_at of the oldest pending event; NULL when nothing is pending.
    pending_since timestamptz,
    -- Fencing token: incremented by every lease.
    epoch bigint NOT NULL DEFAULT 0,
    -- The Subscribe session holding the lease, and where it is.
    holder uuid,
    holder_relay_id text,
    holder_replica_id text,
    leased_event_id uuid,
    lease_expires_at timestamptz,
    -- Deliveries and failed publishes of the head event so far.
    attempt integer NOT NULL DEFAULT 0,
    failures integer NOT NULL DEFAULT 0,
    last_error text,
    next_attempt_at timestamptz,
    parked_at timestamptz,
    parked_reason text,
    gap_revision bigint,
    PRIMARY KEY (stream, aggregate_key),
    CONSTRAINT delivery_claimable_check CHECK (
        (state IN ('ready', 'leased', 'backoff')) = (claimable_at IS NOT NULL)),
    CONSTRAINT delivery_lease_check CHECK ((state = 'leased') = (holder IS NOT NULL))
);

-- The claim index: holds only aggregates that are or will become claimable,
-- so its size follows pending aggregates, never the event backlog.
CREATE INDEX delivery_claimable_idx ON outbox.delivery (claimable_at)
    WHERE claimable_at IS NOT NULL;
-- A session's leases (release on disconnect, reconciliation).
CREATE INDEX delivery_holder_idx ON outbox.delivery (holder) WHERE holder IS NOT NULL;
-- Lag per stream: oldest pending and counts by state.
CREATE INDEX delivery_pending_idx ON outbox.delivery (stream, pending_since)
    WHERE pending_since IS NOT NULL;

-- An operator's explicit abandonment of a pending event: never delivered,
-- never marked published, kept queryable.
CREATE TABLE outbox.skipped_event (
    event_id uuid PRIMARY KEY REFERENCES outbox.event (event_id),
    reason text NOT NULL CHECK (reason <> ''),
    actor text NOT NULL CHECK (actor <> ''),
    skipped_at timestamptz NOT NULL DEFAULT now()
);

-- Replicas with a relay session that found no work register here; while one
-- is registered (and not expired) producers NOTIFY outbox_wakeup. Under load
-- no session idles, registrations lapse, and producers stop notifying: NOTIFY
-- takes a global lock at commit that would serialise every producer.
CREATE TABLE outbox.listener (
    replica_id text PRIMARY KEY,
    waiting_until timestamptz NOT NULL
);

-- +goose StatementBegin
CREATE FUNCTION outbox.event_before_insert() RETURNS trigger
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
    IF EXISTS (SELECT 1 FROM outbox.listener l WHERE l.waiting_until > now()) THEN
        PERFORM pg_notify('outbox_wakeup', '');
    END IF;
    RETURN NEW;
END
$$;
-- +goose StatementEnd

CREATE TRIGGER event_before_insert BEFORE INSERT ON outbox.event
    FOR EACH ROW EXECUTE FUNCTION outbox.event_before_insert();

-- +goose StatementBegin
CREATE FUNCTION outbox.event_immutable() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'outbox: event % is immutable; only published_at may change', OLD.event_id
        USING ERRCODE = 'object_not_in_prerequisite_state',
              HINT = 'Emit a new event instead of editing a committed one.';
END
$$;
-- +goose StatementEnd

CREATE TRIGGER event_immutable
    BEFORE UPDATE OF event_id, stream, aggregate_key, revision, event_type, payload, headers, created_at
    ON outbox.event FOR EACH ROW EXECUTE FUNCTION outbox.event_immutable();

-- +goose StatementBegin
CREATE FUNCTION outbox.event_keep_pending() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF OLD.published_at IS NULL THEN
        RAISE EXCEPTION 'outbox: event % is not published and cannot be deleted', OLD.event_id
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  HINT = 'Pending events are never deleted; an operator may skip one with a reason.';
    END IF;
    RETURN OLD;
END
$$;
-- +goose StatementEnd

CREATE TRIGGER event_keep_pending BEFORE DELETE ON outbox.event
    FOR EACH ROW EXECUTE FUNCTION outbox.event_keep_pending();

-- emit records an event in the caller's transaction. Without a revision it
-- assigns the aggregate's next one; with one it checks it.
-- +goose StatementBegin
CREATE FUNCTION outbox.emit(
    stream text,
    aggregate_key text,
    event_type text,
    payload jsonb,
    headers jsonb DEFAULT '{}',
    revision bigint DEFAULT NULL,
    event_id uuid DEFAULT NULL
) RETURNS TABLE (event_id uuid, revision bigint)
LANGUAGE sql AS $$
    INSERT INTO outbox.event (event_id, stream, aggregate_key, revision, event_type, payload, headers)
    VALUES (coalesce($7, gen_random_uuid()), $1, $2, $6, $3, $4, coalesce($5, '{}'::jsonb))
    RETURNING event.event_id, event.revision
$$;
-- +goose StatementEnd

-- +goose Down
DROP SCHEMA outbox CASCADE;
