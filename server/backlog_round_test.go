package server_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/jackc/pgx/v5/pgxpool"
	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/store"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/server"
)

// discoveryLockKey is the advisory lock discovery rounds take turns with
// ('outboxd.discover' in outbox.discover_scan): a test that holds it keeps
// rounds from running, so that events committed meanwhile are found by one
// round.
const discoveryLockKey = 7954802400917419382

// A round that found more aggregates than Config.DiscoveryMaxFound hands the
// replica only the oldest to choose dispatches from, yet makes every one
// deliverable, and, since it cannot tell the streams of those it did not
// return, wakes every waiting session: a session whose stream only the
// unreturned aggregates hold gets them at once, not at its next poll.
func TestRoundOverMoreThanMaxFoundWakesEverySession(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	type round struct{ events, dispatched int }
	seen := make(chan round, 16)
	r := startReplica(t, url, func(c *server.Config) { c.DiscoveryMaxFound = 2 })
	// No poll rescues a session the round did not wake (a poll group polls
	// from 2 ms on after a claim found work, whatever PollInterval says).
	r.Server.SetNoPolls()
	r.Server.SetAfterDiscover(func(d store.Discovery, err error) (store.Discovery, error) {
		if err == nil && d.Events > 0 {
			seen <- round{int(d.Events), len(d.Dispatched)}
		}
		return d, err
	})
	ttl := durationpb.New(time.Hour)
	// A stream with no event yet cannot be subscribed to: one each,
	// delivered and acked before the round under test.
	emit(t, pool, "a", "seed", 1)
	emit(t, pool, "b", "seed", 1)
	// One unit of credit: the round dispatches the oldest aggregate to it
	// and leaves the second one it returned ready, so stream a is among
	// the streams it could name.
	stA := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{RelayId: "relay-a", MaxInFlight: 1, Streams: []string{"a"}, LeaseTtl: ttl})
	stB := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{RelayId: "relay-b", MaxInFlight: 10, Streams: []string{"b"}, LeaseTtl: ttl})
	ack(t, r, recv(t, stA))
	ack(t, r, recv(t, stB))
	for r.Server.IdleSessions() < 2 {
		select {
		case <-ctx.Done():
			t.Fatal("the two sessions never waited for work")
		case <-time.After(5 * time.Millisecond):
		}
	}
	// The seeds' rounds are done with.
	for len(seen) > 0 {
		<-seen
	}

	release := holdDiscovery(ctx, t, pool)
	// Oldest first: a's two aggregates, then b's three, each in its own
	// transaction, all found by the one round that runs once the lock is
	// given back.
	a1 := emit(t, pool, "a", "a1", 1)[0]
	a2 := emit(t, pool, "a", "a2", 1)[0]
	var b []string
	for _, key := range []string{"b1", "b2", "b3"} {
		b = append(b, emit(t, pool, "b", key, 1)[0].String())
	}
	release()
	select {
	case rd := <-seen:
		// Only the two oldest were the replica's to choose from, and the
		// session of stream a had credit for one: b's were not
		// dispatched, whatever credit their session offered.
		if rd.events != 5 || rd.dispatched != 1 {
			t.Fatalf("the round found %d events and dispatched %d, want all 5 found and only a1 dispatched", rd.events, rd.dispatched)
		}
	case <-ctx.Done():
		t.Fatal("no round found the events")
	}

	got := map[string]bool{}
	for range b {
		got[recv(t, stB).GetEvent().GetEventId()] = true
	}
	for _, id := range b {
		if !got[id] {
			t.Fatalf("session of stream b got %v, want %v", got, b)
		}
	}
	d := recv(t, stA)
	if d.GetEvent().GetEventId() != a1.String() {
		t.Fatalf("session of stream a got %s first, want the oldest, %s", d.GetEvent().GetEventId(), a1)
	}
	ack(t, r, d)
	if d := recv(t, stA); d.GetEvent().GetEventId() != a2.String() {
		t.Fatalf("session of stream a got %s, want %s", d.GetEvent().GetEventId(), a2)
	}
}

// A backlog larger than Config.DiscoveryMaxEvents is found in several
// rounds of whole transactions, every event once.
func TestBacklogIsFoundInRoundsOfMaxEvents(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	found := make(chan int64, 16)
	r := startReplica(t, url, func(c *server.Config) { c.DiscoveryMaxEvents = 2 })
	r.Server.SetAfterDiscover(func(d store.Discovery, err error) (store.Discovery, error) {
		if err == nil && d.Events > 0 {
			found <- d.Events
		}
		return d, err
	})
	release := holdDiscovery(ctx, t, pool)
	// Three transactions of two events each (emit commits one event per
	// transaction: these insert two per transaction).
	for i := range 3 {
		if _, err := pool.Exec(ctx, `INSERT INTO outbox.event (stream, aggregate_key, event_type, payload)
			VALUES ('s', $1, 't', '{}'), ('s', $2, 't', '{}')`, fmt.Sprint("k", i, "a"), fmt.Sprint("k", i, "b")); err != nil {
			t.Fatal(err)
		}
	}
	release()
	var rounds []int64
	for total := int64(0); total < 6; {
		select {
		case n := <-found:
			rounds = append(rounds, n)
			total += n
		case <-ctx.Done():
			t.Fatalf("rounds found %v, want 6 events in all", rounds)
		}
	}
	if len(rounds) != 3 || rounds[0] != 2 || rounds[1] != 2 || rounds[2] != 2 {
		t.Fatalf("rounds found %v events, want [2 2 2]: one transaction each", rounds)
	}
}

// holdDiscovery takes the lock discovery rounds take turns with, on a
// connection of its own, so that no round runs until release; the test's
// events then wait for one round.
func holdDiscovery(ctx context.Context, t *testing.T, pool *pgxpool.Pool) (release func()) {
	t.Helper()
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(conn.Release)
	if _, err := conn.Exec(ctx, `SELECT pg_advisory_lock($1)`, int64(discoveryLockKey)); err != nil {
		t.Fatal(err)
	}
	return func() {
		t.Helper()
		if _, err := conn.Exec(ctx, `SELECT pg_advisory_unlock($1)`, int64(discoveryLockKey)); err != nil {
			t.Fatal(err)
		}
	}
}

// A member of a poll group whose claim got all it asked for wakes the next
// idle member, since there may be more: two sessions of one filter, one
// unit of credit each, and two aggregates made ready by one round. The
// round wakes one member; the other gets the second aggregate only through
// that member's claim (no polls, no dispatch).
func TestAClaimThatGotAllItAskedForWakesTheNextMember(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, func(c *server.Config) { c.NoDispatch = true })
	r.Server.SetNoPolls()
	ttl := durationpb.New(time.Hour)
	st1 := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{RelayId: "one", MaxInFlight: 1, LeaseTtl: ttl})
	st2 := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{RelayId: "two", MaxInFlight: 1, LeaseTtl: ttl})
	for r.Server.IdleSessions() < 2 {
		select {
		case <-ctx.Done():
			t.Fatal("the two sessions never waited for work")
		case <-time.After(5 * time.Millisecond):
		}
	}
	release := holdDiscovery(ctx, t, pool)
	x := emit(t, pool, "orders", "x", 1)[0]
	y := emit(t, pool, "orders", "y", 1)[0]
	release()
	got := map[string]bool{}
	for _, st := range []outboxv1.RelayService_SubscribeClient{st1, st2} {
		got[recv(t, st).GetEvent().GetEventId()] = true
	}
	if !got[x.String()] || !got[y.String()] {
		t.Fatalf("the two sessions got %v, want x %s and y %s", got, x, y)
	}
}
