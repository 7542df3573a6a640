-- The delivery protocol, as server-side functions so that each step that must
-- read committed state after taking a lock gets a fresh snapshot in one round
-- trip. server/doc.go explains the protocol and why each invariant holds.

-- +goose Up

-- claim leases up to p_limit aggregates, oldest claimable first, and returns
-- each one's next event with the new lease. It never waits for a lock.
-- +goose StatementBegin
CREATE FUNCTION outbox.claim(
    p_holder uuid,
    p_relay_id text,
    p_replica_id text,
    p_streams text[],
    p_limit integer,
    p_ttl interval
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
DECLARE
    v_now timestamptz := clock_timestamp();
    v_streams text[];
    v_keys text[];
    r record;
    v_cursor bigint;
    v_last bigint;
BEGIN
    -- 1. Lock the oldest claimable aggregates. SKIP LOCKED: one that another
    --    session is claiming or acking right now is simply not ours this time.
    SELECT array_agg(c.stream), array_agg(c.aggregate_key) INTO v_streams, v_keys
    FROM (
        SELECT d.stream, d.aggregate_key FROM outbox.delivery d
        WHERE d.claimable_at <= v_now
          AND (p_streams IS NULL OR d.stream = ANY (p_streams))
        ORDER BY d.claimable_at
        LIMIT p_limit
        FOR UPDATE SKIP LOCKED
    ) c;
    IF v_streams IS NULL THEN
        RETURN;
    END IF;

    -- 2. The rare path: locked aggregates whose next revision is missing or
    --    skipped. Settle each before leasing the others.
    FOR r IN
        SELECT d.stream, d.aggregate_key, d.delivered_revision
        FROM unnest(v_streams, v_keys) AS l(stream, aggregate_key)
        JOIN outbox.delivery d ON d.stream = l.stream AND d.aggregate_key = l.aggregate_key
        WHERE NOT EXISTS (
            SELECT 1 FROM outbox.event e
            WHERE e.stream = d.stream AND e.aggregate_key = d.aggregate_key
              AND e.revision = d.delivered_revision + 1
              AND NOT EXISTS (SELECT 1 FROM outbox.skipped_event s WHERE s.event_id = e.event_id))
    LOOP
        -- Step over revisions an operator skipped.
        v_cursor := r.delivered_revision;
        WHILE EXISTS (
            SELECT 1 FROM outbox.event e JOIN outbox.skipped_event s ON s.event_id = e.event_id
            WHERE e.stream = r.stream AND e.aggregate_key = r.aggregate_key AND e.revision = v_cursor + 1)
        LOOP
            v_cursor := v_cursor + 1;
        END LOOP;
        IF v_cursor <> r.delivered_revision THEN
            UPDATE outbox.delivery d SET delivered_revision = v_cursor
            WHERE d.stream = r.stream AND d.aggregate_key = r.aggregate_key;
        END IF;
        CONTINUE WHEN EXISTS (
            SELECT 1 FROM outbox.event e
            WHERE e.stream = r.stream AND e.aggregate_key = r.aggregate_key AND e.revision = v_cursor + 1);

        -- Nothing to deliver next. Deciding "idle" or "gap" needs the
        -- producers' order lock: holding it, no producer of this aggregate is
        -- between its insert and its commit, and the next statement's fresh
        -- snapshot sees every event committed before. A producer holding it
        -- now is about to commit: look again shortly.
        SELECT a.last_revision INTO v_last FROM outbox.aggregate a
        WHERE a.stream = r.stream AND a.aggregate_key = r.aggregate_key
        FOR UPDATE SKIP LOCKED;
        IF NOT FOUND THEN
            UPDATE outbox.delivery d
            SET claimable_at = v_now + interval '20 milliseconds'
            WHERE d.stream = r.stream AND d.aggregate_key = r.aggregate_key;
            CONTINUE;
        END IF;
        CONTINUE WHEN EXISTS (
            SELECT 1 FROM outbox.event e
            WHERE e.stream = r.stream AND e.aggregate_key = r.aggregate_key AND e.revision = v_cursor + 1);
        IF v_last <= v_cursor THEN
            UPDATE outbox.delivery d
            SET state = 'idle', claimable_at = NULL, pending_since = NULL,
                holder = NULL, holder_relay_id = NULL, holder_replica_id = NULL,
                lease_expires_at = NULL, next_attempt_at = NULL, gap_revision = NULL
            WHERE d.stream = r.stream AND d.aggregate_key = r.aggregate_key;
        ELSE
            -- A later revision exists but the next one does not: hold the
            -- aggregate and report the gap, never skip over it. The producer
            -- that inserts the missing revision wakes it.
            UPDATE outbox.delivery d
            SET state = 'gap', claimable_at = NULL, gap_revision = v_cursor + 1,
                holder = NULL, holder_relay_id = NULL, holder_replica_id = NULL,
                lease_expires_at = NULL, next_attempt_at = NULL,
                pending_since = (
                    SELECT min(e.created_at) FROM outbox.event e
                    WHERE e.stream = r.stream AND e.aggregate_key = r.aggregate_key
                      AND e.revision > v_cursor AND e.published_at IS NULL)
            WHERE d.stream = r.stream AND d.aggregate_key = r.aggregate_key;
        END IF;
    END LOOP;

    -- 3. Lease every locked aggregate whose next revision is there. The epoch
    --    grows with every lease: it fences Nack and ExtendLease of older ones.
    RETURN QUERY
    WITH head AS (
        SELECT e.event_id, e.stream, e.aggregate_key, e.revision, e.event_type,
               e.payload::text AS payload, e.headers, e.created_at
        FROM unnest(v_streams, v_keys) AS l(stream, aggregate_key)
        JOIN outbox.delivery d ON d.stream = l.stream AND d.aggregate_key = l.aggregate_key
        JOIN outbox.event e ON e.stream = d.stream AND e.aggregate_key = d.aggregate_key
                           AND e.revision = d.delivered_revision + 1
        WHERE NOT EXISTS (SELECT 1 FROM outbox.skipped_event s WHERE s.event_id = e.event_id)
    ), leased AS (
        UPDATE outbox.delivery d
        SET state = 'leased', epoch = d.epoch + 1,
            holder = p_holder, holder_relay_id = p_relay_id, holder_replica_id = p_replica_id,
            attempt = CASE WHEN d.leased_event_id = h.event_id THEN d.attempt + 1 ELSE 1 END,
            failures = CASE WHEN d.leased_event_id = h.event_id THEN d.failures ELSE 0 END,
            leased_event_id = h.event_id,
            lease_expires_at = v_now + p_ttl, claimable_at = v_now + p_ttl,
            pending_since = h.created_at, next_attempt_at = NULL, gap_revision = NULL
        FROM head h
        WHERE d.stream = h.stream AND d.aggregate_key = h.aggregate_key
        RETURNING d.stream, d.aggregate_key, d.epoch, d.attempt, d.lease_expires_at
    )
    SELECT h.event_id, h.stream, h.aggregate_key, h.revision, h.event_type, h.payload,
           h.headers, h.created_at, l.epoch, l.attempt, l.lease_expires_at
    FROM leased l JOIN head h ON h.stream = l.stream AND h.aggregate_key = l.aggregate_key;
END
$$;
-- +goose StatementEnd

-- ack marks events published, group-committed: one call for many acks, each
-- row checked on its own. The caller has already verified each token's
-- signature, so every id here is one the server leased at some epoch; the
-- event is marked only while it is its aggregate's next revision and not
-- skipped. Returns one row per distinct input id.
-- +goose StatementBegin
CREATE FUNCTION outbox.ack(p_event_ids uuid[], p_replica_id text)
RETURNS TABLE (event_id uuid, status text, holder uuid)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := clock_timestamp();
    v_ids uuid[];
    v_streams text[];
    v_keys text[];
    v_revs bigint[];
    v_ok uuid[];
    v_holders uuid[];
    v_remote uuid[];
BEGIN
    -- Lock the pending events, then their aggregates' delivery rows, each in
    -- a fixed order so that concurrent batches cannot deadlock.
    SELECT array_agg(e.event_id), array_agg(e.stream), array_agg(e.aggregate_key), array_agg(e.revision)
    INTO v_ids, v_streams, v_keys, v_revs
    FROM (
        SELECT e.event_id, e.stream, e.aggregate_key, e.revision FROM outbox.event e
        WHERE e.event_id = ANY (p_event_ids) AND e.published_at IS NULL
        ORDER BY e.event_id
        FOR UPDATE OF e
    ) e;

    IF v_ids IS NOT NULL THEN
        -- An event may be marked only while it is its aggregate's next
        -- revision and not skipped. Tokens are only ever issued for that
        -- revision, so this fails only for events an operator skipped.
        SELECT array_agg(x.event_id) FILTER (WHERE x.ok),
               array_agg(x.holder) FILTER (WHERE x.ok),
               array_agg(DISTINCT x.holder) FILTER (WHERE x.ok AND x.holder IS NOT NULL
                                                    AND x.holder_replica_id IS DISTINCT FROM p_replica_id)
        INTO v_ok, v_holders, v_remote
        FROM (
            SELECT l.event_id, d.holder, d.holder_replica_id,
                   d.delivered_revision = l.revision - 1
                   AND NOT EXISTS (SELECT 1 FROM outbox.skipped_event s WHERE s.event_id = l.event_id) AS ok
            FROM unnest(v_ids, v_streams, v_keys, v_revs) AS l(event_id, stream, aggregate_key, revision)
            JOIN outbox.delivery d ON d.stream = l.stream AND d.aggregate_key = l.aggregate_key
            ORDER BY d.stream, d.aggregate_key
            FOR UPDATE OF d
        ) x;
    END IF;

    IF v_ok IS NOT NULL THEN
        UPDATE outbox.event e SET published_at = v_now WHERE e.event_id = ANY (v_ok);

        -- Advance each cursor and say what comes next. If the next revision
        -- is committed the aggregate is ready at once. Otherwise it may go
        -- idle, but only under the producers' order lock (taken with SKIP
        -- LOCKED: a producer holding it is about to commit, so stay ready),
        -- and only when the latest committed counter says nothing follows.
        WITH acked AS (
            SELECT e.stream, e.aggregate_key, e.revision FROM outbox.event e
            WHERE e.event_id = ANY (v_ok)
        ), nxt AS (
            SELECT a.stream, a.aggregate_key, a.revision, n.created_at AS next_created_at,
                   (g.last_revision IS NOT NULL AND g.last_revision <= a.revision) AS drained
            FROM acked a
            LEFT JOIN outbox.event n ON n.stream = a.stream AND n.aggregate_key = a.aggregate_key
                                    AND n.revision = a.revision + 1
            LEFT JOIN LATERAL (
                SELECT g.last_revision FROM outbox.aggregate g
                WHERE n.event_id IS NULL
                  AND g.stream = a.stream AND g.aggregate_key = a.aggregate_key
                FOR UPDATE SKIP LOCKED
            ) g ON true
        )
        UPDATE outbox.delivery d
        SET delivered_revision = x.revision,
            state = CASE WHEN x.drained THEN 'idle' ELSE 'ready' END,
            claimable_at = CASE WHEN x.drained THEN NULL ELSE coalesce(x.next_created_at, v_now) END,
            pending_since = CASE WHEN x.drained THEN NULL ELSE coalesce(x.next_created_at, v_now) END,
            holder = NULL, holder_relay_id = NULL, holder_replica_id = NULL,
            lease_expires_at = NULL, leased_event_id = NULL, attempt = 0, failures = 0,
            last_error = NULL, next_attempt_at = NULL, parked_at = NULL, parked_reason = NULL,
            gap_revision = NULL
        FROM nxt x
        WHERE d.stream = x.stream AND d.aggregate_key = x.aggregate_key;

        -- Sessions on other replicas holding these leases free their credit
        -- now rather than at their next reconciliation.
        PERFORM pg_notify('outbox_released', h::text) FROM unnest(v_remote) AS h;
    END IF;

    RETURN QUERY
    SELECT i.id,
           CASE WHEN o.id IS NOT NULL THEN 'published'
                WHEN i.id = ANY (coalesce(v_ids, '{}')) THEN 'lease_lost'
                WHEN e.published_at IS NOT NULL THEN 'already_published'
                WHEN e.event_id IS NOT NULL THEN 'lease_lost'
                ELSE 'not_found' END,
           o.holder
    FROM (SELECT DISTINCT unnest(p_event_ids) AS id) i
    LEFT JOIN unnest(v_ok, v_holders) AS o(id, holder) ON o.id = i.id
    LEFT JOIN outbox.event e ON e.event_id = i.id;
