package server_test

// Tests written against mutants of the SQL RetryAggregate sends
// (internal/store) that the server's tests let through.

import (
	"context"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/server"
)

// A retry gives a fresh set of attempts: it clears the count of leases that
// ended unanswered with the failures, so the retried aggregate is not
// stalled (README: "an ack, a skip or a retry clears it").
func TestRetryClearsTheUnansweredCount(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, func(c *server.Config) { c.MaxFailures = 1 })
	setting(t, pool, "stall_after_unanswered = 2")
	emit(t, pool, "orders", "s", 1)
	sctx, scancel := context.WithCancel(ctx)
	st := subscribe(t, sctx, r, &outboxv1.SubscribeRequest{Streams: []string{"orders"}, MaxInFlight: 1, LeaseTtl: durationpb.New(time.Hour)})
	nack(t, r, recv(t, st))
	scancel()
	waitState(t, pool, "s", "parked")
	// What two leases of its event that expired before the parking nack
	// leave on the delivery row.
	if _, err := pool.Exec(ctx, `UPDATE outbox.delivery SET unanswered = 2 WHERE stream = 'orders' AND aggregate_key = 's'`); err != nil {
		t.Fatal(err)
	}
	res, err := r.Admin.RetryAggregate(ctx, &outboxv1.RetryAggregateRequest{Stream: "orders", AggregateKey: "s"})
	if err != nil {
		t.Fatal(err)
	}
	if a := res.GetAggregate(); a.GetState() != outboxv1.AggregateState_AGGREGATE_STATE_READY || a.GetStalled() {
		t.Fatalf("retried aggregate %v; want ready and not stalled", a)
	}
	if n := countWhere(t, pool, "outbox.delivery", "unanswered <> 0"); n != 0 {
		t.Fatalf("%d delivery rows keep an unanswered count after the retry", n)
	}
}
