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

// A claim that answers a wake-up and finds work leaves the group's poll
// where it was: the work was announced, so it says nothing of work no
// wake-up announces, which is what the poll is for. (Such claims used to
// bring the poll back to 2 ms, after which the group polled four or five
// times, all empty, after every claim that found work; under a held xmin
// horizon each of those claims read every dead entry at the front of the
// claim index's ready range.)
func TestAClaimAnsweringAWakeUpLeavesThePollAlone(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	// No dispatch: the round makes the event ready and wakes the session,
	// whose claim leases it.
	r := startReplica(t, url, func(c *server.Config) { c.PollInterval = time.Hour; c.NoDispatch = true })
	claims := countClaims(r)
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 4, LeaseTtl: durationpb.New(time.Hour)})
	waitFor(t, func() int32 { return b2i(r.Server.IdleSessions() == 1) })

	r.Server.SetPollBackoff(time.Hour)
	// A poll that fired just before is armed for the hour too once its
	// claim is done and the session waits again.
	var fireAt time.Time
	var polls uint64
	waitFor(t, func() int32 {
		at, armed, n, ok := r.Server.PollTimer()
		fireAt, polls = at, n
		return b2i(ok && armed && time.Until(at) > 30*time.Minute && r.Server.IdleSessions() == 1)
	})
	c0 := claims.Load()
	emit(t, pool, "orders", "a", 1)
	if d := recv(t, st); d.GetEvent().GetAggregateKey() != "a" {
		t.Fatalf("got %v, want the delivery of orders/a", d)
	}
	if claims.Load() == c0 {
		t.Fatal("the event reached the relay without a claim; the test needs the wake-up's claim")
	}
	// The session waits again once its claim is accounted for.
	waitFor(t, func() int32 { return b2i(r.Server.IdleSessions() == 1) })
	fireAt1, armed1, polls1, _ := r.Server.PollTimer()
	if polls1 != polls || !armed1 || !fireAt1.Equal(fireAt) {
		t.Fatalf("after a claim that answered a wake-up: %d polls fired, armed %v, due in %v; want none fired and the poll still due in %v",
			polls1-polls, armed1, time.Until(fireAt1).Round(time.Millisecond), time.Until(fireAt).Round(time.Second))
	}
}
