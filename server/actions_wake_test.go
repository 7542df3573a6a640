package server_test

// Tests written against mutants of the operator actions that drop a
// wake-up: every action that releases work wakes the idle sessions, so what
// it released is delivered at once, not at their next poll.

import (
	"context"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/server"
)

// pollAnHourAway sets r's one poll group's fallback poll an hour away and
// waits until its idle session waits for that poll: from then on only a
// wake-up makes it claim.
func pollAnHourAway(t *testing.T, r *replica) {
	t.Helper()
	r.Server.SetPollBackoff(time.Hour)
	waitFor(t, func() int32 {
		at, armed, _, ok := r.Server.PollTimer()
		return b2i(ok && armed && time.Until(at) > 30*time.Minute && r.Server.Sessions() == 1 && r.Server.IdleSessions() == 1)
	})
}

// recvWoken receives the next delivery on st, which only a wake-up brings
// (its session's poll is an hour away); the 30 s wait is a hang guard, not a delay
// the test depends on.
func recvWoken(t *testing.T, st outboxv1.RelayService_SubscribeClient) *outboxv1.SubscribeResponse {
	t.Helper()
	got := make(chan *outboxv1.SubscribeResponse, 1)
	go func() {
		d, err := st.Recv()
		if err != nil {
			d = nil
		}
		got <- d
	}()
	select {
	case d := <-got:
		if d == nil {
			t.Fatal("the session's stream ended before a delivery")
		}
		return d
	case <-time.After(30 * time.Second):
		t.Fatal("no delivery within 30s: the idle session was not woken")
		return nil
	}
}

// idleWithParkedHead parks the first of two events of orders/k, then opens a
// session on orders and waits until it waits idle with its poll an hour
// away; it returns the parked event's id. Only a wake-up makes
// that session claim before its poll.
func idleWithParkedHead(t *testing.T) (context.Context, *replica, outboxv1.RelayService_SubscribeClient, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	t.Cleanup(cancel)
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, func(c *server.Config) {
		c.MaxFailures = 1
		c.PollInterval, c.ReconcileInterval = time.Hour, time.Hour
	})
	ids := emit(t, pool, "orders", "k", 2)
	pctx, pcancel := context.WithCancel(ctx)
	parker := subscribe(t, pctx, r, &outboxv1.SubscribeRequest{Streams: []string{"orders"}, MaxInFlight: 1, LeaseTtl: durationpb.New(time.Hour)})
	nack(t, r, recv(t, parker))
	pcancel()
	waitState(t, pool, "k", "parked")
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{Streams: []string{"orders"}, MaxInFlight: 1, LeaseTtl: durationpb.New(time.Hour)})
	if _, err := st.Header(); err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() int32 { return b2i(r.Server.Sessions() == 1 && r.Server.IdleSessions() == 1) })
	pollAnHourAway(t, r)
	return ctx, r, st, ids[0].String()
}

// A retry wakes the idle sessions: the aggregate it made ready is delivered
// at once, not at their next poll.
func TestRetryWakesIdleSessions(t *testing.T) {
	t.Parallel()
	ctx, r, st, first := idleWithParkedHead(t)
	if _, err := r.Admin.RetryAggregate(ctx, &outboxv1.RetryAggregateRequest{Stream: "orders", AggregateKey: "k"}); err != nil {
		t.Fatal(err)
	}
	if d := recvWoken(t, st); d.GetEvent().GetEventId() != first {
		t.Fatalf("delivered after the retry: %v, want the retried event %s", d.GetEvent(), first)
	}
}

// A skip of an aggregate's next event wakes the idle sessions: its
// successor is delivered at once, not at their next poll.
func TestSkipWakesIdleSessions(t *testing.T) {
	t.Parallel()
	ctx, r, st, first := idleWithParkedHead(t)
	if _, err := r.Admin.SkipEvent(ctx, &outboxv1.SkipEventRequest{EventId: first, Reason: "poison"}); err != nil {
		t.Fatal(err)
	}
	if d := recvWoken(t, st); d.GetEvent().GetRevision() != 2 {
		t.Fatalf("delivered after the skip: %v, want revision 2", d.GetEvent())
	}
}

// A bulk action that ends wakes the idle sessions, so that what it released
// is delivered at once, not at their next poll (an hour away here): a bulk
// retry of one aggregate walks a single short page, whose end wakes no one.
func TestBulkRetryOfOnePageWakesIdleSessionsWhenItEnds(t *testing.T) {
	t.Parallel()
	ctx, r, st := idleAfterParking(t, 1)
	pollAnHourAway(t, r)
	res, err := r.Admin.BulkRetry(ctx, &outboxv1.BulkRetryRequest{Filter: &outboxv1.AggregateFilter{Stream: "orders"}})
	if err != nil || res.GetRetried() != 1 {
		t.Fatalf("bulk retry: %v, %v; want 1 retried", res, err)
	}
	if d := recvWoken(t, st); d.GetEvent().GetAggregateKey() != "orders-000" {
		t.Fatalf("delivered after the bulk retry: %v, want orders-000", d.GetEvent())
	}
}
