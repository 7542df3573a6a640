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
	w.group.delay = time.Hour // backed off: the poll alone would not fire
	w.claimNoLaterThan(time.Now().Add(10 * time.Millisecond))
	w.claimNoLaterThan(time.Now().Add(time.Hour)) // a later bound does not replace it

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	kicked, err := w.wait(ctx, true)
	if err != nil {
		t.Fatalf("wait ended with %v, want the bound to fire first", err)
	}
	if kicked {
		t.Fatal("wait reported a kick, want the bound (the caller then claims)")
	}
	if w.group.delay != time.Hour || !w.claimDue.IsZero() || w.takeProbe() {
		t.Fatalf("after the bound fired: poll delay %v, claimDue %v; want the backoff kept, the bound cleared, and no poll", w.group.delay, w.claimDue)
	}
	// A claim clears the bound.
	w.claimNoLaterThan(time.Now().Add(time.Hour))
	w.claimed()
	if !w.claimDue.IsZero() {
		t.Fatalf("after a claim: claimDue %v; want it cleared", w.claimDue)
	}
}

// A poll group keeps a wake-up that found no session waiting (they were all
// claiming, and their claims may have started before the work was made
// claimable) for the next session to wait, once; passes on one signalled to
// a session that stops waiting without claiming; and wakes only groups that
// take the streams named.
func TestPollGroupLosesNoWakeUp(t *testing.T) {
	srv := &Server{cfg: Config{ReconcileInterval: time.Hour, PollInterval: time.Hour}, stopping: make(chan struct{})}
	a := newSession(srv, "a", "peer", nil, 1, time.Minute)
	b := newSession(srv, "b", "peer", nil, 1, time.Minute)
	c := newSession(srv, "c", "peer", []string{"payments"}, 1, time.Minute)
	g, gb, gc := srv.joinPollGroup(a), srv.joinPollGroup(b), srv.joinPollGroup(c)
	if g != gb || g == gc {
		t.Fatal("want a and b in one group, c in another")
	}
	g.delay, gc.delay = time.Hour, time.Hour // no poll fires

	srv.wakeGroups(nil) // nobody waits
	if now, _ := g.enterIdle(a); !now {
		t.Fatal("a wake-up that found no session waiting was lost: the next to wait must claim at once")
	}
	if now, _ := g.enterIdle(b); now {
		t.Fatal("a kept wake-up made two sessions claim")
	}
	if now, _ := gc.enterIdle(c); !now { // every group was woken
		t.Fatal("a wake-up for every stream did not reach c's group")
	}
	if now, _ := gc.enterIdle(c); now {
		t.Fatal("c claims twice for one wake-up")
	}
	srv.wakeGroups([]string{"orders"}) // b waits: signalled; c does not take orders
	select {
	case <-c.probe:
		t.Fatal("a wake-up for orders reached a session that takes only payments")
	default:
	}
	g.leaveIdle(b)
	g.passOn(b) // b stops waiting without claiming (no credit left, say)
	if now, _ := g.enterIdle(a); !now {
		t.Fatal("a wake-up signalled to a session that did not claim was lost")
	}
	srv.wakeGroups([]string{"payments"})
	select {
	case <-c.probe:
	default:
		t.Fatal("a wake-up for payments did not reach the session that takes it")
	}
	g.leave(a)
	g.leave(b)
	gc.leave(c)
	if len(srv.groups) != 0 {
		t.Fatalf("%d groups left after every session left", len(srv.groups))
	}
}

// Only a poll that finds work brings the group's poll back to the shortest
// delay: a claim that answered a wake-up, freed credit or another claim
// found announced work, which leaves the backoff (and an armed poll) as
// it is. An empty poll doubles the delay; an empty claim of another
// kind does not.
func TestOnlyAPollThatFindsWorkResetsTheBackoff(t *testing.T) {
	srv := &Server{cfg: Config{ReconcileInterval: time.Hour, PollInterval: time.Hour}, stopping: make(chan struct{})}
	a := newSession(srv, "a", "peer", nil, 1, time.Minute)
	g := srv.joinPollGroup(a)
	defer g.leave(a)
	g.delay = time.Minute
	g.claimed(claimedAll, false)
	g.claimed(claimedSome, false)
	g.claimed(claimedNone, false)
	if g.delay != time.Minute {
		t.Fatalf("after claims that were not polls: delay %v, want the backoff kept at 1m", g.delay)
	}
	g.claimed(claimedNone, true)
	if g.delay != 2*time.Minute {
		t.Fatalf("after an empty poll: delay %v, want it doubled to 2m", g.delay)
	}
	g.claimed(claimedSome, true)
	if g.delay != minIdlePoll {
		t.Fatalf("after a poll that found work: delay %v, want %v", g.delay, minIdlePoll)
	}
}

// The listener holds back exactly the wake-up a local round sent: one from
// the round's backend while the round is open (which the round then
// reports, in case it did not wake the sessions itself), or the first one
// from it after a round that notified; not a later one, and none once the
// LISTEN connection was lost in between.
func TestWakerHoldsBackOnlyTheRoundsOwnNotify(t *testing.T) {
	w := newWaker(&Server{})
	w.listening(true)

	w.openRound(7)
	if !w.echo(7) {
		t.Fatal("a wake-up from the round's backend while it is open was acted on")
	}
	if w.echo(8) {
		t.Fatal("a wake-up from another backend was held back")
	}
	if seen := w.closeRound(7, false); !seen {
		t.Fatal("the round was not told of the wake-up held back while it was open")
	}
	if w.echo(7) {
		t.Fatal("a wake-up from the backend after its round ended was held back")
	}

	w.openRound(7)
	if seen := w.closeRound(7, true); seen {
		t.Fatal("closeRound reports a wake-up that did not arrive")
	}
	if !w.echo(7) {
		t.Fatal("the echo of a round that notified, arriving after it ended, was acted on")
	}
	if w.echo(7) {
		t.Fatal("a second wake-up from the backend was held back")
	}

	w.openRound(7)
	w.closeRound(7, true)
	w.listening(false) // the echo went with the connection
	w.listening(true)
	if w.echo(7) {
		t.Fatal("a wake-up was held back as the echo of a round notified on a lost connection")
	}

	// An echo seen while the round was open is not expected again: the
	// backend's next wake-up is someone else's.
	w.openRound(7)
	if !w.echo(7) {
		t.Fatal("a wake-up from the round's backend while it is open was acted on")
	}
	w.closeRound(7, true)
	if w.echo(7) {
		t.Fatal("a wake-up after the round whose echo was seen while open was held back as its echo")
	}

	// Nor is the echo of a round whose listening connection was lost and
	// made again while it was open: the echo went with the old connection.
	w.openRound(7)
	w.listening(false)
	w.listening(true)
	w.closeRound(7, true)
	if w.echo(7) {
		t.Fatal("a wake-up was held back as the echo of a round that notified while the connection was replaced")
	}
}
