package server

import (
	"context"
	"log/slog"
	"time"

	"github.com/google/uuid"

	"github.com/outboxd/outboxd/internal/store"
)

// RunJanitor runs one retention pass now and reports what it did.
func (s *Server) RunJanitor(ctx context.Context) (deleted, batches int64, err error) {
	res, err := s.runJanitor(ctx)
	return res.deleted, res.batches, err
}

// Stopping is closed once Stop has begun.
func (s *Server) Stopping() <-chan struct{} { return s.stopping }

// IsClosed reports whether c is closed, without waiting.
func IsClosed(c <-chan struct{}) bool { return isClosed(c) }

// SetBeforeLease makes every claim ("claim") and every ack batch that may
// hand over ("hand-over") call f with its path just before its statement is
// sent, once it may lease (the server is not stopping): Stop waits for it. A
// discovery round that dispatches calls SetBeforeRound's hook there. Stop
// calls g when it finds such a statement under way, before it waits for it
// to return.
func (s *Server) SetBeforeLease(f func(path string), g func()) {
	s.beforeLease.set(f)
	s.stopWaits.set(g)
}

// SetBeforeAddSession makes every Subscribe call f once its checks passed,
// just before its session is added. Set it before the first Subscribe.
func (s *Server) SetBeforeAddSession(f func()) { s.beforeAddSession.set(f) }

// SetBeforeSaveSessions sets f to run in a refresh of the replica's
// relay-session rows between its snapshot of the sessions and its write,
// and g to run when a session's removal finds a refresh under way and is
// about to wait for it.
func (s *Server) SetBeforeSaveSessions(f, g func()) {
	s.beforeSaveSessions.set(f)
	s.removeWaits.set(g)
}

// SessionsDone returns a channel closed once every session has ended and
// been removed.
func (s *Server) SessionsDone() <-chan struct{} { return s.sessionsDone() }

// SetAfterClaim makes every claim's outcome pass through f, which may
// replace it. Set it before the first Subscribe.
func (s *Server) SetAfterClaim(f func([]store.Lease, error) ([]store.Lease, error)) {
	s.afterClaim.set(f)
}

// SetAfterAck makes every ack statement's outcome pass through f, which may
// replace it. Set it before the first Ack.
func (s *Server) SetAfterAck(f func([]store.AckResult, error) ([]store.AckResult, error)) {
	s.afterAck.set(f)
}

// SetBeforeHandOver makes every ack batch call f with its results once it
// has committed, before the leases it handed over reach their sessions.
// Set it before the first Ack.
func (s *Server) SetBeforeHandOver(f func([]store.AckResult)) { s.beforeHandOver.set(f) }

// HandOvers is how many leases acks on this replica have handed over.
func (s *Server) HandOvers() uint64 { return s.handOvers.Load() }

// SetAfterOffer makes every session loop call f (with the session's id and
// the credit it offers) each time it has offered its free credit to
// discovery, before it waits; a blocking f keeps the offer standing. Set it
// before the first Subscribe.
func (s *Server) SetAfterOffer(f func(session uuid.UUID, offered int)) { s.afterOffer.set(f) }

// SetAfterFreed makes every session loop call f each time it found credit
// freed, with whether it claims at once and, if not, the latest time it
// will (zero: no bound but its poll). Set it before the first Subscribe.
func (s *Server) SetAfterFreed(f func(session uuid.UUID, claim bool, claimBy time.Time)) {
	s.afterFreed.set(f)
}

// SetBeforeNackNotice makes every Nack call f with the lease's holder once
// the nack committed, before the holder's session hears that its lease
// ended; a blocking f holds the notice back. Set it before the first Nack.
func (s *Server) SetBeforeNackNotice(f func(holder uuid.UUID)) { s.beforeNackNotice.set(f) }

// SetFreedApplied makes every session loop call f as soon as it has
// applied its freed list (acks, nacks and hand-overs) and let the
// session's lock go, with how many it applied and the session's
// outstanding deliveries then. Set it before the first Subscribe.
func (s *Server) SetFreedApplied(f func(applied int, outstanding int64)) {
	s.freedApplied.set(f)
}

