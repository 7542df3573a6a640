package migrations_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxd/outboxd/internal/testdb"
)

// These tests force one interleaving each of a discovery round and an ack
// still in its transaction, with PostgreSQL's own word (pg_blocking_pids)
// that the round waits for the ack: no sleeps, no chance.

// openAck begins a transaction on its own connection and acks ids in it as
// replica x (handing over to holder, if not nil), leaving the transaction
// open; it returns the transaction and its backend's pid.
// ackOpenWhileRevision2Commits sets the scene of the tests of a round
// meeting an ack still in its transaction: aggregate a's revision 1 leased
// to a holder elsewhere, its ack applied but not committed (ack, on backend
// ackPID), and revision 2 committed after the ack read the events.
func ackOpenWhileRevision2Commits(t *testing.T) (pool *pgxpool.Pool, ack pgx.Tx, ackPID int) {
	t.Helper()
	pool = testdb.NewPoolConfig(t, func(c *pgxpool.Config) { c.MaxConns = 6 })
	emitN(t, pool, "a", 1)
	discover(t, pool)
	first := claimAs(t, pool, uuid.New(), "elsewhere")
	ack, ackPID = openAck(t, pool, []uuid.UUID{first.id}, nil)
	emitN(t, pool, "a", 1)
	return pool, ack, ackPID
}

func openAck(t *testing.T, pool *pgxpool.Pool, ids []uuid.UUID, holder *uuid.UUID) (pgx.Tx, int) {
	t.Helper()
	return openWindowedAck(t, pool, ids, holder, 0)
}

// openWindowedAck is openAck for a holder taking a window (and as much
// credit) of window > 0, which sends the ack down its windowed path.
func openWindowedAck(t *testing.T, pool *pgxpool.Pool, ids []uuid.UUID, holder *uuid.UUID, window int) (pgx.Tx, int) {
	t.Helper()
	ctx := testContext(t)
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	pid := backendPID(t, tx)
	var holders []uuid.UUID
	if holder != nil {
		holders = []uuid.UUID{*holder}
	}
	var windows []int32
	if window > 0 {
		windows = []int32{int32(window)}
	}
	var published int
	if err := tx.QueryRow(ctx, `SELECT count(*) FROM outbox.ack($1, 'x', $2, ARRAY[interval '30 seconds'], $3, $3)
		WHERE status = 'published'`, ids, holders, windows).Scan(&published); err != nil {
		t.Fatal(err)
	}
	if published != len(ids) {
		t.Fatalf("the open ack published %d of %d events", published, len(ids))
	}
	return tx, pid
}

// discoverRound runs one whole round with no dispatch.
func discoverRound(ctx context.Context, conn *pgxpool.Conn) error {
	_, err := conn.Exec(ctx, `SELECT * FROM outbox.discover()`)
	return err
}

// runBehind starts call (by default a discovery round, discoverRound; a
// re-scan, a nack, a release...) on its own connection and returns once
// the call waits for backend holder, or has finished without waiting
// (which the caller's assertions then catch); the channel yields the
// call's error.
func runBehind(t *testing.T, pool *pgxpool.Pool, holder int, call ...func(context.Context, *pgxpool.Conn) error) <-chan error {
	t.Helper()
	ctx := testContext(t)
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var pid int
	if err := conn.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
		conn.Release()
		t.Fatal(err)
	}
	done := make(chan error, 1)
	run := discoverRound
	if len(call) > 0 {
		run = call[0]
	}
	go func() {
		defer conn.Release()
		done <- run(ctx, conn)
	}()
	for {
		var blocked bool
		if err := pool.QueryRow(ctx, `SELECT $2::int = ANY (pg_blocking_pids($1))`, pid, holder).Scan(&blocked); err != nil {
			t.Fatal(err)
		}
		if blocked {
			return done
		}
		select {
		case err := <-done:
			t.Logf("the call finished without waiting for backend %d (err %v)", holder, err)
			finished := make(chan error, 1)
			finished <- err
			return finished
		case <-ctx.Done():
			t.Fatalf("the call neither waited for backend %d nor finished", holder)
		case <-time.After(2 * time.Millisecond):
		}
	}
}

func await(t *testing.T, done <-chan error) {
	t.Helper()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("discovery round: %v", err)
		}
	case <-testContext(t).Done():
		t.Fatal("the discovery round did not finish after the ack committed")
	}
}

// An ack still in its transaction ends the aggregate's lease with nothing
// to follow (idle); the next revision commits; a round finds it and must
// wait for the ack's row lock before it decides, so that it sees the
// aggregate idle and wakes it. Deciding on what it read before the lock
// (leased: work in hand) would leave revision 2 behind an idle aggregate
// for good.
func TestDiscoveryWaitsForAnAckInItsTransaction(t *testing.T) {
	t.Parallel()
	pool, ack, ackPID := ackOpenWhileRevision2Commits(t)
	round := runBehind(t, pool, ackPID)
	if err := ack.Commit(testContext(t)); err != nil {
		t.Fatal(err)
	}
	await(t, round)

	if got := claimRevisions(t, pool); got["a"] != 2 {
		t.Fatalf("claim after the round = %v, want a at revision 2", got)
	}
	if n := strandedEvents(t, pool); n != 0 {
		t.Fatalf("%d stranded events", n)
	}
}

