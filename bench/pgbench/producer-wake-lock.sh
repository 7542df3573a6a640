#!/usr/bin/env bash
# What the sleeping-discovery design (sleeping-discovery-prototype.patch;
# built since ef45f30, so give this script a binary from before it, such as
# one built at 4500904: on a later one both arms already take the lock)
# adds to every producer's insert while no replica sleeps: the
# trigger's common path taking pg_try_advisory_xact_lock_shared on the
# sleeper's key (which succeeds, and is held to the commit). 8 pgbench
# clients, synchronous_commit off (CPU-bound), inserting through the real
# trigger and through the same trigger with that lock added, alternating
# (real, lock, lock, real) ROUNDS times; inserts a second, each line one run.
#
# Usage: [ROUNDS=N] [SECONDS_PER_RUN=S] bench/pgbench/producer-wake-lock.sh [OUTBOXD_BINARY]
set -euo pipefail
bin=${1:-bin/outboxd}
rounds=${ROUNDS:-4}
secs=${SECONDS_PER_RUN:-6}
. "$(dirname "${BASH_SOURCE[0]}")/scratch-db.sh"
scratch_db outboxd_wakelock
psql -X -At "$url" -c "SELECT pg_get_functiondef('outbox.event_before_insert()'::regprocedure)" >"$work/real.sql"
common='AND NEW.xid = pg_current_xact_id() AND octet_length(NEW.payload::text) <= 1024 THEN'
grep -qF "$common" "$work/real.sql" || { echo "the trigger's common path is not where this script expects it" >&2; exit 1; }
! grep -q 'pg_try_advisory_xact_lock_shared' "$work/real.sql" || { echo "this trigger takes the lock already: use a binary from before ef45f30" >&2; exit 1; }
sed "s/${common//\*/\\*}/${common% THEN} AND pg_try_advisory_xact_lock_shared(7954802400917419383) THEN/" "$work/real.sql" >"$work/lock.sql"
grep -q 'pg_try_advisory_xact_lock_shared(7954802400917419383)' "$work/lock.sql" || { echo "the lock was not added" >&2; exit 1; }
echo "INSERT INTO outbox.event (stream, aggregate_key, event_type, payload) VALUES ('s', (floor(random() * 10000))::int::text, 't', '{\"a\":1}');" >"$work/insert.sql"
run() {
	psql -X -q "$url" -f "$work/$1.sql"
	PGOPTIONS="-c synchronous_commit=off" pgbench -n -M prepared -c 8 -j 2 -T "$secs" -f "$work/insert.sql" "$url" 2>/dev/null |
		awk -v n="$1" '/^tps/ {printf "%-5s %6d inserts/s\n", n, $3}'
}
run real >/dev/null # warm-up
for _ in $(seq "$rounds"); do run real; run lock; run lock; run real; done
