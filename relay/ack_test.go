package relay

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/servertest"
)

// poisonAcks fails every Ack request that carries the poison event with
// code, as a server does whose group commit cannot take one item; requests
// without it reach the real server.
type poisonAcks struct {
	poison string
	code   codes.Code
	mu     sync.Mutex
	sizes  []int // sizes of the requests that carried the poison
}

func (p *poisonAcks) interceptor() grpc.UnaryClientInterceptor {
	return func(ctx context.Context, m string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		if r, ok := req.(*outboxv1.AckRequest); ok {
			for _, it := range r.GetAcks() {
				if it.GetEventId() == p.poison {
					p.mu.Lock()
					p.sizes = append(p.sizes, len(r.GetAcks()))
					p.mu.Unlock()
					return status.Errorf(p.code, "injected: the batch holding %s fails", p.poison)
				}
			}
		}
		return invoker(ctx, m, req, reply, cc, opts...)
	}
}

// One ack the server cannot take does not hold up the others: the batch
// that carries it is split until it is alone and given up, and every other
// event is marked published, whether the server refuses the batch outright
// (INTERNAL) or keeps failing it as unavailable (after AckRetryTimeout).
// Before, the batcher retried such a batch forever and sent no other ack.
func TestRunnerSplitsAckBatchAroundBadItem(t *testing.T) {
	t.Parallel()
	for _, code := range []codes.Code{codes.Internal, codes.Unavailable} {
		t.Run(code.String(), func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, servertest.Options{})
			const n = 16
			var ids []string
			for i := range n {
				ids = append(ids, e.emit(t, "orders", fmt.Sprintf("k%02d", i)))
			}
			poison := &poisonAcks{poison: ids[n/2], code: code}
			givenUp := make(chan int, n)
			pub := newPublisher()
			pub.block = make(chan struct{})
			start(t, Config{
				Conn: e.dial(t, grpc.WithChainUnaryInterceptor(poison.interceptor())), Publisher: pub,
				MaxInFlight: n, AckMaxDelay: time.Hour, AckBatchSize: n, AckRetryTimeout: 200 * time.Millisecond,
			}, hooks{ackGivenUp: func(k int) { givenUp <- k }})
			openAtEnd(t, pub.block)
			// Hold every publish until all have started, so that their acks
			// travel in one batch of n (AckMaxDelay waits for a full batch).
			for range n {
				waitSignal(t, "publishes to start", pub.started)
			}
			close(pub.block)

			var others []string
			for _, id := range ids {
				if id != poison.poison {
					others = append(others, id)
				}
			}
			e.waitPublished(t, others...)
			if k := waitSignal(t, "the bad ack to be given up", givenUp); k != 1 {
				t.Fatalf("%d acks given up together, want the bad one alone", k)
			}
			if e.published(t, poison.poison) {
				t.Fatal("the event whose ack failed is marked published")
			}
			poison.mu.Lock()
			defer poison.mu.Unlock()
			if poison.sizes[0] != n {
				t.Fatalf("first request carrying the bad ack had %d items, want one batch of %d", poison.sizes[0], n)
			}
			// Halving from 16 reaches the bad item alone in 4 splits.
			for _, want := range []int{8, 4, 2, 1} {
				if !containsInt(poison.sizes, want) {
					t.Errorf("no request of %d items carried the bad ack (requests: %v)", want, poison.sizes)
				}
			}
			select {
			case k := <-givenUp:
				t.Fatalf("%d more acks given up", k)
			default:
			}
		})
	}
}

func containsInt(s []int, v int) bool {
	for _, x := range s {
		if x == v {
			return true
		}
	}
	return false
}

