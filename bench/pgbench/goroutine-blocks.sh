#!/usr/bin/env bash
# Where a Go process's goroutines block, from an execution trace (for
# example 5 s of a server started with --pprof: curl -o T
# 'http://HOST/debug/pprof/trace?seconds=5'): every Running->Waiting
# transition counted by its reason and the first three frames of the
# blocked goroutine's stack outside the runtime and standard library, most
# frequent first, after the totals of blocks and goroutines created. Each
# block is a later wake-up; in an idle process each wake-up is a thread's.
# BENCHMARKS.md divides by the server's Ack calls in the trace (the line
# with ackCommitter).submit) to get blocks per light event.
#
# Usage: bench/pgbench/goroutine-blocks.sh TRACE [LINES]
set -euo pipefail
trace=$1
lines=${2:-20}
go tool trace -d=parsed "$trace" 2>/dev/null | awk '
	function flush() {
		if (pending) count[reason " " frames]++
		pending = 0; collecting = 0
	}
	/StateTransition/ && /NotExist->Runnable/ { created++ }
	/StateTransition/ && /Running->Waiting/ {
		flush()
		pending = 1; blocks++; n = 0; frames = ""
		reason = $0; sub(/.*Reason=/, "", reason)
		next
	}
	pending && /^TransitionStack=/ { collecting = 1; next }
	collecting && /^\t[^\t]/ {
		f = $1
		if (n < 3 && f !~ /^(runtime|internal\/|sync\.|syscall\.|net\.|io\.|bufio\.|time\.|context\.|os\.)/) {
			frames = frames (n ? " < " : "") f; n++
		}
		next
	}
	collecting && /^\t\t/ { next }
	{ if (collecting || pending) flush() }
	END {
		flush()
		printf "blocks %d, goroutines created %d\n", blocks, created
		for (k in count) printf "%6d %s\n", count[k], k | "sort -rn"
	}' | head -n $((lines + 1))
