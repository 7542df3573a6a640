package server_test

import (
	"context"
	"sync"
	"testing"
	"time"

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
func TestRunnerExtendsLeaseOfSlowPublish(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	ids := emit(t, pool, "orders", "slow", 1)

	pub := &blockingPublisher{attempts: map[string]int{}, started: make(chan struct{}, 1), release: make(chan struct{})}
	runner, err := relay.NewRunner(relay.Config{Conn: r.Conn, Publisher: pub, LeaseTTL: time.Second, MaxInFlight: 1})
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { defer close(done); _ = runner.Run(ctx) }()
	<-pub.started

	var first time.Time
	if err := pool.QueryRow(ctx, `SELECT lease_expires_at FROM outbox.delivery WHERE aggregate_key = 'slow'`).Scan(&first); err != nil {
		t.Fatal(err)
	}
	// Wait until the lease has been extended past the original expiry twice
	// over: without extension the lease would have lapsed by then.
	waitFor(t, func() int32 {
		var exp time.Time
		_ = pool.QueryRow(ctx, `SELECT lease_expires_at FROM outbox.delivery WHERE aggregate_key = 'slow'`).Scan(&exp)
		if exp.After(first.Add(1500 * time.Millisecond)) {
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
	<-done
	pub.mu.Lock()
	defer pub.mu.Unlock()
	if n := pub.attempts[ids[0].String()]; n != 1 {
		t.Fatalf("%d publish attempts, want 1 (the lease should never have lapsed)", n)
	}
}
