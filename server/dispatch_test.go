package server_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/protobuf/types/known/durationpb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/store"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/server"
)

// offerGate holds a session's loop right after it offered its credit to
// discovery, so that the offer stands (the loop cannot withdraw it to claim)
// until the test opens the gate: whatever reaches the session meanwhile was
// dispatched by a discovery round, not claimed.
type offerGate struct {
	// least is the smallest offer held; smaller ones pass.
	least  int
	mu     sync.Mutex
	held   chan struct{} // receives once per hold: the loop is held
	open   chan struct{} // closed to release the current hold
	closed bool          // no more holds
}

// newOfferGate returns a gate that holds every offer; with armed false it
// holds none until arm.
func newOfferGate(armed bool) *offerGate {
	return &offerGate{held: make(chan struct{}, 1), open: make(chan struct{}), closed: !armed}
}

// arm makes the next offers held.
func (g *offerGate) arm() { g.armFrom(0) }

// armFrom makes the next offers of at least least units held.
func (g *offerGate) armFrom(least int) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.closed = false
	g.least = least
}

func (g *offerGate) hook(_ uuid.UUID, offered int) {
	g.mu.Lock()
	if g.closed || offered < g.least {
		g.mu.Unlock()
		return
	}
	open := g.open
	g.mu.Unlock()
	select {
	case g.held <- struct{}{}:
	default:
	}
	<-open
}

// waitHeld waits until a session loop is held at its offer.
func (g *offerGate) waitHeld(t *testing.T) {
	t.Helper()
	select {
	case <-g.held:
	case <-time.After(30 * time.Second):
		t.Fatal("no session offered its credit within 30s")
	}
}

// release lets the held loop go on; with again, the loop's next offer is held
// too.
func (g *offerGate) release(again bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	close(g.open)
	g.open = make(chan struct{})
	g.closed = !again
}

// discoveryTurns tells a test when the replica's discovery loop has ended
// an idle check (SetAfterRoundDue).
type discoveryTurns struct{ c chan struct{} }

func watchDiscoveryTurns(r *replica) *discoveryTurns {
	w := &discoveryTurns{c: make(chan struct{}, 1)}
	r.Server.SetAfterRoundDue(func(bool, error) {
		select {
		case w.c <- struct{}{}:
		default:
		}
	})
	return w
}

// next waits for a check that ends after it is called. The loop takes one
// turn at a time, so a round that began before the call (say, before a
// session offered its credit, which that round then did not borrow) has
// ended by then: a round that finds an event committed after next returns
// began after the call too.
func (w *discoveryTurns) next(t *testing.T) {
	t.Helper()
	select {
	case <-w.c:
	default:
	}
	select {
	case <-w.c:
	case <-time.After(30 * time.Second):
		t.Fatal("the discovery loop made no idle check within 30s")
	}
}

// drain empties c of what it holds.
func drain[T any](c chan T) {
	for len(c) > 0 {
		<-c
	}
}

// sweepWatch sees a replica's sweeps for orphans (releaseUndelivered):
// whether one had to wait for leases on their way to their session, and
// what each released.
type sweepWatch struct {
	waited chan struct{}
	swept  chan sweep
}

type sweep struct {
	session  uuid.UUID
	released int
}

func watchSweeps(r *replica) *sweepWatch {
	w := &sweepWatch{waited: make(chan struct{}, 1), swept: make(chan sweep, 4)}
	r.Server.SetSweepWaits(
		func(uuid.UUID) {
			select {
			case w.waited <- struct{}{}:
			default:
			}
		},
		func(id uuid.UUID, released int) {
			select {
			case w.swept <- sweep{id, released}:
			default:
			}
		})
	return w
}

// sweepWhileOnTheirWay asks session's loop for a sweep while leases are on
// their way to it (a hook holds them back) and returns once the sweep waits
// for them, as it must; a sweep that goes ahead fails t (and stays to be
// seen by next). What was seen before the call is dropped: it is not the
// sweep under test.
func (w *sweepWatch) sweepWhileOnTheirWay(t *testing.T, r *replica, session uuid.UUID, what string) {
	t.Helper()
	drain(w.waited)
	drain(w.swept)
	if !r.Server.RequestSweep(session) {
		t.Errorf("%s went to a session the server does not have", what)
	}
	select {
	case <-w.waited:
	case s := <-w.swept:
		t.Errorf("the sweep went ahead while %s was on its way, and released %d", what, s.released)
		w.swept <- s
	case <-time.After(30 * time.Second):
		t.Error("the session's loop did not sweep within 30s")
	}
}

