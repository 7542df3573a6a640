package server

import (
	"bytes"
	"context"
	"errors"
	"slices"
	"time"

	"github.com/google/uuid"

	"github.com/outboxd/outboxd/internal/store"
)

// discover runs discovery rounds until ctx ends: each finds the events
// committed since the previous round, leases the next event of idle
// aggregates straight to this replica's waiting sessions (dispatch, see
// discoverRound), makes the other aggregates claimable, and (through NOTIFY
// outbox_wakeup, and directly for this replica's sessions) wakes idle
// sessions to claim those. It is how producers' events
// reach delivery without their transactions writing anything the server
// owns. Every replica runs the loop; replicas take turns in the database, so
// concurrent rounds cost one advisory-lock attempt each.
//
// While rounds find events the loop pauses as long as the last round took
// (less after a round that found few: roundPause), between
// DiscoveryInterval and DiscoveryPaceMax (after a lone event in a trickle,
// half DiscoveryIdleInterval: see doc.go, Discovery); once a round finds
// nothing it doubles the wait, up to DiscoveryIdleInterval, which is then
// the longest an event waits for its first round. After a turn that found
// nothing the loop first asks whether the next round has
// anything to do (store.RoundDue: one statement, one round trip, no
// transaction, no discovery lock) and runs the round only then, where an
// empty round takes the discovery lock. A round that found one
// event at most is followed by a check too, not by a round: a source with a
// trickle of events (one every 50 ms, say) therefore pays one round per
// event and a handful of checks, where it paid two rounds (the one that
// found the event and an empty one after: 1.5 scans per event in 19 such
// sources) and the checks. A busy loop never checks (a round that found
// several events is followed by a round), so the check's round trip lands
// only on an event after a pause or after a lone one.
// Once its rounds have found nothing for DiscoveryQuietAfter, the checks
// come every DiscoveryQuietInterval instead (by default the same): a
// replica serving many sources spreads a budget of checks over them rather
// than paying 40 a second for each quiet database, and the first event
// after a quiet spell waits up to that long to be found.
//
// A database whose discovery state is not this cluster's (restored from a
// dump into another cluster, or a transaction counter set back) stops
// discovery: rounds fail with store.ErrDiscoveryStopped until an operator
// re-scans (`outboxd rescan`), and resume by themselves after it. The loop
// records the stop in the database at once (see store.DiscoveryStopped), so
// that it holds even after the counter passes the stored snapshot, says so
// once at error level, and tries again every DiscoveryIdleInterval (a
// second at least).
func (s *Server) discover(ctx context.Context) {
	wait := s.cfg.DiscoveryInterval
	t := time.NewTimer(0)
	defer t.Stop()
	stopped := ""
	// The last turn (a round or a check) found nothing, or a round found
	// one event: check before the next round.
	empty := false
	// active is when a round last found events, or the loop started if
	// later: the loop is quiet DiscoveryQuietAfter after it.
	started := time.Now()
	active := func() time.Time {
		if at := time.Unix(0, s.lastEvents.Load()); at.After(started) {
			return at
		}
		return started
	}
	quiet := func() bool { return time.Since(active()) >= s.cfg.DiscoveryQuietAfter }
	// reset arms the timer for the next turn: wait, or the quiet interval
	// (as last set) once an idle loop's rounds have found nothing for long
	// enough.
	//
	// A quiet pause ends on the grid of its length (alignedPause): every
	// quiet loop of the replica shares the quiet interval, so the checks of
	// its quiet sources fall due together and the process wakes once for
	// all of them instead of once for each. On this project's 2-core VM a
	// wake-up of an idle Go process costs 0.1-0.4 ms of CPU before any
	// work, a query after an idle pause 0.4-1.8 ms against 0.03-0.06 back
	// to back (bench/cmd/wakeup-cost; it varies with the host's load),
	// which made the wake-ups, not the checks, most of what 50 quiet
	// sources cost the server.
	type pause struct {
		chosen, armed time.Duration
		at            time.Time // when armed
	}
	nextPause := func() pause {
		if s.wake.isAsleep() {
			// Asleep: producers' notices end the pause; the check at its
			// end is a safety net, on the grid as the quiet checks are.
			d := max(time.Duration(s.asleepCheck.Load()), time.Duration(s.quietInterval.Load()))
			at := time.Now()
			return pause{chosen: d, armed: alignedPause(at, d, 0), at: at}
		}
		p := pause{chosen: wait, armed: wait, at: time.Now()}
		if empty && wait >= s.cfg.DiscoveryIdleInterval && quiet() {
			p.chosen = max(wait, time.Duration(s.quietInterval.Load()))
			p.armed = p.chosen
			if p.chosen > wait {
				p.armed = alignedPause(p.at, p.chosen, 0)
			}
		}
		return p
	}
	reset := func(p pause) {
		if h := s.afterDiscoveryWait.get(); h != nil {
			h(p.chosen, p.armed, p.at)
		}
		t.Reset(p.armed)
	}
	// backOff doubles the wait after a turn that found nothing.
	backOff := func() { wait = min(2*wait, s.cfg.DiscoveryIdleInterval) }
	// credit is s.creditOffered while the loop waits for a session to offer
	// credit (a round put off for want of any: see discoverRound), else nil.
	var credit <-chan struct{}
	// sleepAfter is when the loop may next try to sleep after a try that
	// failed (another replica sleeps, say): not at every check.
	var sleepAfter time.Time
	// justAsleep: the loop fell asleep at its last check, so the next one
	// (at once) is followed by a sleeping pause, longer than the cover of
	// the probe taken before it.
	justAsleep := false
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-credit:
			t.Stop()
		case <-s.discoverWake:
			// A producer committed while the loop slept (or the sleep
			// ended: its connection was lost, or the settings no longer
			// allow it): a round, without a check.
			t.Stop()
			empty = false
		}
		credit = nil
		if empty {
			probe, asked := s.claimProbeWanted(justAsleep), time.Now()
			justAsleep = false
			due, claims, err := s.store.RoundDue(ctx, probe, s.cfg.maxDue())
			nothing := err == nil && !due
			var next pause
			if nothing {
				backOff()
				// Everything is discovered: whatever the last rounds were
				// short of credit for is not saturation (discoverRound).
				s.shortSince = time.Time{}
				fellAsleep := false
				if !s.wake.isAsleep() && !time.Now().Before(sleepAfter) {
					if fellAsleep = s.trySleep(ctx); !fellAsleep {
						sleepAfter = time.Now().Add(sleepRetry)
					}
				}
				next = nextPause()
				if fellAsleep {
					// An event committed between this check and the lock
					// notified nobody: check once more, now.
					next = pause{at: time.Now()}
					justAsleep = true
				}
			}
			if err == nil && claims.Probed {
				// Asked, not answered: the probe's times then err early.
				// It covers the polls until the next check, whose pause is
				// known now (a round due next covers them sooner).
				covers := s.cfg.PollInterval
				if nothing {
					covers = probeCovers(s.cfg.PollInterval, next.armed)
				}
				s.claimProbe.Store(&probedClaims{at: asked, covers: covers, ClaimProbe: claims})
			}
			if h := s.afterRoundDue.get(); h != nil {
				h(due, err)
			}
			// A failed check runs the round, which reports the failure.
			if nothing {
				// The check's conditions include every stop condition
				// (see store.RoundDue): discovery runs.
				s.lastTurn.Store(&discoveryTurn{at: time.Now()})
				reset(next)
				continue
			}
		}
		// The round's wall time, waits for a connection or a lock included:
		// what the pause after it follows (roundPause).
		began := time.Now()
		found, round, err := s.discoverRound(ctx)
		took := time.Since(began)
		if round.noCredit {
			// Put off until a session offers credit, or the idle interval
			// (sessions that end offer none; without them the next round
			// is not bounded). The events wait in outbox.event, where they
			// cost nothing, rather than as ready rows for claims.
			credit = s.creditOffered
			if h := s.afterPutOff.get(); h != nil {
				h()
			}
			reset(pause{chosen: s.cfg.DiscoveryIdleInterval, armed: s.cfg.DiscoveryIdleInterval, at: time.Now()})
			continue
		}
		if err == nil {
			s.lastTurn.Store(&discoveryTurn{at: time.Now()})
		}
		if stopped != "" && err == nil {
			s.log.Info("discovery resumed")
			s.metrics.discoveryStop.Set(0)
			stopped = ""
		}
		// A round as large as its bound left the rest of a backlog there.
		full := err == nil && round.bound > 0 && found.Events >= int64(round.bound)
		switch {
		case errors.Is(err, store.ErrDiscoveryStopped):
			s.metrics.discoveryErrors.Inc()
			reason, rerr := s.store.DiscoveryStopped(ctx)
			if rerr != nil {
				reason = err.Error()
			}
			s.metrics.discoveryStop.Set(1)
			s.lastTurn.Store(&discoveryTurn{at: time.Now(), stopped: reason})
			if reason != stopped {
				s.log.Error("discovery stopped: new events are not delivered until an operator re-scans", "reason", reason)
				stopped = reason
			}
			wait = max(time.Second, s.cfg.DiscoveryIdleInterval)
		case err != nil:
			if ctx.Err() != nil {
				return
			}
			// Backing off to a second at most: the database is likely down,
			// and a log line every few milliseconds would bury the cause.
			wait = min(max(2*wait, s.cfg.DiscoveryIdleInterval), max(time.Second, s.cfg.DiscoveryIdleInterval))
			s.metrics.discoveryErrors.Inc()
			s.log.Warn("discovery round failed; retrying", "err", err, "in", wait)
		case found.Events > 0:
			s.metrics.discovered.Add(float64(found.Events))
			now := time.Now()
			// Paced by the round (see Config.DiscoveryPaceMax), but not
			// while a backlog is taken in parts: a round as large as its
			// bound (DiscoveryMaxEvents, or the credit its sessions
			// offered) leaves the rest there, and the next one goes on
			// without the pause, as far as credit allows.
			wait = max(s.cfg.DiscoveryInterval, min(roundPause(took, found.Events), s.cfg.DiscoveryPaceMax))
			if full {
				wait = s.cfg.DiscoveryInterval
			}
			// (Not a round as large as its bound, even of one event: the
			// rest of the backlog is there already.)
			if found.Events == 1 && !full && now.Sub(active()) > s.cfg.DiscoveryIdleInterval {
				// A trickle: one event, and the round before that found any
				// was more than the idle interval ago. A check 1, 2, 4 ms
				// later would almost never find the next one (a source with
				// an event every 50 ms made 4-6 empty checks per event), so
				// the first waits half the idle interval. Events closer
				// together (a busier source, a burst under way) keep the
				// short pause.
				wait = max(s.cfg.DiscoveryInterval, s.cfg.DiscoveryIdleInterval/2)
			}
			s.lastEvents.Store(now.UnixNano())
		default:
			backOff()
		}
		switch {
		case err == nil && found.Aggregates > 0:
			// Rows made ready wait for a claim; dispatched ones are with
			// their sessions already. One session of each poll group that
			// takes their streams claims (the others only if it finds all
			// it asks for); the other replicas hear of them through the
			// round's NOTIFY, which this replica's listener leaves alone.
			s.wakeGroups(round.ready)
		case round.echoed:
			// A wake-up from the round's backend that the round does not
			// account for (its answer was lost, say): act on it now.
			s.wakeGroups(nil)
		}
		empty = err == nil && found.Events <= 1
		if !empty || full {
			// Events come faster than one a round, a backlog waits, or the
			// round failed: poll, and leave the producers' commits alone.
			s.wake.wakeUp(ctx)
		}
		reset(nextPause())
	}
}

