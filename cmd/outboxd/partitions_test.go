package main_test

import (
	"context"
	"fmt"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxd/outboxd/internal/testdb"
)

// Two `outboxd serve` processes, each with a relay, share the aggregates'
// partitions. One is killed with SIGKILL, so it neither releases its
// partitions nor leaves: once its ownership and membership expire
// (--partition-ttl 1s) the other takes every partition over, each under a
// higher epoch than the dead replica held it at.
func TestKilledReplicasPartitionsAreTakenOver(t *testing.T) {
	if testing.Short() {
		t.Skip("runs server and relay processes")
	}
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	addrs := []string{freeAddr(t), freeAddr(t)}
	var servers []*process
	for i, addr := range addrs {
		servers = append(servers, start(t, "serve", "--database-url", url, "--listen", addr, "--http-listen", "",
			"--replica-id", fmt.Sprintf("r%d", i), "--partition-ttl", "1s", "--log-level", "warn"))
	}
	for i, addr := range addrs {
		start(t, "relay", "--server", addr, "--sink", "stdout://", "--relay-id", fmt.Sprintf("relay%d", i), "--log-level", "warn")
	}
	waitPartitionOwners(t, pool, "map[r0:128 r1:128]")
	var dead []int32
	var deadEpochs []int64
	if err := pool.QueryRow(ctx, `SELECT array_agg(partition ORDER BY partition), array_agg(epoch ORDER BY partition)
		FROM outbox.partition WHERE owner = 'r0'`).Scan(&dead, &deadEpochs); err != nil {
		t.Fatal(err)
	}

	servers[0].signal(os.Kill)
	waitPartitionOwners(t, pool, "map[r1:256]")
	var raised bool
	if err := pool.QueryRow(ctx, `SELECT bool_and(p.epoch > d.epoch) FROM outbox.partition p
		JOIN unnest($1::int[], $2::bigint[]) AS d(partition, epoch) USING (partition)`, dead, deadEpochs).Scan(&raised); err != nil {
		t.Fatal(err)
	}
	if !raised {
		t.Fatal("a partition of the killed replica was taken over without a higher epoch")
	}
}

// waitPartitionOwners waits until the count of partitions per owner prints
// as want, failing after a minute.
func waitPartitionOwners(t *testing.T, pool *pgxpool.Pool, want string) {
	t.Helper()
	var got string
	for deadline := time.Now().Add(time.Minute); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		counts := map[string]int{}
		rows, err := pool.Query(context.Background(), `SELECT coalesce(owner, ''), count(*) FROM outbox.partition GROUP BY 1`)
		if err != nil {
			t.Fatal(err)
		}
		for rows.Next() {
			var owner string
			var n int
			if err := rows.Scan(&owner, &n); err != nil {
				t.Fatal(err)
			}
			counts[owner] = n
		}
		if err := rows.Err(); err != nil {
			t.Fatal(err)
		}
		if got = fmt.Sprint(counts); got == want {
			return
		}
	}
	t.Fatalf("partitions owned %s, want %s", got, want)
}
