package server_test

import (
	"context"
	"fmt"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/outboxd/outboxd/client"
	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/store"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/server"
)

func undiscovered(t *testing.T, pool *pgxpool.Pool) int64 {
	t.Helper()
	var n int64
	if err := pool.QueryRow(context.Background(),
		`SELECT coalesce(sum(events), 0) FROM outbox.undiscovered(NULL)`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// Once rounds have found more events than their sessions' credit for a
// while (saturation: SetSaturatedAfter(0) makes it so from the first
// round), a round on a replica whose sessions take every stream takes about
// as many events as they offer credit, oldest first, and leaves the rest
// undiscovered rather than making them ready: every event then reaches the
// relay by dispatch, none by a claim. A lone burst beyond the credit, before
// that, is made ready as ever, for the sessions' claims, which take it in
// parallel as acks free credit. Forced: the session is held at its offer of
// 3 and discovery's lock held while ten events commit, each in its own
// transaction, so that one round finds all ten there.
func TestARoundTakesWhatItsSessionsCanTake(t *testing.T) {
	t.Parallel()
	for name, saturated := range map[string]bool{"saturated": true, "burst": false} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			after := serverSaturatedAfter
			if saturated {
				after = 0
			}
			reg := prometheus.NewPedanticRegistry()
			ctx, pool, r, gate, rounds := startCreditReplica(t, true, after, func(c *server.Config) { c.Registerer = reg })
			st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 3, LeaseTtl: durationpb.New(time.Hour)})
			gate.waitHeld(t)
			const n = 10
			ids := burst(ctx, t, pool, "o", n)
			first := rounds.next(t)
			taken, ready := 3, 0
			if !saturated {
				taken, ready = n, n-3
			}
			if first.Events != int64(taken) || len(first.Dispatched) != 3 || first.Aggregates != int64(ready) {
				t.Fatalf("the first round took %d events, dispatched %d and made %d ready; want %d, 3 and %d (the session offered 3)",
					first.Events, len(first.Dispatched), first.Aggregates, taken, ready)
			}
			for i, d := range first.Dispatched {
				if d.Lease.Event.ID != ids[i] {
					t.Fatalf("the first round dispatched %s as lease %d, want %s: the oldest first", d.Lease.Event.ID, i, ids[i])
				}
			}
			if u := undiscovered(t, pool); u != int64(n-taken) {
				t.Fatalf("%d events undiscovered after the first round, want %d", u, n-taken)
			}
			gate.release(false)
			got := map[string]bool{}
			for range n {
				d := recv(t, st)
				got[d.GetEvent().GetEventId()] = true
				ackPublished(t, r, d)
			}
			for _, id := range ids {
				if !got[id.String()] {
					t.Fatalf("event %s never delivered", id)
				}
			}
			claimed := gatherSum(t, reg, "outboxd_claimed_total")
			if saturated && (claimed != 0 || r.Server.Dispatched() != n) {
				t.Fatalf("%v claimed and %d dispatched, want 0 and %d: every event dispatched", claimed, r.Server.Dispatched(), n)
			}
			if !saturated && claimed == 0 {
				t.Fatal("nothing claimed: the burst's ready events went some other way")
			}
		})
	}
}

