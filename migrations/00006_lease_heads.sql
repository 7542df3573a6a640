-- Claims cost less and wait for no disk flush (issue 5).
--
-- * outbox.lease_heads becomes PL/pgSQL so that its UPDATE keeps a plan for
--   the life of the connection: PostgreSQL 15 parses and plans the body of a
--   LANGUAGE sql function at every call, and every claim calls it.
-- * A claim's commit no longer waits for its WAL to reach disk
--   (synchronous_commit off for that transaction only). A lease is soft
--   state: if PostgreSQL crashes before the commit is flushed, the aggregate
--   is simply not leased after recovery and its event is offered again,
--   which at-least-once delivery allows (an ack of that delivery still
--   publishes; see Delivery semantics). For every event whose aggregate is
--   busy, this takes one disk flush off the path from one revision to the
--   next.
-- * So that a lease lost that way can never be confused with a later one,
--   epochs follow the clock: a new lease's epoch is the larger of the
--   previous epoch + 1 and the current time in microseconds, so an epoch
--   handed out before a crash is never handed out again after it (unless the
--   clock moves back). Epochs stay strictly increasing per aggregate. (outbox.emit stays SQL for now: its input and output
-- parameters share names, which PL/pgSQL refuses, and renaming them would
-- break producers that pass arguments by name.)

-- +goose Up

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION outbox.lease_heads(
    p_streams text[],
    p_keys text[],
    p_holder uuid,
    p_relay_id text,
    p_replica_id text,
    p_ttl interval,
    p_now timestamptz
) RETURNS TABLE (
    event_id uuid,
    stream text,
    aggregate_key text,
    revision bigint,
    event_type text,
    payload text,
    headers jsonb,
    created_at timestamptz,
    epoch bigint,
    attempt integer,
    lease_expires_at timestamptz
)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    -- The epoch grows with every lease: it fences Nack and ExtendLease of
    -- older ones.
    RETURN QUERY
        UPDATE outbox.delivery d
        SET state = 'leased',
            epoch = greatest(d.epoch + 1, (extract(epoch FROM p_now) * 1000000)::bigint),
            holder = p_holder, holder_relay_id = p_relay_id, holder_replica_id = p_replica_id,
            attempt = CASE WHEN d.leased_event_id = e.event_id THEN d.attempt + 1 ELSE 1 END,
            failures = CASE WHEN d.leased_event_id = e.event_id THEN d.failures ELSE 0 END,
            leased_event_id = e.event_id,
            lease_expires_at = p_now + p_ttl, claimable_at = p_now + p_ttl,
            pending_since = e.created_at, next_attempt_at = NULL, gap_revision = NULL
        FROM unnest(p_streams, p_keys) AS l(stream, aggregate_key), outbox.event e
        WHERE d.stream = l.stream AND d.aggregate_key = l.aggregate_key
          AND e.stream = d.stream AND e.aggregate_key = d.aggregate_key
          AND e.revision = d.delivered_revision + 1
          AND NOT EXISTS (SELECT 1 FROM outbox.skipped_event s WHERE s.event_id = e.event_id)
        RETURNING e.event_id, e.stream, e.aggregate_key, e.revision, e.event_type, e.payload::text,
                  e.headers, e.created_at, d.epoch, d.attempt, d.lease_expires_at;
END
$$;
-- +goose StatementEnd

-- +goose Down
-- The new body keeps the signature and the guarantees version 5's callers
-- rely on (epochs still only grow); nothing to undo.
