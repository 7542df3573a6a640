package server_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/protobuf/types/known/durationpb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/store"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/server"
)

// A session for stream live claims live's work while another stream holds
// a large ready backlog, older than live's, that no relay takes.
func TestSessionClaimsItsStreamBesideABacklogElsewhere(t *testing.T) {
	t.Parallel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	if _, err := pool.Exec(ctx, `INSERT INTO outbox.event (stream, aggregate_key, revision, event_type, payload)
		SELECT 'cold', 'k' || g, 1, 'T', '{}' FROM generate_series(1, 5000) g`); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `SELECT outbox.discover()`); err != nil {
		t.Fatal(err)
	}
	emit(t, pool, "live", "seed", 1) // Subscribe refuses a stream no event has used
	// No dispatch: every live event goes through a claim.
	r := startReplica(t, url, func(c *server.Config) { c.NoDispatch = true })
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{Streams: []string{"live"}, MaxInFlight: 8})
	if d := recv(t, st); d.GetEvent().GetAggregateKey() != "seed" {
		t.Fatalf("first delivery %s/%s, want live/seed", d.GetEvent().GetStream(), d.GetEvent().GetAggregateKey())
	} else {
		ack(t, r, d)
	}
	for i := range 3 {
		emit(t, pool, "live", fmt.Sprintf("a%d", i), 2)
	}
	for range 6 {
		d := recv(t, st)
		if d.GetEvent().GetStream() != "live" {
			t.Fatalf("delivered %s/%s to a session of live", d.GetEvent().GetStream(), d.GetEvent().GetAggregateKey())
		}
		ackPublished(t, r, d)
	}
	var ready int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox.delivery WHERE stream = 'cold' AND state = 'ready'`).Scan(&ready); err != nil || ready != 5000 {
		t.Fatalf("cold holds %d ready aggregates, %v; want all 5000 untouched", ready, err)
	}
}

// shiftIntoFuture makes the events of stream, and the delivery rows' stored
// times, lie d ahead of the database clock, as they do after the clock
// stepped back by d.
func shiftIntoFuture(t *testing.T, pool *pgxpool.Pool, stream string, d time.Duration) {
	t.Helper()
	ctx := t.Context()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	for _, q := range []string{
		`ALTER TABLE outbox.event DISABLE TRIGGER USER`,
		`UPDATE outbox.event SET created_at = created_at + $2 WHERE stream = $1`,
		`ALTER TABLE outbox.event ENABLE TRIGGER USER`,
		`UPDATE outbox.delivery SET claimable_at = claimable_at + $2, pending_since = pending_since + $2 WHERE stream = $1`,
	} {
		var args []any
		if q[0] == 'U' {
			args = []any{stream, d}
		}
		if _, err := tx.Exec(ctx, q, args...); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
}

// After the database clock stepped back 10 minutes, ready aggregates whose
// events were created "in the future" are delivered at once, and lag says
// so sensibly: the work counts as pending and ready, its age is never
// negative, nothing is stalled, and once delivered nothing is pending.
func TestClockSteppedBackDeliversReadyAggregates(t *testing.T) {
	t.Parallel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	for i := range 10 {
		emit(t, pool, "orders", fmt.Sprintf("o%d", i), 1)
	}
	if _, err := pool.Exec(ctx, `SELECT outbox.discover()`); err != nil {
		t.Fatal(err)
	}
	shiftIntoFuture(t, pool, "orders", 10*time.Minute)
	r := startReplica(t, url, nil)

	lag := func() *outboxv1.StreamLag {
		t.Helper()
		res, err := r.Admin.GetLag(ctx, &outboxv1.GetLagRequest{Streams: []string{"orders"}})
		if err != nil {
			t.Fatal(err)
		}
		for _, l := range res.GetStreams() {
			if l.GetStream() == "orders" {
				return l
			}
		}
		return &outboxv1.StreamLag{}
	}
	before := lag()
	if before.GetPendingEvents() != 10 || before.GetReadyAggregates() != 10 || before.GetStalledAggregates() != 0 ||
		before.GetOldestPendingAge().AsDuration() < 0 ||
		!before.GetOldestPendingCreatedAt().AsTime().After(time.Now().Add(5*time.Minute)) {
		t.Fatalf("lag before delivery: %d pending, %d ready, %d stalled, oldest age %v created %v; want 10, 10, 0, >= 0, ~10 minutes ahead",
			before.GetPendingEvents(), before.GetReadyAggregates(), before.GetStalledAggregates(),
			before.GetOldestPendingAge().AsDuration(), before.GetOldestPendingCreatedAt().AsTime())
	}

	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{Streams: []string{"orders"}, MaxInFlight: 20})
	got := map[string]bool{}
	for range 10 {
		d := recv(t, st) // a hang guard: before the fix they waited for the clock, 10 minutes
		got[d.GetEvent().GetAggregateKey()] = true
		ackPublished(t, r, d)
	}
	if len(got) != 10 {
		t.Fatalf("delivered %d distinct aggregates, want 10", len(got))
	}
	if after := lag(); after.GetPendingEvents() != 0 || after.GetStalledAggregates() != 0 {
		t.Fatalf("lag after delivery: %d pending, %d stalled; want 0, 0", after.GetPendingEvents(), after.GetStalledAggregates())
	}
}

// A lease granted for the longest TTL a relay may ask for keeps its holder
// through a small step back of the database clock: its expiry then lies a
// little further ahead than any lease the server sets, which must not yet
// count as left there by a step (the bound has a margin; without it the
// smallest step, a leap second or an NTP correction, handed the aggregate to
// a second holder while the first still published). Dispatch is off and the
// first relay's credit is full, so every claim after the step is the second
// relay's; the after-claim hook says when one has run.
func TestLongestLeaseSurvivesASmallClockStep(t *testing.T) {
	t.Parallel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	const longest = 20 * time.Second
	r := startReplica(t, url, func(c *server.Config) {
		c.NoDispatch = true
		c.MaxLeaseTTL, c.DefaultLeaseTTL = longest, longest
		c.BackoffCap = time.Second
	})
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	emit(t, pool, "orders", "o-1", 2)
	first := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{Streams: []string{"orders"}, MaxInFlight: 1,
		LeaseTtl: durationpb.New(longest)})
	held := recv(t, first)

	// The clock steps back 2 s: the lease's expiry now lies that much
	// further ahead of it.
	if _, err := pool.Exec(ctx, `UPDATE outbox.delivery
		SET lease_expires_at = lease_expires_at + interval '2 seconds', claimable_at = claimable_at + interval '2 seconds'
		WHERE aggregate_key = 'o-1'`); err != nil {
		t.Fatal(err)
	}
	claimed := make(chan []store.Lease, 16)
	r.Server.SetAfterClaim(func(leases []store.Lease, err error) ([]store.Lease, error) {
		if err == nil {
			claimed <- leases
		}
		return leases, err
	})
	subscribe(t, ctx, r, &outboxv1.SubscribeRequest{Streams: []string{"orders"}, MaxInFlight: 1})
	select {
	case leases := <-claimed:
		if len(leases) != 0 {
			t.Fatalf("the second relay's claim leased %s revision %d, which the first holds for another ~%v",
				leases[0].Event.AggregateKey, leases[0].Event.Revision, longest)
		}
	case <-ctx.Done():
		t.Fatal("the second relay's session never claimed")
	}
	ackPublished(t, r, held)
}
