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
	"google.golang.org/protobuf/types/known/durationpb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/store"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/server"
)

// With max_in_flight_per_aggregate above 1 the server sends consecutive
// revisions of an aggregate under one lease, in revision order, never more
// than max_in_flight in all; acks slide the window forward (and, with
// credit to spare, grow it to its limit) under the same epoch; a nack of
// the window's head ends it all and frees its credit, and the aggregate
// comes again from the nacked revision under a higher epoch.
func TestWindowedSession(t *testing.T) {
	t.Parallel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	const reconcile = 10 * time.Millisecond
	r := startReplica(t, url, func(c *server.Config) {
		c.ReconcileInterval = reconcile
		// Long enough that the nack has freed its credit before the
		// aggregate is claimable again, so that the new window is whole.
		c.BackoffBase, c.BackoffCap = time.Second, 2*time.Second
	})
	emit(t, pool, "orders", "a", 20)
	emit(t, pool, "orders", "b", 3)
	// Both found before the relay subscribes, so that its first claim
	// leases whole windows (a discovery round dispatches one event).
	waitDiscovered(t, pool, 2)
	gate := newOfferGate(false)
	r.Server.SetAfterOffer(gate.hook)
	claimed := make(chan struct{}, 1)
	r.Server.SetAfterClaim(func(l []store.Lease, err error) ([]store.Lease, error) {
		select {
		case claimed <- struct{}{}:
		default:
		}
		return l, err
	})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 6, MaxInFlightPerAggregate: 4})
	got, next := receive(t, st)
	// nothingMore checks that nothing beyond the held deliveries was sent
	// or is on its way: the session counts a lease before it sends it, so
	// its count equals what the test holds. With credit to spare, it first
	// waits for a claim that began after this point (the second to end
	// from now; the reconcile tick makes the session claim), so the count
	// includes whatever that claim found.
	nothingMore := func(when string, held int, spare bool) {
		t.Helper()
		if spare {
			select {
			case <-claimed: // one that may have begun before
			default:
			}
			for range 2 {
				select {
				case <-claimed:
				case <-time.After(30 * time.Second):
					t.Fatalf("%s: the session did not claim within 30s", when)
				}
			}
		}
		if n := r.Server.InFlight(); n != int64(held) {
			t.Fatalf("%s: the session counts %d leases in flight, the relay holds %d", when, n, held)
		}
		select {
		case d := <-got:
			t.Fatalf("%s: extra delivery %s/%d beyond the credit", when, d.GetEvent().GetAggregateKey(), d.GetEvent().GetRevision())
		default:
		}
	}
	held := map[string][]*outboxv1.SubscribeResponse{}
	take := func(n int) {
		t.Helper()
		for range n {
			d := next()
			k := d.GetEvent().GetAggregateKey()
			if prev := held[k]; len(prev) > 0 {
				last := prev[len(prev)-1]
				if d.GetEvent().GetRevision() != last.GetEvent().GetRevision()+1 {
					t.Fatalf("%s: revision %d after %d", k, d.GetEvent().GetRevision(), last.GetEvent().GetRevision())
				}
			}
			held[k] = append(held[k], d)
		}
	}
	revs := func(k string) string {
		var s []int64
		for _, d := range held[k] {
			s = append(s, d.GetEvent().GetRevision())
		}
		return fmt.Sprint(s)
	}
	// Credit 6 over two aggregates: each one's next, then each one's
	// second, then each one's third.
	take(6)
	nothingMore("before any ack", 6, false)
	if revs("a") != "[1 2 3]" || revs("b") != "[1 2 3]" {
		t.Fatalf("first deliveries a %s b %s, want [1 2 3] each", revs("a"), revs("b"))
	}
	epoch := held["a"][0].GetLeaseEpoch()
	for _, d := range held["a"] {
		if d.GetLeaseEpoch() != epoch || epoch == 0 {
			t.Fatalf("a's window under epochs %d and %d", epoch, d.GetLeaseEpoch())
		}
	}
	// Acking a1 and a2 slides a's window: a4 and a5, same epoch.
	ack(t, r, held["a"][0], held["a"][1])
	take(2)
	nothingMore("after two acks", 6, false)
	if revs("a") != "[1 2 3 4 5]" {
		t.Fatalf("a after acking 1-2: %s", revs("a"))
	}
	// b done: its three units are free, and once the session offers them
	// (held there, so that the offer stands) a's window may grow to its
	// limit of 4: 3, 4, 5 and then 6, 7 after acking 3.
	gate.armFrom(3) // not an offer made before b's acks landed
	ack(t, r, held["b"]...)
	gate.waitHeld(t)
	ack(t, r, held["a"][2])
	gate.release(false)
	take(2)
	if revs("a") != "[1 2 3 4 5 6 7]" {
		t.Fatalf("a after acking 3 with credit to spare: %s", revs("a"))
	}
	for _, d := range held["a"] {
		if d.GetLeaseEpoch() != epoch {
			t.Fatalf("the window moved to epoch %d (was %d)", d.GetLeaseEpoch(), epoch)
		}
	}
	// Nacking a4, now the head: the window (4-7) ends; a comes again from
	// 4, under a higher epoch.
	a4 := held["a"][3]
	if _, err := r.Relay.Nack(ctx, &outboxv1.NackRequest{EventId: a4.GetEvent().GetEventId(), LeaseToken: a4.GetLeaseToken(), Error: "broker down"}); err != nil {
		t.Fatal(err)
	}
	again := next()
	if again.GetEvent().GetRevision() != 4 || again.GetLeaseEpoch() <= epoch {
		t.Fatalf("after the nack: revision %d at epoch %d, want 4 above %d", again.GetEvent().GetRevision(), again.GetLeaseEpoch(), epoch)
	}
	// Its credit came back whole: a new window of up to 4 (4-7).
	held["a"] = []*outboxv1.SubscribeResponse{again}
	take(3)
	if revs("a") != "[4 5 6 7]" {
		t.Fatalf("a's new window %s, want [4 5 6 7]", revs("a"))
	}
	nothingMore("after the new window", 4, true)
	// An ack out of revision order changes nothing.
	res := ack(t, r, held["a"][1])
	if res[0].GetStatus() != outboxv1.AckStatus_ACK_STATUS_LEASE_LOST || publishedAt(t, pool, held["a"][1].GetEvent().GetEventId()) != nil {
		t.Fatalf("ack of 5 before 4: %v", res[0])
	}
}

