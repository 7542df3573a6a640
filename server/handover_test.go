package server_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/store"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/relay"
	"github.com/outboxd/outboxd/server"
)

// claimCounter counts the claim statements that leased something.
type claimCounter struct{ n atomic.Int64 }

func (c *claimCounter) hook(ls []store.Lease, err error) ([]store.Lease, error) {
	if len(ls) > 0 {
		c.n.Add(1)
	}
	return ls, err
}

// Hand-over: a hot aggregate of K committed events goes out with one claim
// (its first event); every later event is leased by the ack of the one
// before, to the same session, with the session's TTL and a new epoch, and
// sent at once. The previous lease's token is fenced off.
func TestAckHandsOverNextEvent(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	const k = 20
	ids := emit(t, pool, "orders", "hot", k)
	emit(t, pool, "orders", "cold", 1) // another aggregate: claimed, never handed over
	var claims claimCounter
	r := startReplica(t, url, nil)
	r.Server.SetAfterClaim(claims.hook)
	const ttl = time.Hour
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 1, Streams: []string{"orders"}, LeaseTtl: durationpb.New(ttl)})
	var prev *outboxv1.SubscribeResponse
	for i := 0; i < k+1; i++ {
		d := recv(t, st)
		if d.GetEvent().GetAggregateKey() == "cold" {
			ackPublished(t, r, d)
			continue
		}
		if prev != nil && prev.GetEvent().GetAggregateKey() == "hot" {
			// The previous lease is over: its token is stale.
			_, err := r.Relay.Nack(ctx, &outboxv1.NackRequest{EventId: prev.GetEvent().GetEventId(), LeaseToken: prev.GetLeaseToken(), Error: "x"})
			if status.Code(err) != codes.FailedPrecondition {
				t.Fatalf("nack with the previous lease's token: %v, want FailedPrecondition", err)
			}
			_, err = r.Relay.ExtendLease(ctx, &outboxv1.ExtendLeaseRequest{EventId: prev.GetEvent().GetEventId(),
				LeaseToken: prev.GetLeaseToken(), Ttl: durationpb.New(ttl)})
			if status.Code(err) != codes.FailedPrecondition {
				t.Fatalf("extend with the previous lease's token: %v, want FailedPrecondition", err)
			}
			if res := ack(t, r, prev); res[0].GetStatus() != outboxv1.AckStatus_ACK_STATUS_ALREADY_PUBLISHED {
				t.Fatalf("repeated ack: %v", res[0])
			}
		}
		rev := d.GetEvent().GetRevision()
		if d.GetEvent().GetEventId() != ids[rev-1].String() || d.GetAttempt() != 1 {
			t.Fatalf("got %s revision %d attempt %d", d.GetEvent().GetEventId(), rev, d.GetAttempt())
		}
		if prev != nil && prev.GetEvent().GetAggregateKey() == "hot" && rev != prev.GetEvent().GetRevision()+1 {
			t.Fatalf("revision %d after %d", rev, prev.GetEvent().GetRevision())
		}
		before := time.Now()
		if _, err := r.Relay.ExtendLease(ctx, &outboxv1.ExtendLeaseRequest{EventId: d.GetEvent().GetEventId(),
			LeaseToken: d.GetLeaseToken(), Ttl: durationpb.New(ttl)}); err != nil {
			t.Fatalf("extend the handed-over lease of revision %d: %v", rev, err)
		}
		if d.GetLeaseExpiresAt().AsTime().Before(before.Add(ttl - time.Minute)) {
			t.Fatalf("revision %d leased until %v: not the session's TTL", rev, d.GetLeaseExpiresAt().AsTime())
		}
		prev = d
		ackPublished(t, r, d)
	}
	// One claim (or dispatch, when the replica's first discovery round ran
	// once the stream was open) for the hot aggregate's first event, one
	// for the cold one.
	if n := claims.n.Load() + int64(r.Server.Dispatched()); n != 2 {
		t.Fatalf("%d claims leased something or dispatches, want 2 (the rest handed over)", n)
	}
	if n := r.Server.HandOvers(); n != k-1 {
		t.Fatalf("%d hand-overs, want %d", n, k-1)
	}
	waitPending(t, pool, 0)
}