// A saturated replica (as above) whose sessions take every stream and offer
// no credit runs no round: new events stay undiscovered, not made ready, and the session's
// offer, once an ack frees its credit, brings the round that dispatches
// them.
func TestNoRoundWhileNoSessionOffersCredit(t *testing.T) {
	t.Parallel()
	reg := prometheus.NewPedanticRegistry()
	ctx, pool, r, _, rounds := startCreditReplica(t, false, 0, func(c *server.Config) {
		c.Registerer = reg
		// A round put off waits for the session's offer, not for this.
		c.DiscoveryIdleInterval = time.Hour
	})
	putOff := make(chan struct{}, 64)
	r.Server.SetAfterPutOff(func() {
		select {
		case putOff <- struct{}{}:
		default:
		}
	})
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 1, LeaseTtl: durationpb.New(time.Hour)})
	first := emit(t, pool, "orders", "a", 1)[0]
	d := recv(t, st)
	if d.GetEvent().GetEventId() != first.String() {
		t.Fatalf("got %s, want %s", d.GetEvent().GetEventId(), first)
	}
	// The first event's round (dispatched, or made ready before the
	// session was added and claimed): it may report only now, after its
	// event reached the relay, and is not the round the select below
	// waits for. A put-off before it has been seen by then.
	if found := rounds.next(t); found.Events != 1 || !slices.Equal(foundKeys(found), []string{"a"}) {
		t.Fatalf("the first event's round took %d events of %v, want 1 of [a]", found.Events, foundKeys(found))
	}
	drain(putOff)
	// The first may have been claimed: a round that ran before the session
	// was added made it ready.
	claimed := gatherSum(t, reg, "outboxd_claimed_total")
	// The session's one unit of credit is out: the next event's round is
	// put off, and nothing is made ready.
	second := emit(t, pool, "orders", "b", 1)[0]
	select {
	case <-putOff:
	case found := <-rounds.rounds:
		t.Fatalf("a round ran while the session offered no credit: took %d events, made %d ready", found.Events, found.Aggregates)
	case <-time.After(30 * time.Second):
		t.Fatal("the discovery loop put no round off within 30s")
	}
	if u := undiscovered(t, pool); u != 1 {
		t.Fatalf("%d events undiscovered while no credit was offered, want 1", u)
	}
	ackPublished(t, r, d)
	if d := recv(t, st); d.GetEvent().GetEventId() != second.String() {
		t.Fatalf("got %s, want %s", d.GetEvent().GetEventId(), second)
	} else {
		ackPublished(t, r, d)
	}
	if c := gatherSum(t, reg, "outboxd_claimed_total") - claimed; c != 0 {
		t.Fatalf("outboxd_claimed_total grew by %v, want 0: the second event was dispatched by the round the offer brought", c)
	}
}

// A replica with a session that takes only some streams (named, or all but
// some) does not bound its rounds by credit: bounded, a round would take
// the oldest events first, and another stream's backlog, which no local
// session takes, would keep the session's own events from it. Forced as
// above: the session is held at its offer of 1, and three "billing" events
// commit before one "orders" event while discovery's lock is held.
func TestAFilteredSessionsRoundTakesEverything(t *testing.T) {
	t.Parallel()
	for name, filter := range map[string]*outboxv1.SubscribeRequest{
		"streams": {Streams: []string{"orders"}},
		"exclude": {ExcludeStreams: []string{"billing"}},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			// Saturated from the first round, and still not bounded.
			ctx, pool, r, gate, rounds := startCreditReplica(t, false, 0, nil)
			// A stream is subscribed to once it has events.
			emit(t, pool, "orders", "first", 1)
			filter.MaxInFlight, filter.LeaseTtl = 1, durationpb.New(time.Hour)
			st := subscribe(t, ctx, r, filter)
			d := recv(t, st)
			gate.armFrom(1) // the offer its ack frees, not one made before
			ackPublished(t, r, d)
			gate.waitHeld(t)
			// The first event's round, which may report only after its
			// event, made ready before the session was added, reached the
			// relay by a claim.
			if found := rounds.next(t); found.Events != 1 || !slices.Equal(foundKeys(found), []string{"first"}) {
				t.Fatalf("the first event's round took %d events of %v, want 1 of [first]", found.Events, foundKeys(found))
			}
			release := holdDiscovery(ctx, t, pool)
			for i := range 3 {
				emit(t, pool, "billing", fmt.Sprintf("b%d", i), 1)
			}
			id := emit(t, pool, "orders", "o", 1)[0]
			release()
			found := rounds.next(t)
			if found.Events != 4 || len(found.Dispatched) != 1 || found.Dispatched[0].Lease.Event.ID != id {
				t.Fatalf("the round took %d events and dispatched %v; want all 4 taken and orders/o dispatched", found.Events, found.Dispatched)
			}
			gate.release(false)
			if d := recv(t, st); d.GetEvent().GetEventId() != id.String() {
				t.Fatalf("got %s, want %s", d.GetEvent().GetEventId(), id)
			}
		})
	}
}