// While the server is down, a batch is retried for AckRetryTimeout, tried
// once more as two halves, and given up: two more requests, not one per
// item, and the runner goes on (here the stream is still up, so the
// events' leases stay held until they expire).
func TestRunnerGivesUpAckBatchWhenServerIsDown(t *testing.T) {
	t.Parallel()
	e := newEnv(t, servertest.Options{})
	const n = 16
	var ids []string
	for i := range n {
		ids = append(ids, e.emit(t, "orders", fmt.Sprintf("k%02d", i)))
	}
	var mu sync.Mutex
	var sizes []int
	down := grpc.WithChainUnaryInterceptor(func(ctx context.Context, m string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		if r, ok := req.(*outboxv1.AckRequest); ok {
			mu.Lock()
			sizes = append(sizes, len(r.GetAcks()))
			mu.Unlock()
			return status.Error(codes.Unavailable, "injected: connection refused")
		}
		return invoker(ctx, m, req, reply, cc, opts...)
	})
	givenUp := make(chan int, n)
	pub := newPublisher()
	pub.block = make(chan struct{})
	start(t, Config{
		Conn: e.dial(t, down), Publisher: pub,
		MaxInFlight: n, AckMaxDelay: time.Hour, AckBatchSize: n, AckRetryTimeout: 200 * time.Millisecond,
	}, hooks{ackGivenUp: func(k int) { givenUp <- k }})
	openAtEnd(t, pub.block)
	for range n {
		waitSignal(t, "publishes to start", pub.started)
	}
	close(pub.block)
	if k := waitSignal(t, "the batch to be given up", givenUp); k != n {
		t.Fatalf("%d acks given up, want the whole batch of %d at once", k, n)
	}
	mu.Lock()
	defer mu.Unlock()
	last := sizes[len(sizes)-2:]
	if last[0] != n/2 || last[1] != n/2 {
		t.Fatalf("requests %v: want retries of %d, then one try of each half", sizes, n)
	}
	for _, s := range sizes[:len(sizes)-2] {
		if s != n {
			t.Fatalf("requests %v: want retries of %d, then one try of each half", sizes, n)
		}
	}
	for _, id := range ids {
		if e.published(t, id) {
			t.Fatalf("event %s published though every Ack failed", id)
		}
	}
}

// An ack the server answers with a status asking for it again (its
// database refused that one item; ACK_STATUS_RETRY) is sent again, and
// lands. The first answer is simulated: the item is kept from the server
// and answered with status 6, as a server does whose group commit refused
// it; the retry reaches the real server.
func TestRunnerResendsAckTheServerAsksAgain(t *testing.T) {
	t.Parallel()
	e := newEnv(t, servertest.Options{})
	target := e.emit(t, "orders", "a")
	other := e.emit(t, "orders", "b")
	var sent atomic.Int32
	retryOnce := grpc.WithChainUnaryInterceptor(func(ctx context.Context, m string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		r, ok := req.(*outboxv1.AckRequest)
		if !ok {
			return invoker(ctx, m, req, reply, cc, opts...)
		}
		var kept []*outboxv1.AckItem
		held := -1
		for i, it := range r.GetAcks() {
			if it.GetEventId() == target && sent.Add(1) == 1 {
				held = i
				continue
			}
			kept = append(kept, it)
		}
		if held < 0 {
			return invoker(ctx, m, req, reply, cc, opts...)
		}
		res := reply.(*outboxv1.AckResponse)
		if len(kept) > 0 {
			if err := invoker(ctx, m, &outboxv1.AckRequest{Acks: kept}, res, cc, opts...); err != nil {
				return err
			}
		}
		res.Results = append(res.Results[:held:held], append([]*outboxv1.AckResult{{
			EventId: target, Status: outboxv1.AckStatus_ACK_STATUS_RETRY, Message: "injected: the database refused this ack",
		}}, res.Results[held:]...)...)
		return nil
	})
	givenUp := make(chan int, 10)
	start(t, Config{Conn: e.dial(t, retryOnce), Publisher: newPublisher(), LeaseTTL: time.Hour},
		hooks{ackGivenUp: func(k int) { givenUp <- k }})
	// With an hour-long lease, only a resent ack can publish it in time.
	e.waitPublished(t, target, other)
	if n := sent.Load(); n != 2 {
		t.Fatalf("the ack was sent %d times, want 2", n)
	}
	select {
	case k := <-givenUp:
		t.Fatalf("%d acks given up", k)
	default:
	}
}
