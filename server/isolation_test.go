package server_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/outboxd/outboxd/client"
	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/server"
)

// One producer transaction left open freezes nothing but its own aggregate:
// while it stays open (and holds its aggregate's order lock), rounds of
// events of 100 other aggregates are each delivered completely through two
// replicas with a relay each, and the open transaction's event is not; it
// follows once it commits. Each round waits for its own deliveries, not for
// a clock: a freeze shows as a round that never completes, caught by the
// test's deadline, and a slow machine only makes the test slower.
func TestOpenProducerTransactionFreezesNothing(t *testing.T) {
	t.Parallel()
	const (
		rounds     = 8
		perRound   = 100
		aggregates = 100
	)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	replicas := []*replica{startReplica(t, url, nil), startReplica(t, url, nil)}

	held, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer held.Rollback(context.WithoutCancel(ctx))
	heldEvent, err := client.Emit(ctx, held, client.Event{Stream: "orders", AggregateKey: "held", Type: "T", Payload: []byte(`{}`)})
	if err != nil {
		t.Fatal(err)
	}
	var heldXID string
	if err := held.QueryRow(ctx, `SELECT pg_current_xact_id()::text`).Scan(&heldXID); err != nil {
		t.Fatal(err)
	}

	// Each relay acks what it receives and reports every first delivery.
	var (
		mu       sync.Mutex
		received = map[string]bool{}
	)
	delivered := make(chan string, rounds*perRound+1)
	relayCtx, stopRelays := context.WithCancel(ctx)
	defer stopRelays()
	var relays sync.WaitGroup
	for i, r := range replicas {
		st, err := r.Relay.Subscribe(relayCtx, &outboxv1.SubscribeRequest{RelayId: fmt.Sprintf("relay-%d", i), MaxInFlight: 32})
		if err != nil {
			t.Fatal(err)
		}
		relays.Add(1)
		go func() {
			defer relays.Done()
			for {
				d, err := st.Recv()
				if err != nil {
					if relayCtx.Err() == nil && !errors.Is(err, io.EOF) && status.Code(err) != codes.Canceled {
						t.Errorf("relay %d: %v", i, err)
					}
					return
				}
				id := d.GetEvent().GetEventId()
				if _, err := r.Relay.Ack(relayCtx, &outboxv1.AckRequest{Acks: []*outboxv1.AckItem{{EventId: id, LeaseToken: d.GetLeaseToken()}}}); err != nil {
					if relayCtx.Err() == nil {
						t.Errorf("ack: %v", err)
					}
					return
				}
				mu.Lock()
				first := !received[id]
				received[id] = true
				mu.Unlock()
				if first {
					delivered <- id
				}
			}
		}()
	}

	// waitFor blocks until every event in want has been delivered.
	waitFor := func(what string, want map[string]bool) {
		t.Helper()
		for len(want) > 0 {
			select {
			case id := <-delivered:
				if id == heldEvent.ID.String() && what != "the held event" {
					t.Fatalf("the open transaction's event %s was delivered before it committed", id)
				}
				delete(want, id)
			case <-ctx.Done():
				t.Fatalf("%s: %d events never delivered (delivery froze)", what, len(want))
			}
		}
	}
	for round := range rounds {
		want := map[string]bool{}
		for i := range perRound {
			e, err := client.Emit(ctx, pool, client.Event{Stream: "orders", AggregateKey: fmt.Sprintf("k-%d", (round*perRound+i)%aggregates), Type: "T", Payload: []byte(`{}`)})
			if err != nil {
				t.Fatal(err)
			}
			want[e.ID.String()] = true
		}
		waitFor(fmt.Sprintf("round %d", round), want)
	}

	// The producer transaction was open for all of it.
	var open bool
	if err := pool.QueryRow(ctx, `SELECT pg_xact_status($1::xid8) = 'in progress'`, heldXID).Scan(&open); err != nil {
		t.Fatal(err)
	}
	if !open {
		t.Fatal("the held producer transaction ended before the rounds did")
	}
	if err := held.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	waitFor("the held event", map[string]bool{heldEvent.ID.String(): true})
	stopRelays()
	relays.Wait()
	t.Logf("%d events through two replicas while a producer transaction stayed open", rounds*perRound)
}

