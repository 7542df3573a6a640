package main

import (
	"context"
	"strings"
	"testing"
)

// After a restore into another cluster, `outboxd lag` says discovery is
// stopped and what to run; `outboxd rescan` (straight to the database, as
// the schema owner) finds the events and discovery runs again.
func TestCLIRescanAfterRestore(t *testing.T) {
	t.Parallel()
	ts := startServer(t, nil)
	if _, err := ts.pool.Exec(context.Background(), `UPDATE outbox.discovery SET system_identifier = 42`); err != nil {
		t.Fatal(err)
	}
	ts.emit(t, "orders", keys("o", 2)...)

	r := ts.cli(t, nil, "lag").want(t, exitOK)
	for _, s := range []string{"DISCOVERY STOPPED:", "another PostgreSQL cluster", "outboxd rescan"} {
		if !strings.Contains(r.stdout, s) {
			t.Fatalf("lag does not say %q:\n%s", s, r.stdout)
		}
	}

	r = runCLI(t, t.Context(), nil, nil, "rescan", "--database-url", ts.pool.Config().ConnString()).want(t, exitOK)
	if !strings.Contains(r.stdout, "discovery was stopped: ") || !strings.Contains(r.stdout, "rescanned: 2 pending events, 2 aggregates") {
		t.Fatalf("rescan said:\n%s", r.stdout)
	}
	if r := ts.cli(t, nil, "lag").want(t, exitOK); strings.Contains(r.stdout, "DISCOVERY STOPPED") {
		t.Fatalf("lag after the re-scan:\n%s", r.stdout)
	}
}
