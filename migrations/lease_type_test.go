package migrations_test

import (
	"testing"

	"github.com/outboxd/outboxd/internal/testdb"
)

// Every field of a lease a claim or a round returns is set (a lease that
// names no republish says 0), so a caller's "lease IS NOT NULL", which
// PostgreSQL answers true only when every field of the row is, keeps
// telling a lease from none (bench/pgbench/delivery-cycle.sh relies on it).
func TestEveryFieldOfALeaseIsSet(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pool := testdb.NewPool(t)
	emitN(t, pool, "claimed", 1)
	discover(t, pool) // no session: ready for the claim below
	var leases, whole int
	if err := pool.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE c IS NOT NULL)
		FROM outbox.claim('5d1b5c3e-8f7a-4f55-9c1e-2b0b6f4d7a10', 'r', 'rep', NULL, 10, '30s') c`).Scan(&leases, &whole); err != nil {
		t.Fatal(err)
	}
	if leases != 1 || whole != 1 {
		t.Fatalf("the claim returned %d leases, %d with every field set; want 1 and 1", leases, whole)
	}

	emitN(t, pool, "dispatched", 1)
	if err := pool.QueryRow(ctx, `SELECT count(r.lease), count(*) FILTER (WHERE r.lease IS NOT NULL)
		FROM outbox.discover_round(1000, NULL, ARRAY['5d1b5c3e-8f7a-4f55-9c1e-2b0b6f4d7a10'::uuid], ARRAY['r'],
		                           ARRAY['30s'::interval], ARRAY[4], NULL, 'rep') r`).Scan(&leases, &whole); err != nil {
		t.Fatal(err)
	}
	if leases != 1 || whole != 1 {
		t.Fatalf("the round dispatched %d leases, %d with every field set; want 1 and 1", leases, whole)
	}
}
