package server

import (
	"context"
	"time"

	"github.com/google/uuid"

	"github.com/outboxd/outboxd/internal/store"
)

// ackCommitter applies acks in group commits: while one batch is in the
// database, requests from every Ack RPC queue up, and the next statement takes
// them all. Each row is still checked on its own inside outbox.ack. The
// batch passes the replica's sessions that take more work, so an ack that
// ends one's lease can hand it the aggregate's next event in the same commit
// (see Server.handOver).
type ackCommitter struct {
	s    *Server
	reqs chan *ackRequest
}

type ackRequest struct {
	ids  []uuid.UUID
	done chan ackOutcome
}

type ackOutcome struct {
	results map[uuid.UUID]store.AckResult
	err     error
}

func newAckCommitter(s *Server) *ackCommitter {
	return &ackCommitter{s: s, reqs: make(chan *ackRequest, 1024)}
}

// submit queues ids and waits for the batch that carries them to commit.
func (a *ackCommitter) submit(ctx context.Context, ids []uuid.UUID) (map[uuid.UUID]store.AckResult, error) {
	req := &ackRequest{ids: ids, done: make(chan ackOutcome, 1)}
	select {
	case a.reqs <- req:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	// Once queued, wait for the outcome even if the caller gives up: the
	// batch commits regardless, and the result must not be lost to a
	// half-read channel.
	select {
	case out := <-req.done:
		return out.results, out.err
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

func (a *ackCommitter) run(ctx context.Context) {
	for {
		var first *ackRequest
		select {
		case first = <-a.reqs:
		case <-ctx.Done():
			a.failQueued(ctx.Err())
			return
		}
		batch := []*ackRequest{first}
		n := len(first.ids)
	drain:
		for n < a.s.cfg.AckBatch {
			select {
			case r := <-a.reqs:
				batch = append(batch, r)
				n += len(r.ids)
			default:
				break drain
			}
		}
		a.commit(ctx, batch, n)
	}
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
	// Acks already taken must land even while the server shuts down.
	dbCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	a.s.handOverMu.RLock()
	defer a.s.handOverMu.RUnlock()
	holders, loans := a.s.handOverTargets()
	res, err := a.s.store.Ack(dbCtx, store.AckParams{IDs: ids, ReplicaID: a.s.cfg.ReplicaID, HandOver: holders})
	cancel()
	if h := a.s.afterAck; h != nil {
		res, err = h(res, err)
	}
	if err != nil && len(holders) > 0 {
		// The statement may have committed (its answer lost) or a part of
		// a split batch may have: leases it handed over would then be held
		// by sessions that never hear of them. Each session that could
		// have received one sweeps its orphans once this batch is done.
		a.s.sweepSessions(holders)
	}
	if h := a.s.beforeHandOver; h != nil && err == nil {
		h(res)
	}
	byID := make(map[uuid.UUID]store.AckResult, len(res))
	type settlement struct {
		acked  []uuid.UUID
		leases []store.Lease
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
					st = &settlement{}
					settle[r.Holder] = st
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
		a.s.settleAcks(ctx, holder, st.acked, st.leases, lent)
	}
	for holder, lent := range loans {
		a.s.settleAcks(ctx, holder, nil, nil, lent)
	}
	if err != nil {
		a.s.log.Warn("ack batch failed", "acks", len(ids), "err", err)
	}
	for _, r := range batch {
		r.done <- ackOutcome{results: byID, err: err}
	}
}

func (a *ackCommitter) failQueued(err error) {
	for {
		select {
		case r := <-a.reqs:
			r.done <- ackOutcome{err: err}
		default:
			return
		}
	}
}
