package server_test

import (
	"context"
	"fmt"
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

// A claim that leased its ClaimBatch of aggregates may have left more
// claimable, although it used less credit than the session has: the session
// claims again at once instead of waiting for a wake-up or the group's poll
// (session.go, claimAndSend's claimedAll). Here each claim may lease one
// aggregate of twelve claimable ones, the session has credit for all twelve,
// and nothing else would wake it: no polls, reconcile ticks only from the
// test (none), no new events for discovery to dispatch or announce. Only
// that claim after claim leases all twelve; a session that took a full batch
// for "fewer than asked" receives one or two (the wake-ups its start left)
// and then none.
func TestAClaimThatFilledItsBatchClaimsAgainAtOnce(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	const aggregates = 12
	for i := range aggregates {
		emit(t, pool, "orders", fmt.Sprintf("k%02d", i), 1)
	}
	r := quietReplica(t, url, func(c *server.Config) {
		c.NoDispatch = true
		c.ClaimBatch = 1
	})
	eventually(t, func() (bool, string) {
		n := countWhere(t, pool, "outbox.delivery", "state = 'ready'")
		return n == aggregates, fmt.Sprintf("%d of %d aggregates claimable", n, aggregates)
	})
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: aggregates, LeaseTtl: durationpb.New(time.Hour)})
	seen := map[string]bool{}
	for range aggregates {
		seen[recv(t, st).GetEvent().GetAggregateKey()] = true
	}
	if len(seen) != aggregates {
		t.Fatalf("%d distinct aggregates delivered, want %d", len(seen), aggregates)
	}
}