// next waits for the next sweep to end.
func (w *sweepWatch) next(t *testing.T, what string) sweep {
	t.Helper()
	select {
	case s := <-w.swept:
		return s
	case <-time.After(30 * time.Second):
		t.Fatal("no sweep " + what + " within 30s")
		return sweep{}
	}
}

// emitOnceOffered emits one event to stream/key once the session's offer
// is held (gate) and no round that began before it is under way (turns),
// and waits for dispatched (fed by an afterDiscover hook) to name it.
func emitOnceOffered(t *testing.T, pool *pgxpool.Pool, gate *offerGate, turns *discoveryTurns,
	dispatched <-chan uuid.UUID, stream, key string) uuid.UUID {
	t.Helper()
	gate.waitHeld(t)
	turns.next(t)
	id := emit(t, pool, stream, key, 1)[0]
	select {
	case got := <-dispatched:
		if got != id {
			t.Fatalf("dispatched %s, want %s", got, id)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("nothing was dispatched")
	}
	return id
}

// recvAttempt receives the next delivery and fails t unless it is event id
// at attempt (why says what that attempt means).
func recvAttempt(t *testing.T, st outboxv1.RelayService_SubscribeClient, id uuid.UUID, attempt uint32, why string) *outboxv1.SubscribeResponse {
	t.Helper()
	d := recv(t, st)
	if d.GetEvent().GetEventId() != id.String() || d.GetAttempt() != attempt {
		t.Fatalf("got %s attempt %d, want %s attempt %d (%s)", d.GetEvent().GetEventId(), d.GetAttempt(), id, attempt, why)
	}
	return d
}

// roundWatch passes a test each discovery round that found events
// (SetAfterDiscover). Its channel is large, and a full one holds the loop,
// so that no round is missed.
type roundWatch struct{ rounds chan store.Discovery }

func watchRounds(r *replica) *roundWatch { return watchRoundsWith(r, nil) }

// watchRoundsWith is watchRounds with every round's outcome (one that found
// nothing or failed too) given to f first, in the discovery loop, before
// the round gives its sessions their leases: a blocking f holds the loop
// there.
func watchRoundsWith(r *replica, f func(store.Discovery, error)) *roundWatch {
	w := &roundWatch{rounds: make(chan store.Discovery, 256)}
	r.Server.SetAfterDiscover(func(d store.Discovery, err error) (store.Discovery, error) {
		if f != nil {
			f(d, err)
		}
		if err == nil && d.Events > 0 {
			w.rounds <- d
		}
		return d, err
	})
	return w
}

// next returns the next round that found events.
func (w *roundWatch) next(t *testing.T) store.Discovery {
	t.Helper()
	select {
	case d := <-w.rounds:
		return d
	case <-time.After(30 * time.Second):
		t.Fatal("no discovery round found events within 30s")
		return store.Discovery{}
	}
}

// nextDispatch returns what the next round that dispatched anything
// dispatched, passing over rounds that did not.
func (w *roundWatch) nextDispatch(t *testing.T) []store.DispatchedLease {
	t.Helper()
	for {
		if d := w.next(t); len(d.Dispatched) > 0 {
			return d.Dispatched
		}
	}
}

// A session waiting for work gets an idle aggregate's next event from the
// discovery round that finds it, with no claim: the lease has the session's
// TTL, attempt 1 and a working token, and the stream's credit holds.
func TestDiscoveryDispatchesToWaitingSession(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	var claims claimCounter
	gate := newOfferGate(false)
	defer gate.release(false) // a held loop would keep the replica from stopping
	reg := prometheus.NewPedanticRegistry()
	r := startReplica(t, url, func(c *server.Config) { c.Registerer = reg })
	r.Server.SetAfterClaim(claims.hook)
	r.Server.SetAfterOffer(gate.hook)
	watch := watchRounds(r)
	turns := watchDiscoveryTurns(r)
	const ttl = time.Hour
	emit(t, pool, "billing", "b", 1)
	first := emit(t, pool, "orders", "o", 1)[0]
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 2, Streams: []string{"orders"}, LeaseTtl: durationpb.New(ttl)})
	// The first event was committed before the stream opened: claimed.
	if d := recv(t, st); d.GetEvent().GetEventId() != first.String() {
		t.Fatalf("got %s, want %s", d.GetEvent().GetEventId(), first)
	} else {
		ack(t, r, d)
	}
	// Whether that event was claimed or dispatched (the round may have
	// run once the stream was open), from here on every event is counted.
	claims.n.Store(0)
	dispatchedBefore := r.Server.Dispatched()
	claimedBefore := gatherSum(t, reg, "outboxd_claimed_total")
	drain(watch.rounds)
	gate.arm()
	const k = 6
	for i := range k {
		gate.waitHeld(t)
		turns.next(t) // no round that began before the offer finds the events
		// Two aggregates, other stream first: the filter keeps "billing"
		// for a claim, so only "orders" may be dispatched to this session.
		emit(t, pool, "billing", "b", 1)
		id := emit(t, pool, "orders", "o", 1)[0]
		dispatched := watch.nextDispatch(t)
		if len(dispatched) != 1 || dispatched[0].Lease.Event.ID != id {
			t.Fatalf("round %d dispatched %v, want only orders/o revision %d", i, dispatched, i+2)
		}
		// Not held again until the lease is with the relay: a loop held
		// at its offer could not send it.
		gate.release(false)
		before := time.Now()
		d := recv(t, st)
		if d.GetEvent().GetEventId() != id.String() || d.GetAttempt() != 1 {
			t.Fatalf("got %s attempt %d, want %s attempt 1", d.GetEvent().GetEventId(), d.GetAttempt(), id)
		}
		if d.GetLeaseExpiresAt().AsTime().Before(before.Add(ttl - time.Minute)) {
			t.Fatalf("leased until %v: not the session's TTL", d.GetLeaseExpiresAt().AsTime())
		}
		ackPublished(t, r, d)
		if i < k-1 {
			gate.arm()
		}
	}
	if n := claims.n.Load(); n != 0 {
		t.Fatalf("%d claims leased something, want none (every event dispatched)", n)
	}
	if n := r.Server.Dispatched() - dispatchedBefore; n != k {
		t.Fatalf("%d dispatched, want %d", n, k)
	}
	if n := gatherSum(t, reg, "outboxd_claimed_total") - claimedBefore; n != 0 {
		t.Fatalf("outboxd_claimed_total grew by %v over %d dispatched events, want 0", n, k)
	}
	// The billing aggregate was made ready, not dispatched: nobody took it.
	var ready int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox.delivery WHERE stream = 'billing' AND state = 'ready'`).Scan(&ready); err != nil {
		t.Fatal(err)
	}
	if ready != 1 {
		t.Fatalf("billing: %d ready aggregates, want 1", ready)
	}
}

// Dispatch takes turns over a replica's waiting sessions across rounds:
// each round begins with the session after the last one a round leased to,
// so one relay does not take every trickled event while the others wait.
// Forced: both sessions' loops are held where they offer their credit, so
// both offer it to every round below.
func TestDispatchTakesTurnsAcrossRounds(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	watch := watchRounds(r)
	open := make(chan struct{})
	defer close(open) // held loops would keep the replica from stopping
	held := make(chan uuid.UUID, 16)
	r.Server.SetAfterOffer(func(id uuid.UUID, offered int) {
		select {
		case <-open:
			return
		default:
		}
		if offered > 0 {
			held <- id
			<-open
		}
	})
	turns := watchDiscoveryTurns(r)
	for range 2 {
		subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 3, LeaseTtl: durationpb.New(time.Hour)})
	}
	var sessions []uuid.UUID
	for len(sessions) < 2 {
		select {
		case id := <-held:
			if !slices.Contains(sessions, id) {
				sessions = append(sessions, id)
			}
		case <-time.After(30 * time.Second):
			t.Fatalf("%d of 2 sessions offered their credit within 30s", len(sessions))
		}
	}
	turns.next(t) // no round that began before the offers finds the first event
	var got []uuid.UUID
	for i := range 3 {
		emit(t, pool, "orders", fmt.Sprintf("o%d", i), 1)
		d := watch.nextDispatch(t)
		if len(d) != 1 {
			t.Fatalf("round %d dispatched %d leases, want 1", i, len(d))
		}
		got = append(got, d[0].Holder)
	}
	if got[0] == got[1] || got[1] == got[2] {
		t.Fatalf("three rounds dispatched to sessions %v: the second went to the first's session, or the third to the second's", got)
	}
}

// With dispatch off every event is claimed.
func TestNoDispatchClaimsEveryEvent(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	gate := newOfferGate(true)
	defer gate.release(false) // a held loop would keep the replica from stopping
	rounds := make(chan store.Discovery, 16)
	reg := prometheus.NewPedanticRegistry()
	r := startReplica(t, url, func(c *server.Config) {
		c.NoDispatch = true
		c.Registerer = reg
	})
	r.Server.SetAfterOffer(gate.hook)
	r.Server.SetAfterDiscover(func(d store.Discovery, err error) (store.Discovery, error) {
		if err == nil && d.Events > 0 {
			rounds <- d
		}
		return d, err
	})
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 1})
	gate.waitHeld(t)
	id := emit(t, pool, "orders", "o", 1)[0]
	// Held at its offer, the session takes nothing from the round that
	// finds the event: it is made ready, for a claim.
	select {
	case d := <-rounds:
		if len(d.Dispatched) != 0 || d.Aggregates != 1 {
			t.Fatalf("round with dispatch off: %d dispatched, %d made ready; want 0 and 1", len(d.Dispatched), d.Aggregates)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("no discovery round found the event")
	}
	gate.release(false)
	if d := recv(t, st); d.GetEvent().GetEventId() != id.String() {
		t.Fatalf("got %s, want %s", d.GetEvent().GetEventId(), id)
	}
	if n := r.Server.Dispatched(); n != 0 {
		t.Fatalf("%d dispatched with dispatch off", n)
	}
	if n := gatherSum(t, reg, "outboxd_claimed_total"); n != 1 {
		t.Fatalf("outboxd_claimed_total = %v after one claimed event, want 1", n)
	}
}

// A session whose stream ends after a round borrowed its credit and before
// the round's leases commit loses nothing: the stream's own release has
// already run (it found nothing to release), the session refuses the
// leases, and the round releases them at once, not after their hour-long
// TTL, so the event goes to the next relay. Forced: the round is held after
// it borrowed the credit and before it is sent; meanwhile the event
// commits and the session ends.
func TestDispatchToEndedSessionIsReleased(t *testing.T) {
	t.Parallel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	// The sessions leave stream unwatched alone, whose events make rounds
	// due below (a stream is named only once it has events).
	emit(t, pool, "unwatched", "u", 1)
	r := startReplica(t, url, nil)
	gate := newOfferGate(true)
	defer gate.release(false) // a held loop would keep the replica from stopping
	r.Server.SetAfterOffer(gate.hook)
	ctx1, cancel1 := context.WithCancel(context.Background())
	defer cancel1()
	var once sync.Once
	var id uuid.UUID
	ended := make(chan struct{})
	r.Server.SetBeforeRound(func() {
		once.Do(func() {
			// The round has borrowed the session's credit: the event
			// commits before the round reads, and the session ends, its
			// stream's release run, before the round's leases commit.
			id = emit(t, pool, "orders", "o", 1)[0]
			gate.release(false)
			cancel1()
			waitCtx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			if err := r.Server.Wait(waitCtx); err != nil {
				t.Errorf("session did not end: %v", err)
			}
			close(ended)
		})
	})
	refused := make(chan struct{})
	var refusedOnce sync.Once
	r.Server.SetAfterDiscover(func(d store.Discovery, err error) (store.Discovery, error) {
		if err == nil && len(d.Dispatched) > 0 {
			refusedOnce.Do(func() { close(refused) })
		}
		return d, err
	})
	unwatched := []string{"unwatched"}
	subscribe(t, ctx1, r, &outboxv1.SubscribeRequest{ExcludeStreams: unwatched, MaxInFlight: 1,
		LeaseTtl: durationpb.New(time.Hour)})
	gate.waitHeld(t)
	// An event the session does not take makes a round due, so that the
	// idle replica runs one (and the session's credit is borrowed) whether
	// or not a round is under way already.
	emit(t, pool, "unwatched", "u", 1)
	for _, c := range []chan struct{}{ended, refused} {
		select {
		case <-c:
		case <-time.After(30 * time.Second):
			t.Fatal("nothing was dispatched to the ending session")
		}
	}
	// The lease was committed for a session that no longer exists; only
	// the round's own release frees it before its TTL.
	ctx2, cancel2 := context.WithCancel(context.Background())
	defer cancel2()
	d := recv(t, subscribe(t, ctx2, r, &outboxv1.SubscribeRequest{ExcludeStreams: unwatched, MaxInFlight: 1}))
	if d.GetEvent().GetEventId() != id.String() {
		t.Fatalf("next relay got %s, want %s", d.GetEvent().GetEventId(), id)
	}
	ack(t, r, d)
}

// A round whose answer is lost after it committed (the dispatched leases
// exist, their session never hears of them) leaves nothing held: the
// session sweeps its orphans and the event is delivered well before its
// hour-long TTL.
func TestDispatchWithLostAnswerLeavesNoOrphan(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	gate := newOfferGate(true)
	defer gate.release(false) // a held loop would keep the replica from stopping
	r.Server.SetAfterOffer(gate.hook)
	var once sync.Once
	lost := make(chan uuid.UUID, 1)
	r.Server.SetAfterDiscover(func(d store.Discovery, err error) (store.Discovery, error) {
		if err == nil && len(d.Dispatched) > 0 {
			var drop bool
			once.Do(func() { drop = true })
			if drop {
				lost <- d.Dispatched[0].Lease.Event.ID
				gate.release(false)
				return store.Discovery{}, fmt.Errorf("test: %w", store.ErrAnswerLost)
			}
		}
		return d, err
	})
	turns := watchDiscoveryTurns(r)
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 1, LeaseTtl: durationpb.New(time.Hour)})
	id := emitOnceOffered(t, pool, gate, turns, lost, "orders", "o")
	d := recvAttempt(t, st, id, 2, "the orphaned lease released, then claimed")
	ackPublished(t, r, d)
}

// A sweep for orphans that runs while a round's leases are on their way to
// its session (the round committed, the session does not have them yet)
// waits until they are with it, and keeps them: it must not release a
// lease the session is about to send. The round is held after it
// committed, the sweep is asked for then, and the round goes on once the
// sweep either waits (as it must) or has released what it found.
func TestSweepKeepsLeasesARoundIsDispatching(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	gate := newOfferGate(true)
	defer gate.release(false) // a held loop would keep the replica from stopping
	r.Server.SetAfterOffer(gate.hook)
	sweeps := watchSweeps(r)
	var once sync.Once
	dispatched := make(chan uuid.UUID, 1)
	r.Server.SetAfterDiscover(func(d store.Discovery, err error) (store.Discovery, error) {
		if err != nil || len(d.Dispatched) == 0 {
			return d, err
		}
		var first bool
		once.Do(func() { first = true })
		if !first {
			return d, err
		}
		dispatched <- d.Dispatched[0].Lease.Event.ID
		gate.release(false) // the loop sweeps once let go
		sweeps.sweepWhileOnTheirWay(t, r, d.Dispatched[0].Holder, "the round's lease")
		return d, err
	})
	turns := watchDiscoveryTurns(r)
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 1, LeaseTtl: durationpb.New(time.Hour)})
	id := emitOnceOffered(t, pool, gate, turns, dispatched, "orders", "o")
	d := recvAttempt(t, st, id, 1, "the dispatched lease, kept")
	if s := sweeps.next(t, "after the round"); s.released != 0 {
		t.Fatalf("the sweep released %d leases, want 0", s.released)
	}
	ackPublished(t, r, d)
}

// A claim that failed may still commit late, after the session's immediate
// sweep: the session then holds a lease it never heard of, with nothing in
// flight that would make its loop reconcile. It sweeps once more at its
// next reconcile tick all the same (the loop selects on the tick while a
// sweep is owed), so the lease is claimable again long before its TTL. The
// session's first claim fails; once its immediate sweep is done the test
// takes the late commit's part, leasing an event of a stream the session
// does not take (so nothing else turns its loop) to the session's id.
func TestClaimCommittedLateIsSweptAtTheNextTickWithNothingInFlight(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, func(c *server.Config) { c.NoDispatch = true })
	ticks := make(chan time.Time)
	r.Server.SetReconcileTick(ticks)
	var once sync.Once
	r.Server.SetAfterClaim(func(ls []store.Lease, err error) ([]store.Lease, error) {
		var first bool
		once.Do(func() { first = true })
		if first && err == nil && len(ls) == 0 {
			return nil, errors.New("test: the claim failed")
		}
		return ls, err
	})
	sweeps := watchSweeps(r)
	subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 1, ExcludeStreams: []string{"audit"},
		LeaseTtl: durationpb.New(time.Hour)})
	first := sweeps.next(t, "after the failed claim")
	if first.released != 0 {
		t.Fatalf("the immediate sweep released %d", first.released)
	}

	emit(t, pool, "audit", "x", 1)
	deadline := time.Now().Add(30 * time.Second)
	for {
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox.claim($1, 'r', 'x', ARRAY['audit'], 1, interval '1 hour')`,
			first.session).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("audit/x was not claimable within 30s")
		}
		time.Sleep(10 * time.Millisecond) // until discovery has found it
	}

	select {
	case ticks <- time.Now():
	case <-time.After(30 * time.Second):
		t.Fatal("the session's loop took no reconcile tick within 30s though it owes a sweep")
	}
	if s := sweeps.next(t, "after the tick"); s.session != first.session || s.released != 1 {
		t.Fatalf("the tick's sweep released %d leases of %s, want the late claim's 1 of %s", s.released, s.session, first.session)
	}
	var state string
	if err := pool.QueryRow(ctx, `SELECT state FROM outbox.delivery WHERE stream = 'audit' AND aggregate_key = 'x'`).Scan(&state); err != nil {
		t.Fatal(err)
	}
	if state == "leased" {
		t.Fatal("audit/x is still leased to the session after its sweep")
	}
}

