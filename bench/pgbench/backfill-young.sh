#!/usr/bin/env bash
# A backfill into a young database, through the insert trigger: 50 events,
# the ANALYZE autovacuum would make of them (done here, with autovacuum off
# for the two tables so that it makes no other), then N events of N new
# aggregates in one INSERT. The trigger's statements settle on a plan made
# for the tables the statistics describe (50 rows), and no ANALYZE can see
# the backfill's rows before it commits: a plan that scans outbox.aggregate
# makes the insert quadratic in N. Prints the INSERT's time.
#
# Usage: bench/pgbench/backfill-young.sh [OUTBOXD_BINARY] [N]
# Needs psql and a PostgreSQL that $ADMIN_URL may CREATE DATABASE on
# (default: the local one as postgres). BENCHMARKS.md quotes its figures.
set -euo pipefail
bin=${1:-bin/outboxd}
n=${2:-20000}
. "$(dirname "${BASH_SOURCE[0]}")/scratch-db.sh"
scratch_db outboxd_backfill
psql -q "$url" \
	-c "ALTER TABLE outbox.aggregate SET (autovacuum_enabled = false)" \
	-c "ALTER TABLE outbox.event SET (autovacuum_enabled = false)" \
	-c "INSERT INTO outbox.event (stream, aggregate_key, event_type, payload)
	    SELECT 'orders', 'young-' || g, 'created', '{}' FROM generate_series(1, 50) g" \
	-c "ANALYZE outbox.aggregate, outbox.event"
psql -q "$url" -At -c '\timing on' \
	-c "INSERT INTO outbox.event (stream, aggregate_key, event_type, payload)
	    SELECT 'orders', 'backfill-' || g, 'created', '{}' FROM generate_series(1, $n) g" | grep '^Time'
