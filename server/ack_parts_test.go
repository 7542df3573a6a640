package server_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/google/uuid"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/store"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/server"
)

// An Ack call whose acks go to two committers answers only once both parts
// were applied, even when the first it waits for failed: the answer says
// each ack was applied if it could be, and a relay counts on that before it
// nacks a later revision. The part of the first committer fails (afterAck),
// the other's statement waits for the test's lock on its event
// (pg_blocking_pids); the call must not answer before that event is
// published. Kills a call that returns at its first failed part.
func TestAnAckCallWaitsForEveryPartAfterOneFailed(t *testing.T) {
	t.Parallel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, func(c *server.Config) { c.AckCommitters = 2; c.AckLinger = 0 })
	const aggregates = 16
	for i := range aggregates {
		emit(t, pool, "orders", fmt.Sprintf("a%d", i), 1)
	}
	waitDiscovered(t, pool, aggregates)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: aggregates})
	_, next := receive(t, st)
	// One delivery of each committer: first fails, second is held.
	var first, second *outboxv1.SubscribeResponse
	for range aggregates {
		d := next()
		switch r.Server.AckCommitterOf(d.GetLeaseToken()) {
		case 0:
			first = d
		case 1:
			second = d
		}
	}
	if first == nil || second == nil {
		t.Fatalf("%d deliveries did not reach both committers", aggregates)
	}
	failing := uuid.MustParse(first.GetEvent().GetEventId())
	heldID := second.GetEvent().GetEventId()
	r.Server.SetAfterAck(func(res []store.AckResult, err error) ([]store.AckResult, error) {
		for _, x := range res {
			if x.EventID == failing {
				return nil, errors.New("injected: the first part failed")
			}
		}
		return res, err
	})

	lock, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer lock.Rollback(context.Background())
	if _, err := lock.Exec(ctx, `SELECT 1 FROM outbox.event WHERE event_id = $1 FOR UPDATE`, heldID); err != nil {
		t.Fatal(err)
	}
	type answer struct {
		err           error
		heldPublished bool
	}
	answered := make(chan answer, 1)
	go func() {
		var a answer
		_, a.err = r.Relay.Ack(ctx, &outboxv1.AckRequest{Acks: []*outboxv1.AckItem{
			{EventId: first.GetEvent().GetEventId(), LeaseToken: first.GetLeaseToken()},
			{EventId: heldID, LeaseToken: second.GetLeaseToken()},
		}})
		// Read at once: was the held part applied when the call answered?
		_ = pool.QueryRow(context.Background(), `SELECT published_at IS NOT NULL FROM outbox.event WHERE event_id = $1`, heldID).Scan(&a.heldPublished)
		answered <- a
	}()
	waitBlocked(t, ctx, pool, "the second part's ack", "%outbox.ack(%")
	// The first part has failed or is about to; a call that answers at
	// its first failure does so now, while the second is still held.
	select {
	case a := <-answered:
		t.Fatalf("the call answered (%v) while its second part waited for its event's lock (published: %v)", a.err, a.heldPublished)
	case <-time.After(time.Second): // the window in which a wrong answer would come; the right one cannot
	}
	if err := lock.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	a := <-answered
	if a.err == nil {
		t.Error("the call succeeded though its first part failed")
	}
	if !a.heldPublished {
		t.Error("the call answered before its second part was applied")
	}
}