// A round that takes everything it found within its sessions' credit ends
// the saturation: the next burst beyond the credit is made ready again, for
// the claims, rather than bounded. Forced with a saturation that sets in at
// once (1ns) and the loop held in its hooks while events commit: a burst
// of 6 against an offer of 4 makes the replica saturated, and the lone
// event committed during that round is the next round's, put off until the
// session offers credit again, so no check comes between that could end
// the saturation on its own. The put-off loop is held until the session,
// every delivery acked, is held at its offer of all 4 units: the lone
// event's round then takes 1 event with 4 units borrowed, well within the
// credit. (Run at the first offer of a unit, as it may be when the loop is
// not held, it would be as short as its bound.) The second burst, committed
// during the lone event's round, is due at the check after it, and its
// round takes all 5; were the saturation not ended by the lone round, that
// round would take no more than the 3 units the session has left.
func TestARoundWithinTheCreditEndsTheSaturation(t *testing.T) {
	t.Parallel()
	ctx, pool, r, gate, _ := startCreditReplica(t, true, time.Nanosecond, nil)
	// The hooks hold the loop only while the test runs: one that failed
	// would otherwise keep the replica from stopping.
	done := make(chan struct{})
	t.Cleanup(func() { close(done) })
	paused, resume := make(chan store.Discovery), make(chan struct{})
	var pauses atomic.Int32
	pauses.Store(2)
	rounds := watchRoundsWith(r, func(d store.Discovery, err error) {
		if err == nil && d.Events > 0 && pauses.Add(-1) >= 0 {
			select {
			case paused <- d:
				<-resume
			case <-done:
			}
		}
	})
	putOff, goOn := make(chan struct{}), make(chan struct{})
	var putOffs atomic.Int32
	r.Server.SetAfterPutOff(func() {
		if putOffs.Add(1) == 1 {
			select {
			case putOff <- struct{}{}:
				select {
				case <-goOn:
				case <-done:
				}
			case <-done:
			}
		}
	})
	// during waits until a round is held in its hook, commits events there
	// and lets it go on; it returns the round.
	during := func(name string, n int) store.Discovery {
		t.Helper()
		var d store.Discovery
		select {
		case d = <-paused:
		case <-time.After(30 * time.Second):
			t.Fatal("no discovery round found events within 30s")
		}
		for i := range n {
			emit(t, pool, "orders", fmt.Sprintf("%s%d", name, i), 1)
		}
		resume <- struct{}{}
		return d
	}
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 4, LeaseTtl: durationpb.New(time.Hour)})
	gate.waitHeld(t) // the session offers all 4 units
	burst(ctx, t, pool, "a", 6)
	if d := during("b", 1); d.Events != 6 || len(d.Dispatched) != 4 {
		t.Fatalf("the first burst's round took %d events and dispatched %d, want 6 and 4 (not saturated yet)", d.Events, len(d.Dispatched))
	}
	select {
	case <-putOff:
	case <-time.After(30 * time.Second):
		t.Fatal("the lone event's round was not put off within 30s")
	}
	// The session goes on, and is held again only at an offer of all its
	// credit, which it makes once every delivery is acked: the 4
	// dispatched, and the two ready aggregates, claimed with the credit
	// the first acks free (their batches see claimable work, and the
	// session claims before it offers).
	gate.armFrom(4)
	gate.release(true)
	for range 6 {
		ackPublished(t, r, recv(t, st))
	}
	gate.waitHeld(t)
	close(goOn)
	if d := during("c", 5); d.Events != 1 || len(d.Dispatched) != 1 {
		t.Fatalf("the lone event's round took %d events and dispatched %d, want 1 and 1", d.Events, len(d.Dispatched))
	}
	rounds.next(t) // the first burst's, seen above
	rounds.next(t) // the lone event's
	if d := rounds.next(t); d.Events != 5 {
		t.Fatalf("the second burst's round took %d events, want all 5: the round within the credit ended the saturation", d.Events)
	}
	gate.release(false)
	for range 6 {
		ackPublished(t, r, recv(t, st))
	}
}

