#!/usr/bin/env bash
# What one lightly loaded source costs per event, with the real binaries:
# outboxd serve on a scratch database, one outboxd relay publishing to
# stdout:// (discarded), and pgbench calling outbox.emit at RATE events/s
# (default 20, the light sources of the benchmark's sources workload) over
# 100 aggregates. After a warm-up it prints, over a WINDOW-second window
# (default 20): events delivered, the server process's CPU per event (read
# from /proc, so everything must run on this machine), and per event the
# top-level statements' calls and time on that database
# (pg_stat_statements, when the server has it loaded; statement time is
# wall time, so on a busy host it includes waiting for a core). STRACE=1
# also counts the server's system calls over the first 10 s of the window
# (strace -c; it slows the process, so its CPU figure is then not the
# one to quote).
#
# SERVE_ENV and SERVE_FLAGS are put before and after the serve command
# (SERVE_ENV='env GOMAXPROCS=1', SERVE_FLAGS='--max-db-conns 1').
#
# Usage: [RATE=N] [WINDOW=S] [STRACE=1] bench/pgbench/light-source.sh [OUTBOXD_BINARY]
set -euo pipefail
bin=${1:-bin/outboxd}
rate=${RATE:-20}
window=${WINDOW:-20}
. "$(dirname "${BASH_SOURCE[0]}")/scratch-db.sh"
scratch_db outboxd_light
grpc=127.0.0.1:7390
# shellcheck disable=SC2086 # SERVE_ENV and SERVE_FLAGS are word lists
${SERVE_ENV:-} "$bin" serve --database-url "$url" --listen "$grpc" --http-listen 127.0.0.1:7391 ${SERVE_FLAGS:-} >"$work/serve.log" 2>&1 &
serve=$!
on_exit "kill $serve; wait $serve"
for _ in $(seq 50); do
	(exec 3<>"/dev/tcp/${grpc%:*}/${grpc#*:}") 2>/dev/null && break
	sleep 0.2
done
"$bin" relay --server "$grpc" --sink stdout:// >/dev/null 2>"$work/relay.log" &
relay=$!
on_exit "kill $relay"
echo "SELECT outbox.emit('s', (floor(random() * 100))::int::text, 't', '{\"a\":1}'::jsonb);" >"$work/emit.sql"
pgbench -n -M prepared -c 1 -R "$rate" -T $((window + 15)) -f "$work/emit.sql" "$url" >"$work/pgbench.log" 2>&1 &
producer=$!
on_exit "kill $producer"
sleep 8
q() { psql -X -q -At -F ' | ' "$1" -c "$2"; }
oid=$(q "$admin" "SELECT oid FROM pg_database WHERE datname = '$db'")
stats=$(q "$admin" "SELECT count(*) FROM pg_extension WHERE extname = 'pg_stat_statements'" 2>/dev/null || echo 0)
[[ $stats == 1 ]] && q "$admin" "SELECT pg_stat_statements_reset(0, $oid, 0)" >/dev/null
tracer=
if [[ -n ${STRACE:-} ]]; then
	timeout 10 strace -c -f -p "$serve" -o "$work/strace.out" 2>/dev/null &
	tracer=$!
fi
published() { q "$url" "SELECT count(*) FROM outbox.event WHERE published_at IS NOT NULL"; }
cpu() { awk '{print $14 + $15}' /proc/"$serve"/stat; }
c0=$(cpu)
e0=$(published)
sleep "$window"
c1=$(cpu)
e1=$(published)
n=$((e1 - e0))
tick=$(getconf CLK_TCK)
echo "events $n in ${window}s at ${rate}/s; server CPU per event $(((c1 - c0) * 1000000 / tick / n)) us"
if [[ $stats == 1 ]]; then
	echo "top-level statements: calls per event, time per event (us), time per call (us):"
	q "$admin" "SELECT format('%6s %8s %8s  %s', round(calls::numeric / $n, 2), round((total_exec_time * 1000 / $n)::numeric), round((total_exec_time * 1000 / nullif(calls, 0))::numeric), left(regexp_replace(query, '\s+', ' ', 'g'), 90))
	            FROM pg_stat_statements WHERE dbid = $oid AND toplevel ORDER BY total_exec_time DESC LIMIT ${TOP:-8}"
fi
if [[ -n ${STRACE:-} ]]; then
	wait "$tracer" || true
	echo "server system calls over 10 s (about $((n * 10 / window)) events):"
	head -n 12 "$work/strace.out"
fi
