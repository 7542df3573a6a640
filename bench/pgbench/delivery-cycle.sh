#!/usr/bin/env bash
# The delivery statements of steady load, without gRPC or Go: one pgbench
# client runs, per transaction, what a replica's steady delivery asks of
# PostgreSQL for BATCH events (default 16): the producers' inserts (BATCH
# events over 10,000 aggregates), one discovery round that dispatches every
# idle aggregate it found to one session (discover_scan, then
# discover_apply, in one transaction), and one batch ack of the leases the
# round returned (outbox.ack with the session as hand-over holder and its
# stream filter). It prints the CPU time of that client's backend per event
# delivered over a WINDOW-second window (read from /proc, so PostgreSQL must
# run on this machine), and, when the server has pg_stat_statements loaded,
# the statements' time per event, and how many of outbox.delivery's updates
# were HOT.
#
# FACTS=1 measures instead what an engine that leases in memory would still
# write (#25's direction 2, not built): the same inserts, the new events read
# since the stored snapshot and the snapshot advanced, then one statement
# marking the batch published and moving each aggregate's cursor (a HOT
# update: no indexed column changes). A lower bound for such a design: it
# leaves out skip checks, the delivery-rate counter and ownership rows.
#
# FENCE=advisory or FENCE=share (with FACTS=1) adds what fencing such an
# engine's writes would cost: aggregates hashed to PARTITIONS (default 64)
# partitions, each owned under an epoch in a table; the ack checks, in the
# transaction that marks the batch, that the epochs it holds are current,
# after locking its partitions against a takeover that bumps an epoch:
# FENCE=share locks the partition rows FOR SHARE (Temporal's SQL shard
# fence: a takeover's UPDATE waits for the acks in flight), FENCE=advisory
# takes shared transaction-scoped advisory locks instead (a takeover takes
# them exclusive), which write nothing to the table or WAL. The check runs
# in a statement after the lock, so its snapshot sees a takeover that
# committed while the ack waited. The server would know each lease's
# partition; here the first transaction computes them from the new events.
#
# ROUND=1 runs the round as the server does, one outbox.discover_round
# statement carrying one session's offer (credit BATCH + 4), with pgbench's
# prepared protocol, so that statements are planned as a server connection
# plans them; with BATCH=1 it is a trickled event's cycle. pg_stat_statements
# with pg_stat_statements.track_planning = on then also says which
# statements were planned on every call.
#
# HELD=1 runs the cycle of #25's direction 2, step 2 (not built): a lease
# kept in delivery columns that no index or predicate reads, so that both of
# a steady event's writes to its delivery row are HOT. The round reads the
# new events since the stored snapshot, sets held_through, the holder and a
# raised epoch on each idle aggregate whose next revision arrived (the
# state, claimable_at, holder and pending_since columns that the indexes
# read stay as they are), and advances the snapshot; the ack, per batch,
# marks the events published and moves each aggregate's cursor, fenced by
# the row's epoch (the row is written anyway), clearing held_through. With
# the prepared protocol, as ROUND=1. Compare it with ROUND=1, which is the
# same cycle as the server runs it today. HELD=2 adds what a sound engine of
# that shape would still do per ack: the replica's ownership of the leases'
# partitions fenced (shared advisory locks, then the partition rows checked
# against its instance), skipped events left alone, the look for each
# aggregate's next revision and its hand-over (a HOT update too), and the
# delivery-rate counter.
#
# RATE=N runs at most N cycles a second (pgbench -R) instead of back to
# back: with BATCH=1 and RATE=20, a light source's cycle, each statement
# landing on a backend that sat idle since the last cycle.
#
# Usage: [BATCH=N] [RATE=N] [ROUND=1 | HELD=1|2 | FACTS=1 [FENCE=advisory|share] [PARTITIONS=N]] bench/pgbench/delivery-cycle.sh [OUTBOXD_BINARY]
# TOP=N lists N statements (default 15). Compare builds (or the modes)
# back to back, alternating, on one server; BENCHMARKS.md quotes its
# figures.
set -euo pipefail
bin=${1:-bin/outboxd}
window=${WINDOW:-30}
batch=${BATCH:-16}
. "$(dirname "${BASH_SOURCE[0]}")/scratch-db.sh"
scratch_db outboxd_cycle
h=00000000-0000-0000-0000-0000000000aa
cat >"$work/cycle.sql" <<SQL
INSERT INTO outbox.event (stream, aggregate_key, event_type, payload) SELECT 's', (floor(random() * 10000))::int::text, 't', '{"a":1}' FROM generate_series(1, $batch);
BEGIN;
SELECT quote_literal(min(prev_snapshot)) AS prev, quote_literal(min(snapshot)) AS snap, quote_literal(array_agg(stream) FILTER (WHERE idle)) AS ss, quote_literal(array_agg(aggregate_key) FILTER (WHERE idle)) AS ks, count(*) FILTER (WHERE idle) AS n FROM outbox.discover_scan() \gset
SELECT quote_literal(array_agg((a.lease).event_id) FILTER (WHERE a.holder IS NOT NULL)) AS ids FROM outbox.discover_apply(:prev, :snap, :ss::text[], :ks::text[], array_fill('$h'::uuid, ARRAY[:n]), array_fill('r'::text, ARRAY[:n]), array_fill('30s'::interval, ARRAY[:n]), 'rep') a \gset
COMMIT;
SELECT count(*) AS acked FROM outbox.ack(:ids::uuid[], 'rep', ARRAY['$h'::uuid], ARRAY['30s'::interval], ARRAY[1], ARRAY[0], ARRAY['$h'::uuid], ARRAY[NULL::text], ARRAY[false], '60s') \gset
SQL
mode=simple
if [[ -n ${ROUND:-} ]]; then
	# No quote_literal: under the prepared protocol a variable is a parameter.
	mode=prepared
	cat >"$work/cycle.sql" <<SQL
