package server_test

import (
	"context"
	"fmt"
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

// delivered is one delivery and the index of the stream it came on.
type delivered struct {
	stream int
	d      *outboxv1.SubscribeResponse
}

// recvAll receives on every stream until it ends, into one channel.
func recvAll(sts []outboxv1.RelayService_SubscribeClient) <-chan delivered {
	c := make(chan delivered, 16)
	for i, st := range sts {
		go func() {
			for {
				d, err := st.Recv()
				if err != nil {
					return
				}
				c <- delivered{i, d}
			}
		}()
	}
	return c
}

// next returns the next delivery on any stream (bounded: a hang guard).
func next(t *testing.T, c <-chan delivered) delivered {
	t.Helper()
	select {
	case d := <-c:
		return d
	case <-time.After(30 * time.Second):
		t.Fatal("no delivery within 30s")
		return delivered{}
	}
}

func countClaims(r *replica) *atomic.Int64 {
	var n atomic.Int64
	r.Server.SetAfterClaim(func(l []store.Lease, err error) ([]store.Lease, error) {
		n.Add(1)
		return l, err
	})
	return &n
}

func b2i(b bool) int32 {
	if b {
		return 1
	}
	return 0
}

// Sessions that take the same streams share one idle poll: while nothing is
// claimable, each poll of the group makes one claim, not one per session;
// and what no wake-up announces (a lease that expired) is still found (by
// the group's poll, or by the holder's reconcile).
func TestIdleSessionsOfOneFilterShareOnePoll(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, func(c *server.Config) { c.PollInterval = 20 * time.Millisecond })
	claims := countClaims(r)
	var polls atomic.Int64
	r.Server.SetAfterPoll(func() { polls.Add(1) })
	const n = 8
	sts := make([]outboxv1.RelayService_SubscribeClient, n)
	for i := range sts {
		sts[i] = subscribe(t, ctx, r, &outboxv1.SubscribeRequest{
			RelayId: fmt.Sprintf("relay-%d", i), MaxInFlight: 4, LeaseTtl: durationpb.New(time.Second)})
	}
	// Every session made its first claim, and the group's poll has backed
	// off to PollInterval.
	waitFor(t, func() int32 { return b2i(claims.Load() >= n && polls.Load() >= 10) })
	c0, p0 := claims.Load(), polls.Load()
	waitFor(t, func() int32 { return b2i(polls.Load() >= p0+30) })
	c1, p1 := claims.Load(), polls.Load()
	// One claim per poll, give or take the one under way at each end (and
	// the listener's wake-up when it connects).
	if c1-c0 > p1-p0+2 {
		t.Fatalf("%d idle sessions made %d claims over %d polls; want one claim per poll", n, c1-c0, p1-p0)
	}

	got := recvAll(sts)
	ids := emit(t, pool, "orders", "a", 1)
	first := next(t, got)
	if first.d.GetEvent().GetEventId() != ids[0].String() || first.d.GetAttempt() != 1 {
		t.Fatalf("first delivery %v", first.d)
	}
	// Not acked: the lease expires after a second, which nothing
	// announces; it is found again.
	again := next(t, got)
	if again.d.GetEvent().GetEventId() != ids[0].String() || again.d.GetAttempt() != 2 {
		t.Fatalf("after the lease expired got %v, want the event again (attempt 2)", again.d)
	}
	ack(t, r, again.d)
}

// A discovery round that made an aggregate ready wakes one idle session of
// the poll group that takes its stream, once: not every session, and not a
// second time when the round's own NOTIFY outbox_wakeup comes back on the
// replica's LISTEN connection.
func TestAWakeUpWakesOneSessionOnce(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, func(c *server.Config) {
		c.ReplicaID = "waker"
		c.PollInterval = time.Hour // only wake-ups make sessions claim
		c.NoDispatch = true        // the round makes the aggregate ready
	})
	notified := countWakeupsOnceListening(ctx, t, pool, r, "waker")
	const n = 5
	sts := make([]outboxv1.RelayService_SubscribeClient, n)
	for i := range sts {
		sts[i] = subscribe(t, ctx, r, &outboxv1.SubscribeRequest{RelayId: fmt.Sprintf("relay-%d", i), MaxInFlight: 4})
	}
	waitFor(t, func() int32 { return b2i(r.Server.IdleSessions() == n) })
	got := recvAll(sts)
	w0, g0 := r.Server.Wakeups(), r.Server.GroupWakeups()

	ids := emit(t, pool, "orders", "a", 1)
	d := next(t, got)
	if d.d.GetEvent().GetEventId() != ids[0].String() {
		t.Fatalf("got %v", d.d)
	}
	// The round's NOTIFY has come back and been acted on.
	waitFor(t, func() int32 { return b2i(notified.Load() >= 1) })
	if w := r.Server.GroupWakeups() - g0; w != 1 {
		t.Errorf("the round woke the group %d times; want once (its own NOTIFY is not a second wake-up)", w)
	}
	if w := r.Server.Wakeups() - w0; w != 1 {
		t.Errorf("%d sessions were asked to claim; want one", w)
	}
	ack(t, r, d.d)
}

