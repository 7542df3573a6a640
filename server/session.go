package server

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/leasetoken"
	"github.com/outboxd/outboxd/internal/limits"
	"github.com/outboxd/outboxd/internal/store"
)

const (
	// minIdlePoll is the first re-poll delay of a poll group (the sessions
	// of one stream filter, see pollGroup) whose poll found work; it
	// doubles after each poll that found nothing, up to
	// Config.PollInterval. Discovery wakes idle sessions when events
	// commit, so polls only catch what no wake-up announces: backoffs and
	// leases that expire, and work an operator made claimable on another
	// replica.
	minIdlePoll = 2 * time.Millisecond
	// claimTimeout bounds one claim statement.
	claimTimeout = 10 * time.Second
	// windowClaimFactor bounds the events one claim leases with windows:
	// ClaimBatch aggregates and this many times as many events, so that a
	// statement never carries a whole MaxInFlight of payloads.
	windowClaimFactor = 4
)

// session is one Subscribe stream: its credit, its outstanding deliveries and
// the loop that claims and sends.
type session struct {
	srv     *Server
	id      uuid.UUID
	relayID string
	peer    string
	streams []string
	// excludeStreams are never claimed for this stream (SubscribeRequest.exclude_streams).
	excludeStreams []string
	maxInFlight    int
	// window is the most events of one aggregate one lease covers
	// (SubscribeRequest.max_in_flight_per_aggregate): 1 unless the relay
	// asked for more.
	window int
	// batches says the relay reads several deliveries in one message
	// (SubscribeRequest.accept_batches): see sendLeases.
	batches     bool
	ttl         time.Duration
	connectedAt time.Time
	// subscriber is who opened the stream, for the per-relay limit.
	subscriber string

	// inflight holds the events delivered on this stream whose lease still
	// exists as far as the session knows. Only the session loop touches it;
	// its size is published in inflightN for ListRelays.
	// Each maps to the epoch of the lease it was sent under.
	inflight  map[uuid.UUID]int64
	inflightN atomic.Int64
	acked     atomic.Uint64
	// parked holds the leases (aggregate and epoch) this session parked
	// for an event too large to send: no later event of such a lease may
	// follow on the stream (an ack may have slid its window forward before
	// the park), or the relay would publish past the parked one. Only the
	// session loop touches it.
	parked map[leaseRef]bool

	mu    sync.Mutex
	freed []freedLease
	// claimFreed says the credit freed since the loop last looked is to be
	// claimed with at once: a nack or a release freed some, or an ack batch
	// saw claimable work. Otherwise claimBy, when set, is the latest time
	// to claim (the first claimable time the ack batches saw): an ack batch
	// that saw nothing claimable spares the session a claim that would find
	// nothing (see outbox.ack's claimable_in).
	claimFreed bool
	claimBy    time.Time
	handed     []store.Lease // leases acks handed over, not yet sent
	sweep      bool          // release leases held but unknown (requestSweep)
	closed     bool          // the stream is over: no more hand-overs
	reconcile  bool
	// offered is the credit the loop lets discovery rounds take while it
	// waits (see offerCredit); lent is what a round took and has not given
	// back yet, as leases or unused. The loop never claims with either.
	offered, lent int
	waiting       bool // the loop is between offerCredit and withdrawCredit
	// turnedWhileLent says the loop withdrew its offer while a round held
	// some of its credit: it may wait without credit since (see give).
	turnedWhileLent bool
	kick            chan struct{} // capacity 1: "look at freed/reconcile"
	aborted         chan struct{}
	abortOnce       sync.Once

	// probe (capacity 1) is the session's poll group asking it to claim:
	// true for the group's poll, false for a wake-up (see pollGroup).
	probe chan bool
}

func newSession(srv *Server, relayID, peer string, streams []string, maxInFlight int, ttl time.Duration) *session {
	return &session{
		srv: srv, id: uuid.New(), relayID: relayID, peer: peer, streams: streams,
		maxInFlight: maxInFlight, window: 1, ttl: ttl, connectedAt: time.Now(),
		inflight: make(map[uuid.UUID]int64),
		kick:     make(chan struct{}, 1),
		probe:    make(chan bool, 1),
		aborted:  make(chan struct{}),
	}
}