// With hand-over and dispatch off (the benchmark's comparison switches)
// every event is claimed.
func TestNoHandOverClaimsEveryEvent(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	const k = 5
	emit(t, pool, "orders", "hot", k)
	var claims claimCounter
	r := startReplica(t, url, func(c *server.Config) { c.NoHandOver, c.NoDispatch = true, true })
	r.Server.SetAfterClaim(claims.hook)
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 1})
	for i := range k {
		d := recv(t, st)
		if d.GetEvent().GetRevision() != int64(i+1) {
			t.Fatalf("revision %d, want %d", d.GetEvent().GetRevision(), i+1)
		}
		ack(t, r, d)
	}
	if n := claims.n.Load(); n != k {
		t.Fatalf("%d claims, want %d", n, k)
	}
	if n := r.Server.HandOvers(); n != 0 {
		t.Fatalf("%d hand-overs with hand-over off", n)
	}
}

// An ack arriving on another replica than the holder's hands nothing over:
// the aggregate becomes ready and the holder's replica claims it.
func TestAckOnAnotherReplicaDoesNotHandOver(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	emit(t, pool, "orders", "hot", 2)
	a, b := startReplica(t, url, nil), startReplica(t, url, nil)
	st := subscribe(t, ctx, a, &outboxv1.SubscribeRequest{MaxInFlight: 1})
	d1 := recv(t, st)
	if res := ack(t, b, d1); res[0].GetStatus() != outboxv1.AckStatus_ACK_STATUS_PUBLISHED {
		t.Fatalf("ack on b: %v", res[0])
	}
	d2 := recv(t, st)
	if d2.GetEvent().GetRevision() != 2 {
		t.Fatalf("revision %d, want 2", d2.GetEvent().GetRevision())
	}
	ack(t, a, d2)
	if a.Server.HandOvers()+b.Server.HandOvers() != 0 {
		t.Fatalf("hand-overs: a %d, b %d; want none", a.Server.HandOvers(), b.Server.HandOvers())
	}
}

// A missing next revision (a gap) or a skipped one is not handed over: the
// ack leaves the aggregate ready and the claim applies the gap and skip
// rules as before.
func TestNoHandOverAcrossGapOrSkip(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	emitAt(t, pool, "orders", "gap", 1)
	emitAt(t, pool, "orders", "gap", 3)
	skipped := emit(t, pool, "orders", "skip", 3)
	r := startReplica(t, url, nil)
	if _, err := r.Admin.SkipEvent(ctx, &outboxv1.SkipEventRequest{EventId: skipped[1].String(), Reason: "test", Actor: "test"}); err != nil {
		t.Fatal(err)
	}
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 2})
	got := map[string][]int64{}
	for range 3 { // gap r1, skip r1, skip r3
		d := recv(t, st)
		key := d.GetEvent().GetAggregateKey()
		got[key] = append(got[key], d.GetEvent().GetRevision())
		ackPublished(t, r, d)
	}
	if fmt.Sprint(got["gap"]) != "[1]" || fmt.Sprint(got["skip"]) != "[1 3]" {
		t.Fatalf("delivered %v", got)
	}
	if n := r.Server.HandOvers(); n != 0 {
		t.Fatalf("%d hand-overs across a gap or a skipped revision", n)
	}
	// The gap is held: once revision 2 commits, 2 and then 3 go out, 3
	// handed over by the ack of 2.
	emitAt(t, pool, "orders", "gap", 2)
	for _, want := range []int64{2, 3} {
		d := recv(t, st)
		if d.GetEvent().GetAggregateKey() != "gap" || d.GetEvent().GetRevision() != want {
			t.Fatalf("got %s/%d, want gap/%d", d.GetEvent().GetAggregateKey(), d.GetEvent().GetRevision(), want)
		}
		ack(t, r, d)
	}
	if n := r.Server.HandOvers(); n != 1 {
		t.Fatalf("%d hand-overs, want 1 (revision 3)", n)
	}
}

