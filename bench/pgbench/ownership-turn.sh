#!/usr/bin/env bash
# What one partition-ownership turn costs: outbox.own_partitions as a
# replica that owns all 256 partitions calls it every third of
# --partition-ttl, one client, SECS seconds: its wall time per call (with the
# synchronous commit it forces) and its backend's CPU per call (from /proc,
# over the middle of the run; the script must run on the database's host).
#
# Usage: bench/pgbench/ownership-turn.sh [OUTBOXD_BINARY]
# Needs pgbench and psql, and a PostgreSQL that $ADMIN_URL may CREATE
# DATABASE on (default: the local one as postgres). BENCHMARKS.md quotes its
# figures; compare them within one run only.
set -euo pipefail
bin=${1:-bin/outboxd}
secs=${SECS:-6}
. "$(dirname "${BASH_SOURCE[0]}")/scratch-db.sh"
scratch_db outboxd_ownership
echo "SELECT outbox.own_partitions('bench', '00000000-0000-0000-0000-000000000001', true, interval '15 seconds');" >"$work/turn.sql"
pgbench -n -M prepared -c 1 -T "$secs" -f "$work/turn.sql" "$url" >"$work/pgbench.out" 2>&1 &
pgb=$!
on_exit "kill $pgb 2>/dev/null"
sleep 1
pid=$(psql -X -Atq "$url" -c "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND application_name = 'pgbench'")
ticks() { awk '{print $14 + $15}' "/proc/$pid/stat"; }
calls() { psql -X -Atq "$url" -c "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"; }
t0=$(ticks) c0=$(calls)
sleep $((secs - 2))
t1=$(ticks) c1=$(calls)
wait "$pgb"
hz=$(getconf CLK_TCK)
awk -v t="$((t1 - t0))" -v c="$((c1 - c0))" -v hz="$hz" \
	'BEGIN {printf "backend CPU per call: %.0f us (%d calls measured)\n", t * 1e6 / hz / c, c}'
grep -E '^(latency average|tps)' "$work/pgbench.out"
