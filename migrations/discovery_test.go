package migrations_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxd/outboxd/client"
	"github.com/outboxd/outboxd/internal/testdb"
)

// These tests drive the delivery functions in SQL, one step at a time, to
// pin down the interleavings that once stranded events. The server runs the
// same functions; server and cmd tests cover them end to end.

// discover runs one discovery round and returns how many events it found.
func discover(t *testing.T, pool *pgxpool.Pool) int64 {
	t.Helper()
	return count(t, pool, `SELECT events FROM outbox.discover()`)
}

// claimed is what one claim returned, by event revision.
func claimRevisions(t *testing.T, pool *pgxpool.Pool) map[string]int64 {
	t.Helper()
	rows, err := pool.Query(testContext(t),
		`SELECT aggregate_key, revision FROM outbox.claim(gen_random_uuid(), 'r', 'x', NULL, 100, interval '30 seconds')`)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]int64{}
	for rows.Next() {
		var key string
		var rev int64
		if err := rows.Scan(&key, &rev); err != nil {
			t.Fatal(err)
		}
		got[key] = rev
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return got
}

func ackEvents(t *testing.T, pool *pgxpool.Pool, where string) {
	t.Helper()
	exec(t, pool, `SELECT * FROM outbox.ack(ARRAY(SELECT event_id FROM outbox.event WHERE `+where+`), 'x')`)
}

func strandedEvents(t *testing.T, pool *pgxpool.Pool) int64 {
	t.Helper()
	return count(t, pool, `SELECT coalesce(sum(events), 0)::bigint FROM outbox.stranded(NULL)`)
}

// Discovery finds each committed event exactly once, however late its
// transaction commits, and a transaction left open does not hide the
// events committed after it started.
func TestDiscoveryFindsLateCommitsExactlyOnce(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pool := testdb.NewPool(t)

	open, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer open.Rollback(ctx)
	if _, err := open.Exec(ctx, `SELECT outbox.emit('orders', 'slow', 'T', '{}')`); err != nil {
		t.Fatal(err)
	}
	exec(t, pool, `SELECT outbox.emit('orders', 'fast-1', 'T', '{}')`)
	if n := discover(t, pool); n != 1 {
		t.Fatalf("first round found %d events, want 1 (the committed one)", n)
	}
	// Committed after the open transaction started, and after the round.
	exec(t, pool, `SELECT outbox.emit('orders', 'fast-2', 'T', '{}')`)
	if n := discover(t, pool); n != 1 {
		t.Fatalf("second round found %d events, want 1", n)
	}
	if n := discover(t, pool); n != 0 {
		t.Fatalf("a round with nothing new found %d events", n)
	}
	if err := open.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if n := discover(t, pool); n != 1 {
		t.Fatalf("round after the late commit found %d events, want 1", n)
	}
	if n := discover(t, pool); n != 0 {
		t.Fatalf("the late event was found twice (%d)", n)
	}
	got := claimRevisions(t, pool)
	if len(got) != 3 {
		t.Fatalf("claimed %v, want the three aggregates", got)
	}
	// A rolled-back producer leaves nothing to find.
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `SELECT outbox.emit('orders', 'gone', 'T', '{}')`); err != nil {
		t.Fatal(err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if n := discover(t, pool); n != 0 {
		t.Fatalf("found %d events of a rolled-back transaction", n)
	}
}

// A producer's transaction writes only its event and its aggregate's
// counter: no delivery row, no lock on anything the server writes.
func TestProducerWritesNothingTheServerOwns(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pool := testdb.NewPool(t)
	exec(t, pool, `SELECT outbox.emit('orders', 'o-1', 'T', '{}')`)
	discover(t, pool)
	claimRevisions(t, pool) // o-1 leased: its delivery row is the server's now

	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `SELECT outbox.emit('orders', 'o-1', 'T', '{}')`); err != nil {
		t.Fatal(err)
	}
	var locked []string
	rows, err := tx.Query(ctx, `
		SELECT DISTINCT c.relname FROM pg_locks l JOIN pg_class c ON c.oid = l.relation
		WHERE l.pid = pg_backend_pid() AND l.mode = 'RowExclusiveLock' AND c.relkind = 'r'
		ORDER BY 1`)
	if err != nil {
		t.Fatal(err)
	}
	if locked, err = pgx.CollectRows(rows, pgx.RowTo[string]); err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(locked) != "[aggregate event]" {
		t.Fatalf("the producer's transaction writes %v, want only [aggregate event]", locked)
	}
	// The server acks the leased event while the producer's transaction is
	// still open: nothing waits for it.
	actx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if _, err := pool.Exec(actx, `SELECT * FROM outbox.ack(ARRAY(SELECT event_id FROM outbox.event WHERE revision = 1), 'x')`); err != nil {
		t.Fatalf("ack while a producer of the same aggregate is open: %v", err)
	}
}

