package server_test

// A test written against a mutant of the aggregate filter
// (server/deadletter.go) that the other tests let through.

import (
	"context"
	"testing"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/testdb"
)

// A bulk action's stalled_only filter applies it to stalled aggregates only:
// of two ready aggregates, the one whose next event had three leases end
// unanswered (stall_after_unanswered) is skipped, the other is not.
func TestBulkSkipStalledOnlySkipsOnlyStalledAggregates(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	emit(t, pool, "orders", "stuck", 1)
	emit(t, pool, "orders", "fine", 1)
	waitState(t, pool, "stuck", "ready")
	waitState(t, pool, "fine", "ready")
	// What three expired leases of its event leave on the delivery row.
	if _, err := pool.Exec(ctx, `UPDATE outbox.delivery SET unanswered = 3 WHERE stream = 'orders' AND aggregate_key = 'stuck'`); err != nil {
		t.Fatal(err)
	}
	res, err := r.Admin.BulkSkip(ctx, &outboxv1.BulkSkipRequest{Filter: &outboxv1.AggregateFilter{StalledOnly: true}, Reason: "stuck"})
	if err != nil || res.GetMatched() != 1 || res.GetSkipped() != 1 {
		t.Fatalf("bulk skip of stalled aggregates: %v, %v; want 1 matched, 1 skipped", res, err)
	}
	if n := countWhere(t, pool, "outbox.skipped_event s JOIN outbox.event e USING (event_id)", "e.aggregate_key = 'fine'"); n != 0 {
		t.Fatalf("the aggregate that is not stalled had %d events skipped", n)
	}
}
