package server_test

import (
	"context"
	"fmt"
	"testing"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/testdb"
)

// An audit that fails counts nothing: lag goes on answering without
// stranded counts (no audited_at, so a reader cannot take its silence for
// "none stranded"), and, its pause not over, the next readers do not start
// another. The audit is made to fail by cancelling its statement while it
// waits for a lock on a table only it reads.
func TestStrandedAuditThatFailsReportsNoCounts(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	emit(t, pool, "orders", "a", 1)
	waitState(t, pool, "a", "ready")
	tx, locker := lockLateEvents(t, ctx, pool)
	// The first reader starts the audit and answers without its counts.
	if _, err := r.Admin.GetLag(ctx, &outboxv1.GetLagRequest{}); err != nil {
		t.Fatalf("GetLag while the first audit is blocked: %v", err)
	}
	var audit int
	eventually(t, func() (bool, string) {
		err := pool.QueryRow(ctx, `SELECT pid FROM pg_stat_activity
			WHERE $1 = ANY (pg_blocking_pids(pid)) AND query LIKE '%outbox.stranded(NULL)%'`, locker).Scan(&audit)
		return err == nil, fmt.Sprintf("no audit waits for the lock: %v", err)
	})
	var cancelled bool
	if err := pool.QueryRow(ctx, `SELECT pg_cancel_backend($1)`, audit).Scan(&cancelled); err != nil || !cancelled {
		t.Fatalf("cancelling the audit's statement: %v, %v", cancelled, err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	// A reader that comes while the failed audit is still recording itself
	// may get its error; every reader after that gets an answer.
	var lag *outboxv1.GetLagResponse
	var err error
	eventually(t, func() (bool, string) {
		lag, err = r.Admin.GetLag(ctx, &outboxv1.GetLagRequest{})
		return err == nil, fmt.Sprintf("GetLag after the audit failed: %v", err)
	})
	for range 3 {
		if lag, err = r.Admin.GetLag(ctx, &outboxv1.GetLagRequest{}); err != nil {
			t.Fatal(err)
		}
		if at := lag.GetStrandedAuditedAt(); at != nil {
			t.Fatalf("stranded counts (%d) as of %v from an audit that failed", lag.GetTotal().GetStrandedEvents(), at.AsTime())
		}
	}
	if n := r.Server.StrandedAudits(); n != 1 {
		t.Fatalf("%d audits begun; want only the one that failed, within its pause", n)
	}
}