// SetAfterDiscover makes every discovery round's outcome pass through f,
// which may replace it (say, to lose the answer of one that committed),
// before the leases it dispatched reach their sessions.
func (s *Server) SetAfterDiscover(f func(store.Discovery, error) (store.Discovery, error)) {
	s.afterDiscover.set(f)
}

// SetBeforeRound makes every discovery round that borrowed sessions' credit
// call f after it did and before the round is sent.
func (s *Server) SetBeforeRound(f func()) { s.beforeRound.set(f) }

// Dispatched is how many leases discovery rounds on this replica have given
// to sessions.
func (s *Server) Dispatched() uint64 { return s.dispatched.Load() }

// SetBeforeAckBatch makes every ack batch call f before it goes to the
// database; a blocking f holds that committer. Set it before the first Ack.
func (s *Server) SetBeforeAckBatch(f func()) { s.beforeAckBatch.set(f) }

// SetAfterAckQueued makes every Ack call run f after it queued a request
// for a committer (one per committer its acks go to). Set it before the
// first Ack.
func (s *Server) SetAfterAckQueued(f func()) { s.afterAckQueued.set(f) }

// Sessions is how many Subscribe streams the server has open.
func (s *Server) Sessions() (n int) {
	s.forEachSession(func(*session) { n++ })
	return n
}

// InFlight is how many events this replica's sessions count as in flight:
// a session counts its leases before it sends them.
func (s *Server) InFlight() (n int64) {
	s.forEachSession(func(ss *session) { n += ss.inflightN.Load() })
	return n
}

// SetAckLingering makes f run as an ack batch begins to wait for company
// (Config.AckLinger), with the acks it holds so far.
func (s *Server) SetAckLingering(f func(acks int)) { s.ackLingering.set(f) }

// SetBeforeBulkAct makes f run as a bulk action is about to act on an
// aggregate it matched (after its page was read), with its stream and key.
func (s *Server) SetBeforeBulkAct(f func(ctx context.Context, stream, key string)) {
	s.beforeBulkAct.set(f)
}

// SetBulkPage makes bulk actions read n aggregates per page and call f
// (which may be nil) after acting on each page, before reading the next.
// Set it before the first bulk action.
func (s *Server) SetBulkPage(n int, f func()) {
	s.bulkPage.Store(int64(n))
	s.afterBulkPage.set(f)
}

// SetAfterPoll makes every poll of a poll group call f once it has woken a
// session (or kept the wake-up for the next). Set it before the first
// Subscribe.
func (s *Server) SetAfterPoll(f func()) { s.afterPoll.set(f) }

// SetAfterNotify makes the listener call f after it acted on each
// notification.
func (s *Server) SetAfterNotify(f func(channel string)) { s.afterNotify.set(f) }

// Wakeups is how many times poll groups asked a session to claim, other
// than for their polls.
func (s *Server) Wakeups() uint64 { return s.wakeups.Load() }

// GroupWakeups is how many wake-ups poll groups received.
func (s *Server) GroupWakeups() uint64 { return s.groupWakeups.Load() }

// IdleSessions is how many sessions wait in their poll groups with credit.
func (s *Server) IdleSessions() (n int) {
	s.groupsMu.Lock()
	defer s.groupsMu.Unlock()
	for _, g := range s.groups {
		g.mu.Lock()
		n += len(g.idle)
		g.mu.Unlock()
	}
	return n
}

// SetAfterRoundDue makes the discovery loop call f after each check it
// makes, while idle, of whether a round has anything to do, with the
// answer, before it acts on it; a blocking f holds the loop there.
func (s *Server) SetAfterRoundDue(f func(due bool, err error)) { s.afterRoundDue.set(f) }

// SetAfterPutOff makes the discovery loop call f each time it puts a round
// off because every session takes every stream and none offered credit,
// before it waits for an offer.
func (s *Server) SetAfterPutOff(f func()) { s.afterPutOff.set(f) }

// SetSaturatedAfter sets how long rounds must have found more events than
// their sessions' credit before they take no more than it (0: from the
// first round on).
func (s *Server) SetSaturatedAfter(d time.Duration) { s.saturatedAfter.Store(int64(d)) }