// Credit an ack frees is claimed with at once only when the ack's batch saw
// claimable work; otherwise the session makes no claim (an empty claim
// after every ack that ended a lease without a hand-over was most of a
// steady replica's claims), waits no longer than the first time the batch
// saw anything become claimable, and still gets new events by dispatch.
func TestAckFreedCreditIsClaimedOnlyWhenWorkIsClaimable(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	type decision struct {
		claim bool
		by    time.Time
	}
	decisions := make(chan decision, 16)
	// No reconcile: one that read the session's leases after an ack
	// committed but before the acker settled it would free the lease as
	// gone, a reason to claim at once, and the decision under test would
	// never be made.
	r := startReplica(t, url, func(c *server.Config) { c.ReconcileInterval = time.Hour })
	r.Server.SetAfterFreed(func(_ uuid.UUID, claim bool, by time.Time) { decisions <- decision{claim, by} })
	next := func() decision {
		t.Helper()
		select {
		case d := <-decisions:
			return d
		case <-time.After(30 * time.Second):
			t.Fatal("no session found credit freed within 30s")
			return decision{}
		}
	}
	const ttl = time.Hour
	emit(t, pool, "orders", "a", 1)
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 1, Streams: []string{"orders"}, LeaseTtl: durationpb.New(ttl)})
	a := recv(t, st)
	// Found while the session's one unit of credit is in use: made ready.
	b := emit(t, pool, "orders", "b", 1)[0]
	waitState(t, pool, "b", "ready")
	ack(t, r, a)
	if d := next(); !d.claim {
		t.Fatalf("ack with orders/b ready: claim %v by %v, want a claim at once", d.claim, d.by)
	}
	if d := recv(t, st); d.GetEvent().GetEventId() != b.String() {
		t.Fatalf("got %s, want orders/b %s", d.GetEvent().GetEventId(), b)
	} else {
		ack(t, r, d)
	}
	// Nothing else pending, nothing leased: no claim, and no bound but the
	// poll.
	if d := next(); d.claim || !d.by.IsZero() {
		t.Fatalf("ack with nothing claimable: claim %v by %v, want no claim and no bound", d.claim, d.by)
	}
	// Another relay holds billing/x for a minute: a stream this session
	// does not take, so it neither makes it claim nor bounds its wait.
	x := emit(t, pool, "billing", "x", 1)[0]
	other := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{RelayId: "other", MaxInFlight: 1, Streams: []string{"billing"},
		LeaseTtl: durationpb.New(time.Minute)})
	if d := recv(t, other); d.GetEvent().GetEventId() != x.String() {
		t.Fatalf("other got %s, want billing/x %s", d.GetEvent().GetEventId(), x)
	}
	c := emit(t, pool, "orders", "c", 1)[0]
	if d := recv(t, st); d.GetEvent().GetEventId() != c.String() {
		t.Fatalf("got %s, want orders/c %s", d.GetEvent().GetEventId(), c)
	} else {
		ack(t, r, d)
	}
	if d := next(); d.claim || !d.by.IsZero() {
		t.Fatalf("ack with billing/x leased for a minute: claim %v by %v, want no claim and no bound (not this session's stream)", d.claim, d.by)
	}
	// A third relay holds orders/x for a minute (given it while this
	// session's credit was in use): nothing of orders is claimable before
	// that lease expires, which bounds the wait.
	c2 := emit(t, pool, "orders", "c2", 1)[0]
	if d := recv(t, st); d.GetEvent().GetEventId() != c2.String() {
		t.Fatalf("got %s, want orders/c2 %s", d.GetEvent().GetEventId(), c2)
	} else {
		ordersOther := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{RelayId: "orders-other", MaxInFlight: 1,
			Streams: []string{"orders"}, LeaseTtl: durationpb.New(time.Minute)})
		ox := emit(t, pool, "orders", "x", 1)[0]
		if o := recv(t, ordersOther); o.GetEvent().GetEventId() != ox.String() {
			t.Fatalf("orders-other got %s, want orders/x %s", o.GetEvent().GetEventId(), ox)
		}
		ack(t, r, d)
	}
	if d := next(); d.claim || d.by.Before(time.Now().Add(30*time.Second)) || d.by.After(time.Now().Add(time.Minute)) {
		t.Fatalf("ack with orders/x leased for a minute: claim %v by %v, want no claim, by within the minute", d.claim, d.by)
	}
	// The session still gets new events, by dispatch.
	e := emit(t, pool, "orders", "e", 1)[0]
	if d := recv(t, st); d.GetEvent().GetEventId() != e.String() {
		t.Fatalf("got %s, want orders/e %s", d.GetEvent().GetEventId(), e)
	}
}

