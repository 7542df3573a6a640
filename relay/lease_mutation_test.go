package relay

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/servertest"
)

// A publish that outlives its lease many times over keeps it: each
// extension counts from the expiry the previous one granted, so the runner
// goes on extending long after the lease it was delivered with would have
// lapsed. (Counting from the delivery's expiry instead, it would crowd its
// extensions ever closer to that moment and then stop.)
func TestExtensionsKeepALeaseForManyTTLs(t *testing.T) {
	t.Parallel()
	e := newEnv(t, servertest.Options{})
	id := e.emit(t, "orders", "slow")
	watch, extended := watchExtensions()
	stopped := make(chan bool, 10)
	pub := newPublisher()
	pub.block = make(chan struct{})
	const ttl = 2 * time.Second
	start(t, Config{Conn: e.dial(t, watch), Publisher: pub, LeaseTTL: ttl, MaxInFlight: 1},
		hooks{extendStopped: func(_ string, lost bool) { stopped <- lost }})
	openAtEnd(t, pub.block)
	waitSignal(t, "the publish to start", pub.started)
	began := time.Now()
	c := e.competitor(t, "orders")
	// Wait for an extension sent three TTLs into the publish: by then the
	// lease rests on extensions of extensions, not on the delivery.
	for done := false; !done; {
		select {
		case x := <-extended:
			done = x.sent.Sub(began) > 3*ttl
		case lost := <-stopped:
			t.Fatalf("the runner stopped extending the lease (lost=%v) while its publish was still under way", lost)
		case <-time.After(bound):
			t.Fatalf("no extension sent %v into the publish within %v", 3*ttl, bound)
		}
	}
	c.none(t)
	close(pub.block)
	e.waitPublished(t, id)
	c.none(t)
	if n := pub.attemptsOf(id); n != 1 {
		t.Fatalf("%d publish attempts, want 1", n)
	}
}

// Once the server answers that a lease is gone (FAILED_PRECONDITION),
// the runner sends no further ExtendLease for it: retrying the same token
// cannot succeed. The server's answer is injected here, so the lease
// itself lapses unextended; by the time a second session receives the
// event, the runner would have retried several times had it kept on.
func TestNoExtensionAfterTheServerSaysTheLeaseIsGone(t *testing.T) {
	t.Parallel()
	e := newEnv(t, servertest.Options{})
	id := e.emit(t, "orders", "slow")
	var calls atomic.Int32
	gone := grpc.WithChainUnaryInterceptor(func(ctx context.Context, m string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		if _, ok := req.(*outboxv1.ExtendLeaseRequest); ok {
			calls.Add(1)
			return status.Error(codes.FailedPrecondition, "injected: the lease is gone")
		}
		return invoker(ctx, m, req, reply, cc, opts...)
	})
	stopped := make(chan bool, 100)
	pub := newPublisher()
	pub.block = make(chan struct{})
	start(t, Config{Conn: e.dial(t, gone), Publisher: pub, LeaseTTL: 2 * time.Second, MaxInFlight: 1},
		hooks{extendStopped: func(_ string, lost bool) { stopped <- lost }})
	// The publish is never let through: the test ends with it held.
	openAtEnd(t, pub.block)
	waitSignal(t, "the publish to start", pub.started)
	c := e.competitor(t, "orders")
	if lost := waitSignal(t, "extending to stop", stopped); !lost {
		t.Fatal("the runner stopped extending because the lease's time ran out (lost=false), want it to stop at the server's FAILED_PRECONDITION")
	}
	if d := waitSignal(t, "the lapsed lease to reach a second session", c.got); d.GetEvent().GetEventId() != id {
		t.Fatalf("the second session received %s, want %s", d.GetEvent().GetEventId(), id)
	}
	if n := calls.Load(); n != 1 {
		t.Fatalf("%d ExtendLease calls for a lease the server said was gone, want 1", n)
	}
}
