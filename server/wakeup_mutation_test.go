package server

import (
	"testing"
	"time"

	"github.com/outboxd/outboxd/internal/store"
)

// The wake-up sweep's tests of the poll group (wakeup.go): each holds one
// promise of pollGroup's comments that no other test held. They drive the
// group as its sessions' loops do (enterIdle, leaveIdle, claimed, leave)
// and its timer does (duePoll, fire), with the poll armed an hour away so
// that nothing fires but what a test fires.

// probed takes the signal the group sent ss, if any: ok says there was
// one, poll whether it was the group's poll.
func probed(ss *session) (poll, ok bool) {
	select {
	case poll = <-ss.probe:
		return poll, true
	default:
		return false, false
	}
}

// A wake-up signalled to a member whose loop then ends before it acted on
// it is not lost with it: leave hands it to the longest idle member still
// there, as the poll it was (a poll's claim that finds work resets the
// backoff), or keeps it for the next member to wait. (Kills W06, W07.)
func TestAWakeUpSignalledToAMemberThatLeavesIsHandedOn(t *testing.T) {
	g, a, b := pollGroupOfTwo(time.Hour)
	defer g.leave(b)
	g.delay = time.Hour // no poll fires but duePoll's
	g.enterIdle(a)
	g.enterIdle(b)
	duePoll(t, g) // the poll asks a, idle longest
	g.leave(a)    // and a's stream ends before a claimed
	if poll, ok := probed(b); !ok || !poll {
		t.Fatalf("a poll signalled to a member that left: b was asked %v, as the poll %v; want both", ok, poll)
	}

	// With nobody else idle, it is kept for the next member to wait.
	c := newSession(g.srv, "c", "peer", nil, 1, time.Minute)
	g.srv.joinPollGroup(c)
	g.enterIdle(c)
	g.srv.wakeGroups(nil) // the wake-up goes to c
	g.leave(c)            // which leaves at once
	if now, poll := g.enterIdle(b); !now || poll {
		t.Fatalf("a wake-up signalled to a member that left with none idle: the next to wait claims at once %v (as a poll %v); want at once, not as a poll", now, poll)
	}
}

// The group's poll is armed only while it has idle members: a claim that
// ends with no member waiting (the claimant itself is not idle, it claims)
// does not arm it, so no poll fires at a group whose members all claim, to
// be kept and make the next to wait claim again at once. The next member
// to wait arms it. (Kills W22.)
func TestAClaimWithNoMemberIdleLeavesThePollUnarmed(t *testing.T) {
	g, a := pollGroupOfOne(time.Hour)
	defer g.leave(a)
	for _, outcome := range []claimOutcome{claimedNone, claimedSome, claimedAll, claimFailed} {
		g.claimed(outcome, true)
		g.mu.Lock()
		armed := g.armed
		g.mu.Unlock()
		if armed {
			t.Fatalf("after claim outcome %d with no member idle the poll is armed; want it armed only while a member is idle", outcome)
		}
	}
	if now, _ := g.enterIdle(a); now {
		t.Fatal("a waited after claims with nobody idle and was told to claim at once")
	}
	g.mu.Lock()
	armed := g.armed
	g.mu.Unlock()
	if !armed {
		t.Fatal("a member waits and the poll is not armed")
	}
}

// A firing of the poll's timer that finds the poll no longer armed (a poll
// that found work brought it forward while nobody was idle, so it was not
// re-armed) does nothing: it is no poll, counts as none, and is not kept
// for the next member to wait. (Kills W25.)
func TestAFiringOfAPollNoLongerArmedDoesNothing(t *testing.T) {
	g, a := pollGroupOfOne(time.Hour)
	defer g.leave(a)
	g.delay = time.Hour
	g.enterIdle(a) // armed for the hour
	g.leaveIdle(a) // a claims (say, a wake-up)
	g.claimed(claimedSome, true)
	g.mu.Lock()
	if g.armed {
		g.mu.Unlock()
		t.Fatal("a poll that found work left the hour-long poll armed with nobody idle")
	}
	g.fireAt = time.Now() // the timer, still set, fires as if due
	g.mu.Unlock()
	g.fire()
	g.mu.Lock()
	polls := g.polls
	g.mu.Unlock()
	if polls != 0 {
		t.Fatalf("a firing of an unarmed poll counted %d polls, want 0", polls)
	}
	if now, _ := g.enterIdle(a); now {
		t.Fatal("a firing of an unarmed poll was kept: the next member to wait claimed at once")
	}
}

// A firing of the poll's timer before the poll is due (the timer was set
// for an earlier time and the poll re-armed for later meanwhile) does
// nothing: the timer fires again when it is due. (Kills W26.)
func TestAFiringBeforeThePollIsDueDoesNothing(t *testing.T) {
	g, a := pollGroupOfOne(time.Hour)
	defer g.leave(a)
	g.delay = time.Hour
	g.enterIdle(a)
	g.fire() // an hour early
	if _, ok := probed(a); ok {
		t.Fatal("a firing an hour before the poll is due asked the idle member to claim")
	}
	g.mu.Lock()
	polls, armed := g.polls, g.armed
	g.mu.Unlock()
	if polls != 0 || !armed {
		t.Fatalf("after a firing before the poll is due: %d polls, armed %v; want 0, armed", polls, armed)
	}
}