// free records that the leases on events ids ended: acked (published), or
// nacked at epoch (a later lease of the same event, claimed before this
// reaches the loop, stays counted).
func (ss *session) free(published bool, epoch int64, ids ...uuid.UUID) {
	ss.mu.Lock()
	for _, id := range ids {
		ss.freed = append(ss.freed, freedLease{id, published, epoch})
	}
	ss.claimFreed = true
	ss.mu.Unlock()
	ss.poke()
}

// settle records, in one step, that the leases on events acked ended by an
// ack, that the same ack batch leased leases to this session (hand-over,
// or a window sliding forward), and that the batch's loan of lent units of
// credit is over: the loop sees it all at once, so its credit never counts
// the one without the other. What the leases did not use of the loan is
// offered again if the loop still waits. claimable is what the batch saw
// of claimable work: the credit the acks free is claimed with at once
// unless the batch saw nothing claimable. It returns false, taking
// nothing, once the stream is over: the caller then releases the leases.
func (ss *session) settle(acked []uuid.UUID, leases []store.Lease, lent int, claimable store.ClaimHint) bool {
	ss.mu.Lock()
	ss.lent -= lent
	if ss.closed {
		ss.mu.Unlock()
		return len(leases) == 0
	}
	for _, id := range acked {
		ss.freed = append(ss.freed, freedLease{id, true, 0})
	}
	if len(acked) > 0 {
		now, by := claimable.ClaimAt(time.Now())
		ss.claimFreed = ss.claimFreed || now
		ss.claimBy = earlierDeadline(ss.claimBy, by)
	}
	ss.handed = append(ss.handed, leases...)
	if ss.waiting {
		ss.offered += lent - min(max(len(leases)-len(acked), 0), lent)
	}
	ss.mu.Unlock()
	ss.poke()
	return true
}

// outstanding is how many of this session's deliveries are still out: the
// leases it holds, less those an ack or nack has ended, plus those handed
// over to it, before its loop has applied either.
func (ss *session) outstanding() int64 {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	return ss.outstandingLocked()
}

// outstandingLocked is outstanding with ss.mu held.
func (ss *session) outstandingLocked() int64 {
	return max(0, ss.inflightN.Load()+int64(len(ss.handed)-len(ss.freed)))
}

// handOverState says whether an ack may hand this session a lease (its
// stream is open; credit does not matter: a hand-over replaces the lease
// the ack ended), and whether it has credit to spare: free beyond its
// outstanding deliveries and what discovery rounds have borrowed, credit
// its claims can take older work with. One lock for both: the acker asks
// every session on each batch.
func (ss *session) handOverState() (takes, spare bool) {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	return !ss.closed, ss.outstandingLocked()+int64(ss.lent) < int64(ss.maxInFlight)
}

// close refuses hand-overs and dispatched leases from now on. The stream's
// release runs after it, so it covers every lease handed over before; one
// refused here is released by the acker or the discovery round.
func (ss *session) close() {
	ss.mu.Lock()
	ss.closed = true
	ss.offered = 0
	ss.mu.Unlock()
}

// offerCredit lets discovery rounds (and ack batches, for a session with a
// window) take, while the loop waits, the credit free leaves after what a
// round holds already and what leases wait to be counted (free is the
// loop's maxInFlight less its inflight), and returns it. An offer of any
// credit tells a discovery loop that waits for one (Server.creditOffered).
func (ss *session) offerCredit(free int) (offered int) {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	ss.waiting = true
	if !ss.closed {
		ss.offered = max(free-ss.lent-len(ss.handed), 0)
	}
	if ss.offered > 0 {
		select {
		case ss.srv.creditOffered <- struct{}{}:
		default:
		}
	}
	return ss.offered
}

// withdrawCredit takes the offer back before the loop claims, and returns the
// credit the loop must leave alone: what a discovery round holds, and leases
// handed over or dispatched that it has not counted yet.
func (ss *session) withdrawCredit() int {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	ss.waiting = false
	ss.offered = 0
	if ss.lent > 0 {
		ss.turnedWhileLent = true
	}
	return ss.lent + len(ss.handed)
}

// lendUpTo takes up to limit units of the credit the loop offers, and
// returns how many: for a discovery round (give ends the loan), or, all of
// it, for an ack batch, which may lease a windowed session more events than
// its acks free (a window growing; settle ends the loan).
func (ss *session) lendUpTo(limit int) int {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	n := min(ss.offered, limit)
	ss.offered -= n
	ss.lent += n
	return n
}

