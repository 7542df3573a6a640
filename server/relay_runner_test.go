package server_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/relay"
)

// blockingPublisher holds every publish until released, counting attempts.
type blockingPublisher struct {
	mu       sync.Mutex
	attempts map[string]int
	started  chan struct{}
	release  chan struct{}
}

func (p *blockingPublisher) Publish(ctx context.Context, ev relay.Event) error {
	p.mu.Lock()
	p.attempts[ev.ID]++
	p.mu.Unlock()
	select {
	case p.started <- struct{}{}:
	default:
	}
	select {
	case <-p.release:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// A publish slower than the lease TTL keeps its lease: the runner extends it,
// so the event is neither redelivered nor marked before the broker accepts.
// A second session with spare credit subscribes once the runner holds the
// lease: had the lease lapsed, the event would have been delivered to it.
func TestRunnerExtendsLeaseOfSlowPublish(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	ids := emit(t, pool, "orders", "slow", 1)

	pub := &blockingPublisher{attempts: map[string]int{}, started: make(chan struct{}, 1), release: make(chan struct{})}
	runner, err := relay.NewRunner(relay.Config{Conn: r.Conn, Publisher: pub, LeaseTTL: 2 * time.Second, MaxInFlight: 1})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- runner.Run(ctx) }()
	waitChan(t, "the publish to start", pub.started)

	other := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{RelayId: "competitor", Streams: []string{"orders"}, MaxInFlight: 10})
	stolen := make(chan *outboxv1.SubscribeResponse, 1)
	go func() {
		if d, err := other.Recv(); err == nil {
			stolen <- d
		}
	}()

	lease := func() (exp time.Time, epoch int64) {
		if err := pool.QueryRow(ctx, `SELECT lease_expires_at, epoch FROM outbox.delivery WHERE aggregate_key = 'slow'`).Scan(&exp, &epoch); err != nil {
			t.Fatal(err)
		}
		return exp, epoch
	}
	first, epoch := lease()
	// Wait until the runner's lease (same epoch) has been extended 1.5 TTLs
	// past the original expiry: without extension it would have lapsed by
	// then, and the second session claimed it (its poll interval is 200 ms).
	// The 2 s TTL leaves the runner a second for each extension, a wide
	// margin on a loaded machine.
	waitFor(t, func() int32 {
		exp, e := lease()
		if e != epoch {
			t.Fatalf("lease epoch went from %d to %d: the lease lapsed and was claimed again", epoch, e)
		}
		if exp.After(first.Add(3 * time.Second)) {
			return 1
		}
		return 0
	})
	if publishedAt(t, pool, ids[0].String()) != nil {
		t.Fatal("marked published before the broker accepted")
	}
	close(pub.release)
	waitPending(t, pool, 0)
	cancel()
	if err := waitChan(t, "Run to return", done); err != nil {
		t.Fatalf("Run: %v", err)
	}
	select {
	case d := <-stolen:
		t.Fatalf("event %s (attempt %d) was delivered to the second session: the lease lapsed", d.GetEvent().GetEventId(), d.GetAttempt())
	default:
	}
	pub.mu.Lock()
	defer pub.mu.Unlock()
	if n := pub.attempts[ids[0].String()]; n != 1 {
		t.Fatalf("%d publish attempts, want 1 (the lease should never have lapsed)", n)
	}
}

// Deliveries and ExtendLease state the lease's remaining time as a
// duration, so that relays need not compare their clock with the
// database's: the TTL the lease was just set to.
func TestRelayStatesLeaseTTLRemaining(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	emit(t, pool, "orders", "a", 1)
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 1, LeaseTtl: durationpb.New(5 * time.Second)})
	d := recv(t, st)
	if got := d.GetLeaseTtlRemaining(); got == nil || got.AsDuration() != 5*time.Second {
		t.Fatalf("delivery states lease_ttl_remaining %v, want 5s", got)
	}
	res, err := r.Relay.ExtendLease(ctx, &outboxv1.ExtendLeaseRequest{
		EventId: d.GetEvent().GetEventId(), LeaseToken: d.GetLeaseToken(), Ttl: durationpb.New(7 * time.Second)})
	if err != nil {
		t.Fatal(err)
	}
	if got := res.GetLeaseTtlRemaining(); got == nil || got.AsDuration() != 7*time.Second {
		t.Fatalf("ExtendLease states lease_ttl_remaining %v, want 7s", got)
	}
}

// waitChan receives from c, failing the test after a bound: a hang guard,
// so that a wedged runner fails this test instead of the whole suite's
// timeout.
func waitChan[T any](t *testing.T, what string, c <-chan T) T {
	t.Helper()
	select {
	case v := <-c:
		return v
	case <-time.After(30 * time.Second):
		t.Fatalf("not reached within 30s: %s", what)
		var zero T
		return zero
	}
}