// Once a poll fired, the group arms the next one when a member waits
// again: the poll is armed once, not for good. (Kills W27.)
func TestAfterAPollTheNextIsArmedWhenAMemberWaitsAgain(t *testing.T) {
	g, a := pollGroupOfOne(time.Hour)
	defer g.leave(a)
	g.delay = time.Hour
	g.enterIdle(a)
	duePoll(t, g)
	if poll, ok := probed(a); !ok || !poll {
		t.Fatal("the poll did not ask the idle member to claim")
	}
	g.claimed(claimedNone, true) // empty: the delay stays at the hour
	g.enterIdle(a)
	g.mu.Lock()
	armed, in := g.armed, time.Until(g.fireAt)
	g.mu.Unlock()
	if !armed || in < 30*time.Minute {
		t.Fatalf("a member waits again after the poll: armed %v, due in %v; want armed for the hour from now", armed, in)
	}
}

// A poll that fires when no member is idle is kept for the next member to
// wait, also when the discovery loop's probe covers it: only a poll with a
// member to ask skips its claim on the probe (and backs off). (Kills W29.)
func TestAPollWithNoMemberIdleIsKeptDespiteTheProbe(t *testing.T) {
	g, a := pollGroupOfOne(time.Hour)
	defer g.leave(a)
	g.delay = time.Minute
	g.enterIdle(a)
	g.leaveIdle(a)
	g.srv.claimProbe.Store(&probedClaims{at: time.Now(), covers: time.Hour, ClaimProbe: store.ClaimProbe{Probed: true, NextIn: -1}})
	duePoll(t, g)
	if n := g.srv.skippedPolls.Load(); n != 0 {
		t.Fatalf("a poll with no member idle skipped its claim (%d skipped); want it kept", n)
	}
	if now, poll := g.enterIdle(a); !now || !poll {
		t.Fatalf("a poll with no member idle: the next to wait claims at once %v, as the poll %v; want both", now, poll)
	}
}

// Only a claim that came back with all it asked for wakes the next idle
// member, and with a wake-up (not the poll, whatever the claim answered: it
// announces work, and a claim it finds work with says nothing of polls); a
// claim that got fewer, or none, wakes nobody. A claim that got all it asked
// for with no member idle keeps nothing: the claimant itself claims again.
// (Kills W36, W38, W39.)
func TestOnlyAFullClaimWakesTheNextIdleMember(t *testing.T) {
	g, a, b := pollGroupOfTwo(time.Hour)
	defer g.leave(b)
	defer g.leave(a)
	g.delay = time.Hour
	g.enterIdle(b) // a claims, b waits
	for _, outcome := range []claimOutcome{claimedSome, claimedNone, claimFailed} {
		g.claimed(outcome, false)
		if _, ok := probed(b); ok {
			t.Fatalf("a claim with outcome %d woke the idle member; only a full claim does", outcome)
		}
	}
	before := g.srv.wakeups.Load()
	g.claimed(claimedAll, true) // a's poll got all it asked for
	if poll, ok := probed(b); !ok || poll {
		t.Fatalf("a full claim (the poll's): the idle member was asked %v, as the poll %v; want asked, as a wake-up", ok, poll)
	}
	if n := g.srv.wakeups.Load() - before; n != 1 {
		t.Fatalf("a full claim woke the next member: %d wake-ups counted, want 1", n)
	}
	// Nobody idle now: a's next full claim keeps nothing.
	g.claimed(claimedAll, false)
	if now, _ := g.enterIdle(a); now {
		t.Fatal("a full claim with no member idle was kept: the next to wait claimed at once")
	}
}

// The group is dropped when its last member leaves: a wake-up after that
// reaches no group (and a member that joins later starts a group of its
// own, with no wake-up kept from before). (Kills W02, W03.)
func TestTheLastMemberToLeaveDropsTheGroup(t *testing.T) {
	g, a := pollGroupOfOne(time.Hour)
	srv := g.srv
	g.leave(a)
	srv.wakeGroups(nil)
	if n := srv.groupWakeups.Load(); n != 0 {
		t.Fatalf("a wake-up after the last member left reached %d groups, want 0", n)
	}
	b := newSession(srv, "b", "peer", nil, 1, time.Minute)
	g2 := srv.joinPollGroup(b)
	defer g2.leave(b)
	if g2 == g {
		t.Fatal("a member joined the group its last member had left")
	}
	if now, _ := g2.enterIdle(b); now {
		t.Fatal("a member of a new group was told to claim at once for a wake-up of the group dropped before")
	}
}

