package server

import (
	"slices"
	"strings"
	"sync"
	"time"
)

// pollGroup is the sessions of this replica that take the same streams (the
// same stream filter): they would all find the same work, so they share one
// idle poll and one wake-up.
//
// A session that waits with credit free is idle in its group. The group's
// poll timer, armed while it has idle members (armed once: a member that
// waits again does not move it), wakes one of them (the one idle longest)
// to claim, and a wake-up (a discovery round that made work
// of these streams ready, a NOTIFY from another replica, an operator's
// action) does the same. A claim that came back with all it asked for
// (there may be more) wakes the next idle member, so the work decides how
// many members claim, not how many wait. A wake-up that finds no member
// idle (they are claiming, or have no credit) is kept: the next member to
// wait with credit claims at once instead, so no wake-up is lost to a claim
// that started before the work was made claimable.
//
// The poll backs off as a session's did: from minIdlePoll, doubling after
// each poll whose claim found nothing, up to Config.PollInterval, and back
// to minIdlePoll when a poll's claim finds work: work appeared that no
// wake-up announced (a backoff or a lease that ran out, a notification
// lost), and more may follow. A claim that answered a wake-up, freed
// credit or another claim finds work that was announced, which says
// nothing of what polls are for, so it leaves the backoff alone. (It used
// to bring the poll back to minIdlePoll too. Under load that made every
// group poll four or five times after each claim that found work, every
// one of them empty, about a third of the claim statements of a held-xmin
// run (bench/held-xmin-claims.sh); and while a transaction holds the xmin
// horizon back, an empty claim reads every dead entry at the front of the
// claim index's ready range.) An idle replica so runs
// one claim per filter per PollInterval, whatever the number of relays.
type pollGroup struct {
	srv *Server
	key string
	// streams and exclude are the filter every member has.
	streams, exclude []string

	mu sync.Mutex
	// members counts the sessions of the group; the group is dropped when
	// the last one leaves.
	members int
	// idle holds the members waiting with credit, longest waiting first.
	idle []*session
	// pending: a wake-up (or a poll) found no idle member; the next member
	// to wait with credit claims at once. pendingPoll says a poll was among
	// them (for the backoff).
	pending, pendingPoll bool
	// delay is the poll backoff; timer fires at fireAt while armed.
	delay  time.Duration
	timer  *time.Timer
	armed  bool
	fireAt time.Time
	// polls counts the polls that fired (read by tests).
	polls uint64
}

// filterKey names a stream filter: sessions with equal keys take the same
// streams.
func filterKey(streams, exclude []string) string {
	norm := func(s []string) string {
		s = slices.Clone(s)
		slices.Sort(s)
		return strings.Join(slices.Compact(s), "\x00")
	}
	return norm(streams) + "\x01" + norm(exclude)
}

// joinPollGroup adds ss to the group of its stream filter, creating it.
func (s *Server) joinPollGroup(ss *session) *pollGroup {
	key := filterKey(ss.streams, ss.excludeStreams)
	s.groupsMu.Lock()
	defer s.groupsMu.Unlock()
	if s.groups == nil {
		s.groups = make(map[string]*pollGroup)
	}
	g := s.groups[key]
	if g == nil {
		g = &pollGroup{srv: s, key: key, streams: ss.streams, exclude: ss.excludeStreams, delay: minIdlePoll}
		s.groups[key] = g
	}
	g.mu.Lock()
	g.members++
	g.mu.Unlock()
	return g
}

// leave takes ss out of the group for good (its loop ended). A wake-up
// signalled to it and not acted on goes to another member.
func (g *pollGroup) leave(ss *session) {
	g.srv.groupsMu.Lock()
	g.mu.Lock()
	g.removeIdleLocked(ss)
	g.members--
	if g.members == 0 {
		delete(g.srv.groups, g.key)
		if g.timer != nil {
			g.timer.Stop()
		}
		g.armed = false
	}
	g.mu.Unlock()
	g.srv.groupsMu.Unlock()
	g.passOn(ss)
}

// passOn gives a wake-up signalled to ss, which will not claim with it, to
// another member (or keeps it for the next one to wait).
func (g *pollGroup) passOn(ss *session) {
	select {
	case poll := <-ss.probe:
		g.handOn(poll)
	default:
	}
}

// handOn gives a wake-up (poll: the group's poll) that a member took and
// cannot claim with to the longest idle member, or keeps it for the next
// member to wait with credit.
func (g *pollGroup) handOn(poll bool) {
	g.mu.Lock()
	g.wakeLocked(poll, true)
	g.mu.Unlock()
}