INSERT INTO outbox.event (stream, aggregate_key, event_type, payload) SELECT 's', (floor(random() * 10000))::int::text, 't', '{"a":1}' FROM generate_series(1, $batch);
SELECT coalesce(array_agg((r.lease).event_id) FILTER (WHERE r.lease IS NOT NULL), '{}')::text AS ids FROM outbox.discover_round(1000, NULL, ARRAY['$h'::uuid], ARRAY['r'], ARRAY['30s'::interval], ARRAY[$((batch + 4))], NULL, 'rep') r \gset
SELECT count(*) AS acked FROM outbox.ack(:ids::uuid[], 'rep', ARRAY['$h'::uuid], ARRAY['30s'::interval], ARRAY[1], ARRAY[0], ARRAY['$h'::uuid], ARRAY[NULL::text], ARRAY[false], '60s') \gset
SQL
fi
if [[ -n ${HELD:-} ]]; then
	mode=prepared
	# As outbox.discover_scan's own SET clauses: the new events are read
	# through the xid index however small outbox.event was when pgbench
	# prepared the statement.
	export PGOPTIONS="${PGOPTIONS:-} -c enable_seqscan=off -c jit=off -c plan_cache_mode=force_generic_plan"
	psql -X -q "$url" -c "ALTER TABLE outbox.delivery ADD COLUMN held_through bigint, ADD COLUMN held_by uuid, SET (fillfactor = 70)"
	# The round: one statement reads the new events (the first of each
	# aggregate) and holds the idle aggregates they continue; a second
	# advances the snapshot. The ack: one statement fences each lease by
	# the row's epoch, moves the cursor and marks the events.
	ack=$(cat <<'ACK'
WITH a AS (SELECT e.stream, e.aggregate_key, e.event_id, a.epoch FROM unnest(:ids::uuid[], :epochs::bigint[]) a(event_id, epoch) JOIN outbox.event e ON e.event_id = a.event_id), acked AS (UPDATE outbox.delivery d SET delivered_revision = d.held_through, held_through = NULL, held_by = NULL FROM a WHERE d.stream = a.stream AND d.aggregate_key = a.aggregate_key AND d.leased_event_id = a.event_id AND d.epoch = a.epoch AND d.held_through IS NOT NULL RETURNING d.leased_event_id)
UPDATE outbox.event e SET published_at = clock_timestamp() FROM acked a WHERE e.event_id = a.leased_event_id AND e.published_at IS NULL;
ACK
)
	if [[ $HELD == 2 ]]; then
		# This client's replica owns every partition.
		psql -X -q -At "$url" -c "SELECT outbox.own_partitions('rep', '$h', true, '1 day')" >/dev/null
		ack=$(cat <<ACK
SELECT count(pg_advisory_xact_lock_shared(4243, p)) AS fenced FROM unnest(:parts::int[]) p \gset
WITH a AS (SELECT e.stream, e.aggregate_key, e.event_id, e.revision, a.epoch FROM unnest(:ids::uuid[], :epochs::bigint[]) a(event_id, epoch) JOIN outbox.event e ON e.event_id = a.event_id WHERE e.published_at IS NULL AND NOT EXISTS (SELECT FROM outbox.skipped_event s WHERE s.event_id = e.event_id) AND (SELECT count(*) FROM outbox.partition p WHERE p.partition = ANY (:parts::int[]) AND p.owner_instance = '$h') = cardinality(:parts::int[])), nxt AS (SELECT a.*, n.revision AS next_revision, n.event_id AS next_id FROM a LEFT JOIN LATERAL (SELECT x.revision, x.event_id FROM outbox.event x WHERE x.stream = a.stream AND x.aggregate_key = a.aggregate_key AND x.revision > a.revision AND NOT EXISTS (SELECT FROM outbox.skipped_event s WHERE s.event_id = x.event_id) ORDER BY x.revision LIMIT 1) n ON n.revision = a.revision + 1), acked AS (UPDATE outbox.delivery d SET delivered_revision = d.held_through, held_through = n.next_revision, held_by = CASE WHEN n.next_id IS NOT NULL THEN d.held_by END, leased_event_id = coalesce(n.next_id, d.leased_event_id), epoch = d.epoch + CASE WHEN n.next_id IS NOT NULL THEN 1 ELSE 0 END FROM nxt n WHERE d.stream = n.stream AND d.aggregate_key = n.aggregate_key AND d.leased_event_id = n.event_id AND d.epoch = n.epoch AND d.held_through IS NOT NULL RETURNING n.event_id), marked AS (UPDATE outbox.event e SET published_at = clock_timestamp() FROM acked a WHERE e.event_id = a.event_id AND e.published_at IS NULL RETURNING e.stream) INSERT INTO outbox.delivered_count AS c (stream, bucket, backend_pid, events) SELECT m.stream, date_bin('5 seconds', now(), timestamptz '2000-01-01'), pg_backend_pid(), count(*) FROM marked m GROUP BY m.stream ON CONFLICT (stream, bucket, backend_pid) DO UPDATE SET events = c.events + excluded.events;
ACK
)
	fi
	cat >"$work/cycle.sql" <<SQL