// A wake-up goes to the groups whose filter takes one of the streams, and
// to no group that excludes all of them. Sessions whose filters name the
// same streams (in any order, with repeats) share one group; a filter that
// takes only stream x and one that takes all but x do not. (Kills W47,
// W48, W49.)
func TestAWakeUpFollowsTheStreamFilters(t *testing.T) {
	srv := &Server{cfg: Config{ReconcileInterval: time.Hour, PollInterval: time.Hour}, stopping: make(chan struct{})}
	join := func(name string, streams, exclude []string) (*pollGroup, *session) {
		ss := newSession(srv, name, "peer", streams, 1, time.Minute)
		ss.excludeStreams = exclude
		g := srv.joinPollGroup(ss)
		g.mu.Lock()
		g.delay = time.Hour
		g.mu.Unlock()
		return g, ss
	}
	gAB, ab := join("ab", []string{"a", "b"}, nil)
	defer gAB.leave(ab)
	gBA, ba := join("ba", []string{"b", "a", "b"}, nil)
	defer gBA.leave(ba)
	if gAB != gBA {
		t.Fatal("sessions taking streams [a b] and [b a b] are in different poll groups, want one")
	}
	gX, onlyX := join("x", []string{"x"}, nil)
	defer gX.leave(onlyX)
	gNotX, notX := join("not-x", nil, []string{"x"})
	defer gNotX.leave(notX)
	if gX == gNotX {
		t.Fatal("a session taking only stream x and one taking all but x share a poll group")
	}
	gX.enterIdle(onlyX)
	gNotX.enterIdle(notX)
	srv.wakeGroups([]string{"x"})
	if _, ok := probed(notX); ok {
		t.Fatal("a wake-up for stream x reached the group that excludes x")
	}
	if _, ok := probed(onlyX); !ok {
		t.Fatal("a wake-up for stream x did not reach the group that takes x")
	}
	srv.wakeGroups([]string{"y"})
	if _, ok := probed(notX); !ok {
		t.Fatal("a wake-up for stream y did not reach the group that takes all but x")
	}
}

// A new group's poll starts at minIdlePoll and doubles from there after
// each empty poll, up to PollInterval: it is not armed for no delay (a
// group whose poll starts at none would poll without pause, doubling
// nothing). Held with no member idle, so no timer is armed. (Kills W01.)
func TestANewGroupsPollStartsAtMinIdlePoll(t *testing.T) {
	g, a := pollGroupOfOne(8 * minIdlePoll)
	defer g.leave(a)
	for i, want := range []time.Duration{minIdlePoll, 2 * minIdlePoll, 4 * minIdlePoll, 8 * minIdlePoll, 8 * minIdlePoll} {
		if i > 0 {
			g.claimed(claimedNone, true)
		}
		g.mu.Lock()
		delay := g.delay
		g.mu.Unlock()
		if delay != want {
			t.Fatalf("after %d empty polls of a new group: delay %v, want %v", i, delay, want)
		}
	}
}

// A member that stops waiting leaves the idle line, and only it: the
// members still waiting keep their places, so the next wake-up goes to the
// one of them idle longest, not to the member that left. (Kills W15.)
func TestAMemberThatStopsWaitingLeavesOnlyItsOwnPlace(t *testing.T) {
	g, a, b := pollGroupOfTwo(time.Hour)
	defer g.leave(b)
	defer g.leave(a)
	g.delay = time.Hour
	g.enterIdle(a)
	g.enterIdle(b)
	g.leaveIdle(b) // b was kicked: it no longer waits
	g.srv.wakeGroups(nil)
	if _, ok := probed(b); ok {
		t.Fatal("a wake-up went to the member that had stopped waiting")
	}
	if _, ok := probed(a); !ok {
		t.Fatal("a wake-up did not reach the member still waiting")
	}
}

// Only a poll's empty claim backs the poll off: a claim that answered a
// wake-up (or freed credit, or a full claim before it) and found nothing
// says only that the work announced was taken by someone else, which is
// nothing about what polls are for, so the delay stays. The poll's own
// empty claim then doubles it, up to PollInterval. (Kills W40.)
func TestOnlyAPollsEmptyClaimBacksThePollOff(t *testing.T) {
	g, a := pollGroupOfOne(time.Hour)
	defer g.leave(a)
	delay := func() time.Duration {
		g.mu.Lock()
		defer g.mu.Unlock()
		return g.delay
	}
	g.mu.Lock()
	g.delay = time.Second
	g.mu.Unlock()
	g.claimed(claimedNone, false)
	if d := delay(); d != time.Second {
		t.Fatalf("an empty claim that answered a wake-up moved the poll's delay from 1s to %v; want it left alone", d)
	}
	g.claimed(claimedNone, true)
	if d := delay(); d != 2*time.Second {
		t.Fatalf("the poll's own empty claim: delay %v, want 1s doubled", d)
	}
}