// waitDiscovered waits (bounded) until n aggregates have delivery rows and
// every event has been discovered.
func waitDiscovered(t *testing.T, pool *pgxpool.Pool, n int) {
	t.Helper()
	eventually(t, func() (bool, string) {
		// Every event, not only every aggregate: a round that finds an
		// aggregate's later events locks its row, and a claim meanwhile
		// skips it (this made TestWindowedSession's first claim lease one
		// aggregate's window alone, once).
		var got int
		var pending bool
		if err := pool.QueryRow(context.Background(), `SELECT (SELECT count(*) FROM outbox.delivery),
			EXISTS (SELECT 1 FROM outbox.events_since((SELECT snapshot FROM outbox.discovery)))`).Scan(&got, &pending); err != nil {
			t.Fatal(err)
		}
		return got == n && !pending, fmt.Sprintf("%d of %d aggregates discovered", got, n)
	})
}

// One claim leases at most four times ClaimBatch events, however large
// the credit and the window: a statement never carries a whole
// max_in_flight of payloads.
func TestWindowedClaimIsBounded(t *testing.T) {
	t.Parallel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, func(c *server.Config) { c.ClaimBatch = 2 })
	var largest atomic.Int64
	r.Server.SetAfterClaim(func(ls []store.Lease, err error) ([]store.Lease, error) {
		if n := int64(len(ls)); n > largest.Load() {
			largest.Store(n)
		}
		return ls, err
	})
	emit(t, pool, "orders", "a", 20)
	emit(t, pool, "orders", "b", 20)
	waitDiscovered(t, pool, 2)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 32, MaxInFlightPerAggregate: 16})
	_, next := receive(t, st)
	for range 8 {
		next()
	}
	if n := largest.Load(); n != 8 {
		t.Fatalf("largest claim leased %d events, want 8 (4 x ClaimBatch 2)", n)
	}
}