// trySleep tries to put the discovery loop to sleep (waker.sleep), between
// the tests' hooks.
func (s *Server) trySleep(ctx context.Context) bool {
	if h := s.beforeSleep.get(); h != nil {
		h()
	}
	asleep := s.wake.sleep(ctx)
	if h := s.afterSleep.get(); h != nil {
		h(asleep)
	}
	return asleep
}

// alignedPause is how long from now to the next instant after it on the
// grid of multiples of d, shifted by offset (counted from the zero time,
// so every timer with the same d and offset shares the grid). A timer
// re-armed with it on every firing fires once every d, on the grid, from
// its second pause on; no pause is longer than d (so a bound stated for a
// pause of d holds), and only the first may be shorter.
func alignedPause(now time.Time, d, offset time.Duration) time.Duration {
	shifted := now.Add(-offset)
	return shifted.Truncate(d).Add(d).Sub(shifted)
}

// probedClaims is what a discovery check's probe of the claims found
// (store.RoundDue), when, and how long it lets polls skip their claims
// (probeCovers).
type probedClaims struct {
	at     time.Time
	covers time.Duration
	store.ClaimProbe
}

// claimProbeWanted says whether the loop's next check should also probe
// the claims: while a poll group has a member waiting, at most every half
// PollInterval, so that each poll finds a probe that still covers it (see
// pollCovered, probeCovers), unless renew: the check is followed by a
// longer pause than the last probe was taken to cover (the loop's first
// check asleep), so a probe of its own covers the polls until the next.
func (s *Server) claimProbeWanted(renew bool) bool {
	if p := s.claimProbe.Load(); !renew && p != nil && time.Since(p.at) < s.cfg.PollInterval/2 {
		return false
	}
	s.groupsMu.Lock()
	defer s.groupsMu.Unlock()
	for _, g := range s.groups {
		g.mu.Lock()
		idle := len(g.idle) > 0
		g.mu.Unlock()
		if idle {
			return true
		}
	}
	return false
}

