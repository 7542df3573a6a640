package server_test

import (
	"context"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/server"
)

// A running replica's clean-up removes the session rows other replicas
// stopped refreshing and spares its own, even one whose refresh is late:
// the row of a crashed replica goes, and in the same statement a stale row
// of this replica would have gone too.
func TestReplicaCleanupSparesItsOwnStaleSessionRows(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	if _, err := pool.Exec(ctx, `INSERT INTO outbox.relay_session
		    (session_id, relay_id, peer, replica_id, streams, max_in_flight, connected_at, seen_at)
		VALUES (gen_random_uuid(), 'r', 'p', 'me', '{}', 1, now(), now() - interval '1 hour'),
		       (gen_random_uuid(), 'r', 'p', 'crashed', '{}', 1, now(), now() - interval '1 hour')`); err != nil {
		t.Fatal(err)
	}
	startReplica(t, url, func(c *server.Config) {
		c.ReplicaID = "me"
		c.SessionRefreshInterval = 10 * time.Millisecond
	})
	rows := func(replica string) int32 {
		var n int32
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox.relay_session WHERE replica_id = $1`, replica).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	waitFor(t, func() int32 { return b2i(rows("crashed") == 0) })
	if n := rows("me"); n != 1 {
		t.Fatalf("the replica's clean-up removed %d of its own session rows", 1-n)
	}
}

// Without Retention the janitor deletes nothing, however short
// JanitorInterval is: published events are kept for good. The replica's
// session refresh loop, turning 20 times at 5 ms, is the test's clock
// against a janitor that would run every millisecond.
func TestNoRetentionKeepsPublishedEvents(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	ids := emit(t, pool, "orders", "o-1", 1)
	var turns atomic.Int32
	r := startReplica(t, url, func(c *server.Config) {
		c.JanitorInterval = time.Millisecond
		c.SessionRefreshInterval = 5 * time.Millisecond
	})
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 1})
	ackPublished(t, r, recv(t, st))
	if publishedAt(t, pool, ids[0].String()) == nil {
		t.Fatal("the acked event is not published")
	}
	r.Server.SetAfterLoopWait(func(loop string, _, _ time.Duration, _ time.Time) {
		if loop == "refresh" {
			turns.Add(1)
		}
	})
	waitFor(t, func() int32 { return b2i(turns.Load() >= 20) })
	if n := countWhere(t, pool, "outbox.event", "true"); n != 1 {
		t.Fatalf("%d events left without Retention, want the published one kept", n)
	}
}

// A relay session counts as alive for three refresh intervals after its
// last refresh, so one slow refresh of its replica does not hide it:
// ListRelays shows another replica's session refreshed two intervals ago,
// and not one refreshed four intervals ago.
func TestListRelaysKeepsASessionForThreeRefreshIntervals(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, func(c *server.Config) { c.SessionRefreshInterval = time.Minute })
	if _, err := pool.Exec(ctx, `INSERT INTO outbox.relay_session
		    (session_id, relay_id, peer, replica_id, streams, max_in_flight, connected_at, seen_at)
		VALUES (gen_random_uuid(), 'late', 'p', 'other', '{}', 1, now(), now() - interval '2 minutes'),
		       (gen_random_uuid(), 'gone', 'p', 'other', '{}', 1, now(), now() - interval '4 minutes')`); err != nil {
		t.Fatal(err)
	}
	res, err := r.Admin.ListRelays(ctx, &outboxv1.ListRelaysRequest{})
	if err != nil {
		t.Fatal(err)
	}
	var relays []string
	for _, rl := range res.GetRelays() {
		relays = append(relays, rl.GetRelayId())
	}
	if !slices.Equal(relays, []string{"late"}) {
		t.Fatalf("ListRelays with refresh every minute: %v, want [late] (seen 2 minutes ago; gone, seen 4 minutes ago, is not)", relays)
	}
}