// Credit a discovery round borrowed and gives back unused reaches the
// session's loop at once. The loop that is woken while its credit is lent
// cannot claim, so it waits without credit, out of its poll group's idle
// line: neither the group's wake-ups nor its polls reach it. Were the
// credit's return silent, the wake-up it took (here an operator's retry)
// would be lost and the retried aggregate never claimed. Forced: the round
// is held after it borrowed the credit and before it is sent; the retry
// (or, before it, the group's poll) wakes the session, seen offering
// nothing; the round's aggregate is skipped meanwhile, so the round leases
// nothing and gives all the credit back.
func TestCreditARoundGivesBackWakesTheSession(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, func(c *server.Config) { c.MaxFailures = 1 })
	turns := watchDiscoveryTurns(r)
	// The session's loop is held where it offers its credit after the nack,
	// so that the round below finds the credit offered (a loop that is
	// claiming has withdrawn it), and let go once the round borrowed it.
	gate := newOfferGate(false)
	defer gate.release(false) // a held loop would keep the replica from stopping
	var watching atomic.Bool
	var zeroOnce sync.Once
	offeredNothing := make(chan struct{})
	r.Server.SetAfterOffer(func(id uuid.UUID, offered int) {
		if watching.Load() && offered == 0 {
			zeroOnce.Do(func() { close(offeredNothing) })
		}
		gate.hook(id, offered)
	})
	parked := emit(t, pool, "orders", "p", 1)[0]
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 1, LeaseTtl: durationpb.New(time.Hour)})
	d := recv(t, st)
	gate.armFrom(1)
	nack(t, r, d) // parks p
	gate.waitHeld(t)

	lent, letGo := holdFirstRound(t, r)
	turns.next(t) // no round that began before the offer finds x
	skipped := emit(t, pool, "orders", "x", 1)[0]
	waitClosed(t, lent, "no discovery round lent the session's credit")
	// Watched from the release on: on a busy host the loop may turn before
	// the retry, woken by its group's poll, and then wait without credit
	// all the same, the retry's wake-up left for a member with credit.
	watching.Store(true)
	gate.release(false)

	if _, err := r.Admin.RetryAggregate(ctx, &outboxv1.RetryAggregateRequest{Stream: "orders", AggregateKey: "p",
		Reason: "broker is back"}); err != nil {
		t.Fatal(err)
	}
	waitClosed(t, offeredNothing, "the retry did not wake the session while its credit was lent")
	if _, err := r.Admin.SkipEvent(ctx, &outboxv1.SkipEventRequest{EventId: skipped.String(), Reason: "not wanted"}); err != nil {
		t.Fatal(err)
	}
	letGo()

	d = recv(t, st)
	if got := d.GetEvent().GetEventId(); got != parked.String() {
		t.Fatalf("got %s, want the retried %s", got, parked)
	}
	ack(t, r, d)
}

