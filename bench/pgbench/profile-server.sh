#!/usr/bin/env bash
# A CPU profile of the server child of one outboxd-bench run: runs the
# benchmark with a wrapper as its --server-binary that starts `outboxd
# serve` with --pprof on PORT (the benchmark otherwise turns the HTTP port
# off), waits until the server answers and DELAY seconds more (past the
# arm's warm-up, or its backlog fill), and fetches PROFILE_SECONDS of profile into
# OUT. The benchmark's own report goes to OUT.txt. Then, for example:
# go tool pprof -top BINARY OUT. Read it with the run's events/s: the
# profile's samples over the events of its window are the server's CPU per
# event under the profiler.
#
# Usage: [PORT=9911] [DELAY=4] [PROFILE_SECONDS=6] bench/pgbench/profile-server.sh OUTBOXD_BINARY OUT -- OUTBOXD_BENCH_ARGS...
# e.g.   bench/pgbench/profile-server.sh bin/outboxd /tmp/steady.pprof -- --workload steady --arms outboxd --sink-latency 0 --duration 10s
# (run from the bench/ module, or give its outboxd-bench as $OUTBOXD_BENCH).
set -euo pipefail
bin=$(realpath "$1")
out=$2
shift 2
[[ ${1:-} == -- ]] && shift
port=${PORT:-9911}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cat >"$work/outboxd" <<WRAP
#!/usr/bin/env bash
if [[ \$1 == serve && \${2:-} != --help ]]; then exec "$bin" "\$@" --http-listen=127.0.0.1:$port --pprof; fi
exec "$bin" "\$@"
WRAP
chmod +x "$work/outboxd"
bench=${OUTBOXD_BENCH:-go run ./cmd/outboxd-bench}
$bench --server-binary "$work/outboxd" "$@" >"$out.txt" 2>&1 &
run=$!
until curl -sf -o /dev/null "http://127.0.0.1:$port/debug/pprof/"; do
	kill -0 "$run" 2>/dev/null || { echo "the benchmark ended before its server answered; see $out.txt" >&2; exit 1; }
	sleep 0.2
done
sleep "${DELAY:-4}"
if ! curl -sf -o "$out" "http://127.0.0.1:$port/debug/pprof/profile?seconds=${PROFILE_SECONDS:-6}"; then
	wait "$run" || true
	echo "no profile: the server ended within DELAY + PROFILE_SECONDS (make them shorter, or the run longer); see $out.txt" >&2
	exit 1
fi
wait "$run"
echo "profile: $out; benchmark report: $out.txt"