// pollCovered says whether a poll group's poll at now may skip its claim:
// the discovery loop's check probed the claims of every stream less than
// probeCovers ago and found none claimable, and none due by now. A claim
// would then find only what became claimable since the probe, and each way
// that happens is covered without it: an event (the loop's next round
// dispatches it or wakes the groups), an ack, nack or release on this
// replica (the session is told, or the groups woken), one on another
// replica or an operator's action (their NOTIFY; a NOTIFY lost with the
// LISTEN connection is what the poll is for, and a poll skips only on a
// probe younger than probeCovers, so the first poll after the next probe
// or after probeCovers claims),
// a lease expiry or the end of a backoff (the probe's NextIn: a poll after
// it claims). So a lost notification delays work by at most the probe's
// cover and a PollInterval (about twice PollInterval while checks come at
// least every half PollInterval), and an idle replica's checks, which it
// makes anyway, take the place of its groups' claims: one statement a check
// for a quiet source with relays, not one more per stream filter and
// PollInterval. A busy loop does not check, so its groups poll as before.
func (s *Server) pollCovered(now time.Time) bool {
	p := s.claimProbe.Load()
	return p != nil && now.Sub(p.at) < p.covers && !p.Claimable &&
		(p.NextIn < 0 || now.Sub(p.at) < p.NextIn)
}