// give ends a discovery round's loan of n units of credit: leases (at most n)
// are the ones it dispatched to this session, and the rest of the loan is
// offered again if the loop is still waiting; either way the loop is told.
// It returns false, taking nothing, once the stream is over: the caller
// then releases the leases.
func (ss *session) give(leases []store.Lease, n int) bool {
	ss.mu.Lock()
	ss.lent -= n
	if ss.closed {
		ss.mu.Unlock()
		return false
	}
	ss.handed = append(ss.handed, leases...)
	unused := n - len(leases)
	if ss.waiting {
		ss.offered += unused
	}
	// Credit given back unused is credit freed: a loop that turned while
	// it was lent found none to claim with, and waits without credit, out
	// of its poll group's idle line, where neither wake-ups nor polls reach
	// it; a wake-up it took meanwhile would be lost with it. A loop that
	// did not turn still waits with its offer, which the credit rejoins:
	// not woken, since every round borrows the credit of every waiting
	// session.
	wake := len(leases) > 0 || (unused > 0 && ss.turnedWhileLent)
	if ss.lent == 0 {
		ss.turnedWhileLent = false
	}
	ss.mu.Unlock()
	if wake {
		ss.poke()
	}
	if h := ss.srv.afterGive.get(); h != nil {
		h(ss.id, len(leases), unused, wake)
	}
	return true
}

// filter is what the session takes, as the store names it.
func (ss *session) filter() store.StreamFilter {
	return store.StreamFilter{Streams: ss.streams, ExcludeStreams: ss.excludeStreams}
}

type freedLease struct {
	id        uuid.UUID
	published bool
	epoch     int64 // of the lease that ended; 0: whichever (a published event is never leased again)
}

// requestSweep asks the loop to release the leases this session holds but
// does not know of (see releaseUndelivered).
func (ss *session) requestSweep() {
	ss.mu.Lock()
	ss.sweep = true
	ss.mu.Unlock()
	ss.poke()
}

// requestReconcile asks the loop to recheck its leases against the database.
func (ss *session) requestReconcile() {
	ss.mu.Lock()
	ss.reconcile = true
	ss.mu.Unlock()
	ss.poke()
}

func (ss *session) poke() {
	select {
	case ss.kick <- struct{}{}:
	default:
	}
}

func (ss *session) abort() { ss.abortOnce.Do(func() { close(ss.aborted) }) }

// run claims and sends until ctx ends, the server stops, or sending fails.
// Each turn of the loop settles ended leases, sends what acks handed over,
// claims and sends up to the free credit, and, when that found less than it
// asked for, waits for work.
//
// A turn claims only when something may have made work claimable for it
// since its last claim came back short: credit freed by a nack, or by an
// ack without a hand-over whose batch saw claimable work, a lease found
// gone, new events discovered, the poll timer, a reconcile tick. A
// hand-over alone is no such reason (it replaced the lease the ack ended),
// so a hot aggregate's events cost one ack each and no empty claim; nor is
// credit an ack batch freed when it saw nothing claimable, which instead
// bounds the wait by the first time it saw anything become claimable.
func (ss *session) run(ctx context.Context, send func(*outboxv1.SubscribeResponse) error) error {
	w := newSessionWait(ss)
	defer w.stop()
	wantClaim := true
	for {
		handed, claim, claimBy, err := ss.applyFreed(ctx)
		if err != nil {
			return err
		}
		if claim {
			wantClaim = true
		} else {
			w.claimNoLaterThan(claimBy)
		}
		if err := ss.sendHanded(ctx, handed, send); err != nil {
			return err
		}
		stopping := isClosed(ss.srv.stopping)
		if stopping && len(ss.inflight) == 0 {
			return errShuttingDown
		}
		// A discovery round that ends while the claim runs (and may have
		// been missed by it) wakes the session's poll group: an idle member,
		// or, with none idle, the next member to wait with credit, this one
		// included (see pollGroup).
		credit := ss.maxInFlight - len(ss.inflight) - ss.withdrawCredit()
		if w.woken {
			w.woken = false
			if credit <= 0 || stopping {
				// The group asked this session to claim, as its longest
				// idle member, and it cannot: its credit went to a
				// discovery round's loan or to leases given to it while it
				// waited. Another member claims instead (or the next to
				// wait with credit), or the work announced would wait for
				// the group's poll.
				w.group.handOn(w.poll)
				w.poll = false
			}
		}
		if credit > 0 && !stopping && wantClaim {
			// A wake-up signalled before this claim starts is answered by it.
			poll := w.takeProbe()
			outcome, err := ss.claimAndSend(ctx, credit, send)
			if err != nil {
				return err
			}
			w.claimed()
			w.group.claimed(outcome, poll)
			switch outcome {
			case claimedAll:
				continue // there may be more
			case claimedSome, claimedNone:
				wantClaim = false
			case claimFailed:
				w.claimFailed()
			case claimStopped:
				continue // the next turn sees the server stopping
			}
		}
		if !stopping {
			offered := ss.offerCredit(ss.maxInFlight - len(ss.inflight))
			if h := ss.srv.afterOffer.get(); h != nil {
				h(ss.id, offered)
			}
		}
		kicked, err := w.wait(ctx, credit > 0 && !stopping)
		if err != nil {
			return err
		}
		if !kicked {
			wantClaim = true
		}
	}
}