// A session that ends between the commit of an ack that handed it a lease
// and the hand-over reaching it loses nothing: the lease is released at once
// (not left to its hour-long TTL) and the event goes to the next relay.
func TestHandOverToEndedSessionIsReleased(t *testing.T) {
	t.Parallel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	ids := emit(t, pool, "orders", "hot", 2)
	r := startReplica(t, url, nil)
	ctx1, cancel1 := context.WithCancel(context.Background())
	defer cancel1()
	var hooked atomic.Bool
	r.Server.SetBeforeHandOver(func(res []store.AckResult) {
		for _, a := range res {
			if a.HandOver != nil && hooked.CompareAndSwap(false, true) {
				// The lease on revision 2 is committed; end its session
				// and wait until the stream's own release has run.
				cancel1()
				waitCtx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				defer cancel()
				if err := r.Server.Wait(waitCtx); err != nil {
					t.Errorf("session did not end: %v", err)
				}
			}
		}
	})
	st1 := subscribe(t, ctx1, r, &outboxv1.SubscribeRequest{MaxInFlight: 1, LeaseTtl: durationpb.New(time.Hour)})
	d1 := recv(t, st1)
	ackPublished(t, r, d1)
	if !hooked.Load() {
		t.Fatal("the ack handed nothing over")
	}
	// The Ack has returned: the handed lease is already released.
	var state string
	var holder *string
	if err := pool.QueryRow(context.Background(), `SELECT state, holder::text FROM outbox.delivery WHERE aggregate_key = 'hot'`).Scan(&state, &holder); err != nil {
		t.Fatal(err)
	}
	if state != "ready" || holder != nil {
		t.Fatalf("after the session ended: state %s holder %v, want ready and no holder", state, holder)
	}
	ctx2, cancel2 := context.WithCancel(context.Background())
	defer cancel2()
	d2 := recv(t, subscribe(t, ctx2, r, &outboxv1.SubscribeRequest{MaxInFlight: 1}))
	if d2.GetEvent().GetEventId() != ids[1].String() {
		t.Fatalf("next relay got %s, want revision 2", d2.GetEvent().GetEventId())
	}
	ack(t, r, d2)
}

// A sweep for orphans that runs while an ack batch's hand-overs are on
// their way to their sessions (the batch committed, the session does not
// have them yet) waits until they are with it and keeps them, as for a
// dispatching round's leases (TestSweepKeepsLeasesARoundIsDispatching).
func TestSweepKeepsLeasesAnAckIsHandingOver(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	ids := emit(t, pool, "orders", "hot", 2)
	r := startReplica(t, url, nil)
	sweeps := watchSweeps(r)
	var hooked atomic.Bool
	r.Server.SetBeforeHandOver(func(res []store.AckResult) {
		for _, a := range res {
			if len(a.HandOver) == 0 || !hooked.CompareAndSwap(false, true) {
				continue
			}
			sweeps.sweepWhileOnTheirWay(t, r, a.Holder, "the ack's hand-over")
		}
	})
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 1, LeaseTtl: durationpb.New(time.Hour)})
	d1 := recv(t, st)
	ackPublished(t, r, d1)
	if !hooked.Load() {
		t.Fatal("the ack handed nothing over")
	}
	d2 := recvAttempt(t, st, ids[1], 1, "the handed-over lease, kept")
	if s := sweeps.next(t, "after the ack"); s.released != 0 {
		t.Fatalf("the sweep released %d leases, want 0", s.released)
	}
	ackPublished(t, r, d2)
}

