package server_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/store"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/server"
)

// sleepRig is a replica whose discovery loop may sleep while its source is
// quiet, woken by the producers' commits (doc.go, Discovery), with its
// tries to sleep and its pauses watched. A sleeping loop's own checks come
// an hour apart, so that an event reaches delivery during a test only
// through a producer's notice, or through the check the loop makes right
// after it fell asleep.
type sleepRig struct {
	url  string
	pool *pgxpool.Pool
	r    *replica
	// checks counts the loop's checks (store.RoundDue).
	checks atomic.Int64
	// asleep receives when the loop arms a sleeping pause.
	asleep chan struct{}
	// tries receives the outcome of every try to sleep.
	tries chan bool
	// beforeTry, when set, runs on the loop just before a try to sleep.
	beforeTry atomic.Pointer[func()]
}

// newSleepRig starts the replica on a database whose producer_wakeups is
// off, so that no try to sleep succeeds before the test has set what it
// watches with and called allowSleep.
func newSleepRig(t *testing.T, configure ...func(*server.Config)) *sleepRig {
	t.Helper()
	url := pollingDatabase(t)
	rig := &sleepRig{url: url, pool: testdb.NewPoolURL(t, url)}
	rig.r = startReplica(t, url, func(c *server.Config) {
		c.ReplicaID = "sleeper"
		for _, f := range configure {
			f(c)
		}
	})
	rig.watch(rig.r)
	// A try to sleep fails while the LISTEN connection is not up, which
	// on a busy host can outlast the loop's first checks: the tests mean
	// their tries to meet only the conditions they set.
	waitFor(t, func() int32 { return b2i(rig.r.Server.ListenerConnected()) })
	return rig
}

// allowSleep turns the database's producer_wakeups on: the loop tries again
// within sleepRetry (a second) of a try the setting refused.
// (Called on the loop by a hook, it reports a failure with t.Error.)
func (rig *sleepRig) allowSleep(t *testing.T) {
	t.Helper()
	if _, err := rig.pool.Exec(t.Context(), `UPDATE outbox.settings SET producer_wakeups = 'on'`); err != nil {
		t.Error(err)
	}
}

// onNextTry runs f once, on the loop, just before its next try to sleep.
func (rig *sleepRig) onNextTry(f func()) {
	var once atomic.Bool
	g := func() {
		if once.CompareAndSwap(false, true) {
			// What tries tells from here on is this try's outcome.
			for len(rig.tries) > 0 {
				<-rig.tries
			}
			f()
		}
	}
	rig.beforeTry.Store(&g)
}

// watch sets r's hooks to feed the rig.
func (rig *sleepRig) watch(r *replica) {
	rig.asleep, rig.tries = make(chan struct{}, 1), make(chan bool, 16)
	r.Server.SetAsleepCheckInterval(time.Hour)
	r.Server.SetAfterRoundDue(func(bool, error) { rig.checks.Add(1) })
	r.Server.SetAfterDiscoveryWait(func(chosen, _ time.Duration, _ time.Time) {
		if chosen == time.Hour {
			select {
			case rig.asleep <- struct{}{}:
			default:
			}
		}
	})
	r.Server.SetSleepHooks(func() {
		if f := rig.beforeTry.Load(); f != nil {
			(*f)()
		}
	}, func(asleep bool) {
		select {
		case rig.tries <- asleep:
		default:
		}
	})
}

// nextTry returns the outcome of the loop's next try to sleep.
func (rig *sleepRig) nextTry(ctx context.Context, t *testing.T) bool {
	t.Helper()
	select {
	case asleep := <-rig.tries:
		return asleep
	case <-ctx.Done():
		t.Fatal("the loop made no try to sleep")
		return false
	}
}

// waitAsleep waits until the loop sleeps, its check after the lock made.
func (rig *sleepRig) waitAsleep(t *testing.T) {
	t.Helper()
	select {
	case <-rig.asleep:
	case <-time.After(30 * time.Second):
		t.Fatal("the discovery loop never fell asleep")
	}
}

// recvAndAck receives the next delivery on st, which must be of aggregate
// key (else the test fails, saying why it wanted it), and acks it.
func recvAndAck(t *testing.T, r *replica, st outboxv1.RelayService_SubscribeClient, key, why string) {
	t.Helper()
	d := recv(t, st)
	if d.GetEvent().GetAggregateKey() != key {
		t.Fatalf("got %v, want %s", d.GetEvent(), why)
	}
	ack(t, r, d)
}

