package main

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/outboxd/outboxd/internal/freeport"
	"github.com/outboxd/outboxd/internal/testdb"
)

// After a restore into another cluster, `outboxd lag` says discovery is
// stopped and what to run; `outboxd rescan` (straight to the database, as
// the schema owner) finds the events and discovery runs again.
func TestCLIRescanAfterRestore(t *testing.T) {
	t.Parallel()
	ts := startServer(t, nil)
	// The "restore" and the events happen while this test holds the lock
	// discovery rounds take turns with ('outboxd.discover', per database):
	// a round under way when it changed the system identifier could
	// otherwise have read the old one and found the first event.
	ctx := context.Background()
	lock, err := ts.pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Release()
	if _, err := lock.Exec(ctx, `SELECT pg_advisory_lock(7954802400917419382)`); err != nil {
		t.Fatal(err)
	}
	if _, err := ts.pool.Exec(ctx, `UPDATE outbox.discovery SET system_identifier = 42`); err != nil {
		t.Fatal(err)
	}
	ts.emit(t, "orders", keys("o", 2)...)
	if _, err := lock.Exec(ctx, `SELECT pg_advisory_unlock(7954802400917419382)`); err != nil {
		t.Fatal(err)
	}

	// The server reads the stop from its discovery loop's last turn, which
	// may be one from before the restore for a moment: lag says so once the
	// loop has turned.
	var r result
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(50 * time.Millisecond) {
		r = ts.cli(t, nil, "lag").want(t, exitOK)
		if strings.Contains(r.stdout, "DISCOVERY STOPPED:") || time.Now().After(deadline) {
			break // a minute: a hang guard, the message is checked below
		}
	}
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

// rescan names the database it cannot use and what to run: a database never
// migrated, or one it cannot reach, is not the stopped discovery it exists
// for, and its error must not read as one (it said "discovery stopped:
// ERROR: schema "outbox" does not exist").
func TestCLIRescanNamesADatabaseItCannotUse(t *testing.T) {
	t.Parallel()
	port, err := freeport.Port()
	if err != nil {
		t.Fatal(err)
	}
	unreachable := "postgres://postgres@127.0.0.1:" + strconv.Itoa(port) + "/none?connect_timeout=5"
	for _, c := range []struct {
		what, url string
		says      []string
	}{
		{"never migrated", testdb.NewEmpty(t), []string{"database postgres://", "pending; run `outboxd migrate` first"}},
		{"unreachable", unreachable, []string{"database postgres://postgres@127.0.0.1:" + strconv.Itoa(port) + "/none"}},
	} {
		r := runCLI(t, t.Context(), nil, nil, "rescan", "--database-url", c.url).want(t, exitFailure)
		for _, s := range c.says {
			if !strings.Contains(r.stderr, s) {
				t.Errorf("rescan of a database %s does not say %q:\n%s", c.what, s, r.stderr)
			}
		}
		if strings.Contains(r.stderr, "discovery stopped") {
			t.Errorf("rescan's error for a database %s reads as a stopped discovery:\n%s", c.what, r.stderr)
		}
	}
}
