package server_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/outboxd/outboxd/internal/store"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/server"
)

// A round as large as its bound (DiscoveryMaxEvents here; the credit of a
// saturated replica's sessions likewise) leaves the rest of the backlog
// there, and is followed after DiscoveryInterval (Config.DiscoveryMaxEvents:
// "the rest of the backlog is there already"), also when it found a single
// event after a quiet spell: that is a backlog taken in parts, not a lone
// event in a trickle, whose half idle interval is for checks that would
// almost never find the next event. Two events, each its own transaction,
// commit while discovery's lock is held, after the loop went quiet; with
// DiscoveryMaxEvents 1 the first round takes one of them.
func TestARoundAsLargeAsItsBoundIsNotATrickle(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	const interval, idle = time.Millisecond, time.Second
	r := startReplica(t, url, func(c *server.Config) {
		c.DiscoveryInterval, c.DiscoveryIdleInterval = interval, idle
		c.DiscoveryMaxEvents = 1
	})
	// Quiet for more than the idle interval: the loop started (which counts
	// as activity) and backed off to the idle interval since.
	awaitClosed(t, ctx, pauseChosen(r, func(w time.Duration) bool { return w == idle }),
		"the discovery loop never backed off to the idle interval")
	var found atomic.Int64
	r.Server.SetAfterDiscover(func(d store.Discovery, err error) (store.Discovery, error) {
		if err == nil && d.Events > 0 {
			found.CompareAndSwap(0, d.Events)
		}
		return d, err
	})
	pauses := make(chan time.Duration, 1)
	var sent atomic.Bool
	r.Server.SetAfterDiscoveryWait(func(chosen, _ time.Duration, _ time.Time) {
		if found.Load() > 0 && sent.CompareAndSwap(false, true) {
			pauses <- chosen
		}
	})
	release := holdDiscovery(ctx, t, pool)
	emit(t, pool, "orders", "a", 1)
	emit(t, pool, "orders", "b", 1)
	release()
	select {
	case p := <-pauses:
		if n := found.Load(); n != 1 {
			t.Fatalf("the first round took %d events, want 1 (DiscoveryMaxEvents)", n)
		}
		if p != interval {
			t.Fatalf("after a round as large as DiscoveryMaxEvents (one event of two) the loop paused %v, want DiscoveryInterval (%v): the rest of the backlog is there already", p, interval)
		}
	case <-ctx.Done():
		t.Fatal("no round found the events")
	}
}