// A poll skips its claim only on a probe younger than PollInterval (or,
// when the quiet loop checks less often, than the check interval and half
// a PollInterval) that found nothing claimable and nothing due by then.
func TestPollSkipsItsClaimOnlyOnAFreshEmptyProbe(t *testing.T) {
	t.Parallel()
	const poll = time.Second
	// No session waits, so the discovery loop's checks probe nothing
	// (claimProbeWanted): the probe is the test's.
	r := startReplica(t, testdb.New(t), func(c *server.Config) { c.PollInterval = poll })
	at := time.Now()
	for _, c := range []struct {
		what  string
		quiet time.Duration // the pause before the loop's next check, if longer than the idle interval
		probe store.ClaimProbe
		after time.Duration
		skip  bool
	}{
		{"nothing claimable, nothing due", 0, store.ClaimProbe{Probed: true, NextIn: -1}, poll / 2, true},
		{"a probe as old as PollInterval", 0, store.ClaimProbe{Probed: true, NextIn: -1}, poll, false},
		{"something claimable (whatever NextIn says)", 0, store.ClaimProbe{Probed: true, Claimable: true, NextIn: -1}, 0, false},
		{"a lease expiring later", 0, store.ClaimProbe{Probed: true, NextIn: 300 * time.Millisecond}, 200 * time.Millisecond, true},
		{"a lease expired since", 0, store.ClaimProbe{Probed: true, NextIn: 300 * time.Millisecond}, 400 * time.Millisecond, false},
		// A loop that checks every 2 s (a replica of many sources): a poll
		// just before the next check still finds the last probe, which
		// covers the check interval and half a PollInterval.
		{"a probe just older than the check interval", 2 * time.Second, store.ClaimProbe{Probed: true, NextIn: -1}, 2*time.Second + poll/4, true},
		{"a probe older than the check interval and half a PollInterval", 2 * time.Second, store.ClaimProbe{Probed: true, NextIn: -1}, 2*time.Second + poll/2, false},
	} {
		r.Server.SetClaimProbe(at, max(c.quiet, 25*time.Millisecond), c.probe)
		if got := r.Server.PollCovered(at.Add(c.after)); got != c.skip {
			t.Errorf("%s, %v after the probe: skip %v, want %v", c.what, c.after, got, c.skip)
		}
	}
}

// An idle replica's discovery checks probe the claims, so its poll groups'
// polls skip their claims while nothing is claimable: an idle source with
// an idle relay costs one statement per check, not one more per poll. The
// first event still reaches the relay (the round dispatches it).
func TestAnIdleReplicasChecksTakeThePlaceOfItsClaims(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	// The loop as it checks when it cannot sleep; a sleeping loop's probe:
	// TestASleepingLoopsProbeCoversItsPolls.
	url := pollingDatabase(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, func(c *server.Config) {
		c.PollInterval = 40 * time.Millisecond
		c.DiscoveryIdleInterval = 5 * time.Millisecond
	})
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{RelayId: "relay", MaxInFlight: 4})
	// Each check's probe covers the polls of the next PollInterval (40 ms):
	// a loaded machine delays a check past that now and then, and the poll
	// then claims, as it must (3 claims in 20 polls at a load of 9 on 2
	// cores). Without the checks' probes, every poll claims.
	requirePollsSkipClaims(t, r, 5, 0, 10)
	ids := emit(t, pool, "orders", "a", 1)
	got := recvAll([]outboxv1.RelayService_SubscribeClient{st})
	if d := next(t, got); d.d.GetEvent().GetEventId() != ids[0].String() {
		t.Fatalf("got %v, want the event", d.d)
	}
}

