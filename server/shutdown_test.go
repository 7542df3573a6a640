package server_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/store"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/server"
)

// stopAsync runs Stop with the given deadline and reports its result and
// how long it took.
func stopAsync(s *server.Server, deadline time.Duration) <-chan stopResult {
	c := make(chan stopResult, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), deadline)
		defer cancel()
		start := time.Now()
		err := s.Stop(ctx)
		c <- stopResult{err, time.Since(start)}
	}()
	return c
}

type stopResult struct {
	err     error
	elapsed time.Duration
}

// waitStop waits (bounded, a hang guard) for Stop to return.
func waitStop(t *testing.T, c <-chan stopResult, bound time.Duration) stopResult {
	t.Helper()
	select {
	case r := <-c:
		return r
	case <-time.After(bound):
		t.Fatalf("Stop had not returned after %v", bound)
		return stopResult{}
	}
}

// recvEnd receives from st until the stream ends (bounded) and returns the
// deliveries it got and the error that ended it.
func recvEnd(t *testing.T, st outboxv1.RelayService_SubscribeClient) ([]*outboxv1.SubscribeResponse, error) {
	t.Helper()
	type res struct {
		got []*outboxv1.SubscribeResponse
		err error
	}
	c := make(chan res, 1)
	go func() {
		var got []*outboxv1.SubscribeResponse
		for {
			d, err := st.Recv()
			if err != nil {
				c <- res{got, err}
				return
			}
			got = append(got, d)
		}
	}()
	select {
	case r := <-c:
		return r.got, r.err
	case <-time.After(30 * time.Second):
		t.Fatal("stream did not end within 30s")
		return nil, nil
	}
}

// Once Stop has begun no session claims again: an event committed after
// that is not leased to the stream that is draining, although it has spare
// credit; the stream ends as soon as its last delivery is acked, and new
// subscriptions are refused.
func TestStopHandsOutNoNewLease(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	emit(t, pool, "orders", "a", 1)
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{Streams: []string{"orders"}, MaxInFlight: 2})
	a := recv(t, st)

	stopped := stopAsync(r.Server, time.Minute)
	<-r.Server.Stopping()
	// Committed after the stop began; the producer's wake-up reaches the
	// session, which has one credit to spare.
	emit(t, pool, "orders", "b", 1)
	late, err := r.Relay.Subscribe(ctx, &outboxv1.SubscribeRequest{RelayId: "late", Streams: []string{"orders"}, MaxInFlight: 1})
	if err == nil {
		_, err = late.Recv()
	}
	if status.Code(err) != codes.Unavailable {
		t.Errorf("Subscribe during Stop: %v, want Unavailable", err)
	}

	ackPublished(t, r, a)
	got, err := recvEnd(t, st)
	for _, d := range got {
		t.Errorf("delivered after Stop began: %s/%s", d.GetEvent().GetStream(), d.GetEvent().GetAggregateKey())
	}
	if status.Code(err) != codes.Unavailable {
		t.Errorf("stream ended with %v, want Unavailable", err)
	}
	if res := waitStop(t, stopped, 30*time.Second); res.err != nil {
		t.Errorf("Stop: %v", res.err)
	}
	agg, err := r.Admin.GetAggregate(ctx, &outboxv1.GetAggregateRequest{Stream: "orders", AggregateKey: "b"})
	if err != nil {
		t.Fatal(err)
	}
	if agg.GetAggregate().GetState() == outboxv1.AggregateState_AGGREGATE_STATE_LEASED || agg.GetAggregate().GetAttempt() != 0 {
		t.Errorf("event committed after Stop began was claimed: %v", agg.GetAggregate())
	}
}

