package server

import (
	"context"
	"sync"
	"time"

	"github.com/google/uuid"
	"google.golang.org/grpc/peer"

	"github.com/outboxd/outboxd/internal/leasetoken"
	"github.com/outboxd/outboxd/internal/store"
)

// ackCommitter applies acks in group commits: while one batch is in the
// database, requests from every Ack RPC queue up, and the next statement takes
// them all. Each row is still checked on its own inside outbox.ack. The
// batch passes the replica's sessions that take more work, so an ack that
// ends one's lease can hand it the aggregate's next event in the same commit
// (see Server.handOver).
//
// Config.AckCommitters batches run at once, each on its own connection, so
// that the database applies acks on as many cores while one batch commits.
// An ack goes to the committer its lease picks: the lease's epoch and its
// aggregate's hash, both in the token. Every event of one lease (a window)
// has the same pair, so its acks queue in one committer in the order they
// arrived and are applied in that order: spreading them over committers
// could apply a later revision's ack first, which outbox.ack refuses as out
// of order (a redelivery, never a loss). The leases one statement makes
// share an epoch but not an aggregate, so their acks spread. A lease of
// another epoch of the same aggregate starts only once the earlier one
// ended (its acks applied, or it expired or was nacked); an ack of the
// earlier lease still queued in another committer is then applied if its
// event is still the next revision, or refused, as an ack on another
// replica would be.
type ackCommitter struct {
	s      *Server
	shards []chan *ackRequest
}

type ackRequest struct {
	ids []uuid.UUID
	// from names the connection of the Ack call (its peer's address), and
	// at is when the call queued this request: whether acks of several
	// callers interleave says whether a batch may wait for company.
	from string
	at   time.Time
	done chan ackOutcome
}

type ackOutcome struct {
	results map[uuid.UUID]store.AckResult
	err     error
}

func newAckCommitter(s *Server) *ackCommitter {
	a := &ackCommitter{s: s, shards: make([]chan *ackRequest, s.cfg.AckCommitters)}
	for i := range a.shards {
		a.shards[i] = make(chan *ackRequest, 1024)
	}
	return a
}

// shard picks the committer of a lease's acks from its epoch and aggregate,
// mixed so that neighbouring values spread.
func (a *ackCommitter) shard(t leasetoken.Token) int {
	x := (uint64(t.Epoch) ^ uint64(t.Aggregate)<<32 ^ uint64(t.Aggregate)) * 0x9E3779B97F4A7C15
	return int((x >> 32) % uint64(len(a.shards)))
}