// An ack batch lends itself the offered credit of every local session
// with a window (a window may slide onto it), and gives it back to the
// sessions none of its acks concern: one whose credit the batch kept would
// never claim again. Session B (payments, window 2) waits with its credit
// offered while A's ack of an orders event commits; B must then still
// claim the next payments event. (No dispatch, so that only ack batches
// borrow B's credit.)
func TestAckBatchGivesBackTheCreditOfSessionsItDidNotAck(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	emit(t, pool, "orders", "o", 1)
	emit(t, pool, "payments", "p", 1)
	// B's loop must still wait with its offer when A's ack batch runs, or
	// the batch borrows nothing and the test shows nothing (an idle poll,
	// backing off from 2 ms, turned it in between under load, and a batch
	// that kept B's credit went unseen): no polls, no reconcile ticks. B
	// claims payments/q when the round that finds it wakes it.
	r := quietReplica(t, url, func(c *server.Config) { c.NoDispatch = true })
	offeredAll := make(chan struct{}, 1)
	r.Server.SetAfterOffer(func(_ uuid.UUID, offered int) {
		if offered == 2 { // only B offers 2
			select {
			case offeredAll <- struct{}{}:
			default:
			}
		}
	})
	b := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 2, MaxInFlightPerAggregate: 2,
		Streams: []string{"payments"}, LeaseTtl: durationpb.New(time.Hour)})
	ackPublished(t, r, recv(t, b))
	a := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 1, Streams: []string{"orders"},
		LeaseTtl: durationpb.New(time.Hour)})
	d := recv(t, a)
	select {
	case <-offeredAll:
	case <-time.After(30 * time.Second):
		t.Fatal("session B did not offer its credit within 30s")
	}
	ackPublished(t, r, d)
	next := emit(t, pool, "payments", "q", 1)[0]
	if got := recv(t, b); got.GetEvent().GetEventId() != next.String() {
		t.Fatalf("B got %s, want payments/q %s", got.GetEvent().GetEventId(), next)
	}
}

// A lease an ack hands over counts against the session's credit from the
// moment the ack settles, before the loop has taken it in: a loop that is
// between applying what was freed and claiming when the hand-over lands
// claims nothing more, or its relay would hold more than max_in_flight.
// The loop is turned (by a reconcile tick) and held right after it applied
// its (empty) freed list; the ack of a/1, handing a/2 over, commits then.
// (No dispatch: only the loop's claim could lease b/1.)
func TestHandOverCountsAgainstCreditBeforeTheLoopTakesIt(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	ids := emit(t, pool, "orders", "a", 2)
	emit(t, pool, "orders", "b", 1)
	r := startReplica(t, url, func(c *server.Config) { c.NoDispatch = true })
	ticks := make(chan time.Time)
	r.Server.SetReconcileTick(ticks)
	var holdNext atomic.Bool
	held, release := make(chan struct{}), make(chan struct{})
	r.Server.SetFreedApplied(func(int, int64) {
		if holdNext.CompareAndSwap(true, false) {
			close(held)
			<-release
		}
	})
	defer func() {
		select {
		case <-release:
		default:
			close(release)
		}
	}()
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 1, Streams: []string{"orders"},
		LeaseTtl: durationpb.New(time.Hour)})
	d1 := recv(t, st)
	if d1.GetEvent().GetEventId() != ids[0].String() {
		t.Fatalf("got %s, want a/1", d1.GetEvent().GetEventId())
	}
	// The tick turns the loop, unless another wake-up of its own (the
	// listener's first connect asks every session to reconcile) turns it
	// first: either way it is held right after applying its freed list,
	// before the ack below settles.
	holdNext.Store(true)
	go func() {
		select {
		case ticks <- time.Now():
		case <-ctx.Done():
		}
	}()
	waitClosed(t, held, "the session's loop did not turn on the tick")
	ackPublished(t, r, d1)
	if n := r.Server.HandOvers(); n != 1 {
		t.Fatalf("%d hand-overs, want 1 (a/2)", n)
	}
	close(release)
	if d := recv(t, st); d.GetEvent().GetEventId() != ids[1].String() {
		t.Fatalf("after the hand-over of a/2 the relay got %s/%d, want a/2 (max_in_flight is 1)",
			d.GetEvent().GetAggregateKey(), d.GetEvent().GetRevision())
	}
}