// outbox.late_event holds events found at or below their aggregate's
// cursor that no rule will deliver, and nothing else: an event a round
// found pending while an ack published it (the ack moved the cursor past
// it, committing while the round waited for its row) was delivered, and is
// not recorded.
func TestLateEventsLeaveOutEventsAckedDuringTheRound(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPoolConfig(t, func(c *pgxpool.Config) { c.MaxConns = 6 })
	h := uuid.New()
	emitN(t, pool, "a", 1)
	discover(t, pool)
	first := claimOne(t, pool, h, 1)
	emitN(t, pool, "a", 1) // revision 2, not discovered yet
	// The ack of revision 1 hands revision 2 over to the same session: it
	// reads events itself, discovered or not.
	_, handed := ackWindow(t, pool, []uuid.UUID{first}, h, 1, 0)
	if len(handed) != 1 || handed[0].revision != 2 {
		t.Fatalf("handed over %v, want revision 2", handed)
	}

	ack, ackPID := openAck(t, pool, []uuid.UUID{handed[0].id}, &h) // publishes revision 2
	round := runBehind(t, pool, ackPID)                            // finds revision 2 pending
	if err := ack.Commit(testContext(t)); err != nil {
		t.Fatal(err)
	}
	await(t, round)

	if n := count(t, pool, `SELECT count(*) FROM outbox.late_event`); n != 0 {
		t.Fatalf("%d late events recorded for an event an ack published during the round", n)
	}
	if n := count(t, pool, `SELECT count(*) FROM outbox.delivery WHERE state = 'idle' AND delivered_revision = 2`); n != 1 {
		t.Fatal("the aggregate is not idle at revision 2")
	}
	if n := strandedEvents(t, pool); n != 0 {
		t.Fatalf("%d stranded events", n)
	}
}

// The same interleaving with dispatch: the round names the aggregate for a
// session, waits for the ack's row lock, then finds it idle and leases
// revision 2 to the session. Deciding before the lock (leased: work in
// hand) would lease nothing and strand revision 2.
func TestDispatchWaitsForAnAckInItsTransaction(t *testing.T) {
	t.Parallel()
	pool, ack, ackPID := ackOpenWhileRevision2Commits(t)
	h := uuid.New()
	var leased map[string]uuid.UUID
	round := runBehind(t, pool, ackPID, func(ctx context.Context, conn *pgxpool.Conn) error {
		// The scan sees the aggregate leased, so it is named for the
		// session whatever its state (all): the apply decides after the lock.
		var err error
		leased, err = dispatchRound(ctx, conn, h, true)
		return err
	})
	if err := ack.Commit(testContext(t)); err != nil {
		t.Fatal(err)
	}
	await(t, round)

	want := eventID(t, pool, "a", 2)
	if leased["a"] != want {
		t.Fatalf("the round dispatched %v, want revision 2 of a (%s)", leased, want)
	}
	if n := count(t, pool, fmt.Sprintf(`SELECT count(*) FROM outbox.delivery WHERE aggregate_key = 'a' AND state = 'leased' AND holder = '%s'`, h)); n != 1 {
		t.Fatal("aggregate a is not leased to the session")
	}
	if n := strandedEvents(t, pool); n != 0 {
		t.Fatalf("%d stranded events", n)
	}
}

// The same interleaving through the windowed ack path: the window's last
// revision acked in an open transaction ends the lease with nothing to
// follow; the round that finds the next revision waits for it and wakes
// the aggregate.
func TestDiscoveryWaitsForAWindowedAckInItsTransaction(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPoolConfig(t, func(c *pgxpool.Config) { c.MaxConns = 6 })
	h := uuid.New()
	emitN(t, pool, "a", 2)
	discover(t, pool)
	ls := claimWindow(t, pool, h, 1, 4, 4)
	if len(ls) != 2 {
		t.Fatalf("claimed %v, want revisions 1 and 2 in one window", ls)
	}

	ack, ackPID := openWindowedAck(t, pool, []uuid.UUID{ls[0].id, ls[1].id}, &h, 4)
	emitN(t, pool, "a", 1) // revision 3, committed after the ack read the events
	round := runBehind(t, pool, ackPID)
	if err := ack.Commit(testContext(t)); err != nil {
		t.Fatal(err)
	}
	await(t, round)

	if got := claimRevisions(t, pool); got["a"] != 3 {
		t.Fatalf("claim after the round = %v, want a at revision 3", got)
	}
	if n := strandedEvents(t, pool); n != 0 {
		t.Fatalf("%d stranded events", n)
	}
}