// probeCovers is how long a probe that found nothing claimable lets polls
// skip their claims, given the pause before the loop's next check:
// PollInterval, or, when that pause is longer than half a PollInterval (a
// quiet loop of a replica that spreads its budget of checks over many
// sources: --idle-checks-per-second), the pause and half a PollInterval
// more, so that every poll until the next check finds this probe. Without
// that margin a replica of 50 idle sources checked each every second, and
// polls that found the probe just older than PollInterval claimed anyway.
// The pause is the one the check arms, so a probe taken while the loop
// checks often does not cover longer because the loop turns quiet later.
func probeCovers(poll, pause time.Duration) time.Duration {
	return max(poll, pause+poll/2)
}

// discoveryTurn is what one turn of the discovery loop (a check or a
// round) said of discovery: stopped and why, or "" while it runs.
type discoveryTurn struct {
	at      time.Time
	stopped string
}

// discoveryStopped is why discovery is stopped, or "" while it runs: ""
// when the discovery loop's last turn found it running and that is fresh
// (the loop turns at least every quiet interval), else as the database
// says now (store.DiscoveryStopped, which records a stop it notices
// first). A stop is always asked about, so that readiness follows an
// operator's re-scan at once rather than at the stopped loop's next try.
func (s *Server) discoveryStopped(ctx context.Context) (string, error) {
	if t := s.freshTurn(); t != nil && t.stopped == "" {
		return "", nil
	}
	return s.store.DiscoveryStopped(ctx)
}