// enterIdle makes ss an idle member, the last in line, and arms the poll.
// It returns true instead, leaving ss out, when a wake-up was kept for the
// next member: ss then claims at once (poll says whether a poll was among
// what it stands for).
func (g *pollGroup) enterIdle(ss *session) (claimNow, poll bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.pending {
		poll = g.pendingPoll
		g.pending, g.pendingPoll = false, false
		return true, poll
	}
	if !slices.Contains(g.idle, ss) {
		g.idle = append(g.idle, ss)
	}
	g.armLocked()
	return false, false
}

// leaveIdle takes ss out of the idle line (it stopped waiting).
func (g *pollGroup) leaveIdle(ss *session) {
	g.mu.Lock()
	g.removeIdleLocked(ss)
	g.mu.Unlock()
}

func (g *pollGroup) removeIdleLocked(ss *session) {
	if i := slices.Index(g.idle, ss); i >= 0 {
		g.idle = slices.Delete(g.idle, i, i+1)
	}
}

// wake wakes one idle member to claim; with none idle, the next member to
// wait with credit claims at once.
func (g *pollGroup) wake() { g.handOn(false) }

// wakeLocked signals the longest idle member to claim (poll: as the group's
// poll). With no member idle it keeps the wake-up when keep is set.
func (g *pollGroup) wakeLocked(poll, keep bool) {
	if len(g.idle) == 0 {
		if keep {
			g.pending = true
			g.pendingPoll = g.pendingPoll || poll
		}
		return
	}
	ss := g.idle[0]
	g.idle = slices.Delete(g.idle, 0, 1)
	if !poll {
		g.srv.wakeups.Add(1)
	}
	select {
	case ss.probe <- poll:
	default:
		// A signal it has not acted on yet: it claims after this wake-up
		// anyway.
	}
}

// armLocked arms the poll timer for delay from now unless it is armed.
func (g *pollGroup) armLocked() {
	if g.armed || len(g.idle) == 0 || g.srv.noPolls.Load() {
		return
	}
	g.armed = true
	g.fireAt = time.Now().Add(g.delay)
	if g.timer == nil {
		g.timer = time.AfterFunc(g.delay, g.fire)
	} else {
		g.timer.Reset(g.delay)
	}
}

// fire is the poll: one idle member claims.
func (g *pollGroup) fire() {
	g.mu.Lock()
	if !g.armed || time.Now().Before(g.fireAt) {
		// Stopped, or re-armed earlier or later since this firing was
		// scheduled: the timer fires again then.
		g.mu.Unlock()
		return
	}
	g.armed = false
	g.polls++
	if now := time.Now(); len(g.idle) > 0 && g.srv.pollCovered(now) {
		// Nothing to claim as of the discovery loop's probe: back off as
		// after an empty claim and poll again later.
		g.srv.skippedPolls.Add(1)
		g.delay = min(g.delay*2, g.srv.cfg.PollInterval)
		g.armLocked()
	} else {
		g.wakeLocked(true, true)
	}
	g.mu.Unlock()
	if h := g.srv.afterPoll.get(); h != nil {
		h()
	}
}

// claimed records what a member's claim found (poll: the claim was the
// group's poll): work a poll found resets the backoff (and re-arms a poll
// armed for later), an empty claim a poll asked for doubles it, a failed
// one slows it, and a claim that got all it asked for wakes the next idle
// member, since there may be more.
func (g *pollGroup) claimed(outcome claimOutcome, poll bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	switch outcome {
	case claimedAll, claimedSome:
		if poll {
			g.delay = minIdlePoll
			if g.armed && time.Until(g.fireAt) > g.delay {
				g.armed = false
			}
		}
		if outcome == claimedAll {
			g.wakeLocked(false, false)
		}
	case claimedNone:
		if poll {
			g.delay = min(g.delay*2, g.srv.cfg.PollInterval)
		}
	case claimFailed:
		g.delay = max(g.delay, 100*time.Millisecond)
	}
	g.armLocked()
}

// wakeGroups wakes one idle member of each group whose filter admits one of
// streams (every group when streams is nil).
func (s *Server) wakeGroups(streams []string) {
	s.groupsMu.Lock()
	groups := make([]*pollGroup, 0, len(s.groups))
	for _, g := range s.groups {
		groups = append(groups, g)
	}
	s.groupsMu.Unlock()
	for _, g := range groups {
		if streams != nil && !g.admitsAny(streams) {
			continue
		}
		s.groupWakeups.Add(1)
		g.wake()
	}
}

// admitsAny says whether the group's filter takes one of streams.
func (g *pollGroup) admitsAny(streams []string) bool {
	return slices.ContainsFunc(streams, func(st string) bool { return filterAdmits(g.streams, g.exclude, st) })
}

// filterAdmits says whether a stream filter (streams taken, none meaning
// all; streams excluded) takes events of stream, as the claim's filter does.
func filterAdmits(streams, exclude []string, stream string) bool {
	return (len(streams) == 0 || slices.Contains(streams, stream)) && !slices.Contains(exclude, stream)
}