// SetAfterDiscoveryWait makes the discovery loop call f with every pause
// it chooses before its next turn, the pause it then arms (a quiet one
// aligned to the quiet interval's grid) and the time it arms it from.
func (s *Server) SetAfterDiscoveryWait(f func(chosen, armed time.Duration, at time.Time)) {
	s.afterDiscoveryWait.set(f)
}

// SetAfterLoopWait makes the periodic loops ("readiness" watches, the
// session "refresh") call f with their interval, every pause they arm
// between turns and the time they arm it from.
func (s *Server) SetAfterLoopWait(f func(loop string, interval, armed time.Duration, at time.Time)) {
	s.afterLoopWait.set(f)
}

// AlignedPause is alignedPause, for tests.
var AlignedPause = alignedPause

// SetReconcileTick makes every session take its reconcile ticks from c
// instead of a ticker every ReconcileInterval (a session selects on it only
// while it has leases to check). Set it before the first Subscribe.
func (s *Server) SetReconcileTick(c <-chan time.Time) { s.reconcileTick = c }

// PollTimer describes the poll of the only poll group: whether its timer
// is armed and when it fires, and how many polls have fired. ok is false
// unless there is exactly one group.
func (s *Server) PollTimer() (fireAt time.Time, armed bool, polls uint64, ok bool) {
	s.groupsMu.Lock()
	defer s.groupsMu.Unlock()
	if len(s.groups) != 1 {
		return time.Time{}, false, 0, false
	}
	for _, g := range s.groups {
		g.mu.Lock()
		fireAt, armed, polls = g.fireAt, g.armed, g.polls
		g.mu.Unlock()
	}
	return fireAt, armed, polls, true
}

// SetClaimProbe records p as the discovery loop's latest probe of the
// claims, taken at by a check that armed pause before the next one.
func (s *Server) SetClaimProbe(at time.Time, pause time.Duration, p store.ClaimProbe) {
	s.claimProbe.Store(&probedClaims{at: at, covers: probeCovers(s.cfg.PollInterval, pause), ClaimProbe: p})
}

// ClaimProbe is when the discovery loop's latest probe of the claims was
// taken (the zero time: none yet) and how long it covers the polls.
func (s *Server) ClaimProbe() (at time.Time, covers time.Duration) {
	if p := s.claimProbe.Load(); p != nil {
		return p.at, p.covers
	}
	return time.Time{}, 0
}

// PollCovered says whether a poll at now may skip its claim (pollCovered).
func (s *Server) PollCovered(now time.Time) bool { return s.pollCovered(now) }

// SkippedPolls is how many polls skipped their claim.
func (s *Server) SkippedPolls() uint64 { return s.skippedPolls.Load() }

// StrandedAudits counts the stranded audits begun.
func (s *Server) StrandedAudits() int {
	s.stranded.mu.Lock()
	defer s.stranded.mu.Unlock()
	return s.stranded.started
}

// LagScraper returns a scrape of a lag collector whose reads are read, on
// the clock now.
func LagScraper(read func(context.Context) (store.Lag, error), now func() time.Time) func() error {
	c := newLagCollector(&Server{log: slog.New(slog.DiscardHandler)})
	c.readLag, c.now = read, now
	return func() error { _, err := c.read(); return err }
}

// RequestSweep asks the session's loop to release the leases it holds but
// does not know of, as a failed claim or a lost round's answer does, and
// reports whether the session was found.
func (s *Server) RequestSweep(id uuid.UUID) bool {
	s.mu.Lock()
	ss := s.sessions[id]
	s.mu.Unlock()
	if ss == nil {
		return false
	}
	ss.requestSweep()
	return true
}

// SetSweepWaits makes a session's sweep for orphans call f when it has to
// wait for leases being handed over or dispatched to reach their sessions;
// SetAfterSweep makes it call g when done, with how many it released.
func (s *Server) SetSweepWaits(f func(session uuid.UUID), g func(session uuid.UUID, released int)) {
	s.sweepWaits.set(f)
	s.afterSweep.set(g)
}