END
$$;
-- +goose StatementEnd

-- nack records a failed publish by the current lease (the epoch must match)
-- and schedules a retry with exponential backoff and jitter, or parks the
-- aggregate once failures reach p_max_failures.
-- +goose StatementBegin
CREATE FUNCTION outbox.nack(
    p_event_id uuid,
    p_epoch bigint,
    p_error text,
    p_retry_after interval,
    p_backoff_base interval,
    p_backoff_cap interval,
    p_max_failures integer
) RETURNS TABLE (parked boolean, next_attempt_at timestamptz, failures integer, holder uuid)
LANGUAGE sql AS $$
    WITH cur AS (
        SELECT d.stream, d.aggregate_key, d.failures + 1 AS failures, d.holder,
               clock_timestamp() + greatest(
                   coalesce(p_retry_after, interval '0'),
                   least(p_backoff_cap, p_backoff_base * power(2, least(d.failures, 30)))
                       * (0.5 + random() / 2)) AS retry_at
        FROM outbox.event e
        JOIN outbox.delivery d ON d.stream = e.stream AND d.aggregate_key = e.aggregate_key
        WHERE e.event_id = p_event_id AND d.leased_event_id = p_event_id
          AND d.epoch = p_epoch AND d.state = 'leased'
        FOR UPDATE OF d
    )
    UPDATE outbox.delivery d
    SET failures = c.failures,
        last_error = left(p_error, 4096),
        state = CASE WHEN c.failures >= p_max_failures THEN 'parked' ELSE 'backoff' END,
        claimable_at = CASE WHEN c.failures >= p_max_failures THEN NULL ELSE c.retry_at END,
        next_attempt_at = CASE WHEN c.failures >= p_max_failures THEN NULL ELSE c.retry_at END,
        parked_at = CASE WHEN c.failures >= p_max_failures THEN clock_timestamp() END,
        parked_reason = CASE WHEN c.failures >= p_max_failures
            THEN format('publish failed %s times; last error: %s', c.failures, left(p_error, 1024)) END,
        holder = NULL, holder_relay_id = NULL, holder_replica_id = NULL, lease_expires_at = NULL
    FROM cur c
    WHERE d.stream = c.stream AND d.aggregate_key = c.aggregate_key
    RETURNING d.state = 'parked', d.next_attempt_at, d.failures, c.holder
