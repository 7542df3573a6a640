package server_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"google.golang.org/protobuf/types/known/durationpb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/server"
)

// idleHolder is a replica with one session that holds one lease and has
// credit free: idle in its poll group, and with a lease to check at each
// reconcile tick, which the test sends.
type idleHolder struct {
	r      *replica
	ticks  chan<- time.Time
	turns  chan struct{} // one per turn of the session's loop (as it offers credit, before it waits)
	claims *atomic.Int64
}

func startIdleHolder(t *testing.T, ctx context.Context, pollInterval time.Duration) *idleHolder {
	t.Helper()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, func(c *server.Config) { c.PollInterval = pollInterval })
	ticks := make(chan time.Time)
	r.Server.SetReconcileTick(ticks)
	h := &idleHolder{r: r, ticks: ticks, turns: make(chan struct{}, 1024), claims: countClaims(r)}
	r.Server.SetAfterOffer(func(uuid.UUID, int) {
		select {
		case h.turns <- struct{}{}:
		default:
		}
	})
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 4, LeaseTtl: durationpb.New(time.Hour)})
	emit(t, pool, "orders", "held", 1)
	recv(t, st) // never acked: the lease stays for the test
	return h
}

// send sends one reconcile tick and returns once the session took it:
// it was waiting, so every turn of its loop before has ended (and the
// claims they made are counted).
func (h *idleHolder) send(t *testing.T) {
	t.Helper()
	select {
	case h.ticks <- time.Now():
	case <-time.After(30 * time.Second):
		t.Fatal("the session took no reconcile tick within 30s")
	}
}

// tick sends one reconcile tick and returns once a turn of the session's
// loop that followed it has come to wait again (the turn it took for the
// tick, or another one: the caller checks that no poll or wake-up came in
// between).
func (h *idleHolder) tick(t *testing.T) {
	t.Helper()
	for len(h.turns) > 0 {
		<-h.turns
	}
	h.send(t)
	select {
	case <-h.turns:
	case <-time.After(30 * time.Second):
		t.Fatal("the session's loop did not come round within 30s of a reconcile tick")
	}
}

// polls is how many polls the group has fired.
func (h *idleHolder) polls(t *testing.T) uint64 {
	t.Helper()
	_, _, n, ok := h.r.Server.PollTimer()
	if !ok {
		t.Fatal("want exactly one poll group")
	}
	return n
}

// A reconcile tick makes a session with free credit check its leases, and
// claim only if it finds one gone: it is no reason to claim by itself (the
// group's poll is), so idle relays that hold leases cost no claim per tick.
func TestReconcileTickDoesNotMakeIdleSessionsClaim(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	h := startIdleHolder(t, ctx, time.Hour)
	// The group's poll has backed off to seconds: no poll comes between
	// the ticks below, as a rule (an attempt with one is tried again).
	waitFor(t, func() int32 { return b2i(h.polls(t) >= 10) })
	const ticks = 5
	for range 3 {
		h.send(t)
		p0, w0, c0 := h.polls(t), h.r.Server.GroupWakeups(), h.claims.Load()
		for range ticks {
			h.send(t)
		}
		h.send(t) // the last tick's turn has ended
		c1 := h.claims.Load()
		if h.polls(t) != p0 || h.r.Server.GroupWakeups() != w0 {
			continue // the group's poll or a wake-up asked for a claim meanwhile
		}
		if c1 != c0 {
			t.Fatalf("%d reconcile ticks made the idle session claim %d times, with its lease still held", ticks, c1-c0)
		}
		return
	}
	t.Fatal("a poll or a wake-up came during every attempt")
}

