package server_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/server"
)

// owners reads how many partitions each replica owns (unowned under "").
func owners(t *testing.T, pool *pgxpool.Pool) map[string]int {
	t.Helper()
	rows, err := pool.Query(context.Background(),
		`SELECT coalesce(owner, ''), count(*) FROM outbox.partition GROUP BY 1`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	got := map[string]int{}
	for rows.Next() {
		var owner string
		var n int
		if err := rows.Scan(&owner, &n); err != nil {
			t.Fatal(err)
		}
		got[owner] = n
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return got
}

// waitOwners waits until the partitions are owned as want says, kicking the
// given replicas' ownership loops while it waits (each turn is one
// statement; a kick while a turn runs is kept for the next).
func waitOwners(t *testing.T, pool *pgxpool.Pool, want map[string]int, kick ...*replica) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second) // a hang guard
	for {
		got := owners(t, pool)
		if fmt.Sprint(got) == fmt.Sprint(want) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("partitions owned %v, want %v", got, want)
		}
		for _, r := range kick {
			r.Server.KickOwnership()
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// openSession opens a relay session on r, which ends when the returned
// function is called.
func openSession(t *testing.T, r *replica, relayID string) (end func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	if _, err := r.Relay.Subscribe(ctx, &outboxv1.SubscribeRequest{RelayId: relayID, MaxInFlight: 1}); err != nil {
		cancel()
		t.Fatal(err)
	}
	return cancel
}

// waitGauge waits until the metric reads want: a replica sets it once its
// turn's statement has returned, after the database shows the outcome.
func waitGauge(t *testing.T, reg *prometheus.Registry, name string, want float64) {
	t.Helper()
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(time.Millisecond) {
		got := gatherSum(t, reg, name)
		if got == want {
			return
		}
		if time.Now().After(deadline) { // a hang guard
			t.Fatalf("%s = %v, want %v", name, got, want)
		}
	}
}

// Partitions follow relay sessions: a replica owns none until its first
// session, all of them while it is the only one with sessions, half once a
// second replica has sessions too (the first gives back the rest, the
// second takes them over under higher epochs), none again once its
// sessions end, and it gives everything back when it shuts down.
func TestPartitionsFollowRelaySessions(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	regA := prometheus.NewRegistry()
	configure := func(id string, reg *prometheus.Registry) func(*server.Config) {
		return func(c *server.Config) {
			c.ReplicaID = id
			c.Registerer = reg
			// No periodic turn within the test: only sessions and kicks
			// move ownership.
			c.PartitionTTL = time.Hour
		}
	}
	a := startReplica(t, url, configure("a", regA))
	// After every turn, a believes it owns only partitions the database
	// records as a's: it errs toward owning less, never more.
	a.Server.SetOwnershipHooks(nil, func() {
		var recorded []int32
		if err := pool.QueryRow(ctx, `SELECT coalesce(array_agg(partition), '{}') FROM outbox.partition WHERE owner = 'a'`).
			Scan(&recorded); err != nil {
			t.Error(err)
			return
		}
		for _, p := range a.Server.OwnedPartitions() {
			if !slices.Contains(recorded, p) {
				t.Errorf("a believes it owns partition %d, which the database does not record as a's", p)
				return
			}
		}
	})
	if got := owners(t, pool); got[""] != 256 {
		t.Fatalf("a replica without sessions owns partitions: %v", got)
	}

	endA := openSession(t, a, "ra")
	defer endA()
	waitOwners(t, pool, map[string]int{"a": 256})
	waitGauge(t, regA, "outboxd_partitions_owned", 256)
	var epochsBefore []int64
	if err := pool.QueryRow(ctx, `SELECT array_agg(epoch ORDER BY partition) FROM outbox.partition`).Scan(&epochsBefore); err != nil {
		t.Fatal(err)
	}

	b := startReplica(t, url, configure("b", prometheus.NewRegistry()))
	endB := openSession(t, b, "rb")
	waitOwners(t, pool, map[string]int{"a": 128, "b": 128}, a, b)
	var lowOwner, highOwner string
	var raised bool
	if err := pool.QueryRow(ctx, `SELECT
		    (SELECT min(owner) FROM outbox.partition WHERE partition < 128),
		    (SELECT min(owner) FROM outbox.partition WHERE partition >= 128),
		    (SELECT bool_and(p.epoch > b.epoch) FROM outbox.partition p
		     JOIN unnest($1::bigint[]) WITH ORDINALITY AS b(epoch, i) ON p.partition = b.i - 1
		     WHERE p.partition >= 128)`, epochsBefore).Scan(&lowOwner, &highOwner, &raised); err != nil {
		t.Fatal(err)
	}
	if lowOwner != "a" || highOwner != "b" || !raised {
		t.Fatalf("a owns the low half: %q, b the high half: %q, taken over under higher epochs: %v; want a, b, true",
			lowOwner, highOwner, raised)
	}
	waitGauge(t, regA, "outboxd_partitions_owned", 128)

	// b's only session ends: b gives its half back, and a takes it.
	endB()
	waitOwners(t, pool, map[string]int{"a": 256}, a)

	// a shuts down: everything is free at once, not after the TTL.
	endA()
	a.Close()
	if got := owners(t, pool); got[""] != 256 {
		t.Fatalf("after a's shutdown, partitions owned %v; want all free", got)
	}
}

// A replica gives its partitions back when it shuts down even when its
// turns failed: here the turn that took them lost its answer (the database
// recorded the takeover, the replica heard an error) and every turn after
// fails too. It releases whatever the database records as its own, not only
// what it believes it owns.
func TestPartitionsReleasedAtShutdownAfterFailedTurns(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	a := startReplica(t, url, func(c *server.Config) { c.ReplicaID = "a"; c.PartitionTTL = time.Hour })
	var turns atomic.Int32
	a.Server.SetOwnershipHooks(func(wants bool) error {
		if turns.Add(1) == 1 {
			if _, err := pool.Exec(ctx, `SELECT outbox.own_partitions('a', $1, true, interval '1 hour')`, a.Server.Instance()); err != nil {
				t.Error(err)
			}
			return errors.New("injected: the answer was lost")
		}
		return errors.New("injected: the database did not answer")
	}, nil)
	defer openSession(t, a, "ra")()
	waitOwners(t, pool, map[string]int{"a": 256})
	if got := a.Server.OwnedPartitions(); len(got) != 0 {
		t.Fatalf("a believes it owns %d partitions after its turn failed", len(got))
	}
	a.Close()
	if got := owners(t, pool); got[""] != 256 {
		t.Fatalf("after a's shutdown, partitions owned %v; want all free", got)
	}
}

// A replica whose renewals fail stops believing in its partitions once its
// ownership could have expired (it counts from when it sent the last
// renewal that succeeded, so it stops first), while the database still
// records them until another replica takes them over.
func TestOwnershipBeliefEndsWithoutRenewals(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	a := startReplica(t, url, func(c *server.Config) { c.ReplicaID = "a"; c.PartitionTTL = 600 * time.Millisecond })
	defer openSession(t, a, "ra")()
	waitOwners(t, pool, map[string]int{"a": 256})
	for deadline := time.Now().Add(30 * time.Second); len(a.Server.OwnedPartitions()) != 256; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) { // a hang guard
			t.Fatal("a never believed it owns its 256 partitions")
		}
	}
	a.Server.SetOwnershipHooks(func(bool) error { return errors.New("injected: the database did not answer") }, nil)
	for deadline := time.Now().Add(30 * time.Second); len(a.Server.OwnedPartitions()) != 0; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) { // a hang guard
			t.Fatal("a still believes it owns its partitions 30s after its renewals began to fail")
		}
	}
	ended := time.Now()
	// The database's clock is this machine's: the belief must have ended
	// by the time the database lets another replica take over (a little
	// slack for the polling above).
	var expires time.Time
	if err := pool.QueryRow(ctx, `SELECT expires_at FROM outbox.partition_member WHERE replica_id = 'a'`).Scan(&expires); err != nil {
		t.Fatal(err)
	}
	if ended.After(expires.Add(50 * time.Millisecond)) {
		t.Fatalf("a believed in its partitions until %v, %v after the database let them expire",
			ended.Format(time.RFC3339Nano), ended.Sub(expires))
	}
	a.Server.SetOwnershipHooks(nil, nil)
}
