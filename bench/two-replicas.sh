#!/usr/bin/env bash
# Steady delivery through two replicas of one database, which the
# benchmark's workloads (one replica each) do not cover: two `outboxd serve`,
# two `outboxd relay` on each with CREDIT credit (default 16, where relays
# fall into the claim mode under load; 256 is the product's default) and a
# stdout sink to /dev/null, and 8 pgbench producers calling outbox.emit at
# full speed for SECS seconds (default 10). Prints the producers' rate, what
# was published, and how the events reached the relays, summed over both
# replicas' /metrics: dispatched by discovery rounds, handed over by acks,
# or leased by claims (each a second write of the delivery row, and under a
# held xmin a walk past the dead entries earlier claims left).
#
# Usage: bench/two-replicas.sh [OUTBOXD_BINARY]
# Run from the repository root. Needs pgbench, psql and curl, a PostgreSQL
# that $ADMIN_URL may CREATE DATABASE on (default: the local one as
# postgres), and ports 7171-7172 and 7181-7182 free. Compare builds within
# one sitting, alternating (BENCHMARKS.md).
set -euo pipefail
bin=$(realpath "${1:-bin/outboxd}")
credit=${CREDIT:-16}
secs=${SECS:-10}
admin=${ADMIN_URL:-postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable}
db=outboxd_two_replicas_$$
url=${admin%%/postgres\?*}/$db?sslmode=disable
work=$(mktemp -d)
pids=()
cleanup() {
	for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
	wait 2>/dev/null || true
	psql -q "$admin" -c "DROP DATABASE IF EXISTS $db WITH (FORCE)"
	rm -rf "$work"
}
trap cleanup EXIT
psql -q "$admin" -c "CREATE DATABASE $db"
"$bin" migrate --database-url "$url" >/dev/null
payload='{"order_id":12345,"customer":"c-00042","amount":"199.90","currency":"EUR","items":[{"sku":"sku-1","qty":2},{"sku":"sku-2","qty":1}],"note":"benchmark payload xxxxxxxxxxxxxxxx"}'
printf '\\set a random(1, 10000)\nSELECT * FROM outbox.emit(%s, :a::text, %s, %s);\n' \
	"'bench'" "'created'" "'$payload'" >"$work/emit.sql"

# metric NAME: its value summed over both replicas.
metric() {
	local sum=0 v
	for i in 1 2; do
		v=$(curl -fsS "http://127.0.0.1:718$i/metrics" | awk -v m="$1" '$1 == m || index($1, m "{") == 1 {s += $2} END {print s + 0}')
		sum=$(awk "BEGIN {print $sum + $v}")
	done
	echo "$sum"
}
# await COND: polls COND (a command) for up to 30 seconds.
await() {
	for _ in $(seq 300); do
		if "$@"; then return 0; fi
		sleep 0.1
	done
	echo "two-replicas: timed out waiting for: $*" >&2
	exit 1
}
for i in 1 2; do
	"$bin" serve --database-url "$url" --listen "127.0.0.1:717$i" --http-listen "127.0.0.1:718$i" \
		--replica-id "r$i" >"$work/serve$i.log" 2>&1 &
	pids+=($!)
done
for i in 1 2; do await curl -fs -o /dev/null "http://127.0.0.1:718$i/readyz"; done
for i in 1 2; do
	for j in 1 2; do
		"$bin" relay --server "127.0.0.1:717$i" --sink stdout:// --max-in-flight "$credit" \
			--relay-id "relay$i$j" >/dev/null 2>"$work/relay$i$j.log" &
		pids+=($!)
	done
done
subscribed() { [[ $(metric outboxd_relay_sessions) == 4 ]]; }
await subscribed
pgbench -n -M prepared -c 8 -j 2 -T "$secs" -f "$work/emit.sql" "$url" 2>&1 |
	awk '/^tps/ {printf "producers: %.0f events/s\n", $3}'
all_published() { [[ $(psql -qAt "$url" -c "SELECT count(*) FROM outbox.event WHERE published_at IS NULL") == 0 ]]; }
await all_published
events=$(psql -qAt "$url" -c "SELECT count(*) FROM outbox.event")
d=$(metric outboxd_dispatched_total)
h=$(metric outboxd_hand_overs_total)
c=$(metric outboxd_claimed_total)
awk -v e="$events" -v d="$d" -v h="$h" -v c="$c" -v k="$credit" 'BEGIN {
	printf "published: %d events (relays of %d credit)\n", e, k
	printf "reached the relays by: dispatch %.1f %%, hand-over %.1f %%, claim %.1f %%\n", 100*d/e, 100*h/e, 100*c/e
}'