// A quiet loop that checks less often than every half poll interval (a
// replica of many sources spreading its budget of checks) arms each
// check's probe to cover the polls until the next check: its idle relay's
// polls still skip their claims, though most find a probe older than
// PollInterval.
func TestAQuietLoopsProbesCoverThePollsUntilTheNextCheck(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	// A loop that cannot sleep, as in the test above (asleep, its checks and
	// their probes are a second apart: TestASleepingLoopsProbeCoversItsPolls).
	r := startReplica(t, pollingDatabase(t), func(c *server.Config) {
		c.PollInterval = 200 * time.Millisecond
		c.DiscoveryIdleInterval = 5 * time.Millisecond
		c.DiscoveryQuietAfter = 100 * time.Millisecond
		c.DiscoveryQuietInterval = 300 * time.Millisecond
	})
	subscribe(t, ctx, r, &outboxv1.SubscribeRequest{RelayId: "relay", MaxInFlight: 4})
	// Once quiet, a probe covering PollInterval alone would leave about a
	// third of the next 20 polls to claim.
	requirePollsSkipClaims(t, r, 3, 250*time.Millisecond, 2) // a quiet check's probe covers 400 ms
}

// requirePollsSkipClaims watches r's polls: once settle polls have fired
// (the session waits) and the discovery loop has probed (a probe covers the
// polls from now until ahead from now: 0 for a loop that checks often, more
// than PollInterval once a quiet loop's checks probe), the next 20 must skip
// their claims, maxClaims claims allowed. The loop's state is awaited, not
// assumed from the polls: on a loaded machine its first check came 350 ms
// after the relay subscribed, and every poll before it claimed (a test run
// that counted polls alone failed that way: 4 claims in 20).
func requirePollsSkipClaims(t *testing.T, r *replica, settle int64, ahead time.Duration, maxClaims int64) {
	t.Helper()
	claims := countClaims(r)
	var polls atomic.Int64
	r.Server.SetAfterPoll(func() { polls.Add(1) })
	for deadline := time.Now().Add(30 * time.Second); polls.Load() < settle || !r.Server.PollCovered(time.Now().Add(ahead)); {
		if time.Now().After(deadline) {
			t.Fatalf("after %d polls, no probe of the discovery loop's checks covers the polls %v ahead", polls.Load(), ahead)
		}
		time.Sleep(time.Millisecond)
	}
	c0, p0, s0 := claims.Load(), polls.Load(), r.Server.SkippedPolls()
	waitFor(t, func() int32 { return b2i(polls.Load() >= p0+20) })
	c1, p1, s1 := claims.Load(), polls.Load(), r.Server.SkippedPolls()
	if c1-c0 > maxClaims || s1-s0 < uint64(p1-p0-maxClaims) {
		t.Fatalf("an idle relay's group made %d claims over %d polls, %d skipped; want its polls to skip their claims", c1-c0, p1-p0, s1-s0)
	}
}

// A round whose answer is lost after it committed cannot say whether it
// made rows ready, and its NOTIFY, arriving while the round was open, was
// held back by the listener as the round's own echo: the replica must act
// on that wake-up itself, or the ready work waits for a poll (polls are off
// here, so nothing else would make the idle session claim).
func TestAWakeUpHeldBackForARoundWhoseAnswerWasLostIsActedOn(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, func(c *server.Config) { c.NoDispatch = true })
	r.Server.SetNoPolls()
	wakeups := make(chan struct{}, 16)
	r.Server.SetAfterNotify(func(channel string) {
		if channel == store.ChannelWakeup {
			wakeups <- struct{}{}
		}
	})
	var lost atomic.Bool
	r.Server.SetAfterDiscover(func(d store.Discovery, err error) (store.Discovery, error) {
		if err != nil || d.Aggregates == 0 || !lost.CompareAndSwap(false, true) {
			return d, err
		}
		// The round committed and notified; its wake-up reaches the
		// listener while the round is still open, then its answer is lost.
		select {
		case <-wakeups:
		case <-ctx.Done():
			return d, err
		}
		return store.Discovery{}, fmt.Errorf("the answer never came: %w", store.ErrAnswerLost)
	})
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 1, LeaseTtl: durationpb.New(time.Hour)})
	// Its first claim found nothing: it waits, idle, for a wake-up.
	waitFor(t, func() int32 { return b2i(r.Server.IdleSessions() == 1) })
	emit(t, pool, "orders", "a", 1)
	got := make(chan *outboxv1.SubscribeResponse, 1)
	go func() {
		if d, err := st.Recv(); err == nil {
			got <- d
		}
	}()
	select {
	case d := <-got:
		if !lost.Load() || d.GetEvent().GetAggregateKey() != "a" {
			t.Fatalf("delivered %s with the round's answer lost: %t", d.GetEvent().GetAggregateKey(), lost.Load())
		}
	case <-ctx.Done():
		t.Fatal("the event the round made ready was never claimed after its answer was lost")
	}
}