// A discovery check that finds nothing due ends the saturation too:
// everything is discovered, so no shortage of credit is sustained. Without
// it, a replica idle after one short round stayed saturated, and its next
// burst was bounded at once. Forced: the session's one unit of credit is
// out when one more event commits, so that round is short (it found 1
// event, 0 credit offered) and, finding one event, is followed by checks
// rather than rounds; the loop is parked in a check while three events
// commit and the session's ack frees its unit. Saturated, the round after
// would take 1 event; ended, it takes all 3.
//
// Each round is read by what it found, never drained: a round reports
// (SetAfterDiscover) only after it committed, and the first event, made
// ready by a round that ran before the session offered its credit, can
// reach the relay by the session's claim before its round reports. Drained
// then, that round was read as the "short" event's, and the "short"
// event's as the round after the idle check (1 event, not 3).
func TestACheckThatFindsNothingEndsTheSaturation(t *testing.T) {
	t.Parallel()
	ctx, pool, r, gate, rounds := startCreditReplica(t, false, time.Nanosecond, nil)
	idle, parked, unpark := make(chan struct{}, 1), make(chan struct{}, 1), make(chan struct{})
	var parking atomic.Bool
	r.Server.SetAfterRoundDue(func(due bool, err error) {
		// Only a check that answered "nothing due" ends the saturation;
		// a failed one (due false too) runs the round instead.
		if due || err != nil {
			return
		}
		select {
		case idle <- struct{}{}:
		default:
		}
		if parking.Load() {
			select {
			case parked <- struct{}{}:
			default:
			}
			<-unpark
		}
	})
	idleCheck := func() {
		t.Helper()
		drain(idle)
		select {
		case <-idle:
		case <-time.After(30 * time.Second):
			t.Fatal("the discovery loop made no check that found nothing within 30s")
		}
	}
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 1, LeaseTtl: durationpb.New(time.Hour)})
	first := emit(t, pool, "orders", "first", 1)[0]
	held := recv(t, st)
	if held.GetEvent().GetEventId() != first.String() {
		t.Fatalf("got %s, want %s", held.GetEvent().GetEventId(), first)
	}
	// The first event's round, dispatched or made ready and claimed: it may
	// report only now, after its event reached the relay.
	if d := rounds.next(t); d.Events != 1 || !slices.Equal(foundKeys(d), []string{"first"}) {
		t.Fatalf("the first event's round took %d events of %v, want 1 of [first]", d.Events, foundKeys(d))
	}
	// Whatever the first event's round was short of ends here.
	idleCheck()
	emit(t, pool, "orders", "short", 1)
	if d := rounds.next(t); d.Events != 1 || len(d.Dispatched) != 0 || !slices.Equal(foundKeys(d), []string{"short"}) {
		t.Fatalf("the round with the credit out took %d events of %v and dispatched %d, want 1 of [short] and 0",
			d.Events, foundKeys(d), len(d.Dispatched))
	}
	parking.Store(true)
	select {
	case <-parked:
	case <-time.After(30 * time.Second):
		t.Fatal("the discovery loop made no check that found nothing within 30s")
	}
	gate.armFrom(1)
	ackPublished(t, r, held)
	ackPublished(t, r, recv(t, st)) // "short", claimed with the unit the ack freed
	gate.waitHeld(t)                // the unit offered again, and held there
	for i := range 3 {
		emit(t, pool, "orders", fmt.Sprintf("b%d", i), 1)
	}
	parking.Store(false)
	close(unpark)
	if d := rounds.next(t); d.Events != 3 {
		t.Fatalf("the round after the idle check took %d events (of %v), want all 3: the check ended the saturation", d.Events, foundKeys(d))
	}
	gate.release(false)
	for range 3 {
		ackPublished(t, r, recv(t, st))
	}
}

// foundKeys returns the aggregate keys of the aggregates round d found,
// the oldest first.
func foundKeys(d store.Discovery) []string {
	keys := make([]string, len(d.Found))
	for i, a := range d.Found {
		keys[i] = a.AggregateKey
	}
	return keys
}

