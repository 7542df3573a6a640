package server

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/leasetoken"
	"github.com/outboxd/outboxd/internal/store"
)

const (
	// minIdlePoll is the first re-poll delay of a session that found no work;
	// it doubles up to Config.PollInterval.
	minIdlePoll = 2 * time.Millisecond
	// armAfter is the idle poll delay from which a session relies on
	// producers' notifications. Since a registration is consumed by one
	// NOTIFY (see outbox.wake_listeners), notifications are cheap for
	// producers, and one short poll before registering is enough: every
	// empty poll is a claim statement's worth of database CPU.
	armAfter = 4 * time.Millisecond
	// claimTimeout bounds one claim statement.
	claimTimeout = 10 * time.Second
)

// session is one Subscribe stream: its credit, its outstanding deliveries and
// the loop that claims and sends.
type session struct {
	srv         *Server
	id          uuid.UUID
	relayID     string
	peer        string
	streams     []string
	maxInFlight int
	ttl         time.Duration
	connectedAt time.Time
	// subscriber is who opened the stream, for the per-relay limit.
	subscriber string

	// inflight holds the events delivered on this stream whose lease still
	// exists as far as the session knows. Only the session loop touches it;
	// its size is published in inflightN for ListRelays.
	inflight  map[uuid.UUID]struct{}
	inflightN atomic.Int64
	acked     atomic.Uint64

	mu        sync.Mutex
	freed     []freedLease
	reconcile bool
	kick      chan struct{} // capacity 1: "look at freed/reconcile"
	aborted   chan struct{}
	abortOnce sync.Once
}

func newSession(srv *Server, relayID, peer string, streams []string, maxInFlight int, ttl time.Duration) *session {
	return &session{
		srv: srv, id: uuid.New(), relayID: relayID, peer: peer, streams: streams,
		maxInFlight: maxInFlight, ttl: ttl, connectedAt: time.Now(),
		inflight: make(map[uuid.UUID]struct{}),
		kick:     make(chan struct{}, 1),
		aborted:  make(chan struct{}),
	}
}

// free records that the lease on event id ended: acked (published) or
// nacked.
func (ss *session) free(id uuid.UUID, published bool) {
	ss.mu.Lock()
	ss.freed = append(ss.freed, freedLease{id, published})
	ss.mu.Unlock()
	ss.poke()
}

type freedLease struct {
	id        uuid.UUID
	published bool
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
func (ss *session) run(ctx context.Context, send func(*outboxv1.SubscribeResponse) error) error {
	log := ss.srv.log.With("session", ss.id, "relay", ss.relayID)
	pollDelay := minIdlePoll
	reconcileTicker := time.NewTicker(ss.srv.cfg.ReconcileInterval)
	defer reconcileTicker.Stop()
	idleTimer := time.NewTimer(time.Hour)
	defer idleTimer.Stop()
	stopping := ss.srv.stopping

	for {
		if err := ss.applyFreed(ctx); err != nil {
			return err
		}
		select {
		case <-stopping:
			if len(ss.inflight) == 0 {
				return status.Error(codes.Unavailable, "server is shutting down; reconnect to another replica")
			}
		default:
		}

		idle := false
		credit := ss.maxInFlight - len(ss.inflight)
		if credit > 0 && !isClosed(stopping) {
			n := min(credit, ss.srv.cfg.ClaimBatch)
			// Not cancelled with the stream: a claim interrupted by the
			// relay hanging up may still commit in the database after the
			// stream's leases were released, orphaning its leases until
			// their TTL. Letting it finish means the release covers them.
			claimCtx, cancelClaim := context.WithTimeout(context.WithoutCancel(ctx), claimTimeout)
			leases, err := ss.srv.store.Claim(claimCtx, store.ClaimParams{
				Holder: ss.id, RelayID: ss.relayID, ReplicaID: ss.srv.cfg.ReplicaID,
				Streams: ss.streams, Limit: n, TTL: ss.ttl,
			})
			cancelClaim()
			if err != nil {
				if ctx.Err() != nil {
					return ctx.Err()
				}
				log.Warn("claim failed; retrying", "err", err)
				idle = true
				pollDelay = max(pollDelay, 100*time.Millisecond)
			}
			for _, l := range leases {
				ss.inflight[l.Event.ID] = struct{}{}
				ss.srv.metrics.deliveries.Inc()
				if l.Attempt > 1 {
					ss.srv.metrics.redeliveries.Inc()
				}
				if err := send(ss.delivery(l)); err != nil {
					ss.inflightN.Store(int64(len(ss.inflight)))
					return err
				}
			}
			ss.inflightN.Store(int64(len(ss.inflight)))
			if len(leases) > 0 {
				pollDelay = minIdlePoll
			}
			if err == nil && len(leases) == n {
				continue // there may be more
			}
			if err == nil {
				idle = true
			}
		}

		var pollC <-chan time.Time
		if idle {
			if pollDelay >= armAfter {
				// Waiting on producers' notifications from here on. A
				// wake-up consumed the registration, so this renews it
				// right away (a no-op while it is fresh).
				ss.srv.wake.arm(ctx)
			}
			idleTimer.Reset(pollDelay)
			pollC = idleTimer.C
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-ss.aborted:
			return status.Error(codes.Unavailable, "server is shutting down; reconnect to another replica")
		case <-ss.kick:
			// Credit freed: claim at once. The backoff is kept, so a session
			// that then finds nothing does not start over with fast polls.
		case <-ss.srv.wake.wait():
			// A producer committed: claim at once, backoff kept (another
			// session may take the event, and all of them were woken).
		case <-pollC:
			// Capped so that an idle session renews its registration in
			// outbox.listener before it lapses, whatever the poll interval.
			pollDelay = min(pollDelay*2, ss.srv.cfg.PollInterval, armTTL/4)
		case <-reconcileTicker.C:
			if len(ss.inflight) > 0 {
				ss.requestReconcile()
			}
		case <-stopping:
			stopping = nil // now only frees matter; handled at the top
		}
		if idle && !idleTimer.Stop() {
			select {
			case <-idleTimer.C:
			default:
			}
		}
	}
}

// applyFreed drops ended leases from inflight, and reconciles with the
// database when asked to.
func (ss *session) applyFreed(ctx context.Context) error {
	ss.mu.Lock()
	freed, reconcile := ss.freed, ss.reconcile
	ss.freed, ss.reconcile = nil, false
	ss.mu.Unlock()
	for _, f := range freed {
		if _, ok := ss.inflight[f.id]; ok {
			delete(ss.inflight, f.id)
			if f.published {
				ss.acked.Add(1)
			}
		}
	}
	if reconcile && len(ss.inflight) > 0 {
		held, err := ss.srv.store.HeldEvents(ctx, ss.id)
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
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
	return nil
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

func (ss *session) delivery(l store.Lease) *outboxv1.SubscribeResponse {
	e := l.Event
	return &outboxv1.SubscribeResponse{
		Event:          eventProto(e),
		LeaseToken:     ss.srv.signer.Sign(leasetoken.Token{EventID: e.ID, Epoch: l.Epoch}),
		LeaseExpiresAt: timestamppb.New(l.ExpiresAt),
		Attempt:        uint32(l.Attempt),
		// The claim has just set the lease to the database's now + ttl; the
		// relay counts this from receipt on its own clock.
		LeaseTtlRemaining: durationpb.New(ss.ttl),
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