INSERT INTO outbox.event (stream, aggregate_key, event_type, payload) SELECT 's', (floor(random() * 10000))::int::text, 't', '{"a":1}' FROM generate_series(1, $batch);
BEGIN;
WITH found AS (SELECT DISTINCT ON (e.stream, e.aggregate_key) e.stream, e.aggregate_key, e.revision, e.event_id FROM outbox.events_since((SELECT d.snapshot FROM outbox.discovery d)) e WHERE e.published_at IS NULL ORDER BY e.stream, e.aggregate_key, e.revision),
held AS (UPDATE outbox.delivery d SET held_through = f.revision, held_by = '$h', leased_event_id = f.event_id, epoch = d.epoch + 1, lease_expires_at = now() + interval '30 s', attempt = 1 FROM found f WHERE d.stream = f.stream AND d.aggregate_key = f.aggregate_key AND d.state = 'idle' AND d.held_through IS NULL AND d.delivered_revision = f.revision - 1 RETURNING d.stream, d.aggregate_key, d.leased_event_id, d.epoch),
created AS (INSERT INTO outbox.delivery (stream, aggregate_key, state, delivered_revision, held_through, held_by, leased_event_id, epoch, lease_expires_at, attempt) SELECT f.stream, f.aggregate_key, 'idle', f.revision - 1, f.revision, '$h', f.event_id, 1, now() + interval '30 s', 1 FROM found f ON CONFLICT DO NOTHING RETURNING stream, aggregate_key, leased_event_id, epoch)
SELECT coalesce(array_agg(x.leased_event_id), '{}')::text AS ids, coalesce(array_agg(x.epoch), '{}')::text AS epochs, coalesce(array_agg(DISTINCT outbox.partition_of(x.stream, x.aggregate_key)), '{}')::text AS parts FROM (SELECT * FROM held UNION ALL SELECT * FROM created) x \gset
UPDATE outbox.discovery SET snapshot = pg_current_snapshot(), advanced_at = now();
COMMIT;
BEGIN;
SELECT set_config('outbox.acking', 'on', true) AS acking \gset
$ack
COMMIT;
SQL
fi
q() { psql -X -q -At "$1" -c "$2"; }
# Warm up: most aggregates have a delivery row (idle) from here on.
pgbench -n -M "$mode" -c 1 -t 700 -f "$work/cycle.sql" "$url" >/dev/null
# Statistics of the warmed-up tables for the plans made from here on (the
# measured pgbench run prepares its statements anew).
q "$url" "ANALYZE" >/dev/null
fence=${FENCE:-}
parts=${PARTITIONS:-64}
case $fence in
'') lock= ; current=true ;;
advisory) lock="SELECT count(pg_advisory_xact_lock_shared(4242, p)) AS locked FROM unnest(:parts::int[]) p \\gset" ;;
share) lock="SELECT count(*) AS locked FROM (SELECT 1 FROM bench_partition WHERE partition = ANY (:parts::int[]) FOR SHARE) l \\gset" ;;
*) echo "FENCE is advisory or share, not $fence" >&2; exit 2 ;;
esac
if [[ -n $fence ]]; then
	[[ -n ${FACTS:-} ]] || { echo "FENCE needs FACTS=1" >&2; exit 2; }
	q "$url" "CREATE TABLE bench_partition (partition int PRIMARY KEY, owner text NOT NULL, epoch bigint NOT NULL);
	          INSERT INTO bench_partition SELECT p, 'rep', 1 FROM generate_series(0, $parts - 1) p" >/dev/null
	current="(SELECT bool_and(epoch = 1) FROM bench_partition WHERE partition = ANY (:parts::int[]))"
