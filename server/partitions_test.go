package server_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/server"
)

// owners reads how many partitions each replica owns (unowned under "").
func owners(t *testing.T, pool *pgxpool.Pool) map[string]int {
	t.Helper()
	rows, _ := pool.Query(context.Background(), `SELECT coalesce(owner, ''), count(*)::int FROM outbox.partition GROUP BY 1`)
	counts, err := pgx.CollectRows(rows, pgx.RowToStructByPos[struct {
		Owner string
		N     int
	}])
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]int{}
	for _, c := range counts {
		got[c.Owner] = c.N
	}
	return got
}

// waitOwners waits until the partitions are owned as want says, kicking the
// given replicas' ownership loops while it waits (each turn is one
// statement; a kick while a turn runs is kept for the next).
func waitOwners(t *testing.T, pool *pgxpool.Pool, want map[string]int, kick ...*replica) {
	t.Helper()
	eventually(t, func() (bool, string) {
		got := owners(t, pool)
		for _, r := range kick {
			r.Server.KickOwnership()
		}
		return fmt.Sprint(got) == fmt.Sprint(want), fmt.Sprintf("partitions owned %v, want %v", got, want)
	})
}

// startOwner starts a replica named id whose ownership lasts ttl without a
// renewal, with its metrics in reg (nil: none).
func startOwner(t *testing.T, url, id string, ttl time.Duration, reg prometheus.Registerer) *replica {
	t.Helper()
	return startReplica(t, url, func(c *server.Config) {
		c.ReplicaID, c.PartitionTTL, c.Registerer = id, ttl, reg
	})
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
	eventually(t, func() (bool, string) {
		got := gatherSum(t, reg, name)
		return got == want, fmt.Sprintf("%s = %v, want %v", name, got, want)
	})
}

