#!/usr/bin/env bash
# How a held-xmin run's events reached their relays: runs
# `outboxd-bench --workload held-xmin --arms outboxd` (a steady arm, then the
# other-db and same-db RR holds) with pg_stat_statements reset first, and
# prints, per arm database in the order the arms ran, the share of events
# leased by claims rather than dispatched by discovery or handed over by
# acks, the claim statements run per 1,000 events (empty ones included),
# and the buffers that claims and ack batches read per event. Under a
# hold, a claim reads past every dead entry the claims before it left at
# the front of the ready range, so a large share claimed is what makes a
# held arm cost far more per event (BENCHMARKS.md, "Held xmin on this
# machine").
#
# Usage: bench/held-xmin-claims.sh [OUTBOXD_BINARY] [outboxd-bench flags...]
#   e.g. bench/held-xmin-claims.sh bin/outboxd --max-in-flight 64 (the
#   relays' credit before it became 256, which brings on the claim mode)
# Run from the repository root. Needs psql, and pg_stat_statements in the
# server's shared_preload_libraries with the extension created in the
# database $ADMIN_URL names (default: the local one as postgres), which
# must be the one outboxd-bench connects to. $BENCH is a built
# outboxd-bench (default: go run from bench/). Nothing else may use the
# server's statistics meanwhile: they are reset.
set -euo pipefail
bin=$(realpath "${1:-bin/outboxd}")
shift || true
admin=${ADMIN_URL:-postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable}
if ! psql -qAt "$admin" -c "SELECT pg_stat_statements_reset()" >/dev/null; then
	echo "held-xmin-claims: pg_stat_statements is not usable in $admin (load it in shared_preload_libraries, CREATE EXTENSION pg_stat_statements)" >&2
	exit 2
fi
run=(go run ./cmd/outboxd-bench)
[[ -n ${BENCH:-} ]] && run=("$(realpath "$BENCH")")
(cd bench && "${run[@]}" --workload held-xmin --arms outboxd --sink-latency 0 --duration 8s \
	--database-url "$admin" --server-binary "$bin" "$@") |
	grep -E '^ +outboxd( \((other-db|same-db-rr)\))? +0s' || true
# The producers' INSERT counts each arm's events; the claim's statement
# returns one row per lease; the ack's statement is the batch call.
psql -q "$admin" <<'SQL'
WITH ins AS (
    SELECT dbid, sum(calls) AS events FROM pg_stat_statements
    WHERE query LIKE 'INSERT INTO outbox.event (stream%' GROUP BY dbid
), claims AS (
    SELECT dbid, sum(rows) AS leases, sum(calls) AS calls, sum(shared_blks_hit) AS hits FROM pg_stat_statements
    WHERE toplevel AND query LIKE 'SELECT event_id, stream, aggregate_key, revision, event_type, payload%'
    GROUP BY dbid
), acks AS (
    SELECT dbid, sum(shared_blks_hit) AS hits FROM pg_stat_statements
    WHERE toplevel AND query LIKE 'SELECT a.event_id, a.status%' GROUP BY dbid
)
SELECT row_number() OVER (ORDER BY i.dbid) AS arm, i.events,
       round(100.0 * coalesce(c.leases, 0) / i.events, 1) AS "% claimed",
       round(1000.0 * coalesce(c.calls, 0) / i.events, 1) AS "claims/1k events",
       round(coalesce(c.hits, 0)::numeric / i.events, 1) AS "claim buffers/event",
       round(coalesce(a.hits, 0)::numeric / i.events, 1) AS "ack buffers/event"
FROM ins i LEFT JOIN claims c USING (dbid) LEFT JOIN acks a USING (dbid)
ORDER BY i.dbid;
SQL
