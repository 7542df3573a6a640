package relay

import (
	"context"
	"testing"
	"time"

	"google.golang.org/grpc"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/servertest"
)

// streamEnds runs a replica that reports, through the returned channel,
// the value of at() each time a Subscribe stream ends on the server (after
// its leases were released).
func streamEnds[T any](t *testing.T, at func() T) (*env, <-chan T) {
	t.Helper()
	ends := make(chan T, 10)
	e := newEnv(t, servertest.Options{ServerOptions: []grpc.ServerOption{
		grpc.ChainStreamInterceptor(func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
			err := handler(srv, ss)
			ends <- at()
			return err
		}),
	}})
	return e, ends
}

// A relay shutting down while a publish is still under way after
// DrainTimeout neither nacks nor acks it: the stream stays open (the lease
// held) until the publish has ended, then closing it releases the lease at
// once, with no failure counted against the event. Before, every rolling
// deploy during a slow broker counted a failure per event in flight.
func TestRunnerShutdownReleasesCancelledPublishWithoutNack(t *testing.T) {
	t.Parallel()
	pub := newPublisher()
	pub.block = make(chan struct{}) // never released: the broker hangs
	e, ends := streamEnds(t, pub.cancelled.Load)
	id := e.emit(t, "orders", "a")
	cancelled := make(chan string, 1)
	run := start(t, Config{Conn: e.srv.Conn, Publisher: pub, LeaseTTL: time.Hour, DrainTimeout: time.Second},
		hooks{publishCancelled: func(id string) { cancelled <- id }})
	waitSignal(t, "the publish to start", pub.started)
	if err := run.stop(t); err != nil {
		t.Fatalf("Run: %v", err)
	}
	endedAfterPublish := waitSignal(t, "the stream to end", ends)
	// The server released the lease before the stream's end was reported.
	if a := e.aggregate(t, "orders", "a"); a.GetState() != outboxv1.AggregateState_AGGREGATE_STATE_READY || a.GetFailures() != 0 {
		t.Fatalf("after shutdown the aggregate is %s with %d failures, want ready with 0", a.GetState(), a.GetFailures())
	}
	if !endedAfterPublish {
		t.Fatal("the stream ended while the publish was still under way: its lease was released during the drain")
	}
	select {
	case got := <-cancelled:
		if got != id {
			t.Fatalf("cancelled publish of %s, want %s", got, id)
		}
	default:
		t.Fatal("Run returned without reporting the cancelled publish")
	}

	// Another relay gets the event at once, not after the hour-long TTL.
	next := newPublisher()
	start(t, Config{Conn: e.srv.Conn, Publisher: next}, hooks{})
	if ev := waitSignal(t, "the event to be delivered again", next.started); ev.ID != id || ev.Attempt != 2 {
		t.Fatalf("redelivered %s attempt %d, want %s attempt 2", ev.ID, ev.Attempt, id)
	}
	e.waitPublished(t, id)
	if n := e.aggregate(t, "orders", "a").GetFailures(); n != 0 {
		t.Fatalf("%d failures recorded, want 0", n)
	}
}

// A publish that finishes during the drain is acked before the stream
// closes, so its lease is never released to another relay meanwhile.
func TestRunnerDrainAcksPublishUnderWay(t *testing.T) {
	t.Parallel()
	var id string
	var e *env
	e, ends := streamEnds(t, func() bool {
		// Not e.published: this runs on a server goroutine, where t.Fatal
		// must not be called.
		var p bool
		_ = e.pool.QueryRow(context.Background(),
			`SELECT published_at IS NOT NULL FROM outbox.event WHERE event_id = $1`, id).Scan(&p)
		return p
	})
	id = e.emit(t, "orders", "a")
	pub := newPublisher()
	pub.block = make(chan struct{})
	run := start(t, Config{Conn: e.srv.Conn, Publisher: pub, DrainTimeout: bound}, hooks{})
	openAtEnd(t, pub.block)
	waitSignal(t, "the publish to start", pub.started)
	run.cancel()
	close(pub.block)
	if err := waitSignal(t, "Run to return", run.done); err != nil {
		t.Fatalf("Run: %v", err)
	}
	run.done <- nil
	if !waitSignal(t, "the stream to end", ends) {
		t.Fatal("the stream ended before the drained publish was acked")
	}
	if n := pub.attemptsOf(id); n != 1 {
		t.Fatalf("%d attempts, want 1", n)
	}
}
