package relay

import (
	"context"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/outboxd/outboxd/internal/servertest"
)

// brokenStream is a Subscribe stream that fails on its first receive, as
// one does whose connection drops; before failing it calls ran, which may
// move the test's clock on as if the stream had run that long.
type brokenStream struct {
	grpc.ClientStream
	ran func()
}

func (s brokenStream) RecvMsg(any) error {
	s.ran()
	return status.Error(codes.Unavailable, "injected: connection dropped")
}

// After a stream that ran fine for a while (longer than ReconnectCap by
// the runner's clock) breaks, the reconnect backoff starts over from
// ReconnectBase: a relay whose server restarts once a day reconnects at
// once, not after the cap that its last bad spell reached. Here six quick
// failures grow the wait towards the cap; then the seventh stream "runs"
// for an hour of the test's clock before it breaks, and the next wait is
// back at about ReconnectBase.
func TestReconnectBackoffStartsOverAfterAGoodRun(t *testing.T) {
	t.Parallel()
	e := newEnv(t, servertest.Options{})
	const base, limit = time.Millisecond, 64 * time.Millisecond
	const quick = 6 // failures before the good run
	var (
		mu      sync.Mutex
		clock   = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
		streams int
		waits   []time.Duration
	)
	broken := grpc.WithChainStreamInterceptor(func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, m string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
		s, err := streamer(ctx, desc, cc, m, opts...)
		if err != nil {
			return nil, err
		}
		mu.Lock()
		streams++
		good := streams == quick+1
		mu.Unlock()
		return brokenStream{s, func() {
			if good {
				mu.Lock()
				clock = clock.Add(time.Hour)
				mu.Unlock()
			}
		}}, nil
	})
	done := make(chan struct{})
	h := hooks{
		now: func() time.Time { mu.Lock(); defer mu.Unlock(); return clock },
		reconnecting: func(_ error, wait time.Duration) {
			mu.Lock()
			defer mu.Unlock()
			waits = append(waits, wait)
			if len(waits) == quick+1 {
				close(done)
			}
		},
	}
	run := start(t, Config{Conn: e.dial(t, broken), Publisher: newPublisher(), ReconnectBase: base, ReconnectCap: limit}, h)
	waitSignal(t, "the reconnect after the good run", done)
	if err := run.stop(t); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	// The quick failures' waits double from base: the last is 32 ms ± 50 %.
	if w := waits[quick-1]; w < limit/8 {
		t.Fatalf("waits %v: the backoff did not grow over %d quick failures", waits, quick)
	}
	if w := waits[quick]; w > base*3/2 {
		t.Fatalf("waits %v: after a stream that ran an hour the wait is %v, want about ReconnectBase %v", waits, w, base)
	}
}