// Ack batches run on several committers at once, but the acks of one
// window are applied in the order they arrived: the relay acks each
// revision of a window in its own call, one after another, while every
// committer is held, and once they run every ack is applied (none is
// refused as out of order, as it would be if a later revision's ack were
// applied in a batch of its own before an earlier one).
func TestWindowAcksKeepOrderAcrossCommitters(t *testing.T) {
	t.Parallel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	const n = 24
	r := startReplica(t, url, func(c *server.Config) { c.AckCommitters = 4 })
	held := make(chan struct{})
	var releaseOnce sync.Once
	release := func() { releaseOnce.Do(func() { close(held) }) }
	t.Cleanup(release) // before the replica stops, should the test fail while holding it
	r.Server.SetBeforeAckBatch(func() { <-held })
	queued := make(chan struct{}, n)
	r.Server.SetAfterAckQueued(func() { queued <- struct{}{} })
	emit(t, pool, "orders", "a", n)
	waitDiscovered(t, pool, 1)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: n, MaxInFlightPerAggregate: n})
	_, next := receive(t, st)
	ds := make([]*outboxv1.SubscribeResponse, n)
	for i := range ds {
		ds[i] = next()
		if got := ds[i].GetEvent().GetRevision(); got != int64(i+1) {
			t.Fatalf("delivery %d is revision %d", i, got)
		}
		if ds[i].GetLeaseEpoch() != ds[0].GetLeaseEpoch() {
			t.Fatalf("revision %d came under epoch %d, not the window's %d", i+1, ds[i].GetLeaseEpoch(), ds[0].GetLeaseEpoch())
		}
	}
	type answer struct {
		res *outboxv1.AckResponse
		err error
	}
	answers := make(chan answer, n)
	for _, d := range ds {
		go func() {
			res, err := r.Relay.Ack(ctx, &outboxv1.AckRequest{Acks: []*outboxv1.AckItem{
				{EventId: d.GetEvent().GetEventId(), LeaseToken: d.GetLeaseToken()}}})
			answers <- answer{res, err}
		}()
		// This ack waits in its committer's queue before the next is sent.
		select {
		case <-queued:
		case a := <-answers:
			t.Fatalf("an Ack was answered before it was queued: %v", a.err)
		}
	}
	release()
	for range n {
		a := <-answers
		if a.err != nil {
			t.Fatal(a.err)
		}
		for _, res := range a.res.GetResults() {
			if res.GetStatus() != outboxv1.AckStatus_ACK_STATUS_PUBLISHED {
				t.Errorf("ack of %s: %v %s", res.GetEventId(), res.GetStatus(), res.GetMessage())
			}
		}
	}
}

// The leases one claim makes share an epoch, but their acks still spread
// over the committers: one Ack call acking many aggregates at once has
// batches in two committers at the same moment.
func TestAcksOfOneClaimSpreadOverCommitters(t *testing.T) {
	t.Parallel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	const aggregates = 40
	r := startReplica(t, url, func(c *server.Config) { c.AckCommitters = 2 })
	entered := make(chan struct{}, aggregates)
	held := make(chan struct{})
	var releaseOnce sync.Once
	release := func() { releaseOnce.Do(func() { close(held) }) }
	t.Cleanup(release) // before the replica stops, should the test fail while holding it
	r.Server.SetBeforeAckBatch(func() {
		entered <- struct{}{}
		<-held
	})
	for i := range aggregates {
		emit(t, pool, "orders", fmt.Sprintf("a%d", i), 1)
	}
	// All found before the relay subscribes, so that one claim leases them
	// all (under one epoch).
	waitDiscovered(t, pool, aggregates)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: aggregates})
	_, next := receive(t, st)
	ds := make([]*outboxv1.SubscribeResponse, aggregates)
	epochs := map[int64]bool{}
	for i := range ds {
		ds[i] = next()
		epochs[ds[i].GetLeaseEpoch()] = true
	}
	if len(epochs) != 1 {
		// All were discovered before the relay subscribed, so its first
		// claim leases them all; anything else voids what follows.
		t.Fatalf("the claim's leases came under %d epochs; the test needs them to share one", len(epochs))
	}
	done := make(chan []*outboxv1.AckResult, 1)
	go func() {
		req := &outboxv1.AckRequest{}
		for _, d := range ds {
			req.Acks = append(req.Acks, &outboxv1.AckItem{EventId: d.GetEvent().GetEventId(), LeaseToken: d.GetLeaseToken()})
		}
		res, err := r.Relay.Ack(ctx, req)
		if err != nil {
			t.Error(err)
		}
		done <- res.GetResults()
	}()
	for i := range 2 {
		select {
		case <-entered:
		case <-time.After(30 * time.Second):
			t.Fatalf("%d ack batch(es) began; want 2 at once, one per committer", i)
		}
	}
	release()
	for _, res := range <-done {
		if res.GetStatus() != outboxv1.AckStatus_ACK_STATUS_PUBLISHED {
			t.Errorf("ack of %s: %v %s", res.GetEventId(), res.GetStatus(), res.GetMessage())
		}
	}
}

