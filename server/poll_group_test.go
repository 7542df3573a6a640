package server

import (
	"testing"
	"time"

	"github.com/outboxd/outboxd/internal/store"
)

// duePoll makes the group's armed poll due now and fires it, as its timer
// would (the timer itself is armed for far later: nothing fires but this).
func duePoll(t *testing.T, g *pollGroup) {
	t.Helper()
	g.mu.Lock()
	if !g.armed {
		g.mu.Unlock()
		t.Fatal("the group's poll is not armed")
	}
	g.fireAt = time.Now()
	g.mu.Unlock()
	g.fire()
}

// A poll that skips its claim on the discovery loop's probe (nothing
// claimable as of the probe: pollCovered) backs off as after an empty
// claim, doubling up to PollInterval, and stays armed: a skipped poll is
// still a poll, and an idle group that skipped every claim must not poll
// every 2 ms for it.
func TestASkippedPollBacksOffAsAnEmptyOne(t *testing.T) {
	srv := &Server{cfg: Config{ReconcileInterval: time.Hour, PollInterval: time.Minute}, stopping: make(chan struct{})}
	a := newSession(srv, "a", "peer", nil, 1, time.Minute)
	g := srv.joinPollGroup(a)
	defer g.leave(a)
	g.delay = 10 * time.Second
	if now, _ := g.enterIdle(a); now {
		t.Fatal("a claimed at once with no wake-up kept")
	}
	// A probe that covers the polls for the next hour and found nothing.
	srv.claimProbe.Store(&probedClaims{at: time.Now(), covers: time.Hour, ClaimProbe: store.ClaimProbe{Probed: true, NextIn: -1}})
	for i, want := range []time.Duration{20 * time.Second, 40 * time.Second, time.Minute, time.Minute} {
		duePoll(t, g)
		select {
		case <-a.probe:
			t.Fatalf("poll %d: a covered poll asked the idle session to claim", i+1)
		default:
		}
		g.mu.Lock()
		delay, armed := g.delay, g.armed
		g.mu.Unlock()
		if delay != want || !armed {
			t.Fatalf("poll %d skipped its claim: delay %v, armed %v; want %v (doubled, up to PollInterval), armed", i+1, delay, armed, want)
		}
	}
	if n := srv.skippedPolls.Load(); n != 4 {
		t.Fatalf("%d polls skipped their claims, want 4", n)
	}
}
