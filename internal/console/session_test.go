package console

import (
	"testing"
	"time"
)

// A session ends when unused for the idle timeout, however young it is,
// and each use moves that end: an operator who keeps working is not logged
// out after the idle timeout, one who walks away is. The clock is the
// caller's, so the test steps it instead of waiting.
func TestSessionIdleTimeoutCountsFromLastUse(t *testing.T) {
	t.Parallel()
	s := newSessions(12*time.Hour, time.Hour)
	t0 := time.Date(2026, 1, 1, 9, 0, 0, 0, time.UTC)
	id := s.create(t0).id
	for _, at := range []time.Duration{50 * time.Minute, 100 * time.Minute, 150 * time.Minute} {
		// Used every 50 minutes: 150 minutes after login, well past one
		// idle timeout since creation, it is still live.
		if s.get(id, t0.Add(at)) == nil {
			t.Fatalf("session used every 50m ended at +%v with a 1h idle timeout", at)
		}
	}
	if s.get(id, t0.Add(150*time.Minute+time.Hour+time.Second)) != nil {
		t.Error("session unused for more than the idle timeout is still live")
	}
	if s.get(id, t0.Add(150*time.Minute+time.Second)) != nil {
		t.Error("an idle-expired session came back: it must be deleted, not just refused once")
	}
}

// A session ends at its lifetime even when used all along.
func TestSessionLifetimeEndsABusySession(t *testing.T) {
	t.Parallel()
	s := newSessions(2*time.Hour, time.Hour)
	t0 := time.Date(2026, 1, 1, 9, 0, 0, 0, time.UTC)
	id := s.create(t0).id
	for at := 30 * time.Minute; at <= 2*time.Hour; at += 30 * time.Minute {
		if s.get(id, t0.Add(at)) == nil {
			t.Fatalf("busy session ended at +%v, before its 2h lifetime", at)
		}
	}
	if s.get(id, t0.Add(2*time.Hour+time.Minute)) != nil {
		t.Error("session used every 30m outlived its 2h lifetime")
	}
}

// The session table is bounded: beyond maxSessions, creating one drops the
// oldest, so a flood of login-page visits cannot grow memory without bound,
// and the sessions of operators who logged in later survive it.
func TestSessionTableDropsTheOldestBeyondItsBound(t *testing.T) {
	t.Parallel()
	s := newSessions(12*time.Hour, time.Hour)
	t0 := time.Date(2026, 1, 1, 9, 0, 0, 0, time.UTC)
	first := s.create(t0).id
	second := s.create(t0.Add(time.Millisecond)).id
	for i := 2; i < maxSessions; i++ {
		s.create(t0.Add(time.Duration(i) * time.Millisecond))
	}
	now := t0.Add(time.Duration(maxSessions) * time.Millisecond)
	last := s.create(now).id
	if n := len(s.m); n != maxSessions {
		t.Errorf("%d sessions after %d creations, want the bound %d", n, maxSessions+1, maxSessions)
	}
	if s.get(first, now) != nil {
		t.Error("the oldest session survived a creation beyond the bound")
	}
	if s.get(second, now) == nil || s.get(last, now) == nil {
		t.Error("a session other than the oldest was dropped")
	}
}
