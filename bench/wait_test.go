package bench

import (
	"testing"
	"time"
)

// A window does not close before the first event arrives: a replica's
// first discovery round over a large backlog may take longer than the
// stall timeout (a drain arm once measured 0 events/s that way). It waits
// for the first event up to its timeout, then goes on.
func TestWaitDeliveredWaitsPastTheStallForTheFirstEvent(t *testing.T) {
	l := NewLedger(1, 1)
	commitAll(t, l, 0, 2)
	const stall = 50 * time.Millisecond
	start := time.Now()
	delivered := make(chan error, 1)
	go func() {
		// Deliver only once the waiter has been waiting well past its stall.
		for time.Since(start) < 4*stall {
			time.Sleep(stall / 5)
		}
		_, err := l.Deliver(0, 1, -1, 0, 101)
		if err == nil {
			_, err = l.Deliver(0, 2, -1, 0, 102)
		}
		delivered <- err
	}()
	ok := waitDeliveredStall(t.Context(), l, 30*time.Second, stall, false)
	if !ok {
		t.Errorf("gave up after %v with %d of 2 delivered; want it to wait for the first event", time.Since(start), l.Delivered())
	}
	if err := <-delivered; err != nil {
		t.Fatal(err)
	}
}

// Once events have arrived, a wait without further progress for the stall
// timeout gives up, whether or not it may give up early on the rate: with
// one event delivered before the wait and one during it (a wait that
// counted progress against its first reading saw progress on every tick
// after that, and never stalled).
func TestWaitDeliveredGivesUpOnAStallAfterProgress(t *testing.T) {
	for _, giveUpEarly := range []bool{false, true} {
		l := NewLedger(1, 1)
		commitAll(t, l, 0, 3)
		deliver(t, l, 0, 1, -1, 0)
		const stall, timeout = 50 * time.Millisecond, 30 * time.Second
		start := time.Now()
		delivered := make(chan error, 1)
		go func() {
			for time.Since(start) < stall/2 {
				time.Sleep(stall / 10)
			}
			_, err := l.Deliver(0, 2, -1, 0, 102)
			delivered <- err
		}()
		if waitDeliveredStall(t.Context(), l, timeout, stall, giveUpEarly) {
			t.Errorf("giveUpEarly %v: reported everything delivered with 2 of 3", giveUpEarly)
		}
		if waited := time.Since(start); waited >= timeout {
			t.Errorf("giveUpEarly %v: waited %v, the whole timeout; want it to stop about %v after the last event", giveUpEarly, waited, stall)
		}
		if err := <-delivered; err != nil {
			t.Fatal(err)
		}
	}
}