// A poll group's poll is armed once, when a member starts waiting, and
// fires then whatever its members do meanwhile: a member that waits again
// (here after each reconcile tick) neither postpones it nor resets it, so
// sessions that keep waking cannot starve the poll of the group.
func TestWaitingAgainDoesNotPostponeTheGroupsPoll(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	// Long enough that a tick and the wait after it fit between two polls
	// on a loaded machine (at 300 ms, a load of 20 on 2 cores put a poll
	// inside every one, and nothing was compared).
	const pollInterval = time.Second
	h := startIdleHolder(t, ctx, pollInterval)
	// The poll has backed off from 2 ms (to 128 ms and more).
	waitFor(t, func() int32 { return b2i(h.polls(t) >= 6) })
	idleAgain := func() (time.Time, uint64) {
		waitFor(t, func() int32 { return b2i(h.r.Server.IdleSessions() == 1) })
		due, armed, n, _ := h.r.Server.PollTimer()
		if !armed {
			return time.Time{}, n
		}
		return due, n
	}
	due0, n0 := idleAgain()
	start := n0
	compared := 0
	// The poll keeps firing while the session waits again and again (two
	// polls), and at least three waits in between are compared.
	for h.polls(t) < start+2 || compared < 3 {
		if ctx.Err() != nil {
			t.Fatalf("the group's poll stopped while the session waited again: %d polls, %d waits compared", h.polls(t)-start, compared)
		}
		h.tick(t)
		due, n := idleAgain()
		if n == n0 && !due0.IsZero() && !due.IsZero() {
			if !due.Equal(due0) {
				t.Fatalf("the session waiting again moved the group's poll from %v to %v (%v later)",
					due0.Format(time.StampMicro), due.Format(time.StampMicro), due.Sub(due0))
			}
			compared++
		}
		due0, n0 = due, n
	}
}

// A lease the reconcile finds gone with no ack or nack on this replica (it
// expired and another relay's claim took it, or an operator ended it) is
// credit freed that no ack's claim hint speaks for: the session claims with
// it at once, rather than waiting for a wake-up or its group's poll. Polls
// are off here, so only the loop's own decision can make it claim.
//
// The lease takes all of the session's credit (MaxInFlight 1): from its
// claim of 'a' until the reconcile, no wake-up can make it claim again.
// With credit to spare, the wake-ups the replica's start leaves (the
// discovery round's, its NOTIFY heard back, kept for the next member to
// wait while the session was claiming) made it claim once or twice after
// its first claim, and a claim after the UPDATE below leased 'a' again:
// the reconcile then found it held, and nothing was found gone.
func TestALeaseTheReconcileFindsGoneIsClaimedWithAtOnce(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	emit(t, pool, "orders", "a", 1)
	r := startReplica(t, url, func(c *server.Config) { c.NoDispatch = true })
	ticks := make(chan time.Time)
	r.Server.SetReconcileTick(ticks)
	r.Server.SetNoPolls()
	decisions := make(chan bool, 16)
	r.Server.SetAfterFreed(func(_ uuid.UUID, claim bool, _ time.Time) { decisions <- claim })
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 1, LeaseTtl: durationpb.New(time.Hour)})
	if d := recv(t, st); d.GetEvent().GetAggregateKey() != "a" || d.GetAttempt() != 1 {
		t.Fatalf("first delivery: %s attempt %d", d.GetEvent().GetAggregateKey(), d.GetAttempt())
	}
	// The lease ends behind this replica's back, as an expiry would.
	if _, err := pool.Exec(ctx, `UPDATE outbox.delivery SET state = 'ready', claimable_at = clock_timestamp(),
		holder = NULL, holder_relay_id = NULL, holder_replica_id = NULL, lease_expires_at = NULL
		WHERE aggregate_key = 'a'`); err != nil {
		t.Fatal(err)
	}
	select {
	case ticks <- time.Now():
	case <-ctx.Done():
		t.Fatal("the session's loop never took the reconcile tick")
	}
	select {
	case claim := <-decisions:
		if !claim {
			t.Fatal("the session found its lease gone and did not claim with the credit")
		}
	case <-ctx.Done():
		t.Fatal("the session never found its lease gone")
	}
	if d := recv(t, st); d.GetEvent().GetAggregateKey() != "a" || d.GetAttempt() != 2 {
		t.Fatalf("after the lease was found gone: %s attempt %d, want a again, attempt 2",
			d.GetEvent().GetAggregateKey(), d.GetAttempt())
	}
}
