package relay

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/servertest"
)

// extension is one ExtendLease the server granted: for which event, and
// when the runner sent it.
type extension struct {
	eventID string
	sent    time.Time
}

// watchExtensions reports, on the returned channel, the ExtendLeases the
// server grants on a connection dialled with the option. The tests wait for
// a count of them or for one that meets a condition, which later ones meet
// as well; so once 1000 wait unread, further ones are dropped rather than
// holding the runner's ExtendLease (and so Run) until someone reads.
func watchExtensions() (grpc.DialOption, <-chan extension) {
	c := make(chan extension, 1000)
	return grpc.WithChainUnaryInterceptor(func(ctx context.Context, m string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		sent := time.Now()
		err := invoker(ctx, m, req, reply, cc, opts...)
		if r, ok := req.(*outboxv1.ExtendLeaseRequest); ok && err == nil {
			select {
			case c <- extension{r.GetEventId(), sent}:
			default:
			}
		}
		return err
	}), c
}

// slowPublishKeepsLease runs one publish that outlives its lease TTL on a
// runner dialled with opts, while a second session with spare credit
// would receive the event if the lease ever lapsed. It returns once the
// lease was extended extensions times, the publish was released, and the
// event was marked published after exactly one attempt.
func slowPublishKeepsLease(t *testing.T, ttl time.Duration, extensions int, opts ...grpc.DialOption) {
	t.Helper()
	e := newEnv(t, servertest.Options{})
	id := e.emit(t, "orders", "slow")
	// Outermost, so it sees what the server answered.
	watch, extended := watchExtensions()
	opts = append([]grpc.DialOption{watch}, opts...)
	pub := newPublisher()
	pub.block = make(chan struct{})
	start(t, Config{Conn: e.dial(t, opts...), Publisher: pub, LeaseTTL: ttl, MaxInFlight: 1}, hooks{})
	openAtEnd(t, pub.block)
	waitSignal(t, "the publish to start", pub.started)
	c := e.competitor(t, "orders")

	// Each extension succeeds only while the runner's lease (its epoch) is
	// current; had it lapsed, the competitor would have claimed it.
	for range extensions {
		waitSignal(t, "the lease to be extended", extended)
	}
	c.none(t)
	close(pub.block)
	e.waitPublished(t, id)
	c.none(t)
	if n := pub.attemptsOf(id); n != 1 {
		t.Fatalf("%d publish attempts, want 1", n)
	}
}

// A publish slower than its lease keeps the lease through extensions that
// fail for a while (the server unreachable): the runner retries until one
// succeeds, before the lease's expiry. Before, it gave up after the first
// failure and the event was delivered again.
func TestRunnerRetriesFailedExtensions(t *testing.T) {
	t.Parallel()
	var failed atomic.Int32
	flaky := grpc.WithChainUnaryInterceptor(func(ctx context.Context, m string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		// The first three calls of each extension fail, as while the
		// server is unreachable; the fourth goes through.
		if _, ok := req.(*outboxv1.ExtendLeaseRequest); ok && failed.Add(1)%4 != 0 {
			return status.Error(codes.Unavailable, "injected: connection refused")
		}
		return invoker(ctx, m, req, reply, cc, opts...)
	})
	// With a 3 s lease, the second extension comes after the first lease
	// would have expired; each one has 1.5 s, against about 0.4 s of
	// retries, to get through.
	slowPublishKeepsLease(t, 3*time.Second, 2, flaky)
	if n := failed.Load(); n < 8 {
		t.Fatalf("%d ExtendLease calls, want at least 8 (3 failures before each of 2 successes)", n)
	}
}

// Extensions are scheduled by the remaining time the server states,
// measured on the relay's own clock, not by lease_expires_at read against
// it: a relay whose clock runs an hour ahead of the database's (simulated by
// shifting every timestamp it receives) keeps its lease. Before, it saw the
// lease as already expired and never extended it.
func TestRunnerExtendsByItsOwnClock(t *testing.T) {
	t.Parallel()
	const skew = time.Hour
	shift := func(ts *timestamppb.Timestamp) *timestamppb.Timestamp {
		return timestamppb.New(ts.AsTime().Add(-skew))
	}
	unary := grpc.WithChainUnaryInterceptor(func(ctx context.Context, m string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		err := invoker(ctx, m, req, reply, cc, opts...)
		if r, ok := reply.(*outboxv1.ExtendLeaseResponse); ok && err == nil {
			r.LeaseExpiresAt = shift(r.LeaseExpiresAt)
		}
		return err
	})
	stream := grpc.WithChainStreamInterceptor(func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, m string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
		s, err := streamer(ctx, desc, cc, m, opts...)
		return skewedStream{s, shift}, err
	})
	slowPublishKeepsLease(t, 2*time.Second, 3, unary, stream)
}

type skewedStream struct {
	grpc.ClientStream
	shift func(*timestamppb.Timestamp) *timestamppb.Timestamp
}

func (s skewedStream) RecvMsg(m any) error {
	err := s.ClientStream.RecvMsg(m)
	if d, ok := m.(*outboxv1.SubscribeResponse); ok && err == nil {
		d.LeaseExpiresAt = s.shift(d.LeaseExpiresAt)
	}
	return err
}

// A lease the server says is gone (here: an operator skipped the event
// during its slow publish, and ExtendLease answers FAILED_PRECONDITION) is
// not extended again: retrying the same token cannot succeed.
func TestRunnerStopsExtendingLostLease(t *testing.T) {
	t.Parallel()
	e := newEnv(t, servertest.Options{})
	id := e.emit(t, "orders", "slow")
	stopped := make(chan bool, 10)
	pub := newPublisher()
	pub.block = make(chan struct{})
	start(t, Config{Conn: e.srv.Conn, Publisher: pub, LeaseTTL: 2 * time.Second}, hooks{
		extendStopped: func(_ string, lost bool) { stopped <- lost },
	})
	openAtEnd(t, pub.block)
	waitSignal(t, "the publish to start", pub.started)
	if _, err := e.srv.Admin.SkipEvent(context.Background(), &outboxv1.SkipEventRequest{EventId: id, Reason: "test", Actor: "test"}); err != nil {
		t.Fatal(err)
	}
	if lost := waitSignal(t, "extending to stop", stopped); !lost {
		t.Fatal("the runner kept extending until the lease's time ran out, want it to stop at the server's answer")
	}
	close(pub.block)
}
