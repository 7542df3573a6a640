package main

import (
	"context"
	"net"
	"slices"
	"strings"
	"testing"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
)

// downAddr is an address nothing listens on.
func downAddr(t *testing.T) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := lis.Addr().String()
	lis.Close()
	return addr
}

// A command line that is wrong exits 2 (usage) before the server is
// called, so a script tells its own mistake from a server that is down
// (exit 1), whatever state the server is in: here nothing listens.
func TestCLIUsageMistakesExit2BeforeDialing(t *testing.T) {
	t.Parallel()
	addr := downAddr(t)
	for _, args := range [][]string{
		{"skip", "0190a8c2-0000-7000-8000-000000000001", "--reason", "  "}, // a blank reason
		{"skip", "not-a-uuid", "--reason", "x"},
		{"retry", "flaky", "f1", "--accept-gap"}, // accepting a gap needs a reason
		{"retry", "flaky", "f1", "--accept-gap", "--reason", " "},
		{"lag", "--interval", "0"},
		{"lag", "--watch", "--interval", "0"},
	} {
		r := runCLI(t, context.Background(), nil, nil, append(args, "--server", addr)...)
		if r.code != exitUsage {
			t.Errorf("outboxd %s: exit %d, want %d (usage) without calling the server\n%s", strings.Join(args, " "), r.code, exitUsage, r.stderr)
		}
		if strings.Contains(r.stderr, "unavailable") {
			t.Errorf("outboxd %s called the server:\n%s", strings.Join(args, " "), r.stderr)
		}
	}
}

// With several sources, lag names each source that is not ready, and why:
// its streams are missing from the table, and the line says so.
func TestLagNamesSourcesNotReady(t *testing.T) {
	t.Parallel()
	var out strings.Builder
	err := printLag(&out, &outboxv1.GetLagResponse{
		Total: &outboxv1.StreamLag{},
		Sources: []*outboxv1.SourceHealth{
			{Name: "default", Ready: true},
			{Name: "orders", Ready: false, Reason: "database unreachable: connection refused"},
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "source orders NOT READY: database unreachable: connection refused") {
		t.Errorf("lag does not say orders is not ready:\n%s", out.String())
	}
	if strings.Contains(out.String(), "source default NOT READY") {
		t.Errorf("lag says the ready source default is not ready:\n%s", out.String())
	}
}

// lag's table names a stream of another source as SOURCE/STREAM (default's
// bare), and says why discovery stopped: an operator reading it must know
// which database's stream lags and that nothing new is being found.
func TestLagNamesSourcesAndAStoppedDiscovery(t *testing.T) {
	t.Parallel()
	var out strings.Builder
	err := printLag(&out, &outboxv1.GetLagResponse{
		Streams: []*outboxv1.StreamLag{
			{Stream: "sales_order", PendingEvents: 3},
			{Stream: "sales_order", Source: "orders", PendingEvents: 5},
		},
		Total:            &outboxv1.StreamLag{PendingEvents: 8},
		DiscoveryStopped: "the database was restored from a backup (system identifier changed)",
	})
	if err != nil {
		t.Fatal(err)
	}
	var rows []string
	for _, line := range strings.Split(out.String(), "\n") {
		if f := strings.Fields(line); len(f) > 1 && strings.HasSuffix(f[0], "sales_order") {
			rows = append(rows, f[0]+" "+f[1])
		}
	}
	if want := []string{"sales_order 3", "orders/sales_order 5"}; !slices.Equal(rows, want) {
		t.Errorf("lag's stream rows %q, want %q:\n%s", rows, want, out.String())
	}
	if !strings.Contains(out.String(), "DISCOVERY STOPPED: the database was restored from a backup (system identifier changed)") {
		t.Errorf("lag does not say discovery stopped:\n%s", out.String())
	}
}

// A republish of one event says so in the singular.
func TestRepublishOfOneEventReadsSingular(t *testing.T) {
	t.Parallel()
	var out strings.Builder
	if err := printRepublish(&out, &outboxv1.RepublishResponse{Events: 1, Aggregates: 1}, "are"); err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(out.String(), "1 event of 1 aggregate is delivered again\n") {
		t.Errorf("printRepublish of one event: %q", out.String())
	}
}