// Producers at REPEATABLE READ and SERIALIZABLE lose nothing: an event whose
// snapshot predates the ack of its aggregate's previous revision is still
// found and delivered, and so is one that fills a gap.
func TestSnapshotIsolationProducersRacingAcks(t *testing.T) {
	t.Parallel()
	for _, level := range []pgx.TxIsoLevel{pgx.RepeatableRead, pgx.Serializable} {
		t.Run(string(level), func(t *testing.T) {
			t.Parallel()
			ctx := testContext(t)
			pool := testdb.NewPool(t)

			// Rev 1 is leased; the producer's snapshot is taken while it is.
			exec(t, pool, `SELECT outbox.emit('orders', 'o-1', 'T', '{}')`)
			discover(t, pool)
			if got := claimRevisions(t, pool); got["o-1"] != 1 {
				t.Fatalf("claim = %v, want o-1 rev 1", got)
			}
			producer, err := pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: level})
			if err != nil {
				t.Fatal(err)
			}
			defer producer.Rollback(ctx)
			if _, err := producer.Exec(ctx, `SELECT 1`); err != nil {
				t.Fatal(err)
			}
			ackEvents(t, pool, `revision = 1`) // o-1 goes idle: nothing follows yet
			if _, err := producer.Exec(ctx, `SELECT outbox.emit('orders', 'o-1', 'T', '{}')`); err != nil {
				t.Fatal(err)
			}
			if err := producer.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			discover(t, pool)
			if got := claimRevisions(t, pool); got["o-1"] != 2 {
				t.Fatalf("after the producer committed, claim = %v, want o-1 rev 2", got)
			}

			// A gap-held aggregate, and a snapshot producer filling the gap.
			exec(t, pool, `SELECT outbox.emit('orders', 'g', 'T', '{}', revision => 1)`)
			exec(t, pool, `SELECT outbox.emit('orders', 'g', 'T', '{}', revision => 3)`)
			discover(t, pool)
			if got := claimRevisions(t, pool); got["g"] != 1 {
				t.Fatalf("claim = %v, want g rev 1", got)
			}
			filler, err := pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: level})
			if err != nil {
				t.Fatal(err)
			}
			defer filler.Rollback(ctx)
			if _, err := filler.Exec(ctx, `SELECT 1`); err != nil {
				t.Fatal(err)
			}
			ackEvents(t, pool, `aggregate_key = 'g' AND revision = 1`)
			if got := claimRevisions(t, pool); len(got) != 0 {
				t.Fatalf("claim at the gap = %v, want nothing", got)
			}
			if st := count(t, pool, `SELECT count(*) FROM outbox.delivery WHERE aggregate_key = 'g' AND state = 'gap'`); st != 1 {
				t.Fatal("aggregate g is not held at its gap")
			}
			if _, err := filler.Exec(ctx, `SELECT outbox.emit('orders', 'g', 'T', '{}', revision => 2)`); err != nil {
				t.Fatal(err)
			}
			if err := filler.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			discover(t, pool)
			if got := claimRevisions(t, pool); got["g"] != 2 {
				t.Fatalf("after the gap was filled, claim = %v, want g rev 2", got)
			}
			if n := strandedEvents(t, pool); n != 0 {
				t.Fatalf("%d stranded events, want 0", n)
			}
		})
	}
}

// The delivery functions refuse a transaction whose statements share one
// snapshot, whatever the caller's default, instead of reading stale state
// after their locks.
func TestDeliveryFunctionsNeedReadCommitted(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pool := testdb.NewPool(t)
	for _, call := range []string{
		`SELECT * FROM outbox.discover()`,
		`SELECT * FROM outbox.discover_scan()`,
		`SELECT * FROM outbox.discover_apply('1:1:', '1:1:')`,
		`SELECT * FROM outbox.claim(gen_random_uuid(), 'r', 'x', NULL, 1, interval '30 seconds')`,
		`SELECT * FROM outbox.ack(ARRAY[gen_random_uuid()], 'x')`,
	} {
		tx, err := pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
		if err != nil {
			t.Fatal(err)
		}
		_, err = tx.Exec(ctx, call)
		// Before the check: a failed check ends the test, and a
		// transaction left open would hold the pool's Close at cleanup
		// until the package's timeout, the failure never reported.
		_ = tx.Rollback(ctx)
		wantSQLState(t, err, "25000")
	}
}