// Hot aggregates under racing producers, discovery, claims, hand-overs and
// acks: two replicas, two relays on each, producers emitting while they
// run. Every event reaches the sink exactly once, in revision order, and
// hand-overs did happen.
func TestHotAggregatesRacingTwoReplicas(t *testing.T) {
	t.Parallel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	const aggregates, perProducer, producers = 3, 100, 2
	emit(t, pool, "orders", "seed", 1) // so that the stream exists
	reps := []*replica{startReplica(t, url, nil), startReplica(t, url, nil)}
	sink := newOrderSink()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var wg sync.WaitGroup
	for i := range 4 {
		runner, err := relay.NewRunner(relay.Config{
			Conn: reps[i%2].Conn, Publisher: sink, RelayID: fmt.Sprintf("r%d", i), MaxInFlight: 4,
		})
		if err != nil {
			t.Fatal(err)
		}
		wg.Add(1)
		go func() { defer wg.Done(); _ = runner.Run(ctx) }()
	}
	var pwg sync.WaitGroup
	for p := range producers {
		pwg.Add(1)
		go func() {
			defer pwg.Done()
			for i := range perProducer {
				emit(t, pool, "orders", fmt.Sprintf("hot-%d", (i+p)%aggregates), 1)
			}
		}()
	}
	pwg.Wait()
	sink.waitFor(t, 1+producers*perProducer)
	waitPending(t, pool, 0)
	cancel()
	wg.Wait()
	if sink.reordered > 0 {
		t.Fatalf("%d first deliveries out of revision order", sink.reordered)
	}
	// No lease expires within the test (30s TTL) and no stream ends before
	// the last event is delivered, so a duplicate could only come from two
	// leases on one event at once.
	if sink.duplicates > 0 {
		t.Fatalf("%d duplicate deliveries: an event was leased twice", sink.duplicates)
	}
	if reps[0].Server.HandOvers()+reps[1].Server.HandOvers() == 0 {
		t.Fatal("no hand-over happened")
	}
	t.Logf("duplicates %d, hand-overs %d + %d", sink.duplicates, reps[0].Server.HandOvers(), reps[1].Server.HandOvers())
}

// A hand-over alone does not make the session claim: it replaced the lease
// the ack ended. A stream with spare credit on one hot aggregate runs its K
// events with a handful of claims (the first, and the idle polls, which
// back off from 2 ms), not one empty claim per event.
func TestHandOverCostsNoClaim(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	const k = 100
	emit(t, pool, "orders", "hot", k)
	var claims atomic.Int64
	r := startReplica(t, url, func(c *server.Config) {
		c.PollInterval = time.Hour
		c.ReconcileInterval = time.Hour
	})
	r.Server.SetAfterClaim(func(ls []store.Lease, err error) ([]store.Lease, error) {
		claims.Add(1)
		return ls, err
	})
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 10})
	for i := range k {
		d := recv(t, st)
		if d.GetEvent().GetRevision() != int64(i+1) {
			t.Fatalf("revision %d, want %d", d.GetEvent().GetRevision(), i+1)
		}
		ack(t, r, d)
	}
	if n := r.Server.HandOvers(); n != k-1 {
		t.Fatalf("%d hand-overs, want %d", n, k-1)
	}
	if n := claims.Load(); n >= k/4 {
		t.Fatalf("%d claims for %d handed-over events: hand-overs make the session claim", n, k)
	}
	t.Logf("%d claims", claims.Load())
}

