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
	g, a := pollGroupOfOne(time.Minute)
	defer g.leave(a)
	g.delay = 10 * time.Second
	if now, _ := g.enterIdle(a); now {
		t.Fatal("a claimed at once with no wake-up kept")
	}
	// A probe that covers the polls for the next hour and found nothing.
	g.srv.claimProbe.Store(&probedClaims{at: time.Now(), covers: time.Hour, ClaimProbe: store.ClaimProbe{Probed: true, NextIn: -1}})
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
	if n := g.srv.skippedPolls.Load(); n != 4 {
		t.Fatalf("%d polls skipped their claims, want 4", n)
	}
}

// A poll that finds work brings the group's next poll forward to the
// shortest delay even when it is armed already (another member began to
// wait after the poll fired, and armed it for the old, long delay): work
// no wake-up announced appeared, and more may follow, so the group must
// not wait the long delay to look again.
func TestAPollThatFindsWorkBringsAnArmedPollForward(t *testing.T) {
	g, a, b := pollGroupOfTwo(time.Hour)
	defer g.leave(b)
	defer g.leave(a)
	g.delay = time.Hour // backed off
	g.enterIdle(a)
	g.enterIdle(b)
	duePoll(t, g) // no probe: the poll asks a, the longest idle, to claim
	select {
	case poll := <-a.probe:
		if !poll {
			t.Fatal("the poll reached a as a wake-up, not as a poll")
		}
	default:
		t.Fatal("the poll asked nobody to claim")
	}
	// b waits again (after a reconcile tick, say): the poll is armed for
	// the hour.
	g.leaveIdle(b)
	g.enterIdle(b)
	g.mu.Lock()
	armedFor := time.Until(g.fireAt)
	g.mu.Unlock()
	if armedFor < 30*time.Minute {
		t.Fatalf("the poll is armed for %v, want the hour the group backed off to", armedFor)
	}
	g.claimed(claimedSome, true) // a's poll found work
	g.mu.Lock()
	delay, armed, fireAt := g.delay, g.armed, g.fireAt
	g.mu.Unlock()
	if delay != minIdlePoll {
		t.Fatalf("after a poll that found work: delay %v, want %v", delay, minIdlePoll)
	}
	// Armed (or fired already) within minIdlePoll of the claim, not in an hour.
	if limit := time.Now().Add(minIdlePoll); fireAt.After(limit) {
		t.Fatalf("after a poll that found work the next poll is due in %v (armed %v), want within %v", time.Until(fireAt).Round(time.Second), armed, minIdlePoll)
	}
}

// A poll that fires when no member is idle (they left the line to claim,
// or spent their credit) is kept as a wake-up is: the next member to wait
// with credit claims at once, and its claim counts as the group's poll
// (work it finds resets the backoff) also when a wake-up was kept with it.
func TestAPollThatFindsNoMemberIdleIsKept(t *testing.T) {
	g, a := pollGroupOfOne(time.Hour)
	defer g.leave(a)
	g.delay = time.Hour
	g.enterIdle(a)
	g.leaveIdle(a) // a stops waiting; the poll stays armed
	duePoll(t, g)
	if now, poll := g.enterIdle(a); !now || !poll {
		t.Fatalf("a poll that found no member idle: the next to wait claims at once %v, as the group's poll %v; want both", now, poll)
	}
	// Again, and a wake-up finds nobody idle either: kept with the poll.
	g.enterIdle(a)
	g.leaveIdle(a)
	duePoll(t, g)
	g.srv.wakeGroups(nil)
	if now, poll := g.enterIdle(a); !now || !poll {
		t.Fatalf("a poll and a wake-up that found no member idle: the next to wait claims at once %v, as the group's poll %v; want both", now, poll)
	}
	if now, _ := g.enterIdle(a); now {
		t.Fatal("the kept poll and wake-up made the group claim twice")
	}
}