// A nack ends its whole lease, window and all: an event of the window that
// an ack slid onto and handed to the session, which the session has not
// sent yet when the nack lands, is not sent at all (it would reach the
// broker before the nacked revision's redelivery). The session's loop is
// held at its offer while the ack of revision 1 slides the window onto 3
// and the nack of 2 ends the lease; then let go.
func TestNackDropsTheWindowsUnsentHandOver(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	ids := emit(t, pool, "orders", "a", 4)
	// Claimed, not dispatched: a round leases one revision, a claim the window.
	r := startReplica(t, url, func(c *server.Config) { c.NoDispatch = true })
	// Held once it has sent revisions 1 and 2 and has no credit left.
	gate := newOfferGate(true)
	defer gate.release(false) // a held loop would keep the replica from stopping
	r.Server.SetAfterOffer(func(id uuid.UUID, offered int) {
		if offered == 0 {
			gate.hook(id, offered)
		}
	})
	handedOver := make(chan struct{}, 1)
	r.Server.SetBeforeHandOver(func(res []store.AckResult) {
		for _, a := range res {
			if len(a.HandOver) > 0 {
				select {
				case handedOver <- struct{}{}:
				default:
				}
			}
		}
	})
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 2, MaxInFlightPerAggregate: 2,
		LeaseTtl: durationpb.New(time.Hour)})
	d1, d2 := recv(t, st), recv(t, st)
	if d1.GetEvent().GetEventId() != ids[0].String() || d2.GetEvent().GetEventId() != ids[1].String() {
		t.Fatalf("got %s and %s, want revisions 1 and 2", d1.GetEvent().GetEventId(), d2.GetEvent().GetEventId())
	}
	gate.waitHeld(t)
	ackPublished(t, r, d1)
	select {
	case <-handedOver:
	default:
		t.Fatal("the ack of revision 1 did not slide the window onto revision 3")
	}
	if _, err := r.Relay.Nack(ctx, &outboxv1.NackRequest{EventId: d2.GetEvent().GetEventId(), LeaseToken: d2.GetLeaseToken(),
		Error: "broker said no", RetryAfter: durationpb.New(time.Millisecond)}); err != nil {
		t.Fatalf("nack of revision 2: %v", err)
	}
	gate.release(false)
	d := recv(t, st)
	if d.GetEvent().GetEventId() != ids[1].String() || d.GetAttempt() != 2 {
		t.Fatalf("after the nack of revision 2 got revision %d attempt %d, want revision 2 again (attempt 2)",
			d.GetEvent().GetRevision(), d.GetAttempt())
	}
}

// A nack of a window's head frees the credit of every event the lease
// covered at once, not only the head's: with no reconcile to notice the
// rest are gone, the redelivery must still take the whole window.
func TestNackOfAWindowFreesItsWholeCredit(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	ids := emit(t, pool, "orders", "a", 4)
	// Claimed, not dispatched: a round leases one revision, a claim the window.
	r := startReplica(t, url, func(c *server.Config) { c.NoDispatch = true })
	r.Server.SetReconcileTick(make(chan time.Time)) // never ticks
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 4, MaxInFlightPerAggregate: 4,
		LeaseTtl: durationpb.New(time.Hour)})
	var first []*outboxv1.SubscribeResponse
	for range 4 {
		first = append(first, recv(t, st))
	}
	if _, err := r.Relay.Nack(ctx, &outboxv1.NackRequest{EventId: first[0].GetEvent().GetEventId(),
		LeaseToken: first[0].GetLeaseToken(), Error: "broker said no", RetryAfter: durationpb.New(time.Millisecond)}); err != nil {
		t.Fatalf("nack of the window's head: %v", err)
	}
	for i, id := range ids {
		d := recv(t, st)
		if d.GetEvent().GetEventId() != id.String() || d.GetAttempt() != 2 {
			t.Fatalf("redelivery %d: got revision %d attempt %d, want revision %d attempt 2",
				i+1, d.GetEvent().GetRevision(), d.GetAttempt(), i+1)
		}
	}
}