// waitBelief waits until r believes it owns n partitions.
func waitBelief(t *testing.T, r *replica, n int) {
	t.Helper()
	eventually(t, func() (bool, string) {
		got := len(r.Server.OwnedPartitions())
		return got == n, fmt.Sprintf("the replica believes it owns %d partitions, want %d", got, n)
	})
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
	// No periodic turn within the test: only sessions and kicks move
	// ownership.
	a := startOwner(t, url, "a", time.Hour, regA)
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

	b := startOwner(t, url, "b", time.Hour, nil)
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
	a := startOwner(t, url, "a", time.Hour, nil)
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

// A turn's belief counts from the moment the turn sent its statement, not
// from the answer: the database's ownership starts somewhere in between,
// so a belief counted from the answer could outlast it. Every turn here
// checks, once its belief is set, that it ends no later than the TTL after
// the turn began.
func TestOwnershipBeliefCountsFromTheSend(t *testing.T) {
	t.Parallel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	const ttl = time.Hour
	a := startOwner(t, url, "a", ttl, nil)
	var (
		began            time.Time // the current turn's; turns run one at a time
		checked, overrun atomic.Int32
	)
	a.Server.SetOwnershipHooks(func(bool) error { began = time.Now(); return nil }, func() {
		if until := a.Server.OwnershipValidUntil(); !until.IsZero() {
			checked.Add(1)
			if until.After(began.Add(ttl)) {
				overrun.Add(1)
			}
		}
	})
	defer openSession(t, a, "ra")()
	waitOwners(t, pool, map[string]int{"a": 256}, a)
	eventually(t, func() (bool, string) {
		return checked.Load() >= 2, fmt.Sprintf("%d turns checked, want 2", checked.Load())
	})
	if n := overrun.Load(); n > 0 {
		t.Fatalf("%d of %d turns believed their partitions beyond the TTL counted from when they began", n, checked.Load())
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
	a := startOwner(t, url, "a", 600*time.Millisecond, nil)
	defer openSession(t, a, "ra")()
	waitOwners(t, pool, map[string]int{"a": 256})
	waitBelief(t, a, 256)
	a.Server.SetOwnershipHooks(func(bool) error { return errors.New("injected: the database did not answer") }, nil)
	waitBelief(t, a, 0)
	// The database's clock is this machine's: the belief must end by the
	// time the database lets another replica take over. Its end is read
	// from the replica, not from when this test saw it end (a loaded
	// machine can delay that by any amount), so no slack is needed, and a
	// belief counted from the renewal's answer rather than from its
	// sending (later by the statement's time) fails.
	ended := a.Server.OwnershipValidUntil()
	var expires time.Time
	if err := pool.QueryRow(ctx, `SELECT expires_at FROM outbox.partition_member WHERE replica_id = 'a'`).Scan(&expires); err != nil {
		t.Fatal(err)
	}
	if ended.IsZero() || ended.After(expires) {
		t.Fatalf("a believed in its partitions until %v, %v after the database let them expire",
			ended.Format(time.RFC3339Nano), ended.Sub(expires))
	}
	a.Server.SetOwnershipHooks(nil, nil)
}

// Partitions a turn gives back beyond the replica's share count as gone
// whether or not the release's answer arrives: here the release fails (the
// function is renamed away), the database still records them as the
// replica's, and the replica believes it owns only its share. It errs
// toward owning less: it cannot tell a release that failed from one that
// committed and lost its answer.
func TestPartitionsGivenBackCountAsGoneWhenTheReleaseFails(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	a := startOwner(t, url, "a", time.Hour, nil)
	defer openSession(t, a, "ra")()
	waitOwners(t, pool, map[string]int{"a": 256})
	waitBelief(t, a, 256)
	if _, err := pool.Exec(ctx, `ALTER FUNCTION outbox.release_partitions(uuid, integer[]) RENAME TO release_partitions_gone`); err != nil {
		t.Fatal(err)
	}
	b := startOwner(t, url, "b", time.Hour, nil)
	defer openSession(t, b, "rb")()
	// b has joined (its share is half), taking nothing: a holds all.
	eventually(t, func() (bool, string) {
		n := countWhere(t, pool, "outbox.partition_member", "replica_id = 'b' AND wants")
		return n == 1, "b's membership not recorded"
	})
	// a's next turn starts after b joined: its share is 128, and it gives
	// back the 128 beyond it, which fails.
	beliefs := make(chan int, 1)
	var armed atomic.Bool
	armed.Store(true)
	var counted bool // turns run one at a time, on the loop's goroutine
	a.Server.SetOwnershipHooks(func(bool) error {
		counted = armed.CompareAndSwap(true, false)
		return nil
	}, func() {
		if counted {
			counted = false
			beliefs <- len(a.Server.OwnedPartitions())
		}
	})
	a.Server.KickOwnership()
	got := <-beliefs
	if recorded := owners(t, pool)["a"]; recorded != 256 {
		t.Fatalf("the database records %d partitions as a's; want all 256 (the release was to fail)", recorded)
	}
	if got != 128 {
		t.Fatalf("after giving back the partitions beyond its share, a believes it owns %d; want its share, 128", got)
	}
	if _, err := pool.Exec(ctx, `ALTER FUNCTION outbox.release_partitions_gone(uuid, integer[]) RENAME TO release_partitions`); err != nil {
		t.Fatal(err)
	}
}

// A stopping replica wants no partitions: while it drains its sessions'
// last deliveries (it claims nothing more), its turns take a share of none
// and give back everything, so that a replica that goes on serving can
// take its partitions over at once rather than when it has finished.
func TestStoppingReplicaGivesItsPartitionsBackWhileDraining(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	a := startOwner(t, url, "a", time.Hour, nil)
	emit(t, pool, "orders", "o-1", 1)
	st := subscribe(t, ctx, a, &outboxv1.SubscribeRequest{RelayId: "ra", Streams: []string{"orders"}, MaxInFlight: 1})
	d := recv(t, st)
	waitOwners(t, pool, map[string]int{"a": 256})

	// Stop waits for the delivery to be acked: the session stays.
	stopped := stopAsync(a.Server, time.Minute)
	<-a.Server.Stopping()
	// The first turn to start from now on is the one that counts.
	wants := make(chan bool, 1)
	var armed atomic.Bool
	armed.Store(true)
	a.Server.SetOwnershipHooks(func(w bool) error {
		if armed.CompareAndSwap(true, false) {
			wants <- w
		}
		return nil
	}, nil)
	a.Server.KickOwnership()
	if <-wants {
		t.Fatal("a stopping replica with a session still draining took a turn wanting partitions")
	}
	waitOwners(t, pool, map[string]int{"": 256})

	ackPublished(t, a, d)
	if res := waitStop(t, stopped, 30*time.Second); res.err != nil {
		t.Errorf("Stop: %v", res.err)
	}
}

// The ownership loop renews every third of the TTL (never later: a pause
// it arms is at most that), so that a renewal or two may fail or come late
// before the belief, which lasts one TTL from the last renewal's send,
// lapses under a replica whose database is there.
func TestOwnershipLoopRenewsEveryThirdOfTheTTL(t *testing.T) {
	t.Parallel()
	url := testdb.New(t)
	const ttl = 600 * time.Millisecond
	a := startOwner(t, url, "a", ttl, nil)
	type wait struct{ interval, armed time.Duration }
	waits := make(chan wait, 1)
	a.Server.SetAfterLoopWait(func(loop string, interval, armed time.Duration, _ time.Time) {
		if loop == "ownership" {
			select {
			case waits <- wait{interval, armed}:
			default:
			}
		}
	})
	w := <-waits
	if w.interval != ttl/3 || w.armed > ttl/3 {
		t.Fatalf("the ownership loop's interval is %v and it armed a pause of %v; want %v and at most that", w.interval, w.armed, ttl/3)
	}
}

// An ownership turn's statement is not cancelled when the replica's loops
// stop: the shutdown waits for it to end, then gives back what it took.
// Cancelled, the statement is abandoned by the replica while the database
// may still run it (pgx asks the server to cancel it over a connection of
// its own, which can come too late, or too early, before the statement
// started); blocked behind a lock until after the replica's release at
// shutdown, it would then commit a takeover for a process that is gone,
// whose name would stay on the partitions until its membership expired.
//
// The turn's statement (a's first, taking over the partitions of x, an
// expired member) is held on a lock of the test's until the replica's loops
// have been cancelled, as the disappearance of its LISTEN connection shows
// (it ends when they are). The turn must not end before the lock is let go;
// and once the replica has shut down, the takeover has run to its end and
// everything it took is free again.
func TestOwnershipTurnStatementOutlivesTheShutdown(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	// x owned every partition and died.
	if _, err := pool.Exec(ctx, `SELECT outbox.own_partitions('x', gen_random_uuid(), true, interval '1 hour')`); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `UPDATE outbox.partition_member SET expires_at = clock_timestamp() - interval '1 second'`); err != nil {
		t.Fatal(err)
	}
	holder, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = holder.Rollback(ctx) }()
	var holderPID uint32
	if err := holder.QueryRow(ctx, `SELECT pg_backend_pid() FROM outbox.partition WHERE partition = 0 FOR UPDATE`).Scan(&holderPID); err != nil {
		t.Fatal(err)
	}

	a := startOwner(t, url, "a", time.Hour, nil)
	// The turn waits for the lock from here until the replica's loops have
	// ended: longer, on a slow machine, than a turn's own bound.
	a.Server.SetOwnershipTurnTimeout(time.Minute)
	var letGo atomic.Bool
	a.Server.SetOwnershipHooks(nil, func() {
		if !letGo.Load() {
			t.Error("an ownership turn ended while its statement was still waiting for the lock: it was cancelled")
		}
	})
	listeners := func() int64 {
		return countWhere(t, pool, "pg_stat_activity", "datname = current_database() AND application_name = '"+server.ListenerApplicationName+" a'")
	}
	waitFor(t, func() int32 { return b2i(listeners() == 1) })
	openSession(t, a, "ra") // ends with the replica's shutdown
	// a's first turn joins and, taking x's partitions over, waits for the lock.
	waitFor(t, func() int32 {
		return b2i(countWhere(t, pool, "pg_stat_activity",
			fmt.Sprintf("query LIKE '%%outbox.own_partitions%%' AND %d = ANY (pg_blocking_pids(pid))", holderPID)) == 1)
	})

	closed := make(chan struct{})
	go func() { defer close(closed); a.Close() }()
	waitFor(t, func() int32 { return b2i(listeners() == 0) })
	letGo.Store(true)
	if err := holder.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	<-closed
	// No statement of a's still runs (a cancelled one would, without its
	// client, until it commits).
	waitFor(t, func() int32 {
		return b2i(countWhere(t, pool, "pg_stat_activity",
			"datname = current_database() AND query LIKE '%outbox.own_partitions%' AND state = 'active' AND pid <> pg_backend_pid()") == 0)
	})
	if got := owners(t, pool); got[""] != 256 {
		t.Errorf("after a's shutdown, partitions owned %v; want all free (a's takeover of x's ran to its end and a gave them back)", got)
	}
}

