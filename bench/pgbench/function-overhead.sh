#!/usr/bin/env bash
# What a delivery function's fixed parts cost a call, one pgbench client
# back to back (prepared protocol), in backend CPU per call (read from
# /proc, so PostgreSQL must run on this machine): a PL/pgSQL function that
# returns 1 with no SET clause, with one and with the three the delivery
# functions carry, and outbox.discover_scan with nothing to find, with its
# SET clauses and without them (a copy). BENCHMARKS.md ("A light source's
# event, piece by piece") quotes it: the SET clauses are not where a
# one-event round's time goes.
#
# Usage: [ROUNDS=N] [SECONDS_PER_RUN=S] bench/pgbench/function-overhead.sh [OUTBOXD_BINARY]
set -euo pipefail
bin=${1:-bin/outboxd}
rounds=${ROUNDS:-2}
secs=${SECONDS_PER_RUN:-10}
. "$(dirname "${BASH_SOURCE[0]}")/scratch-db.sh"
scratch_db outboxd_fnoverhead
psql -X -q "$url" <<'SQL'
CREATE FUNCTION public.f_noset() RETURNS int LANGUAGE plpgsql AS $$ BEGIN RETURN 1; END $$;
CREATE FUNCTION public.f_set1() RETURNS int LANGUAGE plpgsql SET jit = off AS $$ BEGIN RETURN 1; END $$;
CREATE FUNCTION public.f_set3() RETURNS int LANGUAGE plpgsql
    SET enable_seqscan = off SET jit = off SET plan_cache_mode = force_generic_plan AS $$ BEGIN RETURN 1; END $$;
SQL
psql -X -At "$url" -c "SELECT pg_get_functiondef('outbox.discover_scan(integer,integer)'::regprocedure)" |
	sed 's/FUNCTION outbox.discover_scan(/FUNCTION outbox.discover_scan_noset(/; /^ SET /d' | psql -X -q "$url"
tick=$(getconf CLK_TCK)
run() { # NAME STATEMENT
	echo "$2" >"$work/q.sql"
	pgbench -n -M prepared -c 1 -T $((secs + 2)) -f "$work/q.sql" "$url" >"$work/pgbench.log" 2>&1 &
	local pgb=$! pid=
	for _ in $(seq 50); do
		pid=$(psql -X -At "$admin" -c "SELECT pid FROM pg_stat_activity WHERE datname = '$db' AND application_name = 'pgbench'")
		[[ -n $pid ]] && break
		sleep 0.1
	done
	local c0 c1 n
	c0=$(awk '{print $14 + $15}' /proc/"$pid"/stat)
	sleep "$secs"
	c1=$(awk '{print $14 + $15}' /proc/"$pid"/stat)
	wait "$pgb"
	# Calls in the window, from the whole run's count scaled to it.
	n=$(awk '/number of transactions actually processed/ {split($NF, a, "/"); print a[1]}' "$work/pgbench.log")
	n=$((n * secs / (secs + 2)))
	printf '%-12s %8d calls  %6.1f us backend CPU a call\n' "$1" "$n" "$(echo "($c1 - $c0) * 1000000 / $tick / $n" | bc -l)"
}
for _ in $(seq "$rounds"); do
	run noset "SELECT public.f_noset();"
	run set1 "SELECT public.f_set1();"
	run set3 "SELECT public.f_set3();"
	run scan "SELECT * FROM outbox.discover_scan();"
	run scan_noset "SELECT * FROM outbox.discover_scan_noset();"
done
