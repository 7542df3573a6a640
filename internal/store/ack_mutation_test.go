package store_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxd/outboxd/internal/store"
	"github.com/outboxd/outboxd/internal/testdb"
)

// Added by the ack mutation sweep.

// An ack that PostgreSQL picks as a deadlock's victim (40P01) is tried
// again, and publishes its event once the other transaction is gone: a
// deadlock says nothing of the ack itself. Here a transaction holds the
// aggregate's delivery row while the ack, holding the event's lock, waits
// for it; the transaction then asks for the event's lock. The ack waited
// first, so its deadlock check (deadlock_timeout after it began to wait)
// normally runs while the cycle exists and ends its own statement; on a
// machine so loaded that the transaction asks only after that check, the
// transaction's own check finds the cycle and it is the victim, the ack
// goes through untried, and the scenario runs again on the next aggregate
// until the ack was the victim. Kills an ackRetrying that does not retry
// 40P01 (the ack would answer AckFailed).
func TestAckRetriesADeadlock(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	st := store.New(pool)
	for try := range 5 {
		if ackCaughtInADeadlock(t, pool, st, fmt.Sprint(try)) {
			return
		}
		t.Logf("try %d: the test's transaction was the deadlock's victim; again", try)
	}
	t.Fatal("in 5 tries the ack was never the deadlock's victim: its retry went untested")
}

// ackCaughtInADeadlock runs one try of TestAckRetriesADeadlock on aggregate
// key of stream orders and reports whether the ack was the victim.
func ackCaughtInADeadlock(t *testing.T, pool *pgxpool.Pool, st *store.Store, key string) bool {
	t.Helper()
	ctx := t.Context()
	discovered(t, pool, st, "orders", key)
	leases, err := st.Claim(ctx, claimOf(1))
	if err != nil || len(leases) != 1 {
		t.Fatalf("claim: %d leases, %v", len(leases), err)
	}
	id := leases[0].Event.ID
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx))
	var txPID int
	if err := tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&txPID); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `SELECT 1 FROM outbox.delivery WHERE aggregate_key = $1 FOR UPDATE`, key); err != nil {
		t.Fatal(err)
	}
	type answer struct {
		res []store.AckResult
		err error
	}
	done := make(chan answer, 1)
	go func() {
		res, err := st.Ack(ctx, store.AckParams{IDs: []uuid.UUID{id}, ReplicaID: "replica"})
		done <- answer{res, err}
	}()
	waitUntilTrue(t, pool, "the ack to wait for the delivery row's lock", `SELECT count(*) > 0 FROM pg_stat_activity
		WHERE datname = current_database() AND strpos(query, 'outbox.ack(') > 0 AND $1::int = ANY (pg_blocking_pids(pid))`, txPID)
	// The event's lock, which the ack holds: a deadlock.
	_, lockErr := tx.Exec(ctx, `SELECT 1 FROM outbox.event WHERE event_id = $1 FOR UPDATE`, id)
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	var a answer
	select {
	case a = <-done:
	case <-time.After(hangGuard):
		t.Fatalf("the ack has not returned after %v", hangGuard)
	}
	if a.err != nil || len(a.res) != 1 || a.res[0].Status != store.AckPublished {
		t.Fatalf("the ack caught in a deadlock: %+v, %v; want it retried and published", a.res, a.err)
	}
	return lockErr == nil
}