// A replica gives back what it owns beyond its share however little that
// is, down to one partition (as when a 24th replica joins 23: the share
// falls from 12 to 11), so that the newcomer can take its own share.
func TestReplicaOneAboveItsShareGivesThatOneBack(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	a := startOwner(t, url, "a", time.Hour, nil)
	defer openSession(t, a, "ra")()
	waitOwners(t, pool, map[string]int{"a": 256})
	// b, another replica with sessions, joins: a gives back the high half
	// and b takes it.
	const b = "00000000-0000-0000-0000-00000000000b"
	ownB := func() {
		if _, err := pool.Exec(ctx, `SELECT outbox.own_partitions('b', $1::uuid, true, interval '1 hour')`, b); err != nil {
			t.Fatal(err)
		}
	}
	ownB()
	waitOwners(t, pool, map[string]int{"a": 128, "": 128}, a)
	ownB()
	// One of b's partitions becomes a's: a owns one above its share.
	if _, err := pool.Exec(ctx, `UPDATE outbox.partition SET owner = 'a', owner_instance = $1 WHERE partition = 255`, a.Server.Instance()); err != nil {
		t.Fatal(err)
	}
	turned := make(chan struct{})
	var armed atomic.Bool
	armed.Store(true)
	var counted bool // turns run one at a time, on the loop's goroutine
	a.Server.SetOwnershipHooks(func(bool) error {
		counted = armed.CompareAndSwap(true, false)
		return nil
	}, func() {
		if counted {
			counted = false
			close(turned)
		}
	})
	a.Server.KickOwnership()
	<-turned
	if got := owners(t, pool); got["a"] != 128 {
		t.Fatalf("after a's turn with a share of 128, partitions owned %v; want a at 128", got)
	}
}

// A replica's shutdown ends its membership even when it owns no partition
// by then, as when its sessions ended before it stopped (a rolling
// restart drains them first) and its turn gave everything back: the next
// process under the same replica id (the restarted pod) is refused while
// the old membership lasts, so it must be gone at once, not a TTL later.
func TestReplicaShutdownEndsItsMembershipWhenItOwnsNothing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	a := startOwner(t, url, "a", time.Hour, nil)
	endA := openSession(t, a, "ra")
	waitOwners(t, pool, map[string]int{"a": 256})
	// Its last session ends: its next turn gives everything back.
	endA()
	waitOwners(t, pool, map[string]int{"": 256})
	a.Close()
	if n := countWhere(t, pool, "outbox.partition_member", "replica_id = 'a'"); n != 0 {
		t.Errorf("after a's shutdown, %d memberships of replica a are recorded; want none", n)
	}
	// The restarted process, under the same replica id.
	if _, err := pool.Exec(ctx, `SELECT outbox.own_partitions('a', gen_random_uuid(), true, interval '1 hour')`); err != nil {
		t.Errorf("a process restarted under replica id a after a's shutdown: %v", err)
	}
}
