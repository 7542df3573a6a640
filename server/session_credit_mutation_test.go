package server_test

import (
	"context"
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

// The tests of this file hold the session's credit accounting
// (server/session.go) against mutants of a sweep, most of which the rest
// of the suite let through: each names the mutants it kills (ids as in
// the commit that added them). Polls and reconcile ticks are off where a
// stall is at stake, so that neither hides a lost claim; a stall then
// fails a bounded receive.

// makeDue makes the backing-off aggregate key claimable now, as its retry
// time passing would, with nothing announcing it: no wake-up, no release.
func makeDue(t *testing.T, pool *pgxpool.Pool, key string) {
	t.Helper()
	tag, err := pool.Exec(context.Background(), `UPDATE outbox.delivery SET claimable_at = now() - interval '1 second'
		WHERE aggregate_key = $1 AND state = 'backoff'`, key)
	if err != nil {
		t.Fatal(err)
	}
	if tag.RowsAffected() != 1 {
		t.Fatalf("%s is not backing off", key)
	}
}

// Credit a nack frees is claimed with at once (session.free sets
// claimFreed): the session's last claim came back short, so nothing else
// makes it claim, and the work that is there (b, whose backoff ended with
// no one announcing it) would otherwise wait for a poll. S (max_in_flight
// 2) nacks b, then holds a (dispatched or claimed); b falls due; the nack
// of a must make S claim, and b comes.
//
// Kills S01: session.free without `ss.claimFreed = true`; and S27: run
// setting wantClaim = false, not true, when applyFreed says claim. Both
// survived the rest of the suite.
func TestCreditANackFreesIsClaimedWithAtOnce(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := quietReplica(t, url, nil)
	emit(t, pool, "orders", "b", 1)
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 2, LeaseTtl: durationpb.New(time.Hour)})
	db := recv(t, st)
	if k := db.GetEvent().GetAggregateKey(); k != "b" {
		t.Fatalf("delivered %s, want b", k)
	}
	nackAfter(t, r, time.Hour, db)
	emit(t, pool, "orders", "a", 1)
	da := recv(t, st)
	if k := da.GetEvent().GetAggregateKey(); k != "a" {
		t.Fatalf("delivered %s, want a", k)
	}
	// The loop has sent a: its claims (if a came by one) are over, and it
	// waits with one unit of credit and no reason to claim.
	makeDue(t, pool, "b")
	nackAfter(t, r, time.Hour, da)
	d := recvWithin(t, st, 10*time.Second, "the credit the nack of a freed was not claimed with")
	if d.GetEvent().GetAggregateKey() != "b" || d.GetAttempt() != 2 {
		t.Fatalf("delivered %s attempt %d, want b's second attempt", d.GetEvent().GetAggregateKey(), d.GetAttempt())
	}
}

// A claim that leased as many events as its credit allowed may have left
// work behind (claimedAll: claim again), even when its leases cover fewer
// aggregates than it asked for: a window took the credit. S (window 16,
// max_in_flight 32, ClaimBatch 2: claims of at most 2 aggregates and 8
// events) first claims 8 of a's 20 events; b, backing off, falls due
// while that claim runs, announced by no one. S must claim again, with
// credit left, and deliver b.
//
// Kills S30: claimAndSend's claimedAll test without `len(leases) == credit`,
// which survived the rest of the suite (and S28, claimedAll not
// continuing, as TestAClaimThatFilledItsBatchClaimsAgainAtOnce does).
func TestAClaimThatFilledItsCreditClaimsAgain(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := quietReplica(t, url, func(c *server.Config) { c.ClaimBatch = 2 })

	backingOffAnHour(t, ctx, r, pool, "b")

	emit(t, pool, "orders", "a", 20)
	waitDiscovered(t, pool, 2)
	var once sync.Once
	dueErr := make(chan error, 1)
	r.Server.SetAfterClaim(func(ls []store.Lease, err error) ([]store.Lease, error) {
		if len(ls) > 0 {
			once.Do(func() {
				_, e := pool.Exec(context.Background(), `UPDATE outbox.delivery SET claimable_at = now() - interval '1 second'
					WHERE aggregate_key = 'b' AND state = 'backoff'`)
				dueErr <- e
			})
		}
		return ls, err
	})
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 32, MaxInFlightPerAggregate: 16,
		LeaseTtl: durationpb.New(time.Hour)})
	for i := range 8 {
		d := recv(t, st)
		if d.GetEvent().GetAggregateKey() != "a" || d.GetEvent().GetRevision() != int64(i+1) {
			t.Fatalf("delivery %d: %s revision %d, want a's revision %d", i, d.GetEvent().GetAggregateKey(), d.GetEvent().GetRevision(), i+1)
		}
	}
	if err := <-dueErr; err != nil {
		t.Fatal(err)
	}
	d := recvWithin(t, st, 10*time.Second, "a claim that filled its credit did not claim again")
	if d.GetEvent().GetAggregateKey() != "b" {
		t.Fatalf("delivered %s revision %d, want b", d.GetEvent().GetAggregateKey(), d.GetEvent().GetRevision())
	}
}

