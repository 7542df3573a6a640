package migrations_test

import (
	"fmt"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/outboxd/outboxd/internal/testdb"
)

// Tests added by the ack mutation sweep: each pins down a line of
// outbox.ack that no other test held.

// Two ack batches that touch the same aggregates through different events
// lock the aggregates' delivery rows in key order, whatever order their
// event ids fall in, so they cannot deadlock. Batch X acks b/1 and a/1
// (event ids put b first), batch Y acks a/2 and b/2 (a first). Y waits
// first for a's row, which the test holds; then X waits too. Locked in
// event-id order, X would hold b while waiting for a, and Y, given a once
// the test lets go, would wait for b: a deadlock, and one batch refused
// (40P01). In key order both wait for a and go one after the other.
func TestAckBatchesLockDeliveryRowsInKeyOrder(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pool := testdb.NewPool(t)
	id := func(n int) uuid.UUID { return uuid.MustParse(fmt.Sprintf("00000000-0000-0000-0000-%012d", n)) }
	for _, e := range []struct {
		key string
		id  uuid.UUID
	}{{"b", id(1)}, {"a", id(2)}, {"a", id(3)}, {"b", id(4)}} {
		if _, err := pool.Exec(ctx, `SELECT outbox.emit('orders', $1, 'T', '{}', event_id => $2)`, e.key, e.id); err != nil {
			t.Fatal(err)
		}
	}
	discover(t, pool)
	if n := count(t, pool, `SELECT count(*) FROM outbox.event WHERE (aggregate_key, revision, event_id) IN
		(('b', 1, '00000000-0000-0000-0000-000000000001'), ('a', 1, '00000000-0000-0000-0000-000000000002'),
		 ('a', 2, '00000000-0000-0000-0000-000000000003'), ('b', 2, '00000000-0000-0000-0000-000000000004'))`); n != 4 {
		t.Fatalf("%d of the 4 events have the revisions the test expects", n)
	}

	holder, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Rollback(ctx)
	holderPID := backendPID(t, holder)
	if _, err := holder.Exec(ctx, `SELECT 1 FROM outbox.delivery WHERE aggregate_key = 'a' FOR UPDATE`); err != nil {
		t.Fatal(err)
	}

	type answer struct {
		statuses map[uuid.UUID]string
		err      error
	}
	start := func(ids ...uuid.UUID) (int, <-chan answer) {
		t.Helper()
		conn, err := pool.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(conn.Release)
		pid := backendPID(t, conn)
		done := make(chan answer, 1)
		go func() {
			a := answer{statuses: map[uuid.UUID]string{}}
			rows, err := conn.Query(ctx, `SELECT event_id, status FROM outbox.ack($1, 'x')`, ids)
			if err == nil {
				var got []struct {
					ID     uuid.UUID
					Status string
				}
				got, err = pgx.CollectRows(rows, pgx.RowToStructByPos[struct {
					ID     uuid.UUID
					Status string
				}])
				for _, g := range got {
					a.statuses[g.ID] = g.Status
				}
			}
			a.err = err
			done <- a
		}()
		return pid, done
	}
	yPID, y := start(id(3), id(4))
	waitUntilBlockedBy(t, pool, yPID, holderPID)
	// X queues behind Y for a's row (Y holds its tuple lock while it
	// waits for the test's transaction).
	xPID, x := start(id(1), id(2))
	waitUntilBlockedBy(t, pool, xPID, yPID)
	if err := holder.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	ay, ax := <-y, <-x
	if ay.err != nil || ax.err != nil {
		t.Fatalf("batch Y (a/2, b/2): %v; batch X (b/1, a/1): %v; want both answered", ay.err, ax.err)
	}
	if ax.statuses[id(1)] != "published" || ax.statuses[id(2)] != "published" {
		t.Fatalf("batch X answered %v, want b/1 and a/1 published", ax.statuses)
	}
	if ay.statuses[id(3)] != "out_of_order" || ay.statuses[id(4)] != "out_of_order" {
		t.Fatalf("batch Y answered %v, want a/2 and b/2 out of order (it went first)", ay.statuses)
	}
}

// A window that slides keeps the lease's expiry when it is later than the
// slide's own TTL would set: the relay extended the lease (ExtendLease) to
// publish an event it holds, and an ack of an earlier revision of the same
// lease must not cut that extension short (the event would be claimed again
// while the relay still publishes it).
func TestAWindowSlideKeepsAnExtendedExpiry(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	emitN(t, pool, "a", 4)
	discover(t, pool)
	holder := uuid.New()
	got := claimWindow(t, pool, holder, 1, 4, 2) // revisions 1-2, a window of 4
	if r := revisions(got, "a"); len(r) != 2 {
		t.Fatalf("claimed %v, want revisions 1 and 2", r)
	}
	exec(t, pool, fmt.Sprintf(`SELECT * FROM outbox.extend_lease('%s', %d, interval '1 hour')`, got[0].id, got[0].epoch))
	// Acking 1 frees one unit: the window slides onto 3 (30 s TTL).
	st, handed := ackWindow(t, pool, []uuid.UUID{got[0].id}, holder, 4, 0)
	if st[got[0].id] != "published" || len(handed) != 1 || handed[0].revision != 3 || handed[0].epoch != got[0].epoch {
		t.Fatalf("ack of 1: %v, handed %v; want revision 3 under epoch %d", st, handed, got[0].epoch)
	}
	if n := count(t, pool, `SELECT count(*) FROM outbox.delivery WHERE aggregate_key = 'a' AND state = 'leased'
		AND lease_expires_at > clock_timestamp() + interval '50 minutes'
		AND claimable_at > clock_timestamp() + interval '50 minutes'`); n != 1 {
		t.Fatal("the slide cut the lease's extension of an hour short")
	}
}