// burst commits n events of stream "orders", aggregates prefix0 to
// prefix(n-1), each in its own transaction, while discovery's lock is held,
// so that one round finds them all; it returns their ids, oldest first.
func burst(ctx context.Context, t *testing.T, pool *pgxpool.Pool, prefix string, n int) []uuid.UUID {
	t.Helper()
	release := holdDiscovery(ctx, t, pool)
	defer release()
	ids := make([]uuid.UUID, n)
	for i := range n {
		ids[i] = emit(t, pool, "orders", fmt.Sprintf("%s%d", prefix, i), 1)[0]
	}
	return ids
}

// serverSaturatedAfter, as startCreditReplica's saturatedAfter, leaves
// the server's own.
const serverSaturatedAfter time.Duration = -1

// startCreditReplica starts a replica for the tests of rounds bounded by
// their sessions' credit, configured by configure (nil: as startReplica
// does): its rounds count as saturated once they have been short of credit
// for saturatedAfter (0: from the first round; 1ns: after any short round;
// serverSaturatedAfter: the server's own), its sessions' offers pass
// through a gate (holding them from the start when armed, none until armed
// otherwise), and its rounds are watched.
func startCreditReplica(t *testing.T, armed bool, saturatedAfter time.Duration, configure func(*server.Config)) (context.Context, *pgxpool.Pool, *replica, *offerGate, *roundWatch) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	gate := newOfferGate(armed)
	r := startReplica(t, url, configure)
	// Registered after the replica's own cleanup, so run before it: a held
	// loop would keep the replica from stopping.
	t.Cleanup(func() { gate.release(false) })
	if saturatedAfter >= 0 {
		r.Server.SetSaturatedAfter(saturatedAfter)
	}
	r.Server.SetAfterOffer(gate.hook)
	// The loop's first turns run at once, and a round among them that
	// began before the test's session offered its credit borrowed none,
	// yet may reach the database only after the test's events commit (on
	// a busy host), and take them with no session to dispatch to. Once a
	// check has ended, nothing being due, no such round is still running:
	// the next one begins at a check that finds the test's events. A loop
	// that fell asleep in those first turns (before the hook was set: on a
	// busy host) runs no round until the test's events wake it, and makes
	// its next check only after the quiet interval, an hour where a test
	// sets DiscoveryIdleInterval to an hour: it is not waited for.
	turns := watchDiscoveryTurns(r)
	if !r.Server.DiscoveryAsleep() {
		// Awake, it checks within its pause, which is short this soon
		// after its start (and a check that falls asleep reports too).
		select {
		case <-turns.c:
		case <-time.After(30 * time.Second):
			t.Fatal("the discovery loop made no idle check within 30s")
		}
	}
	r.Server.SetAfterRoundDue(nil)
	return ctx, pool, r, gate, watchRounds(r)
}

// A round that loses its turn to another replica's round takes nothing,
// and that does not end the saturation: replicas taking turns would
// otherwise end each other's at almost every round, and relays of little
// credit on several replicas would stay in the claim mode. Forced with
// discovery's lock, held as another replica's round holds it: a burst of 5
// against an offer of 3 makes the replica saturated; the lock is taken
// before its next round and held while 5 more events commit and the
// session offers its 3 units again, until a round has lost its turn with
// that credit borrowed. The round after the lock is released takes the 3
// the offer covers (ended, it would take all 5).
func TestARoundThatLostItsTurnKeepsTheSaturation(t *testing.T) {
	t.Parallel()
	ctx, pool, r, gate, _ := startCreditReplica(t, true, time.Nanosecond, nil)
	lock := lockDiscoveryAfterTheFirstRound(ctx, t, pool, r, nil)
	rounds := lock.rounds
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 3, LeaseTtl: durationpb.New(time.Hour)})
	gate.waitHeld(t) // the session offers all 3 units
	burst(ctx, t, pool, "a", 5)
	if d := rounds.next(t); d.Events != 5 || len(d.Dispatched) != 3 {
		t.Fatalf("the burst's round took %d events and dispatched %d, want 5 and 3 (not saturated yet)", d.Events, len(d.Dispatched))
	}
	if err := <-lock.held; err != nil {
		t.Fatal(err)
	}
	for i := range 5 {
		emit(t, pool, "orders", fmt.Sprintf("b%d", i), 1)
	}
	ackBurstUntilReoffered(t, r, st, gate)
	lock.unlockAfterALostTurn(ctx, t)
	if d := rounds.next(t); d.Events != 3 || len(d.Dispatched) != 3 || d.Aggregates != 0 {
		t.Fatalf("the round after the lost turns took %d events, dispatched %d and made %d ready; want 3, 3 and 0: the lost turns ended the saturation",
			d.Events, len(d.Dispatched), d.Aggregates)
	}
	gate.release(false)
	for range 5 {
		ackPublished(t, r, recv(t, st))
	}
}

