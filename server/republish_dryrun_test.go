package server_test

// Tests written against mutants of Republish (server/deadletter.go) that
// the other tests let through.

import (
	"context"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/testdb"
)

// A dry-run republish of a time range only counts: it rewinds nothing and
// records no operator action, as a dry-run republish of one aggregate.
func TestRepublishDryRunOfATimeRangeRecordsNothing(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	emit(t, pool, "orders", "a", 1)
	emit(t, pool, "orders", "b", 1)
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{Streams: []string{"orders"}, MaxInFlight: 2, LeaseTtl: durationpb.New(time.Hour)})
	ackPublished(t, r, recv(t, st), recv(t, st))
	for _, req := range []*outboxv1.RepublishRequest{
		{Stream: "orders", PublishedAfter: timestamppb.New(time.Now().Add(-time.Hour)), Reason: "replay", DryRun: true},
		{Stream: "orders", AggregateKey: "a", FromRevision: 1, Reason: "replay", DryRun: true},
	} {
		res, err := r.Admin.Republish(ctx, req)
		if err != nil || res.GetEvents() == 0 {
			t.Fatalf("dry-run republish %v: %v, %v; want events counted", req, res, err)
		}
	}
	if n := countWhere(t, pool, "outbox.operator_action", "true"); n != 0 {
		t.Fatalf("dry-run republishes recorded %d operator actions, want none", n)
	}
	if n := countWhere(t, pool, "outbox.event", "published_at IS NULL"); n != 0 {
		t.Fatalf("dry-run republishes made %d events pending again, want none", n)
	}
}