// freshTurn is the discovery loop's last turn that reached the database if
// it is fresh (the loop turns at least every quiet interval), else nil.
func (s *Server) freshTurn() *discoveryTurn {
	fresh := max(2*time.Duration(s.quietInterval.Load()), 2*s.cfg.DiscoveryIdleInterval, time.Second,
		2*time.Duration(s.asleepCheck.Load()))
	if t := s.lastTurn.Load(); t != nil && time.Since(t.at) < fresh {
		return t
	}
	return nil
}

// asleepCheckInterval is the pause between a sleeping discovery loop's
// checks (at least the quiet interval): they find only what no producer's
// notice announced, which nothing but a lost notification leaves.
const asleepCheckInterval = time.Second

// sleepRetry is how long a discovery loop that could not sleep (another
// replica sleeps, or the database's settings say no) checks before it tries
// again: a try is a statement on the LISTEN connection.
const sleepRetry = time.Second

// fullRound is how many events a round finds for the pause after it to be
// as long as the round took (roundPause).
const fullRound = 32

// roundPause is the pause after a round that took took and found events:
// as long as the round once it found fullRound events or more, and that
// share of it below. A round's cost is mostly fixed, so under load, where
// rounds are full, the next one collects what arrived while this one ran
// and carries about twice the events for the same cost; a light load's
// rounds find a few events each, whose wait the pause would lengthen for
// little to share (on the benchmark's machine a round at half load found
// about five, in ~3 ms), so they go on after DiscoveryInterval, or a small
// share of their length where rounds are slow.
func roundPause(took time.Duration, events int64) time.Duration {
	if events >= fullRound {
		return took
	}
	return took * time.Duration(events) / fullRound
}