// An idempotent retry of an event (same event_id) records nothing and
// consumes no revision, with client.Emit, with outbox.emit, with INSERT ...
// ON CONFLICT DO NOTHING, and when it races the first attempt; the same id
// with other content is refused.
func TestIdempotentRetryCreatesNoGap(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pool := testdb.NewPoolConfig(t, func(c *pgxpool.Config) { c.MaxConns = 6 })
	id := uuid.New()
	ev := client.Event{ID: id, Stream: "orders", AggregateKey: "o-1", Type: "T", Payload: []byte(`{"a":1}`)}
	first, err := client.Emit(ctx, pool, ev)
	if err != nil {
		t.Fatal(err)
	}
	again, err := client.Emit(ctx, pool, ev)
	if err != nil || again != first {
		t.Fatalf("retry through emit = %+v, %v; want the recorded %+v", again, err, first)
	}
	var emitted client.Emitted
	if err := pool.QueryRow(ctx, `SELECT event_id, revision FROM outbox.emit(stream => 'orders',
		aggregate_key => 'o-1', event_type => 'T', payload => '{"a":1}', event_id => $1)`, id).
		Scan(&emitted.ID, &emitted.Revision); err != nil || emitted != first {
		t.Fatalf("retry through outbox.emit = %+v, %v; want the recorded %+v", emitted, err, first)
	}
	const insert = `INSERT INTO outbox.event (event_id, stream, aggregate_key, event_type, payload)
		VALUES ($1, 'orders', 'o-1', 'T', '{"a":1}') ON CONFLICT DO NOTHING`
	if tag, err := pool.Exec(ctx, insert, id); err != nil || tag.RowsAffected() != 0 {
		t.Fatalf("ON CONFLICT DO NOTHING retry: %v, %v rows; want 0 rows", err, tag.RowsAffected())
	}
	_, err = client.Emit(ctx, pool, client.Event{ID: id, Stream: "orders", AggregateKey: "o-1", Type: "T", Payload: []byte(`{"a":2}`)})
	wantSQLState(t, err, "23505")

	// The first attempt of another event is still open when its retry
	// arrives; the retry queues on the aggregate's order lock.
	racing := uuid.New()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	pid := backendPID(t, tx)
	if _, err := tx.Exec(ctx, insert, racing); err != nil {
		t.Fatal(err)
	}
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	retryPID := backendPID(t, conn)
	retried := make(chan error, 1)
	go func() {
		tag, err := conn.Exec(ctx, insert, racing)
		if err == nil && tag.RowsAffected() != 0 {
			err = fmt.Errorf("retry inserted %d rows", tag.RowsAffected())
		}
		retried <- err
	}()
	waitUntilBlockedBy(t, pool, retryPID, pid)
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-retried:
		if err != nil {
			t.Fatalf("racing retry: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("racing retry did not finish after the first attempt committed")
	}

	// Revisions 1 and 2 exist, the counter says 2, the next is 3, and
	// delivery walks them with no gap.
	if n := count(t, pool, `SELECT last_revision FROM outbox.aggregate WHERE aggregate_key = 'o-1'`); n != 2 {
		t.Fatalf("counter = %d, want 2", n)
	}
	next, err := client.Emit(ctx, pool, client.Event{Stream: "orders", AggregateKey: "o-1", Type: "T", Payload: []byte(`{}`)})
	if err != nil || next.Revision != 3 {
		t.Fatalf("next emit = %+v, %v; want revision 3", next, err)
	}
	discover(t, pool)
	for rev := int64(1); rev <= 3; rev++ {
		if got := claimRevisions(t, pool); got["o-1"] != rev {
			t.Fatalf("claim = %v, want o-1 rev %d", got, rev)
		}
		ackEvents(t, pool, fmt.Sprintf(`aggregate_key = 'o-1' AND revision = %d`, rev))
	}
}

// backendPID is the PostgreSQL backend process id of q's connection, as
// pg_blocking_pids names it.
func backendPID(t *testing.T, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}) int {
	t.Helper()
	var pid int
	if err := q.QueryRow(testContext(t), `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
		t.Fatal(err)
	}
	return pid
}

// waitUntilBlockedBy waits until backend pid waits for a lock that holder
// holds: an explicit signal from PostgreSQL, not a sleep.
func waitUntilBlockedBy(t *testing.T, pool *pgxpool.Pool, pid, holder int) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) {
		var blocked bool
		if err := pool.QueryRow(testContext(t),
			`SELECT $2::int = ANY (pg_blocking_pids($1))`, pid, holder).Scan(&blocked); err != nil {
			t.Fatal(err)
		}
		if blocked {
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Fatalf("backend %d never blocked on %d", pid, holder)
}

// Producers cannot set what delivery owns: published_at and created_at on
// insert, published_at by an UPDATE.
func TestProducersCannotSetDeliveryColumns(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pool := testdb.NewPool(t)
	_, err := pool.Exec(ctx, `INSERT INTO outbox.event (stream, aggregate_key, event_type, payload, published_at)
		VALUES ('orders', 'o-1', 'T', '{}', now())`)
	wantSQLState(t, err, "22023")
	_, err = pool.Exec(ctx, `INSERT INTO outbox.event (stream, aggregate_key, event_type, payload, created_at)
		VALUES ('orders', 'o-1', 'T', '{}', now() + interval '10 years')`)
	wantSQLState(t, err, "22023")
	exec(t, pool, `SELECT outbox.emit('orders', 'o-1', 'T', '{}')`)
	_, err = pool.Exec(ctx, `UPDATE outbox.event SET published_at = now()`)
	wantSQLState(t, err, "55000")
	// Discovery finds an event by its transaction's id, so whatever xid a
	// producer writes, the trigger records its own: on the common path
	// (empty headers) and on the other.
	for _, headers := range []string{`{}`, `{"h":"v"}`} {
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		var own, got string
		var id uuid.UUID
		if err := tx.QueryRow(ctx, `SELECT pg_current_xact_id()::text`).Scan(&own); err != nil {
			t.Fatal(err)
		}
		if err := tx.QueryRow(ctx, `INSERT INTO outbox.event (stream, aggregate_key, event_type, payload, headers, xid)
			VALUES ('orders', 'o-2', 'T', '{}', $1::jsonb, '3') RETURNING event_id`, headers).Scan(&id); err != nil {
			t.Fatal(err)
		}
		if err := tx.QueryRow(ctx, `SELECT xid::text FROM outbox.event WHERE event_id = $1`, id).Scan(&got); err != nil {
			t.Fatal(err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		if got != own {
			t.Errorf("headers %s: event recorded with xid %s, want its transaction's %s", headers, got, own)
		}
	}
	if n := count(t, pool, `SELECT count(*) FROM outbox.event WHERE published_at IS NULL AND created_at <= now()`); n != 3 {
		t.Fatalf("%d pending events with a past created_at, want 3", n)
	}
}

// Revisions are bounded so that no value can make delivery's arithmetic
// overflow: the largest one is delivered and acked like any other, and the
// counter refuses to go past it with an error, not a wedged aggregate.
func TestRevisionsAreBounded(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pool := testdb.NewPool(t)
	const maxRevision = 1<<53 - 1
	_, err := client.Emit(ctx, pool, client.Event{Stream: "orders", AggregateKey: "o-1", Type: "T", Payload: []byte(`{}`), Revision: maxRevision + 1})
	wantSQLState(t, err, "22023")
	_, err = pool.Exec(ctx, `SELECT outbox.emit('orders', 'o-1', 'T', '{}', revision => 9223372036854775807)`)
	wantSQLState(t, err, "22023")
	if _, err := client.Emit(ctx, pool, client.Event{Stream: "orders", AggregateKey: "o-1", Type: "T", Payload: []byte(`{}`), Revision: maxRevision}); err != nil {
		t.Fatal(err)
	}
	_, err = client.Emit(ctx, pool, client.Event{Stream: "orders", AggregateKey: "o-1", Type: "T", Payload: []byte(`{}`)})
	wantSQLState(t, err, "23514")
	discover(t, pool)
	if got := claimRevisions(t, pool); got["o-1"] != maxRevision {
		t.Fatalf("claim = %v, want o-1 at the largest revision", got)
	}
	if n := count(t, pool, `SELECT count(*) FROM outbox.ack(ARRAY(SELECT event_id FROM outbox.event), 'x') WHERE status = 'published'`); n != 1 {
		t.Fatal("the largest revision could not be acked")
	}
	if n := count(t, pool, `SELECT count(*) FROM outbox.delivery WHERE state = 'idle'`); n != 1 {
		t.Fatal("the aggregate did not settle after its largest revision")
	}
}

// Every part of an event is bounded, so the largest event fits in one
// delivery message.
func TestEventSizeIsBounded(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pool := testdb.NewPool(t)
	big := func(n int) string { return fmt.Sprintf("%0*d", n, 0) }
	_, err := pool.Exec(ctx, `SELECT outbox.emit('orders', $1, 'T', '{}')`, big(1025))
	wantSQLState(t, err, "54000")
	_, err = pool.Exec(ctx, `SELECT outbox.emit('orders', 'o-1', $1, '{}')`, big(257))
	wantSQLState(t, err, "54000")
	_, err = pool.Exec(ctx, `SELECT outbox.emit('orders', 'o-1', 'T', '{}', jsonb_build_object('h', $1::text))`, big(70000))
	wantSQLState(t, err, "54000")
	_, err = pool.Exec(ctx, `UPDATE outbox.settings SET max_payload_bytes = 4 * 1024 * 1024`)
	wantSQLState(t, err, "23514")
	if n := count(t, pool, `SELECT count(*) FROM outbox.event`); n != 0 {
		t.Fatalf("%d events written by refused inserts", n)
	}
}

// stranded counts pending events that no rule will deliver, independently
// of delivery's states: here a revision a REPEATABLE READ producer inserted
// below the cursor (its stale read of the cursor let it in), and an
// aggregate whose delivery row says idle while events are pending. An
// operator's skip clears the first, and a skipped event is not counted
// behind an idle aggregate either.
func TestStrandedCountsWhatNoRuleDelivers(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pool := testdb.NewPool(t)
	exec(t, pool, `SELECT outbox.emit('orders', 'o-1', 'T', '{}', revision => 5)`)
	if n := strandedEvents(t, pool); n != 0 {
		t.Fatalf("an undiscovered event counts as stranded (%d)", n)
	}
	late, err := pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	if err != nil {
		t.Fatal(err)
	}
	defer late.Rollback(ctx)
	if _, err := late.Exec(ctx, `SELECT 1`); err != nil {
		t.Fatal(err)
	}
	discover(t, pool) // the cursor is now 4, which the producer cannot see
	if _, err := late.Exec(ctx, `SELECT outbox.emit('orders', 'o-1', 'T', '{}', revision => 3)`); err != nil {
		t.Fatal(err)
	}
	if err := late.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	discover(t, pool)
	if n := strandedEvents(t, pool); n != 1 {
		t.Fatalf("%d stranded events, want 1 (revision 3 below the cursor)", n)
	}
	exec(t, pool, `INSERT INTO outbox.skipped_event (event_id, reason, actor)
		SELECT event_id, 'below the cursor', 'test' FROM outbox.event WHERE revision = 3`)
	if n := strandedEvents(t, pool); n != 0 {
		t.Fatalf("%d stranded events after the skip, want 0", n)
	}

	// A delivery bug, simulated: the aggregate says idle with revision 5
	// pending, and revision 6, which an operator skipped, after it.
	exec(t, pool, `SELECT outbox.emit('orders', 'o-1', 'T', '{}')`)
	discover(t, pool)
	exec(t, pool, `INSERT INTO outbox.skipped_event (event_id, reason, actor)
		SELECT event_id, 'abandoned', 'test' FROM outbox.event WHERE revision = 6`)
	exec(t, pool, `UPDATE outbox.delivery SET state = 'idle', claimable_at = NULL, pending_since = NULL`)
	if n := strandedEvents(t, pool); n != 1 {
		t.Fatalf("%d stranded events, want 1 (revision 5 pending behind an idle aggregate; 6 is skipped)", n)
	}
}

// emitAtTheCursor commits orders/o-1's revision 4 at its delivery cursor:
// revision 5 first, discovered (which starts the cursor at 4), then 4 by a
// REPEATABLE READ producer whose snapshot predates the cursor (a READ
// COMMITTED one is refused). atCursor, when given, runs once the cursor is
// there, before revision 4 is written.
func emitAtTheCursor(t *testing.T, pool *pgxpool.Pool, atCursor func()) {
	t.Helper()
	ctx := testContext(t)
	exec(t, pool, `SELECT outbox.emit('orders', 'o-1', 'T', '{}', revision => 5)`)
	late, err := pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = late.Rollback(ctx) }()
	if _, err := late.Exec(ctx, `SELECT 1`); err != nil {
		t.Fatal(err)
	}
	discover(t, pool)
	if atCursor != nil {
		atCursor()
	}
	if _, err := late.Exec(ctx, `SELECT outbox.emit('orders', 'o-1', 'T', '{}', revision => 4)`); err != nil {
		t.Fatal(err)
	}
	if err := late.Commit(ctx); err != nil {
		t.Fatal(err)
	}
}

// An event exactly at its aggregate's delivery cursor is late, as one below
// it is: delivery hands out cursor+1 next, so nothing will ever deliver the
// cursor's own revision. A READ COMMITTED producer is refused it (23505);
// a REPEATABLE READ producer whose snapshot predates the cursor gets it in,
// and then discovery, a re-scan and outbox.stranded must each count it.
func TestEventAtTheCursorIsLate(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pool := testdb.NewPool(t)
	emitAtTheCursor(t, pool, func() {
		if n := count(t, pool, `SELECT delivered_revision FROM outbox.delivery WHERE aggregate_key = 'o-1'`); n != 4 {
			t.Fatalf("cursor at %d, want 4 (before the first revision, 5)", n)
		}
		_, err := pool.Exec(ctx, `SELECT outbox.emit('orders', 'o-1', 'T', '{}', revision => 4)`)
		wantSQLState(t, err, "23505")
	})
	discover(t, pool)
	lateRevisions := `SELECT count(*) FROM outbox.late_event l JOIN outbox.event e USING (event_id) WHERE e.revision = 4`
	if n := count(t, pool, lateRevisions); n != 1 {
		t.Fatalf("discovery recorded %d late events at the cursor, want 1", n)
	}
	if n := strandedEvents(t, pool); n != 1 {
		t.Fatalf("%d stranded events, want 1 (revision 4, at the cursor)", n)
	}
	// Stranded, not pending: lag counts only what delivery will hand out,
	// the revisions after the cursor (here 5).
	if n := count(t, pool, `SELECT events FROM outbox.pending_by_stream(NULL)`); n != 1 {
		t.Fatalf("%d events pending, want 1 (revision 5; revision 4, at the cursor, is stranded)", n)
	}

	// The re-scan judges the same event the same way.
	exec(t, pool, `DELETE FROM outbox.late_event`)
	exec(t, pool, `SELECT * FROM outbox.rescan_discovery()`)
	if n := count(t, pool, lateRevisions); n != 1 {
		t.Fatalf("the re-scan recorded %d late events at the cursor, want 1", n)
	}
	if got := claimRevisions(t, pool); got["o-1"] != 5 {
		t.Fatalf("claim = %v, want revision 5 (the cursor's next)", got)
	}
}

// An event delivered p_max_attempts times without an ack or a nack (every
// lease expired, or every stream holding it ended and its session released
// the lease) parks its aggregate with the reason, instead of being offered
// forever; other aggregates go on.
func TestEventDeliveredTooOftenWithoutAnswerParks(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		ttl  string
		// end ends a delivery unanswered; nil: its TTL has (a negative TTL
		// makes each lease expire at once).
		end func(t *testing.T, pool *pgxpool.Pool, holder uuid.UUID)
		// The attempt history, oldest first: each expiry is recorded by
		// the claim after it, each release by the release; the claim that
		// parks records the last delivery as parked.
		history string
	}{
		{"leases expired", "-1 second", nil, "1 expired, 2 expired, 3 parked"},
		{"streams ended", "1 hour", func(t *testing.T, pool *pgxpool.Pool, holder uuid.UUID) {
			var released int64
			if err := pool.QueryRow(testContext(t), `SELECT outbox.release($1)`, holder).Scan(&released); err != nil {
				t.Fatal(err)
			}
			if released != 1 {
				t.Fatalf("released %d leases, want 1", released)
			}
		}, "1 released, 2 released, 3 released, 3 parked"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			pool := testdb.NewPool(t)
			exec(t, pool, `SELECT outbox.emit('orders', 'poison', 'T', '{}')`)
			discover(t, pool)
			holder := uuid.New()
			claim := func() int64 {
				return count(t, pool, fmt.Sprintf(`SELECT count(*) FROM outbox.claim('%s', 'r', 'x', NULL, 10, interval '%s', 3)`,
					holder, tc.ttl))
			}
			for i := range 3 {
				if n := claim(); n != 1 {
					t.Fatalf("delivery %d: claimed %d events, want 1", i+1, n)
				}
				if tc.end != nil {
					tc.end(t, pool, holder)
				}
			}
			if n := claim(); n != 0 {
				t.Fatalf("a fourth delivery happened (%d)", n)
			}
			var state, reason string
			if err := pool.QueryRow(testContext(t), `SELECT state, parked_reason FROM outbox.delivery WHERE aggregate_key = 'poison'`).
				Scan(&state, &reason); err != nil {
				t.Fatal(err)
			}
			if state != "parked" || reason != "delivered 3 times without an ack or a nack: each lease expired or the stream holding it ended" {
				t.Fatalf("state %q, reason %q", state, reason)
			}
			var history string
			if err := pool.QueryRow(testContext(t), `SELECT string_agg(attempt || ' ' || outcome, ', ' ORDER BY attempt_id)
				FROM outbox.attempt WHERE aggregate_key = 'poison'`).Scan(&history); err != nil {
				t.Fatal(err)
			}
			if history != tc.history {
				t.Fatalf("attempt history %q, want %q", history, tc.history)
			}
			exec(t, pool, `SELECT outbox.emit('orders', 'other', 'T', '{}')`)
			discover(t, pool)
			if got := claimRevisions(t, pool); got["other"] != 1 || len(got) != 1 {
				t.Fatalf("claim = %v, want only the other aggregate", got)
			}
		})
	}
}

// Only deliveries that ended unanswered count towards parking: nacked ones
// do not (their failures and backoff cover them), and an operator's retry of
// an aggregate parked that way starts afresh rather than parking again.
func TestNackedDeliveriesDoNotCountAsUnanswered(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pool := testdb.NewPool(t)
	exec(t, pool, `SELECT outbox.emit('orders', 'o-1', 'T', '{}')`)
	discover(t, pool)
	claimOne := func() (id uuid.UUID, epoch int64, ok bool) {
		err := pool.QueryRow(ctx, `SELECT event_id, epoch FROM outbox.claim(gen_random_uuid(), 'r', 'x', NULL, 1, interval '-1 second', 2)`).Scan(&id, &epoch)
		return id, epoch, err == nil
	}
	for i := range 4 {
		id, epoch, ok := claimOne()
		if !ok {
			t.Fatalf("claim %d found nothing: nacked deliveries counted as unanswered", i+1)
		}
		exec(t, pool, fmt.Sprintf(`SELECT * FROM outbox.nack('%s', %d, 'broker said no', interval '-1 second', interval '1 microsecond', interval '1 microsecond', 100)`, id, epoch))
	}
	// Now two unanswered deliveries (the TTL is negative) park it ...
	claimOne()
	claimOne()
	if _, _, ok := claimOne(); ok {
		t.Fatal("a third unanswered delivery happened")
	}
	if n := count(t, pool, `SELECT count(*) FROM outbox.delivery WHERE state = 'parked'`); n != 1 {
		t.Fatal("not parked after two unanswered deliveries")
	}
	// ... and the operator's retry (the statement RetryAggregate runs)
	// gives it a fresh set.
	exec(t, pool, `UPDATE outbox.delivery SET state = 'ready', claimable_at = clock_timestamp(), next_attempt_at = NULL,
		failures = 0, unanswered = 0, parked_at = NULL, parked_reason = NULL`)
	if _, _, ok := claimOne(); !ok {
		t.Fatal("the retried aggregate parked again at once")
	}
}

// A nack parks the aggregate once its failures reach p_max_failures: the
// nack that makes them equal parks it, with the reason; those before back
// off.
func TestNackParksWhenFailuresReachTheLimit(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pool := testdb.NewPool(t)
	emitN(t, pool, "a", 1)
	discover(t, pool)
	for i, want := range []bool{false, true} {
		l := claimAs(t, pool, uuid.New(), "x") // the backoff (a microsecond) is over
		var parked bool
		var failures int
		if err := pool.QueryRow(ctx, `SELECT parked, failures
			FROM outbox.nack($1, $2, 'broker down', NULL, interval '1 microsecond', interval '1 microsecond', 2)`,
			l.id, l.epoch).Scan(&parked, &failures); err != nil {
			t.Fatal(err)
		}
		if parked != want || failures != i+1 {
			t.Fatalf("nack %d: parked %t after %d failures, want parked %t after %d", i+1, parked, failures, want, i+1)
		}
	}
	var reason string
	if err := pool.QueryRow(ctx, `SELECT parked_reason FROM outbox.delivery WHERE aggregate_key = 'a' AND state = 'parked'`).
		Scan(&reason); err != nil {
		t.Fatalf("a is not parked: %v", err)
	}
	if reason != "publish failed 2 times; last error: broker down" {
		t.Fatalf("parked with reason %q", reason)
	}
}

// Repeating an event with an explicit revision is a no-op even after the
// event was delivered (the cursor check must not refuse the retry).
func TestRetryOfDeliveredExplicitRevisionIsNoOp(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pool := testdb.NewPool(t)
	ev := client.Event{ID: uuid.New(), Stream: "orders", AggregateKey: "o-1", Type: "T", Payload: []byte(`{"a":1}`), Revision: 1}
	first, err := client.Emit(ctx, pool, ev)
	if err != nil {
		t.Fatal(err)
	}
	discover(t, pool)
	claimRevisions(t, pool)
	ackEvents(t, pool, `revision = 1`)
	again, err := client.Emit(ctx, pool, ev)
	if err != nil || again != first {
		t.Fatalf("retry after delivery = %+v, %v; want the recorded %+v", again, err, first)
	}
	// A discovery round that finds an event already published leaves no
	// trace: no late candidate, no wake.
	exec(t, pool, `SELECT outbox.emit('orders', 'o-1', 'T', '{}')`) // revision 2, delivered before any round
	if got := claimRevisions(t, pool); len(got) != 0 {
		t.Fatalf("claim of an idle aggregate = %v", got)
	}
	exec(t, pool, `UPDATE outbox.delivery SET state = 'ready', claimable_at = now()`) // as an ack that saw revision 2
	if got := claimRevisions(t, pool); got["o-1"] != 2 {
		t.Fatalf("claim = %v, want revision 2", got)
	}
	ackEvents(t, pool, `revision = 2`)
	discover(t, pool)
	if n := count(t, pool, `SELECT count(*) FROM outbox.late_event`); n != 0 {
		t.Fatalf("%d late candidates for an event that was published", n)
	}
	if n := count(t, pool, `SELECT count(*) FROM outbox.delivery WHERE state = 'idle'`); n != 1 {
		t.Fatal("the round woke an aggregate whose event was already published")
	}
}

// A stored discovery snapshot ahead of the cluster's transaction ids (the
// database was copied from another cluster) stops discovery loudly instead
// of silently finding nothing.
func TestDiscoveryRefusesASnapshotFromAnotherCluster(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	exec(t, pool, `UPDATE outbox.discovery SET snapshot = '900000000000:900000000000:'`)
	_, err := pool.Exec(testContext(t), `SELECT * FROM outbox.discover()`)
	wantSQLState(t, err, "XX001")
}

// Lag sees an event from its commit on: before discovery reaches it,
// outbox.undiscovered counts it; after, the delivery row does, and it is
// not counted twice.
func TestUndiscoveredEventsCountOnce(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	undiscovered := func() int64 {
		return count(t, pool, `SELECT coalesce(sum(events), 0)::bigint FROM outbox.undiscovered(NULL)`)
	}
	exec(t, pool, `SELECT outbox.emit('orders', 'o-1', 'T', '{}')`)
	if n := undiscovered(); n != 1 {
		t.Fatalf("undiscovered = %d, want 1", n)
	}
	discover(t, pool)
	exec(t, pool, `SELECT outbox.emit('orders', 'o-1', 'T', '{}')`) // behind a pending head
	if n := undiscovered(); n != 0 {
		t.Fatalf("undiscovered = %d, want 0 (the aggregate's delivery row counts it)", n)
	}
	if n := count(t, pool, `SELECT events FROM outbox.delivery d, outbox.pending_of(d.stream, d.aggregate_key, d.delivered_revision)`); n != 2 {
		t.Fatalf("pending through the delivery row = %d, want 2", n)
	}
}

// Producers (READ COMMITTED and REPEATABLE READ), a discovery loop and
// claim-and-ack workers race on a few hot aggregates, as the server runs
// them: every event is published, in revision order, and nothing is left
// stranded. The interleavings are whatever the scheduler makes of them; the
// assertions hold for every one.
func TestDiscoveryClaimAndAckRace(t *testing.T) {
	t.Parallel()
	raceDelivery(t, func(ctx context.Context, pool *pgxpool.Pool) error {
		_, err := pool.Exec(ctx, `SELECT * FROM outbox.discover()`)
		return err
	}, nil)
}

// raceDelivery runs producers at READ COMMITTED and REPEATABLE READ on a few
// hot aggregates against a loop of discovery rounds (round) and two
// claim-and-ack workers (worker, or by default one claim of 4 and its
// acks), and checks that every event is published, in revision order, with
// nothing stranded.
func raceDelivery(t *testing.T, round, worker func(context.Context, *pgxpool.Pool) error) {
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	pool := testdb.NewPoolConfig(t, func(c *pgxpool.Config) { c.MaxConns = 12 })
	const producers, perProducer, aggregates = 4, 150, 8
	var wg sync.WaitGroup
	errs := make(chan error, 16)
	for p := range producers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			iso := pgx.ReadCommitted
			if p%2 == 1 {
				iso = pgx.RepeatableRead
			}
			for i := range perProducer {
				err := pgx.BeginTxFunc(ctx, pool, pgx.TxOptions{IsoLevel: iso}, func(tx pgx.Tx) error {
					_, err := tx.Exec(ctx, `SELECT outbox.emit('orders', $1, 'T', '{}')`, fmt.Sprintf("a-%d", (p+i)%aggregates))
					return err
				})
				if err != nil && !isSerializationFailure(err) {
					errs <- err
					return
				}
			}
		}()
	}
	stop := make(chan struct{})
	var loops sync.WaitGroup
	loop := func(step func() error) {
		loops.Add(1)
		go func() {
			defer loops.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				if err := step(); err != nil && ctx.Err() == nil && !isDeadlock(err) {
					errs <- err
					return
				}
			}
		}()
	}
	loop(func() error { return round(ctx, pool) })
	const claimAndAck = `WITH c AS (SELECT event_id FROM outbox.claim(gen_random_uuid(), 'r', 'x', NULL, 4, interval '30 seconds'))
		SELECT * FROM outbox.ack(ARRAY(SELECT event_id FROM c), 'x')`
	if worker == nil {
		worker = func(ctx context.Context, pool *pgxpool.Pool) error {
			_, err := pool.Exec(ctx, claimAndAck)
			return err
		}
	}
	for range 2 {
		loop(func() error {
			if err := worker(ctx, pool); err != nil {
				return fmt.Errorf("claim and ack: %w", err)
			}
			return nil
		})
	}

	wg.Wait()
	total := count(t, pool, `SELECT count(*) FROM outbox.event`)
	for count(t, pool, `SELECT count(*) FROM outbox.event WHERE published_at IS NULL`) > 0 {
		select {
		case err := <-errs:
			t.Fatal(err)
		case <-ctx.Done():
			t.Fatalf("%d of %d events still pending after the race", count(t, pool, `SELECT count(*) FROM outbox.event WHERE published_at IS NULL`), total)
		case <-time.After(20 * time.Millisecond):
		}
	}
	close(stop)
	loops.Wait()
	select {
	case err := <-errs:
		t.Fatal(err)
	default:
	}
	// Published in revision order: an ack marks only the cursor's next
	// revision, so publication times follow revisions per aggregate.
	if n := count(t, pool, `SELECT count(*) FROM (
		SELECT published_at < lag(published_at) OVER (PARTITION BY aggregate_key ORDER BY revision) AS back
		FROM outbox.event) x WHERE back`); n != 0 {
		t.Fatalf("%d events published before their predecessor", n)
	}
	if n := strandedEvents(t, pool); n != 0 {
		t.Fatalf("%d stranded events", n)
	}
	t.Logf("%d events through the race", total)
}

func isSerializationFailure(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "40001"
}

// isDeadlock: PostgreSQL breaks a lock cycle by failing one statement,
// which the server retries (claims and discovery next round, acks at once).
func isDeadlock(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "40P01"
}