// SetAfterGive makes every discovery round that borrowed a session's
// credit call f as it gives the session its leases and the credit they did
// not use, with whether that woke the session's loop.
func (s *Server) SetAfterGive(f func(session uuid.UUID, leases, unused int, woke bool)) {
	s.afterGive.set(f)
}

// SetNoPolls keeps poll groups from polling (their fallback after a
// missed wake-up, which backs off from 2 ms however long PollInterval is):
// idle sessions then claim only when woken. Set it before the first
// Subscribe.
func (s *Server) SetNoPolls() { s.noPolls.Store(true) }

// SetPollBackoff sets the poll delay of every poll group to d and re-arms
// an armed poll for d from now, as if its polls had backed off to d.
func (s *Server) SetPollBackoff(d time.Duration) {
	s.groupsMu.Lock()
	defer s.groupsMu.Unlock()
	for _, g := range s.groups {
		g.mu.Lock()
		g.delay = d
		if g.armed {
			g.armed = false
			g.armLocked()
		}
		g.mu.Unlock()
	}
}

// KickOwnership makes the partition ownership loop take a turn now, as a
// session's arrival or departure does.
func (s *Server) KickOwnership() { s.kickOwnership() }

// SetOwnershipHooks makes every partition ownership turn call before (with
// whether the replica wants partitions) in place of its statement's error,
// and after once the turn is done.
func (s *Server) SetOwnershipHooks(before func(wants bool) error, after func()) {
	s.beforeOwnPartitions.set(before)
	s.afterOwnershipTurn.set(after)
}

// SetOwnershipTurnTimeout bounds the ownership turns' statements by d
// instead of releaseTimeout.
func (s *Server) SetOwnershipTurnTimeout(d time.Duration) { s.ownershipTurnTimeout.Store(int64(d)) }

// OwnedPartitions is what the replica believes it owns now.
func (s *Server) OwnedPartitions() []int32 { return s.partitions.owned(time.Now()) }

// OwnershipValidUntil is when the replica's belief in its partitions ends.
func (s *Server) OwnershipValidUntil() time.Time {
	s.partitions.mu.Lock()
	defer s.partitions.mu.Unlock()
	return s.partitions.validUntil
}

// Instance is the process identity the replica owns partitions under.
func (s *Server) Instance() uuid.UUID { return s.instance }

// AckShard is the committer an ack of token queues in (ackCommitter.shard).
func (s *Server) AckShard(token string) (int, error) {
	t, err := s.signer.Verify(token)
	if err != nil {
		return 0, err
	}
	return s.acks.shard(t), nil
}

// SetAsleepCheckInterval sets the pause between a sleeping discovery loop's
// checks (by default a second): a test that lengthens it sees events found
// only through the producers' notices.
func (s *Server) SetAsleepCheckInterval(d time.Duration) { s.asleepCheck.Store(int64(d)) }

// SetSleepHooks sets functions run before the discovery loop tries to sleep
// and after, with whether it sleeps.
func (s *Server) SetSleepHooks(before func(), after func(asleep bool)) {
	s.beforeSleep.set(before)
	s.afterSleep.set(after)
}

// DiscoveryAsleep says whether the discovery loop sleeps (waker.sleep):
// it then runs no round until a producer's notice wakes it, and checks
// only every asleep check interval or quiet interval, whichever is longer.
func (s *Server) DiscoveryAsleep() bool { return s.wake.isAsleep() }

// ListenerConnected says whether the replica's LISTEN connection is up
// (waker.listening): a try to sleep before it is fails.
func (s *Server) ListenerConnected() bool {
	s.wake.mu.Lock()
	defer s.wake.mu.Unlock()
	return s.wake.connected
}

// AckCommitterOf returns the index of the ack committer that an ack of the
// lease token goes to (Config.AckCommitters of them), or -1 for a token
// that does not verify.
func (s *Server) AckCommitterOf(token string) int {
	t, err := s.signer.Verify(token)
	if err != nil {
		return -1
	}
	return s.acks.shard(t)
}

// DiscoverWakePending is how many wake-ups of the discovery loop (a
// producer's notice while it sleeps, the end of its sleep) wait for the
// loop to take them: 0 or 1.
func (s *Server) DiscoverWakePending() int { return len(s.discoverWake) }
