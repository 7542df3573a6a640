#!/usr/bin/env bash
# What keeping a lease in columns no index reads would save: the two writes
# a steady event makes to its outbox.delivery row (the lease, then the
# return to idle at the ack) as today (state, claimable_at, holder, expiry,
# pending_since: every index moves) and as HOT updates (an extra unindexed
# held_through column set, then cleared with the cursor moved). 10,000 idle
# aggregates, fillfactor 70, the table's triggers off; each transaction
# leases and returns 30 aggregates (60 row writes); 2 clients,
# synchronous_commit off, alternating ROUNDS times.
#
# Usage: bench/pgbench/hot-lease.sh [OUTBOXD_BINARY]
# Needs pgbench and psql, and a PostgreSQL that $ADMIN_URL may CREATE
# DATABASE on (default: the local one as postgres). BENCHMARKS.md quotes its
# figures; compare them within one run only.
set -euo pipefail
bin=${1:-bin/outboxd}
rounds=${ROUNDS:-3}
secs=${SECS:-8}
. "$(dirname "${BASH_SOURCE[0]}")/scratch-db.sh"
scratch_db outboxd_hot_lease
psql -X -q "$url" <<'SQL'
ALTER TABLE outbox.delivery ADD COLUMN held_through bigint;
ALTER TABLE outbox.delivery SET (fillfactor = 70);
ALTER TABLE outbox.delivery DISABLE TRIGGER USER;
INSERT INTO outbox.delivery (stream, aggregate_key, state, delivered_revision)
SELECT 'orders', 'o-' || i, 'idle', 0 FROM generate_series(0, 9999) i;
VACUUM FULL ANALYZE outbox.delivery;
SQL
keys="stream = 'orders' AND aggregate_key IN (SELECT 'o-' || i FROM generate_series(:k, :k + 29) i)"
cat >"$work/today.sql" <<SQL
\\set k random(0, 9970)
BEGIN;
UPDATE outbox.delivery SET state = 'leased', claimable_at = now() + interval '30 s', holder = gen_random_uuid(),
    holder_relay_id = 'r', holder_replica_id = 'x', leased_event_id = gen_random_uuid(),
    leased_through = delivered_revision + 1, lease_expires_at = now() + interval '30 s', pending_since = now(),
    epoch = epoch + 1 WHERE $keys;
UPDATE outbox.delivery SET state = 'idle', claimable_at = NULL, holder = NULL, holder_relay_id = NULL,
    holder_replica_id = NULL, pending_since = NULL, delivered_revision = delivered_revision + 1 WHERE $keys;
COMMIT;
SQL
cat >"$work/hot.sql" <<SQL
\\set k random(0, 9970)
BEGIN;
UPDATE outbox.delivery SET held_through = delivered_revision + 1 WHERE $keys;
UPDATE outbox.delivery SET held_through = NULL, delivered_revision = delivered_revision + 1 WHERE $keys;
COMMIT;
SQL
tps() { PGOPTIONS='-c synchronous_commit=off' pgbench -n -M prepared -c 2 -T "$secs" -f "$work/$1.sql" "$url" 2>&1 | awk '/^tps/ {printf "%.0f", $3}'; }
echo "transactions/s, 30 aggregates leased and returned each (2 clients, synchronous_commit off):"
for ((r = 1; r <= rounds; r++)); do
	today=$(tps today)
	hot=$(tps hot)
	echo "  round $r: today's writes $today, HOT writes $hot ($(awk "BEGIN {printf \"%.2f\", $hot/$today}")x)"
done
psql -X -Atq "$url" -c "SELECT 'delivery updates: ' || n_tup_upd || ', of them HOT: ' || n_tup_hot_upd FROM pg_stat_user_tables WHERE relid = 'outbox.delivery'::regclass"