// A wake-up that reaches a member of a poll group with no credit to claim
// with goes to another member. The first session (the longest idle) has
// lent its one unit of credit to a discovery round, held before it is
// sent, when another replica's round makes w, x and y ready and notifies:
// the wake-up goes to the first session, which cannot claim. The second
// must, or w, x and y wait for a poll (polls are off here): the held
// round, let go, dispatches z to the first session, which so never claims
// again, and wakes nobody for the others, which it did not find.
func TestAWakeUpAMemberCannotUseGoesToAnother(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	r.Server.SetNoPolls()
	held, letGo := holdFirstRound(t, r)
	turns := watchDiscoveryTurns(r)
	notified := make(chan struct{}, 16)
	r.Server.SetAfterNotify(func(channel string) {
		if channel == store.ChannelWakeup {
			notified <- struct{}{}
		}
	})
	offers := make(chan int, 64)
	var firstID atomic.Pointer[uuid.UUID]
	r.Server.SetAfterOffer(func(id uuid.UUID, offered int) {
		firstID.CompareAndSwap(nil, &id)
		if id == *firstID.Load() {
			offers <- offered
		}
	})
	first := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 1, LeaseTtl: durationpb.New(time.Hour)})
	waitFor(t, func() int32 { return b2i(r.Server.IdleSessions() == 1) })
	// A round borrows the first session's credit and waits before it is
	// sent (not one that began before the session offered it).
	turns.next(t)
	emit(t, pool, "orders", "w", 1)
	waitClosed(t, held, "no discovery round borrowed the first session's credit")
	// The second joins the group now, idle after the first: the held round
	// borrowed none of its credit.
	second := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 3, LeaseTtl: durationpb.New(time.Hour)})
	waitFor(t, func() int32 { return b2i(r.Server.IdleSessions() == 2) })
	for len(offers) > 0 {
		<-offers
	}
	emit(t, pool, "orders", "x", 1)
	emit(t, pool, "orders", "y", 1)
	// Another replica's round: w, x and y ready, and a NOTIFY.
	if _, err := pool.Exec(ctx, `SELECT * FROM outbox.discover()`); err != nil {
		t.Fatal(err)
	}
	// Found by the held round once let go, and dispatched to the first
	// session with the credit it borrowed.
	emit(t, pool, "orders", "z", 1)
	select {
	case <-notified:
	case <-ctx.Done():
		t.Fatal("the listener never took the other round's wake-up")
	}
	// The wake-up reached the first session, which, its credit lent, offers
	// none and claims nothing.
	select {
	case n := <-offers:
		if n != 0 {
			t.Fatalf("the first session offered %d with its credit lent", n)
		}
	case <-ctx.Done():
		t.Fatal("the first session never turned on the wake-up")
	}
	letGo()
	got := make(chan string, 4)
	recvAll := func(st outboxv1.RelayService_SubscribeClient, n int, who string) {
		for range n {
			d, err := st.Recv()
			if err != nil {
				return
			}
			got <- who + ":" + d.GetEvent().GetAggregateKey()
		}
	}
	go recvAll(first, 1, "first")
	go recvAll(second, 3, "second")
	seen := map[string]bool{}
	for len(seen) < 4 {
		select {
		case k := <-got:
			seen[k] = true
		case <-ctx.Done():
			t.Fatalf("delivered only %v: the wake-up for w, x and y went to a session that could not claim, and no further", seen)
		}
	}
	for _, want := range []string{"first:z", "second:w", "second:x", "second:y"} {
		if !seen[want] {
			t.Fatalf("delivered %v, want %s among them", seen, want)
		}
	}
}

