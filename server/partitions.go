package server

import (
	"context"
	"slices"
	"sync"
	"time"

	"github.com/outboxd/outboxd/internal/store"
)

// ownershipLoop is the partition ownership loop's place on the loop grid
// (loopPause): three quarters of a quiet interval off the quiet checks,
// after the session refresh (one) and readiness (two).
var ownershipLoop = periodicLoop{"ownership", 3}

// ownedPartitions is what this replica believes it owns of the aggregates'
// partitions (outbox.partition): the last ownership a turn heard of,
// believed until validUntil, the moment that turn's statement was sent plus
// the ownership TTL by this process's clock. The database's lease started
// after that moment, so the belief ends before the database lets another
// replica take a partition over. It errs toward owning less: a release
// whose answer is lost counts as done.
type ownedPartitions struct {
	mu         sync.Mutex
	ownership  store.Ownership
	validUntil time.Time
	// uncertain: a statement that may have taken partitions failed, so
	// the database may record more than ownership says.
	uncertain bool
	// joined: a turn's statement went out since the last leave, so the
	// replica's membership (outbox.partition_member) may be recorded.
	// Every such statement starts or renews it, even one that gives back
	// everything (the last session ended) and even one that failed, so it
	// outlives the partitions.
	joined bool
}

// set replaces the belief with o, valid until validUntil.
func (p *ownedPartitions) set(o store.Ownership, validUntil time.Time) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.ownership, p.validUntil, p.uncertain = o, validUntil, false
}

// setJoined records whether the replica's membership may be recorded.
func (p *ownedPartitions) setJoined(joined bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.joined = joined
}

// member reports whether the replica's membership may be recorded: some
// turn's statement went out since the last leave. Whatever it owns, or
// may own, came with such a statement, so this covers any() too.
func (p *ownedPartitions) member() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.joined
}

// markUncertain records that a statement that may have taken partitions
// failed: the replica then releases at shutdown even if it believes it owns
// none.
func (p *ownedPartitions) markUncertain() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.uncertain = true
}

// owned returns the partitions owned at now, ascending.
func (p *ownedPartitions) owned(now time.Time) []int32 {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !now.Before(p.validUntil) {
		return nil
	}
	return slices.Clone(p.ownership.Partitions)
}

// any reports whether the replica may still hold some partition in the
// database: it renewed or took some and has not released them, or a
// statement that may have taken some failed. Unlike owned it ignores
// validUntil: an ownership the replica stopped believing in may still be
// recorded, and its next turn gives it back all the same.
func (p *ownedPartitions) any() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.ownership.Partitions) > 0 || p.uncertain
}

// kickOwnership makes the ownership loop take its turn now, as when the
// replica's first relay session arrives or its last one leaves.
func (s *Server) kickOwnership() {
	select {
	case s.ownershipKick <- struct{}{}:
	default:
	}
}

// ownPartitions keeps this replica's share of the partitions, until ctx is
// done: every third of Config.PartitionTTL, and at once when the replica's
// sessions come or go. On its way out it gives back what it owns, so that
// another replica takes it over at once instead of after the TTL.
func (s *Server) ownPartitions(ctx context.Context) {
	interval := s.cfg.PartitionTTL / 3
	t := time.NewTimer(s.loopPause(time.Now(), interval, ownershipLoop))
	defer t.Stop()
	defer s.releasePartitions()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			s.rearmLoop(t, interval, ownershipLoop)
		case <-s.ownershipKick:
		}
		s.ownershipTurn(ctx)
	}
}

// ownershipTurn renews the replica's partitions and takes its share: a
// share of none once it has no relay session or is stopping. What it owns
// beyond its share (another replica's sessions arrived) it gives back at
// once: nothing is leased by partition yet, so there is nothing to drain.
// A replica without sessions that owns nothing sends no statement, so an
// idle source costs nothing here.
func (s *Server) ownershipTurn(ctx context.Context) {
	wants := s.sessionCount() > 0 && !isClosed(s.stopping)
	if !wants && !s.partitions.any() {
		return
	}
	// Not cancelled with ctx: a statement cancelled on its way can still
	// run and commit after the loop has given up on it, and so after the
	// release at shutdown, leaving this replica's name on partitions until
	// they expire. Run to its end, what it took is released with the rest.
	timeout := releaseTimeout
	if d := time.Duration(s.ownershipTurnTimeout.Load()); d > 0 {
		timeout = d
	}
	wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), timeout)
	defer cancel()
	if h := s.afterOwnershipTurn.get(); h != nil {
		defer h()
	}
	sent := time.Now()
	var o store.Ownership
	var err error
	if h := s.beforeOwnPartitions.get(); h != nil {
		err = h(wants)
	}
	if err == nil {
		o, err = s.store.OwnPartitions(wctx, s.cfg.ReplicaID, s.instance, wants, s.cfg.PartitionTTL)
	}
	s.partitions.setJoined(true)
	if err != nil {
		if ctx.Err() == nil {
			s.log.Warn("renewing partition ownership failed; retrying at the next turn", "err", err)
		}
		s.partitions.markUncertain()
		s.metrics.partitionsOwned.Set(float64(len(s.partitions.owned(time.Now()))))
		return
	}
	if excess := len(o.Partitions) - o.Share; excess > 0 {
		keep := len(o.Partitions) - excess
		if _, err := s.store.ReleasePartitions(wctx, s.instance, o.Partitions[keep:]); err != nil {
			s.log.Warn("giving back partitions beyond this replica's share failed; they return when their ownership expires",
				"err", err)
		}
		o.Partitions, o.Epochs = o.Partitions[:keep], o.Epochs[:keep]
	}
	s.partitions.set(o, sent.Add(s.cfg.PartitionTTL))
	s.metrics.partitionsOwned.Set(float64(len(o.Partitions)))
}

// releasePartitions gives back every partition the database records as
// this replica's and ends its membership, with a deadline of its own (the
// loop's context is done by then).
func (s *Server) releasePartitions() {
	// Also when it owns nothing: a membership left behind would refuse the
	// next process under this replica id (a restarted pod) until it
	// expired. (One that expired already is gone, and leaving deletes
	// nothing then.)
	if !s.partitions.member() {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), releaseTimeout)
	defer cancel()
	if _, err := s.store.LeavePartitions(ctx, s.instance); err != nil {
		s.log.Warn("giving back partitions at shutdown failed; other replicas take them when this replica's membership expires",
			"err", err)
	}
	s.partitions.set(store.Ownership{}, time.Time{})
	s.partitions.setJoined(false)
	s.metrics.partitionsOwned.Set(0)
}

// sessionCount is how many relay sessions the replica holds.
func (s *Server) sessionCount() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.sessions)
}
