package relay

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/outboxd/outboxd/internal/servertest"
)

// causePublisher holds every publish until its context ends, and reports
// why it ended.
type causePublisher struct {
	started chan struct{}
	causes  chan error
}

func (p *causePublisher) Publish(ctx context.Context, _ Event) error {
	p.started <- struct{}{}
	<-ctx.Done()
	p.causes <- context.Cause(ctx)
	return ctx.Err()
}

// A stopping runner waits for the publishes under way: one that does not
// finish is cut short by the drain timeout, not by Run's return, so a slow
// broker gets the whole DrainTimeout to confirm it (and the lease stays
// held meanwhile). Why the publish's context ended tells the two apart
// without timing anything.
func TestStoppingRunnerWaitsForThePublishUnderWay(t *testing.T) {
	t.Parallel()
	e := newEnv(t, servertest.Options{})
	e.emit(t, "orders", "a")
	pub := &causePublisher{started: make(chan struct{}, 10), causes: make(chan error, 10)}
	run := start(t, Config{Conn: e.srv.Conn, Publisher: pub, DrainTimeout: time.Second}, hooks{})
	waitSignal(t, "the publish to start", pub.started)
	if err := run.stop(t); err != nil {
		t.Fatalf("Run: %v", err)
	}
	if cause := waitSignal(t, "the publish to end", pub.causes); !errors.Is(cause, errDrainTimeout) {
		t.Fatalf("the publish under way was cut short by %v, want the drain timeout", cause)
	}
}
