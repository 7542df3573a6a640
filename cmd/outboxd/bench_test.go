package main

import (
	"strings"
	"testing"
)

// outboxd bench is only a pointer: whatever flags the old command took, it
// exits with a usage error that says where the benchmark went.
func TestBenchPointsAtTheBenchModule(t *testing.T) {
	t.Parallel()
	r := runCLI(t, t.Context(), nil, nil, "bench", "--quick").want(t, exitUsage)
	if !strings.Contains(r.stderr, "make bench") || !strings.Contains(r.stderr, "docs/benchmark.md") {
		t.Fatalf("stderr does not point at make bench and docs/benchmark.md:\n%s", r.stderr)
	}
}
