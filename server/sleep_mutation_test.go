package server_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outboxd/outboxd/internal/store"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/server"
)

// The wake-up sweep's tests of the listener's part in the discovery loop's
// sleep (notify.go): what a notice on outbox_discover does, and what it
// must leave alone. Each reads the waker's state in SetAfterNotify's hook,
// which runs on the listener right after it acted on the notice, before it
// can run any op (a try to sleep) or read the next notice.

// A change of producer_wakeups that still lets the replica sleep ('on' to
// 'auto' where the cluster allows no prepared transactions) leaves the
// sleeper asleep, holding its lock: only a setting that forbids the sleep
// wakes it. (Kills N06.)
func TestASettingsChangeThatAllowsTheSleepKeepsTheSleeper(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	rig := newSleepRig(t)
	var mpt int
	if err := rig.pool.QueryRow(ctx, `SELECT current_setting('max_prepared_transactions')::integer`).Scan(&mpt); err != nil {
		t.Fatal(err)
	}
	if mpt != 0 {
		t.Skip("the cluster allows prepared transactions: producer_wakeups 'auto' forbids the sleep here")
	}
	rig.allowSleep(t)
	rig.waitAsleep(t)
	asleep := make(chan bool, 4)
	rig.r.Server.SetAfterNotify(func(channel string) {
		if channel == store.ChannelDiscover {
			asleep <- rig.r.Server.DiscoveryAsleep()
		}
	})
	if _, err := rig.pool.Exec(ctx, `UPDATE outbox.settings SET producer_wakeups = 'auto'`); err != nil {
		t.Fatal(err)
	}
	select {
	case a := <-asleep:
		if !a {
			t.Fatal("a change of producer_wakeups that still allows the sleep woke the sleeper")
		}
	case <-ctx.Done():
		t.Fatal("the listener never acted on the settings notice")
	}
	if !sleeperHeld(ctx, t, rig.pool) {
		t.Error("a change of producer_wakeups that still allows the sleep made the sleeper give its lock back")
	}
}

// A loop that does not sleep is not woken by outbox_discover: a producer's
// notice (sent because another session holds the sleeper's lock) is for
// the sleeper alone, and a change of producer_wakeups that forbids the
// sleep has no sleep of this replica to end. Forced: the loop is held just
// before a try to sleep, so a wake-up given to it would wait, unread, in
// its channel when the hook looks. (Kills N05, N27.)
func TestAnAwakeLoopIsNotWokenByDiscoverNotices(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	url := pollingDatabase(t)
	pool := testdb.NewPoolURL(t, url)
	if _, err := pool.Exec(ctx, `UPDATE outbox.settings SET producer_wakeups = 'on'`); err != nil {
		t.Fatal(err)
	}
	// Another session sleeps: it holds the sleeper's lock, so producers
	// notify, and this replica's tries to sleep fail.
	holder, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Close(context.WithoutCancel(ctx))
	if _, err := holder.Exec(ctx, `SELECT pg_advisory_lock(7954802400917419383)`); err != nil {
		t.Fatal(err)
	}
	r := startReplica(t, url, func(c *server.Config) { c.ReplicaID = "awake" })
	held, release := make(chan struct{}), make(chan struct{})
	var holdOnce, releaseOnce sync.Once
	letGo := func() { releaseOnce.Do(func() { close(release) }) }
	t.Cleanup(letGo) // a failed test must not leave the loop held
	r.Server.SetSleepHooks(func() {
		holdOnce.Do(func() {
			close(held)
			<-release
		})
	}, nil)
	select {
	case <-held:
	case <-ctx.Done():
		t.Fatal("the loop made no try to sleep")
	}
	waitFor(t, func() int32 { return b2i(r.Server.ListenerConnected()) })
	if n := r.Server.DiscoverWakePending(); n != 0 {
		t.Fatalf("a wake-up waits for the awake loop before any notice: %d", n)
	}
	pending := make(chan int, 4)
	r.Server.SetAfterNotify(func(channel string) {
		if channel == store.ChannelDiscover {
			pending <- r.Server.DiscoverWakePending()
		}
	})
	next := func(what string) {
		t.Helper()
		select {
		case n := <-pending:
			if n != 0 {
				t.Fatalf("%s woke the loop, which does not sleep", what)
			}
		case <-ctx.Done():
			t.Fatalf("the listener never acted on %s", what)
		}
	}
	emit(t, pool, "orders", "k", 1)
	next("a producer's notice")
	if _, err := pool.Exec(ctx, `UPDATE outbox.settings SET producer_wakeups = 'off'`); err != nil {
		t.Fatal(err)
	}
	next("turning producer_wakeups off")
	if r.Server.DiscoveryAsleep() {
		t.Fatal("the loop that never slept is said to sleep")
	}
	letGo()
}