// claimOutcome is what one claim-and-send step found.
type claimOutcome int

const (
	claimedAll   claimOutcome = iota // as many as asked: there may be more
	claimedSome                      // fewer: wait for work
	claimedNone                      // nothing claimable: wait for work
	claimFailed                      // the claim failed: wait, then try again
	claimStopped                     // not sent: the server began stopping
)

// claimAndSend claims up to ClaimBatch aggregates, and up to credit events
// (more than one per aggregate with a window, and at most windowClaimFactor
// times ClaimBatch in one statement), and sends their events. The error ends
// the session (the stream failed, or ctx ended).
func (ss *session) claimAndSend(ctx context.Context, credit int, send func(*outboxv1.SubscribeResponse) error) (claimOutcome, error) {
	n := min(credit, ss.srv.cfg.ClaimBatch)
	credit = min(credit, windowClaimFactor*ss.srv.cfg.ClaimBatch)
	// Waits while Stop closes stopping, and then claims nothing.
	leased, ok := ss.srv.leasing(true)
	if !ok {
		return claimStopped, nil
	}
	// Not cancelled with the stream: a claim interrupted by the relay
	// hanging up may still commit in the database after the stream's leases
	// were released, orphaning its leases until their TTL. Letting it finish
	// means the release covers them.
	claimCtx, cancelClaim := context.WithTimeout(context.WithoutCancel(ctx), claimTimeout)
	if h := ss.srv.beforeLease.get(); h != nil {
		h("claim")
	}
	leases, err := ss.srv.store.Claim(claimCtx, store.ClaimParams{
		Holder: ss.id, RelayID: ss.relayID, ReplicaID: ss.srv.cfg.ReplicaID,
		Streams: ss.streams, ExcludeStreams: ss.excludeStreams,
		Limit: n, Window: ss.window, Credit: credit,
		TTL: ss.ttl, MaxAttempts: ss.srv.cfg.MaxDeliveries, MaxDue: ss.srv.cfg.maxDue(),
	})
	leased()
	if h := ss.srv.afterClaim.get(); h != nil {
		leases, err = h(leases, err)
	}
	cancelClaim()
	if err != nil {
		if ctx.Err() != nil {
			return claimFailed, ctx.Err() // the stream's release covers the claim
		}
		ss.srv.log.Warn("claim failed; retrying", "session", ss.id, "relay", ss.relayID, "err", err)
		// The claim may have committed before failing (say, timed out
		// reading its rows): give back what it leased now, and once more
		// at the next tick in case its commit was late.
		ss.releaseUndelivered(ctx)
	}
	ss.srv.metrics.claimed.Add(float64(len(leases)))
	// Counted before sending: a send blocked by a relay that stopped
	// reading must not hide the claim's leases from ListRelays.
	for _, l := range leases {
		ss.inflight[l.Event.ID] = l.Epoch
	}
	ss.inflightN.Store(int64(len(ss.inflight)))
	if err := ss.sendLeases(ctx, leases, send); err != nil {
		return claimFailed, err
	}
	switch {
	case err != nil:
		return claimFailed, nil
	case len(leases) == credit || aggregates(leases) == n:
		return claimedAll, nil
	case len(leases) > 0:
		return claimedSome, nil
	default:
		return claimedNone, nil
	}
}