// A saturated round bounded by its sessions' credit that takes as many
// events as that bound leaves the rest undiscovered: it is short of credit
// as much as the rounds before it, and does not end the saturation (only a
// round that takes everything it found within the credit does). Were it
// to end it, every other round of a saturated replica would take the
// whole backlog and make it ready, for claims. Forced as in
// TestARoundThatLostItsTurnKeepsTheSaturation: a burst of 5 against an
// offer of 3 makes the replica saturated, and ten more events (each its own
// transaction) commit in that round's hook, which takes discovery's lock
// and holds it until the session offers its 3 units again; the round after
// takes 3 and dispatches them.
// The session then has no credit to offer: the next round is put off until
// its acks free some, and takes no more than that, not the 7 left.
func TestARoundAsLargeAsItsBoundKeepsTheSaturation(t *testing.T) {
	t.Parallel()
	const more = 10
	ctx, pool, r, gate, _ := startCreditReplica(t, true, time.Nanosecond, nil)
	// The events are committed in the hook, before any check could find
	// nothing due (which would end the saturation).
	lock := lockDiscoveryAfterTheFirstRound(ctx, t, pool, r, func() error {
		for i := range more {
			if _, err := client.Emit(ctx, pool, client.Event{Stream: "orders", AggregateKey: fmt.Sprintf("b%d", i), Type: "Changed", Payload: []byte(`{}`)}); err != nil {
				return err
			}
		}
		return nil
	})
	rounds := lock.rounds
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 3, LeaseTtl: durationpb.New(time.Hour)})
	gate.waitHeld(t) // the session offers all 3 units
	burst(ctx, t, pool, "a", 5)
	if d := rounds.next(t); d.Events != 5 || len(d.Dispatched) != 3 {
		t.Fatalf("the burst's round took %d events and dispatched %d, want 5 and 3 (not saturated yet)", d.Events, len(d.Dispatched))
	}
	if err := <-lock.held; err != nil {
		t.Fatal(err)
	}
	ackBurstUntilReoffered(t, r, st, gate)
	// A round borrowed the 3 units (and lost its turn): the next takes them.
	lock.unlockAfterALostTurn(ctx, t)
	if d := rounds.next(t); d.Events != 3 || len(d.Dispatched) != 3 || d.Aggregates != 0 {
		t.Fatalf("the saturated round took %d events, dispatched %d and made %d ready; want 3, 3 and 0 (bounded by the offer)",
			d.Events, len(d.Dispatched), d.Aggregates)
	}
	// The session, given the 3, offers credit again only as its acks free
	// it: the next round is bounded by that, 3 at most.
	gate.release(false)
	for range 3 {
		ackPublished(t, r, recv(t, st))
	}
	if d := rounds.next(t); d.Events > 3 {
		t.Fatalf("the round after a round as large as its bound took %d events, want 3 at most (the credit the acks freed): that round ended the saturation", d.Events)
	}
	for range more - 3 {
		ackPublished(t, r, recv(t, st))
	}
}