// An event whose delivery would exceed the one-message limit every relay
// receives is parked with the reason, not sent: sending it would end the
// relay's stream, and the next claim would pick it again, forever. (The
// insert trigger bounds every part of an event so this cannot happen; the
// test enlarges a committed payload behind its back.)
func TestUndeliverableEventIsParkedNotSent(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	big := emit(t, pool, "orders", "big", 1)[0]
	testdb.RewriteEvents(t, pool, `UPDATE outbox.event SET payload = jsonb_build_object('x', repeat('a', 5 << 20)) WHERE event_id = $1`, big)
	r := startReplica(t, url, nil)
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 4})
	waitState(t, pool, "big", "parked")
	var reason string
	if err := pool.QueryRow(ctx, `SELECT parked_reason FROM outbox.delivery WHERE aggregate_key = 'big'`).Scan(&reason); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(reason, "undeliverable") || !strings.Contains(reason, "4194304-byte limit") {
		t.Fatalf("parked_reason = %q", reason)
	}
	// The attempt history says so too (outbox.park).
	at, err := r.Admin.ListAttempts(ctx, &outboxv1.ListAttemptsRequest{EventId: big.String()})
	if err != nil || len(at.GetAttempts()) != 1 || at.GetAttempts()[0].GetOutcome() != outboxv1.AttemptOutcome_ATTEMPT_OUTCOME_PARKED ||
		at.GetAttempts()[0].GetError() != reason {
		t.Fatalf("attempts of the parked event: %v, %v", at, err)
	}
	// The stream lives on and carries the next event.
	next := emit(t, pool, "orders", "small", 1)[0]
	if d := recv(t, st); d.GetEvent().GetEventId() != next.String() {
		t.Fatalf("got %v, want the small event", d.GetEvent())
	}
}

// An aggregate whose events are committed but not yet discovered is known
// to the admin plane: GetAggregate shows it ready with its pending events,
// and RetryAggregate says there is nothing to retry rather than NOT_FOUND.
func TestAdminSeesAggregatesBeforeDiscovery(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	emit(t, pool, "orders", "seed", 1)
	r := startReplica(t, url, func(c *server.Config) {
		// One round at start, then none within the test.
		c.DiscoveryInterval, c.DiscoveryIdleInterval = time.Hour, time.Hour
	})
	waitState(t, pool, "seed", "ready") // the start-up round has run
	emit(t, pool, "orders", "fresh", 2)
	res, err := r.Admin.GetAggregate(ctx, &outboxv1.GetAggregateRequest{Stream: "orders", AggregateKey: "fresh"})
	if err != nil {
		t.Fatal(err)
	}
	if a := res.GetAggregate(); a.GetState() != outboxv1.AggregateState_AGGREGATE_STATE_READY || a.GetPendingEvents() != 2 || a.GetNextPendingRevision() != 1 {
		t.Fatalf("undiscovered aggregate: %v", a)
	}
	_, err = r.Admin.RetryAggregate(ctx, &outboxv1.RetryAggregateRequest{Stream: "orders", AggregateKey: "fresh"})
	if status.Code(err) != codes.FailedPrecondition {
		t.Fatalf("retry of an undiscovered aggregate: %v, want FailedPrecondition", err)
	}
	_, err = r.Admin.RetryAggregate(ctx, &outboxv1.RetryAggregateRequest{Stream: "orders", AggregateKey: "never"})
	if status.Code(err) != codes.NotFound {
		t.Fatalf("retry of an unknown aggregate: %v, want NotFound", err)
	}
}