// leaseRef names one lease: an aggregate and the epoch it was leased at.
type leaseRef struct {
	stream, aggregateKey string
	epoch                int64
}

// maxBatchBytes bounds the encoded deliveries one batched message carries
// (see sendLeases): well under what a relay receives (MaxDeliveryBytes),
// and large enough that a batch of ordinary events is never cut short.
const maxBatchBytes = 1 << 20

// sendLeases sends leases (claimed, or handed over by acks or discovery)
// in their order, parking those no relay could receive. To a relay that
// accepts batches (SubscribeRequest.accept_batches) it sends them in as few
// messages as maxBatchBytes allows, each carrying its deliveries in order
// in SubscribeResponse.deliveries: one message, one write to the socket and
// one read for the relay, rather than one per delivery. A lone delivery
// (the only one ready, or too large to share a message) goes in the plain
// form, as to every other relay: at low load nothing changes on the wire.
func (ss *session) sendLeases(ctx context.Context, leases []store.Lease, send func(*outboxv1.SubscribeResponse) error) error {
	var batch []*outboxv1.SubscribeResponse
	batchSize := 0
	flush := func() error {
		var msg *outboxv1.SubscribeResponse
		switch len(batch) {
		case 0:
			return nil
		case 1:
			msg = batch[0]
		default:
			msg = &outboxv1.SubscribeResponse{Deliveries: batch}
		}
		batch, batchSize = nil, 0
		return send(msg)
	}
	for _, l := range leases {
		ref := leaseRef{l.Event.Stream, l.Event.AggregateKey, l.Epoch}
		if ss.parked[ref] {
			// The lease ended when an earlier event of it was parked.
			delete(ss.inflight, l.Event.ID)
			ss.inflightN.Store(int64(len(ss.inflight)))
			continue
		}
		ss.srv.metrics.deliveries.Inc()
		if l.Attempt > 1 {
			ss.srv.metrics.redeliveries.Inc()
		}
		d := ss.delivery(l)
		size := proto.Size(d)
		if size > limits.MaxDeliveryBytes {
			// Sending it would end the stream, and the next claim would
			// pick it again: park it with the reason instead. What is
			// batched before it is still sent: a window's events before
			// it go to the relay, whose acks still land.
			if ss.parkUndeliverable(ctx, l, size) {
				if ss.parked == nil {
					ss.parked = make(map[leaseRef]bool)
				}
				ss.parked[ref] = true
			}
			continue
		}
		if !ss.batches {
			if err := send(d); err != nil {
				return err
			}
			continue
		}
		// Its room in a batch: the field's tag and length, then itself.
		room := protowire.SizeTag(deliveriesField) + protowire.SizeBytes(size)
		if len(batch) > 0 && batchSize+room > maxBatchBytes {
			if err := flush(); err != nil {
				return err
			}
		}
		batch = append(batch, d)
		batchSize += room
	}
	return flush()
}

// deliveriesField is SubscribeResponse.deliveries' field number.
var deliveriesField = (&outboxv1.SubscribeResponse{}).ProtoReflect().Descriptor().Fields().ByName("deliveries").Number()

// sessionWait is how a session waits for work: its poll group (which polls
// and wakes for all the sessions of its stream filter), the reconcile
// ticker, the bound an ack batch set, and what a failed claim left to sweep.
type sessionWait struct {
	ss        *session
	group     *pollGroup
	reconcile *time.Ticker
	// reconcileC is reconcile's channel (or the ticks a test sends, see
	// Server.reconcileTick).
	reconcileC <-chan time.Time
	idle       *time.Timer
	// stopWake fires once when the server starts stopping, to wake the
	// loop; whether the server is stopping is always read from
	// srv.stopping itself, so no later turn can miss it.
	stopWake <-chan struct{}
	// sweepOrphans asks for one more releaseUndelivered after a failed
	// claim.
	sweepOrphans bool
	// poll says the group's poll woke the session: the next claim reports
	// to the group as a poll (an empty one lengthens the group's backoff).
	poll bool
	// woken says the group asked the session to claim (a wake-up or its
	// poll) since its loop last looked: a session that then finds no
	// credit to claim with hands the request on (see run).
	woken bool
	// claimDue, when set, is the latest time for the next claim: credit an
	// ack batch freed was left unclaimed because it saw nothing claimable
	// before then.
	claimDue time.Time
}

