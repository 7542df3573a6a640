package relay

import (
	"context"
	"fmt"
	"sync"
	"testing"

	"google.golang.org/grpc"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/servertest"
)

// streamWatch sees, on the runner's connection, what its Subscribe asked
// and how many deliveries each message of the stream carried.
type streamWatch struct {
	mu     sync.Mutex
	accept []bool // accept_batches of each Subscribe
	perMsg []int
}

func (w *streamWatch) option() grpc.DialOption {
	return grpc.WithChainStreamInterceptor(func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, m string,
		streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
		cs, err := streamer(ctx, desc, cc, m, opts...)
		if err != nil {
			return nil, err
		}
		return &watchedStream{ClientStream: cs, w: w}, nil
	})
}

type watchedStream struct {
	grpc.ClientStream
	w *streamWatch
}

func (s *watchedStream) SendMsg(m any) error {
	if req, ok := m.(*outboxv1.SubscribeRequest); ok {
		s.w.mu.Lock()
		s.w.accept = append(s.w.accept, req.GetAcceptBatches())
		s.w.mu.Unlock()
	}
	return s.ClientStream.SendMsg(m)
}

func (s *watchedStream) RecvMsg(m any) error {
	err := s.ClientStream.RecvMsg(m)
	if res, ok := m.(*outboxv1.SubscribeResponse); ok && err == nil {
		n := max(len(res.GetDeliveries()), 1)
		s.w.mu.Lock()
		s.w.perMsg = append(s.w.perMsg, n)
		s.w.mu.Unlock()
	}
	return err
}

// waitDiscovered waits until every event committed so far is in a
// delivery row, so that the runner's first claim leases them all.
func (e *env) waitDiscovered(t *testing.T) {
	t.Helper()
	waitUntil(t, "every event discovered", func() bool {
		var pending bool
		if err := e.pool.QueryRow(context.Background(),
			`SELECT EXISTS (SELECT 1 FROM outbox.events_since((SELECT snapshot FROM outbox.discovery)))`).Scan(&pending); err != nil {
			t.Fatal(err)
		}
		return !pending
	})
}

// The runner asks for batches and publishes every delivery of a batch once,
// with a window as without: deliveries claimed at once come in one message.
func TestRunnerTakesBatches(t *testing.T) {
	t.Parallel()
	for _, window := range []int{1, 4} {
		t.Run(fmt.Sprintf("window=%d", window), func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, servertest.Options{})
			var ids []string
			for i := range 10 {
				for range window {
					ids = append(ids, e.emit(t, "orders", fmt.Sprintf("k-%d", i)))
				}
			}
			e.waitDiscovered(t)
			var w streamWatch
			pub := newPublisher()
			start(t, Config{Conn: e.dial(t, w.option()), Publisher: pub, MaxInFlight: 64, MaxInFlightPerAggregate: window}, hooks{})
			e.waitPublished(t, ids...)
			for _, id := range ids {
				if n := pub.attemptsOf(id); n != 1 {
					t.Errorf("event %s published %d times, want 1", id, n)
				}
			}
			w.mu.Lock()
			defer w.mu.Unlock()
			if len(w.accept) == 0 || !w.accept[0] {
				t.Fatalf("Subscribe's accept_batches: %v", w.accept)
			}
			if len(w.perMsg) == 0 || w.perMsg[0] != len(ids) {
				t.Fatalf("deliveries per message %v: the first claim's %d did not come in one", w.perMsg, len(ids))
			}
		})
	}
}