// Credit a round gives back unused to a loop that still waits with its
// offer rejoins the offer without waking the loop: every round borrows the
// credit of every waiting session, and a wake-up for each would turn every
// idle loop once a round. The session takes all but payments; its loop is
// held at its offer while two rounds find payments events and give the
// credit back. (TestCreditARoundGivesBackWakesTheSession holds the other
// side: a loop that turned while its credit was lent is woken.)
func TestCreditARoundGivesBackToAWaitingLoopDoesNotWakeIt(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	gate := newOfferGate(true)
	defer gate.release(false) // a held loop would keep the replica from stopping
	r.Server.SetAfterOffer(gate.hook)
	type given struct {
		leases, unused int
		woke           bool
	}
	gives := make(chan given, 8)
	r.Server.SetAfterGive(func(_ uuid.UUID, leases, unused int, woke bool) { gives <- given{leases, unused, woke} })
	turns := watchDiscoveryTurns(r)
	subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 1, ExcludeStreams: []string{"payments"},
		LeaseTtl: durationpb.New(time.Hour)})
	gate.waitHeld(t)
	turns.next(t) // no round that began before the offer finds the first event
	for _, key := range []string{"a", "b"} {
		emit(t, pool, "payments", key, 1)
		select {
		case g := <-gives:
			if g.leases != 0 || g.unused != 1 {
				t.Fatalf("a round gave %d leases and %d unused credit, want 0 and 1", g.leases, g.unused)
			}
			if g.woke {
				t.Fatalf("the round for payments/%s woke the waiting loop when it gave back the credit it did not use", key)
			}
		case <-time.After(30 * time.Second):
			t.Fatalf("no discovery round borrowed the session's credit within 30s of payments/%s", key)
		}
	}
}