$$;
-- +goose StatementEnd

-- extend_lease pushes the current lease's expiry (the epoch must match).
-- +goose StatementBegin
CREATE FUNCTION outbox.extend_lease(p_event_id uuid, p_epoch bigint, p_ttl interval)
RETURNS TABLE (lease_expires_at timestamptz)
LANGUAGE sql AS $$
    UPDATE outbox.delivery d
    SET lease_expires_at = clock_timestamp() + p_ttl, claimable_at = clock_timestamp() + p_ttl
    FROM outbox.event e
    WHERE e.event_id = p_event_id AND d.stream = e.stream AND d.aggregate_key = e.aggregate_key
      AND d.leased_event_id = p_event_id AND d.epoch = p_epoch AND d.state = 'leased'
    RETURNING d.lease_expires_at
$$;
-- +goose StatementEnd

-- release gives back every lease a session holds (its stream ended), making
-- the aggregates claimable at once with their original priority.
-- +goose StatementBegin
CREATE FUNCTION outbox.release(p_holder uuid) RETURNS integer
LANGUAGE sql AS $$
    WITH mine AS (
        SELECT d.stream, d.aggregate_key FROM outbox.delivery d
        WHERE d.holder = p_holder
        ORDER BY d.stream, d.aggregate_key
        FOR UPDATE
    ), released AS (
        UPDATE outbox.delivery d
        SET state = 'ready', claimable_at = coalesce(d.pending_since, clock_timestamp()),
            holder = NULL, holder_relay_id = NULL, holder_replica_id = NULL, lease_expires_at = NULL
        FROM mine m
        WHERE d.stream = m.stream AND d.aggregate_key = m.aggregate_key AND d.holder = p_holder
        RETURNING 1
    )
    SELECT count(*)::integer FROM released
$$;
-- +goose StatementEnd

-- +goose Down
DROP FUNCTION outbox.release(uuid);
DROP FUNCTION outbox.extend_lease(uuid, bigint, interval);
DROP FUNCTION outbox.nack(uuid, bigint, text, interval, interval, interval, integer);
DROP FUNCTION outbox.ack(uuid[], text);
DROP FUNCTION outbox.claim(uuid, text, text, text[], integer, interval);