// holdRemoval holds the next removal of a session from the replica's
// session list: a refresh of the relay-session rows (which ListRelays
// runs) is paused between its snapshot and its write, and a session's
// removal waits for it. removalWaits is closed once a removal waits: the
// session's stream is over, it is closed and its own release has run, and
// the replica still lists it. letGo ends the hold and waits for ListRelays.
func holdRemoval(t *testing.T, r *replica) (removalWaits <-chan struct{}, letGo func()) {
	t.Helper()
	snapshotTaken, waits, release := make(chan struct{}), make(chan struct{}), make(chan struct{})
	r.Server.SetBeforeSaveSessions(sync.OnceFunc(func() {
		close(snapshotTaken)
		<-release
	}), sync.OnceFunc(func() { close(waits) }))
	listed := make(chan error, 1)
	go func() {
		_, err := r.Admin.ListRelays(context.Background(), &outboxv1.ListRelaysRequest{})
		listed <- err
	}()
	waitClosed(t, snapshotTaken, "no refresh of the relay-session rows ran")
	var once sync.Once
	return waits, func() {
		once.Do(func() {
			close(release)
			if err := <-listed; err != nil {
				t.Error(err)
			}
		})
	}
}

// A closed session offers no credit: a discovery round that runs after
// its stream ended, while the replica still lists it, dispatches nothing
// to it (session.close takes its offer back). Were it to, the round would
// lease the event to a session that is gone, only to release it again.
//
// Kills S11: session.close without `ss.offered = 0`, which survived the
// rest of the suite.
func TestAClosedSessionLendsNoCredit(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	offered := make(chan struct{})
	var offeredOnce sync.Once
	r.Server.SetAfterOffer(func(_ uuid.UUID, n int) {
		if n > 0 {
			offeredOnce.Do(func() { close(offered) })
		}
	})
	type round struct {
		events     int64
		dispatched int
	}
	rounds := make(chan round, 64)
	r.Server.SetAfterDiscover(func(d store.Discovery, err error) (store.Discovery, error) {
		if err == nil && d.Events > 0 {
			rounds <- round{d.Events, len(d.Dispatched)}
		}
		return d, err
	})
	sctx, scancel := context.WithCancel(ctx)
	defer scancel()
	subscribe(t, sctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 1, LeaseTtl: durationpb.New(time.Hour)})
	waitClosed(t, offered, "the session offered no credit")
	removalWaits, letGo := holdRemoval(t, r)
	defer letGo()
	scancel()
	waitClosed(t, removalWaits, "the session's removal did not wait")
	emit(t, pool, "orders", "o", 1)
	select {
	case rd := <-rounds:
		if rd.dispatched != 0 {
			t.Fatalf("a round dispatched %d leases to a closed session", rd.dispatched)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("no discovery round found o within 30s")
	}
	letGo()
	d := recv(t, subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 1}))
	if d.GetEvent().GetAggregateKey() != "o" || d.GetAttempt() != 1 {
		t.Fatalf("delivered %s attempt %d, want o's first attempt", d.GetEvent().GetAggregateKey(), d.GetAttempt())
	}
	ack(t, r, d)
}