// waitClosed waits until c is closed, failing with what after 30s.
func waitClosed(t *testing.T, c <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-c:
	case <-time.After(30 * time.Second):
		t.Fatal(what + " within 30s")
	}
}

// A loop offers only the credit that leases given to it but not yet
// counted leave free: a discovery round that borrowed part of a waiting
// session's credit and gives its lease while the loop claims with the rest
// leaves that lease waiting to be counted when the loop next offers, and
// offering past it would let the next round dispatch beyond max_in_flight.
// S (max_in_flight 3, rounds of one aggregate, no polls) offers 3; a round
// borrows 1 and is held before it is sent; a wake-up makes S withdraw the
// offer and claim with the other 2, and its claim is held until the round
// has given S the lease it dispatched; S's next offer is then 3 - 1 = 2.
func TestAnOfferLeavesOutLeasesGivenWhileTheLoopClaimed(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, func(c *server.Config) { c.DiscoveryMaxFound = 1 })
	r.Server.SetReconcileTick(make(chan time.Time)) // never ticks
	// A poll before the round borrows would take S's offer back first; the
	// claim comes from the wake-up below.
	r.Server.SetNoPolls()
	offers := make(chan int, 64)
	r.Server.SetAfterOffer(func(_ uuid.UUID, offered int) { offers <- offered })
	roundHeld, letRoundGo := holdFirstRound(t, r)
	turns := watchDiscoveryTurns(r)
	// The claim is held until the round has given its lease.
	var armed atomic.Bool
	claim := newHoldGate(t)
	r.Server.SetAfterClaim(func(l []store.Lease, err error) ([]store.Lease, error) {
		if armed.Load() {
			claim.hold()
		}
		return l, err
	})
	r.Server.SetAfterGive(func(_ uuid.UUID, leases, _ int, _ bool) {
		if leases > 0 {
			claim.letGo()
		}
	})
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 3, LeaseTtl: durationpb.New(time.Hour)})
	if got := nextOffer(t, offers); got != 3 {
		t.Fatalf("the session's first offer: %d, want 3", got)
	}
	turns.next(t) // no round that began before the offer finds x
	emit(t, pool, "orders", "x", 1)
	waitClosed(t, roundHeld, "no discovery round borrowed the session's credit")
	armed.Store(true)
	if _, err := pool.Exec(ctx, `SELECT pg_notify('outbox_wakeup', '')`); err != nil {
		t.Fatal(err)
	}
	// The wake-up makes the loop withdraw its offer and claim.
	waitClosed(t, claim.held, "the session did not claim while the round was held")
	// Offers the loop made before this claim (a turn the listener's first
	// connection asks of every session, say) are not the one at stake: the
	// first one after the claim is.
	for len(offers) > 0 {
		<-offers
	}
	letRoundGo()
	d := recv(t, st)
	if d.GetEvent().GetAggregateKey() != "x" {
		t.Fatalf("delivered %s, want the round's lease of x", d.GetEvent().GetAggregateKey())
	}
	if got := nextOffer(t, offers); got != 2 {
		t.Fatalf("with x given but not yet counted, the session offered %d, want 2", got)
	}
}