// claimed clears the ack batches' bound: a claim has run.
func (w *sessionWait) claimed() { w.claimDue = time.Time{} }

// claimNoLaterThan makes the session claim by t at the latest (zero: no
// bound).
func (w *sessionWait) claimNoLaterThan(t time.Time) { w.claimDue = earlierDeadline(w.claimDue, t) }

// earlierDeadline is the earlier of two deadlines, zero meaning none.
func earlierDeadline(a, b time.Time) time.Time {
	if a.IsZero() || (!b.IsZero() && b.Before(a)) {
		return b
	}
	return a
}

func newSessionWait(ss *session) *sessionWait {
	w := &sessionWait{
		ss: ss, group: ss.srv.joinPollGroup(ss),
		reconcile: time.NewTicker(ss.srv.cfg.ReconcileInterval),
		idle:      time.NewTimer(time.Hour),
		stopWake:  ss.srv.stopping,
	}
	w.reconcileC = w.reconcile.C
	if ss.srv.reconcileTick != nil {
		w.reconcileC = ss.srv.reconcileTick
	}
	return w
}

func (w *sessionWait) stop() {
	w.reconcile.Stop()
	w.idle.Stop()
	w.group.leave(w.ss)
}

// takeProbe takes the group's signal, if any, before a claim (which answers
// it) and says whether the claim is a poll.
func (w *sessionWait) takeProbe() (poll bool) {
	poll, w.poll = w.poll, false
	select {
	case p := <-w.ss.probe:
		poll = poll || p
	default:
	}
	return poll
}

// claimFailed schedules a sweep for late-committing claims (the group slows
// its polls).
func (w *sessionWait) claimFailed() { w.sweepOrphans = true }

// wait blocks until something may have changed: credit freed, the poll
// group asking for a claim (a wake-up, its poll), the ack batches' bound,
// a reconcile tick, or the server stopping. The error ends the session.
//
// polling says the session would claim if woken (it has credit free): only
// then is it idle in its poll group. A session that would not claim passes
// on a wake-up signalled to it. kicked reports that only the session's own
// kick woke it (leases ended, handed over, or a reconcile asked for):
// applyFreed says whether that freed credit.
func (w *sessionWait) wait(ctx context.Context, polling bool) (kicked bool, err error) {
	ss := w.ss
	var dueC <-chan time.Time
	if polling {
		if now, poll := w.group.enterIdle(ss); now {
			// A wake-up (or poll) found no member idle: claim now.
			w.poll = w.poll || poll
			w.woken = true
			return false, nil
		}
		defer w.group.leaveIdle(ss)
		if !w.claimDue.IsZero() {
			w.idle.Reset(time.Until(w.claimDue))
			dueC = w.idle.C
			defer func() {
				if !w.idle.Stop() {
					select {
					case <-w.idle.C:
					default:
					}
				}
			}()
		}
	} else {
		w.group.passOn(ss)
	}
	// The reconcile tick only matters with leases to check or orphans to
	// sweep: an idle session's goroutine is not woken for nothing.
	var reconcileC <-chan time.Time
	if len(ss.inflight) > 0 || w.sweepOrphans {
		reconcileC = w.reconcileC
	}
	select {
	case <-ctx.Done():
		return false, ctx.Err()
	case <-ss.aborted:
		return false, errShuttingDown
	case <-ss.kick:
		return true, nil
	case poll := <-ss.probe:
		// The group asks for a claim: new work announced (a discovery
		// round, a NOTIFY, an operator), a claim that found all it asked
		// for, or the group's poll.
		w.poll = w.poll || poll
		w.woken = true
	case <-dueC:
		w.claimDue = time.Time{}
	case <-reconcileC:
		// No claim of its own: a lease the reconcile finds gone makes
		// applyFreed claim, and the group's poll covers the rest.
		if len(ss.inflight) > 0 {
			ss.requestReconcile()
		}
		if w.sweepOrphans {
			w.sweepOrphans = false
			ss.releaseUndelivered(ctx)
		}
		return true, nil
	case <-w.stopWake:
		// Seen once; from now on run claims nothing and ends the session
		// when its last delivery is acked or nacked.
		w.stopWake = nil
	}
	return false, nil
}

