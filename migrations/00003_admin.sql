-- What the admin plane needs beyond the delivery protocol: a registry of
-- relay sessions across replicas, a delivery-rate counter, the record of
-- accepted gaps, and an index that retention and event listings can walk by
-- creation time without ties.

-- +goose Up

-- Purge walks (created_at, event_id) upward, ListEvents downward; the pair is
-- unique, so both can page with a keyset instead of an offset.
CREATE INDEX event_created_at_event_id_idx ON outbox.event (created_at, event_id);
DROP INDEX outbox.event_created_at_idx;

-- One row per open Subscribe stream of any replica, for ListRelays and the
-- connected-relay count. The serving replica inserts it when the stream
-- opens, refreshes in_flight, acked and seen_at every few seconds, and
-- deletes it when the stream ends. A crashed replica's rows stop being
-- refreshed: readers ignore rows not seen recently, and replicas delete them.
CREATE TABLE outbox.relay_session (
    session_id uuid PRIMARY KEY,
    relay_id text NOT NULL,
    peer text NOT NULL,
    replica_id text NOT NULL,
    streams text[] NOT NULL,
    max_in_flight integer NOT NULL,
    in_flight integer NOT NULL DEFAULT 0,
    acked bigint NOT NULL DEFAULT 0,
    connected_at timestamptz NOT NULL,
    seen_at timestamptz NOT NULL
);

-- Events marked published, per stream, in 5-second buckets: the delivery
-- rate without an index on published_at (which would make every ack a
-- non-HOT update). Keyed by backend too, so that concurrent ack statements
-- never wait on each other's counter row. UNLOGGED: after a crash the
-- counts restart from zero, which a rate over the last minute tolerates,
-- and acks write no WAL for them.
CREATE UNLOGGED TABLE outbox.delivered_count (
    stream text NOT NULL,
    bucket timestamptz NOT NULL,
    backend_pid integer NOT NULL,
    events bigint NOT NULL,
    PRIMARY KEY (stream, bucket, backend_pid)
);

-- +goose StatementBegin
CREATE FUNCTION outbox.count_published() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    -- outbox.event_immutable lets an UPDATE change nothing but published_at,
    -- and the only UPDATE outboxd runs (outbox.ack) sets it on pending
    -- events, so every row here with a published_at was just published.
    INSERT INTO outbox.delivered_count AS c (stream, bucket, backend_pid, events)
    SELECT n.stream, date_bin('5 seconds', clock_timestamp(), timestamptz '2000-01-01'),
           pg_backend_pid(), count(*)
    FROM published n
    WHERE n.published_at IS NOT NULL
    GROUP BY n.stream
    ON CONFLICT (stream, bucket, backend_pid) DO UPDATE SET events = c.events + excluded.events;
    RETURN NULL;
END
$$;
-- +goose StatementEnd

CREATE TRIGGER event_count_published
    AFTER UPDATE ON outbox.event
    REFERENCING NEW TABLE AS published
    FOR EACH STATEMENT EXECUTE FUNCTION outbox.count_published();

-- An operator's decision to give up on missing revisions of a gap-held
-- aggregate (RetryAggregate with accept_gap): revisions from_revision to
-- to_revision will never be delivered, and a producer can no longer insert
-- them (they are at or below the delivery cursor).
CREATE TABLE outbox.accepted_gap (
    stream text NOT NULL,
    aggregate_key text NOT NULL,
    from_revision bigint NOT NULL,
    to_revision bigint NOT NULL,
    reason text NOT NULL CHECK (reason <> ''),
    actor text NOT NULL CHECK (actor <> ''),
    accepted_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (stream, aggregate_key, from_revision),
    CHECK (from_revision <= to_revision)
);

-- The pending events of one aggregate beyond its delivery cursor: how many,
-- the next revision and the oldest created_at. GetLag, GetAggregate and the
-- metrics count through this one definition, so they always agree. A simple
-- SQL function, so the planner inlines it into the caller's query and walks
-- the (stream, aggregate_key, revision) index.
-- +goose StatementBegin
CREATE FUNCTION outbox.pending_of(p_stream text, p_aggregate_key text, p_after_revision bigint)
RETURNS TABLE (events bigint, next_revision bigint, oldest_created_at timestamptz)
LANGUAGE sql STABLE AS $$
    SELECT count(*), min(e.revision), min(e.created_at)
    FROM outbox.event e
    WHERE e.stream = p_stream AND e.aggregate_key = p_aggregate_key
      AND e.revision > p_after_revision AND e.published_at IS NULL
      AND NOT EXISTS (SELECT 1 FROM outbox.skipped_event s WHERE s.event_id = e.event_id)
$$;
-- +goose StatementEnd

-- +goose Down
DROP FUNCTION outbox.pending_of(text, text, bigint);
DROP TABLE outbox.accepted_gap;
DROP TRIGGER event_count_published ON outbox.event;
DROP FUNCTION outbox.count_published();
DROP TABLE outbox.delivered_count;
DROP TABLE outbox.relay_session;
CREATE INDEX event_created_at_idx ON outbox.event (created_at);
DROP INDEX outbox.event_created_at_event_id_idx;
