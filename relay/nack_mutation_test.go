package relay

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/servertest"
)

// nackCall is one Nack the runner sent and what became of it.
type nackCall struct {
	req *outboxv1.NackRequest
	err error
}

// watchNacks passes each Nack to fault, which may answer it in the
// server's stead (a non-nil error), and reports every call on the returned
// channel.
func watchNacks(fault func(n int32, req *outboxv1.NackRequest) error) (grpc.DialOption, <-chan nackCall) {
	c := make(chan nackCall, 100)
	var n atomic.Int32
	return grpc.WithChainUnaryInterceptor(func(ctx context.Context, m string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		r, ok := req.(*outboxv1.NackRequest)
		if !ok {
			return invoker(ctx, m, req, reply, cc, opts...)
		}
		err := fault(n.Add(1), r)
		if err == nil {
			err = invoker(ctx, m, req, reply, cc, opts...)
		}
		// A copy: the runner may change its request before sending it again.
		// Every call is reported, in order; should the test have stopped
		// reading, the call's own context ends the wait rather than
		// holding the runner's Nack (and so Run) for ever.
		select {
		case c <- nackCall{req: proto.Clone(r).(*outboxv1.NackRequest), err: err}:
		case <-ctx.Done():
		}
		return err
	}), c
}

// nextNack waits for the runner's next Nack, failing the test if the
// runner says instead that it gave the nack up.
func nextNack(t *testing.T, what string, calls <-chan nackCall, gaveUp <-chan string) nackCall {
	t.Helper()
	select {
	case c := <-calls:
		return c
	case msg := <-gaveUp:
		t.Fatalf("waiting for %s, the runner gave the nack up: %q", what, msg)
	case <-time.After(bound):
		t.Fatalf("not reached within %v: %s", bound, what)
	}
	return nackCall{}
}

// A Nack that fails as unavailable (a network blip) is sent again, so the
// failure is counted against the event; given up at once, it would cost a
// whole lease (an hour here) before the event came again, and count
// nothing towards parking.
func TestNackRetriesWhileTheServerIsUnavailable(t *testing.T) {
	t.Parallel()
	e := newEnv(t, servertest.Options{})
	e.emit(t, "orders", "a")
	watch, calls := watchNacks(func(n int32, _ *outboxv1.NackRequest) error {
		if n == 1 {
			return status.Error(codes.Unavailable, "injected: connection reset")
		}
		return nil
	})
	log := newRecords(t)
	gaveUp := log.watch(slog.LevelWarn, "nack failed")
	pub := newPublisher()
	pub.fail = errors.New("broker says no")
	start(t, Config{Conn: e.dial(t, watch), Publisher: pub, LeaseTTL: time.Hour, Logger: slog.New(log)}, hooks{})
	first := nextNack(t, "the first Nack", calls, gaveUp)
	if status.Code(first.err) != codes.Unavailable {
		t.Fatalf("first Nack: %v, want the injected failure", first.err)
	}
	again := nextNack(t, "the Nack to be sent again", calls, gaveUp)
	if again.err != nil || again.req.GetLeaseToken() != first.req.GetLeaseToken() {
		t.Fatalf("second Nack (same lease: %v): %v; want the same nack, applied",
			again.req.GetLeaseToken() == first.req.GetLeaseToken(), again.err)
	}
	if a := e.aggregate(t, "orders", "a"); a.GetFailures() < 1 || !strings.Contains(a.GetLastError(), "broker says no") {
		t.Fatalf("after the retried Nack the aggregate has %d failures, last error %q", a.GetFailures(), a.GetLastError())
	}
}

// A server that refuses a Nack's retry_after (INVALID_ARGUMENT, as one
// that does not cap it does for a delay above its backoff cap) gets the
// nack again without it: the failure still counts, with the server's own
// backoff. Given up instead, the failure would never count and the event
// would wait out its lease.
func TestNackWithoutRetryAfterWhenTheServerRefusesIt(t *testing.T) {
	t.Parallel()
	e := newEnv(t, servertest.Options{})
	e.emit(t, "orders", "a")
	watch, calls := watchNacks(func(_ int32, r *outboxv1.NackRequest) error {
		if r.GetRetryAfter() != nil {
			return status.Error(codes.InvalidArgument, "injected: retry_after above the backoff cap")
		}
		return nil
	})
	log := newRecords(t)
	gaveUp := log.watch(slog.LevelWarn, "nack failed")
	pub := &retryAfterPublisher{after: map[string]time.Duration{"a": time.Hour}}
	start(t, Config{Conn: e.dial(t, watch), Publisher: pub, LeaseTTL: time.Hour, Logger: slog.New(log)}, hooks{})
	if first := nextNack(t, "the first Nack", calls, gaveUp); first.req.GetRetryAfter().AsDuration() != time.Hour {
		t.Fatalf("first Nack carried retry_after %v, want the publisher's 1h", first.req.GetRetryAfter().AsDuration())
	}
	again := nextNack(t, "the Nack without retry_after", calls, gaveUp)
	if again.req.GetRetryAfter() != nil || again.err != nil {
		t.Fatalf("second Nack: retry_after %v, error %v; want none, applied", again.req.GetRetryAfter(), again.err)
	}
	if a := e.aggregate(t, "orders", "a"); a.GetFailures() < 1 || !strings.Contains(a.GetLastError(), "throttled") {
		t.Fatalf("the aggregate has %d failures, last error %q; want the failure counted", a.GetFailures(), a.GetLastError())
	}
}

// A broker error of exactly maxNackText bytes, the most the server stores,
// is sent as it is: only longer texts are cut (and marked with "…").
func TestNackTextKeepsATextOfExactlyTheLimit(t *testing.T) {
	t.Parallel()
	for _, in := range []string{strings.Repeat("x", maxNackText), strings.Repeat("é", maxNackText/2)} {
		if got := nackText(errors.New(in)); got != in {
			// The tail shows whether it was cut; a result shorter than
			// the tail is shown whole rather than sliced out of range.
			tail := got[max(0, len(got)-8):]
			t.Errorf("nackText of %d bytes returned %d bytes ending %q, want it unchanged", len(in), len(got), tail)
		}
	}
}