// While a poll group has a member waiting, every discovery check probes
// the claims unless the last probe is younger than half a PollInterval
// (claimProbeWanted): a probe covers the polls for a PollInterval, so a
// poll always finds one that still covers it, and none claims for want of
// a probe. Probing only every PollInterval would leave the polls between
// a probe's PollInterval and the next check that probes to claim. So after
// every check the latest probe is younger than half a PollInterval as of
// the check before (which ended before this one asked). Polls are off, so
// the session, once idle, stays idle: every check has a member waiting.
func TestAnIdleReplicasChecksProbeEveryHalfPollInterval(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	const poll = 100 * time.Millisecond
	r := startReplica(t, testdb.New(t), func(c *server.Config) {
		c.PollInterval = poll
		c.DiscoveryIdleInterval = 5 * time.Millisecond
	})
	r.Server.SetNoPolls()
	subscribe(t, ctx, r, &outboxv1.SubscribeRequest{RelayId: "relay", MaxInFlight: 4})
	waitFor(t, func() int32 { return b2i(r.Server.IdleSessions() == 1) })
	// Each check's end (on the loop's goroutine) and the latest probe then.
	type check struct{ at, probe time.Time }
	checks := make(chan check, 1024)
	r.Server.SetAfterRoundDue(func(bool, error) {
		probe, _ := r.Server.ClaimProbe()
		select {
		case checks <- check{time.Now(), probe}:
		default:
		}
	})
	var prev check
	var from time.Time // the first check after a probe
	for n := 0; from.IsZero() || prev.at.Sub(from) < 3*poll; n++ {
		var c check
		select {
		case c = <-checks:
		case <-ctx.Done():
			t.Fatalf("the discovery loop made %d checks, want checks over %v", n, 3*poll)
		}
		if !prev.at.IsZero() && !prev.probe.IsZero() {
			if from.IsZero() {
				from = prev.at
			}
			if age := prev.at.Sub(c.probe); age >= poll/2 {
				t.Fatalf("a check with a session waiting left the latest probe %v old as of the check before it, want less than half a PollInterval (%v)", age, poll/2)
			}
		}
		prev = c
	}
	if n := r.Server.IdleSessions(); n != 1 {
		t.Fatalf("%d sessions idle, want the one, waiting throughout", n)
	}
}

// A quiet check's probe covers the polls until the check after it, and
// half a PollInterval more (probeCovers): the pause it covers is the one
// the check arms, which ends on the quiet interval's grid and so is
// shorter than the quiet interval the check chose whenever the loop went
// quiet between two points of it (or its check ended past one). Covering
// the chosen pause instead would let the polls after the next check skip
// their claims on this probe whenever that check does not probe (the probe
// being younger than half a PollInterval then), longer than the probe
// speaks for. Every
// quiet check probes here (a session waits, polls off, so it waits
// throughout, and the checks come more than half a PollInterval apart):
// each of its probes must cover exactly the pause it armed and half a
// PollInterval, PollInterval at least.
func TestAQuietChecksProbeCoversThePauseItArms(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	const poll, quietInterval = 200 * time.Millisecond, 300 * time.Millisecond
	r := startReplica(t, pollingDatabase(t), func(c *server.Config) {
		c.PollInterval = poll
		c.DiscoveryIdleInterval = 5 * time.Millisecond
		c.DiscoveryQuietAfter = 100 * time.Millisecond
		c.DiscoveryQuietInterval = quietInterval
	})
	r.Server.SetNoPolls()
	subscribe(t, ctx, r, &outboxv1.SubscribeRequest{RelayId: "relay", MaxInFlight: 4})
	waitFor(t, func() int32 { return b2i(r.Server.IdleSessions() == 1) })
	type pause struct {
		chosen, armed, covers time.Duration
		fresh                 bool // the probe was taken by the check that armed the pause
	}
	pauses := make(chan pause, 64)
	var last time.Time // the loop's last pause, on its goroutine
	r.Server.SetAfterDiscoveryWait(func(chosen, armed time.Duration, at time.Time) {
		probe, covers := r.Server.ClaimProbe()
		fresh := !last.IsZero() && probe.After(last)
		last = at
		select {
		case pauses <- pause{chosen, armed, covers, fresh}:
		default:
		}
	})
	for quiet := 0; quiet < 3; {
		var p pause
		select {
		case p = <-pauses:
		case <-ctx.Done():
			t.Fatalf("the loop made %d quiet checks that probed, want 3", quiet)
		}
		if p.chosen != quietInterval || !p.fresh {
			continue
		}
		quiet++
		if want := max(poll, p.armed+poll/2); p.covers != want {
			t.Fatalf("a quiet check that chose %v and armed %v stored a probe covering %v, want %v (the armed pause and half a PollInterval)",
				p.chosen, p.armed, p.covers, want)
		}
	}
}

