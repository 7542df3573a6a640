#!/usr/bin/env bash
# What the insert trigger's SET enable_seqscan = off costs a producer:
# client.Emit's INSERT (through outbox.event_before_insert), 8 clients,
# synchronous_commit off, with the function's setting and without it
# (ALTER FUNCTION ... RESET), alternating on one database ROUNDS times.
#
# Usage: bench/pgbench/trigger-setting.sh [OUTBOXD_BINARY]
# Needs pgbench and psql, and a PostgreSQL that $ADMIN_URL may CREATE
# DATABASE on (default: the local one as postgres). BENCHMARKS.md quotes its
# figures; compare them within one run only.
set -euo pipefail
bin=${1:-bin/outboxd}
rounds=${ROUNDS:-3}
secs=${SECONDS_PER_RUN:-8}
. "$(dirname "${BASH_SOURCE[0]}")/scratch-db.sh"
scratch_db outboxd_trigger
payload='{"order_id":12345,"customer":"c-00042","amount":"199.90","currency":"EUR","items":[{"sku":"sku-1","qty":2},{"sku":"sku-2","qty":1}],"note":"benchmark payload xxxxxxxxxxxxxxxx"}'
printf '\\set a random(1, 10000)\nINSERT INTO outbox.event (stream, aggregate_key, event_type, payload) VALUES (%s, :a::text, %s, %s) RETURNING event_id, revision;\n' \
	"'bench'" "'created'" "'$payload'" >"$work/client-emit.sql"
tps() { PGOPTIONS='-c synchronous_commit=off' pgbench -n -M prepared -c 8 -j 2 -T "$secs" -f "$work/client-emit.sql" "$url" 2>&1 | awk '/^tps/ {printf "%.0f", $3}'; }
echo "client.Emit's INSERT, transactions/s (8 clients, synchronous_commit off):"
for ((r = 1; r <= rounds; r++)); do
	psql -q "$url" -c "ALTER FUNCTION outbox.event_before_insert() SET enable_seqscan = off"
	with=$(tps)
	psql -q "$url" -c "ALTER FUNCTION outbox.event_before_insert() RESET enable_seqscan"
	without=$(tps)
	echo "  round $r: with the setting $with, without $without ($(awk "BEGIN {printf \"%.3f\", $with/$without}")x)"
done
