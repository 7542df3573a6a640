package server_test

// Tests written against mutants of store.Republish that survived the tests
// before them: the claim order a rewound aggregate takes, and the notices
// that give a lease it ended back to its session and wake idle sessions.

import (
	"context"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/protobuf/types/known/durationpb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/server"
)

// publishedOnOneCredit emits n events of orders/key and delivers and acks
// them on a new session of one credit opened with ctx; it returns the
// session's stream, left open for what the test delivers next, and the
// events' ids.
func publishedOnOneCredit(t *testing.T, ctx context.Context, r *replica, pool *pgxpool.Pool, key string, n int) (outboxv1.RelayService_SubscribeClient, []uuid.UUID) {
	t.Helper()
	ids := emit(t, pool, "orders", key, n)
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{Streams: []string{"orders"}, MaxInFlight: 1, LeaseTtl: durationpb.New(time.Hour)})
	for range n {
		ack(t, r, recv(t, st))
	}
	return st, ids
}

// A rewound aggregate is claimable in the claim order an ack would give it,
// its first republished event's created_at: ahead of work that arrived
// after that event, not behind it.
func TestARepublishedAggregateTakesItsPlaceInTheClaimOrder(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	sctx, scancel := context.WithCancel(ctx)
	_, ids := publishedOnOneCredit(t, sctx, r, pool, "a", 1)
	scancel()
	waitFor(t, func() int32 { return b2i(r.Server.Sessions() == 0) })
	// b's event is newer than a's, and waits, ready, for a session.
	emit(t, pool, "orders", "b", 1)
	waitState(t, pool, "b", "ready")
	if _, err := r.Admin.Republish(ctx, &outboxv1.RepublishRequest{Stream: "orders", AggregateKey: "a", FromRevision: 1, Reason: "r"}); err != nil {
		t.Fatal(err)
	}
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{Streams: []string{"orders"}, MaxInFlight: 1, LeaseTtl: durationpb.New(time.Hour)})
	if d := recv(t, st); d.GetEvent().GetEventId() != ids[0].String() {
		t.Fatalf("first claimed after the republish: %s/%d, want a/1, the older event",
			d.GetEvent().GetAggregateKey(), d.GetEvent().GetRevision())
	}
}

// A republish that ends a lease in flight gives its session the credit back
// at once (NOTIFY outbox_released), so that the session, with its whole
// credit in that lease, takes the republished events now, not at its
// reconciliation (an hour away here).
func TestARepublishGivesTheLeaseItEndedBackToItsSession(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, func(c *server.Config) { c.PollInterval, c.ReconcileInterval = time.Hour, time.Hour })
	ids := emit(t, pool, "orders", "a", 4)
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{Streams: []string{"orders"}, MaxInFlight: 1, LeaseTtl: durationpb.New(time.Hour)})
	for range 3 {
		ack(t, r, recv(t, st))
	}
	if d := recv(t, st); d.GetEvent().GetRevision() != 4 {
		t.Fatalf("fourth delivery: revision %d", d.GetEvent().GetRevision())
	}
	if _, err := r.Admin.Republish(ctx, &outboxv1.RepublishRequest{Stream: "orders", AggregateKey: "a", FromRevision: 1, Reason: "r"}); err != nil {
		t.Fatal(err)
	}
	if d := recvWoken(t, st); d.GetEvent().GetEventId() != ids[0].String() {
		t.Fatalf("delivered after the republish: %v, want a/1 again", d.GetEvent())
	}
}

// A republish wakes the idle sessions of every replica (NOTIFY
// outbox_wakeup), not only of the one that served it: the aggregate it made
// ready again is delivered at once by a session on another replica, not at
// that session's next poll (an hour away here).
func TestRepublishWakesIdleSessionsOfOtherReplicas(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	operator := startReplica(t, url, nil)
	r := startReplica(t, url, func(c *server.Config) { c.PollInterval, c.ReconcileInterval = time.Hour, time.Hour })
	st, ids := publishedOnOneCredit(t, ctx, r, pool, "a", 1)
	waitState(t, pool, "a", "idle")
	waitFor(t, func() int32 { return b2i(r.Server.IdleSessions() == 1) })
	pollAnHourAway(t, r)
	if _, err := operator.Admin.Republish(ctx, &outboxv1.RepublishRequest{Stream: "orders", AggregateKey: "a", FromRevision: 1, Reason: "r"}); err != nil {
		t.Fatal(err)
	}
	if d := recvWoken(t, st); d.GetEvent().GetEventId() != ids[0].String() {
		t.Fatalf("delivered after the republish: %v, want a/1 again", d.GetEvent())
	}
}

