package migrations_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxd/outboxd/internal/testdb"
)

// ownership is one outbox.own_partitions answer.
type ownership struct {
	share      int
	partitions []int32
	epochs     []int64
}

func ownPartitions(ctx context.Context, pool *pgxpool.Pool, replica string, wants bool, ttl string) (ownership, error) {
	var o ownership
	err := pool.QueryRow(ctx, `SELECT share, partitions, epochs FROM outbox.own_partitions($1, md5($1)::uuid, $2, $3::interval)`,
		replica, wants, ttl).Scan(&o.share, &o.partitions, &o.epochs)
	return o, err
}

func mustOwn(t *testing.T, pool *pgxpool.Pool, replica string, wants bool) ownership {
	t.Helper()
	o, err := ownPartitions(context.Background(), pool, replica, wants, "1 hour")
	if err != nil {
		t.Fatalf("own_partitions(%s): %v", replica, err)
	}
	return o
}

// ownWithoutWaiting is ownPartitions for a caller that must not wait for a
// lock: it fails the test after 30 seconds, as a hang guard.
func ownWithoutWaiting(t *testing.T, pool *pgxpool.Pool, replica string) ownership {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	o, err := ownPartitions(ctx, pool, replica, true, "1 hour")
	if err != nil {
		t.Fatalf("own_partitions(%s) beside a held lock: %v (did it wait for the lock?)", replica, err)
	}
	return o
}

// holdLock runs lockSQL in a transaction left open, so that its row locks
// stay held until release (also run at the test's end) rolls it back; pid
// is the backend holding them, for runBehind.
func holdLock(t *testing.T, pool *pgxpool.Pool, lockSQL string) (release func(), pid int) {
	t.Helper()
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	release = func() { _ = tx.Rollback(ctx) }
	t.Cleanup(release)
	if _, err := tx.Exec(ctx, lockSQL); err != nil {
		t.Fatal(err)
	}
	return release, backendPID(t, tx)
}

// An aggregate's partition is fixed for the life of a database (delivery
// state will be keyed by it), so the function's values are pinned: a change
// of hash would move aggregates between owners under running replicas.
func TestPartitionOfIsStableAndSpread(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.NewPool(t)
	pinned := []struct {
		stream, key string
		want        int32
	}{
		{"orders", "o-1", 29}, {"orders", "o-2", 170}, {"payments", "o-1", 170}, {"a", "bc", 193}, {"ab", "c", 156},
	}
	for _, p := range pinned {
		var got int32
		if err := pool.QueryRow(ctx, `SELECT outbox.partition_of($1, $2)`, p.stream, p.key).Scan(&got); err != nil {
			t.Fatal(err)
		}
		if got != p.want {
			t.Errorf("partition_of(%q, %q) = %d, want %d", p.stream, p.key, got, p.want)
		}
	}
	var hit, low, high int
	if err := pool.QueryRow(ctx, `SELECT count(DISTINCT p), min(p), max(p) FROM (
		SELECT outbox.partition_of('orders', 'order-' || i) AS p FROM generate_series(1, 20000) i) x`).
		Scan(&hit, &low, &high); err != nil {
		t.Fatal(err)
	}
	if hit != 256 || low != 0 || high != 255 {
		t.Errorf("20,000 keys fell into %d partitions, %d..%d; want all 256, 0..255", hit, low, high)
	}
}

