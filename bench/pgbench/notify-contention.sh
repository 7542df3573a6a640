#!/usr/bin/env bash
# What a sleeping replica's wake-ups cost producers when many of them commit
# at once: while a replica's discovery sleeps, every producer's commit sends
# NOTIFY outbox_discover, and PostgreSQL serialises NOTIFYing commits across
# the whole cluster (a lock held from before the commit record until the
# transaction ends, its WAL flush included). Here the benchmark's quiet
# sources (19 at 20 events/s, all on one cluster) become C pgbench clients
# (default 19) on one scratch database calling outbox.emit at R events/s in
# all (default 380), synchronous commits: "plain" with nobody sleeping,
# "notify" with a session holding the sleeper's lock (what a sleeping
# replica holds), so that every insert notifies. Alternating (plain,
# notify, notify, plain) ROUNDS times, T seconds each; pgbench's transaction
# latency and schedule lag per run.
#
# Usage: [C=N] [R=N] [T=S] [ROUNDS=N] bench/pgbench/notify-contention.sh [OUTBOXD_BINARY]
set -euo pipefail
bin=${1:-bin/outboxd}
clients=${C:-19}
rate=${R:-380}
secs=${T:-10}
rounds=${ROUNDS:-2}
. "$(dirname "${BASH_SOURCE[0]}")/scratch-db.sh"
scratch_db outboxd_notify
echo "SELECT outbox.emit('s', (floor(random() * 1000))::int::text, 't', '{\"a\":1}'::jsonb);" >"$work/emit.sql"
run() {
	local holder=
	if [[ $1 == notify ]]; then
		psql -X -q "$url" -c "SELECT pg_advisory_lock(7954802400917419383)" -c "SELECT pg_sleep($((secs + 5)))" >/dev/null &
		holder=$!
		until [[ $(psql -X -At "$url" -c "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted AND objid = 622556535") == 1 ]]; do sleep 0.1; done
	fi
	pgbench -n -M prepared -c "$clients" -j 2 -R "$rate" -T "$secs" -f "$work/emit.sql" "$url" 2>/dev/null |
		awk -v n="$1" '/^latency average/ {a = $4} /^latency stddev/ {s = $4} /schedule lag/ {l = $6; m = $8; sub(/\)/, "", m)} /^tps/ {t = $3}
			END {printf "%-6s %6.1f commits/s  latency avg %6.2f ms (stddev %6.2f)  schedule lag avg %s max %s ms\n", n, t, a, s, l, m}'
	if [[ -n $holder ]]; then
		kill "$holder" 2>/dev/null || true
		wait "$holder" 2>/dev/null || true
	fi
}
run plain >/dev/null # warm-up
for _ in $(seq "$rounds"); do run plain; run notify; run notify; run plain; done