// Credit an ack batch lent itself from a waiting windowed session and used
// for the window's slide is not offered again: only what the slide left
// unused rejoins the offer, or a discovery round would dispatch past the
// session's max_in_flight. S (max_in_flight 3, window 3) holds a/1 and
// offers 2; the ack of a/1 slides the window onto a/2 and a/3, using one
// unit of the loan; the round that then finds b and c may dispatch one.
func TestAckBatchOffersAgainOnlyTheCreditItsSlideLeftUnused(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	emit(t, pool, "orders", "a", 1)
	r := startReplica(t, url, nil)
	gate := newOfferGate(true)
	defer gate.release(false) // a held loop would keep the replica from stopping
	r.Server.SetAfterOffer(func(id uuid.UUID, offered int) {
		if offered == 2 {
			gate.hook(id, offered)
		}
	})
	turns := watchDiscoveryTurns(r)
	found := make(chan int64, 16)
	dispatched := make(chan int, 16)
	r.Server.SetAfterDiscover(func(d store.Discovery, err error) (store.Discovery, error) {
		if err == nil {
			found <- d.Events
			if len(d.Dispatched) > 0 {
				dispatched <- len(d.Dispatched)
			}
		}
		return d, err
	})
	gives := make(chan struct{}, 16)
	r.Server.SetAfterGive(func(uuid.UUID, int, int, bool) { gives <- struct{}{} })
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 3, MaxInFlightPerAggregate: 3,
		LeaseTtl: durationpb.New(time.Hour)})
	d1 := recv(t, st)
	gate.waitHeld(t)
	for len(gives) > 0 {
		<-gives // rounds before the hold
	}
	// a/2 and a/3, found by rounds before the ack (a is leased: a round
	// leaves it alone; rounds run only when there is something new), which
	// have given the session its credit back before the ack borrows it.
	emit(t, pool, "orders", "a", 2)
	rounds := 0
	for n := int64(0); n < 2; rounds++ {
		select {
		case e := <-found:
			n += e
		case <-time.After(30 * time.Second):
			t.Fatal("no round found a/2 and a/3 within 30s")
		}
	}
	for range rounds {
		select {
		case <-gives:
		case <-time.After(30 * time.Second):
			t.Fatal("a round that found a/2 or a/3 did not give the credit back within 30s")
		}
	}
	// A round that found both runs again at once (and borrows the credit):
	// an idle check after it says no round is under way.
	turns.next(t)
	ackPublished(t, r, d1)
	if n := r.Server.HandOvers(); n != 2 {
		t.Fatalf("%d hand-overs, want 2 (the slide onto a/2 and a/3, with the loan)", n)
	}
	// b and c in one transaction: one round finds both.
	if _, err := pool.Exec(ctx, `SELECT outbox.emit('orders', 'b', 'T', '{}'), outbox.emit('orders', 'c', 'T', '{}')`); err != nil {
		t.Fatal(err)
	}
	select {
	case n := <-dispatched:
		if n != 1 {
			t.Fatalf("the round dispatched %d to a session with 1 unit of credit left", n)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("nothing was dispatched within 30s")
	}
}

// A nack's notice that reaches its session only after the session leased
// the event again (a later lease, a higher epoch) frees nothing: the later
// lease is out with the relay and still counts against max_in_flight, or
// the session would claim past it. The nack's notice is held after the
// nack committed; the session's poll claims the event again once its
// backoff passed (the nack took none of the session's credit back yet, so
// it claims with the credit it had left); then the notice goes through.
func TestALateNackNoticeLeavesTheEventsNextLeaseCounted(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	ids := emit(t, pool, "orders", "a", 1)
	r := startReplica(t, url, func(c *server.Config) { c.NoDispatch = true })
	r.Server.SetReconcileTick(make(chan time.Time)) // never ticks
	notice := newHoldGate(t)
	r.Server.SetBeforeNackNotice(func(uuid.UUID) { notice.hold() })
	outstanding := make(chan int64, 64)
	r.Server.SetFreedApplied(func(applied int, out int64) {
		if applied > 0 {
			outstanding <- out
		}
	})
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 2, LeaseTtl: durationpb.New(time.Hour)})
	first := recv(t, st)
	if first.GetEvent().GetEventId() != ids[0].String() || first.GetAttempt() != 1 {
		t.Fatalf("first delivery: %s attempt %d", first.GetEvent().GetEventId(), first.GetAttempt())
	}
	nacked := make(chan error, 1)
	go func() {
		_, err := r.Relay.Nack(ctx, &outboxv1.NackRequest{EventId: first.GetEvent().GetEventId(),
			LeaseToken: first.GetLeaseToken(), Error: "broker said no", RetryAfter: durationpb.New(time.Millisecond)})
		nacked <- err
	}()
	waitClosed(t, notice.held, "no nack notice was held")
	again := recv(t, st)
	if again.GetEvent().GetEventId() != ids[0].String() || again.GetAttempt() != 2 {
		t.Fatalf("after the nack: %s attempt %d, want the event again, attempt 2",
			again.GetEvent().GetEventId(), again.GetAttempt())
	}
	notice.letGo()
	if err := <-nacked; err != nil {
		t.Fatalf("nack: %v", err)
	}
	select {
	case out := <-outstanding:
		if out != 1 {
			t.Fatalf("once the first lease's nack notice applied, the session counts %d deliveries outstanding, want 1 (the second lease)", out)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the session never applied the nack's notice")
	}
}