// discoverRound runs one discovery round, dispatching what it can, and
// says what the loop needs to know of it (roundOutcome).
//
// Dispatch: an aggregate the round finds idle (or new) has nothing in hand,
// so its next event would otherwise be made ready by the round and leased
// by a claim, two writes of its delivery row. Instead the round leases it
// to a local session in the same statement that wakes the others. Sessions
// offer the credit they have free while they wait (session.offerCredit);
// the round borrows it up front (session.lendUpTo: at most the round's
// DiscoveryMaxFound each, as no round dispatches more), so that the credit a
// session lends is never also used by its own claims, and sends the offer
// with the round (store.Discover): the database gives each idle aggregate,
// oldest first, to the next session in turn whose stream filter admits it
// and whose credit is not used up, and leases it only if it is still idle
// once locked and its next revision is there and not skipped. The round
// then gives each session its leases and returns the credit it did not use
// (session.give). Turns rotate over rounds: the next round begins with the
// session after the one this round gave its last aggregate to.
// Dispatch cannot starve older work: a session offers credit only after a
// claim came back short, and claims with the credit an ack frees before it
// offers any again.
//
// A saturated replica's round takes what the sessions can take: once every
// round for saturatedAfter has found more events than the sessions offered
// credit for, and while every session of the replica takes every stream, a
// round takes about as many events as they offer credit (whole
// transactions, oldest first: discover_scan's p_max_events), and none when
// they offer none (the round is put off until one does: round.noCredit).
// What it found beyond the credit it could only make ready, for claims;
// left in outbox.event instead, undiscovered, it costs nothing until credit
// frees, while every ready row costs a claim and a second write of its
// delivery row, and under a held xmin horizon every claim reads past the
// dead entries the claims before it left (the "claim mode" of relays with
// little credit; BENCHMARKS.md). Any session can take any of the events, so
// the oldest first is the order they would be delivered in anyway. Only
// once saturated: a burst beyond the credit is made ready as before, and
// every session's claims take it in parallel as acks free credit, where
// undiscovered it would wait for this loop's rounds one at a time (at 16
// credit and 900 events/s, bounding every round doubled commit->sink p99).
// A round that takes everything it found within the credit ends the
// saturation, as does a check that finds nothing due; a round that lost
// its turn to another replica's does not. Not with stream filters: there a
// round bounded by one stream's credit would make another stream's events
// wait behind a backlog of the first that its relays cannot take, so a
// replica with a filtered session bounds its rounds only by
// DiscoveryMaxEvents, as one without sessions does (other replicas'
// sessions claim what it makes ready).
func (s *Server) discoverRound(ctx context.Context) (_ store.Discovery, round roundOutcome, _ error) {
	var creditKnown, bounded bool
	var creditOffered int
	var loans []*loan
	var offers []store.Offer
	round.bound = s.cfg.DiscoveryMaxEvents
	if !s.cfg.NoDispatch {
		// Held until the round's leases are with their sessions: once Stop
		// has closed stopping no round dispatches (see leaseGate), and a
		// session that then ends for want of deliveries has all of its own.
		if leased, ok := s.leasing(false); ok {
			defer leased()
			// An offer from before this borrow is in it; one after it
			// signals anew.
			select {
			case <-s.creditOffered:
			default:
			}
			var everyStream bool
			loans, offers, everyStream = s.borrowCredit()
			if everyStream {
				credit := 0
				for _, l := range loans {
					credit += l.units
				}
				creditKnown, creditOffered = true, credit
				if after := time.Duration(s.saturatedAfter.Load()); after == 0 || !s.shortSince.IsZero() && time.Since(s.shortSince) >= after {
					bounded = true
					if credit == 0 {
						round.noCredit = true
						return store.Discovery{}, round, nil
					}
					if round.bound == 0 || credit < round.bound {
						round.bound = credit
					}
				}
			}
		}
	}
	if len(loans) > 0 {
		// A lease dispatched but not yet with its session must not be
		// taken for an orphan (releaseUndelivered): held from before the
		// round commits until every one is given.
		s.handOverMu.RLock()
		defer s.handOverMu.RUnlock()
		if h := s.beforeRound.get(); h != nil {
			h()
		}
	}
	var pid uint32
	applying := func(p uint32) {
		pid = p
		s.wake.openRound(p)
	}
	found, err := s.store.Discover(ctx, s.cfg.ReplicaID, s.cfg.DiscoveryMaxFound, round.bound, offers, applying)
	if h := s.afterDiscover.get(); h != nil {
		found, err = h(found, err)
	}
	if pid != 0 {
		round.echoed = s.wake.closeRound(pid, err == nil && found.Aggregates > 0)
	}
	if err != nil {
		// A round whose answer was lost may have committed: a session it
		// dispatched to could hold leases it never hears of, so each one
		// sweeps its orphans once this round is done. A round refused,
		// rolled back or never sent leased nothing.
		lost := errors.Is(err, store.ErrAnswerLost)
		for _, l := range loans {
			l.ss.give(nil, l.units)
			if lost {
				l.ss.requestSweep()
			}
		}
		return found, round, err
	}
	if found.LastHolder != uuid.Nil {
		s.dispatchAfter = found.LastHolder
	}
	// A round that took nothing says nothing of the credit: it found
	// nothing new, or it lost its turn to another replica's round (both
	// return no row). Were that to end the saturation, replicas taking
	// turns would end each other's at almost every round. A round that
	// found nothing is followed by a check, which ends it when nothing is
	// due (the loop).
	short := creditKnown && (found.Events > int64(creditOffered) || (bounded && found.Events >= int64(round.bound)))
	switch {
	case found.Events == 0:
	case !short:
		s.shortSince = time.Time{}
	case s.shortSince.IsZero():
		s.shortSince = time.Now()
	}
	byHolder := make(map[uuid.UUID]*loan, len(loans))
	for _, l := range loans {
		byHolder[l.ss.id] = l
	}
	for _, d := range found.Dispatched {
		if l := byHolder[d.Holder]; l != nil {
			l.leases = append(l.leases, d.Lease)
		}
	}
	for _, l := range loans {
		s.metrics.dispatched.Add(float64(len(l.leases)))
		s.dispatched.Add(uint64(len(l.leases)))
		if l.ss.give(l.leases, l.units) || len(l.leases) == 0 {
			continue
		}
		// The session's stream ended before its leases reached it; its own
		// release may have run before they committed, so release again.
		relCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), releaseTimeout)
		if _, err := s.store.Release(relCtx, l.ss.id); err != nil {
			s.log.Warn("releasing leases dispatched to a session that ended failed; they expire by TTL",
				"session", l.ss.id, "leases", len(l.leases), "err", err)
		}
		cancel()
	}
	round.ready = readyStreams(found.Found, found.Dispatched, s.cfg.DiscoveryMaxFound)
	return found, round, nil
}

