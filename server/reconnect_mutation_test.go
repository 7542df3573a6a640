package server_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/protobuf/types/known/durationpb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/store"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/server"
)

// A wake-up notified while a replica's LISTEN connection was down is not
// lost: once it listens again, the listener wakes an idle session of every
// poll group, whose claim finds the work. Forced: the listener is held in
// its notification hook while its backend is ended and another replica's
// round makes an event ready (its NOTIFY reaches nobody of the held
// replica), and the held replica's sessions never poll and its discovery
// never runs again, so only the wake-up on reconnecting can deliver the
// event. (Kills N24.)
func TestAWakeUpNotifiedWhileTheListenerWasDownIsActedOn(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute) // every emit and wait is bounded
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	deaf := quietReplica(t, url, func(c *server.Config) {
		c.ReplicaID = "deaf"
		// One round at start, then none within the test.
		c.DiscoveryInterval, c.DiscoveryIdleInterval = time.Hour, time.Hour
	})
	discoverer := startReplica(t, url, func(c *server.Config) { c.ReplicaID = "discoverer" })
	st := subscribe(t, ctx, deaf, &outboxv1.SubscribeRequest{MaxInFlight: 4, LeaseTtl: durationpb.New(time.Hour)})
	waitFor(t, func() int32 { return int32(deaf.Server.IdleSessions()) })
	waitFor(t, func() int32 { return listenersListening(ctx, pool, "deaf", 0) })

	old, letGo := holdListenerDown(ctx, t, pool, deaf, "deaf")

	// The discoverer's round makes the event ready and notifies; deaf's
	// listener, gone, does not hear it.
	var ready atomic.Bool
	madeReady := make(chan struct{})
	discoverer.Server.SetAfterDiscover(func(d store.Discovery, err error) (store.Discovery, error) {
		if err == nil && d.Aggregates > 0 && ready.CompareAndSwap(false, true) {
			close(madeReady)
		}
		return d, err
	})
	ids := emit(t, pool, "orders", "while-deaf", 1)
	select {
	case <-madeReady:
	case <-ctx.Done():
		t.Fatal("the discoverer's round never made the event ready")
	}
	letGo()
	waitFor(t, func() int32 { return listenersListening(ctx, pool, "deaf", old) })
	if d := recv(t, st); d.GetEvent().GetEventId() != ids[0].String() {
		t.Fatalf("got %v, want the event made ready while deaf's listener was down", d.GetEvent())
	}
}

// A lease that ended away from its holder's replica while that replica's
// LISTEN connection was down (an operator's skip on another replica, whose
// NOTIFY outbox_released reached nobody of the holder's replica) is found
// gone once the listener is back: every session reconciles its leases,
// and the credit the skipped lease held claims the event that waited for
// it. Forced as above: the holder's listener is held in its hook while its
// backend is ended and the skip commits, and its sessions never poll nor
// reconcile by their ticks. (Kills N25.)
func TestALeaseEndedWhileTheListenerWasDownIsFoundGone(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute) // every emit and wait is bounded
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	holder := quietReplica(t, url, func(c *server.Config) { c.ReplicaID = "holder" })
	operator := startReplica(t, url, func(c *server.Config) { c.ReplicaID = "operator" })
	st := subscribe(t, ctx, holder, &outboxv1.SubscribeRequest{MaxInFlight: 1, LeaseTtl: durationpb.New(time.Hour)})
	emit(t, pool, "orders", "first", 1)
	emit(t, pool, "orders", "second", 1)
	held := recv(t, st) // its one credit; the other event waits for it
	waitFor(t, func() int32 { return listenersListening(ctx, pool, "holder", 0) })

	old, letGo := holdListenerDown(ctx, t, pool, holder, "holder")
	if _, err := operator.Admin.SkipEvent(ctx, &outboxv1.SkipEventRequest{EventId: held.GetEvent().GetEventId(), Reason: "poison"}); err != nil {
		t.Fatal(err)
	}
	letGo()
	waitFor(t, func() int32 { return listenersListening(ctx, pool, "holder", old) })
	d := recv(t, st)
	if d.GetEvent().GetEventId() == held.GetEvent().GetEventId() || d.GetEvent().GetStream() != "orders" {
		t.Fatalf("got %v, want the event that waited for the skipped lease's credit", d.GetEvent())
	}
}

// holdListenerDown holds r's LISTEN connection in its notification hook (on
// a notice of its own) and ends its backend, so that r hears no notice
// until letGo, after which the listener connects again. old is the ended
// backend's pid, for listenersListening.
func holdListenerDown(ctx context.Context, t *testing.T, pool *pgxpool.Pool, r *replica, replicaID string) (old int32, letGo func()) {
	t.Helper()
	inHook, release := make(chan struct{}), make(chan struct{})
	var holdOnce, releaseOnce sync.Once
	letGo = func() { releaseOnce.Do(func() { close(release) }) }
	t.Cleanup(letGo) // a failed test must not leave the listener held
	r.Server.SetAfterNotify(func(channel string) {
		if channel == store.ChannelReleased {
			holdOnce.Do(func() {
				close(inHook)
				<-release
			})
		}
	})
	if _, err := pool.Exec(ctx, `SELECT pg_notify('outbox_released', 'hold')`); err != nil {
		t.Fatal(err)
	}
	select {
	case <-inHook:
	case <-ctx.Done():
		t.Fatalf("%s's listener never heard the notice that holds it", replicaID)
	}
	return terminateListener(ctx, t, pool, replicaID), letGo
}