// A hand-over starts the next event afresh: the failures, last error and
// attempts of the event before it (nacked, then redelivered and acked) do
// not carry over.
func TestHandOverResetsFailures(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	emit(t, pool, "orders", "hot", 2)
	r := startReplica(t, url, func(c *server.Config) {
		c.BackoffBase, c.BackoffCap = time.Millisecond, time.Millisecond
	})
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 1})
	d := recv(t, st)
	if _, err := r.Relay.Nack(ctx, &outboxv1.NackRequest{EventId: d.GetEvent().GetEventId(), LeaseToken: d.GetLeaseToken(), Error: "broker down"}); err != nil {
		t.Fatal(err)
	}
	d = recv(t, st)
	if d.GetEvent().GetRevision() != 1 || d.GetAttempt() != 2 {
		t.Fatalf("after the nack: revision %d attempt %d", d.GetEvent().GetRevision(), d.GetAttempt())
	}
	ack(t, r, d)
	d = recv(t, st)
	if d.GetEvent().GetRevision() != 2 || d.GetAttempt() != 1 {
		t.Fatalf("handed over: revision %d attempt %d, want 2 and 1", d.GetEvent().GetRevision(), d.GetAttempt())
	}
	var state string
	var failures, unanswered int
	var lastError *string
	if err := pool.QueryRow(ctx, `SELECT state, failures, unanswered, last_error FROM outbox.delivery WHERE aggregate_key = 'hot'`).
		Scan(&state, &failures, &unanswered, &lastError); err != nil {
		t.Fatal(err)
	}
	if state != "leased" || failures != 0 || unanswered != 0 || lastError != nil {
		t.Fatalf("handed-over lease: state %s failures %d unanswered %d last_error %v", state, failures, unanswered, lastError)
	}
	if n := r.Server.HandOvers(); n != 1 {
		t.Fatalf("%d hand-overs, want 1", n)
	}
	ack(t, r, d)
}

// Hand-over never jumps the queue: an aggregate whose next event is younger
// than work already claimable elsewhere goes back to ready, and the claim
// takes the oldest. With credit 1 and a hot aggregate's backlog, an older
// event of another aggregate would otherwise wait for the whole backlog (or
// forever, if the hot aggregate kept growing).
func TestHandOverYieldsToOlderWork(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	emit(t, pool, "orders", "hot", 1)
	emit(t, pool, "orders", "cold", 1) // older than the hot aggregate's revisions 2..k
	const k = 10
	emit(t, pool, "orders", "hot", k-1)
	r := startReplica(t, url, nil)
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 1})
	var order []string
	for range k + 1 {
		d := recv(t, st)
		order = append(order, fmt.Sprintf("%s/%d", d.GetEvent().GetAggregateKey(), d.GetEvent().GetRevision()))
		ackPublished(t, r, d)
	}
	if order[0] != "hot/1" || order[1] != "cold/1" {
		t.Fatalf("delivery order %v: the older cold/1 must come right after hot/1, before hot/2", order)
	}
	// The rest of the backlog, with nothing older waiting, is handed over.
	if n := r.Server.HandOvers(); n != k-2 {
		t.Fatalf("%d hand-overs, want %d (hot/3..hot/%d)", n, k-2, k)
	}
	waitPending(t, pool, 0)
}