// saturatedAfter is how long every round must have found more than its
// sessions' credit before rounds take no more than that credit (see
// discoverRound).
const saturatedAfter = 250 * time.Millisecond

// roundOutcome is what a discovery round tells the loop besides its
// Discovery.
type roundOutcome struct {
	// ready names the streams of the aggregates the round found and did not
	// dispatch, the only ones it may have made ready (nil: it cannot tell,
	// any stream).
	ready []string
	// echoed says the listener held back a wake-up from the round's backend
	// as the round's own (see waker.openRound); the loop wakes the sessions
	// when the round does not say it made rows ready.
	echoed bool
	// bound is about the most events the round could take (0: no bound): a
	// round that found as many leaves more there.
	bound int
	// noCredit says the round was put off, not run: the replica is
	// saturated, every session of it takes every stream, and none offered
	// credit.
	noCredit bool
}

// borrowCredit borrows the credit the local sessions offer, for a discovery
// round to dispatch with: a loan and an offer per session that lends any,
// taking turns from after the session the last round gave its last
// aggregate to. everyStream says the replica has sessions and each takes
// every stream (the round may then be bounded by their credit).
func (s *Server) borrowCredit() (loans []*loan, offers []store.Offer, everyStream bool) {
	sessions := s.dispatchSessions()
	everyStream = len(sessions) > 0
	for _, ss := range sessions {
		everyStream = everyStream && len(ss.streams) == 0 && len(ss.excludeStreams) == 0
	}
	if len(sessions) > 0 {
		// Turns begin after the session the last round gave its last
		// aggregate to (or where it stood, if it has gone).
		first, found := slices.BinarySearchFunc(sessions, s.dispatchAfter, func(ss *session, id uuid.UUID) int {
			return bytes.Compare(ss.id[:], id[:])
		})
		if found {
			first++
		}
		for i := range sessions {
			ss := sessions[(first+i)%len(sessions)]
			n := ss.lendUpTo(s.cfg.DiscoveryMaxFound)
			if n == 0 {
				continue
			}
			loans = append(loans, &loan{ss: ss, units: n})
			offers = append(offers, store.Offer{Holder: ss.id, RelayID: ss.relayID, TTL: ss.ttl, Credit: n,
				StreamFilter: ss.filter()})
		}
	}
	return loans, offers, everyStream
}

// readyStreams returns the distinct streams of the aggregates found and not
// dispatched, or nil (any stream) when there were none to tell or the round
// returned maxFound aggregates, which may be fewer than it made ready.
func readyStreams(found []store.FoundAggregate, dispatched []store.DispatchedLease, maxFound int) []string {
	if len(found) >= maxFound {
		// The round returned as many as it may: it may have made ready
		// aggregates it did not return, of other streams.
		return nil
	}
	type key struct{ stream, aggregate string }
	leased := make(map[key]bool, len(dispatched))
	for _, d := range dispatched {
		leased[key{d.Lease.Event.Stream, d.Lease.Event.AggregateKey}] = true
	}
	var streams []string
	for _, a := range found {
		if !leased[key{a.Stream, a.AggregateKey}] && !slices.Contains(streams, a.Stream) {
			streams = append(streams, a.Stream)
		}
	}
	return streams
}

// loan is the credit one discovery round took from one session, and the
// leases it dispatched to it.
type loan struct {
	ss     *session
	units  int
	leases []store.Lease
}

// dispatchSessions returns this replica's sessions in a stable order (by id),
// so that turns that begin after dispatchAfter spread rounds over them.
func (s *Server) dispatchSessions() []*session {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]*session, 0, len(s.sessions))
	for _, ss := range s.sessions {
		out = append(out, ss)
	}
	slices.SortFunc(out, func(a, b *session) int { return bytes.Compare(a.id[:], b.id[:]) })
	return out
}
