package server_test

import (
	"context"
	"testing"
	"time"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/server"
)

// One stranded audit runs at a time, whoever asks: an audit that outlasts
// its interval (blocked here by a lock on a table only it reads) is not
// joined by a second one when the next reader finds its counts stale.
func TestOneStrandedAuditRunsAtATime(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute) // a hang guard
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, func(c *server.Config) { c.StrandedAuditInterval = time.Millisecond })
	emit(t, pool, "orders", "a", 1)
	waitState(t, pool, "a", "ready")
	tx, _ := lockLateEvents(t, ctx, pool)
	// This reader starts an audit, which then waits for the lock.
	if _, err := r.Admin.GetLag(ctx, &outboxv1.GetLagRequest{}); err != nil {
		t.Fatal(err)
	}
	started := r.Server.StrandedAudits()
	// Its interval has passed once the reader above is answered (it waits
	// for no audit longer than the interval, or waits 2 s for the first):
	// stale counts, an audit under way.
	// (Each audit that waits holds a connection: checked after every
	// reader, before a pile of them could exhaust the pool.)
	for range 3 {
		if _, err := r.Admin.GetLag(ctx, &outboxv1.GetLagRequest{}); err != nil {
			t.Fatal(err)
		}
		if n := r.Server.StrandedAudits(); n != started {
			t.Fatalf("%d audits begun while one waited for its lock, want none", n-started)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	audited(t, r)
}