// A replica's share is 256 divided among the replicas that want partitions
// (members); it takes free partitions up to it, never gives back on its own,
// and a partition it releases is taken by the next replica under a higher
// epoch. A replica that stops wanting leaves, and the others' shares grow.
func TestOwnPartitionsSharesAmongReplicasWithSessions(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	before := time.Now().Add(-time.Minute).UnixMicro()

	a := mustOwn(t, pool, "a", true)
	if a.share != 256 || len(a.partitions) != 256 {
		t.Fatalf("alone, a's share is %d and it owns %d partitions; want 256 and 256", a.share, len(a.partitions))
	}
	for i, e := range a.epochs {
		if e < before {
			t.Fatalf("partition %d taken at epoch %d, below the clock in microseconds (%d)", a.partitions[i], e, before)
		}
	}
	if idle := mustOwn(t, pool, "idle", false); idle.share != 0 || len(idle.partitions) != 0 {
		t.Fatalf("a replica without sessions: share %d, %d partitions; want none", idle.share, len(idle.partitions))
	}

	b := mustOwn(t, pool, "b", true)
	if b.share != 128 || len(b.partitions) != 0 {
		t.Fatalf("b beside a: share %d, owns %d; want 128 and none (a holds every partition)", b.share, len(b.partitions))
	}
	a = mustOwn(t, pool, "a", true)
	if a.share != 128 || len(a.partitions) != 256 {
		t.Fatalf("a beside b: share %d, owns %d; want 128 and still 256 (own_partitions never gives back)", a.share, len(a.partitions))
	}
	var released int
	if err := pool.QueryRow(context.Background(), `SELECT outbox.release_partitions(md5('a')::uuid, $1)`, a.partitions[128:]).Scan(&released); err != nil {
		t.Fatal(err)
	}
	if released != 128 {
		t.Fatalf("a released %d partitions, want 128", released)
	}
	b = mustOwn(t, pool, "b", true)
	if !slices.Equal(b.partitions, a.partitions[128:]) {
		t.Fatalf("b took %v, want what a released (%d..%d)", b.partitions, a.partitions[128], a.partitions[255])
	}
	for i := range b.partitions {
		if b.epochs[i] <= a.epochs[128+i] {
			t.Fatalf("partition %d: b's epoch %d is not above a's %d", b.partitions[i], b.epochs[i], a.epochs[128+i])
		}
	}
	if again := mustOwn(t, pool, "a", true); !slices.Equal(again.partitions, a.partitions[:128]) ||
		!slices.Equal(again.epochs, a.epochs[:128]) {
		t.Fatalf("a's renewal changed its partitions or epochs: %v %v", again.partitions, again.epochs)
	}
	// A release names only the caller's partitions.
	if err := pool.QueryRow(context.Background(), `SELECT outbox.release_partitions(md5('a')::uuid, $1)`, b.partitions).Scan(&released); err != nil {
		t.Fatal(err)
	}
	if released != 0 {
		t.Fatalf("a released %d of b's partitions", released)
	}
	// b leaves (its sessions ended): a's share is everything again.
	if left := mustOwn(t, pool, "b", false); left.share != 0 || len(left.partitions) != 128 {
		t.Fatalf("b leaving: share %d, still owns %d; want 0 and 128 (it releases them itself)", left.share, len(left.partitions))
	}
	if a = mustOwn(t, pool, "a", true); a.share != 256 {
		t.Fatalf("a's share after b left: %d, want 256", a.share)
	}
	// b shuts down: its partitions are free at once, its membership gone.
	if err := pool.QueryRow(context.Background(), `SELECT outbox.leave_partitions(md5('b')::uuid)`).Scan(&released); err != nil {
		t.Fatal(err)
	}
	var members int
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM outbox.partition_member WHERE replica_id = 'b'`).Scan(&members); err != nil {
		t.Fatal(err)
	}
	if released != 128 || members != 0 {
		t.Fatalf("b leaving gave back %d partitions and left %d memberships; want 128 and none", released, members)
	}
	if a = mustOwn(t, pool, "a", true); len(a.partitions) != 256 {
		t.Fatalf("a took %d partitions after b left, want all 256", len(a.partitions))
	}
}

// A partition whose owner stopped renewing (a crashed replica) is taken
// once its ownership has expired, not before; the crashed replica's
// membership expires with it, so the survivor's share covers its partitions.
func TestOwnPartitionsTakesOverOnlyExpiredOwnership(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	a := mustOwn(t, pool, "a", true)
	if b := mustOwn(t, pool, "b", true); b.share != 128 || len(b.partitions) != 0 {
		t.Fatalf("b beside a: share %d, took %d partitions a's unexpired ownership covers", b.share, len(b.partitions))
	}
	// a stops renewing; its ownership and membership run out.
	exec(t, pool, `UPDATE outbox.partition_member SET expires_at = clock_timestamp() - interval '1 second' WHERE replica_id = 'a'`)
	b := mustOwn(t, pool, "b", true)
	if b.share != 256 || !slices.Equal(b.partitions, a.partitions) {
		t.Fatalf("b's share %d, took %d partitions; want 256 and all of a's expired ones", b.share, len(b.partitions))
	}
	for i := range b.partitions {
		if b.epochs[i] <= a.epochs[i] {
			t.Fatalf("partition %d taken over at epoch %d, not above a's %d", b.partitions[i], b.epochs[i], a.epochs[i])
		}
	}
	// a comes back: nothing of its old ownership is left to renew.
	if back := mustOwn(t, pool, "a", true); back.share != 128 || len(back.partitions) != 0 {
		t.Fatalf("a back: share %d, owns %d; want 128 and none until b gives some back", back.share, len(back.partitions))
	}
}

// A takeover skips a free partition another transaction has locked (a
// concurrent takeover) rather than waiting for it or taking it from under
// it.
func TestOwnPartitionsSkipsPartitionsBeingTaken(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	holdLock(t, pool, `SELECT FROM outbox.partition WHERE partition = 0 FOR UPDATE`)
	b := ownWithoutWaiting(t, pool, "b")
	if len(b.partitions) != 255 || b.partitions[0] != 1 {
		t.Fatalf("b took %d partitions starting at %d; want 255 from 1", len(b.partitions), b.partitions[0])
	}
}

// Replicas taking over at once never end up owning the same partition.
func TestConcurrentOwnersAreDisjoint(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.NewPool(t)
	const n = 8
	var (
		wg    sync.WaitGroup
		start = make(chan struct{})
		got   [n]ownership
		errs  [n]error
	)
	for i := range n {
		wg.Go(func() {
			<-start
			got[i], errs[i] = ownPartitions(ctx, pool, fmt.Sprintf("r%d", i), true, "1 hour")
		})
	}
	close(start)
	wg.Wait()
	owner := map[int32]int{}
	for i := range n {
		if errs[i] != nil {
			t.Fatal(errs[i])
		}
		if len(got[i].partitions) > got[i].share {
			t.Errorf("r%d owns %d partitions, above its share %d", i, len(got[i].partitions), got[i].share)
		}
		for _, p := range got[i].partitions {
			if j, ok := owner[p]; ok {
				t.Errorf("partition %d owned by both r%d and r%d", p, j, i)
			}
			owner[p] = i
		}
	}
}

// Bad input gets a clear error; and the ownership's commit waits for the
// WAL flush whatever the session asked, so that a replica never acts on a
// renewal or takeover a crash then loses.
func TestOwnPartitionsInputAndDurability(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.NewPool(t)
	for _, c := range []struct{ replica, ttl string }{{"", "1 hour"}, {"a", "0"}, {"a", "-1 second"}} {
		_, err := ownPartitions(ctx, pool, c.replica, true, c.ttl)
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "22023" {
			t.Errorf("own_partitions(%q, ttl %s): %v, want SQLSTATE 22023", c.replica, c.ttl, err)
		}
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, `SET LOCAL synchronous_commit = off`); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `SELECT outbox.own_partitions('a', gen_random_uuid(), true, interval '1 hour')`); err != nil {
		t.Fatal(err)
	}
	var setting string
	if err := tx.QueryRow(ctx, `SELECT current_setting('synchronous_commit')`).Scan(&setting); err != nil {
		t.Fatal(err)
	}
	if setting != "on" {
		t.Fatalf("after own_partitions the transaction commits with synchronous_commit = %s, want on", setting)
	}
}

// The owner is a process, not only a replica id: a replica restarted under
// the same id (a StatefulSet's pod) is refused while its previous process's
// membership lasts, and then takes the old partitions over as any replica
// would, under higher epochs, instead of renewing what the old process held.
// Two processes under one id at once (a misconfiguration) are refused the
// same way, with a clear error.
func TestOwnPartitionsOwnerIsTheProcess(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.NewPool(t)
	own := func(instance string) (ownership, error) {
		var o ownership
		err := pool.QueryRow(ctx, `SELECT share, partitions, epochs FROM outbox.own_partitions('a', $1::uuid, true, interval '1 hour')`,
			instance).Scan(&o.share, &o.partitions, &o.epochs)
		return o, err
	}
	const first, second = "00000000-0000-0000-0000-000000000001", "00000000-0000-0000-0000-000000000002"
	old, err := own(first)
	if err != nil || len(old.partitions) != 256 {
		t.Fatalf("first process: %v, %d partitions", err, len(old.partitions))
	}
	_, err = own(second)
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "23505" || !strings.Contains(pgErr.Message, "replica id a") {
		t.Fatalf("a second process under replica id a: %v, want SQLSTATE 23505 naming the id", err)
	}
	var released int
	if err := pool.QueryRow(ctx, `SELECT outbox.release_partitions($1::uuid, '{0,1,2}')`, second).Scan(&released); err != nil {
		t.Fatal(err)
	}
	if released != 0 {
		t.Fatalf("the second process released %d partitions of the first", released)
	}
	// The first process dies; its membership and ownership run out.
	exec(t, pool, `UPDATE outbox.partition_member SET expires_at = clock_timestamp() - interval '1 second'`)
	next, err := own(second)
	if err != nil || len(next.partitions) != 256 {
		t.Fatalf("the restarted process: %v, %d partitions; want all 256", err, len(next.partitions))
	}
	for i := range next.partitions {
		if next.epochs[i] <= old.epochs[i] {
			t.Fatalf("partition %d: the restarted process holds it at epoch %d, not above the old process's %d",
				next.partitions[i], next.epochs[i], old.epochs[i])
		}
	}
}

// A takeover neither waits for nor takes from a membership whose row
// another transaction holds (here: a renewal under way, as a lock on the
// row), even when the membership has expired: the renewal may yet win.
// Once the row is free, the expired member's partitions are taken.
func TestOwnPartitionsSkipsAMembershipBeingRenewed(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	a := mustOwn(t, pool, "a", true)
	exec(t, pool, `UPDATE outbox.partition_member SET expires_at = clock_timestamp() - interval '1 second' WHERE replica_id = 'a'`)
	release, _ := holdLock(t, pool, `SELECT FROM outbox.partition_member WHERE replica_id = 'a' FOR UPDATE`)
	b := ownWithoutWaiting(t, pool, "b")
	if len(b.partitions) != 0 {
		t.Fatalf("b took %d partitions of a membership being renewed", len(b.partitions))
	}
	release()
	if b = mustOwn(t, pool, "b", true); !slices.Equal(b.partitions, a.partitions) {
		t.Fatalf("b took %d partitions once a's expired membership was free, want all 256", len(b.partitions))
	}
}

// A replica whose membership lapsed (its renewals did not land in time, so
// its belief in its partitions may have ended) does not renew it: it joins
// anew, and even the partitions nobody took meanwhile are taken again under
// higher epochs, never carried over from the lapsed ownership.
func TestOwnPartitionsJoinsAnewAfterALapse(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	before := mustOwn(t, pool, "a", true)
	exec(t, pool, `UPDATE outbox.partition_member SET expires_at = clock_timestamp() - interval '1 second' WHERE replica_id = 'a'`)
	after := mustOwn(t, pool, "a", true)
	if !slices.Equal(after.partitions, before.partitions) {
		t.Fatalf("a owns %d partitions after joining anew, want all 256", len(after.partitions))
	}
	for i := range after.partitions {
		if after.epochs[i] <= before.epochs[i] {
			t.Fatalf("partition %d kept epoch %d across a lapsed membership (before: %d); want it raised",
				after.partitions[i], after.epochs[i], before.epochs[i])
		}
	}
}

// ownInThree has replicas a, b and c join, want partitions and take their
// shares as replicas do: a, which took everything first, renews beside
// the other two and gives back what is beyond its share; then b and c take
// theirs of what is free. It returns each one's last call.
func ownInThree(t *testing.T, pool *pgxpool.Pool) (a, b, c ownership) {
	t.Helper()
	mustOwn(t, pool, "a", true)
	mustOwn(t, pool, "b", true)
	mustOwn(t, pool, "c", true)
	a = mustOwn(t, pool, "a", true)
	if _, err := pool.Exec(context.Background(), `SELECT outbox.release_partitions(md5('a')::uuid, $1)`,
		a.partitions[min(a.share, len(a.partitions)):]); err != nil {
		t.Fatal(err)
	}
	return a, mustOwn(t, pool, "b", true), mustOwn(t, pool, "c", true)
}

// Shares are rounded up, so that the members' shares together cover every
// partition: with three replicas wanting partitions each takes up to 86
// (256/3 rounded down would leave one partition that nobody's share covers,
// owned by no replica for as long as the three run).
func TestOwnPartitionsSharesCoverEveryPartition(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	a, b, c := ownInThree(t, pool)
	if a.share != 86 || b.share != 86 || c.share != 86 {
		t.Fatalf("shares of three replicas: %d, %d, %d; want 86 each (256/3 rounded up)", a.share, b.share, c.share)
	}
	if free := count(t, pool, `SELECT count(*) FROM outbox.partition WHERE owner IS NULL`); free != 0 {
		t.Fatalf("%d partitions owned by none of three replicas that have taken their shares", free)
	}
}

// A replica below its share takes free partitions up to its share and no
// further, even when more are free: here c leaves, a and b's shares grow
// from 86 to 128, and a, which owns 86, takes 42 of c's 84 and leaves the
// other 42 to b.
func TestOwnPartitionsTakesUpToItsShare(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	ownInThree(t, pool)
	exec(t, pool, `SELECT outbox.leave_partitions(md5('c')::uuid)`)
	a := mustOwn(t, pool, "a", true)
	b := mustOwn(t, pool, "b", true)
	if a.share != 128 || len(a.partitions) != 128 || b.share != 128 || len(b.partitions) != 128 {
		t.Fatalf("after c left, a's share %d, owns %d; b's share %d, owns %d; want 128 each",
			a.share, len(a.partitions), b.share, len(b.partitions))
	}
}

// A takeover deletes the expired memberships it takes partitions from:
// every process that dies without a shutdown (each restart is a new
// process) would otherwise leave its row in outbox.partition_member for
// good, for every later takeover to lock and free again.
func TestOwnPartitionsTakeoverDeletesExpiredMemberships(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	mustOwn(t, pool, "a", true)
	exec(t, pool, `UPDATE outbox.partition_member SET expires_at = clock_timestamp() - interval '1 second' WHERE replica_id = 'a'`)
	if b := mustOwn(t, pool, "b", true); len(b.partitions) != 256 {
		t.Fatalf("b took %d of a's expired partitions, want all 256", len(b.partitions))
	}
	if n := count(t, pool, `SELECT count(*) FROM outbox.partition_member WHERE replica_id = 'a'`); n != 0 {
		t.Fatalf("a's expired membership is still recorded after b took its partitions over (%d rows)", n)
	}
}

// A takeover raises the partition's epoch even when the clock is behind
// it (a clock stepped back, or an epoch raised by a takeover on a faster
// clock): the epoch is at least the clock in microseconds, and always above
// the previous owner's, so that no two owners ever hold one partition under
// the same epoch.
func TestOwnPartitionsRaisesTheEpochWhenTheClockIsBehind(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.NewPool(t)
	a := mustOwn(t, pool, "a", true)
	// a's epochs as if a's takeover had run a day ahead of this clock.
	exec(t, pool, `UPDATE outbox.partition SET epoch = epoch + 86400000000`)
	var ahead []int64
	if err := pool.QueryRow(ctx, `SELECT array_agg(epoch ORDER BY partition) FROM outbox.partition`).Scan(&ahead); err != nil {
		t.Fatal(err)
	}
	// a's membership runs out; b takes its partitions over.
	exec(t, pool, `UPDATE outbox.partition_member SET expires_at = clock_timestamp() - interval '1 second' WHERE replica_id = 'a'`)
	b := mustOwn(t, pool, "b", true)
	if !slices.Equal(b.partitions, a.partitions) {
		t.Fatalf("b took %d partitions of a's expired ones, want all 256", len(b.partitions))
	}
	for i, p := range b.partitions {
		if b.epochs[i] <= ahead[p] {
			t.Fatalf("partition %d taken over at epoch %d, not above a's %d (ahead of the clock)", p, b.epochs[i], ahead[p])
		}
	}
}

// A membership lasts the TTL its caller gave, from the call, whether it
// joins or renews: not longer, or a replica killed without a shutdown
// would keep its partitions from the others beyond the TTL, and not
// shorter, or its owner would still believe in partitions the database
// already lets another replica take.
func TestOwnPartitionsMembershipLastsTheTTL(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.NewPool(t)
	clock := func() (at time.Time) {
		if err := pool.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&at); err != nil {
			t.Fatal(err)
		}
		return at
	}
	for _, turn := range []string{"joining", "renewing"} {
		before := clock()
		mustOwn(t, pool, "a", true)
		after := clock()
		var expires time.Time
		if err := pool.QueryRow(ctx, `SELECT expires_at FROM outbox.partition_member WHERE replica_id = 'a'`).Scan(&expires); err != nil {
			t.Fatal(err)
		}
		if expires.Before(before.Add(time.Hour)) || expires.After(after.Add(time.Hour)) {
			t.Fatalf("%s with a TTL of an hour between %v and %v, a's membership ends at %v",
				turn, before.Format(time.RFC3339Nano), after.Format(time.RFC3339Nano), expires.Format(time.RFC3339Nano))
		}
	}
}

// Whether a membership has expired is judged by the clock when the call
// runs, not when its transaction began: a call in a transaction that began
// before the membership expired does not renew it, and joins anew (its
// caller's belief may have lapsed meanwhile) like any caller after a lapse.
func TestOwnPartitionsJudgesExpiryByTheClock(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.NewPool(t)
	before := mustOwn(t, pool, "a", true)
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, `SELECT now()`); err != nil {
		t.Fatal(err)
	}
	// Expires after the transaction began, before the call.
	exec(t, pool, `UPDATE outbox.partition_member SET expires_at = clock_timestamp() WHERE replica_id = 'a'`)
	var o ownership
	if err := tx.QueryRow(ctx, `SELECT share, partitions, epochs FROM outbox.own_partitions('a', md5('a')::uuid, true, interval '1 hour')`).
		Scan(&o.share, &o.partitions, &o.epochs); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(o.partitions, before.partitions) {
		t.Fatalf("a owns %d partitions after joining anew, want all 256", len(o.partitions))
	}
	for i := range o.partitions {
		if o.epochs[i] <= before.epochs[i] {
			t.Fatalf("partition %d kept epoch %d across a membership that expired before the call; want it raised",
				o.partitions[i], o.epochs[i])
		}
	}
}
