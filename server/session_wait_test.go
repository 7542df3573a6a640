package server

import (
	"context"
	"testing"
	"time"
)

// A claim an ack batch's hint put off fires by the hint's time even when the
// poll backoff has grown long, and it is not counted as an empty poll: the
// backoff stays as it was.
func TestWaitClaimsByTheAckBatchesBound(t *testing.T) {
	srv := &Server{cfg: Config{ReconcileInterval: time.Hour, PollInterval: time.Hour}, stopping: make(chan struct{})}
	ss := newSession(srv, "relay", "peer", nil, 1, time.Minute)
	w := newSessionWait(ss)
	defer w.stop()
	w.pollDelay = time.Hour // backed off: the poll alone would not fire
	w.claimNoLaterThan(time.Now().Add(10 * time.Millisecond))
	w.claimNoLaterThan(time.Now().Add(time.Hour)) // a later bound does not replace it

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	kicked, err := w.wait(ctx, true, make(chan struct{}))
	if err != nil {
		t.Fatalf("wait ended with %v, want the bound to fire first", err)
	}
	if kicked {
		t.Fatal("wait reported a kick, want the bound (the caller then claims)")
	}
	if w.pollDelay != time.Hour || !w.claimDue.IsZero() {
		t.Fatalf("after the bound fired: pollDelay %v, claimDue %v; want the backoff kept and the bound cleared", w.pollDelay, w.claimDue)
	}
	// A claim clears both clocks.
	w.claimNoLaterThan(time.Now().Add(time.Hour))
	w.claimed()
	if !w.claimDue.IsZero() || !w.pollAt.IsZero() {
		t.Fatalf("after a claim: claimDue %v, pollAt %v; want both cleared", w.claimDue, w.pollAt)
	}
}