// sleeperHeld says whether a session of the rig's database holds the
// sleeper's lock (outbox.discovery_sleep's advisory key, 7954802400917419383,
// as pg_locks splits it).
func sleeperHeld(ctx context.Context, t *testing.T, pool *pgxpool.Pool) bool {
	t.Helper()
	var held bool
	if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_locks l JOIN pg_database d ON d.oid = l.database
		WHERE d.datname = current_database() AND l.locktype = 'advisory' AND l.granted AND l.mode = 'ExclusiveLock'
		AND l.classid = 1852121763 AND l.objid = 622556535 AND l.objsubid = 1)`).Scan(&held); err != nil {
		t.Fatal(err)
	}
	return held
}

// A sleeping loop makes no checks: a producer's commit wakes it (NOTIFY
// outbox_discover, sent because the producer found the sleeper's lock
// taken), and its round delivers the event. A burst (a round that finds
// more than one event) ends the sleep: the lock is given back, so busy
// producers do not notify, and the loop polls until it is quiet again.
func TestASleepingLoopIsWokenByTheProducersCommit(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	rig := newSleepRig(t)
	rig.allowSleep(t)
	st := subscribe(t, ctx, rig.r, &outboxv1.SubscribeRequest{MaxInFlight: 4})
	rig.waitAsleep(t)
	if !sleeperHeld(ctx, t, rig.pool) {
		t.Fatal("the loop sleeps but nobody holds the sleeper's lock: producers would not wake it")
	}

	checks := rig.checks.Load()
	emit(t, rig.pool, "orders", "lone", 1)
	recvAndAck(t, rig.r, st, "lone", "the lone event")
	if n := rig.checks.Load() - checks; n != 0 {
		t.Errorf("the sleeping loop made %d checks before it delivered the event; want none (the producer's notice)", n)
	}

	// Awake, the loop tries to sleep again once a check finds nothing; by
	// then it has given the lock back.
	heldAtTry := make(chan bool, 1)
	rig.onNextTry(func() { heldAtTry <- sleeperHeld(ctx, t, rig.pool) })
	if _, err := rig.pool.Exec(ctx, `INSERT INTO outbox.event (stream, aggregate_key, event_type, payload)
		SELECT 'orders', 'burst-' || i, 'T', '{}' FROM generate_series(1, 3) i`); err != nil {
		t.Fatal(err)
	}
	burst := []*outboxv1.SubscribeResponse{recv(t, st), recv(t, st), recv(t, st)}
	ack(t, rig.r, burst...)
	select {
	case held := <-heldAtTry:
		if held {
			t.Error("after a round of three events the loop kept the sleeper's lock: busy producers would notify")
		}
	case <-ctx.Done():
		t.Fatal("after a round of three events the loop never tried to sleep again: it never woke")
	}
	rig.waitAsleep(t)
}

// The loop falls asleep only once no producer's insert is uncommitted: a
// producer that inserted first holds the sleeper's key shared until it
// commits, so the loop's try fails (had it slept, that producer, which saw
// nobody asleep, would not notify, and its event would wait for the
// sleeping loop's next check). Awake, the loop's checks find the event.
func TestAnUncommittedProducerKeepsTheLoopAwake(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	rig := newSleepRig(t)
	// Just before the next try to sleep, which it allows, a producer
	// inserts, and stays uncommitted.
	var tx pgx.Tx // set before inserted is closed
	inserted := make(chan struct{})
	rig.onNextTry(func() {
		defer close(inserted)
		rig.allowSleep(t)
		var err error
		if tx, err = rig.pool.Begin(ctx); err != nil {
			t.Error(err)
			return
		}
		if _, err := tx.Exec(ctx, `INSERT INTO outbox.event (stream, aggregate_key, event_type, payload)
			VALUES ('orders', 'open', 'T', '{}')`); err != nil {
			t.Error(err)
		}
	})
	st := subscribe(t, ctx, rig.r, &outboxv1.SubscribeRequest{MaxInFlight: 4})
	select {
	case <-inserted:
	case <-ctx.Done():
		t.Fatal("the loop never tried to sleep")
	}
	if tx == nil {
		t.FailNow()
	}
	defer func() { _ = tx.Rollback(context.Background()) }()
	if rig.nextTry(ctx, t) {
		t.Fatal("the loop fell asleep while a producer's insert was uncommitted: that event would notify nobody")
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	recvAndAck(t, rig.r, st, "open", "the event committed after the loop's try")
}

// An event committed between the check that found nothing and the loop's
// lock notified nobody (nobody slept yet): the check the loop makes once it
// holds the lock finds it.
func TestAnEventCommittedJustBeforeTheSleepIsFound(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	rig := newSleepRig(t)
	// Just before the next try to sleep, which it allows, a producer
	// commits an event.
	rig.onNextTry(func() {
		rig.allowSleep(t)
		if _, err := rig.pool.Exec(ctx, `INSERT INTO outbox.event (stream, aggregate_key, event_type, payload)
			VALUES ('orders', 'just-before', 'T', '{}')`); err != nil {
			t.Error(err)
		}
	})
	st := subscribe(t, ctx, rig.r, &outboxv1.SubscribeRequest{MaxInFlight: 4})
	recvAndAck(t, rig.r, st, "just-before", "the event committed just before the loop slept")
	if !rig.nextTry(ctx, t) {
		t.Error("the loop's try to sleep failed; the test meant it to succeed")
	}
}

// The sleep is held on the LISTEN connection: when that is lost, the lock
// goes with it (producers stop notifying) and the loop is told, so it
// checks again rather than wait for a notice that no longer comes, and
// sleeps again once the listener is back.
func TestALostListenerEndsTheSleep(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	rig := newSleepRig(t)
	rig.allowSleep(t)
	st := subscribe(t, ctx, rig.r, &outboxv1.SubscribeRequest{MaxInFlight: 4})
	rig.waitAsleep(t)
	old := terminateListener(ctx, t, rig.pool, "sleeper")
	waitFor(t, func() int32 { return listenersListening(ctx, rig.pool, "sleeper", old) })
	emit(t, rig.pool, "orders", "after-loss", 1)
	recvAndAck(t, rig.r, st, "after-loss", "the event committed after the listener came back")
	rig.waitAsleep(t)
	if !sleeperHeld(ctx, t, rig.pool) {
		t.Error("asleep again, but nobody holds the sleeper's lock")
	}
}

// Only one replica sleeps (the lock is exclusive); another keeps checking,
// and an event is delivered whichever finds it.
func TestOnlyOneReplicaSleeps(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	rig := newSleepRig(t)
	rig.allowSleep(t)
	rig.waitAsleep(t)
	other := &sleepRig{}
	r2 := startReplica(t, rig.url, func(c *server.Config) { c.ReplicaID = "awake" })
	other.watch(r2)
	if other.nextTry(ctx, t) {
		t.Fatal("a second replica fell asleep beside the first")
	}
	checks := other.checks.Load()
	waitFor(t, func() int32 { return b2i(other.checks.Load() >= checks+3) })
	st := subscribe(t, ctx, r2, &outboxv1.SubscribeRequest{MaxInFlight: 4})
	emit(t, rig.pool, "orders", "either", 1)
	recvAndAck(t, r2, st, "either", "the event, from the replica that checks")
}

// A round as large as its bound (here DiscoveryMaxEvents = 1) leaves the
// rest of what the notices announced in outbox.event: the loop wakes and
// goes on, rather than sleep on events no producer will announce again.
// Forced: the notices of the second and third commits come while the round
// the first one woke (which found the first) waits, so they wake the loop
// once, not twice.
func TestASleepingLoopsFullRoundGoesOn(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	rig := newSleepRig(t, func(c *server.Config) { c.DiscoveryMaxEvents = 1 })
	rig.allowSleep(t)
	st := subscribe(t, ctx, rig.r, &outboxv1.SubscribeRequest{MaxInFlight: 4})
	rig.waitAsleep(t)
	var notices atomic.Int64
	rig.r.Server.SetAfterNotify(func(channel string) {
		if channel == store.ChannelDiscover {
			notices.Add(1)
		}
	})
	inRound, goOn := make(chan struct{}), make(chan struct{})
	var goOnce sync.Once
	letGo := func() { goOnce.Do(func() { close(goOn) }) }
	t.Cleanup(letGo) // a failed test must not leave the loop held
	var once atomic.Bool
	rig.r.Server.SetAfterDiscover(func(d store.Discovery, err error) (store.Discovery, error) {
		if once.CompareAndSwap(false, true) {
			close(inRound)
			<-goOn
		}
		return d, err
	})
	var ids []string
	ids = append(ids, emit(t, rig.pool, "orders", "first", 1)[0].String())
	select {
	case <-inRound:
	case <-ctx.Done():
		t.Fatal("the producer's notice started no round")
	}
	for _, key := range []string{"second", "third"} {
		ids = append(ids, emit(t, rig.pool, "orders", key, 1)[0].String())
	}
	waitFor(t, func() int32 { return b2i(notices.Load() >= 3) })
	letGo()
	// In any order: the aggregates are three, and the held round dispatches
	// only credit lent to it when it began; without any, it makes 'first'
	// ready for a claim, and the next round's dispatch of 'second' can
	// reach the relay first (CI saw it).
	want := map[string]bool{}
	for _, id := range ids {
		want[id] = true
	}
	for range ids {
		d := recv(t, st)
		id := d.GetEvent().GetEventId()
		if !want[id] {
			t.Fatalf("got %v, want one of %v not yet delivered", d.GetEvent(), want)
		}
		delete(want, id)
		ack(t, rig.r, d)
	}
}

// Turning producer_wakeups off reaches a replica that sleeps already: it
// gives the lock back at once (from then on producers do not notify, and a
// prepared transaction cannot fail for it) and does not sleep again. The
// outboxd_discovery_asleep gauge follows.
func TestTurningWakeupsOffWakesTheSleeper(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	reg := prometheus.NewPedanticRegistry()
	rig := newSleepRig(t, func(c *server.Config) { c.Registerer = reg })
	if got := gatherSum(t, reg, "outboxd_discovery_asleep"); got != 0 {
		t.Fatalf("outboxd_discovery_asleep = %v under producer_wakeups off, want 0", got)
	}
	rig.allowSleep(t)
	rig.waitAsleep(t)
	if got := gatherSum(t, reg, "outboxd_discovery_asleep"); got != 1 {
		t.Fatalf("outboxd_discovery_asleep = %v while the loop sleeps, want 1", got)
	}
	for len(rig.tries) > 0 { // asleep, the loop makes no tries meanwhile
		<-rig.tries // (its try that fell asleep, which nextTry must not read)
	}
	// The gauge as the woken loop finds it before it tries again (a try
	// that fails would set it too).
	type gathered struct {
		mfs []*dto.MetricFamily
		err error
	}
	atTry := make(chan gathered, 1)
	rig.onNextTry(func() {
		mfs, err := reg.Gather()
		atTry <- gathered{mfs, err}
	})
	if _, err := rig.pool.Exec(ctx, `UPDATE outbox.settings SET producer_wakeups = 'off'`); err != nil {
		t.Fatal(err)
	}
	if rig.nextTry(ctx, t) {
		t.Fatal("the loop fell asleep again under producer_wakeups off")
	}
	if sleeperHeld(ctx, t, rig.pool) {
		t.Error("under producer_wakeups off a replica still holds the sleeper's lock")
	}
	g := <-atTry
	if g.err != nil {
		t.Fatal(g.err)
	}
	if got := sumFamilies(g.mfs, "outboxd_discovery_asleep"); got != 0 {
		t.Errorf("outboxd_discovery_asleep = %v once the loop woke, want 0", got)
	}
}

// A sleeping loop checks rarely, so the check it makes as it falls asleep
// probes the claims afresh, rather than leave the polls a probe taken to
// cover one PollInterval: its probe covers the polls until the next check
// (an hour away here), so an idle relay's polls skip their claims all the
// while. Forced: with a PollInterval of 10 s, the probe before the sleep
// is never old enough (half a PollInterval) for the next check to renew it
// by age, and covers 10 s only.
func TestASleepingLoopsProbeCoversItsPolls(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	rig := newSleepRig(t, func(c *server.Config) { c.PollInterval = 10 * time.Second })
	// The session waits, idle in its group for good (no polls take it out
	// to claim), before the loop may sleep: the checks have a group to
	// probe for. It offers its credit once it waits.
	rig.r.Server.SetNoPolls()
	waiting := make(chan struct{}, 1)
	rig.r.Server.SetAfterOffer(func(_ uuid.UUID, offered int) {
		select {
		case waiting <- struct{}{}:
		default:
		}
	})
	subscribe(t, ctx, rig.r, &outboxv1.SubscribeRequest{RelayId: "relay", MaxInFlight: 4})
	select {
	case <-waiting:
	case <-ctx.Done():
		t.Fatal("the session never waited")
	}
	rig.allowSleep(t)
	rig.waitAsleep(t)
	if !rig.r.Server.PollCovered(time.Now().Add(30 * time.Second)) {
		t.Error("asleep, the loop's last probe does not cover the polls 30 s from now (its next check is an hour away): idle polls would claim")
	}
}