// Rounds are bounded by their sessions' credit only once they have been
// short of it for saturatedAfter: before that, a burst beyond the credit is
// made ready as ever, for the sessions' claims, which take it in parallel
// as acks free credit (bounded at once, every round of a bursty load would
// wait for the loop's next round). Here saturatedAfter is an hour: a burst
// of 5 against an offer of 3 makes the first round short, and 5 more
// events, committed in that round's hook (so that the next turn is a round
// with no check between, which finding nothing would end the shortage),
// are all taken by the round after, though the session, its offer spent on
// the first round's leases, offers no credit to it: not put off.
func TestAShortRoundDoesNotBoundTheNextBeforeSaturatedAfter(t *testing.T) {
	t.Parallel()
	const more = 5
	ctx, pool, r, gate, _ := startCreditReplica(t, true, time.Hour, nil)
	putOff := make(chan struct{}, 1)
	r.Server.SetAfterPutOff(func() {
		select {
		case putOff <- struct{}{}:
		default:
		}
	})
	var first atomic.Bool
	emitted := make(chan error, 1)
	rounds := watchRoundsWith(r, func(d store.Discovery, err error) {
		if err == nil && d.Events > 0 && first.CompareAndSwap(false, true) {
			var eerr error
			for i := 0; eerr == nil && i < more; i++ {
				_, eerr = client.Emit(ctx, pool, client.Event{Stream: "orders", AggregateKey: fmt.Sprintf("b%d", i), Type: "Changed", Payload: []byte(`{}`)})
			}
			emitted <- eerr
		}
	})
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 3, LeaseTtl: durationpb.New(time.Hour)})
	gate.waitHeld(t) // the session offers all 3 units
	burst(ctx, t, pool, "a", 5)
	if d := rounds.next(t); d.Events != 5 || len(d.Dispatched) != 3 {
		t.Fatalf("the burst's round took %d events and dispatched %d, want 5 and 3", d.Events, len(d.Dispatched))
	}
	if err := <-emitted; err != nil {
		t.Fatal(err)
	}
	select {
	case d := <-rounds.rounds:
		if d.Events != more {
			t.Fatalf("the round after one short round took %d events, want all %d: not saturated before saturatedAfter", d.Events, more)
		}
	case <-putOff:
		t.Fatal("the round after one short round was put off for want of credit: saturated before saturatedAfter")
	case <-time.After(30 * time.Second):
		t.Fatal("no round found the second burst within 30s")
	}
	gate.release(false)
	for range 5 + more {
		ackPublished(t, r, recv(t, st))
	}
}

// A round put off for want of credit waits for a session's offer, or the
// idle interval (sessions that end offer none): it does not try again
// after DiscoveryInterval, which would spin the loop (a borrow of every
// session's credit each millisecond) for as long as the relays hold their
// credit. The session's one unit is out (its lease unacked) when the next
// event commits, so its round is put off; the pause the loop then arms is
// the idle interval, and the ack's offer ends it.
func TestARoundPutOffWaitsForAnOfferOrTheIdleInterval(t *testing.T) {
	t.Parallel()
	const idle = 2 * time.Second
	ctx, pool, r, _, _ := startCreditReplica(t, false, 0, func(c *server.Config) { c.DiscoveryIdleInterval = idle })
	var putOff atomic.Bool
	r.Server.SetAfterPutOff(func() { putOff.Store(true) })
	pauses := make(chan time.Duration, 1)
	var sent atomic.Bool
	r.Server.SetAfterDiscoveryWait(func(chosen, _ time.Duration, _ time.Time) {
		if putOff.Load() && sent.CompareAndSwap(false, true) {
			pauses <- chosen
		}
	})
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 1, LeaseTtl: durationpb.New(time.Hour)})
	first := emit(t, pool, "orders", "a", 1)[0]
	d := recv(t, st)
	if d.GetEvent().GetEventId() != first.String() {
		t.Fatalf("got %s, want %s", d.GetEvent().GetEventId(), first)
	}
	second := emit(t, pool, "orders", "b", 1)[0]
	select {
	case p := <-pauses:
		if p != idle {
			t.Fatalf("after a round put off for want of credit the loop paused %v, want the idle interval (%v), cut short by an offer", p, idle)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the discovery loop put no round off within 30s")
	}
	ackPublished(t, r, d)
	if d := recv(t, st); d.GetEvent().GetEventId() != second.String() {
		t.Fatalf("got %s, want %s", d.GetEvent().GetEventId(), second)
	} else {
		ackPublished(t, r, d)
	}
}