// An ack batch whose statement committed but whose answer was lost (or
// half of a split batch) may have handed leases to sessions that never hear
// of them. Those sessions sweep their unknown leases, so the aggregate's
// next event is delivered again at once instead of after its lease TTL
// (an hour here: the test would hang).
func TestLostAckAnswerDoesNotStrandHandedLease(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	ids := emit(t, pool, "orders", "hot", 3)
	r := startReplica(t, url, func(c *server.Config) { c.ReconcileInterval = 50 * time.Millisecond })
	var lost atomic.Bool
	r.Server.SetAfterAck(func(res []store.AckResult, err error) ([]store.AckResult, error) {
		if err == nil && lost.CompareAndSwap(false, true) {
			for _, x := range res {
				if x.HandOver == nil {
					t.Errorf("the first ack handed nothing over: %+v", x)
				}
			}
			return nil, fmt.Errorf("answer lost after commit (test)")
		}
		return res, err
	})
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 1, LeaseTtl: durationpb.New(time.Hour)})
	d := recv(t, st)
	if d.GetEvent().GetEventId() != ids[0].String() {
		t.Fatalf("first delivery %s, want revision 1", d.GetEvent().GetEventId())
	}
	if _, err := r.Relay.Ack(ctx, &outboxv1.AckRequest{Acks: []*outboxv1.AckItem{{EventId: d.GetEvent().GetEventId(), LeaseToken: d.GetLeaseToken()}}}); err == nil {
		t.Fatal("the ack whose answer was lost succeeded")
	}
	// The relay retries its ack: the first commit stands.
	if res := ack(t, r, d); res[0].GetStatus() != outboxv1.AckStatus_ACK_STATUS_ALREADY_PUBLISHED {
		t.Fatalf("retried ack: %v", res[0])
	}
	for _, want := range ids[1:] {
		d := recv(t, st)
		if d.GetEvent().GetEventId() != want.String() {
			t.Fatalf("got %s revision %d, want %s", d.GetEvent().GetEventId(), d.GetEvent().GetRevision(), want)
		}
		ackPublished(t, r, d)
	}
	waitPending(t, pool, 0)
}

// A session with credit to spare takes a hand-over although older work of
// its streams became claimable meanwhile: its claims take that work with
// the spare credit (the hand-over holds nothing the older work needs), so
// the ack need not probe the claim index, which a hot aggregate paid for on
// every event. The older work still reaches the session, by its claim. (A
// session without credit to spare yields: TestHandOverYieldsToOlderWork.)
func TestHandOverWithSpareCreditGoesAhead(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	r, pool, endOther := coldHeldElsewhere(t, ctx)
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{RelayId: "spare", MaxInFlight: 3})
	hot1 := recvHot1(t, st)

	// From here the session's claims wait, so that cold/1, released by
	// the first relay's end, is claimable and unclaimed when hot/1's ack
	// decides.
	release := make(chan struct{})
	claiming := make(chan struct{}, 16)
	r.Server.SetBeforeLease(func(path string) {
		if path == "claim" {
			claiming <- struct{}{}
			<-release
		}
	}, nil)
	var releaseOnce sync.Once
	defer releaseOnce.Do(func() { close(release) })
	endOther()
	waitState(t, pool, "cold", "ready") // released and claimable
	<-claiming                          // the release woke the session: its claim waits

	before := r.Server.HandOvers()
	ackPublished(t, r, hot1)
	if n := r.Server.HandOvers() - before; n != 1 {
		t.Fatalf("hot/1's ack handed over %d events, want hot/2: the session has credit to spare for the older cold/1", n)
	}
	releaseOnce.Do(func() { close(release) })
	got := map[string]bool{}
	for range 2 {
		d := recv(t, st)
		got[fmt.Sprintf("%s/%d", d.GetEvent().GetAggregateKey(), d.GetEvent().GetRevision())] = true
		ackPublished(t, r, d)
	}
	if !got["cold/1"] || !got["hot/2"] {
		t.Fatalf("after the hand-over the session got %v, want cold/1 (by its claim) and hot/2", got)
	}
	waitPending(t, pool, 0)
}