// submit queues the acks of tokens and waits for the batches that carry
// them to commit.
func (a *ackCommitter) submit(ctx context.Context, tokens []leasetoken.Token) (map[uuid.UUID]store.AckResult, error) {
	// Indexed by committer, so that parts are queued, and waited for, in
	// committer order.
	parts := make([][]uuid.UUID, len(a.shards))
	for _, t := range tokens {
		i := a.shard(t)
		parts[i] = append(parts[i], t.EventID)
	}
	// Who acks and when matter only to a linger (see linger).
	var from string
	var now time.Time
	if a.s.cfg.AckLinger > 0 {
		if p, ok := peer.FromContext(ctx); ok && p.Addr != nil {
			from = p.Addr.String()
		}
		now = time.Now()
	}
	reqs := make([]*ackRequest, 0, len(parts))
	for i, ids := range parts {
		if len(ids) == 0 {
			continue
		}
		req := &ackRequest{ids: ids, from: from, at: now, done: make(chan ackOutcome, 1)}
		select {
		case a.shards[i] <- req:
			if h := a.s.afterAckQueued.get(); h != nil {
				h()
			}
		case <-ctx.Done():
			// Parts already queued commit regardless; their outcome is
			// buffered and dropped.
			return nil, ctx.Err()
		}
		reqs = append(reqs, req)
	}
	// Every part is waited for, even after one failed: the answer to an Ack
	// call means each of its acks was applied if it could be (a relay
	// counts on it before nacking a later revision). Only the caller giving
	// up ends the wait; the batches commit regardless, and their outcome
	// channels are buffered.
	outs := make([]map[uuid.UUID]store.AckResult, 0, len(reqs))
	var failed error
	for _, req := range reqs {
		select {
		case out := <-req.done:
			if out.err != nil {
				failed = out.err
				continue
			}
			outs = append(outs, out.results)
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	if failed != nil {
		return nil, failed
	}
	if len(outs) == 1 {
		return outs[0], nil
	}
	// Each batch's results are shared by every request it carried: read
	// them, never write them. An event acked under two leases in one call
	// (an expired lease's token and its redelivery's) has a result in each
	// part: the one that published it wins.
	results := make(map[uuid.UUID]store.AckResult, len(tokens))
	for _, out := range outs {
		for _, t := range tokens {
			r, ok := out[t.EventID]
			if !ok {
				continue
			}
			if prev, seen := results[t.EventID]; seen && prev.Status == store.AckPublished {
				continue
			}
			results[t.EventID] = r
		}
	}
	return results, nil
}

// run runs every committer until ctx ends.
func (a *ackCommitter) run(ctx context.Context) {
	var wg sync.WaitGroup
	for _, reqs := range a.shards {
		wg.Add(1)
		go func() {
			defer wg.Done()
			a.runShard(ctx, reqs)
		}()
	}
	wg.Wait()
}

func (a *ackCommitter) runShard(ctx context.Context, reqs chan *ackRequest) {
	// last is the request the last batch took last.
	var last *ackRequest
	for {
		var first *ackRequest
		select {
		case first = <-reqs:
		case <-ctx.Done():
			failQueued(reqs, ctx.Err())
			return
		}
		batch := []*ackRequest{first}
		n := len(first.ids)
	drain:
		for n < a.s.cfg.AckBatch {
			select {
			case r := <-reqs:
				batch = append(batch, r)
				n += len(r.ids)
			default:
				break drain
			}
		}
		batch, n = a.linger(ctx, reqs, batch, n, last)
		last = batch[len(batch)-1]
		a.commit(ctx, batch, n)
	}
}

// linger lets a batch of n acks wait up to Config.AckLinger for more, when
// the replica is under load: acks of several callers interleave (another
// connection's came in the batch, or was the one before it, at most four
// lingers earlier), and deliveries besides these n are outstanding on this
// replica's sessions. Acks that come from one caller at a time (one relay
// process, whose next call waits for this answer; a hot aggregate's
// revisions handed over one ack at a time; a trickle) commit at once, as do
// those of a replica whose other deliveries sit with a stalled relay. The
// wait ends when the acks of every delivery outstanding as it began are in
// the batch, when the batch is full, or when the server stops (the acks
// taken are committed then, as any batch is).
func (a *ackCommitter) linger(ctx context.Context, reqs chan *ackRequest, batch []*ackRequest, n int, prev *ackRequest) ([]*ackRequest, int) {
	d := a.s.cfg.AckLinger
	if d <= 0 || n >= a.s.cfg.AckBatch || !interleaved(prev, batch, 4*d) {
		return batch, n
	}
	outstanding := a.s.outstandingDeliveries()
	if outstanding <= int64(n) {
		return batch, n
	}
	if h := a.s.ackLingering.get(); h != nil {
		h(n)
	}
	t := time.NewTimer(d)
	defer t.Stop()
	for n < a.s.cfg.AckBatch && int64(n) < outstanding {
		select {
		case r := <-reqs:
			batch = append(batch, r)
			n += len(r.ids)
		case <-t.C:
			return batch, n
		case <-ctx.Done():
			return batch, n
		}
	}
	return batch, n
}

func (a *ackCommitter) commit(ctx context.Context, batch []*ackRequest, n int) {
	ids := make([]uuid.UUID, 0, n)
	seen := make(map[uuid.UUID]bool, n)
	for _, r := range batch {
		for _, id := range r.ids {
			if !seen[id] {
				seen[id] = true
				ids = append(ids, id)
			}
		}
	}
	if h := a.s.beforeAckBatch.get(); h != nil {
		h()
	}
	// Acks already taken must land even while the server shuts down.
	dbCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	// Hands over only while the server is not stopping, holding leaseGate
	// until the leases handed over are with their sessions (see
	// discoverRound); leaseGate before handOverMu, the order every holder
	// of both takes them in.
	leased, handsOver := a.s.leasing(false)
	if handsOver {
		defer leased()
	}
	a.s.handOverMu.RLock()
	defer a.s.handOverMu.RUnlock()
	var holders map[uuid.UUID]store.HandOverTarget
	var loans map[uuid.UUID]int
	if handsOver {
		holders, loans = a.s.handOverTargets()
		if h := a.s.beforeLease.get(); h != nil {
			h("hand-over")
		}
	}
	res, err := a.s.store.Ack(dbCtx, store.AckParams{IDs: ids, ReplicaID: a.s.cfg.ReplicaID, HandOver: holders,
		Filters: a.s.streamFilters(), MaxDue: a.s.cfg.maxDue()})
	cancel()
	if h := a.s.afterAck.get(); h != nil {
		res, err = h(res, err)
	}
	if err != nil && len(holders) > 0 {
		// The statement may have committed (its answer lost) or a part of
		// a split batch may have: leases it handed over would then be held
		// by sessions that never hear of them. Each session that could
		// have received one sweeps its orphans once this batch is done.
		a.s.sweepSessions(holders)
	}
	if h := a.s.beforeHandOver.get(); h != nil && err == nil {
		h(res)
	}
	byID := make(map[uuid.UUID]store.AckResult, len(res))
	type settlement struct {
		acked  []uuid.UUID
		leases []store.Lease
		// claimable is the earliest of its acks' hints (the halves of a
		// split batch may differ).
		claimable store.ClaimHint
	}
	var settle map[uuid.UUID]*settlement
	for _, r := range res {
		if r.Status == store.AckPublished {
			a.s.metrics.publishLag.Observe(r.PublishLag.Seconds())
			if r.Holder != uuid.Nil {
				if settle == nil {
					settle = make(map[uuid.UUID]*settlement)
				}
				st := settle[r.Holder]
				if st == nil {
					st = &settlement{claimable: r.Claimable}
					settle[r.Holder] = st
				} else {
					st.claimable = st.claimable.Earliest(r.Claimable)
				}
				st.acked = append(st.acked, r.EventID)
				st.leases = append(st.leases, r.HandOver...)
			}
		}
		// Hand-over is not in the answer to the relay: its ack was applied
		// like any other.
		r.HandOver = nil
		byID[r.EventID] = r
	}
	// Each holder learns in one step which of its leases these acks ended,
	// which leases they handed it, and that its loan is over: for a session
	// with a window of 1 and no loan, credit-neutral when every ack hands
	// over.
	for holder, st := range settle {
		lent := loans[holder]
		delete(loans, holder)
		a.s.settleAcks(ctx, holder, st.acked, st.leases, lent, st.claimable)
	}
	for holder, lent := range loans {
		a.s.settleAcks(ctx, holder, nil, nil, lent, store.ClaimHint{})
	}
	if err != nil {
		a.s.log.Warn("ack batch failed", "acks", len(ids), "err", err)
	}
	for _, r := range batch {
		r.done <- ackOutcome{results: byID, err: err}
	}
}

// interleaved reports whether the batch holds acks of more than one caller,
// or its first came within window of an ack of another caller (prev, the
// last one taken before it).
func interleaved(prev *ackRequest, batch []*ackRequest, window time.Duration) bool {
	first := batch[0]
	for _, r := range batch[1:] {
		if r.from != first.from {
			return true
		}
	}
	return prev != nil && prev.from != first.from && first.at.Sub(prev.at) < window
}

func failQueued(reqs chan *ackRequest, err error) {
	for {
		select {
		case r := <-reqs:
			r.done <- ackOutcome{err: err}
		default:
			return
		}
	}
}