// A saturated round is bounded by the smaller of its sessions' credit and
// DiscoveryMaxEvents: a replica configured to take a backlog in rounds of
// 100 still takes no more than the 3 its session can take. Forced as in
// TestARoundTakesWhatItsSessionsCanTake (saturated from the first round):
// ten events, each its own transaction, wait for one round.
func TestASaturatedRoundTakesTheCreditBelowDiscoveryMaxEvents(t *testing.T) {
	t.Parallel()
	ctx, pool, r, gate, rounds := startCreditReplica(t, true, 0, func(c *server.Config) { c.DiscoveryMaxEvents = 100 })
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 3, LeaseTtl: durationpb.New(time.Hour)})
	gate.waitHeld(t) // the session offers all 3 units
	const n = 10
	burst(ctx, t, pool, "o", n)
	if d := rounds.next(t); d.Events != 3 || len(d.Dispatched) != 3 || d.Aggregates != 0 {
		t.Fatalf("the round took %d events, dispatched %d and made %d ready; want 3, 3 and 0 (the session's credit, below DiscoveryMaxEvents 100)",
			d.Events, len(d.Dispatched), d.Aggregates)
	}
	gate.release(false)
	for range n {
		ackPublished(t, r, recv(t, st))
	}
}

// ackBurstUntilReoffered lets the session's held offer go, receives and
// acks the burst's 5 deliveries, and waits until the session offers its 3
// units again (armed before the last ack, whose credit it frees).
func ackBurstUntilReoffered(t *testing.T, r *replica, st outboxv1.RelayService_SubscribeClient, gate *offerGate) {
	t.Helper()
	gate.release(false)
	for i := range 5 {
		d := recv(t, st)
		if i == 4 {
			gate.armFrom(3) // the offer its ack frees, all 3 units
		}
		ackPublished(t, r, d)
	}
	gate.waitHeld(t)
}

// lostTurnLock is discovery's lock, taken by the test from the discovery
// loop's hook right after the first round that found events (so that no
// round comes between), as another replica's round would hold it.
type lostTurnLock struct {
	rounds *roundWatch
	// held: the lock was taken (and then ran), or why not.
	held chan error
	// lost: a round lost its turn while the lock was held.
	lost chan struct{}
	conn *pgxpool.Conn
}

// lockDiscoveryAfterTheFirstRound watches r's rounds and takes discovery's
// lock in the hook of the first that found events, then runs then (when
// not nil) there too.
func lockDiscoveryAfterTheFirstRound(ctx context.Context, t *testing.T, pool *pgxpool.Pool, r *replica, then func() error) *lostTurnLock {
	t.Helper()
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(conn.Release)
	l := &lostTurnLock{held: make(chan error, 1), lost: make(chan struct{}, 1), conn: conn}
	var holding atomic.Bool
	l.rounds = watchRoundsWith(r, func(d store.Discovery, err error) {
		switch {
		case err != nil:
		case d.Events > 0:
			if holding.CompareAndSwap(false, true) {
				_, err := conn.Exec(ctx, `SELECT pg_advisory_lock($1)`, int64(discoveryLockKey))
				if err == nil && then != nil {
					err = then()
				}
				l.held <- err
			}
		case holding.Load():
			select {
			case l.lost <- struct{}{}:
			default:
			}
		}
	})
	return l
}

// unlockAfterALostTurn waits for a round to lose its turn to the lock (a
// fresh report, earlier ones drained), then lets the lock go.
func (l *lostTurnLock) unlockAfterALostTurn(ctx context.Context, t *testing.T) {
	t.Helper()
	drain(l.lost)
	select {
	case <-l.lost:
	case <-time.After(30 * time.Second):
		t.Fatal("no round lost its turn within 30s")
	}
	if _, err := l.conn.Exec(ctx, `SELECT pg_advisory_unlock($1)`, int64(discoveryLockKey)); err != nil {
		t.Fatal(err)
	}
}
