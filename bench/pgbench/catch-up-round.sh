#!/usr/bin/env bash
# How long discovery takes to catch up on a backlog of aggregates it has
# delivered before, as after an outage of every replica: N aggregates get one
# event each, which a replica and a relay (stdout sink) deliver; then, with no
# replica running, one transaction adds one more event to each, and a replica
# starts. It prints how long the first discovery round (which finds all N
# events at once) took, from the replica's start to the stored snapshot
# moving. The round's statement once joined two of its own intermediate
# results by a nested loop: 1.3 s at N = 4,000, 4.5 s at 8,000, minutes at
# 100,000.
#
# Usage: [N=8000] bench/pgbench/catch-up-round.sh [OUTBOXD_BINARY]
# Needs PostgreSQL on 127.0.0.1:5432 (psql, trust auth) and free ports 7443
# and 7444. Compare builds back to back; BENCHMARKS.md quotes its figures.
set -euo pipefail
bin=${1:-bin/outboxd}
n=${N:-8000}
. "$(dirname "${BASH_SOURCE[0]}")/scratch-db.sh"
psql() { command psql -X -q -At "$@"; }
serve() { "$bin" serve --listen 127.0.0.1:7443 --http-listen= --log-level warn --database-url "$url" & }
pids=()
on_exit 'for p in "${pids[@]}"; do kill "$p" 2>/dev/null; done; wait 2>/dev/null'
scratch_db outboxd_catchup
emit="SELECT count(outbox.emit('s', 'k' || g, 'e', '{}'::jsonb)) FROM generate_series(1, $n) g"
psql "$url" -c "$emit" >/dev/null

# Deliver the first events, so that every aggregate has an idle delivery row.
serve
pids+=($!)
sleep 1
"$bin" relay --server 127.0.0.1:7443 --sink stdout:// --max-in-flight 512 --log-level warn >/dev/null &
pids+=($!)
until [ "$(psql "$url" -c "SELECT count(*) FROM outbox.event WHERE published_at IS NULL")" = 0 ]; do sleep 0.2; done
kill "${pids[@]}"
wait 2>/dev/null || true
pids=()

# The backlog, in one transaction, then one replica.
psql "$url" -c "$emit" >/dev/null
before=$(psql "$url" -c "SELECT snapshot FROM outbox.discovery")
start=$(date +%s%N)
serve
pids+=($!)
until [ "$(psql "$url" -c "SELECT snapshot FROM outbox.discovery")" != "$before" ]; do sleep 0.02; done
echo "N=$n: the first round over aggregates delivered before took $((($(date +%s%N) - start) / 1000000)) ms (replica start included)"
