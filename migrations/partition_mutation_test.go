package migrations_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/outboxd/outboxd/internal/testdb"
)

// These tests hold promises of outbox.own_partitions, each found missing
// by a mutation sweep.

// A caller that does not say it has relay sessions (p_wants NULL) wants no
// partitions: its share is 256 divided among the members that want them
// "when p_wants, else 0", and NULL is not a yes. It takes nothing, and it
// does not count in the others' shares: a replica beside it still gets all
// 256.
func TestOwnPartitionsTreatsAnUnknownWantAsNone(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.NewPool(t)
	var share int
	var partitions []int32
	if err := pool.QueryRow(ctx, `SELECT share, partitions FROM outbox.own_partitions('a', md5('a')::uuid, NULL, interval '1 hour')`).
		Scan(&share, &partitions); err != nil {
		t.Fatal(err)
	}
	if share != 0 || len(partitions) != 0 {
		t.Fatalf("with p_wants NULL: share %d, took %d partitions; want none", share, len(partitions))
	}
	if b := mustOwn(t, pool, "b", true); b.share != 256 || len(b.partitions) != 256 {
		t.Fatalf("b beside a member that wants nothing: share %d, owns %d; want 256 and 256", b.share, len(b.partitions))
	}
}

// A takeover takes the free partitions lowest first: with all 256 free
// and a share of 128, a replica takes 0 to 127.
func TestOwnPartitionsTakesTheLowestFreePartitionsFirst(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.NewPool(t)
	a := mustOwn(t, pool, "a", true)
	if b := mustOwn(t, pool, "b", true); b.share != 128 || len(b.partitions) != 0 {
		t.Fatalf("b beside a: share %d, owns %d; want 128 and none", b.share, len(b.partitions))
	}
	if _, err := pool.Exec(ctx, `SELECT outbox.release_partitions(md5('a')::uuid, $1)`, a.partitions); err != nil {
		t.Fatal(err)
	}
	b := mustOwn(t, pool, "b", true)
	want := make([]int32, 128)
	for i := range want {
		want[i] = int32(i)
	}
	if !slices.Equal(b.partitions, want) {
		t.Fatalf("b took %v, want partitions 0 to 127", b.partitions)
	}
}

// What own_partitions returns is what the calling process owns, not what
// its replica id owns: a process restarted under the same id, without
// sessions (so taking nothing), is told it owns none of the partitions its
// expired predecessor held, whether or not the call freed them.
func TestOwnPartitionsReturnsOnlyTheCallingProcesssPartitions(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.NewPool(t)
	const first, second = "00000000-0000-0000-0000-000000000001", "00000000-0000-0000-0000-000000000002"
	var n int
	if err := pool.QueryRow(ctx, `SELECT cardinality(partitions) FROM outbox.own_partitions('a', $1::uuid, true, interval '1 hour')`,
		first).Scan(&n); err != nil || n != 256 {
		t.Fatalf("first process: %v, %d partitions; want 256", err, n)
	}
	exec(t, pool, `UPDATE outbox.partition_member SET expires_at = clock_timestamp() - interval '1 second'`)
	var share int
	var partitions []int32
	if err := pool.QueryRow(ctx, `SELECT share, partitions FROM outbox.own_partitions('a', $1::uuid, false, interval '1 hour')`,
		second).Scan(&share, &partitions); err != nil {
		t.Fatal(err)
	}
	if share != 0 || len(partitions) != 0 {
		t.Fatalf("the restarted process without sessions: share %d, told it owns %d partitions; want none", share, len(partitions))
	}
}

// A renewal's membership lasts the TTL from the call, by the clock, not
// from its transaction's start: a renewal in a transaction that began
// earlier would otherwise end sooner than its caller, counting from the
// call, believes in its partitions.
func TestOwnPartitionsRenewalCountsTheTTLFromTheCall(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.NewPool(t)
	mustOwn(t, pool, "a", true)
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, `SELECT now()`); err != nil {
		t.Fatal(err)
	}
	// Read on another connection, after the transaction began.
	var before time.Time
	if err := pool.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&before); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `SELECT outbox.own_partitions('a', md5('a')::uuid, true, interval '1 hour')`); err != nil {
		t.Fatal(err)
	}
	var expires time.Time
	if err := tx.QueryRow(ctx, `SELECT expires_at FROM outbox.partition_member WHERE replica_id = 'a'`).Scan(&expires); err != nil {
		t.Fatal(err)
	}
	if expires.Before(before.Add(time.Hour)) {
		t.Fatalf("renewed with a TTL of an hour after %v, the membership ends at %v, before an hour from the call",
			before.Format(time.RFC3339Nano), expires.Format(time.RFC3339Nano))
	}
}
