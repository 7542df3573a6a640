package server_test

import (
	"testing"
	"time"
)

// Tests added by the ack mutation sweep: each pins down a line of the
// acker that no other test held.

// A batch lingers when the other caller's ack came within four lingers of
// its own, not only within one: here the other connection's ack came two
// lingers before (a spell a relay's next ack takes under load), delivery 2
// is still out, and the batch waits for company. (The gap is a time the
// rule measures, so the test makes it with a sleep: two lingers, half way
// between the one linger a narrower window would take and the four of the
// rule.)
func TestAckBatchLingersWithinFourLingersOfAnotherCaller(t *testing.T) {
	t.Parallel()
	const linger = time.Second
	g := newLingerRigOf(t, 3, linger)
	g.acksInTurn(t, 1) // connection 1 acks delivery 0
	time.Sleep(2 * linger)
	g.ack(t, 0, 1) // connection 0, two lingers later; delivery 2 is still out
	select {
	case acks := <-g.lingered:
		if acks != 1 {
			t.Fatalf("the batch lingered with %d acks, want 1", acks)
		}
	case a := <-g.answers:
		t.Fatalf("the ack of %s was committed at once, two lingers after another connection's ack", a.id)
	}
	g.ack(t, 1, 2)
	g.answered(t, 2)
}