func nextOffer(t *testing.T, offers <-chan int) int {
	t.Helper()
	select {
	case n := <-offers:
		return n
	case <-time.After(30 * time.Second):
		t.Fatal("the session made no offer within 30s")
		return 0
	}
}

// holdGate holds the first caller of hold (a test hook: a discovery
// round, a claim, an RPC) until letGo; held is closed once one is held.
// letGo also runs when the test ends, so that a failing test does not
// leave a server loop or call held and the replica unable to stop.
type holdGate struct {
	held, release         chan struct{}
	holdOnce, releaseOnce sync.Once
}

// newHoldGate makes a gate; make it after the replica it holds, so that its
// cleanup runs before the replica's.
func newHoldGate(t *testing.T) *holdGate {
	g := &holdGate{held: make(chan struct{}), release: make(chan struct{})}
	t.Cleanup(g.letGo)
	return g
}

func (g *holdGate) hold() {
	g.holdOnce.Do(func() {
		close(g.held)
		<-g.release
	})
}

func (g *holdGate) letGo() { g.releaseOnce.Do(func() { close(g.release) }) }

// holdFirstRound holds the first discovery round that borrows sessions'
// credit, after it did and before it is sent, until letGo (see holdGate).
func holdFirstRound(t *testing.T, r *replica) (held <-chan struct{}, letGo func()) {
	g := newHoldGate(t)
	r.Server.SetBeforeRound(g.hold)
	return g.held, g.letGo
}