// Stop keeps a stream that has deliveries out open, its leases held, until
// they are acked (or the deadline passes): ending it at once would release
// leases whose events the relay may be publishing. The session's loop,
// woken by the stop, must still take two reconcile ticks (it selects on
// them only while it lives and has leases), and the aggregate stays leased
// until the ack.
func TestStopKeepsAStreamWithDeliveriesOutUntilTheyAreAcked(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	ticks := make(chan time.Time)
	r.Server.SetReconcileTick(ticks)
	emit(t, pool, "orders", "a", 1)
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{Streams: []string{"orders"}, MaxInFlight: 1})
	a := recv(t, st)

	stopped := stopAsync(r.Server, time.Minute)
	<-r.Server.Stopping()
	for i := range 2 {
		select {
		case ticks <- time.Now():
		case <-time.After(30 * time.Second):
			t.Fatalf("the session's loop took no reconcile tick %d after Stop began: it ended with a delivery out", i+1)
		}
	}
	if n := r.Server.Sessions(); n != 1 {
		t.Fatalf("%d sessions after Stop began, want the one with a delivery out", n)
	}
	agg, err := r.Admin.GetAggregate(ctx, &outboxv1.GetAggregateRequest{Stream: "orders", AggregateKey: "a"})
	if err != nil {
		t.Fatal(err)
	}
	if agg.GetAggregate().GetState() != outboxv1.AggregateState_AGGREGATE_STATE_LEASED {
		t.Fatalf("the delivery out is %v after Stop began, want still leased", agg.GetAggregate().GetState())
	}
	ackPublished(t, r, a)
	if _, err := recvEnd(t, st); status.Code(err) != codes.Unavailable {
		t.Errorf("stream ended with %v, want Unavailable", err)
	}
	if res := waitStop(t, stopped, 30*time.Second); res.err != nil {
		t.Errorf("Stop: %v", res.err)
	}
}

// With nothing in flight, Stop ends an idle relay's stream at once instead
// of waiting out its deadline.
func TestStopWithNothingInFlightReturnsAtOnce(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	r := startReplica(t, url, nil)
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 10})
	if _, err := st.Header(); err != nil { // the session exists
		t.Fatal(err)
	}
	const deadline = time.Minute
	res := waitStop(t, stopAsync(r.Server, deadline), deadline+10*time.Second)
	if res.err != nil {
		t.Errorf("Stop: %v", res.err)
	}
	// Generous for a loaded machine, and far below the deadline the old
	// loop always ran out.
	if res.elapsed > 5*time.Second {
		t.Errorf("Stop with an idle relay took %v (deadline %v)", res.elapsed, deadline)
	}
	if _, err := recvEnd(t, st); status.Code(err) != codes.Unavailable {
		t.Errorf("idle stream ended with %v, want Unavailable", err)
	}
}

// bigBacklog emits n events of about 900 KB, one per aggregate: more than
// HTTP/2 flow control lets a relay that does not read take, so the server's
// Send to it blocks.
func bigBacklog(t *testing.T, pool *pgxpool.Pool, stream string, n int) {
	t.Helper()
	if _, err := pool.Exec(context.Background(), `SELECT outbox.emit($1, 'big-' || a, 'Big', jsonb_build_object('pad', repeat('x', 900000)))
		FROM generate_series(1, $2::int) a`, stream, n); err != nil {
		t.Fatal(err)
	}
}

