package server_test

import (
	"context"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/server"
)

// Added by the claim mutation sweep. A lease whose expiry lies further
// ahead than any lease the server sets (twice the longest TTL or backoff)
// can only have been left there by a database clock that stepped back: a
// session's claims take it at once, rather than waiting out the step. The
// sessions pass their bound (Config.maxDue) with every claim; without it,
// the lease would wait an hour here. (TestLongestLeaseSurvivesASmallClockStep
// holds the other side: a step within the bound keeps the holder.)
func TestSessionClaimsALeaseAClockStepLeftFarAhead(t *testing.T) {
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
	emit(t, pool, "orders", "o-1", 1)
	firstCtx, endFirst := context.WithCancel(ctx)
	defer endFirst()
	first := subscribe(t, firstCtx, r, &outboxv1.SubscribeRequest{Streams: []string{"orders"}, MaxInFlight: 1,
		LeaseTtl: durationpb.New(longest)})
	held := recv(t, first)

	// The clock steps back an hour: the lease's expiry now lies an hour
	// and 20 seconds ahead of it.
	if _, err := pool.Exec(ctx, `UPDATE outbox.delivery
		SET lease_expires_at = lease_expires_at + interval '1 hour', claimable_at = claimable_at + interval '1 hour'
		WHERE aggregate_key = 'o-1'`); err != nil {
		t.Fatal(err)
	}
	second := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{Streams: []string{"orders"}, MaxInFlight: 1})
	d := recv(t, second) // a hang guard: without the bound it waits for the clock, an hour
	if d.GetEvent().GetAggregateKey() != "o-1" || d.GetEvent().GetRevision() != 1 {
		t.Fatalf("second relay got %s revision %d, want o-1 revision 1", d.GetEvent().GetAggregateKey(), d.GetEvent().GetRevision())
	}
	if d.GetEvent().GetEventId() != held.GetEvent().GetEventId() {
		t.Fatal("the second delivery is not the held event's")
	}
	ackPublished(t, r, d)
}