// releaseUndelivered gives back the leases this session holds but never
// sent, so that a claim which committed although the session saw it fail
// does not hold its aggregates until their TTL.
//
// Leases acks handed over are kept too: those already queued for this
// session, and (by waiting for handOverMu) those of an ack batch still
// being distributed.
func (ss *session) releaseUndelivered(ctx context.Context) {
	if !ss.srv.handOverMu.TryLock() {
		// (Tried first only so that tests can tell this wait from a sweep
		// that went ahead.)
		if h := ss.srv.sweepWaits.get(); h != nil {
			h(ss.id)
		}
		ss.srv.handOverMu.Lock()
	}
	defer ss.srv.handOverMu.Unlock()
	keep := make([]uuid.UUID, 0, len(ss.inflight))
	for id := range ss.inflight {
		keep = append(keep, id)
	}
	ss.mu.Lock()
	for _, l := range ss.handed {
		keep = append(keep, l.Event.ID)
	}
	ss.mu.Unlock()
	relCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), releaseTimeout)
	defer cancel()
	n, err := ss.srv.store.ReleaseAllBut(relCtx, ss.id, keep)
	if h := ss.srv.afterSweep.get(); h != nil {
		h(ss.id, n)
	}
	switch {
	case err != nil:
		ss.srv.log.Warn("releasing leases of a failed claim failed; they expire by TTL", "session", ss.id, "err", err)
	case n > 0:
		ss.srv.log.Info("released leases of a failed claim", "session", ss.id, "released", n)
	}
}

// sendHanded sends the leases acks and discovery rounds handed over to
// this session, all at once; applyFreed has already counted them in
// inflight.
func (ss *session) sendHanded(ctx context.Context, handed []store.Lease, send func(*outboxv1.SubscribeResponse) error) error {
	return ss.sendLeases(ctx, handed, send)
}

// unlockApplied lets the session's lock go once applyFreed has applied
// its freed list (applied leases), and then, as the first thing after,
// runs the freedApplied test hook: what outstanding says to a reader that
// was waiting for the lock.
func (ss *session) unlockApplied(applied int) {
	ss.mu.Unlock()
	if h := ss.srv.freedApplied.get(); h != nil {
		h(applied, ss.outstanding())
	}
}

// applyFreed drops ended leases from inflight, adds the leases acks handed
// over (returned, to be sent), and reconciles with the database when asked
// to. claim says that credit was freed and should be claimed with at once;
// when credit was freed by acks that saw nothing claimable, claimBy is the
// latest time to claim with it (zero: none).
func (ss *session) applyFreed(ctx context.Context) (handed []store.Lease, claim bool, claimBy time.Time, err error) {
	ss.mu.Lock()
	ended, handed, reconcile, sweep := ss.freed, ss.handed, ss.reconcile, ss.sweep
	ss.freed, ss.handed, ss.reconcile, ss.sweep = nil, nil, false, false
	claimFreed, freedBy := ss.claimFreed, ss.claimBy
	ss.claimFreed, ss.claimBy = false, time.Time{}
	before := len(ss.inflight)
	var nacked map[uuid.UUID]bool
	for _, f := range ended {
		if !f.published {
			if nacked == nil {
				nacked = make(map[uuid.UUID]bool)
			}
			nacked[f.id] = true
		}
		if epoch, ok := ss.inflight[f.id]; ok && (f.epoch == 0 || f.epoch == epoch) {
			delete(ss.inflight, f.id)
			if f.published {
				ss.acked.Add(1)
			}
		}
	}
	if nacked != nil {
		// A nack ends its whole lease, window and all: a window's event
		// an ack handed over before the nack is not sent at all.
		handed = slices.DeleteFunc(handed, func(l store.Lease) bool { return nacked[l.Event.ID] })
	}
	for _, l := range handed {
		ss.inflight[l.Event.ID] = l.Epoch
	}
	// Counted before the lock is let go: outstanding, which reads the
	// count with the freed and handed leases not yet applied, never sees
	// these both applied and still pending.
	ss.inflightN.Store(int64(len(ss.inflight)))
	ss.unlockApplied(len(ended) + len(handed))
	if sweep {
		ss.releaseUndelivered(ctx)
	}
	settled := len(ss.inflight)
	defer func() {
		if len(ss.inflight) >= before {
			return
		}
		// A lease found gone by the reconcile is no ack's doing: claim.
		claim = claimFreed || len(ss.inflight) < settled
		if !claim {
			claimBy = freedBy
		}
		if h := ss.srv.afterFreed.get(); h != nil {
			h(ss.id, claim, claimBy)
		}
	}()
	if reconcile && len(ss.inflight) > 0 {
		held, err := ss.srv.store.HeldEvents(ctx, ss.id)
		if err != nil {
			if ctx.Err() != nil {
				return nil, false, time.Time{}, ctx.Err()
			}
			ss.srv.log.Warn("reconcile failed", "session", ss.id, "err", err)
		} else {
			var gone []uuid.UUID
			for id := range ss.inflight {
				if !held[id] {
					delete(ss.inflight, id)
					gone = append(gone, id)
				}
			}
			ss.countGone(ctx, gone)
		}
	}
	ss.inflightN.Store(int64(len(ss.inflight)))
	return handed, false, time.Time{}, nil
}

