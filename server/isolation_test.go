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

// One producer transaction left open slows nothing but its own aggregate:
// for 30 seconds, while it holds its aggregate's order lock, producers of
// other aggregates run as fast as two replicas with a relay each deliver, and
// every event arrives promptly (within maxDelay of its commit, a bound far
// above the milliseconds it takes, so that only a freeze fails it). The open
// transaction's event follows once it commits.
func TestOpenProducerTransactionFreezesNothing(t *testing.T) {
	t.Parallel()
	const (
		window   = 30 * time.Second
		maxDelay = 3 * time.Second
	)
	ctx, cancel := context.WithTimeout(context.Background(), 3*window)
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

	var (
		mu        sync.Mutex
		committed = map[string]time.Time{} // event id → commit
		received  = map[string]time.Time{} // event id → first delivery
		late      []string
	)
	delivered := make(chan string, 1024)
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
				now := time.Now()
				mu.Lock()
				if _, seen := received[id]; !seen {
					received[id] = now
				}
				mu.Unlock()
				if _, err := r.Relay.Ack(relayCtx, &outboxv1.AckRequest{Acks: []*outboxv1.AckItem{{EventId: id, LeaseToken: d.GetLeaseToken()}}}); err != nil {
					if relayCtx.Err() == nil {
						t.Errorf("ack: %v", err)
					}
					return
				}
				select {
				case delivered <- id:
				case <-relayCtx.Done():
					return
				}
			}
		}()
	}

	// Producers of 100 other aggregates, as fast as delivery takes their
	// events, for the window: at most maxBacklog undelivered, so a delivery
	// that stalls for maxDelay fails the test, and a slow machine does not.
	const maxBacklog = 64
	produced, deliveredN := 0, 0
	deadline := time.Now().Add(window)
	for i := 0; time.Now().Before(deadline); i++ {
		for produced-deliveredN >= maxBacklog {
			select {
			case <-delivered:
				deliveredN++
			case <-time.After(maxDelay):
				t.Fatalf("no event delivered for %v while a producer transaction was open (%d of %d delivered)", maxDelay, deliveredN, produced)
			}
		}
		e, err := client.Emit(ctx, pool, client.Event{Stream: "orders", AggregateKey: fmt.Sprintf("k-%d", i%100), Type: "T", Payload: []byte(`{}`)})
		if err != nil {
			t.Fatal(err)
		}
		mu.Lock()
		committed[e.ID.String()] = time.Now()
		mu.Unlock()
		produced++
	}
	if err := held.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	committed[heldEvent.ID.String()] = time.Now()
	mu.Unlock()

	// Every event arrives; the held one too, after its commit.
	want := produced + 1
	for {
		mu.Lock()
		n := len(received)
		mu.Unlock()
		if n >= want {
			break
		}
		select {
		case <-delivered:
		case <-ctx.Done():
			t.Fatalf("%d of %d events delivered", n, want)
		}
	}
	stopRelays()
	relays.Wait()

	mu.Lock()
	defer mu.Unlock()
	for id, at := range committed {
		got, ok := received[id]
		switch {
		case !ok:
			t.Errorf("event %s never delivered", id)
		case got.Sub(at) > maxDelay:
			late = append(late, fmt.Sprintf("%s after %v", id, got.Sub(at)))
		}
	}
	if len(late) > 0 {
		t.Fatalf("%d of %d events took longer than %v from commit to relay, e.g. %v", len(late), len(committed), maxDelay, late[:min(3, len(late))])
	}
	if produced < 100 {
		t.Fatalf("only %d events produced in %v", produced, window)
	}
	t.Logf("%d events through two replicas while a producer transaction stayed open for %v", produced, window)
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