// A claim that failed slows the group's poll to 100 ms at least: the
// database is likely in trouble, and polls every 2 ms would add to it.
func TestAFailedClaimSlowsThePoll(t *testing.T) {
	g, a := pollGroupOfOne(time.Hour)
	defer g.leave(a)
	g.claimed(claimFailed, true)
	if g.delay < 100*time.Millisecond {
		t.Fatalf("after a failed claim: delay %v, want 100ms at least", g.delay)
	}
	g.delay = time.Minute
	g.claimed(claimFailed, false)
	if g.delay != time.Minute {
		t.Fatalf("after a failed claim with the poll backed off to 1m: delay %v, want it kept", g.delay)
	}
}

// A poll whose claim found nothing doubles the group's poll delay, up to
// PollInterval and no further: an idle replica makes one claim per stream
// filter per PollInterval, and a lost notification delays work by a
// PollInterval at most, however long the group has been idle.
func TestAnEmptyPollBacksOffUpToPollInterval(t *testing.T) {
	g, a := pollGroupOfOne(time.Minute)
	defer g.leave(a)
	g.delay = 20 * time.Second
	for i, want := range []time.Duration{40 * time.Second, time.Minute, time.Minute} {
		g.claimed(claimedNone, true)
		if g.delay != want {
			t.Fatalf("after empty poll %d: delay %v, want %v (doubled, up to PollInterval)", i+1, g.delay, want)
		}
	}
}

// A session that leaves its group for good (its stream ended) leaves the
// idle line too: a wake-up after that goes to a member still there, or is
// kept for the next to wait, never to the session that is gone, which
// would never claim with it.
func TestAWakeUpAfterAMemberLeftIsNotLostToIt(t *testing.T) {
	g, a, b := pollGroupOfTwo(time.Hour)
	defer g.leave(b)
	g.delay = time.Hour // no poll fires
	g.enterIdle(a)      // a waits, and its loop ends while it waits
	g.leave(a)
	g.srv.wakeGroups(nil)
	select {
	case <-a.probe:
		t.Fatal("a wake-up went to a session that had left its group")
	default:
	}
	if now, _ := g.enterIdle(b); !now {
		t.Fatal("a wake-up after a member left was lost: the next to wait must claim at once")
	}
}

// A wake-up goes to the member that has waited longest: members take
// turns, so no session of a group is left idle while another, which began
// to wait after it, claims every time.
func TestAWakeUpGoesToTheLongestIdleMember(t *testing.T) {
	g, a, b := pollGroupOfTwo(time.Hour)
	defer g.leave(b)
	defer g.leave(a)
	g.delay = time.Hour // no poll fires
	g.enterIdle(a)
	g.enterIdle(b)
	for i, want := range []*session{a, b} {
		g.srv.wakeGroups(nil)
		for _, ss := range []*session{a, b} {
			select {
			case <-ss.probe:
				if ss != want {
					t.Fatalf("wake-up %d went to %s, want %s, idle longest", i+1, ss.relayID, want.relayID)
				}
			default:
				if ss == want {
					t.Fatalf("wake-up %d did not reach %s, idle longest", i+1, ss.relayID)
				}
			}
		}
	}
}

// pollGroupOfOne is a poll group of one session, a, on a server of its
// own whose polls back off up to pollInterval and whose reconcile ticks
// wait an hour; the test leaves it.
func pollGroupOfOne(pollInterval time.Duration) (*pollGroup, *session) {
	srv := &Server{cfg: Config{ReconcileInterval: time.Hour, PollInterval: pollInterval}, stopping: make(chan struct{})}
	a := newSession(srv, "a", "peer", nil, 1, time.Minute)
	return srv.joinPollGroup(a), a
}

// pollGroupOfTwo is pollGroupOfOne with a second member, b, which joined
// after a.
func pollGroupOfTwo(pollInterval time.Duration) (*pollGroup, *session, *session) {
	g, a := pollGroupOfOne(pollInterval)
	b := newSession(g.srv, "b", "peer", nil, 1, time.Minute)
	g.srv.joinPollGroup(b)
	return g, a, b
}
