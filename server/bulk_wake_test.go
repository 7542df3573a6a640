package server_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/server"
)

// idleAfterParking parks n aggregates of stream orders on a replica whose
// sessions poll only hourly, then opens a session on orders and waits until
// it waits idle (nothing claimable: everything is parked). Only a wake-up
// makes that session claim before its poll.
func idleAfterParking(t *testing.T, n int) (context.Context, *replica, outboxv1.RelayService_SubscribeClient) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	t.Cleanup(cancel)
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, func(c *server.Config) {
		c.MaxFailures = 1
		c.PollInterval, c.ReconcileInterval = time.Hour, time.Hour
	})
	parkSome(t, ctx, r, pool, "orders", n, "HTTP 503")
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{Streams: []string{"orders"}, MaxInFlight: uint32(n), LeaseTtl: durationpb.New(time.Hour)})
	if _, err := st.Header(); err != nil {
		t.Fatal(err)
	}
	// Idle: the parking relay's session gone (it idled too, and may take a
	// moment to go), this one's first claim made and found nothing.
	waitFor(t, func() int32 { return b2i(r.Server.Sessions() == 1 && r.Server.IdleSessions() == 1) })
	return ctx, r, st
}

// A bulk action wakes the idle sessions after each page it walked, so that
// what it released is delivered while it goes on: here the walk, a page of
// one aggregate, waits after its first page until the session has received
// that page's aggregate.
func TestBulkRetryWakesIdleSessionsAfterEachPage(t *testing.T) {
	t.Parallel()
	ctx, r, st := idleAfterParking(t, 2)
	delivered := make(chan *outboxv1.SubscribeResponse, 2)
	go func() {
		for {
			d, err := st.Recv()
			if err != nil {
				return
			}
			delivered <- d
		}
	}()
	var once sync.Once
	var duringWalk *outboxv1.SubscribeResponse
	r.Server.SetBulkPage(1, func() {
		once.Do(func() {
			select {
			case duringWalk = <-delivered:
			case <-time.After(30 * time.Second): // a hang guard: the wake-up is due at once
			}
		})
	})
	res, err := r.Admin.BulkRetry(ctx, &outboxv1.BulkRetryRequest{Filter: &outboxv1.AggregateFilter{Stream: "orders"}})
	if err != nil || res.GetRetried() != 2 {
		t.Fatalf("bulk retry: %v, %v; want 2 retried", res, err)
	}
	if duringWalk.GetEvent().GetAggregateKey() != "orders-000" {
		t.Fatalf("delivered while the walk waited after its first page: %v, want orders-000", duringWalk.GetEvent())
	}
}