// Credit a discovery round has borrowed is not spare: while a session's
// free credit is lent, a hand-over to it yields to older claimable work as
// one to a session without credit does, since the older work has no credit
// of the session's to be claimed with until the round gives it back (and
// the round may spend it on newer work).
func TestHandOverYieldsWhileSpareCreditIsLent(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	r, pool, endOther := coldHeldElsewhere(t, ctx)
	// The session holds hot/1 and offers its second unit while it waits;
	// the offer is kept standing (its loop held after offering), so that
	// no poll withdraws it before a round borrows it.
	offered := make(chan struct{}, 1)
	unhold := make(chan struct{})
	var holdOnce, unholdOnce sync.Once
	defer unholdOnce.Do(func() { close(unhold) })
	var sessionID atomic.Value
	r.Server.SetAfterOffer(func(session uuid.UUID, n int) {
		if id, _ := sessionID.Load().(uuid.UUID); id != session || n != 1 {
			return
		}
		holdOnce.Do(func() {
			offered <- struct{}{}
			<-unhold
		})
	})
	turns := watchDiscoveryTurns(r)
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{RelayId: "lends", MaxInFlight: 2})
	hdr, err := st.Header()
	if err != nil {
		t.Fatal(err)
	}
	sessionID.Store(uuid.MustParse(hdr.Get(server.SessionIDHeader)[0]))
	hot1 := recvHot1(t, st)
	awaitSignal(t, "the session to offer its free unit", offered)
	// A discovery turn that began before the offer, without it, must not be
	// the one to find new/1: it would make new/1 ready rather than
	// dispatch it on the offer. So new/1 comes after the loop's turn under
	// way has ended; the next round borrows the offer.
	turns.next(t)

	// A round borrows it, and is held before its statement.
	release := make(chan struct{})
	held := make(chan struct{}, 1)
	var roundOnce sync.Once
	r.Server.SetBeforeRound(func() {
		roundOnce.Do(func() {
			held <- struct{}{}
			<-release
		})
	})
	var releaseOnce sync.Once
	defer releaseOnce.Do(func() { close(release) })
	emit(t, pool, "orders", "new", 1)
	awaitSignal(t, "a round to borrow the session's credit", held)

	endOther()
	waitState(t, pool, "cold", "ready") // older than hot/2, and claimable
	before := r.Server.HandOvers()
	ackPublished(t, r, hot1)
	if n := r.Server.HandOvers() - before; n != 0 {
		t.Fatalf("hot/1's ack handed over %d events while the session's free credit was lent: it must yield to the older cold/1", n)
	}
	releaseOnce.Do(func() { close(release) })
	unholdOnce.Do(func() { close(unhold) })
	for range 3 { // cold/1, hot/2, new/1, in whatever order
		ackPublished(t, r, recv(t, st))
	}
	waitPending(t, pool, 0)
}

// coldHeldElsewhere starts a replica over cold/1 and then hot/1 and hot/2
// of stream orders, and has another relay take cold/1, the oldest, and
// hold it until endOther ends it (cold/1 is then claimable again, older
// than every hot event). The test's context ends that relay too.
func coldHeldElsewhere(t *testing.T, ctx context.Context) (r *replica, pool *pgxpool.Pool, endOther context.CancelFunc) {
	t.Helper()
	url := testdb.New(t)
	pool = testdb.NewPoolURL(t, url)
	emit(t, pool, "orders", "cold", 1)
	emit(t, pool, "orders", "hot", 2)
	r = startReplica(t, url, nil)
	otherCtx, endOther := context.WithCancel(ctx)
	if d := recv(t, subscribe(t, otherCtx, r, &outboxv1.SubscribeRequest{RelayId: "other", MaxInFlight: 1})); d.GetEvent().GetAggregateKey() != "cold" {
		endOther()
		t.Fatalf("the first relay got %s, want cold/1", d.GetEvent().GetAggregateKey())
	}
	return r, pool, endOther
}

// recvHot1 receives the next delivery of st, which must be hot/1.
func recvHot1(t *testing.T, st outboxv1.RelayService_SubscribeClient) *outboxv1.SubscribeResponse {
	t.Helper()
	d := recv(t, st)
	if k, rev := d.GetEvent().GetAggregateKey(), d.GetEvent().GetRevision(); k != "hot" || rev != 1 {
		t.Fatalf("the second relay got %s/%d, want hot/1", k, rev)
	}
	return d
}

// awaitSignal waits for one signal on c, failing the test after a generous
// bound (a hang guard, not a timing assertion).
func awaitSignal(t *testing.T, what string, c <-chan struct{}) {
	t.Helper()
	select {
	case <-c:
	case <-time.After(30 * time.Second):
		t.Fatalf("no signal within 30s: %s", what)
	}
}
