#!/usr/bin/env bash
# Per-statement costs that the benchmark's workloads only show mixed with
# everything else, measured with pgbench on a scratch database:
#
#   producer: a plain INSERT into a table of outbox.event's shape (the
#   ceiling), client.Emit's INSERT into outbox.event (through the insert
#   trigger) and outbox.emit, 8 clients, synchronous_commit off so that the
#   database is CPU-bound as in steady delivery, alternating ROUNDS times.
#
#   ack: outbox.ack of one event with hand-over to the same session, one
#   client, each ack its own transaction (a hot aggregate with one event in
#   flight, without gRPC).
#
# Usage: bench/pgbench/producer-and-ack.sh [OUTBOXD_BINARY]
# Needs pgbench and psql, and a PostgreSQL that $ADMIN_URL may CREATE
# DATABASE on (default: the local one as postgres). BENCHMARKS.md quotes its
# figures; compare them within one run only.
set -euo pipefail
bin=${1:-bin/outboxd}
rounds=${ROUNDS:-2}
secs=${SECONDS_PER_RUN:-6}
. "$(dirname "${BASH_SOURCE[0]}")/scratch-db.sh"

# Two databases: the producers' events would otherwise be claimable work
# that the hand-over must not jump ahead of.
scratch_db outboxd_pgbench_ack
ackurl=$url
scratch_db outboxd_pgbench
psql -q "$url" <<'SQL'
CREATE SCHEMA scratch;
CREATE TABLE scratch.ceiling (
    event_id uuid PRIMARY KEY DEFAULT gen_random_uuid(), stream text NOT NULL,
    aggregate_key text NOT NULL, revision bigserial, event_type text NOT NULL,
    payload jsonb NOT NULL, headers jsonb NOT NULL DEFAULT '{}',
    created_at timestamptz NOT NULL DEFAULT now(), published_at timestamptz,
    UNIQUE (stream, aggregate_key, revision));
CREATE INDEX ON scratch.ceiling (created_at) WHERE published_at IS NULL;
SQL

payload='{"order_id":12345,"customer":"c-00042","amount":"199.90","currency":"EUR","items":[{"sku":"sku-1","qty":2},{"sku":"sku-2","qty":1}],"note":"benchmark payload xxxxxxxxxxxxxxxx"}'
printf '\\set a random(1, 10000)\nINSERT INTO scratch.ceiling (stream, aggregate_key, event_type, payload) VALUES (%s, :a::text, %s, %s);\n' \
	"'bench'" "'created'" "'$payload'" >"$work/ceiling.sql"
printf '\\set a random(1, 10000)\nINSERT INTO outbox.event (stream, aggregate_key, event_type, payload) VALUES (%s, :a::text, %s, %s) RETURNING event_id, revision;\n' \
	"'bench'" "'created'" "'$payload'" >"$work/client-emit.sql"
printf '\\set a random(1, 10000)\nSELECT * FROM outbox.emit(%s, :a::text, %s, %s);\n' \
	"'bench'" "'created'" "'$payload'" >"$work/outbox-emit.sql"

tps() { PGOPTIONS='-c synchronous_commit=off' pgbench -n -M prepared -c 8 -j 2 -T "$secs" -f "$1" "$url" 2>&1 | awk '/^tps/ {printf "%.0f", $3}'; }
echo "producer, transactions/s (8 clients, synchronous_commit off):"
for ((r = 1; r <= rounds; r++)); do
	c=$(tps "$work/ceiling.sql"); e=$(tps "$work/client-emit.sql"); o=$(tps "$work/outbox-emit.sql")
	echo "  round $r: plain INSERT $c, client.Emit's INSERT $e ($(awk "BEGIN {printf \"%.2f\", $e/$c}")x), outbox.emit $o ($(awk "BEGIN {printf \"%.2f\", $o/$c}")x)"
done

holder=00000000-0000-0000-0000-0000000000aa
psql -q "$ackurl" >/dev/null <<SQL
INSERT INTO outbox.event (stream, aggregate_key, event_type, payload)
SELECT 'hot', 'h', 'T', '{"a":1}' FROM generate_series(1, 30000);
SELECT * FROM outbox.discover();
SELECT count(*) FROM outbox.claim('$holder', 'r', 'rep', ARRAY['hot'], 1, interval '30 seconds');
SQL
cat >"$work/ack.sql" <<SQL
SELECT leased_event_id AS v FROM outbox.delivery WHERE stream = 'hot' AND aggregate_key = 'h' \gset
SELECT count(*) FROM outbox.ack(ARRAY[:v::uuid], 'rep', ARRAY['$holder'::uuid], ARRAY[interval '30 seconds']);
SQL
printf "SELECT leased_event_id AS v FROM outbox.delivery WHERE stream = 'hot' AND aggregate_key = 'h' \\\\gset\n" >"$work/lookup.sql"
lat() { pgbench -n -M prepared -c 1 -t 3000 -f "$1" "$ackurl" 2>&1 | awk '/latency average/ {print $4}'; }
echo "ack of one event with hand-over, ms per call (one client; the lookup of the leased event alone in brackets):"
for ((r = 1; r <= rounds; r++)); do
	echo "  round $r: $(lat "$work/ack.sql") ($(lat "$work/lookup.sql"))"
done