// countLeased is how many aggregates are leased right now.
func countLeased(t *testing.T, pool *pgxpool.Pool) int32 {
	t.Helper()
	var n int32
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM outbox.delivery WHERE state = 'leased'`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// A relay that stopped reading with its HTTP/2 window full blocks the
// session in Send, where it cannot see an abort. Stop still returns by its
// deadline (plus the short grace), saying a stream is stuck; closing the
// replica's connections then ends that stream and releases its leases.
func TestStopHonoursDeadlineWithStalledRelay(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	const n = 40
	bigBacklog(t, pool, "orders", n)
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: n, LeaseTtl: durationpb.New(time.Hour)})
	if _, err := st.Header(); err != nil {
		t.Fatal(err)
	}
	// Never read: the session leases all n and blocks sending them. Waited
	// for in the session, which counts its leases before sending them: the
	// database shows a discovery round's leases before they reach the
	// session, and a session stopped in between ends at once (it has
	// nothing in flight), with no stalled Send for Stop to time out on.
	waitFor(t, func() int32 {
		if countLeased(t, pool) == n && r.Server.InFlight() == n {
			return 1
		}
		return 0
	})

	const deadline = 2 * time.Second
	res := waitStop(t, stopAsync(r.Server, deadline), 30*time.Second)
	if res.elapsed > deadline+3*time.Second {
		t.Errorf("Stop took %v with a %v deadline", res.elapsed, deadline)
	}
	if res.err == nil {
		t.Error("Stop reported every stream ended, but the stalled one cannot have: the test did not stall Send")
	}
	closed := make(chan struct{})
	go func() { r.Close(); close(closed) }()
	select {
	case <-closed:
	case <-time.After(30 * time.Second):
		t.Fatal("replica shutdown did not end with a stalled relay")
	}
	if held := countLeased(t, pool); held != 0 {
		t.Errorf("%d leases still held (1 h TTL) after the stalled stream was closed", held)
	}
}

// A Subscribe that passed its checks as Stop began, and reaches the point
// of adding its session only after Stop returned, is refused: Stop has
// accounted for every session it let in, and none runs after it.
func TestSubscribeRacingStopIsRefused(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	r := startReplica(t, url, nil)
	reached, stopped := make(chan struct{}), make(chan struct{})
	r.Server.SetBeforeAddSession(func() { close(reached); <-stopped })
	ended := make(chan error, 1)
	go func() {
		st, err := r.Relay.Subscribe(ctx, &outboxv1.SubscribeRequest{RelayId: "late", MaxInFlight: 1})
		if err == nil {
			// An accepted subscription announces its session id.
			if md, _ := st.Header(); len(md.Get(server.SessionIDHeader)) > 0 {
				t.Errorf("session %s accepted after Stop returned", md.Get(server.SessionIDHeader)[0])
			}
			_, err = st.Recv()
		}
		ended <- err
	}()
	<-reached
	if res := waitStop(t, stopAsync(r.Server, 30*time.Second), time.Minute); res.err != nil {
		t.Fatalf("Stop: %v", res.err)
	}
	close(stopped)
	select {
	case err := <-ended:
		if status.Code(err) != codes.Unavailable {
			t.Errorf("Subscribe racing Stop ended with %v, want Unavailable", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Subscribe racing Stop neither refused nor ended")
	}
	relays, err := r.Admin.ListRelays(ctx, &outboxv1.ListRelaysRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if len(relays.GetRelays()) != 0 {
		t.Errorf("a session was added after Stop returned: %v", relays.GetRelays())
	}
}

// Stop does not close stopping while a statement that may lease an event is
// under way: a claim, an ack batch that hands over, or a discovery round
// that dispatches which checked that the server was not stopping before
// Stop began could otherwise lease an event committed after stopping
// closed, and the draining stream would hold it until it is acked or the
// deadline. Each subtest holds its statement after the check, calls Stop,
// commits an event once Stopping is closed, and then lets the statement
// run: the late event must stay unleased.
func TestStopWaitsForALeaseUnderWay(t *testing.T) {
	t.Parallel()
	for _, path := range []string{"claim", "dispatch", "hand-over"} {
		t.Run(path, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			url := testdb.New(t)
			pool := testdb.NewPoolURL(t, url)
			r := startReplica(t, url, func(c *server.Config) {
				// The claim's lease must come from the claim.
				c.NoDispatch = path == "claim"
			})
			// Holds the first statement of the path once armed.
			gate := newHoldGate(t)
			var armed atomic.Bool
			hold := func() {
				if armed.Load() {
					gate.hold()
				}
			}
			stopWaits := make(chan struct{}, 1)
			r.Server.SetBeforeLease(func(p string) {
				if p == path {
					hold()
				}
			}, func() { stopWaits <- struct{}{} })

			// Each path leads one statement to hold: it then leases what
			// was committed before it (the late event, with the bug).
			lateKey := "late"
			var st outboxv1.RelayService_SubscribeClient
			var acked chan error
			switch path {
			case "claim":
				// Claimable once a discovery round has made it ready.
				ready := make(chan struct{}, 1)
				r.Server.SetAfterDiscover(func(d store.Discovery, err error) (store.Discovery, error) {
					if err == nil && d.Events > 0 {
						select {
						case ready <- struct{}{}:
						default:
						}
					}
					return d, err
				})
				emit(t, pool, "orders", "a", 1)
				select {
				case <-ready:
				case <-time.After(30 * time.Second):
					t.Fatal("no discovery round found the event within 30s")
				}
				armed.Store(true)
				st = subscribe(t, ctx, r, &outboxv1.SubscribeRequest{Streams: []string{"orders"}, MaxInFlight: 2})
			case "dispatch":
				// The session's loop is held at its offer: the credit it
				// offers goes to the round, never to a claim of its own.
				offers := newOfferGate(true)
				r.Server.SetAfterOffer(offers.hook)
				turns := watchDiscoveryTurns(r)
				r.Server.SetBeforeRound(hold)
				st = subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 2})
				offers.waitHeld(t)
				defer offers.release(false)
				armed.Store(true)
				// No round that began before the offer (and so borrowed
				// nothing) finds a.
				turns.next(t)
				emit(t, pool, "orders", "a", 1)
				go func() { <-gate.release; offers.release(false) }()
			case "hand-over":
				// The ack of the aggregate's first event hands over its next
				// one, committed late.
				lateKey = "a"
				emit(t, pool, "orders", "a", 1)
				st = subscribe(t, ctx, r, &outboxv1.SubscribeRequest{Streams: []string{"orders"}, MaxInFlight: 1})
				first := recv(t, st)
				armed.Store(true)
				acked = make(chan error, 1)
				go func() {
					_, err := r.Relay.Ack(ctx, &outboxv1.AckRequest{Acks: []*outboxv1.AckItem{{
						EventId: first.GetEvent().GetEventId(), LeaseToken: first.GetLeaseToken()}}})
					acked <- err
				}()
			}
			waitClosed(t, gate.held, "no "+path+" statement reached its lease")

			stopped := stopAsync(r.Server, 10*time.Second)
			select {
			case <-stopWaits:
				if server.IsClosed(r.Server.Stopping()) {
					t.Errorf("Stopping closed while the %s was under way", path)
				}
				gate.letGo()
				<-r.Server.Stopping()
				emit(t, pool, "orders", lateKey, 1)
			case <-r.Server.Stopping():
				t.Errorf("Stop closed Stopping without waiting for the %s under way", path)
				emit(t, pool, "orders", lateKey, 1)
				gate.letGo()
			}

			if acked != nil {
				if err := <-acked; err != nil {
					t.Fatalf("ack: %v", err)
				}
			} else if a := recv(t, st); a.GetEvent().GetAggregateKey() != "a" {
				t.Fatalf("the %s leased %s/%s, want the event committed before it", path,
					a.GetEvent().GetStream(), a.GetEvent().GetAggregateKey())
			} else {
				ackPublished(t, r, a)
			}
			got, err := recvEnd(t, st)
			for _, d := range got {
				t.Errorf("delivered after Stopping closed: %s/%s revision %d", d.GetEvent().GetStream(),
					d.GetEvent().GetAggregateKey(), d.GetEvent().GetRevision())
			}
			if status.Code(err) != codes.Unavailable {
				t.Errorf("stream ended with %v, want Unavailable", err)
			}
			if res := waitStop(t, stopped, 30*time.Second); res.err != nil {
				t.Errorf("Stop: %v", res.err)
			}
			agg, err := r.Admin.GetAggregate(ctx, &outboxv1.GetAggregateRequest{Stream: "orders", AggregateKey: lateKey})
			if err != nil {
				t.Fatal(err)
			}
			if a := agg.GetAggregate(); a.GetState() == outboxv1.AggregateState_AGGREGATE_STATE_LEASED || a.GetAttempt() != 0 {
				t.Errorf("the event committed after Stopping closed was leased: %v", a)
			}
		})
	}
}

// Stop waits for a statement under way that may lease only until its
// deadline: then it closes Stopping anyway and returns (with an error
// naming the session still busy), so that a claim stuck in the database
// cannot hold up a shutdown.
func TestStopKeepsItsDeadlineWhileALeaseIsUnderWay(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	r := startReplica(t, url, nil)
	claim := newHoldGate(t)
	r.Server.SetBeforeLease(func(p string) {
		if p == "claim" {
			claim.hold()
		}
	}, nil)
	subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 1})
	waitClosed(t, claim.held, "the session did not claim")
	res := waitStop(t, stopAsync(r.Server, 200*time.Millisecond), 30*time.Second)
	if !server.IsClosed(r.Server.Stopping()) {
		t.Error("Stop returned with Stopping still open")
	}
	if res.err == nil {
		t.Error("Stop returned no error although a session was still claiming")
	}
}

// An ack is not held up while Stop waits for a claim under way: it is
// applied at once and hands nothing over (the replica is stopping), instead
// of waiting for the claim to return. Relay A holds a1 when relay B's first
// claim is held before its statement and Stop begins to wait for it; A's ack
// of a1 must return while the claim is still held, and a discovery round
// must find c, committed then. The claim, let go, then leases a2, which the
// ack left claimable.
func TestStopWaitingForAClaimDoesNotHoldUpAcks(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	claim := newHoldGate(t)
	var armed atomic.Bool
	stopWaits := make(chan struct{}, 1)
	r.Server.SetBeforeLease(func(p string) {
		if p == "claim" && armed.Load() {
			claim.hold()
		}
	}, func() { stopWaits <- struct{}{} })
	found := make(chan struct{}, 1)
	r.Server.SetAfterDiscover(func(d store.Discovery, err error) (store.Discovery, error) {
		if err == nil && d.Events > 0 && server.IsClosed(claim.held) {
			select {
			case found <- struct{}{}:
			default:
			}
		}
		return d, err
	})

	emit(t, pool, "orders", "a", 2)
	stA := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{RelayId: "A", Streams: []string{"orders"}, MaxInFlight: 1})
	a1 := recv(t, stA)
	armed.Store(true)
	stB := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{RelayId: "B", Streams: []string{"orders"}, MaxInFlight: 1})
	waitClosed(t, claim.held, "relay B's claim did not begin")
	stopped := stopAsync(r.Server, time.Minute)
	select {
	case <-stopWaits:
	case <-time.After(30 * time.Second):
		t.Fatal("Stop did not wait for the claim under way")
	}

	acked := make(chan error, 1)
	go func() {
		res, err := r.Relay.Ack(ctx, &outboxv1.AckRequest{Acks: []*outboxv1.AckItem{{
			EventId: a1.GetEvent().GetEventId(), LeaseToken: a1.GetLeaseToken()}}})
		if err == nil && res.GetResults()[0].GetStatus() != outboxv1.AckStatus_ACK_STATUS_PUBLISHED {
			err = fmt.Errorf("ack of a1: %v", res.GetResults()[0])
		}
		acked <- err
	}()
	select {
	case err := <-acked:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the ack waited for the claim under way")
	}
	if n := r.Server.HandOvers(); n != 0 {
		t.Errorf("%d hand-overs while Stop was beginning, want none", n)
	}
	// Nor is discovery held up: a round makes c ready (for any replica)
	// without dispatching it.
	emit(t, pool, "orders", "c", 1)
	select {
	case <-found:
	case <-time.After(30 * time.Second):
		t.Fatal("no discovery round found c while Stop waited for the claim")
	}

	claim.letGo()
	a2 := recv(t, stB)
	if a2.GetEvent().GetAggregateKey() != "a" || a2.GetEvent().GetRevision() != 2 {
		t.Fatalf("relay B's claim leased %s/%s revision %d, want a2", a2.GetEvent().GetStream(),
			a2.GetEvent().GetAggregateKey(), a2.GetEvent().GetRevision())
	}
	ackPublished(t, r, a2)
	for name, st := range map[string]outboxv1.RelayService_SubscribeClient{"A": stA, "B": stB} {
		got, err := recvEnd(t, st)
		if len(got) > 0 || status.Code(err) != codes.Unavailable {
			t.Errorf("relay %s's stream: %d more deliveries, ended with %v; want none, Unavailable", name, len(got), err)
		}
	}
	if res := waitStop(t, stopped, 30*time.Second); res.err != nil {
		t.Errorf("Stop: %v", res.err)
	}
}

// A discovery round whose statement has returned holds the lease gate until
// its leases are with their sessions: Stop, beginning then, waits for it,
// and the session, given its lease before it sees Stopping, delivers it and
// waits for its ack. Were the gate let go as the statement returned, Stop
// would close Stopping at once, the session (nothing in flight) would end,
// and the round would release the lease it had dispatched: nothing lost,
// but a delivery the relay never saw and the event out again elsewhere.
func TestStopLetsARoundGiveItsLeasesFirst(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	stopWaits := make(chan struct{}, 1)
	r.Server.SetBeforeLease(func(string) {}, func() { stopWaits <- struct{}{} })
	// The session's loop is held at its offer, so that its credit goes to
	// the round; the round that dispatches is held once its statement
	// has returned.
	offers := newOfferGate(true)
	r.Server.SetAfterOffer(offers.hook)
	turns := watchDiscoveryTurns(r)
	round := newHoldGate(t)
	r.Server.SetAfterDiscover(func(d store.Discovery, err error) (store.Discovery, error) {
		if err == nil && len(d.Dispatched) > 0 {
			round.hold()
		}
		return d, err
	})
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 2})
	offers.waitHeld(t)
	turns.next(t) // no round that began before the offer finds the event
	emit(t, pool, "orders", "a", 1)
	waitClosed(t, round.held, "no round dispatched the event")
	// The loop is free to see Stopping from here on.
	offers.release(false)

	type received struct {
		d   *outboxv1.SubscribeResponse
		err error
	}
	stream := make(chan received, 4)
	go func() {
		for {
			d, err := st.Recv()
			stream <- received{d, err}
			if err != nil {
				return
			}
		}
	}()
	stopped := stopAsync(r.Server, 30*time.Second)
	select {
	case <-stopWaits:
		if server.IsClosed(r.Server.Stopping()) {
			t.Error("Stopping closed while the round's leases were on their way")
		}
	case <-r.Server.Stopping():
		t.Error("Stop closed Stopping while a round's leases were on their way to their sessions")
		// Let the session do what it does once Stopping is closed (end,
		// with nothing in flight) before the round gives.
		select {
		case got := <-stream:
			stream <- got
		case <-time.After(10 * time.Second):
		}
	}
	round.letGo()

	next := func() received {
		t.Helper()
		select {
		case got := <-stream:
			return got
		case <-time.After(30 * time.Second):
			t.Fatal("the stream neither delivered nor ended within 30s")
			return received{}
		}
	}
	got := next()
	if got.err != nil {
		t.Fatalf("the stream ended (%v) without the lease the round dispatched to it", got.err)
	}
	if got.d.GetEvent().GetAggregateKey() != "a" || got.d.GetAttempt() != 1 {
		t.Fatalf("delivered %v attempt %d, want orders/a attempt 1", got.d.GetEvent(), got.d.GetAttempt())
	}
	ackPublished(t, r, got.d)
	if end := next(); status.Code(end.err) != codes.Unavailable {
		t.Errorf("after the ack the stream gave %v, %v; want it ended Unavailable", end.d, end.err)
	}
	if res := waitStop(t, stopped, 30*time.Second); res.err != nil {
		t.Errorf("Stop: %v", res.err)
	}
}
