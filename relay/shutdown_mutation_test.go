package relay

import (
	"errors"
	"testing"
	"time"

	"github.com/outboxd/outboxd/internal/servertest"
)

// A stopping runner waits for the publishes under way: one that does not
// finish is cut short by the drain timeout, not by Run's return, so a slow
// broker gets the whole DrainTimeout to confirm it (and the lease stays
// held meanwhile). Why the publish's context ended tells the two apart
// without timing anything.
func TestStoppingRunnerWaitsForThePublishUnderWay(t *testing.T) {
	t.Parallel()
	e := newEnv(t, servertest.Options{})
	e.emit(t, "orders", "a")
	pub := newPublisher()
	// Never opened: only the publish's context ends it.
	pub.block = make(chan struct{})
	run := start(t, Config{Conn: e.srv.Conn, Publisher: pub, DrainTimeout: time.Second}, hooks{})
	waitSignal(t, "the publish to start", pub.started)
	if err := run.stop(t); err != nil {
		t.Fatalf("Run: %v", err)
	}
	if cause := waitSignal(t, "the publish to end", pub.causes); !errors.Is(cause, errDrainTimeout) {
		t.Fatalf("the publish under way was cut short by %v, want the drain timeout", cause)
	}
}
