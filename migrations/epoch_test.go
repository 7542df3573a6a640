package migrations_test

import (
	"context"
	"testing"
	"time"

	"github.com/outboxd/outboxd/internal/testdb"
)

// Epochs fence old leases, and claims commit without waiting for the WAL
// flush, so an epoch must never be handed out twice, even after a crash
// lost a claim: every lease's epoch exceeds the previous one and is at
// least the clock in microseconds (a claim lost in a crash had an earlier
// clock reading than any claim after recovery).
func TestEpochsGrowAndFollowTheClock(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.NewPool(t)
	exec(t, pool, `SELECT outbox.emit('orders', 'o-1', 'T', '{}')`)
	exec(t, pool, `SELECT outbox.discover()`)
	claim := func() int64 {
		t.Helper()
		var epoch int64
		// A negative TTL makes the lease claimable again at once.
		if err := pool.QueryRow(ctx, `SELECT epoch FROM outbox.claim(gen_random_uuid(), 'r', 'x', NULL, 1, interval '-1 second')`).
			Scan(&epoch); err != nil {
			t.Fatal(err)
		}
		return epoch
	}
	before := time.Now().Add(-time.Minute).UnixMicro()
	first, second := claim(), claim()
	if first < before {
		t.Fatalf("epoch %d is below the clock in microseconds (%d)", first, before)
	}
	if second <= first {
		t.Fatalf("epochs %d then %d: not increasing", first, second)
	}
}
