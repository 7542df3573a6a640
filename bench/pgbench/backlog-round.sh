#!/usr/bin/env bash
# What a backlog of many aggregates costs the replica that discovers it, as
# for a database restored or migrated in with its outbox full, or replicas
# back from an outage: N pending events, each of its own aggregate,
# committed in TXNS transactions (default 1) before any replica runs; then a
# replica starts (no relay). It prints how long discovery took to make the
# first of them claimable and all of them (from the replica's start, sampled
# every half second), and the replica's peak RSS meanwhile (/proc, so the
# replica runs on this machine).
#
# Usage: [N=1000000] [TXNS=1] [SERVE_FLAGS=...] bench/pgbench/backlog-round.sh [OUTBOXD_BINARY]
# (SERVE_FLAGS, say --discovery-max-events=100000, go to outboxd serve.)
# Needs PostgreSQL on 127.0.0.1:5432 (psql, trust auth) and free ports 7445
# and 7446. Compare builds back to back; BENCHMARKS.md quotes its figures.
set -euo pipefail
bin=${1:-bin/outboxd}
n=${N:-1000000}
txns=${TXNS:-1}
. "$(dirname "${BASH_SOURCE[0]}")/scratch-db.sh"
psql() { command psql -X -q -At "$@"; }
pid=
on_exit '[ -n "$pid" ] && kill "$pid" 2>/dev/null; wait 2>/dev/null'
scratch_db outboxd_backlog
psql "$url" -c "DO \$\$ BEGIN FOR t IN 0..$txns - 1 LOOP
	INSERT INTO outbox.event (stream, aggregate_key, event_type, payload)
	SELECT 'backlog', 'k' || g, 't', '{\"a\":1}' FROM generate_series(t * $n / $txns + 1, (t + 1) * $n / $txns) g;
	COMMIT; END LOOP; END \$\$"
"$bin" serve --listen 127.0.0.1:7445 --http-listen=127.0.0.1:7446 --log-level warn --database-url "$url" ${SERVE_FLAGS:-} &
pid=$!
start=$(date +%s.%N)
peak=0
first=
while :; do
	rss=$(awk '/^VmRSS/ {print $2}' "/proc/$pid/status" 2>/dev/null || echo 0)
	((rss > peak)) && peak=$rss
	ready=$(psql "$url" -c "SELECT count(*) FROM outbox.delivery" 2>/dev/null || echo 0)
	elapsed=$(echo "$(date +%s.%N) - $start" | bc)
	if [ -z "$first" ] && ((ready > 0)); then
		first=${elapsed%??????}
	fi
	if ((ready >= n)); then
		echo "N=$n in $txns transaction(s): first aggregates claimable after $first s, all after ${elapsed%??????} s; replica peak RSS $((peak / 1024)) MiB"
		break
	fi
	if (($(echo "$elapsed > 600" | bc))); then
		echo "N=$n: $ready of $n aggregates claimable after 600 s; replica peak RSS $((peak / 1024)) MiB" >&2
		exit 1
	fi
	sleep 0.5
done