// countGone sorts leases that ended without this replica seeing an ack or
// nack: acked through another replica, or lost (expired and leased again, or
// ended by an operator's skip).
func (ss *session) countGone(ctx context.Context, gone []uuid.UUID) {
	if len(gone) == 0 {
		return
	}
	published, err := ss.srv.store.PublishedAmong(ctx, gone)
	if err != nil {
		return // only figures are at stake
	}
	ss.acked.Add(uint64(len(published)))
	ss.srv.metrics.leasesExpired.Add(float64(len(gone) - len(published)))
}

// parkUndeliverable parks the aggregate of a lease whose delivery would be
// size bytes, over the limit every relay receives, and reports whether it
// did. With a window the event need not be the lease's head: the events
// before it are with the relay already, and their acks still land.
func (ss *session) parkUndeliverable(ctx context.Context, l store.Lease, size int) bool {
	reason := fmt.Sprintf("undeliverable: the delivery is %d bytes, over the %d-byte limit of one message", size, limits.MaxDeliveryBytes)
	ss.srv.log.Error("event parked: too large to deliver", "event_id", l.Event.ID, "stream", l.Event.Stream, "bytes", size)
	dbCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), claimTimeout)
	defer cancel()
	ended, err := ss.srv.store.Park(dbCtx, l.Event.ID, l.Epoch, reason)
	if err != nil {
		// The lease stays with this session until the stream ends or its
		// TTL passes; then the next claim tries again.
		ss.srv.log.Warn("parking an undeliverable event failed", "event_id", l.Event.ID, "err", err)
		return false
	}
	// The whole lease ended; the rest of its window, if any, is not sent
	// (sendLeases drops the parked lease's later events).
	for _, id := range append(ended, l.Event.ID) {
		delete(ss.inflight, id)
	}
	ss.inflightN.Store(int64(len(ss.inflight)))
	return true
}

// aggregates counts the distinct aggregates among leases.
func aggregates(leases []store.Lease) int {
	type key struct{ stream, aggregate string }
	seen := make(map[key]bool, len(leases))
	for _, l := range leases {
		seen[key{l.Event.Stream, l.Event.AggregateKey}] = true
	}
	return len(seen)
}

func (ss *session) delivery(l store.Lease) *outboxv1.SubscribeResponse {
	e := l.Event
	return &outboxv1.SubscribeResponse{
		Event: eventProto(e),
		LeaseToken: ss.srv.signer.Sign(leasetoken.Token{
			EventID: e.ID, Epoch: l.Epoch, Aggregate: leasetoken.AggregateHash(e.Stream, e.AggregateKey)}),
		LeaseExpiresAt: timestamppb.New(l.ExpiresAt),
		Attempt:        uint32(l.Attempt),
		// The claim has just set the lease to the database's now + ttl; the
		// relay counts this from receipt on its own clock.
		LeaseTtlRemaining: durationpb.New(ss.ttl),
		LeaseEpoch:        l.Epoch,
		RepublishActionId: l.RepublishAction,
	}
}

// eventProto is an event as the protocol carries it.
func eventProto(e store.Event) *outboxv1.Event {
	return &outboxv1.Event{
		EventId:      e.ID.String(),
		Stream:       e.Stream,
		AggregateKey: e.AggregateKey,
		Revision:     e.Revision,
		EventType:    e.Type,
		Payload:      e.Payload,
		Headers:      e.Headers,
		CreatedAt:    timestamppb.New(e.CreatedAt),
	}
}

func isClosed(c <-chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}
