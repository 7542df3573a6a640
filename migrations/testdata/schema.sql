--
-- PostgreSQL database dump
--

--
-- Name: outbox; Type: SCHEMA; Schema: -; Owner: -
--

CREATE SCHEMA outbox;

--
-- Name: emitted; Type: TYPE; Schema: outbox; Owner: -
--

CREATE TYPE outbox.emitted AS (
	event_id uuid,
	revision bigint
);

--
-- Name: lease; Type: TYPE; Schema: outbox; Owner: -
--

CREATE TYPE outbox.lease AS (
	event_id uuid,
	stream text,
	aggregate_key text,
	revision bigint,
	event_type text,
	payload text,
	headers jsonb,
	created_at timestamp with time zone,
	epoch bigint,
	attempt integer,
	lease_expires_at timestamp with time zone,
	republish_action bigint
);

--
-- Name: ownership; Type: TYPE; Schema: outbox; Owner: -
--

CREATE TYPE outbox.ownership AS (
	share integer,
	partitions integer[],
	epochs bigint[]
);

--
-- Name: ack(uuid[], text, uuid[], interval[], integer[], integer[], uuid[], text[], boolean[], interval, boolean[]); Type: FUNCTION; Schema: outbox; Owner: -
--

CREATE FUNCTION outbox.ack(p_event_ids uuid[], p_replica_id text, p_handover_holders uuid[] DEFAULT NULL::uuid[], p_handover_ttls interval[] DEFAULT NULL::interval[], p_handover_windows integer[] DEFAULT NULL::integer[], p_handover_credits integer[] DEFAULT NULL::integer[], p_filter_holders uuid[] DEFAULT NULL::uuid[], p_filter_streams text[] DEFAULT NULL::text[], p_filter_excluded boolean[] DEFAULT NULL::boolean[], p_max_due interval DEFAULT NULL::interval, p_handover_spare boolean[] DEFAULT NULL::boolean[]) RETURNS TABLE(event_id uuid, status text, holder uuid, created_at timestamp with time zone, handover outbox.lease, claimable_in interval)
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET enable_sort TO 'off'
    SET enable_incremental_sort TO 'off'
    SET jit TO 'off'
    SET plan_cache_mode TO 'force_generic_plan'
    AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := clock_timestamp();
    v_ids uuid[];
    v_streams text[];
    v_keys text[];
    v_revs bigint[];
    v_created timestamptz[];
    v_ok uuid[];
    v_ok_streams text[];
    v_ok_keys text[];
    v_ok_revs bigint[];
    v_ok_created timestamptz[];
    v_ok_tids tid[];
    -- The updates below reach the rows locked by their tuple ids, which
    -- nothing can move before them (the rows are locked, and nothing in
    -- between updates them); an update that met a moved row would skip it
    -- silently, with the events already marked published, so a count that
    -- disagrees fails the call instead.
    v_advanced bigint;
    v_acked_aggregates bigint;
    v_holders uuid[];
    v_remote uuid[];
    v_oldest timestamptz;
    v_first_claimable timestamptz;
    v_probe_holders uuid[];
    v_probe_oldest timestamptz[];
    v_probed boolean := false;
    -- Arguments of the probe, always variables: a call whose arguments hold
    -- a volatile function (clock_timestamp()) or a subquery is not inlined,
    -- and its body is then planned again on every call (milliseconds).
    v_probe_now timestamptz;
    v_probe_for uuid[];
    v_probe_handover uuid[];
    v_handed outbox.lease[];
    v_handed_holders uuid[];
    v_handed_acks uuid[];
    v_windowed boolean;
    v_ok_parked boolean[];
    v_id uuid;
    v_stream text;
    v_key text;
    v_rev bigint;
    v_at timestamptz;
    v_cursor bigint;
    v_state text;
    v_holder uuid;
    v_holder_replica text;
    v_through bigint;
    v_parked_rev bigint;
    v_skipped boolean;
    v_next_id uuid;
    v_next_at timestamptz;
    v_next_skipped boolean;
    v_has_next boolean;
    v_ttl interval;
    v_slot integer;
    v_stays_parked boolean;
    v_lease outbox.lease;
    v_epoch bigint;
    v_attempt integer;
    v_expires timestamptz;
    v_republished_through bigint;
    v_set text;
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        PERFORM outbox.require_read_committed('outbox.ack');
    END IF;
    -- Not waiting for the WAL flush: an ack lost in a PostgreSQL crash
    -- leaves its event pending, to be delivered again with the same
    -- event_id, which at-least-once allows. WAL is replayed in order, so a
    -- later ack that survived implies every earlier one did: first copies
    -- stay in revision order.
    v_set := set_config('synchronous_commit', 'off', true);

    -- One ack, no window (every event of a hot aggregate, any batch that
    -- holds one ack): the decisions of the batch statements below, made on
    -- one row each in statements a fraction of their size. Starting a
    -- statement's executor costs about as much as a small statement's
    -- work, so the batch path's plans (arrays, window functions, a dozen
    -- aggregates) cost an ack of one event more than its writes. What this
    -- path does not decide (the event not pending or skipped, no delivery
    -- row, not the next revision, a lease that covers more than it) goes to
    -- the batch path before anything is written; it takes the same locks
    -- again (re-entrant) and answers.
    IF cardinality(p_event_ids) = 1 AND coalesce(NOT 1 < ANY (p_handover_windows), true)
       AND coalesce(NOT 0 < ANY (p_handover_credits), true) THEN
        SELECT e.event_id, e.stream, e.aggregate_key, e.revision, e.created_at
        INTO v_id, v_stream, v_key, v_rev, v_at
        FROM outbox.event e
        WHERE e.event_id = p_event_ids[1] AND e.published_at IS NULL
        FOR UPDATE OF e;
        IF v_id IS NOT NULL THEN
            -- Whether the event is skipped is read here, in a statement
            -- after its lock, never in the statement that waited for it:
            -- SkipEvent locks the event, records the skip and commits, and
            -- a statement that waited for that lock reads the skip table as
            -- it was before.
            SELECT d.delivered_revision, d.state, d.holder, d.holder_replica_id, d.leased_through, d.parked_revision,
                   (SELECT true FROM outbox.skipped_event s WHERE s.event_id = v_id) IS NOT NULL
            INTO v_cursor, v_state, v_holder, v_holder_replica, v_through, v_parked_rev, v_skipped
            FROM outbox.delivery d
            WHERE d.stream = v_stream AND d.aggregate_key = v_key
            FOR UPDATE OF d;
            -- The clock again, now that the rows are ours: the locks may
            -- have waited (for a claim, a round, a re-scan), and a lease
            -- handed over from the clock before the wait would be shorter
            -- than its TTL, or over before it is sent.
            v_now := clock_timestamp();
        END IF;
        IF v_cursor IS NOT NULL AND NOT v_skipped AND v_rev = v_cursor + 1
           AND NOT (v_state = 'leased' AND v_through > v_rev) THEN
            -- For TestOneAckDecidesAsABatch, which must know the path ran
            -- (sent only to a session that asked for DEBUG1 messages).
            RAISE DEBUG 'outbox.ack: one-row path';
            v_set := set_config('outbox.acking', 'on', true);
            UPDATE outbox.event e SET published_at = v_now WHERE e.event_id = v_id;
            v_set := set_config('outbox.acking', 'off', true);
            INSERT INTO outbox.delivered_count AS c (stream, bucket, backend_pid, events)
            VALUES (v_stream, date_bin('5 seconds', v_now, timestamptz '2000-01-01'), pg_backend_pid(), 1)
            ON CONFLICT (stream, bucket, backend_pid) DO UPDATE SET events = c.events + 1;

            -- What follows, in one probe: the first revision after this
            -- one is the next (if it is this one's plus one), and whether
            -- there is any says whether anything follows.
            SELECT CASE WHEN n.revision = v_rev + 1 THEN n.event_id END,
                   CASE WHEN n.revision = v_rev + 1 THEN n.created_at END,
                   n.revision = v_rev + 1 AND (SELECT true FROM outbox.skipped_event s WHERE s.event_id = n.event_id) IS NOT NULL,
                   true
            INTO v_next_id, v_next_at, v_next_skipped, v_has_next
            FROM outbox.event n
            WHERE n.stream = v_stream AND n.aggregate_key = v_key AND n.revision > v_rev
            ORDER BY n.revision
            LIMIT 1;
            v_has_next := coalesce(v_has_next, false);
            -- Parked past this ack (an event of a window too large to send):
            -- the aggregate stays parked. A parked row has no holder, so
            -- nothing is handed over then.
            v_stays_parked := v_state = 'parked' AND v_parked_rev > v_rev;
            IF v_holder IS NOT NULL THEN
                v_slot := array_position(p_handover_holders, v_holder);
            END IF;
            -- The claim order a hand-over must not jump: the oldest work
            -- claimable in the streams the holder's session takes, unless
            -- the session has credit to spare for it.
            IF v_slot IS NOT NULL AND v_next_id IS NOT NULL AND NOT v_next_skipped
               AND NOT coalesce(p_handover_spare[v_slot], false) THEN
                SELECT p.oldest INTO v_oldest
                FROM outbox.claim_probe_for(ARRAY[v_holder], p_filter_holders, p_filter_streams, p_filter_excluded,
                                            v_now, p_max_due) p;
            END IF;
            IF v_slot IS NOT NULL AND v_next_id IS NOT NULL AND NOT v_next_skipped
               AND NOT coalesce(v_oldest < least(v_now, v_next_at), false) THEN
                v_ttl := p_handover_ttls[v_slot];
            END IF;

            UPDATE outbox.delivery d
            SET delivered_revision = v_rev,
                state = CASE WHEN v_stays_parked THEN 'parked'
                             WHEN v_ttl IS NOT NULL THEN 'leased'
                             WHEN v_has_next THEN 'ready' ELSE 'idle' END,
                claimable_at = CASE WHEN v_stays_parked THEN NULL
                                    WHEN v_ttl IS NOT NULL THEN v_now + v_ttl
                                    WHEN v_has_next THEN coalesce(v_next_at, v_now) END,
                pending_since = CASE WHEN v_has_next THEN coalesce(v_next_at, v_now) END,
                epoch = CASE WHEN v_ttl IS NOT NULL
                             THEN greatest(d.epoch + 1, (extract(epoch FROM v_now) * 1000000)::bigint)
                             ELSE d.epoch END,
                holder = CASE WHEN v_ttl IS NOT NULL THEN d.holder END,
                holder_relay_id = CASE WHEN v_ttl IS NOT NULL THEN d.holder_relay_id END,
                holder_replica_id = CASE WHEN v_ttl IS NOT NULL THEN d.holder_replica_id END,
                lease_expires_at = CASE WHEN v_ttl IS NOT NULL THEN v_now + v_ttl END,
                leased_event_id = CASE WHEN v_ttl IS NOT NULL THEN v_next_id END,
                leased_through = CASE WHEN v_ttl IS NOT NULL THEN v_rev + 1 END,
                attempt = CASE WHEN v_ttl IS NOT NULL THEN 1 ELSE 0 END,
                failures = 0, unanswered = 0,
                last_error = CASE WHEN v_stays_parked THEN d.last_error END,
                parked_at = CASE WHEN v_stays_parked THEN d.parked_at END,
                parked_reason = CASE WHEN v_stays_parked THEN d.parked_reason END,
                next_attempt_at = NULL, gap_revision = NULL
            WHERE d.stream = v_stream AND d.aggregate_key = v_key
            RETURNING d.epoch, d.attempt, d.lease_expires_at, d.republished_through
            INTO v_epoch, v_attempt, v_expires, v_republished_through;

            IF v_holder IS NOT NULL AND v_holder_replica IS DISTINCT FROM p_replica_id THEN
                PERFORM pg_notify('outbox_released', v_holder::text);
            END IF;

            -- The claim hint: what the holder's session would find to claim
            -- in the streams it takes, now that this ack applied. A holder
            -- not probed (another replica's session) is told to claim. So
            -- is one this ack hands the next event over to: the hand-over
            -- takes the credit the ack frees, so its session does not claim
            -- on this ack and never reads the hint (were the hint read, "claim"
            -- errs on the side that misses nothing). The probe was about a
            -- sixth of this path's backend CPU for every event of a hot
            -- aggregate.
            IF v_holder IS NOT NULL AND v_ttl IS NULL
               AND (p_filter_holders IS NULL OR v_holder = ANY (p_filter_holders)) THEN
                v_probe_now := clock_timestamp();
                SELECT p.next_at INTO v_first_claimable
                FROM outbox.claim_probe_for(ARRAY[v_holder], p_filter_holders, p_filter_streams, p_filter_excluded,
                                            v_probe_now, p_max_due) p;
                v_probed := true;
            END IF;

            RETURN QUERY
            SELECT v_id, 'published'::text, v_holder, v_at, NULL::outbox.lease,
                   CASE WHEN NOT v_probed THEN interval '0'
                        WHEN v_first_claimable IS NOT NULL THEN greatest(v_first_claimable - clock_timestamp(), interval '0')
                   END;
            IF v_ttl IS NOT NULL THEN
                SELECT e.event_id, e.stream, e.aggregate_key, e.revision, e.event_type, e.payload::text,
                       e.headers, e.created_at, v_epoch, v_attempt, v_expires,
                       CASE WHEN v_republished_through IS NOT NULL
                            THEN outbox.republish_action(e.stream, e.aggregate_key, e.revision, v_republished_through) ELSE 0 END
                INTO v_lease
                FROM outbox.event e WHERE e.event_id = v_next_id;
                RETURN QUERY
                SELECT v_id, 'handed_over'::text, v_holder, NULL::timestamptz, v_lease, NULL::interval;
            END IF;
            RETURN;
        END IF;
    END IF;

    -- Lock the pending events, then their aggregates' delivery rows, each in
    -- a fixed order so that concurrent batches cannot deadlock.
    SELECT array_agg(e.event_id), array_agg(e.stream), array_agg(e.aggregate_key),
           array_agg(e.revision), array_agg(e.created_at)
    INTO v_ids, v_streams, v_keys, v_revs, v_created
    FROM (
        SELECT e.event_id, e.stream, e.aggregate_key, e.revision, e.created_at FROM outbox.event e
        WHERE e.event_id = ANY (p_event_ids) AND e.published_at IS NULL
        ORDER BY e.event_id
        FOR UPDATE OF e
    ) e;

    IF v_ids IS NOT NULL THEN
        -- An event may be marked only while it is its aggregate's next
        -- revision and not skipped, the acks before it in this call
        -- counted: its revision is the cursor plus its rank among this
        -- call's acks ahead of the cursor, and none of those before it is
        -- skipped.
        SELECT array_agg(z.event_id) FILTER (WHERE z.ok),
               array_agg(z.stream) FILTER (WHERE z.ok),
               array_agg(z.aggregate_key) FILTER (WHERE z.ok),
               array_agg(z.revision) FILTER (WHERE z.ok),
               array_agg(z.created_at) FILTER (WHERE z.ok),
               array_agg(z.row_tid) FILTER (WHERE z.ok),
               array_agg(z.holder) FILTER (WHERE z.ok),
               array_agg(DISTINCT z.holder) FILTER (WHERE z.ok AND z.holder IS NOT NULL
                                                    AND z.holder_replica_id IS DISTINCT FROM p_replica_id),
               -- A window in play: an aggregate with more than one ack
               -- here, or a lease that covers more than the acked revision.
               coalesce(bool_or(z.ok AND (z.rank > 1 OR (z.state = 'leased' AND z.leased_through > z.revision))), false),
               -- Parked past this ack (an event of a window too large to
               -- send): the aggregate stays parked.
               array_agg(z.state = 'parked' AND z.parked_revision > z.revision) FILTER (WHERE z.ok),
               -- Whose claim index to probe: for the claim order, the
               -- holders that may take a hand-over and have no credit to
               -- spare; for the hint, this replica's (when it names them).
               array_agg(DISTINCT z.holder) FILTER (WHERE z.ok AND z.holder = ANY (p_handover_holders)
                   AND NOT coalesce(p_handover_spare[array_position(p_handover_holders, z.holder)], false)),
               array_agg(DISTINCT z.holder) FILTER (WHERE z.ok AND z.holder IS NOT NULL
                                                    AND (p_filter_holders IS NULL OR z.holder = ANY (p_filter_holders)))
        INTO v_ok, v_ok_streams, v_ok_keys, v_ok_revs, v_ok_created, v_ok_tids, v_holders, v_remote, v_windowed, v_ok_parked,
             v_probe_handover, v_probe_for
        FROM (
            SELECT y.*, y.ahead AND y.revision = y.delivered_revision + y.rank AND y.clean AS ok
            FROM (
                SELECT x.*, row_number() OVER w AS rank, bool_and(NOT x.skipped) OVER w AS clean
                FROM (
                    SELECT l.event_id, l.stream, l.aggregate_key, l.revision, l.created_at,
                           d.holder, d.holder_replica_id, d.delivered_revision, d.state, d.leased_through, d.parked_revision,
                           d.row_tid, l.revision > d.delivered_revision AS ahead,
                           (SELECT true FROM outbox.skipped_event s WHERE s.event_id = l.event_id) IS NOT NULL AS skipped
                    FROM (SELECT * FROM unnest(v_ids, v_streams, v_keys, v_revs, v_created)
                                   AS l(event_id, stream, aggregate_key, revision, created_at)
                          ORDER BY l.stream, l.aggregate_key) l
                    -- Each row by a probe of its key, locked in key order
                    -- (LATERAL with LIMIT: a join, planned while the table
                    -- was small, would pass over all of it). Its tuple id
                    -- stays valid while this transaction holds the lock and
                    -- does not update the row, and the updates below reach
                    -- the row by it (see v_advanced).
                    CROSS JOIN LATERAL (
                        SELECT d.holder, d.holder_replica_id, d.delivered_revision, d.state, d.leased_through,
                               d.parked_revision, d.ctid AS row_tid
                        FROM outbox.delivery d
                        WHERE d.stream = l.stream AND d.aggregate_key = l.aggregate_key
                        LIMIT 1
                        FOR UPDATE
                    ) d
                ) x
                WINDOW w AS (PARTITION BY x.stream, x.aggregate_key, x.ahead ORDER BY x.revision)
            ) y
        ) z;
        -- The clock again, now that the rows are ours (see the one-row
        -- path): hand-overs run their TTL from here.
        v_now := clock_timestamp();
    END IF;

    IF v_ok IS NOT NULL THEN
        -- The delivery rate, counted where events are marked published (only
        -- here), per stream, in the statement that marks them. Not a
        -- trigger on outbox.event: an AFTER statement trigger with a
        -- transition table cost an ack of one event more than the update
        -- itself.
        v_set := set_config('outbox.acking', 'on', true);
        WITH marked AS (
            UPDATE outbox.event e SET published_at = v_now WHERE e.event_id = ANY (v_ok)
            RETURNING e.stream
        )
        INSERT INTO outbox.delivered_count AS c (stream, bucket, backend_pid, events)
        SELECT n.stream, date_bin('5 seconds', v_now, timestamptz '2000-01-01'), pg_backend_pid(), count(*)
        FROM marked n
        GROUP BY n.stream
        ON CONFLICT (stream, bucket, backend_pid) DO UPDATE SET events = c.events + excluded.events;
        v_set := set_config('outbox.acking', 'off', true);

        IF NOT v_windowed AND coalesce(NOT 1 < ANY (p_handover_windows), true)
           AND coalesce(NOT 0 < ANY (p_handover_credits), true) THEN
            -- No window in play (every session here takes one event of an
            -- aggregate at a time, and every lease covers one revision):
            -- one ack per aggregate, whose lease it ends, and a hand-over of
            -- at most the next revision. The same decisions as the general
            -- statement below, in a statement of a third of its plan: the
            -- executor's start-up of that plan cost about as much as
            -- running it, on every ack batch.
            --
            -- The claim order a hand-over must not jump (probe): per
            -- session that may take a hand-over, the oldest work claimable
            -- in the streams it takes, a few probes of the claim index per
            -- stream. Read only for an ack whose next revision is there
            -- (the gate on next_id in h comes first, and a CTE is run
            -- only when read), so a batch that hands nothing over never
            -- probes.
            WITH probe AS MATERIALIZED (
                SELECT p.holder, p.oldest
                FROM outbox.claim_probe_for(v_probe_handover, p_filter_holders, p_filter_streams, p_filter_excluded,
                                            v_now, p_max_due) p
            ), fol AS (
                -- What follows each ack, in one probe: the first revision
                -- after it is the next (if it is the ack's plus one), and
                -- whether there is any says whether anything follows.
                SELECT a.*, CASE WHEN f.revision = a.revision + 1 THEN f.event_id END AS next_id,
                       CASE WHEN f.revision = a.revision + 1 THEN f.created_at END AS next_created_at,
                       f.event_id IS NOT NULL AS has_next
                FROM unnest(v_ok, v_ok_streams, v_ok_keys, v_ok_revs, v_holders, v_ok_parked, v_ok_tids)
                     AS a(event_id, stream, aggregate_key, revision, holder, stays_parked, row_tid)
                LEFT JOIN LATERAL (
                    SELECT e.event_id, e.revision, e.created_at FROM outbox.event e
                    WHERE e.stream = a.stream AND e.aggregate_key = a.aggregate_key AND e.revision > a.revision
                    ORDER BY e.revision
                    LIMIT 1
                ) f ON true
            ), nxt AS (
                SELECT a.*, h.ttl AS handover_ttl
                FROM fol a
                LEFT JOIN LATERAL (
                    SELECT t.ttl FROM unnest(p_handover_holders, p_handover_ttls) AS t(holder, ttl)
                    WHERE t.holder = a.holder AND a.next_id IS NOT NULL
                      AND (SELECT true FROM outbox.skipped_event s WHERE s.event_id = a.next_id) IS NULL
                      AND NOT coalesce((SELECT o.oldest FROM probe o WHERE o.holder = a.holder)
                                       < least(v_now, a.next_created_at), false)
                    LIMIT 1
                ) h ON true
            ), advanced AS (
                UPDATE outbox.delivery d
                SET delivered_revision = x.revision,
                    state = CASE WHEN x.stays_parked THEN 'parked'
                                 WHEN x.handover_ttl IS NOT NULL THEN 'leased'
                                 WHEN x.has_next THEN 'ready' ELSE 'idle' END,
                    claimable_at = CASE WHEN x.stays_parked THEN NULL
                                        WHEN x.handover_ttl IS NOT NULL THEN v_now + x.handover_ttl
                                        WHEN x.has_next THEN coalesce(x.next_created_at, v_now) END,
                    pending_since = CASE WHEN x.has_next THEN coalesce(x.next_created_at, v_now) END,
                    epoch = CASE WHEN x.handover_ttl IS NOT NULL
                                 THEN greatest(d.epoch + 1, (extract(epoch FROM v_now) * 1000000)::bigint)
                                 ELSE d.epoch END,
                    holder = CASE WHEN x.handover_ttl IS NOT NULL THEN d.holder END,
                    holder_relay_id = CASE WHEN x.handover_ttl IS NOT NULL THEN d.holder_relay_id END,
                    holder_replica_id = CASE WHEN x.handover_ttl IS NOT NULL THEN d.holder_replica_id END,
                    lease_expires_at = CASE WHEN x.handover_ttl IS NOT NULL THEN v_now + x.handover_ttl END,
                    leased_event_id = CASE WHEN x.handover_ttl IS NOT NULL THEN x.next_id END,
                    leased_through = CASE WHEN x.handover_ttl IS NOT NULL THEN x.revision + 1 END,
                    attempt = CASE WHEN x.handover_ttl IS NOT NULL THEN 1 ELSE 0 END,
                    failures = 0, unanswered = 0,
                    last_error = CASE WHEN x.stays_parked THEN d.last_error END,
                    parked_at = CASE WHEN x.stays_parked THEN d.parked_at END,
                    parked_reason = CASE WHEN x.stays_parked THEN d.parked_reason END,
                    next_attempt_at = NULL, gap_revision = NULL
                FROM nxt x
                WHERE d.ctid = x.row_tid
                RETURNING d.state, d.holder, d.leased_event_id, d.epoch, d.attempt, d.lease_expires_at,
                          d.republished_through, x.event_id AS acked
            )
            SELECT array_agg(ROW(e.event_id, e.stream, e.aggregate_key, e.revision, e.event_type, e.payload::text,
                                 e.headers, e.created_at, a.epoch, a.attempt, a.lease_expires_at,
                                 CASE WHEN a.republished_through IS NOT NULL
                                      THEN outbox.republish_action(e.stream, e.aggregate_key, e.revision,
                                                                   a.republished_through) ELSE 0 END)::outbox.lease)
                       FILTER (WHERE a.state = 'leased'),
                   array_agg(a.holder) FILTER (WHERE a.state = 'leased'),
                   array_agg(a.acked) FILTER (WHERE a.state = 'leased'),
                   count(*)
            INTO v_handed, v_handed_holders, v_handed_acks, v_advanced
            FROM advanced a
            LEFT JOIN LATERAL (
                SELECT e.* FROM outbox.event e WHERE e.event_id = a.leased_event_id AND a.state = 'leased' LIMIT 1
            ) e ON true;
            -- Every row locked above was advanced (see v_advanced).
            IF v_advanced <> cardinality(v_ok) THEN
                RAISE EXCEPTION 'outbox: ack advanced % of % delivery rows', v_advanced, cardinality(v_ok)
                    USING ERRCODE = 'internal_error';
            END IF;
        ELSE
            -- The claim order hand-over must not jump, as above.
            IF v_probe_handover IS NOT NULL THEN
                SELECT array_agg(p.holder), array_agg(p.oldest) INTO v_probe_holders, v_probe_oldest
                FROM outbox.claim_probe_for(v_probe_handover, p_filter_holders, p_filter_streams, p_filter_excluded,
                                            v_now, p_max_due) p;
            END IF;
            -- Advance each cursor and say what comes next: the lease goes on
            -- when its window reaches past the cursor (and slides forward for a
            -- local holder); for a local holder whose lease ended, a new lease
            -- of the next revisions when they are committed and not skipped;
            -- ready when a later revision is committed; idle otherwise. This
            -- statement's snapshot is newer than the row locks above, so it
            -- sees every event that discovery found before; one committed but
            -- not yet discovered is found by the next round, which wakes the
            -- idle aggregate (a leased or ready one needs no waking).
            WITH acked AS (
                SELECT a.stream, a.aggregate_key, max(a.revision) AS cursor, count(*) AS acks,
                       (array_agg(a.event_id ORDER BY a.revision DESC))[1] AS last_ack,
                       bool_and(a.stays_parked) AS stays_parked, (array_agg(a.row_tid))[1] AS row_tid
                FROM unnest(v_ok, v_ok_streams, v_ok_keys, v_ok_revs, v_ok_parked, v_ok_tids)
                     AS a(event_id, stream, aggregate_key, revision, stays_parked, row_tid)
                GROUP BY a.stream, a.aggregate_key
            ), cur AS (
                SELECT a.*, d.holder, h.ttl, coalesce(h.win, 1) AS win, coalesce(h.credit, 0) AS credit,
                       o.oldest AS claim_oldest,
                       n.event_id AS next_id, n.created_at AS next_created_at,
                       n.event_id IS NOT NULL AND NOT n.skipped AS next_ok,
                       d.state = 'leased' AND d.leased_through > a.cursor AND n.event_id IS NOT NULL
                           AND NOT n.skipped AS continues,
                       d.leased_through,
                       (n.event_id IS NOT NULL OR EXISTS (
                            SELECT 1 FROM outbox.event x
                            WHERE x.stream = a.stream AND x.aggregate_key = a.aggregate_key
                              AND x.revision > a.cursor + 1)) AS has_next
                FROM acked a
                CROSS JOIN LATERAL (
                    SELECT d.holder, d.state, d.leased_through FROM outbox.delivery d
                    WHERE d.ctid = a.row_tid
                    LIMIT 1
                ) d
                LEFT JOIN LATERAL (
                    SELECT e.event_id, e.created_at,
                           (SELECT true FROM outbox.skipped_event s WHERE s.event_id = e.event_id) IS NOT NULL AS skipped
                    FROM outbox.event e
                    WHERE e.stream = a.stream AND e.aggregate_key = a.aggregate_key AND e.revision = a.cursor + 1
                    LIMIT 1
                ) n ON true
                LEFT JOIN unnest(p_handover_holders, p_handover_ttls, p_handover_windows, p_handover_credits)
                     AS h(holder, ttl, win, credit) ON h.holder = d.holder
                LEFT JOIN unnest(v_probe_holders, v_probe_oldest) AS o(holder, oldest) ON o.holder = d.holder
            ), want AS (
                -- Where new leases would start, and how many at most.
                SELECT c.*,
                       CASE WHEN c.continues THEN c.leased_through + 1 ELSE c.cursor + 1 END AS start,
                       CASE WHEN c.ttl IS NULL THEN 0
                            WHEN c.continues THEN c.cursor + c.win - c.leased_through
                            WHEN c.next_ok THEN c.win
                            ELSE 0 END AS room
                FROM cur c
            ), avail AS (
                -- How many of those are there: contiguous, not skipped. A
                -- window of one from the next revision is what cur read
                -- already.
                SELECT w.*, CASE WHEN coalesce(w.claim_oldest < least(v_now, v.first_created_at), false) THEN 0
                                 ELSE coalesce(v.n, 0) END AS n
                FROM want w
                LEFT JOIN LATERAL (
                    SELECT 1 AS n, w.next_created_at AS first_created_at
                    WHERE w.room = 1 AND NOT w.continues
                    UNION ALL
                    SELECT count(*), min(r.created_at)
                    FROM (
                        SELECT e.revision, e.created_at, row_number() OVER (ORDER BY e.revision) AS rn
                        FROM outbox.event e
                        WHERE (w.room > 1 OR (w.room = 1 AND w.continues))
                          AND e.stream = w.stream AND e.aggregate_key = w.aggregate_key
                          AND e.revision >= w.start AND e.revision < w.start + w.room
                          AND (SELECT true FROM outbox.skipped_event s WHERE s.event_id = e.event_id) IS NULL
                    ) r
                    WHERE r.revision = w.start + r.rn - 1
                    HAVING count(*) > 0
                ) v ON true
            ), granted AS (
                -- A holder's credit here: what its acks in this call free plus
                -- what it lends, shared out over its aggregates in key order.
                SELECT a.*, greatest(0, least(a.n,
                           sum(a.acks) OVER (PARTITION BY a.holder) + a.credit
                           - (sum(a.n) OVER (PARTITION BY a.holder ORDER BY a.stream, a.aggregate_key) - a.n)))::bigint AS grant_n
                FROM avail a
            ), advanced AS (
                UPDATE outbox.delivery d
                SET delivered_revision = g.cursor,
                    state = CASE WHEN g.stays_parked THEN 'parked'
                                 WHEN g.continues OR g.grant_n > 0 THEN 'leased'
                                 WHEN g.has_next THEN 'ready' ELSE 'idle' END,
                    leased_through = CASE WHEN g.continues THEN d.leased_through + g.grant_n
                                          WHEN g.grant_n > 0 THEN g.cursor + g.grant_n END,
                    leased_event_id = CASE WHEN g.continues OR g.grant_n > 0 THEN g.next_id END,
                    epoch = CASE WHEN NOT g.continues AND g.grant_n > 0
                                 THEN greatest(d.epoch + 1, (extract(epoch FROM v_now) * 1000000)::bigint)
                                 ELSE d.epoch END,
                    -- Events leased now are sent with the holder's full TTL.
                    lease_expires_at = CASE WHEN g.grant_n > 0 THEN greatest(v_now + g.ttl, CASE WHEN g.continues THEN d.lease_expires_at END)
                                            WHEN g.continues THEN d.lease_expires_at END,
                    claimable_at = CASE WHEN g.stays_parked THEN NULL
                                        WHEN g.grant_n > 0 THEN greatest(v_now + g.ttl, CASE WHEN g.continues THEN d.lease_expires_at END)
                                        WHEN g.continues THEN d.lease_expires_at
                                        WHEN g.has_next THEN coalesce(g.next_created_at, v_now) END,
                    pending_since = CASE WHEN g.has_next THEN coalesce(g.next_created_at, v_now) END,
                    holder = CASE WHEN g.continues OR g.grant_n > 0 THEN d.holder END,
                    holder_relay_id = CASE WHEN g.continues OR g.grant_n > 0 THEN d.holder_relay_id END,
                    holder_replica_id = CASE WHEN g.continues OR g.grant_n > 0 THEN d.holder_replica_id END,
                    attempt = CASE WHEN g.continues THEN d.attempt WHEN g.grant_n > 0 THEN 1 ELSE 0 END,
                    failures = 0, unanswered = 0,
                    last_error = CASE WHEN g.stays_parked THEN d.last_error END,
                    parked_at = CASE WHEN g.stays_parked THEN d.parked_at END,
                    parked_reason = CASE WHEN g.stays_parked THEN d.parked_reason END,
                    next_attempt_at = NULL, gap_revision = NULL
                FROM granted g
                WHERE d.ctid = g.row_tid
                RETURNING d.stream, d.aggregate_key, d.holder, d.epoch, d.attempt, d.lease_expires_at,
                          d.republished_through, g.start, g.grant_n, g.last_ack
            )
            SELECT array_agg(ROW(e.event_id, e.stream, e.aggregate_key, e.revision, e.event_type, e.payload::text,
                                 e.headers, e.created_at, a.epoch, a.attempt, a.lease_expires_at,
                                 CASE WHEN a.republished_through IS NOT NULL
                                      THEN outbox.republish_action(e.stream, e.aggregate_key, e.revision,
                                                                   a.republished_through) ELSE 0 END)::outbox.lease
                             ORDER BY e.stream, e.aggregate_key, e.revision),
                   array_agg(a.holder ORDER BY e.stream, e.aggregate_key, e.revision),
                   array_agg(a.last_ack ORDER BY e.stream, e.aggregate_key, e.revision),
                   (SELECT count(*) FROM advanced), (SELECT count(*) FROM acked)
            INTO v_handed, v_handed_holders, v_handed_acks, v_advanced, v_acked_aggregates
            FROM advanced a
            CROSS JOIN LATERAL (
                SELECT e.* FROM outbox.event e
                WHERE e.stream = a.stream AND e.aggregate_key = a.aggregate_key
                  AND e.revision >= a.start AND e.revision < a.start + a.grant_n
                LIMIT a.grant_n
            ) e
            WHERE a.grant_n > 0;
            -- Every row locked above was advanced (see v_advanced).
            IF v_advanced <> v_acked_aggregates THEN
                RAISE EXCEPTION 'outbox: ack advanced % of % delivery rows', v_advanced, v_acked_aggregates
                    USING ERRCODE = 'internal_error';
            END IF;
        END IF;

        -- Sessions on other replicas holding these leases free their credit
        -- now rather than at their next reconciliation.
        IF v_remote IS NOT NULL THEN
            PERFORM pg_notify('outbox_released', h::text) FROM unnest(v_remote) AS h;
        END IF;
        -- A holder handed at least as many events as it acked here takes
        -- the credit its acks free with them: its session does not claim on
        -- this batch and never reads the hint, so it is not probed (as in
        -- the one-row path); its hint says "claim", which misses nothing
        -- were it read.
        IF v_handed_holders IS NOT NULL AND v_probe_for IS NOT NULL THEN
            v_probe_for := ARRAY(
                SELECT p.holder FROM unnest(v_probe_for) AS p(holder)
                WHERE (SELECT count(*) FROM unnest(v_holders) AS a(holder) WHERE a.holder = p.holder)
                      > (SELECT count(*) FROM unnest(v_handed_holders) AS h(holder) WHERE h.holder = p.holder));
        END IF;
        v_probe_now := clock_timestamp();
    END IF;

    -- Published ones straight from the arrays, each with its claim hint:
    -- what its holder's session would find to claim now that this batch
    -- applied, as late as this transaction can look (the probe in this
    -- statement, after every write). Holders not among this replica's
    -- sessions (when it names them) are not probed: nothing reads their
    -- hint. The rest, if any, need a look at the event to say why not.
    -- Then the leases handed over, in revision order. (The last two run
    -- only when they have rows to return: starting a statement's executor
    -- costs as much as a small one's work, and a batch of one ack runs on
    -- every event of a hot aggregate.)
    RETURN QUERY
    WITH hint AS MATERIALIZED (
        SELECT p.holder, p.next_at
        FROM outbox.claim_probe_for(v_probe_for, p_filter_holders, p_filter_streams, p_filter_excluded,
                                    v_probe_now, p_max_due) p
    )
    SELECT o.id, 'published'::text, o.holder, o.created_at, NULL::outbox.lease,
           CASE WHEN n.holder IS NULL THEN interval '0'
                WHEN n.next_at IS NOT NULL THEN greatest(n.next_at - clock_timestamp(), interval '0') END
    FROM unnest(v_ok, v_holders, v_ok_created) AS o(id, holder, created_at)
    LEFT JOIN hint n ON n.holder = o.holder;
    IF coalesce(cardinality(v_ok), 0) < cardinality(p_event_ids) THEN
        RETURN QUERY
        SELECT i.id,
               CASE WHEN l.id IS NOT NULL AND NOT l.skipped AND l.revision > d.delivered_revision + 1 THEN 'out_of_order'
                    WHEN l.id IS NOT NULL THEN 'lease_lost'
                    WHEN e.published_at IS NOT NULL THEN 'already_published'
                    WHEN e.event_id IS NOT NULL THEN 'lease_lost'
                    ELSE 'not_found' END,
               NULL::uuid, NULL::timestamptz, NULL::outbox.lease, NULL::interval
        FROM (SELECT DISTINCT unnest(p_event_ids) AS id) i
        LEFT JOIN unnest(v_ok) AS ok(id) ON ok.id = i.id
        LEFT JOIN LATERAL (
            SELECT u.id, u.stream, u.aggregate_key, u.revision,
                   (SELECT true FROM outbox.skipped_event s WHERE s.event_id = u.id) IS NOT NULL AS skipped
            FROM unnest(v_ids, v_streams, v_keys, v_revs) AS u(id, stream, aggregate_key, revision)
            WHERE u.id = i.id
        ) l ON true
        LEFT JOIN LATERAL (
            SELECT d.delivered_revision FROM outbox.delivery d
            WHERE d.stream = l.stream AND d.aggregate_key = l.aggregate_key
            LIMIT 1
        ) d ON true
        LEFT JOIN LATERAL (
            SELECT e.event_id, e.published_at FROM outbox.event e
            WHERE e.event_id = i.id AND l.id IS NULL
            LIMIT 1
        ) e ON true
        WHERE ok.id IS NULL;
    END IF;
    IF v_handed IS NOT NULL THEN
        RETURN QUERY
        SELECT v_handed_acks[i], 'handed_over'::text, v_handed_holders[i], NULL::timestamptz, v_handed[i],
               NULL::interval
        FROM generate_subscripts(v_handed, 1) AS i
        ORDER BY i;
    END IF;
END
$$;

--
-- Name: claim(uuid, text, text, text[], integer, interval, integer, text[], integer, integer, interval); Type: FUNCTION; Schema: outbox; Owner: -
--

CREATE FUNCTION outbox.claim(p_holder uuid, p_relay_id text, p_replica_id text, p_streams text[], p_limit integer, p_ttl interval, p_max_attempts integer DEFAULT NULL::integer, p_exclude_streams text[] DEFAULT NULL::text[], p_window integer DEFAULT 1, p_credit integer DEFAULT NULL::integer, p_max_due interval DEFAULT NULL::interval) RETURNS SETOF outbox.lease
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET enable_sort TO 'off'
    SET enable_incremental_sort TO 'off'
    SET jit TO 'off'
    SET plan_cache_mode TO 'force_generic_plan'
    AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := clock_timestamp();
    v_streams text[];
    v_keys text[];
    v_leased bigint;
    v_again_streams text[];
    v_again_keys text[];
    r record;
    v_cursor bigint;
    v_later bigint;
    v_scan integer := p_limit;
    v_more_streams text[];
    v_more_keys text[];
    v_cand_streams text[];
    v_cand_keys text[];
    v_cut boolean;
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        PERFORM outbox.require_read_committed('outbox.claim');
    END IF;
    -- 1. Lock the oldest claimable aggregates of the streams this session
    --    takes. The candidates are read, unlocked, from the claim index one
    --    stream and range at a time (the first v_scan of each, in claim
    --    order), so what other streams hold is never read; then locked in
    --    claim order until p_limit are, each row checked again once locked.
    --    SKIP LOCKED: one that another session is claiming, acking or
    --    discovering right now is simply not ours this time. When that
    --    left the claim short and some range had more rows than were read,
    --    it reads further (sessions claiming at once read the same
    --    candidates, and the later ones must get past those the first
    --    locked). The claim order of an aggregate whose claimable_at lies
    --    ahead of the clock (claimable after a step back, see
    --    claim_ranges) is now.
    LOOP
        SELECT array_agg(x.stream ORDER BY x.claim_order, x.stream, x.aggregate_key),
               array_agg(x.aggregate_key ORDER BY x.claim_order, x.stream, x.aggregate_key),
               coalesce(max(x.n), 0) >= v_scan
        INTO v_cand_streams, v_cand_keys, v_cut
        FROM (
            SELECT x.stream, x.aggregate_key, least(x.claimable_at, v_now) AS claim_order, x.n
            FROM outbox.claimable_streams(p_streams, p_exclude_streams) s
            CROSS JOIN outbox.claim_ranges(v_now, p_max_due) r
            CROSS JOIN LATERAL (
                SELECT d.stream, d.aggregate_key, d.claimable_at, row_number() OVER () AS n
                FROM (
                    SELECT d.stream, d.aggregate_key, d.claimable_at FROM outbox.delivery d
                    WHERE d.stream = s.stream AND d.state = r.state
                      AND d.claimable_at > r.after AND d.claimable_at <= r.through
                    ORDER BY d.claimable_at
                    LIMIT v_scan
                ) d
            ) x
            WHERE r.claimable
        ) x;
        EXIT WHEN v_cand_streams IS NULL;
        -- Locked in a statement of its own, by key from the candidates'
        -- arrays (a nested loop over them, never a scan of the table). A
        -- due time beyond the longest lease or backoff is judged against
        -- the clock read here, not v_now: this statement sees leases that
        -- acks and other claims granted since v_now, from a later clock,
        -- for up to p_max_due, and against v_now such a lease would look
        -- like one a clock step left ahead, and be leased a second time.
        SELECT array_agg(c.stream), array_agg(c.aggregate_key) INTO v_more_streams, v_more_keys
        FROM (
            SELECT d.stream, d.aggregate_key
            FROM unnest(v_cand_streams, v_cand_keys) WITH ORDINALITY AS k(stream, aggregate_key, ord)
            -- (LATERAL with LIMIT keeps it a probe per key: a join, planned
            -- while the table was small, would pass over all of it.)
            CROSS JOIN LATERAL (
                SELECT d.stream, d.aggregate_key FROM outbox.delivery d
                WHERE d.stream = k.stream AND d.aggregate_key = k.aggregate_key
                  AND (d.state = 'ready' OR d.claimable_at <= v_now
                       OR d.claimable_at > clock_timestamp() + p_max_due)
                LIMIT 1
                FOR UPDATE SKIP LOCKED
            ) d
            WHERE v_streams IS NULL OR (k.stream, k.aggregate_key) NOT IN (SELECT * FROM unnest(v_streams, v_keys))
            ORDER BY k.ord
            LIMIT p_limit - coalesce(cardinality(v_streams), 0)
        ) c;
        v_streams := v_streams || v_more_streams;
        v_keys := v_keys || v_more_keys;
        EXIT WHEN coalesce(cardinality(v_streams), 0) >= p_limit OR NOT v_cut OR v_scan >= 64 * p_limit;
        v_scan := v_scan * 4;
    END LOOP;
    IF v_streams IS NULL THEN
        RETURN;
    END IF;

    -- 2. Lease every locked aggregate whose next revision is there.
    RETURN QUERY SELECT * FROM outbox.lease_heads(v_streams, v_keys, p_holder, p_relay_id, p_replica_id, p_ttl, v_now,
                                                  p_max_attempts, p_window, p_credit);
    GET DIAGNOSTICS v_leased = ROW_COUNT;
    -- (With a window the count is of events, so it proves nothing.)
    IF v_leased = cardinality(v_streams) AND p_window = 1 THEN
        RETURN;
    END IF;
    -- (An aggregate lease_heads parked instead has its next revision, so the
    -- loop below passes it by.)

    -- 3. The rare path: locked aggregates whose next revision is missing or
    --    skipped. Every statement from here reads a snapshot taken after the
    --    locks of step 1, so it sees every event that a discovery round
    --    which locked the row before us had found; a round after us finds
    --    the row idle or gap-held and wakes it.
    FOR r IN
        SELECT d.stream, d.aggregate_key, d.delivered_revision
        FROM unnest(v_streams, v_keys) AS l(stream, aggregate_key)
        CROSS JOIN LATERAL (
            SELECT d.stream, d.aggregate_key, d.delivered_revision FROM outbox.delivery d
            WHERE d.stream = l.stream AND d.aggregate_key = l.aggregate_key
            LIMIT 1
        ) d
        WHERE (SELECT true FROM outbox.event e
               WHERE e.stream = d.stream AND e.aggregate_key = d.aggregate_key
                 AND e.revision = d.delivered_revision + 1
                 AND (SELECT true FROM outbox.skipped_event s WHERE s.event_id = e.event_id) IS NULL) IS NULL
    LOOP
        -- Step over revisions an operator skipped.
        v_cursor := r.delivered_revision;
        WHILE EXISTS (
            SELECT 1 FROM outbox.event e
            WHERE e.stream = r.stream AND e.aggregate_key = r.aggregate_key AND e.revision = v_cursor + 1
              AND (SELECT true FROM outbox.skipped_event s WHERE s.event_id = e.event_id) IS NOT NULL)
        LOOP
            v_cursor := v_cursor + 1;
        END LOOP;
        IF v_cursor <> r.delivered_revision THEN
            UPDATE outbox.delivery d SET delivered_revision = v_cursor
            WHERE d.stream = r.stream AND d.aggregate_key = r.aggregate_key;
        END IF;
        IF EXISTS (
            SELECT 1 FROM outbox.event e
            WHERE e.stream = r.stream AND e.aggregate_key = r.aggregate_key AND e.revision = v_cursor + 1) THEN
            v_again_streams := v_again_streams || r.stream;
            v_again_keys := v_again_keys || r.aggregate_key;
            CONTINUE;
        END IF;
        SELECT min(e.revision) INTO v_later FROM outbox.event e
        WHERE e.stream = r.stream AND e.aggregate_key = r.aggregate_key AND e.revision > v_cursor + 1;
        IF v_later IS NULL THEN
            UPDATE outbox.delivery d
            SET state = 'idle', claimable_at = NULL, pending_since = NULL,
                holder = NULL, holder_relay_id = NULL, holder_replica_id = NULL,
                lease_expires_at = NULL, next_attempt_at = NULL, gap_revision = NULL
            WHERE d.stream = r.stream AND d.aggregate_key = r.aggregate_key;
        ELSE
            -- A later revision exists but the next one does not: hold the
            -- aggregate and report the gap, never skip over it. Discovery
            -- wakes it when any event of the aggregate commits.
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

    -- 4. Lease the aggregates whose cursor stepped over skipped revisions to
    --    an event that is there.
    IF v_again_streams IS NOT NULL THEN
        RETURN QUERY SELECT * FROM outbox.lease_heads(v_again_streams, v_again_keys, p_holder, p_relay_id, p_replica_id,
                                                      p_ttl, v_now, p_max_attempts, p_window, (p_credit - v_leased)::integer);
    END IF;
END
$$;

--
-- Name: claim_probe(text[], text[], timestamp with time zone, interval); Type: FUNCTION; Schema: outbox; Owner: -
--

CREATE FUNCTION outbox.claim_probe(p_streams text[], p_exclude text[], p_now timestamp with time zone, p_max_due interval) RETURNS TABLE(oldest timestamp with time zone, next_at timestamp with time zone)
    LANGUAGE sql STABLE
    AS $$
    SELECT c.oldest,
           CASE WHEN c.oldest IS NOT NULL THEN p_now
                ELSE (SELECT min(h.claimable_at) FROM outbox.claim_range_heads(p_streams, p_exclude, p_now, p_max_due, false) h)
           END
    FROM (
        SELECT min(least(h.claimable_at, p_now)) AS oldest
        FROM outbox.claim_range_heads(p_streams, p_exclude, p_now, p_max_due, true) h
    ) c
$$;

--
-- Name: claim_probe_for(uuid[], uuid[], text[], boolean[], timestamp with time zone, interval); Type: FUNCTION; Schema: outbox; Owner: -
--

CREATE FUNCTION outbox.claim_probe_for(p_holders uuid[], p_filter_holders uuid[], p_filter_streams text[], p_filter_excluded boolean[], p_now timestamp with time zone, p_max_due interval) RETURNS TABLE(holder uuid, oldest timestamp with time zone, next_at timestamp with time zone)
    LANGUAGE sql STABLE
    AS $$
    WITH h AS (
        SELECT u.holder,
               array_agg(f.stream ORDER BY f.stream) FILTER (WHERE f.stream IS NOT NULL AND NOT f.excluded) AS streams,
               array_agg(f.stream ORDER BY f.stream) FILTER (WHERE f.excluded) AS exclude
        FROM (SELECT DISTINCT x.holder FROM unnest(p_holders) AS x(holder) WHERE x.holder IS NOT NULL) u
        LEFT JOIN unnest(p_filter_holders, p_filter_streams, p_filter_excluded) AS f(holder, stream, excluded)
               ON f.holder = u.holder
        GROUP BY u.holder
    )
    SELECT u.holder, p.oldest, p.next_at
    FROM (
        SELECT f.holders, x.oldest, x.next_at
        FROM (SELECT array_agg(h.holder) AS holders, h.streams, h.exclude FROM h GROUP BY h.streams, h.exclude) f
        CROSS JOIN LATERAL outbox.claim_probe(f.streams, f.exclude, p_now, p_max_due) x
        OFFSET 0
    ) p
    CROSS JOIN LATERAL unnest(p.holders) AS u(holder)
$$;

--
-- Name: claim_range_heads(text[], text[], timestamp with time zone, interval, boolean); Type: FUNCTION; Schema: outbox; Owner: -
--

CREATE FUNCTION outbox.claim_range_heads(p_streams text[], p_exclude text[], p_now timestamp with time zone, p_max_due interval, p_claimable boolean) RETURNS TABLE(claimable_at timestamp with time zone)
    LANGUAGE sql STABLE
    AS $$
    SELECT x.claimable_at
    FROM outbox.claimable_streams(p_streams, p_exclude) s
    CROSS JOIN outbox.claim_ranges(p_now, p_max_due) r
    CROSS JOIN LATERAL (
        SELECT d.claimable_at FROM outbox.delivery d
        WHERE d.stream = s.stream AND d.state = r.state
          AND d.claimable_at > r.after AND d.claimable_at <= r.through
        ORDER BY d.claimable_at
        LIMIT 1
    ) x
    WHERE r.claimable = p_claimable
$$;

--
-- Name: claim_ranges(timestamp with time zone, interval); Type: FUNCTION; Schema: outbox; Owner: -
--

CREATE FUNCTION outbox.claim_ranges(p_now timestamp with time zone, p_max_due interval) RETURNS TABLE(state text, after timestamp with time zone, through timestamp with time zone, claimable boolean)
    LANGUAGE sql IMMUTABLE
    AS $$
    VALUES ('ready', '-infinity'::timestamptz, 'infinity'::timestamptz, true),
           ('leased', '-infinity', p_now, true),
           ('backoff', '-infinity', p_now, true),
           ('leased', p_now + p_max_due, 'infinity', true),
           ('backoff', p_now + p_max_due, 'infinity', true),
           ('leased', p_now, coalesce(p_now + p_max_due, 'infinity'), false),
           ('backoff', p_now, coalesce(p_now + p_max_due, 'infinity'), false)
$$;

--
-- Name: claimable_streams(text[], text[]); Type: FUNCTION; Schema: outbox; Owner: -
--

CREATE FUNCTION outbox.claimable_streams(p_streams text[], p_exclude text[]) RETURNS TABLE(stream text)
    LANGUAGE sql STABLE
    AS $$
    SELECT s.stream FROM unnest(p_streams) AS s(stream)
    UNION ALL
    SELECT r.stream FROM (
        WITH RECURSIVE r(stream) AS (
            SELECT (SELECT d.stream FROM outbox.delivery d WHERE d.claimable_at IS NOT NULL
                    ORDER BY d.stream DESC, d.state DESC, d.claimable_at DESC LIMIT 1)
            UNION ALL
            SELECT (SELECT d.stream FROM outbox.delivery d
                    WHERE d.claimable_at IS NOT NULL AND d.stream < r.stream
                    ORDER BY d.stream DESC, d.state DESC, d.claimable_at DESC LIMIT 1)
            FROM r WHERE r.stream IS NOT NULL
        )
        SELECT r.stream FROM r
    ) r
    WHERE p_streams IS NULL AND r.stream IS NOT NULL AND r.stream <> ALL (coalesce(p_exclude, '{}'))
$$;

--
-- Name: cluster_system_identifier(); Type: FUNCTION; Schema: outbox; Owner: -
--

CREATE FUNCTION outbox.cluster_system_identifier() RETURNS bigint
    LANGUAGE sql STABLE SECURITY DEFINER
    SET search_path TO 'pg_catalog', 'pg_temp'
    AS $$
    SELECT system_identifier FROM pg_control_system()
$$;

--
-- Name: continue_attempts(); Type: FUNCTION; Schema: outbox; Owner: -
--

CREATE FUNCTION outbox.continue_attempts() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
DECLARE
    v_revision bigint;
    v_earlier integer;
BEGIN
    SELECT e.revision INTO v_revision FROM outbox.event e WHERE e.event_id = NEW.leased_event_id;
    IF v_revision IS NULL OR v_revision > NEW.republished_through THEN
        NEW.republished_through := NULL;
        RETURN NEW;
    END IF;
    v_earlier := outbox.republished_attempts(NEW.stream, NEW.aggregate_key, NEW.leased_event_id);
    NEW.attempt := NEW.attempt + coalesce(v_earlier, 0);
    RETURN NEW;
END
$$;

--
-- Name: discover(); Type: FUNCTION; Schema: outbox; Owner: -
--

CREATE FUNCTION outbox.discover() RETURNS TABLE(events bigint, aggregates bigint)
    LANGUAGE plpgsql
    AS $$
#variable_conflict use_column
DECLARE
    v_prev text;
    v_snapshot text;
    v_events bigint;
BEGIN
    SELECT s.prev_snapshot, s.snapshot, s.events INTO v_prev, v_snapshot, v_events
    FROM outbox.discover_scan() s LIMIT 1;
    IF NOT FOUND THEN
        RETURN QUERY SELECT 0::bigint, 0::bigint;
        RETURN;
    END IF;
    RETURN QUERY SELECT v_events, a.woken FROM outbox.discover_apply(v_prev, v_snapshot) a WHERE a.woken IS NOT NULL;
END
$$;

--
-- Name: discover_apply(text, text, text[], text[], uuid[], text[], interval[], text); Type: FUNCTION; Schema: outbox; Owner: -
--

CREATE FUNCTION outbox.discover_apply(p_prev text, p_snapshot text, p_streams text[] DEFAULT NULL::text[], p_keys text[] DEFAULT NULL::text[], p_holders uuid[] DEFAULT NULL::uuid[], p_relay_ids text[] DEFAULT NULL::text[], p_ttls interval[] DEFAULT NULL::interval[], p_replica_id text DEFAULT NULL::text) RETURNS TABLE(woken bigint, holder uuid, lease outbox.lease)
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET jit TO 'off'
    SET plan_cache_mode TO 'force_generic_plan'
    AS $$
#variable_conflict use_column
DECLARE
    v_now timestamptz := clock_timestamp();
    v_snapshot pg_snapshot := p_snapshot::pg_snapshot;
    v_prev pg_snapshot;
    v_ids uuid[];
    v_streams text[];
    v_keys text[];
    v_revs bigint[];
    v_created timestamptz[];
    v_woken bigint;
    v_holders uuid[];
    v_leases outbox.lease[];
    v_set text;
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        PERFORM outbox.require_read_committed('outbox.discover_apply');
    END IF;
    -- The advisory lock is re-entrant: this succeeds when discover_scan took
    -- it in this transaction, and the stored snapshot is then still the one
    -- it read (no other round can have run since).
    IF NOT pg_try_advisory_xact_lock(7954802400917419382) THEN
        RAISE EXCEPTION 'outbox: discover_apply must follow discover_scan in the same transaction'
            USING ERRCODE = 'invalid_transaction_state';
    END IF;
    SELECT d.snapshot INTO v_prev FROM outbox.discovery d;
    IF v_prev::text IS DISTINCT FROM p_prev THEN
        RAISE EXCEPTION 'outbox: discovery moved from % to % since this round''s scan', p_prev, v_prev
            USING ERRCODE = 'invalid_transaction_state',
                  HINT = 'Call discover_scan and discover_apply in one transaction.';
    END IF;
    -- What a round writes can be written again: if PostgreSQL crashes
    -- before this commit reaches disk, the next round finds the same events
    -- and writes the same rows. A lease given by a round that is lost that
    -- way is soft state (see lease_heads): its event is offered again. So
    -- the commit does not wait for the WAL flush (any later synchronous
    -- commit, such as a producer's, flushes it).
    v_set := set_config('synchronous_commit', 'off', true);

    -- 1. The pending events found: exactly those visible in the scan's
    --    snapshot and not in the stored one. (Into arrays, which the
    --    statements below join by key: their estimates keep those plans
    --    to index probes per key, where a join with events_since, which
    --    the planner may take to match a third of the table, could read
    --    a whole index.)
    SELECT array_agg(f.event_id), array_agg(f.stream), array_agg(f.aggregate_key),
           array_agg(f.revision), array_agg(f.created_at)
    INTO v_ids, v_streams, v_keys, v_revs, v_created
    FROM outbox.events_since(v_prev) f
    -- (xid below the snapshot's xmax is implied; said, it bounds the index
    -- scan to a round that took a backlog in parts.)
    WHERE f.xid < pg_snapshot_xmax(v_snapshot) AND pg_visible_in_snapshot(f.xid, v_snapshot) AND f.published_at IS NULL;

    IF v_ids IS NOT NULL THEN
        -- 2. Lock every found aggregate's row, in key order (as acks and
        --    releases lock them), whatever its state: a row an ack or claim
        --    holds is waited for, then seen below as they left it.
        PERFORM outbox.lock_deliveries(v_streams, v_keys);
        -- The clock again, now that the rows are ours: the locks may have
        -- waited (for an ack, a claim, a re-scan), and a lease dispatched from
        -- the clock before the wait would be shorter than its TTL.
        v_now := clock_timestamp();

        -- 3. Decide, in a statement whose snapshot is newer than the locks:
        --    lease the next event of an idle or new aggregate named for a
        --    session, wake every other idle or gap-held one, leave the rest
        --    (they have work in hand) alone. An event an ack published since
        --    step 1 (committing while this round waited for its row) is left
        --    out: that ack decided what follows it.
        WITH found AS (
            SELECT f.event_id, f.stream, f.aggregate_key, f.revision, f.created_at
            FROM unnest(v_ids, v_streams, v_keys, v_revs, v_created)
                 AS f(event_id, stream, aggregate_key, revision, created_at)
            -- A probe by id, not a join (which could pass over the table).
            WHERE (SELECT e.published_at IS NULL FROM outbox.event e WHERE e.event_id = f.event_id)
        ), agg AS (
            SELECT f.stream, f.aggregate_key, min(f.revision) AS first_revision,
                   min(f.created_at) AS first_created_at
            FROM found f
            GROUP BY f.stream, f.aggregate_key
        ), cand AS (
            -- A new aggregate's cursor sits just below its lowest pending
            -- revision as this statement sees it, not below the lowest one
            -- found: a round that took a backlog in parts (discover_scan's
            -- p_max_events) cut its snapshot at an xid, and transaction ids
            -- follow first writes, not commits. A transaction that took its
            -- id early and then waited for the aggregate's counter behind a
            -- later-id one commits revision 6 after that one committed 5, so
            -- the cut can show 6 without 5. This statement's snapshot is
            -- newer than the scan's, which saw 6 committed, so it sees 5.
            -- (An existing aggregate's cursor is its row's; its claim order
            -- and pending_since come from that lowest pending revision too.)
            SELECT a.stream, a.aggregate_key, a.first_revision,
                   least(lo.created_at, a.first_created_at) AS first_created_at,
                   d.state, coalesce(d.delivered_revision, lo.revision - 1, a.first_revision - 1) AS cursor,
                   d.ctid AS row_tid, t.holder, t.relay_id, t.ttl
            FROM agg a
            -- A probe by key per aggregate (LIMIT keeps the planner from
            -- making it a join; see discover_scan's last statement).
            LEFT JOIN LATERAL (
                SELECT d.stream, d.state, d.delivered_revision, d.ctid
                FROM outbox.delivery d
                WHERE d.stream = a.stream AND d.aggregate_key = a.aggregate_key
                LIMIT 1
            ) d ON true
            LEFT JOIN LATERAL (
                SELECT e.revision, e.created_at
                FROM outbox.event e
                -- (Only where a lower revision can exist, and only for a
                -- row this round writes: the lookup cost a round of a
                -- million new aggregates a third more.)
                WHERE coalesce(d.state IN ('idle', 'gap'), true)
                  AND a.first_revision > coalesce(d.delivered_revision, 0) + 1
                  AND e.stream = a.stream AND e.aggregate_key = a.aggregate_key
                  AND e.revision > coalesce(d.delivered_revision, 0)
                  AND e.published_at IS NULL
                ORDER BY e.revision
                LIMIT 1
            ) lo ON true
            LEFT JOIN unnest(p_streams, p_keys, p_holders, p_relay_ids, p_ttls)
                 AS t(stream, aggregate_key, holder, relay_id, ttl)
                 ON t.stream = a.stream AND t.aggregate_key = a.aggregate_key
        ), plan AS (
            -- The head to dispatch, read whole: the lease returned is made
            -- from it.
            SELECT c.*, h.event_id AS head_id, h.created_at AS head_created_at, h.event_type AS head_type,
                   h.payload AS head_payload, h.headers AS head_headers
            FROM cand c
            LEFT JOIN LATERAL (
                SELECT e.event_id, e.created_at, e.event_type, e.payload::text AS payload, e.headers
                FROM outbox.event e
                WHERE c.holder IS NOT NULL AND coalesce(c.state = 'idle', true)
                  AND e.stream = c.stream AND e.aggregate_key = c.aggregate_key
                  AND e.revision = c.cursor + 1
                  AND (SELECT true FROM outbox.skipped_event s WHERE s.event_id = e.event_id) IS NULL
                -- (LIMIT keeps it a probe of the one revision: joined
                -- instead, the revision's test could end up a filter over
                -- all of the aggregate's events.)
                LIMIT 1
            ) h ON true
        ), created AS (
            INSERT INTO outbox.delivery AS d
                (stream, aggregate_key, state, delivered_revision, claimable_at, pending_since,
                 epoch, holder, holder_relay_id, holder_replica_id, leased_event_id, leased_through,
                 lease_expires_at, attempt)
            SELECT p.stream, p.aggregate_key,
                   CASE WHEN p.head_id IS NOT NULL THEN 'leased' ELSE 'ready' END,
                   p.cursor,
                   CASE WHEN p.head_id IS NOT NULL THEN v_now + p.ttl ELSE p.first_created_at END,
                   p.first_created_at,
                   CASE WHEN p.head_id IS NOT NULL THEN (extract(epoch FROM v_now) * 1000000)::bigint ELSE 0 END,
                   CASE WHEN p.head_id IS NOT NULL THEN p.holder END,
                   CASE WHEN p.head_id IS NOT NULL THEN p.relay_id END,
                   CASE WHEN p.head_id IS NOT NULL THEN p_replica_id END,
                   p.head_id,
                   CASE WHEN p.head_id IS NOT NULL THEN p.cursor + 1 END,
                   CASE WHEN p.head_id IS NOT NULL THEN v_now + p.ttl END,
                   CASE WHEN p.head_id IS NOT NULL THEN 1 ELSE 0 END
            FROM plan p WHERE p.state IS NULL
            ORDER BY p.stream, p.aggregate_key
            -- Only discovery creates delivery rows, and rounds take turns.
            ON CONFLICT (stream, aggregate_key) DO NOTHING
            RETURNING d.stream, d.aggregate_key, d.state, d.holder, d.leased_event_id, d.epoch, d.attempt,
                      d.lease_expires_at, d.republished_through
        ), updated AS (
            UPDATE outbox.delivery d
            SET state = CASE WHEN p.head_id IS NOT NULL THEN 'leased' ELSE 'ready' END,
                claimable_at = CASE WHEN p.head_id IS NOT NULL THEN v_now + p.ttl ELSE p.first_created_at END,
                pending_since = CASE WHEN p.head_id IS NOT NULL THEN p.head_created_at
                                     ELSE least(d.pending_since, p.first_created_at) END,
                epoch = CASE WHEN p.head_id IS NOT NULL
                             THEN greatest(d.epoch + 1, (extract(epoch FROM v_now) * 1000000)::bigint)
                             ELSE d.epoch END,
                holder = CASE WHEN p.head_id IS NOT NULL THEN p.holder END,
                holder_relay_id = CASE WHEN p.head_id IS NOT NULL THEN p.relay_id END,
                holder_replica_id = CASE WHEN p.head_id IS NOT NULL THEN p_replica_id END,
                leased_event_id = CASE WHEN p.head_id IS NOT NULL THEN p.head_id ELSE d.leased_event_id END,
                leased_through = CASE WHEN p.head_id IS NOT NULL THEN p.cursor + 1 ELSE d.leased_through END,
                lease_expires_at = CASE WHEN p.head_id IS NOT NULL THEN v_now + p.ttl END,
                attempt = CASE WHEN p.head_id IS NOT NULL THEN 1 ELSE d.attempt END,
                failures = CASE WHEN p.head_id IS NOT NULL THEN 0 ELSE d.failures END,
                unanswered = CASE WHEN p.head_id IS NOT NULL THEN 0 ELSE d.unanswered END,
                next_attempt_at = NULL, gap_revision = NULL
            FROM plan p
            -- The row cand read (locked in step 2, so not moved since),
            -- found by its tuple id rather than a second probe of the key.
            WHERE d.ctid = p.row_tid AND p.state IN ('idle', 'gap')
            RETURNING d.stream, d.aggregate_key, d.state, d.holder, d.leased_event_id, d.epoch, d.attempt,
                      d.lease_expires_at, d.republished_through
        ), written AS (
            SELECT * FROM created UNION ALL SELECT * FROM updated
        ), late AS (
            -- Against the cursor as this statement sees it, after the
            -- locks (cand read the same rows in the same snapshot).
            -- Delivery can have moved past one of these events since step
            -- 1 only by publishing it (an ack that committed while this
            -- round waited for the row): that event was delivered, not
            -- late, and found holds only events still pending now. The
            -- cursor is read from the row by its key, not by joining cand:
            -- the planner, which takes both for a row or so, joined the two
            -- by a nested loop over them, quadratic in the round's events
            -- (16 million comparisons, 1.6 s, for 4,000 events of
            -- aggregates delivered before; 100,000 such events, as after an
            -- outage, kept discovery in one round for many minutes). And
            -- a probe by key, never a join: see discover_scan's last
            -- statement.
            INSERT INTO outbox.late_event (event_id)
            SELECT f.event_id
            FROM found f
            WHERE f.revision <= (SELECT d.delivered_revision FROM outbox.delivery d
                                 WHERE d.stream = f.stream AND d.aggregate_key = f.aggregate_key)
            ON CONFLICT (event_id) DO NOTHING
        )
        SELECT count(*) FILTER (WHERE w.state = 'ready'),
               array_agg(w.holder) FILTER (WHERE w.state = 'leased'),
               array_agg(ROW(p.head_id, p.stream, p.aggregate_key, p.cursor + 1, p.head_type, p.head_payload,
                             p.head_headers, p.head_created_at, w.epoch, w.attempt, w.lease_expires_at,
                             CASE WHEN w.republished_through IS NOT NULL
                                  THEN outbox.republish_action(p.stream, p.aggregate_key, p.cursor + 1,
                                                               w.republished_through) ELSE 0 END)::outbox.lease)
                   FILTER (WHERE w.state = 'leased')
        INTO v_woken, v_holders, v_leases
        FROM written w
        LEFT JOIN plan p ON p.stream = w.stream AND p.aggregate_key = w.aggregate_key AND w.state = 'leased';
    END IF;

    UPDATE outbox.discovery d SET snapshot = v_snapshot, advanced_at = now();
    IF coalesce(v_woken, 0) > 0 THEN
        -- Idle sessions on every replica claim at once. One NOTIFY per round
        -- that made something ready, never one per producer transaction.
        PERFORM pg_notify('outbox_wakeup', '');
    END IF;
    RETURN QUERY SELECT coalesce(v_woken, 0), NULL::uuid, NULL::outbox.lease;
    RETURN QUERY SELECT NULL::bigint, v_holders[i], v_leases[i] FROM generate_subscripts(v_holders, 1) AS i;
END
$$;

--
-- Name: discover_round(integer, integer, uuid[], text[], interval[], integer[], jsonb, text); Type: FUNCTION; Schema: outbox; Owner: -
--

CREATE FUNCTION outbox.discover_round(p_max_aggregates integer DEFAULT NULL::integer, p_max_events integer DEFAULT NULL::integer, p_holders uuid[] DEFAULT NULL::uuid[], p_relay_ids text[] DEFAULT NULL::text[], p_ttls interval[] DEFAULT NULL::interval[], p_credits integer[] DEFAULT NULL::integer[], p_filters jsonb DEFAULT NULL::jsonb, p_replica_id text DEFAULT NULL::text) RETURNS TABLE(events bigint, woken bigint, last_holder uuid, stream text, aggregate_key text, holder uuid, lease outbox.lease)
    LANGUAGE plpgsql
    SET jit TO 'off'
    SET plan_cache_mode TO 'force_generic_plan'
    AS $$
#variable_conflict use_column
DECLARE
    v_sessions integer := coalesce(cardinality(p_holders), 0);
    v_credits integer[] := p_credits;
    -- Credit left over all sessions: once none is, the rest is woken.
    v_left bigint;
    -- The session (0-based) whose turn comes first for the next aggregate.
    v_turn integer := 0;
    -- The session (1-based) given the last idle aggregate.
    v_last integer;
    v_prev text;
    v_snapshot text;
    v_events bigint;
    v_found_streams text[] := '{}';
    v_found_keys text[] := '{}';
    v_streams text[] := '{}';
    v_keys text[] := '{}';
    v_holders uuid[] := '{}';
    v_relays text[] := '{}';
    v_ttls interval[] := '{}';
    v_found_idle boolean[] := '{}';
    -- Each stream found, with the sessions that take it (see below).
    v_takers jsonb;
    v_list jsonb;
    v_n integer;
    v_start integer;
    v_found record;
    v_session integer;
BEGIN
    IF coalesce(cardinality(p_relay_ids), 0) <> v_sessions OR coalesce(cardinality(p_ttls), 0) <> v_sessions
       OR coalesce(cardinality(p_credits), 0) <> v_sessions
       OR (p_filters IS NOT NULL AND (jsonb_typeof(p_filters) <> 'array' OR jsonb_array_length(p_filters) <> v_sessions)) THEN
        RAISE EXCEPTION 'outbox: discover_round: the offer''s arrays differ in length (holders %, relay ids %, ttls %, credits %, filters %)',
            v_sessions, coalesce(cardinality(p_relay_ids), 0), coalesce(cardinality(p_ttls), 0),
            coalesce(cardinality(p_credits), 0), coalesce(jsonb_array_length(CASE jsonb_typeof(p_filters) WHEN 'array' THEN p_filters END), 0)
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'Pass one element per session in each, and p_filters as a JSON array or NULL.';
    END IF;
    IF array_position(p_holders, NULL) IS NOT NULL OR array_position(p_credits, NULL) IS NOT NULL
       OR EXISTS (SELECT FROM unnest(p_ttls) t WHERE t IS NULL OR t <= interval '0') THEN
        RAISE EXCEPTION 'outbox: discover_round: a session offered has no holder, no credit or no positive lease TTL'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF EXISTS (SELECT FROM jsonb_array_elements(CASE jsonb_typeof(p_filters) WHEN 'array' THEN p_filters END) f
               WHERE jsonb_typeof(f) <> 'object'
                  OR coalesce(jsonb_typeof(f -> 'streams'), 'null') NOT IN ('array', 'null')
                  OR coalesce(jsonb_typeof(f -> 'exclude'), 'null') NOT IN ('array', 'null')) THEN
        RAISE EXCEPTION 'outbox: discover_round: a session''s filter is not {"streams": [...], "exclude": [...]}'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    v_left := (SELECT coalesce(sum(greatest(c, 0)), 0) FROM unnest(p_credits) c);

    FOR v_found IN SELECT * FROM outbox.discover_scan(p_max_aggregates, p_max_events) LOOP
        v_prev := v_found.prev_snapshot;
        v_snapshot := v_found.snapshot;
        v_events := v_found.events;
        CONTINUE WHEN v_found.stream IS NULL;
        v_found_streams := v_found_streams || v_found.stream;
        v_found_keys := v_found_keys || v_found.aggregate_key;
        v_found_idle := v_found_idle || v_found.idle;
    END LOOP;
    IF v_prev IS NULL THEN
        RETURN; -- nothing found, or another replica's turn
    END IF;

    IF v_left > 0 THEN
        -- Which sessions take each stream found (1-based, ascending), worked
        -- out once per stream rather than for each aggregate and session in
        -- turn: a round over 10,000 aggregates with 50 sessions, 49 of them
        -- on other streams, spent more time checking filters than applying.
        SELECT jsonb_object_agg(t.stream, t.sessions) INTO v_takers
        FROM (SELECT s.stream, jsonb_agg(i ORDER BY i) AS sessions
              FROM (SELECT DISTINCT f.stream FROM unnest(v_found_streams, v_found_idle) AS f(stream, idle)
                    WHERE f.idle) s
              CROSS JOIN generate_subscripts(p_holders, 1) AS i
              WHERE p_credits[i] > 0
                AND CASE WHEN jsonb_typeof(p_filters -> (i - 1) -> 'streams') = 'array'
                              AND p_filters -> (i - 1) -> 'streams' <> '[]'
                         THEN p_filters -> (i - 1) -> 'streams' ? s.stream ELSE true END
                AND CASE WHEN jsonb_typeof(p_filters -> (i - 1) -> 'exclude') = 'array'
                         THEN NOT p_filters -> (i - 1) -> 'exclude' ? s.stream ELSE true END
              GROUP BY s.stream) t;
        FOR v_k IN 1 .. cardinality(v_found_streams) LOOP
            EXIT WHEN v_left = 0;
            CONTINUE WHEN NOT v_found_idle[v_k];
            v_list := v_takers -> v_found_streams[v_k];
            CONTINUE WHEN v_list IS NULL;
            v_n := jsonb_array_length(v_list);
            -- The first taker whose turn it is (at or after v_turn), then
            -- round the list.
            v_start := 0;
            WHILE v_start < v_n AND (v_list ->> v_start)::integer <= v_turn LOOP
                v_start := v_start + 1;
            END LOOP;
            FOR j IN 0 .. v_n - 1 LOOP
                v_session := (v_list ->> ((v_start + j) % v_n))::integer;
                CONTINUE WHEN v_credits[v_session] < 1;
                v_credits[v_session] := v_credits[v_session] - 1;
                v_left := v_left - 1;
                v_streams := v_streams || v_found_streams[v_k];
                v_keys := v_keys || v_found_keys[v_k];
                v_holders := v_holders || p_holders[v_session];
                v_relays := v_relays || p_relay_ids[v_session];
                v_ttls := v_ttls || p_ttls[v_session];
                v_turn := v_session % v_sessions;
                v_last := v_session;
                EXIT;
            END LOOP;
        END LOOP;
    END IF;

    RETURN QUERY
    SELECT CASE WHEN a.woken IS NOT NULL THEN v_events END, a.woken,
           CASE WHEN a.woken IS NOT NULL THEN p_holders[v_last] END,
           NULL::text, NULL::text, a.holder, a.lease
    FROM outbox.discover_apply(v_prev, v_snapshot, v_streams, v_keys, v_holders, v_relays, v_ttls, p_replica_id) a;
    RETURN QUERY
    SELECT NULL::bigint, NULL::bigint, NULL::uuid, f.stream, f.aggregate_key, NULL::uuid, NULL::outbox.lease
    FROM unnest(v_found_streams, v_found_keys) WITH ORDINALITY AS f(stream, aggregate_key, n)
    ORDER BY f.n;
END
$$;

--
-- Name: discover_scan(integer, integer); Type: FUNCTION; Schema: outbox; Owner: -
--

CREATE FUNCTION outbox.discover_scan(p_max_aggregates integer DEFAULT NULL::integer, p_max_events integer DEFAULT NULL::integer) RETURNS TABLE(prev_snapshot text, snapshot text, events bigint, stream text, aggregate_key text, idle boolean, first_created_at timestamp with time zone)
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET jit TO 'off'
    SET plan_cache_mode TO 'force_generic_plan'
    AS $$
#variable_conflict use_column
DECLARE
    v_prev pg_snapshot;
    v_xmax xid8;
    v_system bigint;
    v_stopped text;
    v_last xid8;
    -- The round takes the events below this xid (all of them: the largest
    -- xid8).
    v_bound xid8 := '18446744073709551615';
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        PERFORM outbox.require_read_committed('outbox.discover_scan');
    END IF;
    IF p_max_events < 1 THEN
        RAISE EXCEPTION 'outbox: discover_scan(p_max_events => %): want at least 1, or NULL for no limit', p_max_events
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- A limit of 0 would hide the round's header row too, and a caller
    -- that reads "nothing found" from that would never advance.
    IF p_max_aggregates < 1 THEN
        RAISE EXCEPTION 'outbox: discover_scan(p_max_aggregates => %): want at least 1, or NULL for no limit', p_max_aggregates
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF NOT pg_try_advisory_xact_lock(7954802400917419382) THEN -- 'outboxd.discover'
        RETURN;
    END IF;
    -- Read after taking the lock (a fresh snapshot in READ COMMITTED), so it
    -- is the latest round's.
    SELECT d.snapshot, d.system_identifier, d.stopped_reason INTO v_prev, v_system, v_stopped
    FROM outbox.discovery d;
    v_xmax := pg_snapshot_xmax(v_prev);
    -- Transaction ids are only meaningful within one cluster and while its
    -- counter moves forward. A round must not run on ids that are not this
    -- cluster's: an event written with an id below the stored xmax would be
    -- missed for good. So stop loudly, and stay stopped (the reason is
    -- recorded by outbox.discovery_stopped(), which the server calls on
    -- this error) until an operator re-scans.
    IF v_stopped IS NULL AND v_xmax > pg_snapshot_xmax(pg_current_snapshot()) THEN
        v_stopped := outbox.discovery_stop_reason(v_prev, v_system);
    END IF;
    IF v_stopped IS NOT NULL THEN
        RAISE EXCEPTION 'outbox: discovery is stopped: %', v_stopped
            USING ERRCODE = 'data_corrupted',
                  HINT = 'Run `outboxd rescan` (SELECT * FROM outbox.rescan_discovery()) once; discovery resumes after it.';
    END IF;
    -- The new events are always a sliver of the table, read through the
    -- xid index (the function's SET clauses keep the planner from guessing
    -- otherwise: without fresh statistics it takes "xid >= x" to match a
    -- third of the table). Most rounds find nothing: index probes say so
    -- without planning the statement below.
    IF NOT EXISTS (SELECT 1 FROM outbox.events_since(v_prev)) THEN
        RETURN;
    END IF;
    -- A round that found something checks the cluster too before it
    -- writes (an empty round writes nothing, so it need not). Reading
    -- pg_control takes tens of microseconds, so the answer is kept for
    -- the connection's life (a backend never changes cluster), in a
    -- setting made by the first round that commits.
    IF coalesce(current_setting('outbox.system_identifier', true), '') = '' THEN
        PERFORM set_config('outbox.system_identifier', outbox.cluster_system_identifier()::text, false);
    END IF;
    IF current_setting('outbox.system_identifier')::bigint IS DISTINCT FROM v_system THEN
        RAISE EXCEPTION 'outbox: discovery is stopped: %', outbox.discovery_stop_reason(v_prev, v_system)
            USING ERRCODE = 'data_corrupted',
                  HINT = 'Run `outboxd rescan` (SELECT * FROM outbox.rescan_discovery()) once; discovery resumes after it.';
    END IF;
    -- A backlog larger than p_max_events: the first xid past its first
    -- p_max_events events (each statement reads the xid index that far
    -- and no further). An event of a transaction that commits between
    -- these statements and the next one's snapshot is below the bound or
    -- not: either way that snapshot, cut at the bound, says which.
    IF p_max_events IS NOT NULL THEN
        SELECT e.xid INTO v_last FROM outbox.event e
        WHERE e.xid >= v_xmax ORDER BY e.xid OFFSET p_max_events - 1 LIMIT 1;
        IF v_last IS NOT NULL THEN
            -- (min(xid8) is PostgreSQL 15's; the index gives the same.)
            SELECT e.xid INTO v_bound FROM outbox.event e WHERE e.xid > v_last ORDER BY e.xid LIMIT 1;
            v_bound := coalesce(v_bound, '18446744073709551615');
        END IF;
    END IF;
    -- One row per aggregate with a pending event found, oldest first, at
    -- most p_max_aggregates of them; one row with a NULL stream when every
    -- event found is already published (an ack that saw it committed got
    -- there first); none when nothing was found. pg_current_snapshot() is
    -- this statement's snapshot: the one the events are read in.
    RETURN QUERY
    WITH found AS (
        SELECT e.stream, e.aggregate_key, e.created_at, e.published_at FROM outbox.events_since(v_prev) e
        WHERE e.xid < v_bound
    ), agg AS (
        SELECT f.stream, f.aggregate_key, min(f.created_at) AS first_created_at
        FROM found f WHERE f.published_at IS NULL
        GROUP BY f.stream, f.aggregate_key
    ), now_snapshot AS (
        SELECT pg_current_snapshot() AS s
    ), header AS (
        SELECT v_prev::text AS prev_snapshot,
               CASE WHEN v_bound >= pg_snapshot_xmax(n.s) THEN n.s::text
                    -- N cut at the bound: its running transactions below it.
                    ELSE (SELECT least(pg_snapshot_xmin(n.s), v_bound)::text || ':' || v_bound::text || ':'
                                 || coalesce(string_agg(x::text, ',' ORDER BY x), '')
                          FROM pg_snapshot_xip(n.s) x WHERE x < v_bound)
               END AS snapshot,
               (SELECT count(*) FROM found) AS events
        FROM now_snapshot n
    )
    -- Each row's delivery state is a probe by key (a subquery, never a
    -- join): this plan is made once per connection, and one made while
    -- the delivery table was empty or its statistics said so joined the
    -- aggregates found to a materialized scan of the whole table, a
    -- comparison per pair (12 s for a round of 10,000 aggregates against
    -- 10,000 rows).
    SELECT h.prev_snapshot, h.snapshot, h.events, a.stream, a.aggregate_key,
           a.stream IS NOT NULL
           AND coalesce((SELECT d.state = 'idle' FROM outbox.delivery d
                         WHERE d.stream = a.stream AND d.aggregate_key = a.aggregate_key), true),
           a.first_created_at
    FROM header h
    LEFT JOIN agg a ON true
    WHERE h.events > 0
    ORDER BY a.first_created_at
    LIMIT p_max_aggregates;
END
$$;

--
-- Name: discovery_may_sleep(); Type: FUNCTION; Schema: outbox; Owner: -
--

CREATE FUNCTION outbox.discovery_may_sleep() RETURNS boolean
    LANGUAGE plpgsql
    SET plan_cache_mode TO 'force_generic_plan'
    AS $$
BEGIN
    RETURN (SELECT CASE
        WHEN s.producer_wakeups = 'off' THEN false
        WHEN s.producer_wakeups = 'auto' THEN current_setting('max_prepared_transactions')::integer = 0
        ELSE true
    END
    FROM outbox.settings s);
END
$$;

--
-- Name: discovery_sleep(); Type: FUNCTION; Schema: outbox; Owner: -
--

CREATE FUNCTION outbox.discovery_sleep() RETURNS boolean
    LANGUAGE plpgsql
    SET plan_cache_mode TO 'force_generic_plan'
    AS $$
BEGIN
    IF NOT outbox.discovery_may_sleep() THEN
        RETURN false;
    END IF;
    RETURN pg_try_advisory_lock(7954802400917419383);
END
$$;

--
-- Name: discovery_stop_reason(pg_snapshot, bigint); Type: FUNCTION; Schema: outbox; Owner: -
--

CREATE FUNCTION outbox.discovery_stop_reason(p_snapshot pg_snapshot, p_system bigint) RETURNS text
    LANGUAGE plpgsql STABLE
    AS $$
DECLARE
    v_system bigint := outbox.cluster_system_identifier();
    v_counter xid8 := pg_snapshot_xmax(pg_current_snapshot());
BEGIN
    IF p_system IS DISTINCT FROM v_system THEN
        RETURN format('the database moved to another PostgreSQL cluster (restored from a dump, copied, or upgraded '
                      'with pg_upgrade: discovery state from system identifier %s, this cluster is %s), so the '
                      'transaction ids events are found by may not be this cluster''s', p_system, v_system);
    END IF;
    IF pg_snapshot_xmax(p_snapshot) > v_counter THEN
        RETURN format('this cluster''s transaction counter (%s) is behind discovery''s stored snapshot (xmax %s): '
                      'it was set back (pg_resetwal) or the database was copied from another cluster',
                      v_counter, pg_snapshot_xmax(p_snapshot));
    END IF;
    RETURN NULL;
END
$$;

--
-- Name: discovery_stopped(); Type: FUNCTION; Schema: outbox; Owner: -
--

CREATE FUNCTION outbox.discovery_stopped() RETURNS text
    LANGUAGE plpgsql
    AS $$
DECLARE
    v_prev pg_snapshot;
    v_system bigint;
    v_stopped text;
BEGIN
    SELECT d.snapshot, d.system_identifier, d.stopped_reason INTO v_prev, v_system, v_stopped
    FROM outbox.discovery d;
    IF v_stopped IS NULL THEN
        -- After reading the row: the counter read here is never older
        -- than the snapshot stored there.
        v_stopped := outbox.discovery_stop_reason(v_prev, v_system);
        IF v_stopped IS NOT NULL AND pg_try_advisory_xact_lock(7954802400917419382) THEN
            -- Only the state the reason was computed from: a re-scan that
            -- committed since the read above stored a fresh snapshot of
            -- this cluster, which must not be stopped on the old one's
            -- account.
            UPDATE outbox.discovery d SET stopped_reason = v_stopped, stopped_at = now()
            WHERE d.stopped_reason IS NULL AND d.snapshot::text = v_prev::text
              AND d.system_identifier IS NOT DISTINCT FROM v_system
            RETURNING d.stopped_reason INTO v_stopped;
            IF NOT FOUND THEN
                SELECT d.stopped_reason INTO v_stopped FROM outbox.discovery d;
            END IF;
        END IF;
    END IF;
    IF v_stopped IS NULL THEN
        RETURN NULL;
    END IF;
    RETURN v_stopped || '; new events are not being found. Run `outboxd rescan` '
           '(SELECT * FROM outbox.rescan_discovery()) once to find every pending event and resume discovery';
END
$$;

--
-- Name: discovery_wake(); Type: FUNCTION; Schema: outbox; Owner: -
--

CREATE FUNCTION outbox.discovery_wake() RETURNS boolean
    LANGUAGE plpgsql
    SET plan_cache_mode TO 'force_generic_plan'
    AS $$
BEGIN
    RETURN pg_advisory_unlock(7954802400917419383);
END
$$;

--
-- Name: emit(text, text, text, jsonb, jsonb, bigint, uuid); Type: FUNCTION; Schema: outbox; Owner: -
--

CREATE FUNCTION outbox.emit(stream text, aggregate_key text, event_type text, payload jsonb, headers jsonb DEFAULT '{}'::jsonb, revision bigint DEFAULT NULL::bigint, event_id uuid DEFAULT NULL::uuid) RETURNS outbox.emitted
    LANGUAGE plpgsql
    AS $_$
DECLARE
    v_out outbox.emitted;
BEGIN
    -- A NULL id is generated by the insert trigger.
    INSERT INTO outbox.event AS e (event_id, stream, aggregate_key, revision, event_type, payload, headers)
    VALUES ($7, $1, $2, $6, $3, $4, coalesce($5, '{}'::jsonb))
    RETURNING e.event_id, e.revision INTO v_out.event_id, v_out.revision;
    IF NOT FOUND THEN
        -- The trigger inserted nothing: a retry of a recorded event (planned
        -- for this call, as in emit_event).
        EXECUTE 'SELECT e.event_id, e.revision FROM outbox.event e WHERE e.event_id = $1'
        INTO v_out.event_id, v_out.revision USING $7;
    END IF;
    RETURN v_out;
END
$_$;

--
-- Name: emit_event(text, text, text, jsonb, jsonb, bigint, uuid); Type: FUNCTION; Schema: outbox; Owner: -
--

CREATE FUNCTION outbox.emit_event(p_stream text, p_aggregate_key text, p_event_type text, p_payload jsonb, p_headers jsonb DEFAULT '{}'::jsonb, p_revision bigint DEFAULT NULL::bigint, p_event_id uuid DEFAULT NULL::uuid, OUT event_id uuid, OUT revision bigint) RETURNS record
    LANGUAGE plpgsql
    AS $_$
BEGIN
    -- A NULL id is generated by the insert trigger.
    INSERT INTO outbox.event AS e (event_id, stream, aggregate_key, revision, event_type, payload, headers)
    VALUES (p_event_id, p_stream, p_aggregate_key, p_revision,
            p_event_type, p_payload, coalesce(p_headers, '{}'::jsonb))
    RETURNING e.event_id, e.revision INTO emit_event.event_id, emit_event.revision;
    IF NOT FOUND THEN
        -- The trigger inserted nothing: a retry of a recorded event. Planned
        -- for this call (EXECUTE): a plan cached for the connection's life,
        -- made while the table was small, would scan all of it; a retry is
        -- rare, and the common path pays nothing for it.
        EXECUTE 'SELECT e.event_id, e.revision FROM outbox.event e WHERE e.event_id = $1'
        INTO emit_event.event_id, emit_event.revision USING p_event_id;
    END IF;
END
$_$;

--
-- Name: event_before_insert(); Type: FUNCTION; Schema: outbox; Owner: -
--

CREATE FUNCTION outbox.event_before_insert() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER
    SET search_path TO 'pg_catalog', 'pg_temp'
    SET enable_seqscan TO 'off'
    AS $_$
DECLARE
    -- No initial values: PL/pgSQL would evaluate them on every call, before
    -- the common case below returns.
    v_max_payload integer;
    v_payload_bytes integer;
    v_auto_revision boolean;
    v_counter_created boolean;
    v_counter_before bigint;
    v_delivered bigint;
    v_existing record;
    v_fresh_id boolean;
BEGIN
    -- The common case, in as few PL/pgSQL expressions as possible: each one
    -- costs its own set-up in every transaction (about a fifth of this
    -- function's time when every check below was one; BENCHMARKS.md). A
    -- fresh event with an automatic revision, empty headers and a payload of
    -- at most 1 KiB that passes every check below takes this path; anything
    -- else (a NULL makes the condition NULL, so false) takes the checks
    -- below, which say what is wrong. Keep the two in step. The stream is
    -- tested without the regular expression, which took about 3 % of the
    -- backend's time in a perf profile of this path: at most 128 bytes, a
    -- first character a-z, nothing left once a-z0-9_.- are trimmed off is
    -- what ^[a-z][a-z0-9_.-]{0,127}$ accepts.
    IF NEW.event_id IS NULL AND NEW.revision IS NULL
       AND octet_length(NEW.stream) <= 128 AND ascii(NEW.stream) BETWEEN 97 AND 122
       AND ltrim(NEW.stream, 'abcdefghijklmnopqrstuvwxyz0123456789_.-') = ''
       AND NEW.aggregate_key <> '' AND octet_length(NEW.aggregate_key) <= 1024
       AND NEW.event_type <> '' AND octet_length(NEW.event_type) <= 256
       AND NEW.headers = '{}' AND NEW.published_at IS NULL AND NEW.created_at = now()
       AND NEW.xid = pg_current_xact_id() AND octet_length(NEW.payload::text) <= 1024 THEN
        -- An UPDATE first, the upsert only for an aggregate without a
        -- counter yet: INSERT ... ON CONFLICT DO UPDATE locks the row it
        -- found before updating it, a WAL record of its own (about 50 of
        -- the 900 bytes of WAL an event costs). Both wait for a concurrent
        -- producer's lock the same way and fail alike (40001) at
        -- REPEATABLE READ or SERIALIZABLE when one committed meanwhile.
        -- The id comes with the revision: an assignment of its own would
        -- be one more PL/pgSQL expression to set up.
        UPDATE outbox.aggregate a SET last_revision = a.last_revision + 1
        WHERE a.stream = NEW.stream AND a.aggregate_key = NEW.aggregate_key
        RETURNING a.last_revision, gen_random_uuid() INTO NEW.revision, NEW.event_id;
        IF NOT FOUND THEN
            INSERT INTO outbox.aggregate AS a (stream, aggregate_key, last_revision)
            VALUES (NEW.stream, NEW.aggregate_key, 1)
            ON CONFLICT (stream, aggregate_key)
                DO UPDATE SET last_revision = a.last_revision + 1
            RETURNING a.last_revision, gen_random_uuid() INTO NEW.revision, NEW.event_id;
        END IF;
        -- A replica whose discovery sleeps holds this key (see
        -- outbox.discovery_sleep): wake it at commit. Otherwise the shared
        -- lock, held to commit, keeps a replica from falling asleep before
        -- this event is visible to the check it makes once asleep.
        IF NOT pg_try_advisory_xact_lock_shared(7954802400917419383) THEN
            PERFORM pg_notify('outbox_discover', '');
        END IF;
        RETURN NEW;
    END IF;

    v_auto_revision := NEW.revision IS NULL;
    v_counter_created := false;
    -- A producer's own id may repeat a recorded event (a retry); one
    -- generated here cannot.
    v_fresh_id := NEW.event_id IS NULL;
    IF v_fresh_id THEN
        NEW.event_id := gen_random_uuid();
    END IF;
    IF NEW.stream IS NULL OR NEW.stream !~ '^[a-z][a-z0-9_.-]{0,127}$' THEN
        RAISE EXCEPTION 'outbox: stream % is malformed', coalesce(quote_literal(NEW.stream), 'NULL')
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'A stream name matches ^[a-z][a-z0-9_.-]{0,127}$, for example sales_order.';
    END IF;
    IF NEW.aggregate_key IS NULL OR NEW.aggregate_key = '' THEN
        RAISE EXCEPTION 'outbox: aggregate_key must not be empty'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF octet_length(NEW.aggregate_key) > 1024 THEN
        RAISE EXCEPTION 'outbox: aggregate_key is % bytes, over the limit of 1024', octet_length(NEW.aggregate_key)
            USING ERRCODE = 'program_limit_exceeded';
    END IF;
    IF NEW.event_type IS NULL OR NEW.event_type = '' THEN
        RAISE EXCEPTION 'outbox: event_type must not be empty'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF octet_length(NEW.event_type) > 256 THEN
        RAISE EXCEPTION 'outbox: event_type is % bytes, over the limit of 256', octet_length(NEW.event_type)
            USING ERRCODE = 'program_limit_exceeded';
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
    IF NEW.headers <> '{}' THEN
        IF EXISTS (SELECT 1 FROM jsonb_each(NEW.headers) h WHERE jsonb_typeof(h.value) <> 'string') THEN
            RAISE EXCEPTION 'outbox: header values must be strings'
                USING ERRCODE = 'invalid_parameter_value',
                      HINT = 'Brokers carry headers as strings; encode other values as text.';
        END IF;
        IF octet_length(NEW.headers::text) > 65536 THEN
            RAISE EXCEPTION 'outbox: headers are % bytes of JSON, over the limit of 65536',
                    octet_length(NEW.headers::text)
                USING ERRCODE = 'program_limit_exceeded';
        END IF;
    END IF;
    IF NEW.revision IS NOT NULL AND (NEW.revision <= 0 OR NEW.revision > 9007199254740991) THEN
        RAISE EXCEPTION 'outbox: revision must be between 1 and 9007199254740991 (2^53-1), got %', NEW.revision
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    -- Delivery state is outboxd's: an event is born pending, at its
    -- transaction's start time.
    IF NEW.published_at IS NOT NULL THEN
        RAISE EXCEPTION 'outbox: published_at must not be set by a producer'
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'outboxd sets published_at when a relay acks the event; leave the column out.';
    END IF;
    IF NEW.created_at IS DISTINCT FROM now() THEN
        RAISE EXCEPTION 'outbox: created_at must not be set by a producer (got %)', NEW.created_at
            USING ERRCODE = 'invalid_parameter_value',
                  HINT = 'created_at is the producing transaction''s start time; leave the column out.';
    END IF;
    NEW.xid := pg_current_xact_id();
    v_payload_bytes := octet_length(NEW.payload::text);
    -- No limit is below 1 KiB (outbox.settings' CHECK): the settings row is
    -- read only for a payload above that.
    IF v_payload_bytes > 1024 THEN
        SELECT s.max_payload_bytes INTO v_max_payload FROM outbox.settings s;
    END IF;
    IF v_payload_bytes > v_max_payload THEN
        RAISE EXCEPTION 'outbox: payload is % bytes, over the limit of % bytes', v_payload_bytes, v_max_payload
            USING ERRCODE = 'program_limit_exceeded',
                  HINT = 'The limit is outbox.settings.max_payload_bytes.';
    END IF;

    -- The aggregate row is the producers' order lock, held to commit: producers
    -- of one aggregate serialise here, producers of others do not meet.
    IF v_auto_revision THEN
        INSERT INTO outbox.aggregate AS a (stream, aggregate_key, last_revision)
        VALUES (NEW.stream, NEW.aggregate_key, 1)
        ON CONFLICT (stream, aggregate_key)
            DO UPDATE SET last_revision = a.last_revision + 1
        RETURNING a.last_revision, (a.xmax = 0) INTO NEW.revision, v_counter_created;
        v_counter_before := NEW.revision - 1;
    ELSE
        INSERT INTO outbox.aggregate (stream, aggregate_key, last_revision)
        VALUES (NEW.stream, NEW.aggregate_key, NEW.revision)
        ON CONFLICT (stream, aggregate_key) DO NOTHING;
        v_counter_created := FOUND;
        IF NOT v_counter_created THEN
            SELECT a.last_revision INTO v_counter_before FROM outbox.aggregate a
            WHERE a.stream = NEW.stream AND a.aggregate_key = NEW.aggregate_key
            FOR UPDATE;
            IF NEW.revision > v_counter_before THEN
                UPDATE outbox.aggregate a SET last_revision = NEW.revision
                WHERE a.stream = NEW.stream AND a.aggregate_key = NEW.aggregate_key;
            ELSE
                -- A late revision below the counter. If delivery has already
                -- moved past it, it could never be delivered: refuse it while
                -- the producer can still act. (A stale read here, under
                -- REPEATABLE READ, only lets such an event in; discovery then
                -- reports it as stranded. Reading never blocks.)
                SELECT d.delivered_revision INTO v_delivered FROM outbox.delivery d
                WHERE d.stream = NEW.stream AND d.aggregate_key = NEW.aggregate_key;
                -- (A retry of a recorded event is answered below instead.)
                IF NEW.revision <= v_delivered
                   AND (v_fresh_id OR NOT EXISTS (SELECT 1 FROM outbox.event e WHERE e.event_id = NEW.event_id)) THEN
                    RAISE EXCEPTION 'outbox: revision % of %/% is at or below its delivery cursor %',
                            NEW.revision, NEW.stream, NEW.aggregate_key, v_delivered
                        USING ERRCODE = 'unique_violation',
                              DETAIL = 'Delivery already passed this revision (it precedes the aggregate''s first event, or an operator accepted a gap there), so the event could never be delivered.';
                END IF;
            END IF;
        END IF;
    END IF;

    -- As on the common path above. (A retry of a recorded event, answered
    -- below, may so wake a sleeping replica for nothing.)
    IF NOT pg_try_advisory_xact_lock_shared(7954802400917419383) THEN
        PERFORM pg_notify('outbox_discover', '');
    END IF;
    IF v_fresh_id THEN
        RETURN NEW;
    END IF;
    -- A retry of an event already recorded (same event_id). Checked after the
    -- order lock: a first attempt of the same aggregate still in flight has
    -- committed or rolled back by now, and this statement's snapshot sees it.
    -- The retry must consume no revision (a consumed one would hold delivery
    -- at a gap that never fills), so the counter goes back to where it was.
    SELECT e.stream, e.aggregate_key, e.revision, e.event_type, e.payload, e.headers
    INTO v_existing FROM outbox.event e WHERE e.event_id = NEW.event_id;
    IF FOUND THEN
        IF v_counter_created THEN
            DELETE FROM outbox.aggregate a WHERE a.stream = NEW.stream AND a.aggregate_key = NEW.aggregate_key;
        ELSIF v_counter_before < NEW.revision THEN
            UPDATE outbox.aggregate a SET last_revision = v_counter_before
            WHERE a.stream = NEW.stream AND a.aggregate_key = NEW.aggregate_key;
        END IF;
        IF v_existing.stream = NEW.stream AND v_existing.aggregate_key = NEW.aggregate_key
           AND v_existing.event_type = NEW.event_type AND v_existing.payload = NEW.payload
           AND v_existing.headers = NEW.headers
           AND (v_auto_revision OR v_existing.revision = NEW.revision) THEN
            -- The same event: recording it again is a no-op, with or
            -- without ON CONFLICT DO NOTHING.
            RETURN NULL;
        END IF;
        RAISE EXCEPTION 'outbox: event_id % is already recorded for a different event (%/% revision %)',
                NEW.event_id, v_existing.stream, v_existing.aggregate_key, v_existing.revision
            USING ERRCODE = 'unique_violation',
                  HINT = 'An event_id names one event; a retry must repeat the same stream, key, type, payload and headers.';
    END IF;
    RETURN NEW;
END
$_$;

--
-- Name: event_guard_published(); Type: FUNCTION; Schema: outbox; Owner: -
--

CREATE FUNCTION outbox.event_guard_published() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    IF NEW.published_at IS DISTINCT FROM OLD.published_at
       -- An operator's republish (outbox.v1.AdminService.Republish) makes
       -- published events pending again, to be delivered and acked anew.
       AND NOT (NEW.published_at IS NULL AND current_setting('outbox.republishing', true) IS NOT DISTINCT FROM 'on')
       AND (OLD.published_at IS NOT NULL OR current_setting('outbox.acking', true) IS DISTINCT FROM 'on') THEN
        RAISE EXCEPTION 'outbox: published_at of event % is set only by outboxd when a relay acks it', OLD.event_id
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  HINT = 'To abandon a pending event, skip it (outboxd skip) with a reason.';
    END IF;
    RETURN NEW;
END
$$;

--
-- Name: event_immutable(); Type: FUNCTION; Schema: outbox; Owner: -
--

CREATE FUNCTION outbox.event_immutable() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    -- outbox.rescan_discovery() re-stamps the xid of events copied from
    -- another cluster as frozen (2), and changes nothing else.
    IF current_setting('outbox.rescanning', true) IS NOT DISTINCT FROM 'on' AND NEW.xid = '2'::xid8
       AND (NEW.event_id, NEW.stream, NEW.aggregate_key, NEW.revision, NEW.event_type, NEW.payload,
            NEW.headers, NEW.created_at)
           IS NOT DISTINCT FROM (OLD.event_id, OLD.stream, OLD.aggregate_key, OLD.revision, OLD.event_type,
                                 OLD.payload, OLD.headers, OLD.created_at) THEN
        RETURN NEW;
    END IF;
    RAISE EXCEPTION 'outbox: event % is immutable; only published_at may change', OLD.event_id
        USING ERRCODE = 'object_not_in_prerequisite_state',
              HINT = 'Emit a new event instead of editing a committed one.';
END
$$;

--
-- Name: event_keep_pending(); Type: FUNCTION; Schema: outbox; Owner: -
--

CREATE FUNCTION outbox.event_keep_pending() RETURNS trigger
    LANGUAGE plpgsql
    AS $$
BEGIN
    IF OLD.published_at IS NULL THEN
        RAISE EXCEPTION 'outbox: event % is not published and cannot be deleted', OLD.event_id
            USING ERRCODE = 'object_not_in_prerequisite_state',
                  HINT = 'Pending events are never deleted; an operator may skip one with a reason.';
    END IF;
    RETURN OLD;
END
$$;

--
-- Name: event; Type: TABLE; Schema: outbox; Owner: -
--

CREATE TABLE outbox.event (
    event_id uuid NOT NULL,
    stream text NOT NULL,
    aggregate_key text NOT NULL,
    revision bigint NOT NULL,
    event_type text NOT NULL,
    payload jsonb NOT NULL,
    headers jsonb DEFAULT '{}'::jsonb NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    published_at timestamp with time zone,
    xid xid8 DEFAULT pg_current_xact_id() NOT NULL,
    CONSTRAINT event_revision_check CHECK (((revision > 0) AND (revision <= '9007199254740991'::bigint)))
)
WITH (fillfactor='50');

--
-- Name: events_since(pg_snapshot); Type: FUNCTION; Schema: outbox; Owner: -
--

CREATE FUNCTION outbox.events_since(p_since pg_snapshot) RETURNS SETOF outbox.event
    LANGUAGE sql STABLE
    AS $$
    SELECT * FROM outbox.event e WHERE e.xid >= pg_snapshot_xmax(p_since)
    UNION ALL
    SELECT * FROM outbox.event e WHERE e.xid = ANY (ARRAY(SELECT pg_snapshot_xip(p_since)))
$$;

--
-- Name: extend_lease(uuid, bigint, interval); Type: FUNCTION; Schema: outbox; Owner: -
--

CREATE FUNCTION outbox.extend_lease(p_event_id uuid, p_epoch bigint, p_ttl interval) RETURNS TABLE(lease_expires_at timestamp with time zone)
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET jit TO 'off'
    SET plan_cache_mode TO 'force_generic_plan'
    AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    UPDATE outbox.delivery d
    SET lease_expires_at = clock_timestamp() + p_ttl, claimable_at = clock_timestamp() + p_ttl
    FROM outbox.event e
    WHERE e.event_id = p_event_id AND d.stream = e.stream AND d.aggregate_key = e.aggregate_key
      AND e.revision > d.delivered_revision AND e.revision <= d.leased_through
      AND d.epoch = p_epoch AND d.state = 'leased'
    RETURNING d.lease_expires_at;
END
$$;

--
-- Name: lease_heads(text[], text[], uuid, text, text, interval, timestamp with time zone, integer, integer, integer); Type: FUNCTION; Schema: outbox; Owner: -
--

CREATE FUNCTION outbox.lease_heads(p_streams text[], p_keys text[], p_holder uuid, p_relay_id text, p_replica_id text, p_ttl interval, p_now timestamp with time zone, p_max_attempts integer, p_window integer DEFAULT 1, p_credit integer DEFAULT NULL::integer) RETURNS SETOF outbox.lease
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET jit TO 'off'
    SET plan_cache_mode TO 'force_generic_plan'
    AS $$
#variable_conflict use_column
DECLARE
    v_set text;
BEGIN
    v_set := set_config('synchronous_commit', 'off', true);
    -- Attempt history: earlier leases of these events that expired.
    PERFORM outbox.record_expired(p_streams, p_keys, p_now, p_max_attempts);
    RETURN QUERY
    -- Every table row is reached by a probe of its key or id (LATERAL with
    -- LIMIT, which the planner cannot turn into a join) or, for the rows
    -- the caller locked, by the tuple id read here: a join, planned while
    -- a table was small, would pass over all of it.
    WITH heads AS (
        SELECT d.stream, d.aggregate_key, d.row_tid, e.event_id, e.revision, l.ord, u.unanswered,
               coalesce(u.unanswered >= p_max_attempts, false) AS exhausted
        FROM unnest(p_streams, p_keys) WITH ORDINALITY AS l(stream, aggregate_key, ord)
        CROSS JOIN LATERAL (
            SELECT d.stream, d.aggregate_key, d.delivered_revision, d.leased_event_id, d.state, d.unanswered,
                   d.ctid AS row_tid
            FROM outbox.delivery d
            WHERE d.stream = l.stream AND d.aggregate_key = l.aggregate_key
            LIMIT 1
        ) d
        CROSS JOIN LATERAL (
            SELECT e.event_id, e.revision FROM outbox.event e
            WHERE e.stream = d.stream AND e.aggregate_key = d.aggregate_key
              AND e.revision = d.delivered_revision + 1
            LIMIT 1
        ) e
        -- The previous lease of this same event ended unanswered when it is
        -- still marked leased (expired) or was released (ready); a nack
        -- leaves it backing off.
        CROSS JOIN LATERAL (
            SELECT CASE WHEN d.leased_event_id IS DISTINCT FROM e.event_id THEN 0
                        WHEN d.state IN ('leased', 'ready') THEN d.unanswered + 1
                        ELSE d.unanswered END AS unanswered
        ) u
        WHERE (SELECT true FROM outbox.skipped_event s WHERE s.event_id = e.event_id) IS NULL
    ), extra AS (
        -- The rest of each window: revisions after the head, contiguous
        -- and not skipped, ranked by their place in the window and then by
        -- claim order, and cut at the credit the heads leave.
        SELECT r.stream, r.aggregate_key, r.event_id, r.revision
        FROM (
            SELECT c.*, row_number() OVER (ORDER BY c.revision - c.head_revision, c.ord) AS n
            FROM (
                SELECT h.stream, h.aggregate_key, h.ord, h.revision AS head_revision, e.event_id, e.revision,
                       row_number() OVER (PARTITION BY h.stream, h.aggregate_key ORDER BY e.revision) AS rn
                FROM heads h
                CROSS JOIN LATERAL (
                    SELECT e.event_id, e.revision FROM outbox.event e
                    WHERE e.stream = h.stream AND e.aggregate_key = h.aggregate_key
                      AND e.revision > h.revision AND e.revision < h.revision + p_window
                      AND (SELECT true FROM outbox.skipped_event s WHERE s.event_id = e.event_id) IS NULL
                    LIMIT p_window
                ) e
                WHERE p_window > 1 AND NOT h.exhausted
            ) c
            WHERE c.revision = c.head_revision + c.rn
        ) r
        -- (One unit is kept for every named aggregate, leased or not, so
        -- that a caller leasing the rest later stays within the credit.)
        WHERE p_credit IS NULL OR r.n <= p_credit - cardinality(p_streams)
    ), widths AS (
        SELECT x.stream, x.aggregate_key, count(*) AS n FROM extra x GROUP BY x.stream, x.aggregate_key
    ), changed AS (
        UPDATE outbox.delivery d
        SET state = CASE WHEN h.exhausted THEN 'parked' ELSE 'leased' END,
            epoch = CASE WHEN h.exhausted THEN d.epoch
                         ELSE greatest(d.epoch + 1, (extract(epoch FROM p_now) * 1000000)::bigint) END,
            holder = CASE WHEN h.exhausted THEN NULL ELSE p_holder END,
            holder_relay_id = CASE WHEN h.exhausted THEN NULL ELSE p_relay_id END,
            holder_replica_id = CASE WHEN h.exhausted THEN NULL ELSE p_replica_id END,
            attempt = CASE WHEN h.exhausted THEN d.attempt
                           WHEN d.leased_event_id = h.event_id THEN d.attempt + 1 ELSE 1 END,
            failures = CASE WHEN d.leased_event_id = h.event_id THEN d.failures ELSE 0 END,
            unanswered = h.unanswered,
            leased_event_id = h.event_id,
            leased_through = h.revision + coalesce(w.n, 0),
            lease_expires_at = CASE WHEN h.exhausted THEN NULL ELSE p_now + p_ttl END,
            claimable_at = CASE WHEN h.exhausted THEN NULL ELSE p_now + p_ttl END,
            parked_at = CASE WHEN h.exhausted THEN p_now END,
            parked_revision = CASE WHEN h.exhausted THEN h.revision END,
            parked_reason = CASE WHEN h.exhausted THEN format(
                'delivered %s times without an ack or a nack: each lease expired or the stream holding it ended',
                h.unanswered) END,
            next_attempt_at = NULL, gap_revision = NULL
        FROM heads h
        LEFT JOIN widths w ON w.stream = h.stream AND w.aggregate_key = h.aggregate_key
        WHERE d.ctid = h.row_tid
        RETURNING d.stream, d.aggregate_key, d.state, d.epoch, d.attempt, d.lease_expires_at, d.republished_through
    )
    SELECT e.event_id, e.stream, e.aggregate_key, e.revision, e.event_type, e.payload::text,
           e.headers, e.created_at, c.epoch, c.attempt, c.lease_expires_at,
           CASE WHEN c.republished_through IS NOT NULL
                THEN outbox.republish_action(e.stream, e.aggregate_key, e.revision, c.republished_through) ELSE 0 END
    FROM changed c
    JOIN (SELECT h.stream, h.aggregate_key, h.event_id FROM heads h
          UNION ALL SELECT x.stream, x.aggregate_key, x.event_id FROM extra x) l
      ON l.stream = c.stream AND l.aggregate_key = c.aggregate_key
    CROSS JOIN LATERAL (SELECT e.* FROM outbox.event e WHERE e.event_id = l.event_id LIMIT 1) e
    WHERE c.state = 'leased'
    ORDER BY e.stream, e.aggregate_key, e.revision;
END
$$;

--
-- Name: lease_window(text, text, bigint, bigint); Type: FUNCTION; Schema: outbox; Owner: -
--

CREATE FUNCTION outbox.lease_window(p_stream text, p_aggregate_key text, p_cursor bigint, p_through bigint) RETURNS uuid[]
    LANGUAGE plpgsql STABLE
    SET enable_seqscan TO 'off'
    SET jit TO 'off'
    SET plan_cache_mode TO 'force_generic_plan'
    AS $$
BEGIN
    RETURN ARRAY(
        SELECT e.event_id
        FROM outbox.event e
        WHERE e.stream = p_stream AND e.aggregate_key = p_aggregate_key
          AND e.revision > p_cursor AND e.revision <= p_through
        ORDER BY e.revision);
END
$$;

--
-- Name: leave_partitions(uuid); Type: FUNCTION; Schema: outbox; Owner: -
--

CREATE FUNCTION outbox.leave_partitions(p_instance uuid) RETURNS integer
    LANGUAGE plpgsql
    SET search_path TO 'pg_catalog', 'pg_temp'
    SET plan_cache_mode TO 'force_generic_plan'
    AS $$
DECLARE
    v_released integer;
BEGIN
    UPDATE outbox.partition SET owner = NULL, owner_instance = NULL WHERE owner_instance = p_instance;
    GET DIAGNOSTICS v_released = ROW_COUNT;
    DELETE FROM outbox.partition_member WHERE instance = p_instance;
    RETURN v_released;
END
$$;

--
-- Name: lock_deliveries(text[], text[]); Type: FUNCTION; Schema: outbox; Owner: -
--

CREATE FUNCTION outbox.lock_deliveries(p_streams text[], p_keys text[]) RETURNS void
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET jit TO 'off'
    SET plan_cache_mode TO 'force_generic_plan'
    AS $$
BEGIN
    PERFORM 1
    FROM (SELECT DISTINCT k.stream, k.aggregate_key
          FROM unnest(p_streams, p_keys) AS k(stream, aggregate_key)
          ORDER BY k.stream, k.aggregate_key) k
    CROSS JOIN LATERAL (
        SELECT 1 FROM outbox.delivery d
        WHERE d.stream = k.stream AND d.aggregate_key = k.aggregate_key
        LIMIT 1
        FOR UPDATE
    ) d;
END
$$;

--
-- Name: nack(uuid, bigint, text, interval, interval, interval, integer); Type: FUNCTION; Schema: outbox; Owner: -
--

CREATE FUNCTION outbox.nack(p_event_id uuid, p_epoch bigint, p_error text, p_retry_after interval, p_backoff_base interval, p_backoff_cap interval, p_max_failures integer) RETURNS TABLE(parked boolean, next_attempt_at timestamp with time zone, failures integer, holder uuid, ended uuid[])
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET jit TO 'off'
    SET plan_cache_mode TO 'force_generic_plan'
    AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH cur AS (
        SELECT d.stream, d.aggregate_key, d.failures + 1 AS failures, d.holder,
               d.delivered_revision, d.leased_through,
               clock_timestamp() + greatest(
                   coalesce(p_retry_after, interval '0'),
                   least(p_backoff_cap, p_backoff_base * power(2, least(d.failures, 30)))
                       * (0.5 + random() / 2)) AS retry_at
        FROM outbox.event e
        JOIN outbox.delivery d ON d.stream = e.stream AND d.aggregate_key = e.aggregate_key
        WHERE e.event_id = p_event_id AND d.leased_event_id = p_event_id
          AND d.epoch = p_epoch AND d.state = 'leased'
        FOR UPDATE OF d
    ), recorded AS (
        -- Attempt history (outbox.attempt), from the lease as it was.
        INSERT INTO outbox.attempt (stream, aggregate_key, event_id, revision, attempt, outcome, error, relay_id, replica_id)
        SELECT c.stream, c.aggregate_key, p_event_id, e.revision, d.attempt,
               CASE WHEN c.failures >= p_max_failures THEN 'parked' ELSE 'nacked' END,
               left(p_error, 4096), d.holder_relay_id, d.holder_replica_id
        FROM cur c
        JOIN outbox.delivery d ON d.stream = c.stream AND d.aggregate_key = c.aggregate_key
        JOIN outbox.event e ON e.event_id = p_event_id
    )
    UPDATE outbox.delivery d
    SET failures = c.failures,
        last_error = left(p_error, 4096),
        state = CASE WHEN c.failures >= p_max_failures THEN 'parked' ELSE 'backoff' END,
        claimable_at = CASE WHEN c.failures >= p_max_failures THEN NULL ELSE c.retry_at END,
        next_attempt_at = CASE WHEN c.failures >= p_max_failures THEN NULL ELSE c.retry_at END,
        parked_at = CASE WHEN c.failures >= p_max_failures THEN clock_timestamp() END,
        parked_revision = CASE WHEN c.failures >= p_max_failures THEN c.delivered_revision + 1 END,
        parked_reason = CASE WHEN c.failures >= p_max_failures
            THEN format('publish failed %s; last error: %s',
                        CASE WHEN c.failures = 1 THEN 'once' ELSE c.failures || ' times' END, left(p_error, 1024)) END,
        holder = NULL, holder_relay_id = NULL, holder_replica_id = NULL, lease_expires_at = NULL
    FROM cur c
    WHERE d.stream = c.stream AND d.aggregate_key = c.aggregate_key
    RETURNING d.state = 'parked', d.next_attempt_at, d.failures, c.holder,
              outbox.lease_window(c.stream, c.aggregate_key, c.delivered_revision, c.leased_through);
END
$$;

--
-- Name: own_partitions(text, uuid, boolean, interval); Type: FUNCTION; Schema: outbox; Owner: -
--

CREATE FUNCTION outbox.own_partitions(p_replica text, p_instance uuid, p_wants boolean, p_ttl interval) RETURNS outbox.ownership
    LANGUAGE plpgsql
    SET search_path TO 'pg_catalog', 'pg_temp'
    SET plan_cache_mode TO 'force_generic_plan'
    AS $$
DECLARE
    v_now timestamptz := clock_timestamp();
    v_wants boolean := coalesce(p_wants, false);
    v_share integer := 0;
    v_owned integer;
    v_other timestamptz;
    v_set text;
    r outbox.ownership;
BEGIN
    IF p_replica IS NULL OR p_replica = '' THEN
        RAISE EXCEPTION 'outbox.own_partitions: replica id must not be empty'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_instance IS NULL THEN
        RAISE EXCEPTION 'outbox.own_partitions: instance must not be NULL'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF p_ttl IS NULL OR p_ttl <= interval '0' THEN
        RAISE EXCEPTION 'outbox.own_partitions: ownership TTL must be positive, got %', p_ttl
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    v_set := set_config('synchronous_commit', 'on', true);
    UPDATE outbox.partition_member SET expires_at = v_now + p_ttl, wants = v_wants
    WHERE instance = p_instance AND expires_at > v_now;
    IF NOT FOUND THEN
        SELECT m.expires_at INTO v_other FROM outbox.partition_member m
        WHERE m.replica_id = p_replica AND m.instance <> p_instance AND m.expires_at > v_now;
        IF FOUND THEN
            RAISE EXCEPTION 'outbox.own_partitions: another process registered replica id % until %', p_replica, v_other
                USING ERRCODE = 'unique_violation',
                      HINT = 'Either a second replica runs with this --replica-id (give each its own, or leave it to the default), '
                          || 'or this replica restarted and waits for its previous process''s registration to expire.';
        END IF;
        -- Joining, or back after the membership lapsed: what this process
        -- owned under it is not its own any more, as if it had left.
        PERFORM outbox.leave_partitions(p_instance);
        INSERT INTO outbox.partition_member (instance, replica_id, wants, expires_at)
        VALUES (p_instance, p_replica, v_wants, v_now + p_ttl);
    END IF;
    IF v_wants THEN
        SELECT ceil(256.0 / count(*))::integer INTO v_share FROM outbox.partition_member
        WHERE wants AND expires_at > v_now;
    END IF;
    SELECT count(*) INTO v_owned FROM outbox.partition WHERE owner_instance = p_instance;
    IF v_owned < v_share THEN
        -- The dead, locked against their renewal: a membership renewed
        -- meanwhile is re-checked on its new version and left alone. Rows
        -- another transaction holds (a renewal under way, or another
        -- takeover) are skipped, so that no takeover waits for anyone and
        -- none deadlocks with a renewal that goes on to take partitions.
        -- A dead member's partitions are freed with it, in the same
        -- statement, so every owned partition's owner has a membership:
        -- an owner whose membership this snapshot does not show is a
        -- process joining concurrently, never a dead one.
        WITH dead AS (
            DELETE FROM outbox.partition_member
            WHERE instance IN (SELECT m.instance FROM outbox.partition_member m
                               WHERE m.expires_at <= v_now FOR UPDATE SKIP LOCKED)
            RETURNING instance
        )
        UPDATE outbox.partition SET owner = NULL, owner_instance = NULL
        WHERE owner_instance IN (SELECT instance FROM dead);
        UPDATE outbox.partition p
        SET owner = p_replica,
            owner_instance = p_instance,
            epoch = greatest(p.epoch + 1, (extract(epoch FROM v_now) * 1000000)::bigint)
        FROM (SELECT f.partition FROM outbox.partition f
              WHERE f.owner_instance IS NULL
              ORDER BY f.partition
              LIMIT v_share - v_owned
              FOR UPDATE OF f SKIP LOCKED) free
        WHERE p.partition = free.partition;
    END IF;
    SELECT v_share, coalesce(array_agg(p.partition ORDER BY p.partition), '{}'),
           coalesce(array_agg(p.epoch ORDER BY p.partition), '{}')
    INTO r
    FROM outbox.partition p WHERE p.owner_instance = p_instance;
    RETURN r;
END
$$;

--
-- Name: park(uuid, bigint, text); Type: FUNCTION; Schema: outbox; Owner: -
--

CREATE FUNCTION outbox.park(p_event_id uuid, p_epoch bigint, p_reason text) RETURNS TABLE(holder uuid, ended uuid[])
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET jit TO 'off'
    SET plan_cache_mode TO 'force_generic_plan'
    AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH cur AS (
        SELECT d.stream, d.aggregate_key, d.holder, e.revision, d.leased_through FROM outbox.event e
        JOIN outbox.delivery d ON d.stream = e.stream AND d.aggregate_key = e.aggregate_key
        WHERE e.event_id = p_event_id AND e.revision > d.delivered_revision AND e.revision <= d.leased_through
          AND d.epoch = p_epoch AND d.state = 'leased'
        FOR UPDATE OF d
    ), recorded AS (
        -- Attempt history (outbox.attempt), from the lease as it was.
        INSERT INTO outbox.attempt (stream, aggregate_key, event_id, revision, attempt, outcome, error, relay_id, replica_id)
        SELECT c.stream, c.aggregate_key, p_event_id, e.revision, d.attempt, 'parked', left(p_reason, 4096),
               d.holder_relay_id, d.holder_replica_id
        FROM cur c
        JOIN outbox.delivery d ON d.stream = c.stream AND d.aggregate_key = c.aggregate_key
        JOIN outbox.event e ON e.event_id = p_event_id
    )
    UPDATE outbox.delivery d
    SET state = 'parked', claimable_at = NULL, parked_at = clock_timestamp(), parked_reason = p_reason,
        parked_revision = c.revision,
        last_error = p_reason, next_attempt_at = NULL,
        holder = NULL, holder_relay_id = NULL, holder_replica_id = NULL, lease_expires_at = NULL
    FROM cur c
    WHERE d.stream = c.stream AND d.aggregate_key = c.aggregate_key
    RETURNING c.holder, outbox.lease_window(c.stream, c.aggregate_key, c.revision - 1, c.leased_through);
END
$$;

--
-- Name: partition_of(text, text); Type: FUNCTION; Schema: outbox; Owner: -
--

CREATE FUNCTION outbox.partition_of(p_stream text, p_aggregate_key text) RETURNS integer
    LANGUAGE sql IMMUTABLE STRICT PARALLEL SAFE
    AS $$
    SELECT (hashtextextended(p_aggregate_key, hashtextextended(p_stream, 0)) & 255)::integer
$$;

--
-- Name: pending_by_stream(text[]); Type: FUNCTION; Schema: outbox; Owner: -
--

CREATE FUNCTION outbox.pending_by_stream(p_streams text[]) RETURNS TABLE(stream text, events bigint, aggregates bigint, oldest timestamp with time zone, oldest_held timestamp with time zone, ready bigint, leased bigint, backoff bigint, parked bigint, gap bigint, stalled bigint)
    LANGUAGE plpgsql STABLE
    SET enable_seqscan TO 'off'
    SET jit TO 'off'
    SET plan_cache_mode TO 'force_custom_plan'
    AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH pend AS (
        SELECT d.stream, d.state, p.events, p.oldest_created_at,
               outbox.stall_reason(d.state, d.unanswered, d.failures, d.last_error) IS NOT NULL AS stalled
        FROM outbox.delivery d
        CROSS JOIN LATERAL outbox.pending_of(d.stream, d.aggregate_key, d.delivered_revision) p
        WHERE d.pending_since IS NOT NULL AND (p_streams IS NULL OR d.stream = ANY (p_streams))
          AND p.events > 0
    )
    SELECT x.stream, sum(x.events)::bigint, count(*),
           min(x.oldest_created_at),
           min(x.oldest_created_at) FILTER (WHERE x.state IN ('parked', 'backoff', 'gap')),
           count(*) FILTER (WHERE x.state = 'ready'),
           count(*) FILTER (WHERE x.state = 'leased'),
           count(*) FILTER (WHERE x.state = 'backoff'),
           count(*) FILTER (WHERE x.state = 'parked'),
           count(*) FILTER (WHERE x.state = 'gap'),
           count(*) FILTER (WHERE x.stalled)
    FROM pend x
    GROUP BY x.stream;
END
$$;

--
-- Name: pending_of(text, text, bigint); Type: FUNCTION; Schema: outbox; Owner: -
--

CREATE FUNCTION outbox.pending_of(p_stream text, p_aggregate_key text, p_after_revision bigint) RETURNS TABLE(events bigint, next_revision bigint, oldest_created_at timestamp with time zone)
    LANGUAGE sql STABLE
    AS $$
    SELECT count(*), min(e.revision), min(e.created_at)
    FROM outbox.event e
    WHERE e.stream = p_stream AND e.aggregate_key = p_aggregate_key
      AND e.revision > p_after_revision AND e.published_at IS NULL
      AND (SELECT true FROM outbox.skipped_event s WHERE s.event_id = e.event_id) IS NULL
$$;

--
-- Name: probe_claims(text[], text[], interval); Type: FUNCTION; Schema: outbox; Owner: -
--

CREATE FUNCTION outbox.probe_claims(p_streams text[], p_exclude text[], p_max_due interval) RETURNS TABLE(oldest timestamp with time zone, next_at timestamp with time zone)
    LANGUAGE plpgsql STABLE
    SET enable_seqscan TO 'off'
    SET enable_sort TO 'off'
    SET enable_incremental_sort TO 'off'
    SET jit TO 'off'
    SET plan_cache_mode TO 'force_generic_plan'
    AS $$
DECLARE
    -- The transaction's clock, as the check's own statement used before.
    v_now timestamptz := now();
BEGIN
    RETURN QUERY SELECT p.oldest, p.next_at FROM outbox.claim_probe(p_streams, p_exclude, v_now, p_max_due) p;
END
$$;

--
-- Name: record_expired(text[], text[], timestamp with time zone, integer); Type: FUNCTION; Schema: outbox; Owner: -
--

CREATE FUNCTION outbox.record_expired(p_streams text[], p_keys text[], p_now timestamp with time zone, p_max_attempts integer) RETURNS void
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET jit TO 'off'
    SET plan_cache_mode TO 'force_generic_plan'
    AS $$
BEGIN
    -- Usually nothing qualifies (claims take ready aggregates whose head
    -- was never leased): say so with index probes alone, so that the
    -- INSERT and its statement trigger (trim_attempts) do not run at all.
    -- (Each row by a probe of its key, LATERAL with LIMIT: a join, planned
    -- while the table was small, would pass over all of it.)
    IF NOT EXISTS (
        SELECT 1 FROM unnest(p_streams, p_keys) AS l(stream, aggregate_key)
        CROSS JOIN LATERAL (
            SELECT 1 FROM outbox.delivery d
            WHERE d.stream = l.stream AND d.aggregate_key = l.aggregate_key
              AND (d.state = 'leased' OR (d.state = 'ready' AND d.unanswered + 1 >= p_max_attempts))
            LIMIT 1
        ) d) THEN
        RETURN;
    END IF;
    INSERT INTO outbox.attempt (stream, aggregate_key, event_id, revision, attempt, outcome, error,
                                relay_id, replica_id, at)
    SELECT d.stream, d.aggregate_key, e.event_id, e.revision, d.attempt,
           CASE WHEN d.unanswered + 1 >= p_max_attempts THEN 'parked' ELSE 'expired' END,
           CASE WHEN d.unanswered + 1 >= p_max_attempts THEN format(
                    'delivered %s times without an ack or a nack: each lease expired or the stream holding it ended',
                    d.unanswered + 1)
                ELSE format('the lease expired at %s without an ack or a nack', d.lease_expires_at) END,
           d.holder_relay_id, d.holder_replica_id,
           CASE WHEN d.state = 'leased' THEN least(coalesce(d.lease_expires_at, p_now), p_now) ELSE p_now END
    FROM unnest(p_streams, p_keys) AS l(stream, aggregate_key)
    CROSS JOIN LATERAL (
        SELECT d.* FROM outbox.delivery d
        WHERE d.stream = l.stream AND d.aggregate_key = l.aggregate_key
          AND (d.state = 'leased' OR (d.state = 'ready' AND d.unanswered + 1 >= p_max_attempts))
        LIMIT 1
    ) d
    CROSS JOIN LATERAL (
        SELECT e.event_id, e.revision FROM outbox.event e
        WHERE e.event_id = d.leased_event_id AND e.revision = d.delivered_revision + 1
        LIMIT 1
    ) e
    WHERE (SELECT true FROM outbox.skipped_event s WHERE s.event_id = e.event_id) IS NULL;
END
$$;

--
-- Name: release(uuid, uuid[]); Type: FUNCTION; Schema: outbox; Owner: -
--

CREATE FUNCTION outbox.release(p_holder uuid, p_keep uuid[] DEFAULT '{}'::uuid[]) RETURNS integer
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET jit TO 'off'
    SET plan_cache_mode TO 'force_generic_plan'
    AS $$
DECLARE
    v_released integer;
BEGIN
    WITH held AS (
        -- Every lease of the holder, kept or not, locked before it is
        -- judged: an ack still committing may slide a kept window onto
        -- events the session never saw, and the lock waits for it and
        -- returns the row as the ack left it (a lease judged on this
        -- statement's snapshot alone would be kept unlocked). Locking the
        -- kept rows costs a sweep a tuple lock each; a stream's end keeps
        -- none.
        SELECT d.stream, d.aggregate_key, d.leased_event_id, d.leased_through, d.attempt,
               d.holder_relay_id, d.holder_replica_id
        FROM outbox.delivery d
        WHERE d.holder = p_holder
        ORDER BY d.stream, d.aggregate_key
        FOR UPDATE
    ), mine AS (
        SELECT h.stream, h.aggregate_key FROM held h
        WHERE NOT coalesce(h.leased_event_id = ANY (p_keep) AND EXISTS (
                  SELECT 1 FROM outbox.event t
                  WHERE t.stream = h.stream AND t.aggregate_key = h.aggregate_key
                    AND t.revision = h.leased_through AND t.event_id = ANY (p_keep)), false)
    ), released AS (
        UPDATE outbox.delivery d
        SET state = 'ready', claimable_at = coalesce(d.pending_since, clock_timestamp()),
            holder = NULL, holder_relay_id = NULL, holder_replica_id = NULL, lease_expires_at = NULL
        FROM mine m
        WHERE d.stream = m.stream AND d.aggregate_key = m.aggregate_key AND d.holder = p_holder
        RETURNING d.stream, d.aggregate_key
    ), recorded AS (
        -- Attempt history (outbox.attempt), from the leases as they were
        -- when locked, before the update.
        INSERT INTO outbox.attempt (stream, aggregate_key, event_id, revision, attempt, outcome, error, relay_id, replica_id)
        SELECT h.stream, h.aggregate_key, h.leased_event_id, e.revision, h.attempt, 'released',
               'the lease was given back unanswered: the relay''s stream ended (or the server stopped) while it held it', h.holder_relay_id, h.holder_replica_id
        FROM released r
        JOIN held h ON h.stream = r.stream AND h.aggregate_key = r.aggregate_key
        JOIN outbox.event e ON e.event_id = h.leased_event_id
    ), woken AS (
        -- Released aggregates are ready: idle sessions on every replica
        -- claim them now rather than at their next poll. (A stream ends
        -- rarely; producers never notify.)
        SELECT pg_notify('outbox_wakeup', '') FROM (SELECT 1 FROM released LIMIT 1) r
    )
    SELECT count(*)::integer INTO v_released FROM released, (SELECT count(*) FROM woken) w;
    RETURN v_released;
END
$$;

--
-- Name: release_partitions(uuid, integer[]); Type: FUNCTION; Schema: outbox; Owner: -
--

CREATE FUNCTION outbox.release_partitions(p_instance uuid, p_partitions integer[]) RETURNS integer
    LANGUAGE plpgsql
    SET search_path TO 'pg_catalog', 'pg_temp'
    SET plan_cache_mode TO 'force_generic_plan'
    AS $$
DECLARE
    v_released integer;
BEGIN
    UPDATE outbox.partition SET owner = NULL, owner_instance = NULL
    WHERE owner_instance = p_instance AND partition = ANY (p_partitions);
    GET DIAGNOSTICS v_released = ROW_COUNT;
    RETURN v_released;
END
$$;

--
-- Name: republish_action(text, text, bigint, bigint); Type: FUNCTION; Schema: outbox; Owner: -
--

CREATE FUNCTION outbox.republish_action(p_stream text, p_aggregate_key text, p_revision bigint, p_republished_through bigint) RETURNS bigint
    LANGUAGE sql STABLE
    AS $$
    SELECT coalesce(CASE WHEN p_revision <= p_republished_through THEN (
        SELECT r.action_id FROM outbox.republished r
        WHERE r.stream = p_stream AND r.aggregate_key = p_aggregate_key
          AND p_revision BETWEEN r.from_revision AND r.to_revision
        ORDER BY r.action_id DESC
        LIMIT 1)
    END, 0)
$$;

--
-- Name: republished_attempts(text, text, uuid); Type: FUNCTION; Schema: outbox; Owner: -
--

CREATE FUNCTION outbox.republished_attempts(p_stream text, p_aggregate_key text, p_event_id uuid) RETURNS integer
    LANGUAGE sql STABLE
    AS $$
    SELECT (r.earlier_attempts ->> p_event_id::text)::integer
    FROM outbox.republished r
    WHERE r.stream = p_stream AND r.aggregate_key = p_aggregate_key
      AND r.earlier_attempts ? p_event_id::text
    ORDER BY r.action_id DESC
    LIMIT 1
$$;

--
-- Name: require_read_committed(text); Type: FUNCTION; Schema: outbox; Owner: -
--

CREATE FUNCTION outbox.require_read_committed(p_caller text) RETURNS void
    LANGUAGE plpgsql
    AS $$
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'outbox: % must run at READ COMMITTED, not %',
                p_caller, upper(current_setting('transaction_isolation'))
            USING ERRCODE = 'invalid_transaction_state',
                  HINT = 'Set default_transaction_isolation = ''read committed'' on outboxd''s connections.';
    END IF;
END
$$;

--
-- Name: rescan_discovery(); Type: FUNCTION; Schema: outbox; Owner: -
--

CREATE FUNCTION outbox.rescan_discovery() RETURNS TABLE(events bigint, aggregates bigint, restamped bigint)
    LANGUAGE plpgsql
    SET jit TO 'off'
    AS $$
#variable_conflict use_column
DECLARE
    v_snapshot pg_snapshot;
    v_restamped bigint;
    v_ids uuid[];
    v_streams text[];
    v_keys text[];
    v_revs bigint[];
    v_created timestamptz[];
    v_woken bigint := 0;
BEGIN
    PERFORM outbox.require_read_committed('outbox.rescan_discovery');
    PERFORM pg_advisory_xact_lock(7954802400917419382); -- 'outboxd.discover': rounds take turns with it
    PERFORM set_config('outbox.rescanning', 'on', true);

    -- 1. In one snapshot N: re-stamp the copied ids, and read every pending
    --    event.
    WITH snap AS MATERIALIZED (
        SELECT pg_current_snapshot() AS s
    ), restamp AS (
        UPDATE outbox.event e SET xid = '2'::xid8
        FROM snap
        WHERE e.xid >= pg_snapshot_xmax(snap.s) OR e.xid = ANY (ARRAY(SELECT pg_snapshot_xip(snap.s)))
        RETURNING 1
    ), pending AS (
        SELECT e.event_id, e.stream, e.aggregate_key, e.revision, e.created_at
        FROM outbox.event e
        WHERE e.published_at IS NULL
          AND (SELECT true FROM outbox.skipped_event s WHERE s.event_id = e.event_id) IS NULL
    )
    SELECT (SELECT s FROM snap), (SELECT count(*) FROM restamp),
           array_agg(p.event_id), array_agg(p.stream), array_agg(p.aggregate_key),
           array_agg(p.revision), array_agg(p.created_at)
    INTO v_snapshot, v_restamped, v_ids, v_streams, v_keys, v_revs, v_created
    FROM pending p;

    IF v_ids IS NOT NULL THEN
        -- 2. Lock the found aggregates' delivery rows, in key order.
        PERFORM outbox.lock_deliveries(v_streams, v_keys);

        -- 3. Decide in a newer statement: events published meanwhile are
        --    left out; a new aggregate gets a ready delivery row from its
        --    oldest pending revision; an idle or gap-held one with a
        --    pending revision past its cursor is woken; the rest have work
        --    in hand. Pending events at or below the cursor are late.
        WITH found AS (
            SELECT f.event_id, f.stream, f.aggregate_key, f.revision, f.created_at
            FROM unnest(v_ids, v_streams, v_keys, v_revs, v_created)
                 AS f(event_id, stream, aggregate_key, revision, created_at)
            WHERE (SELECT e.published_at IS NULL FROM outbox.event e WHERE e.event_id = f.event_id)
              AND (SELECT true FROM outbox.skipped_event s WHERE s.event_id = f.event_id) IS NULL
        ), fresh AS (
            SELECT f.stream, f.aggregate_key, min(f.revision) AS first_revision, min(f.created_at) AS first_created_at
            FROM found f
            WHERE NOT EXISTS (SELECT 1 FROM outbox.delivery d WHERE d.stream = f.stream AND d.aggregate_key = f.aggregate_key)
            GROUP BY f.stream, f.aggregate_key
        ), created AS (
            INSERT INTO outbox.delivery AS d (stream, aggregate_key, state, delivered_revision, claimable_at, pending_since)
            SELECT x.stream, x.aggregate_key, 'ready', x.first_revision - 1, x.first_created_at, x.first_created_at
            FROM fresh x
            ORDER BY x.stream, x.aggregate_key
            ON CONFLICT (stream, aggregate_key) DO NOTHING
            RETURNING 1
        ), ahead AS (
            SELECT f.stream, f.aggregate_key, min(f.created_at) AS first_created_at
            FROM found f
            JOIN outbox.delivery d ON d.stream = f.stream AND d.aggregate_key = f.aggregate_key
            WHERE f.revision > d.delivered_revision AND d.state IN ('idle', 'gap')
            GROUP BY f.stream, f.aggregate_key
        ), woken AS (
            UPDATE outbox.delivery d
            SET state = 'ready', claimable_at = x.first_created_at,
                pending_since = least(d.pending_since, x.first_created_at),
                next_attempt_at = NULL, gap_revision = NULL
            FROM ahead x
            WHERE d.stream = x.stream AND d.aggregate_key = x.aggregate_key
            RETURNING 1
        ), late AS (
            INSERT INTO outbox.late_event (event_id)
            SELECT f.event_id
            FROM found f
            JOIN outbox.delivery d ON d.stream = f.stream AND d.aggregate_key = f.aggregate_key
            WHERE f.revision <= d.delivered_revision
            ON CONFLICT (event_id) DO NOTHING
        )
        SELECT (SELECT count(*) FROM created) + (SELECT count(*) FROM woken) INTO v_woken;
    END IF;

    UPDATE outbox.discovery d
    SET snapshot = v_snapshot, advanced_at = now(), system_identifier = outbox.cluster_system_identifier(),
        stopped_reason = NULL, stopped_at = NULL;
    IF v_woken > 0 THEN
        PERFORM pg_notify('outbox_wakeup', '');
    END IF;
    RETURN QUERY SELECT coalesce(cardinality(v_ids), 0)::bigint, v_woken, v_restamped;
END
$$;

--
-- Name: settings_wake_sleeper(); Type: FUNCTION; Schema: outbox; Owner: -
--

CREATE FUNCTION outbox.settings_wake_sleeper() RETURNS trigger
    LANGUAGE plpgsql
    SET plan_cache_mode TO 'force_generic_plan'
    AS $$
BEGIN
    IF NEW.producer_wakeups IS DISTINCT FROM OLD.producer_wakeups THEN
        PERFORM pg_notify('outbox_discover', 'settings');
    END IF;
    RETURN NULL;
END
$$;

--
-- Name: stall_reason(text, integer, integer, text); Type: FUNCTION; Schema: outbox; Owner: -
--

CREATE FUNCTION outbox.stall_reason(p_state text, p_unanswered integer, p_failures integer, p_last_error text) RETURNS text
    LANGUAGE sql STABLE
    AS $$
    SELECT CASE
        WHEN p_state NOT IN ('ready', 'leased', 'backoff') THEN NULL
        WHEN p_unanswered >= s.stall_after_unanswered THEN format(
            '%s deliveries of the next event ended without an ack or a nack (lease expired or the relay''s stream ended)',
            p_unanswered)
        WHEN p_failures >= s.stall_after_failures THEN format(
            '%s publishes of the next event failed in a row; last error: %s', p_failures, left(coalesce(p_last_error, ''), 512))
    END
    FROM outbox.settings s
$$;

--
-- Name: stranded(text[]); Type: FUNCTION; Schema: outbox; Owner: -
--

CREATE FUNCTION outbox.stranded(p_streams text[]) RETURNS TABLE(stream text, events bigint)
    LANGUAGE sql STABLE
    AS $$
    WITH disc AS (
        SELECT snapshot FROM outbox.discovery
    ), unclaimed AS (
        SELECT a.stream, p.events
        FROM outbox.aggregate a
        LEFT JOIN outbox.delivery d ON d.stream = a.stream AND d.aggregate_key = a.aggregate_key
        CROSS JOIN disc
        CROSS JOIN LATERAL (
            SELECT count(*) AS events FROM outbox.event e
            WHERE e.stream = a.stream AND e.aggregate_key = a.aggregate_key
              AND e.revision > coalesce(d.delivered_revision, 0) AND e.published_at IS NULL
              AND pg_visible_in_snapshot(e.xid, disc.snapshot)
              AND (SELECT true FROM outbox.skipped_event s WHERE s.event_id = e.event_id) IS NULL
        ) p
        WHERE (d.state IS NULL OR d.state = 'idle')
          AND a.last_revision > coalesce(d.delivered_revision, 0)
          AND (p_streams IS NULL OR a.stream = ANY (p_streams))
          AND p.events > 0
    ), late AS (
        SELECT e.stream, count(*) AS events
        FROM outbox.late_event l
        JOIN outbox.event e ON e.event_id = l.event_id
        JOIN outbox.delivery d ON d.stream = e.stream AND d.aggregate_key = e.aggregate_key
        WHERE e.published_at IS NULL AND e.revision <= d.delivered_revision
          AND (SELECT true FROM outbox.skipped_event s WHERE s.event_id = e.event_id) IS NULL
          AND (p_streams IS NULL OR e.stream = ANY (p_streams))
        GROUP BY e.stream
    )
    SELECT x.stream, sum(x.events)::bigint
    FROM (SELECT * FROM unclaimed UNION ALL SELECT * FROM late) x
    GROUP BY x.stream
$$;

--
-- Name: trim_attempts(); Type: FUNCTION; Schema: outbox; Owner: -
--

CREATE FUNCTION outbox.trim_attempts() RETURNS trigger
    LANGUAGE plpgsql
    SET enable_seqscan TO 'off'
    SET jit TO 'off'
    AS $$
BEGIN
    -- The attempts past each aggregate's newest ones, found by a walk of
    -- its own index range (the subquery's OFFSET keeps it one per
    -- aggregate, never a join), then deleted by id.
    DELETE FROM outbox.attempt a
    WHERE a.attempt_id = ANY (ARRAY(
        SELECT x.attempt_id
        FROM (SELECT DISTINCT n.stream, n.aggregate_key FROM added n) n
        CROSS JOIN outbox.settings s
        CROSS JOIN LATERAL (
            SELECT x.attempt_id FROM outbox.attempt x
            WHERE x.stream = n.stream AND x.aggregate_key = n.aggregate_key
            ORDER BY x.attempt_id DESC
            OFFSET s.attempt_history_per_aggregate
        ) x));
    RETURN NULL;
END
$$;

--
-- Name: undiscovered(text[]); Type: FUNCTION; Schema: outbox; Owner: -
--

CREATE FUNCTION outbox.undiscovered(p_streams text[]) RETURNS TABLE(stream text, events bigint, oldest_created_at timestamp with time zone)
    LANGUAGE plpgsql STABLE
    SET enable_seqscan TO 'off'
    SET jit TO 'off'
    SET plan_cache_mode TO 'force_generic_plan'
    AS $$
#variable_conflict use_column
DECLARE
    v_prev pg_snapshot;
BEGIN
    SELECT d.snapshot INTO v_prev FROM outbox.discovery d;
    RETURN QUERY
    SELECT e.stream, count(*), min(e.created_at)
    FROM outbox.events_since(v_prev) e
    WHERE e.published_at IS NULL AND (p_streams IS NULL OR e.stream = ANY (p_streams))
      -- Its aggregate's row by a probe of the primary key: a NOT EXISTS
      -- could probe delivery_pending_idx by stream alone, every pending
      -- aggregate of the stream for each event.
      AND NOT coalesce((
          SELECT d.pending_since IS NOT NULL AND e.revision > d.delivered_revision
          FROM outbox.delivery d
          WHERE d.stream = e.stream AND d.aggregate_key = e.aggregate_key), false)
    GROUP BY e.stream;
END
$$;

--
-- Name: waiting_streams(text[]); Type: FUNCTION; Schema: outbox; Owner: -
--

CREATE FUNCTION outbox.waiting_streams(p_streams text[]) RETURNS TABLE(stream text)
    LANGUAGE plpgsql STABLE
    SET enable_seqscan TO 'off'
    SET enable_sort TO 'off'
    SET enable_incremental_sort TO 'off'
    SET jit TO 'off'
    SET plan_cache_mode TO 'force_generic_plan'
    AS $$
BEGIN
    RETURN QUERY
    SELECT s.stream
    FROM outbox.claimable_streams(p_streams, NULL) s
    CROSS JOIN outbox.settings st
    WHERE (SELECT d.claimable_at FROM outbox.delivery d
           WHERE d.stream = s.stream AND d.state = 'ready' AND d.claimable_at IS NOT NULL
           ORDER BY d.claimable_at
           LIMIT 1) < clock_timestamp() - st.idle_relay_after;
END
$$;

--
-- Name: xmin_horizon_holders(); Type: FUNCTION; Schema: outbox; Owner: -
--

CREATE FUNCTION outbox.xmin_horizon_holders() RETURNS TABLE(age integer, holder text, since timestamp with time zone)
    LANGUAGE sql STABLE
    AS $$
    SELECT h.age, h.holder, h.since FROM (
        SELECT greatest(age(a.backend_xid), CASE WHEN a.datname = current_database() THEN age(a.backend_xmin) END, 0) AS age,
               format('pid %s (%s)', a.pid,
                      concat_ws(', ', 'database ' || a.datname, 'user ' || a.usename,
                                'application ' || nullif(a.application_name, ''), a.state)) AS holder,
               a.xact_start AS since
        FROM pg_stat_activity a
        WHERE (a.backend_xid IS NOT NULL OR (a.backend_xmin IS NOT NULL AND a.datname = current_database()))
          AND a.pid <> pg_backend_pid()
          -- (A WAL sender's horizon is its standby's, listed below.)
          AND NOT EXISTS (SELECT FROM pg_stat_replication r WHERE r.pid = a.pid)
        UNION ALL
        SELECT greatest(age(p.transaction), 0),
               format('prepared transaction %s (database %s, owner %s)', p.gid, p.database, p.owner), p.prepared
        FROM pg_prepared_xacts p
        UNION ALL
        SELECT greatest(age(s.xmin), 0), format('replication slot %s', s.slot_name), NULL
        FROM pg_replication_slots s
        WHERE s.xmin IS NOT NULL
        UNION ALL
        SELECT greatest(age(r.backend_xmin), 0),
               format('standby %s (feedback of pid %s)', coalesce(nullif(r.application_name, ''), r.client_addr::text), r.pid),
               NULL
        FROM pg_stat_replication r
        WHERE r.backend_xmin IS NOT NULL
    ) h
    ORDER BY h.age DESC, h.holder
$$;

--
-- Name: accepted_gap; Type: TABLE; Schema: outbox; Owner: -
--

CREATE TABLE outbox.accepted_gap (
    stream text NOT NULL,
    aggregate_key text NOT NULL,
    from_revision bigint NOT NULL,
    to_revision bigint NOT NULL,
    reason text NOT NULL,
    actor text NOT NULL,
    accepted_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT accepted_gap_actor_check CHECK ((actor <> ''::text)),
    CONSTRAINT accepted_gap_check CHECK ((from_revision <= to_revision)),
    CONSTRAINT accepted_gap_reason_check CHECK ((reason <> ''::text))
);

--
-- Name: aggregate; Type: TABLE; Schema: outbox; Owner: -
--

CREATE TABLE outbox.aggregate (
    stream text NOT NULL,
    aggregate_key text NOT NULL,
    last_revision bigint NOT NULL
)
WITH (fillfactor='50');

--
-- Name: attempt; Type: TABLE; Schema: outbox; Owner: -
--

CREATE TABLE outbox.attempt (
    attempt_id bigint NOT NULL,
    stream text NOT NULL,
    aggregate_key text NOT NULL,
    event_id uuid NOT NULL,
    revision bigint NOT NULL,
    attempt integer NOT NULL,
    outcome text NOT NULL,
    error text,
    relay_id text,
    replica_id text,
    at timestamp with time zone DEFAULT clock_timestamp() NOT NULL,
    CONSTRAINT attempt_outcome_check CHECK ((outcome = ANY (ARRAY['nacked'::text, 'expired'::text, 'released'::text, 'parked'::text])))
);

--
-- Name: attempt_attempt_id_seq; Type: SEQUENCE; Schema: outbox; Owner: -
--

ALTER TABLE outbox.attempt ALTER COLUMN attempt_id ADD GENERATED ALWAYS AS IDENTITY (
    SEQUENCE NAME outbox.attempt_attempt_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1
);

--
-- Name: delivered_count; Type: TABLE; Schema: outbox; Owner: -
--

CREATE UNLOGGED TABLE outbox.delivered_count (
    stream text NOT NULL,
    bucket timestamp with time zone NOT NULL,
    backend_pid integer NOT NULL,
    events bigint NOT NULL
);

--
-- Name: delivery; Type: TABLE; Schema: outbox; Owner: -
--

CREATE TABLE outbox.delivery (
    stream text NOT NULL,
    aggregate_key text NOT NULL,
    state text NOT NULL,
    delivered_revision bigint NOT NULL,
    claimable_at timestamp with time zone,
    pending_since timestamp with time zone,
    epoch bigint DEFAULT 0 NOT NULL,
    holder uuid,
    holder_relay_id text,
    holder_replica_id text,
    leased_event_id uuid,
    leased_through bigint,
    lease_expires_at timestamp with time zone,
    attempt integer DEFAULT 0 NOT NULL,
    failures integer DEFAULT 0 NOT NULL,
    unanswered integer DEFAULT 0 NOT NULL,
    last_error text,
    next_attempt_at timestamp with time zone,
    parked_at timestamp with time zone,
    parked_reason text,
    parked_revision bigint,
    gap_revision bigint,
    republished_through bigint,
    CONSTRAINT delivery_claimable_check CHECK (((state = ANY (ARRAY['ready'::text, 'leased'::text, 'backoff'::text])) = (claimable_at IS NOT NULL))),
    CONSTRAINT delivery_lease_check CHECK (((state = 'leased'::text) = (holder IS NOT NULL))),
    CONSTRAINT delivery_state_check CHECK ((state = ANY (ARRAY['idle'::text, 'ready'::text, 'leased'::text, 'backoff'::text, 'parked'::text, 'gap'::text])))
);

--
-- Name: discovery; Type: TABLE; Schema: outbox; Owner: -
--

CREATE TABLE outbox.discovery (
    singleton boolean DEFAULT true NOT NULL,
    snapshot pg_snapshot NOT NULL,
    advanced_at timestamp with time zone NOT NULL,
    system_identifier bigint DEFAULT outbox.cluster_system_identifier() NOT NULL,
    stopped_reason text,
    stopped_at timestamp with time zone,
    CONSTRAINT discovery_check CHECK (((stopped_reason IS NULL) = (stopped_at IS NULL))),
    CONSTRAINT discovery_singleton_check CHECK (singleton)
);

--
-- Name: goose_db_version; Type: TABLE; Schema: outbox; Owner: -
--

CREATE TABLE outbox.goose_db_version (
    id integer NOT NULL,
    version_id bigint NOT NULL,
    is_applied boolean NOT NULL,
    tstamp timestamp without time zone DEFAULT now() NOT NULL
);

--
-- Name: goose_db_version_id_seq; Type: SEQUENCE; Schema: outbox; Owner: -
--

ALTER TABLE outbox.goose_db_version ALTER COLUMN id ADD GENERATED BY DEFAULT AS IDENTITY (
    SEQUENCE NAME outbox.goose_db_version_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1
);

--
-- Name: late_event; Type: TABLE; Schema: outbox; Owner: -
--

CREATE TABLE outbox.late_event (
    event_id uuid NOT NULL,
    discovered_at timestamp with time zone DEFAULT now() NOT NULL
);

--
-- Name: lease_key; Type: TABLE; Schema: outbox; Owner: -
--

CREATE TABLE outbox.lease_key (
    singleton boolean DEFAULT true NOT NULL,
    key bytea NOT NULL,
    CONSTRAINT lease_key_key_check CHECK ((octet_length(key) >= 32)),
    CONSTRAINT lease_key_singleton_check CHECK (singleton)
);

--
-- Name: operator_action; Type: TABLE; Schema: outbox; Owner: -
--

CREATE TABLE outbox.operator_action (
    action_id bigint NOT NULL,
    action text NOT NULL,
    actor text NOT NULL,
    reason text NOT NULL,
    request jsonb NOT NULL,
    aggregates bigint DEFAULT 0 NOT NULL,
    events bigint DEFAULT 0 NOT NULL,
    started_at timestamp with time zone DEFAULT clock_timestamp() NOT NULL,
    finished_at timestamp with time zone,
    stream text DEFAULT '*'::text NOT NULL,
    CONSTRAINT operator_action_action_check CHECK ((action = ANY (ARRAY['bulk_retry'::text, 'bulk_skip'::text, 'republish'::text, 'retry'::text, 'skip'::text]))),
    CONSTRAINT operator_action_actor_check CHECK ((actor <> ''::text))
);

--
-- Name: operator_action_action_id_seq; Type: SEQUENCE; Schema: outbox; Owner: -
--

ALTER TABLE outbox.operator_action ALTER COLUMN action_id ADD GENERATED ALWAYS AS IDENTITY (
    SEQUENCE NAME outbox.operator_action_action_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1
);

--
-- Name: operator_action_aggregate; Type: TABLE; Schema: outbox; Owner: -
--

CREATE TABLE outbox.operator_action_aggregate (
    action_id bigint NOT NULL,
    stream text NOT NULL,
    aggregate_key text NOT NULL,
    detail jsonb DEFAULT '{}'::jsonb NOT NULL,
    at timestamp with time zone DEFAULT clock_timestamp() NOT NULL
);

--
-- Name: partition; Type: TABLE; Schema: outbox; Owner: -
--

CREATE TABLE outbox.partition (
    partition integer NOT NULL,
    owner text,
    owner_instance uuid,
    epoch bigint DEFAULT 0 NOT NULL,
    CONSTRAINT partition_owner_check CHECK (((owner IS NULL) = (owner_instance IS NULL))),
    CONSTRAINT partition_partition_check CHECK (((partition >= 0) AND (partition < 256)))
)
WITH (fillfactor='50');

--
-- Name: partition_member; Type: TABLE; Schema: outbox; Owner: -
--

CREATE TABLE outbox.partition_member (
    instance uuid NOT NULL,
    replica_id text NOT NULL,
    wants boolean NOT NULL,
    expires_at timestamp with time zone NOT NULL
);

--
-- Name: relay_session; Type: TABLE; Schema: outbox; Owner: -
--

CREATE TABLE outbox.relay_session (
    session_id uuid NOT NULL,
    relay_id text NOT NULL,
    peer text NOT NULL,
    replica_id text NOT NULL,
    streams text[] NOT NULL,
    exclude_streams text[] DEFAULT '{}'::text[] NOT NULL,
    max_in_flight integer NOT NULL,
    in_flight integer DEFAULT 0 NOT NULL,
    acked bigint DEFAULT 0 NOT NULL,
    connected_at timestamp with time zone NOT NULL,
    seen_at timestamp with time zone NOT NULL
);

--
-- Name: republished; Type: TABLE; Schema: outbox; Owner: -
--

CREATE TABLE outbox.republished (
    action_id bigint NOT NULL,
    stream text NOT NULL,
    aggregate_key text NOT NULL,
    from_revision bigint NOT NULL,
    to_revision bigint NOT NULL,
    events bigint NOT NULL,
    previous_published_at jsonb NOT NULL,
    previous_skips jsonb DEFAULT '{}'::jsonb NOT NULL,
    earlier_attempts jsonb DEFAULT '{}'::jsonb NOT NULL,
    CONSTRAINT republished_check CHECK ((from_revision <= to_revision))
);

--
-- Name: settings; Type: TABLE; Schema: outbox; Owner: -
--

CREATE TABLE outbox.settings (
    singleton boolean DEFAULT true NOT NULL,
    max_payload_bytes integer DEFAULT 1048576 NOT NULL,
    attempt_history_per_aggregate integer DEFAULT 50 NOT NULL,
    stall_after_unanswered integer DEFAULT 3 NOT NULL,
    stall_after_failures integer DEFAULT 3 NOT NULL,
    idle_relay_after interval DEFAULT '00:01:00'::interval NOT NULL,
    producer_wakeups text DEFAULT 'auto'::text NOT NULL,
    CONSTRAINT settings_attempt_history_per_aggregate_check CHECK (((attempt_history_per_aggregate >= 1) AND (attempt_history_per_aggregate <= 10000))),
    CONSTRAINT settings_idle_relay_after_check CHECK ((idle_relay_after > '00:00:00'::interval)),
    CONSTRAINT settings_max_payload_bytes_check CHECK (((max_payload_bytes >= 1024) AND (max_payload_bytes <= 3145728))),
    CONSTRAINT settings_producer_wakeups_check CHECK ((producer_wakeups = ANY (ARRAY['auto'::text, 'on'::text, 'off'::text]))),
    CONSTRAINT settings_singleton_check CHECK (singleton),
    CONSTRAINT settings_stall_after_failures_check CHECK ((stall_after_failures > 0)),
    CONSTRAINT settings_stall_after_unanswered_check CHECK ((stall_after_unanswered > 0))
);

--
-- Name: skipped_event; Type: TABLE; Schema: outbox; Owner: -
--

CREATE TABLE outbox.skipped_event (
    event_id uuid NOT NULL,
    reason text NOT NULL,
    actor text NOT NULL,
    skipped_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT skipped_event_actor_check CHECK ((actor <> ''::text)),
    CONSTRAINT skipped_event_reason_check CHECK ((reason <> ''::text))
);

--
-- Name: accepted_gap accepted_gap_pkey; Type: CONSTRAINT; Schema: outbox; Owner: -
--

ALTER TABLE ONLY outbox.accepted_gap
    ADD CONSTRAINT accepted_gap_pkey PRIMARY KEY (stream, aggregate_key, from_revision);

--
-- Name: aggregate aggregate_pkey; Type: CONSTRAINT; Schema: outbox; Owner: -
--

ALTER TABLE ONLY outbox.aggregate
    ADD CONSTRAINT aggregate_pkey PRIMARY KEY (stream, aggregate_key);

--
-- Name: attempt attempt_pkey; Type: CONSTRAINT; Schema: outbox; Owner: -
--

ALTER TABLE ONLY outbox.attempt
    ADD CONSTRAINT attempt_pkey PRIMARY KEY (attempt_id);

--
-- Name: delivered_count delivered_count_pkey; Type: CONSTRAINT; Schema: outbox; Owner: -
--

ALTER TABLE ONLY outbox.delivered_count
    ADD CONSTRAINT delivered_count_pkey PRIMARY KEY (stream, bucket, backend_pid);

--
-- Name: delivery delivery_pkey; Type: CONSTRAINT; Schema: outbox; Owner: -
--

ALTER TABLE ONLY outbox.delivery
    ADD CONSTRAINT delivery_pkey PRIMARY KEY (stream, aggregate_key);

--
-- Name: discovery discovery_pkey; Type: CONSTRAINT; Schema: outbox; Owner: -
--

ALTER TABLE ONLY outbox.discovery
    ADD CONSTRAINT discovery_pkey PRIMARY KEY (singleton);

--
-- Name: event event_pkey; Type: CONSTRAINT; Schema: outbox; Owner: -
--

ALTER TABLE ONLY outbox.event
    ADD CONSTRAINT event_pkey PRIMARY KEY (event_id);

--
-- Name: event event_stream_aggregate_key_revision_key; Type: CONSTRAINT; Schema: outbox; Owner: -
--

ALTER TABLE ONLY outbox.event
    ADD CONSTRAINT event_stream_aggregate_key_revision_key UNIQUE (stream, aggregate_key, revision);

--
-- Name: goose_db_version goose_db_version_pkey; Type: CONSTRAINT; Schema: outbox; Owner: -
--

ALTER TABLE ONLY outbox.goose_db_version
    ADD CONSTRAINT goose_db_version_pkey PRIMARY KEY (id);

--
-- Name: late_event late_event_pkey; Type: CONSTRAINT; Schema: outbox; Owner: -
--

ALTER TABLE ONLY outbox.late_event
    ADD CONSTRAINT late_event_pkey PRIMARY KEY (event_id);

--
-- Name: lease_key lease_key_pkey; Type: CONSTRAINT; Schema: outbox; Owner: -
--

ALTER TABLE ONLY outbox.lease_key
    ADD CONSTRAINT lease_key_pkey PRIMARY KEY (singleton);

--
-- Name: operator_action_aggregate operator_action_aggregate_pkey; Type: CONSTRAINT; Schema: outbox; Owner: -
--

ALTER TABLE ONLY outbox.operator_action_aggregate
    ADD CONSTRAINT operator_action_aggregate_pkey PRIMARY KEY (action_id, stream, aggregate_key);

--
-- Name: operator_action operator_action_pkey; Type: CONSTRAINT; Schema: outbox; Owner: -
--

ALTER TABLE ONLY outbox.operator_action
    ADD CONSTRAINT operator_action_pkey PRIMARY KEY (action_id);

--
-- Name: partition_member partition_member_pkey; Type: CONSTRAINT; Schema: outbox; Owner: -
--

ALTER TABLE ONLY outbox.partition_member
    ADD CONSTRAINT partition_member_pkey PRIMARY KEY (instance);

--
-- Name: partition partition_pkey; Type: CONSTRAINT; Schema: outbox; Owner: -
--

ALTER TABLE ONLY outbox.partition
    ADD CONSTRAINT partition_pkey PRIMARY KEY (partition);

--
-- Name: relay_session relay_session_pkey; Type: CONSTRAINT; Schema: outbox; Owner: -
--

ALTER TABLE ONLY outbox.relay_session
    ADD CONSTRAINT relay_session_pkey PRIMARY KEY (session_id);

--
-- Name: republished republished_pkey; Type: CONSTRAINT; Schema: outbox; Owner: -
--

ALTER TABLE ONLY outbox.republished
    ADD CONSTRAINT republished_pkey PRIMARY KEY (action_id, stream, aggregate_key);

--
-- Name: settings settings_pkey; Type: CONSTRAINT; Schema: outbox; Owner: -
--

ALTER TABLE ONLY outbox.settings
    ADD CONSTRAINT settings_pkey PRIMARY KEY (singleton);

--
-- Name: skipped_event skipped_event_pkey; Type: CONSTRAINT; Schema: outbox; Owner: -
--

ALTER TABLE ONLY outbox.skipped_event
    ADD CONSTRAINT skipped_event_pkey PRIMARY KEY (event_id);

--
-- Name: attempt_aggregate_idx; Type: INDEX; Schema: outbox; Owner: -
--

CREATE INDEX attempt_aggregate_idx ON outbox.attempt USING btree (stream, aggregate_key, attempt_id);

--
-- Name: attempt_event_idx; Type: INDEX; Schema: outbox; Owner: -
--

CREATE INDEX attempt_event_idx ON outbox.attempt USING btree (event_id, attempt_id);

--
-- Name: delivery_claimable_idx; Type: INDEX; Schema: outbox; Owner: -
--

CREATE INDEX delivery_claimable_idx ON outbox.delivery USING btree (stream, state, claimable_at) WHERE (claimable_at IS NOT NULL);

--
-- Name: delivery_holder_idx; Type: INDEX; Schema: outbox; Owner: -
--

CREATE INDEX delivery_holder_idx ON outbox.delivery USING btree (holder) WHERE (holder IS NOT NULL);

--
-- Name: delivery_pending_idx; Type: INDEX; Schema: outbox; Owner: -
--

CREATE INDEX delivery_pending_idx ON outbox.delivery USING btree (stream, pending_since) WHERE (pending_since IS NOT NULL);

--
-- Name: event_created_at_event_id_idx; Type: INDEX; Schema: outbox; Owner: -
--

CREATE INDEX event_created_at_event_id_idx ON outbox.event USING btree (created_at, event_id);

--
-- Name: event_xid_idx; Type: INDEX; Schema: outbox; Owner: -
--

CREATE INDEX event_xid_idx ON outbox.event USING btree (xid);

--
-- Name: operator_action_aggregate_idx; Type: INDEX; Schema: outbox; Owner: -
--

CREATE INDEX operator_action_aggregate_idx ON outbox.operator_action_aggregate USING btree (stream, aggregate_key, action_id);

--
-- Name: operator_action_started_idx; Type: INDEX; Schema: outbox; Owner: -
--

CREATE INDEX operator_action_started_idx ON outbox.operator_action USING btree (started_at);

--
-- Name: republished_aggregate_idx; Type: INDEX; Schema: outbox; Owner: -
--

CREATE INDEX republished_aggregate_idx ON outbox.republished USING btree (stream, aggregate_key, action_id);

--
-- Name: attempt attempt_trim; Type: TRIGGER; Schema: outbox; Owner: -
--

CREATE TRIGGER attempt_trim AFTER INSERT ON outbox.attempt REFERENCING NEW TABLE AS added FOR EACH STATEMENT EXECUTE FUNCTION outbox.trim_attempts();

--
-- Name: delivery delivery_continue_attempts; Type: TRIGGER; Schema: outbox; Owner: -
--

CREATE TRIGGER delivery_continue_attempts BEFORE UPDATE OF attempt ON outbox.delivery FOR EACH ROW WHEN (((new.republished_through IS NOT NULL) AND (new.attempt = 1) AND (new.holder IS NOT NULL) AND ((old.attempt <> 1) OR (old.leased_event_id IS DISTINCT FROM new.leased_event_id)))) EXECUTE FUNCTION outbox.continue_attempts();

--
-- Name: event event_before_insert; Type: TRIGGER; Schema: outbox; Owner: -
--

CREATE TRIGGER event_before_insert BEFORE INSERT ON outbox.event FOR EACH ROW EXECUTE FUNCTION outbox.event_before_insert();

--
-- Name: event event_guard_published; Type: TRIGGER; Schema: outbox; Owner: -
--

CREATE TRIGGER event_guard_published BEFORE UPDATE OF published_at ON outbox.event FOR EACH ROW WHEN (((new.published_at IS DISTINCT FROM old.published_at) AND (NOT ((old.published_at IS NULL) AND (NOT (current_setting('outbox.acking'::text, true) IS DISTINCT FROM 'on'::text)))))) EXECUTE FUNCTION outbox.event_guard_published();

--
-- Name: event event_immutable; Type: TRIGGER; Schema: outbox; Owner: -
--

CREATE TRIGGER event_immutable BEFORE UPDATE OF event_id, stream, aggregate_key, revision, event_type, payload, headers, created_at, xid ON outbox.event FOR EACH ROW EXECUTE FUNCTION outbox.event_immutable();

--
-- Name: event event_keep_pending; Type: TRIGGER; Schema: outbox; Owner: -
--

CREATE TRIGGER event_keep_pending BEFORE DELETE ON outbox.event FOR EACH ROW EXECUTE FUNCTION outbox.event_keep_pending();

--
-- Name: settings settings_wake_sleeper; Type: TRIGGER; Schema: outbox; Owner: -
--

CREATE TRIGGER settings_wake_sleeper AFTER UPDATE ON outbox.settings FOR EACH ROW EXECUTE FUNCTION outbox.settings_wake_sleeper();

--
-- Name: late_event late_event_event_id_fkey; Type: FK CONSTRAINT; Schema: outbox; Owner: -
--

ALTER TABLE ONLY outbox.late_event
    ADD CONSTRAINT late_event_event_id_fkey FOREIGN KEY (event_id) REFERENCES outbox.event(event_id) ON DELETE CASCADE;

--
-- Name: operator_action_aggregate operator_action_aggregate_action_id_fkey; Type: FK CONSTRAINT; Schema: outbox; Owner: -
--

ALTER TABLE ONLY outbox.operator_action_aggregate
    ADD CONSTRAINT operator_action_aggregate_action_id_fkey FOREIGN KEY (action_id) REFERENCES outbox.operator_action(action_id);

--
-- Name: republished republished_action_id_fkey; Type: FK CONSTRAINT; Schema: outbox; Owner: -
--

ALTER TABLE ONLY outbox.republished
    ADD CONSTRAINT republished_action_id_fkey FOREIGN KEY (action_id) REFERENCES outbox.operator_action(action_id);

--
-- Name: skipped_event skipped_event_event_id_fkey; Type: FK CONSTRAINT; Schema: outbox; Owner: -
--

ALTER TABLE ONLY outbox.skipped_event
    ADD CONSTRAINT skipped_event_event_id_fkey FOREIGN KEY (event_id) REFERENCES outbox.event(event_id);

--
-- PostgreSQL database dump complete
--