#!/usr/bin/env bash
# The delivery statements of steady load, without gRPC or Go: one pgbench
# client runs, per transaction, what a replica's steady delivery asks of
# PostgreSQL for 16 events: the producers' inserts (16 events over 10,000
# aggregates), one discovery round that dispatches every idle aggregate it
# found to one session (discover_scan, then discover_apply, in one
# transaction), and one batch ack of the leases it got (outbox.ack with the
# session as hand-over holder and its stream filter). It prints the CPU
# time of that client's backend per event delivered over a WINDOW-second
# window (read from /proc, so PostgreSQL must run on this machine), and,
# when the server has pg_stat_statements loaded, the statements' time per
# event.
#
# Usage: bench/pgbench/delivery-cycle.sh [OUTBOXD_BINARY]
# Compare builds back to back, alternating, on one server; BENCHMARKS.md
# quotes its figures.
set -euo pipefail
bin=${1:-bin/outboxd}
admin=${ADMIN_URL:-postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable}
window=${WINDOW:-30}
db=outboxd_cycle_$$
url=${admin%%/postgres\?*}/$db?sslmode=disable
work=$(mktemp -d)
trap 'psql -q "$admin" -c "DROP DATABASE IF EXISTS $db WITH (FORCE)"; rm -rf "$work"' EXIT

psql -q "$admin" -c "CREATE DATABASE $db"
"$bin" migrate --database-url "$url" >/dev/null
h=00000000-0000-0000-0000-0000000000aa
cat >"$work/cycle.sql" <<SQL
INSERT INTO outbox.event (stream, aggregate_key, event_type, payload) SELECT 's', (floor(random() * 10000))::int::text, 't', '{"a":1}' FROM generate_series(1, 16);
BEGIN;
SELECT quote_literal(min(prev_snapshot)) AS prev, quote_literal(min(snapshot)) AS snap, quote_literal(array_agg(stream) FILTER (WHERE idle)) AS ss, quote_literal(array_agg(aggregate_key) FILTER (WHERE idle)) AS ks, count(*) FILTER (WHERE idle) AS n FROM outbox.discover_scan() \gset
SELECT count(*) AS dispatched FROM outbox.discover_apply(:prev, :snap, :ss::text[], :ks::text[], array_fill('$h'::uuid, ARRAY[:n]), array_fill('r'::text, ARRAY[:n]), array_fill('30s'::interval, ARRAY[:n]), 'rep') \gset
COMMIT;
SELECT quote_literal(array_agg(leased_event_id)) AS ids FROM outbox.delivery WHERE holder = '$h' \gset
SELECT count(*) AS acked FROM outbox.ack(:ids::uuid[], 'rep', ARRAY['$h'::uuid], ARRAY['30s'::interval], ARRAY[1], ARRAY[0], ARRAY['$h'::uuid], ARRAY[NULL::text], ARRAY[false], '60s') \gset
SQL
q() { psql -X -q -At "$1" -c "$2"; }
# Warm up: most aggregates have a delivery row (idle) from here on.
pgbench -n -c 1 -t 700 -f "$work/cycle.sql" "$url" >/dev/null
stats=$(q "$url" "SELECT count(*) FROM pg_extension WHERE extname = 'pg_stat_statements'" 2>/dev/null || echo 0)
if [[ $stats == 0 ]] && q "$url" "CREATE EXTENSION pg_stat_statements" >/dev/null 2>&1; then stats=1; fi
pgbench -n -c 1 -T $((window + 10)) -f "$work/cycle.sql" "$url" >/dev/null &
sleep 5
pid=$(q "$url" "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND application_name = 'pgbench'")
tick=$(getconf CLK_TCK)
[[ $stats == 1 ]] && q "$url" "SELECT pg_stat_statements_reset(0, (SELECT oid FROM pg_database WHERE datname = current_database()), 0)" >/dev/null
c0=$(awk '{print $14 + $15}' /proc/"$pid"/stat)
e0=$(q "$url" "SELECT coalesce(sum(events), 0) FROM outbox.delivered_count")
sleep "$window"
c1=$(awk '{print $14 + $15}' /proc/"$pid"/stat)
e1=$(q "$url" "SELECT coalesce(sum(events), 0) FROM outbox.delivered_count")
echo "events $((e1 - e0)), backend CPU per event $(((c1 - c0) * 1000000 / tick / (e1 - e0))) us"
if [[ $stats == 1 ]]; then
	echo "statement time per event (us; nested statements' time leaves out their executor start-up):"
	q "$url" "SELECT format('%8s  %s', round((total_exec_time * 1000 / $((e1 - e0)))::numeric, 1), left(regexp_replace(query, '\s+', ' ', 'g'), 100))
	          FROM pg_stat_statements WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
	          ORDER BY total_exec_time DESC LIMIT 15"
fi
wait