// A round that made aggregates ready wakes the poll groups whose filter
// takes one of their streams, and no other: a session that takes only
// payments is not asked to claim for an orders event (a claim that can
// find nothing, one per group and round). Two sessions, one taking orders,
// one payments, wait in two groups; polls are off and nothing is
// dispatched, so only the round's wake-up makes a session claim; the
// round's own NOTIFY, come back on the LISTEN connection, is not a second
// wake-up (TestAWakeUpWakesOneSessionOnce).
func TestARoundWakesOnlyTheGroupsOfTheStreamsItMadeReady(t *testing.T) {
	t.Parallel()
	roundWakesOnlyTheOrdersGroup(t, &outboxv1.SubscribeRequest{RelayId: "payments", Streams: []string{"payments"}, MaxInFlight: 4})
}

// roundWakesOnlyTheOrdersGroup subscribes a session to orders and another
// with filter other (which must not take orders), each fed its first
// payments or orders event, and fails unless a round that made an orders
// aggregate ready woke one poll group and asked one session to claim.
func roundWakesOnlyTheOrdersGroup(t *testing.T, other *outboxv1.SubscribeRequest) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, func(c *server.Config) {
		c.ReplicaID = "waker"
		c.NoDispatch = true // the round makes the aggregate ready
	})
	r.Server.SetNoPolls()
	notified := countWakeupsOnceListening(ctx, t, pool, r, "waker")
	// A stream is subscribed to once it has events.
	emit(t, pool, "orders", "first", 1)
	emit(t, pool, "payments", "first", 1)
	orders := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{RelayId: "orders", Streams: []string{"orders"}, MaxInFlight: 4})
	others := subscribe(t, ctx, r, other)
	for _, st := range []outboxv1.RelayService_SubscribeClient{orders, others} {
		ack(t, r, recv(t, st))
	}
	waitFor(t, func() int32 { return b2i(r.Server.IdleSessions() == 2) })
	n0, g0, w0 := notified.Load(), r.Server.GroupWakeups(), r.Server.Wakeups()

	ids := emit(t, pool, "orders", "a", 1)
	d := recv(t, orders)
	if d.GetEvent().GetEventId() != ids[0].String() {
		t.Fatalf("got %v, want orders/a", d)
	}
	// The round's NOTIFY has come back and been acted on.
	waitFor(t, func() int32 { return b2i(notified.Load() > n0) })
	if w := r.Server.GroupWakeups() - g0; w != 1 {
		t.Errorf("a round that made an orders aggregate ready woke %d poll groups; want one, the orders group's", w)
	}
	if w := r.Server.Wakeups() - w0; w != 1 {
		t.Errorf("%d sessions were asked to claim; want one, the orders session", w)
	}
	ack(t, r, d)
}

// countWakeupsOnceListening counts the outbox_wakeup notices the listener
// of r (replica id replicaID) hears, and returns once it listens (LISTEN
// is the connection's first statement), so that a round's NOTIFY comes
// back to it.
func countWakeupsOnceListening(ctx context.Context, t *testing.T, pool *pgxpool.Pool, r *replica, replicaID string) *atomic.Int64 {
	t.Helper()
	notified := new(atomic.Int64)
	r.Server.SetAfterNotify(func(channel string) {
		if channel == store.ChannelWakeup {
			notified.Add(1)
		}
	})
	waitFor(t, func() int32 { return listenersListening(ctx, pool, replicaID, 0) })
	return notified
}

// terminateListener ends the LISTEN connection of replica replicaID on
// pool's database (once it has one) and returns its backend's pid.
func terminateListener(ctx context.Context, t *testing.T, pool *pgxpool.Pool, replicaID string) int32 {
	t.Helper()
	pid := waitFor(t, func() int32 {
		var pid int32
		_ = pool.QueryRow(ctx, `SELECT pid FROM pg_stat_activity WHERE datname = current_database()
			AND application_name = $1 AND state IS NOT NULL LIMIT 1`, server.ListenerApplicationName+" "+replicaID).Scan(&pid)
		return pid
	})
	if _, err := pool.Exec(ctx, `SELECT pg_terminate_backend($1)`, pid); err != nil {
		t.Fatal(err)
	}
	return pid
}

// listenersListening counts the LISTEN connections of replica replicaID,
// but for the one of backend notPID, that listen on every channel: the
// LISTEN statement, the connection's first, has run.
func listenersListening(ctx context.Context, pool *pgxpool.Pool, replicaID string, notPID int32) int32 {
	var n int32
	_ = pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()
		AND pid <> $2 AND application_name = $1
		AND query <> '' AND (state = 'idle' OR query NOT LIKE 'LISTEN %')`,
		server.ListenerApplicationName+" "+replicaID, notPID).Scan(&n)
	return n
}