// Without include_skipped, a skipped event inside the rewound range stays
// skipped: the published events around it are delivered again, it is not,
// and its skip is kept.
func TestARepublishWithoutIncludeSkippedLeavesSkipsInPlace(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, func(c *server.Config) { c.MaxFailures = 1 })
	ids := emit(t, pool, "orders", "k", 3)
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{Streams: []string{"orders"}, MaxInFlight: 1, LeaseTtl: durationpb.New(time.Hour)})
	ack(t, r, recv(t, st))
	nack(t, r, recv(t, st)) // revision 2 parks at attempt 1
	if _, err := r.Admin.SkipEvent(ctx, &outboxv1.SkipEventRequest{EventId: ids[1].String(), Reason: "poison"}); err != nil {
		t.Fatal(err)
	}
	ack(t, r, recv(t, st)) // revision 3
	waitState(t, pool, "k", "idle")

	res, err := r.Admin.Republish(ctx, &outboxv1.RepublishRequest{Stream: "orders", AggregateKey: "k", FromRevision: 1, Reason: "r"})
	if err != nil || res.GetEvents() != 2 || res.GetUnskippedEvents() != 0 {
		t.Fatalf("republish around a skipped event: %v, %v; want 2 events, none unskipped", res, err)
	}
	for _, want := range []int{0, 2} {
		d := recv(t, st)
		if d.GetEvent().GetEventId() != ids[want].String() {
			t.Fatalf("delivered again: revision %d, want revision %d", d.GetEvent().GetRevision(), want+1)
		}
		ack(t, r, d)
	}
	if n := countWhere(t, pool, "outbox.skipped_event", "true"); n != 1 {
		t.Fatalf("%d skips after the republish, want the one kept", n)
	}
}

// With include_skipped, a range that holds only skipped events is
// republished (the events are delivered, their skips withdrawn), not
// refused as a range with nothing published.
func TestARepublishOfOnlySkippedEventsWithIncludeSkippedDeliversThem(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, func(c *server.Config) { c.MaxFailures = 1 })
	only := emit(t, pool, "orders", "only", 1)[0]
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{Streams: []string{"orders"}, MaxInFlight: 1, LeaseTtl: durationpb.New(time.Hour)})
	nack(t, r, recv(t, st)) // parks at attempt 1
	if _, err := r.Admin.SkipEvent(ctx, &outboxv1.SkipEventRequest{EventId: only.String(), Reason: "poison"}); err != nil {
		t.Fatal(err)
	}
	waitState(t, pool, "only", "idle")
	res, err := r.Admin.Republish(ctx, &outboxv1.RepublishRequest{Stream: "orders", AggregateKey: "only", FromRevision: 1,
		IncludeSkipped: true, Reason: "receiver fixed"})
	if err != nil || res.GetEvents() != 1 || res.GetUnskippedEvents() != 1 {
		t.Fatalf("republish of a skipped event alone: %v, %v; want it delivered", res, err)
	}
	if d := recv(t, st); d.GetEvent().GetEventId() != only.String() {
		t.Fatalf("delivered after the republish: %v, want the formerly skipped event", d.GetEvent())
	}
}

// Every republish numbers its deliveries after all the earlier ones of the
// event, the newest republish's count included: delivered once, then
// republished three times, the event comes as attempts 2, 3 and 4.
func TestEachRepublishContinuesTheAttemptsOfTheLastOne(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	st, ids := publishedOnOneCredit(t, ctx, r, pool, "a", 1)
	for want := uint32(2); want <= 4; want++ {
		waitState(t, pool, "a", "idle")
		if _, err := r.Admin.Republish(ctx, &outboxv1.RepublishRequest{Stream: "orders", AggregateKey: "a", FromRevision: 1, Reason: "r"}); err != nil {
			t.Fatal(err)
		}
		d := recv(t, st)
		if d.GetEvent().GetEventId() != ids[0].String() || d.GetAttempt() != want {
			t.Fatalf("republish %d: %v attempt %d, want the event at attempt %d", want-1, d.GetEvent(), d.GetAttempt(), want)
		}
		ack(t, r, d)
	}
}