// A loop offers only the credit a discovery round does not hold already:
// a session whose loop turned while a round held part of its credit, and
// claimed (finding nothing) with the rest, offers again without the
// round's loan, or the next round (or a windowed ack batch) could lend
// the same credit twice and dispatch beyond max_in_flight. S
// (max_in_flight 3, rounds of one aggregate) offers 3; a round borrows 1
// and is held before it is sent; a wake-up makes S claim; S's next offer
// is 3 - 1 = 2.
//
// Kills S12: offerCredit not subtracting ss.lent (which
// TestCreditARoundGivesBackWakesTheSession kills by the stall it leads
// to; this holds the offer itself, as
// TestAnOfferLeavesOutLeasesGivenWhileTheLoopClaimed does for leases
// given and not yet counted).
func TestAnOfferLeavesOutTheCreditARoundHolds(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := quietReplica(t, url, func(c *server.Config) { c.DiscoveryMaxFound = 1 })
	offers := make(chan int, 64)
	r.Server.SetAfterOffer(func(_ uuid.UUID, offered int) { offers <- offered })
	roundHeld, letRoundGo := holdFirstRound(t, r)
	defer letRoundGo()
	turns := watchDiscoveryTurns(r)
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 3, LeaseTtl: durationpb.New(time.Hour)})
	if got := nextOffer(t, offers); got != 3 {
		t.Fatalf("the session's first offer: %d, want 3", got)
	}
	turns.next(t) // no round that began before the offer finds x
	emit(t, pool, "orders", "x", 1)
	waitClosed(t, roundHeld, "no discovery round borrowed the session's credit")
	drain(offers)
	if _, err := pool.Exec(ctx, `SELECT pg_notify('outbox_wakeup', '')`); err != nil {
		t.Fatal(err)
	}
	if got := nextOffer(t, offers); got != 2 {
		t.Fatalf("with 1 of its 3 credit lent to a round, the session offered %d, want 2", got)
	}
	letRoundGo()
	if d := recv(t, st); d.GetEvent().GetAggregateKey() != "x" {
		t.Fatalf("delivered %s, want the round's lease of x", d.GetEvent().GetAggregateKey())
	}
}

// A session's spare credit (HandOverTarget.Spare) counts the leases handed
// to it that its loop has not taken in yet: outstanding deliveries are
// the leases it holds, less those ended, plus those handed over. S
// (max_in_flight 2) holds g/1 and h/1; its loop is held; the ack of g/1
// hands g/2 over; b, backing off, falls due, older than h/2; the ack of
// h/1 then finds S without spare credit (h/1 ends, g/2 and h/1's
// successor would make 2) and yields h/2 to b, the older work, rather
// than handing it over.
//
// Kills S08: outstandingLocked without `len(ss.handed)`.
func TestSpareCreditCountsLeasesHandedButNotTakenIn(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, func(c *server.Config) { c.NoDispatch = true })
	ticks := make(chan time.Time)
	r.Server.SetReconcileTick(ticks)
	r.Server.SetNoPolls()
	var holdNext atomic.Bool
	held := make(chan struct{})
	loop := newHoldGate(t)
	r.Server.SetFreedApplied(func(int, int64) {
		if holdNext.CompareAndSwap(true, false) {
			close(held)
			loop.hold()
		}
	})

	backingOffAnHour(t, ctx, r, pool, "b")

	emit(t, pool, "orders", "g", 2)
	emit(t, pool, "orders", "h", 2)
	waitDiscovered(t, pool, 3)
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 2, LeaseTtl: durationpb.New(time.Hour)})
	held1 := map[string]*outboxv1.SubscribeResponse{}
	for range 2 {
		d := recv(t, st)
		held1[d.GetEvent().GetAggregateKey()] = d
	}
	if held1["g"] == nil || held1["h"] == nil {
		t.Fatalf("S got %v, want g/1 and h/1", held1)
	}
	holdNext.Store(true)
	go func() {
		select {
		case ticks <- time.Now():
		case <-ctx.Done():
		}
	}()
	waitClosed(t, held, "the session's loop did not turn on the tick")
	ackPublished(t, r, held1["g"])
	if n := r.Server.HandOvers(); n != 1 {
		t.Fatalf("%d hand-overs after the ack of g/1, want 1 (g/2)", n)
	}
	if _, err := pool.Exec(ctx, `UPDATE outbox.delivery SET claimable_at = now() - interval '1 hour'
		WHERE aggregate_key = 'b' AND state = 'backoff'`); err != nil {
		t.Fatal(err)
	}
	ackPublished(t, r, held1["h"])
	if n := r.Server.HandOvers(); n != 1 {
		t.Fatalf("%d hand-overs after the ack of h/1, want still 1: S had no spare credit (g/2 handed, not yet taken in) and b is older than h/2", n)
	}
	loop.letGo()
}

// backingOffAnHour leaves orders/key (one event) backing off for an hour:
// a session of its own claims it, nacks it with that retry delay, and
// goes. r must have no other session.
func backingOffAnHour(t *testing.T, ctx context.Context, r *replica, pool *pgxpool.Pool, key string) {
	t.Helper()
	emit(t, pool, "orders", key, 1)
	sctx, scancel := context.WithCancel(ctx)
	defer scancel()
	s0 := subscribe(t, sctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 1, LeaseTtl: durationpb.New(time.Hour)})
	nackAfter(t, r, time.Hour, recv(t, s0))
	scancel()
	waitFor(t, func() int32 { return b2i(r.Server.Sessions() == 0) })
}