fi
if [[ -n ${FACTS:-} ]]; then
	cat >"$work/cycle.sql" <<SQL
INSERT INTO outbox.event (stream, aggregate_key, event_type, payload) SELECT 's', (floor(random() * 10000))::int::text, 't', '{"a":1}' FROM generate_series(1, $batch);
BEGIN;
SELECT quote_literal(array_agg(e.event_id)) AS ids, quote_literal(array_agg(DISTINCT abs(hashtext(e.aggregate_key)) % $parts)) AS parts FROM outbox.events_since((SELECT d.snapshot FROM outbox.discovery d)) e WHERE e.published_at IS NULL \\gset
UPDATE outbox.discovery SET snapshot = pg_current_snapshot(), advanced_at = now();
COMMIT;
BEGIN;
SELECT set_config('outbox.acking', 'on', true) AS acking \\gset
$lock
WITH marked AS (UPDATE outbox.event e SET published_at = clock_timestamp() WHERE e.event_id = ANY (:ids::uuid[]) AND e.published_at IS NULL AND $current RETURNING e.stream, e.aggregate_key, e.revision)
UPDATE outbox.delivery d SET delivered_revision = m.revision FROM marked m WHERE d.stream = m.stream AND d.aggregate_key = m.aggregate_key;
COMMIT;
SQL
fi
stats=$(q "$url" "SELECT count(*) FROM pg_extension WHERE extname = 'pg_stat_statements'" 2>/dev/null || echo 0)
if [[ $stats == 0 ]] && q "$url" "CREATE EXTENSION pg_stat_statements" >/dev/null 2>&1; then stats=1; fi
pgbench -n -M "$mode" -c 1 ${RATE:+-R "$RATE"} -T $((window + 10)) -f "$work/cycle.sql" "$url" >/dev/null &
sleep 5
pid=$(q "$url" "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND application_name = 'pgbench'")
tick=$(getconf CLK_TCK)
[[ $stats == 1 ]] && q "$url" "SELECT pg_stat_statements_reset(0, (SELECT oid FROM pg_database WHERE datname = current_database()), 0)" >/dev/null
c0=$(awk '{print $14 + $15}' /proc/"$pid"/stat)
e0=$(q "$url" "SELECT count(*) FROM outbox.event WHERE published_at IS NOT NULL")
sleep "$window"
c1=$(awk '{print $14 + $15}' /proc/"$pid"/stat)
e1=$(q "$url" "SELECT count(*) FROM outbox.event WHERE published_at IS NOT NULL")
q "$url" "SELECT 'delivery updates: ' || n_tup_upd || ', of them HOT: ' || n_tup_hot_upd FROM pg_stat_user_tables WHERE relid = 'outbox.delivery'::regclass"
echo "events $((e1 - e0)), backend CPU per event $(((c1 - c0) * 1000000 / tick / (e1 - e0))) us"
if [[ $stats == 1 ]]; then
	echo "statement time per event (us, planning included; plans/calls; nested statements' time leaves out their executor start-up):"
	q "$url" "SELECT format('%8s  %6s/%-6s  %s', round(((total_exec_time + total_plan_time) * 1000 / $((e1 - e0)))::numeric, 1), plans, calls, left(regexp_replace(query, '\s+', ' ', 'g'), 100))
	          FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
	          ORDER BY total_exec_time DESC LIMIT ${TOP:-15}"
fi
wait
