package migrations_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
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

// (a) A data-modifying CTE changes the order and inserts
// its event in one statement; the precondition decides whether either happens.
func TestCTEInsertsEventWithBusinessChange(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.NewPool(t)
	exec(t, pool, `CREATE TABLE sales_order (
		order_id bigint PRIMARY KEY,
		state text NOT NULL CHECK (state IN ('pending', 'paid', 'cancelled')),
		revision bigint NOT NULL DEFAULT 0 CHECK (revision >= 0))`)
	exec(t, pool, `INSERT INTO sales_order VALUES (1, 'pending', 0)`)

	const pay = `
		WITH changed AS (
			UPDATE sales_order SET state = 'paid', revision = revision + 1
			WHERE order_id = 1 AND state = 'pending' AND revision = 0
			RETURNING order_id, revision, state
		)
		INSERT INTO outbox.event (event_id, stream, aggregate_key, revision, event_type, payload)
		SELECT $1, 'sales_order', order_id::text, revision, 'OrderPaid',
		       jsonb_build_object('schema_version', 1, 'order_id', order_id,
		                          'revision', revision, 'state', state)
		FROM changed
		RETURNING event_id, revision`
	fixed := uuid.MustParse("00000000-0000-4000-8000-000000000001")

	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	rows, err := tx.Query(ctx, pay, fixed)
	if err != nil {
		t.Fatal(err)
	}
	type ret struct {
		ID       uuid.UUID
		Revision int64
	}
	got, err := pgx.CollectRows(rows, pgx.RowToStructByPos[ret])
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if len(got) != 1 || got[0].ID != fixed || got[0].Revision != 1 {
		t.Fatalf("CTE returned %+v, want one row (%s, 1)", got, fixed)
	}

	// The precondition no longer holds: zero rows, and nothing else changes.
	rows, err = pool.Query(ctx, pay, uuid.New())
	if err != nil {
		t.Fatal(err)
	}
	again, err := pgx.CollectRows(rows, pgx.RowToStructByPos[ret])
	if err != nil {
		t.Fatal(err)
	}
	if len(again) != 0 {
		t.Fatalf("CTE with a failed precondition returned %+v, want no rows", again)
	}
	if n := count(t, pool, `SELECT count(*) FROM outbox.event`); n != 1 {
		t.Fatalf("%d events, want 1", n)
	}
	// The trigger kept the revision counter a plain INSERT cannot be trusted
	// with, and wrote nothing of delivery's: discovery takes it from there.
	if n := count(t, pool, `SELECT count(*) FROM outbox.delivery`); n != 0 {
		t.Fatalf("the producer's transaction wrote %d delivery rows, want 0", n)
	}
	exec(t, pool, `SELECT outbox.discover()`)
	var last, delivered int64
	var state string
	if err := pool.QueryRow(ctx, `SELECT a.last_revision, d.delivered_revision, d.state
		FROM outbox.aggregate a JOIN outbox.delivery d USING (stream, aggregate_key)
		WHERE stream = 'sales_order' AND aggregate_key = '1'`).Scan(&last, &delivered, &state); err != nil {
		t.Fatal(err)
	}
	if last != 1 || delivered != 0 || state != "ready" {
		t.Fatalf("bookkeeping = (last %d, delivered %d, %s), want (1, 0, ready)", last, delivered, state)
	}
}

// (b) A repeated revision is refused with SQLSTATE 23505, through a plain
// INSERT and through outbox.emit alike.
func TestRepeatedRevisionIsUniqueViolation(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.NewPool(t)
	exec(t, pool, `INSERT INTO outbox.event (event_id, stream, aggregate_key, revision, event_type, payload)
		VALUES ('00000000-0000-4000-8000-000000000001', 'sales_order', '1', 1, 'OrderPaid', '{}')`)

	_, err := pool.Exec(ctx, `INSERT INTO outbox.event (event_id, stream, aggregate_key, revision, event_type, payload)
		VALUES ('00000000-0000-4000-8000-000000000002', 'sales_order', '1', 1, 'OrderPaid', '{}')`)
	wantSQLState(t, err, "23505")
	_, err = client.Emit(ctx, pool, client.Event{Stream: "sales_order", AggregateKey: "1", Type: "OrderPaid", Payload: []byte(`{}`), Revision: 1})
	wantSQLState(t, err, "23505")
	if n := count(t, pool, `SELECT count(*) FROM outbox.event`); n != 1 {
		t.Fatalf("%d events, want 1", n)
	}
	// The counter was not moved by the refused inserts.
	e, err := client.Emit(ctx, pool, client.Event{Stream: "sales_order", AggregateKey: "1", Type: "OrderShipped", Payload: []byte(`{}`)})
	if err != nil {
		t.Fatal(err)
	}
	if e.Revision != 2 {
		t.Fatalf("next assigned revision %d, want 2", e.Revision)
	}
}

// (c) Atomicity: a rolled-back business transaction leaves neither the change,
// nor the event, nor any bookkeeping.
func TestRolledBackTransactionLeavesNothing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.NewPool(t)
	exec(t, pool, `CREATE TABLE sales_order (order_id bigint PRIMARY KEY, state text NOT NULL)`)
	exec(t, pool, `INSERT INTO sales_order VALUES (7, 'pending')`)

	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// A failure must not leave a transaction open: the pool's clean-up
	// waits for its connection.
	defer func() { _ = tx.Rollback(ctx) }()
	if _, err := tx.Exec(ctx, `UPDATE sales_order SET state = 'paid' WHERE order_id = 7`); err != nil {
		t.Fatal(err)
	}
	if _, err := client.Emit(ctx, tx, client.Event{Stream: "sales_order", AggregateKey: "7", Type: "OrderPaid", Payload: []byte(`{"order_id":7}`)}); err != nil {
		t.Fatal(err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	for _, q := range []string{
		`SELECT count(*) FROM sales_order WHERE state = 'paid'`,
		`SELECT count(*) FROM outbox.event`,
		`SELECT count(*) FROM outbox.aggregate`,
		`SELECT count(*) FROM outbox.delivery`,
	} {
		if n := count(t, pool, q); n != 0 {
			t.Errorf("%s = %d after rollback, want 0", q, n)
		}
	}
	// And the committed path records both, with revision 1 (the rolled-back
	// attempt consumed nothing).
	tx, err = pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `UPDATE sales_order SET state = 'paid' WHERE order_id = 7`); err != nil {
		t.Fatal(err)
	}
	e, err := client.Emit(ctx, tx, client.Event{Stream: "sales_order", AggregateKey: "7", Type: "OrderPaid", Payload: []byte(`{"order_id":7}`)})
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if e.Revision != 1 || count(t, pool, `SELECT count(*) FROM outbox.event WHERE published_at IS NULL`) != 1 {
		t.Fatalf("committed emit: revision %d; want 1 and one pending event", e.Revision)
	}
}

// (d) Producers of one aggregate serialise on its order lock and get
// revisions 1..50 exactly once; a producer of another aggregate is not
// blocked by them.
func TestConcurrentProducersOfOneAggregateSerialise(t *testing.T) {
	t.Parallel()
	// Every producer needs its own connection to queue on the lock.
	const producers = 50
	pool := testdb.NewPoolConfig(t, func(c *pgxpool.Config) { c.MaxConns = producers + 4 })
	// Bounded, so a regression fails the test instead of hanging it.
	ctx, cancelAll := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancelAll()
	ev := func(key string) client.Event {
		return client.Event{Stream: "sales_order", AggregateKey: key, Type: "OrderChanged", Payload: []byte(`{}`)}
	}

	// The first producer holds its transaction open, so every other producer
	// of aggregate "hot" queues behind its order lock.
	first, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer first.Rollback(ctx) //nolint:errcheck // committed below; rollback after commit is a no-op
	firstEmit, err := client.Emit(ctx, first, ev("hot"))
	if err != nil {
		t.Fatal(err)
	}

	var (
		wg        sync.WaitGroup
		mu        sync.Mutex
		revisions = []int64{firstEmit.Revision}
		errs      []error
	)
	for range producers - 1 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			tx, err := pool.Begin(ctx)
			if err == nil {
				var e client.Emitted
				if e, err = client.Emit(ctx, tx, ev("hot")); err == nil {
					if err = tx.Commit(ctx); err == nil {
						mu.Lock()
						revisions = append(revisions, e.Revision)
						mu.Unlock()
						return
					}
				}
				_ = tx.Rollback(ctx)
			}
			mu.Lock()
			errs = append(errs, err)
			mu.Unlock()
		}()
	}

	// Wait until all the others are blocked on the lock (an explicit signal
	// from pg_stat_activity, not a sleep)...
	deadline := time.Now().Add(30 * time.Second)
	for {
		n := count(t, pool, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock'`)
		if n == producers-1 {
			break
		}
		if time.Now().After(deadline) {
			cancelAll()
			wg.Wait()
			t.Fatalf("only %d producers waiting on the order lock, want %d", n, producers-1)
		}
		time.Sleep(5 * time.Millisecond)
	}
	// ...then a producer of another aggregate must commit straight through.
	otherCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	other, err := client.Emit(otherCtx, pool, ev("cold"))
	cancel()
	if err != nil {
		t.Fatalf("producer of another aggregate was blocked: %v", err)
	}
	if other.Revision != 1 {
		t.Fatalf("other aggregate got revision %d, want 1", other.Revision)
	}

	if err := first.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	if len(errs) > 0 {
		t.Fatalf("producers failed: %v", errs)
	}
	seen := make(map[int64]bool)
	for _, r := range revisions {
		if seen[r] {
			t.Fatalf("revision %d assigned twice", r)
		}
		seen[r] = true
	}
	for r := int64(1); r <= producers; r++ {
		if !seen[r] {
			t.Fatalf("revision %d never assigned; got %v", r, revisions)
		}
	}
	if n := count(t, pool, `SELECT last_revision FROM outbox.aggregate WHERE aggregate_key = 'hot'`); n != producers {
		t.Fatalf("counter at %d, want %d", n, producers)
	}
}

// An omitted or NULL event_id is generated by the insert trigger, whatever
// the path: the column has no DEFAULT, so that the trigger can tell a fresh
// id (which needs no lookup for a retry) from a producer's own.
func TestOmittedEventIDIsGenerated(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.NewPool(t)
	exec(t, pool, `INSERT INTO outbox.event (stream, aggregate_key, event_type, payload) VALUES ('orders', 'g', 'T', '{}')`)
	exec(t, pool, `INSERT INTO outbox.event (event_id, stream, aggregate_key, event_type, payload) VALUES (NULL, 'orders', 'g', 'T', '{}')`)
	exec(t, pool, `INSERT INTO outbox.event (event_id, stream, aggregate_key, event_type, payload) VALUES (DEFAULT, 'orders', 'g', 'T', '{}')`)
	exec(t, pool, `SELECT * FROM outbox.emit('orders', 'g', 'T', '{}')`)
	exec(t, pool, `SELECT * FROM outbox.emit('orders', 'g', 'T', '{}', event_id => NULL)`)
	if _, err := client.Emit(ctx, pool, client.Event{Stream: "orders", AggregateKey: "g", Type: "T", Payload: []byte(`{}`)}); err != nil {
		t.Fatal(err)
	}
	if n := count(t, pool, `SELECT count(DISTINCT event_id) FROM outbox.event WHERE aggregate_key = 'g'`); n != 6 {
		t.Fatalf("%d distinct generated ids, want 6", n)
	}
	if n := count(t, pool, `SELECT max(revision) FROM outbox.event WHERE aggregate_key = 'g'`); n != 6 {
		t.Fatalf("revisions up to %d, want 6", n)
	}
	// A DEFAULT would fill the id before the trigger sees it, and every
	// emit would pay the retry lookup again.
	if n := count(t, pool, `SELECT count(*) FROM information_schema.columns
		WHERE table_schema = 'outbox' AND table_name = 'event' AND column_name = 'event_id' AND column_default IS NOT NULL`); n != 0 {
		t.Fatal("outbox.event.event_id has a DEFAULT")
	}
}

// The payload limit is at least 1 KiB (the insert trigger reads it only for
// a larger payload), and a raised limit lets larger payloads in and still
// stops those above it.
func TestPayloadLimit(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.NewPool(t)
	_, err := pool.Exec(ctx, `UPDATE outbox.settings SET max_payload_bytes = 1023`)
	wantSQLState(t, err, "23514")
	exec(t, pool, `UPDATE outbox.settings SET max_payload_bytes = 1024`)
	// jsonb prints {"x": "a..."}: 9 bytes besides the a's.
	payload := func(n int) string { return `{"x":"` + strings.Repeat("a", n-9) + `"}` }
	if _, err := pool.Exec(ctx, `SELECT * FROM outbox.emit('orders', 'p', 'T', $1::jsonb)`, payload(1024)); err != nil {
		t.Fatalf("a payload of exactly the limit: %v", err)
	}
	_, err = pool.Exec(ctx, `SELECT * FROM outbox.emit('orders', 'p', 'T', $1::jsonb)`, payload(1025))
	wantSQLState(t, err, "54000")
	exec(t, pool, `UPDATE outbox.settings SET max_payload_bytes = 4096`)
	if _, err := pool.Exec(ctx, `SELECT * FROM outbox.emit('orders', 'p', 'T', $1::jsonb)`, payload(4096)); err != nil {
		t.Fatalf("a payload of exactly the raised limit: %v", err)
	}
	_, err = pool.Exec(ctx, `INSERT INTO outbox.event (stream, aggregate_key, event_type, payload) VALUES ('orders', 'p', 'T', $1::jsonb)`, payload(4097))
	wantSQLState(t, err, "54000")
	if n := count(t, pool, `SELECT count(*) FROM outbox.event WHERE aggregate_key = 'p'`); n != 2 {
		t.Fatalf("%d events recorded, want 2", n)
	}
}

// (e) Bad input gets a clear SQL error with a SQLSTATE and writes nothing.
func TestBadInputIsRefusedAndWritesNothing(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.NewPool(t)
	exec(t, pool, `UPDATE outbox.settings SET max_payload_bytes = 1024`)
	big := `{"x":"` + strings.Repeat("a", 2000) + `"}`

	cases := []struct {
		name, sql, state, message string
		args                      []any
	}{
		{"malformed stream", `SELECT * FROM outbox.emit('Sales Order', 'k', 't', '{}')`, "22023", "stream", nil},
		{"empty stream", `SELECT * FROM outbox.emit('', 'k', 't', '{}')`, "22023", "stream", nil},
		{"stream too long", `SELECT * FROM outbox.emit($1, 'k', 't', '{}')`, "22023", "stream", []any{"s" + strings.Repeat("x", 128)}},
		{"null stream", `SELECT * FROM outbox.emit(NULL, 'k', 't', '{}')`, "22023", "stream", nil},
		{"empty key", `SELECT * FROM outbox.emit('orders', '', 't', '{}')`, "22023", "aggregate_key", nil},
		{"empty type", `SELECT * FROM outbox.emit('orders', 'k', '', '{}')`, "22023", "event_type", nil},
		{"null payload", `SELECT * FROM outbox.emit('orders', 'k', 't', NULL)`, "22023", "payload", nil},
		{"payload over limit", `SELECT * FROM outbox.emit('orders', 'k', 't', $1::jsonb)`, "54000", "limit", []any{big}},
		{"headers array", `SELECT * FROM outbox.emit('orders', 'k', 't', '{}', '[1]')`, "22023", "headers", nil},
		{"headers string", `SELECT * FROM outbox.emit('orders', 'k', 't', '{}', '"x"')`, "22023", "headers", nil},
		{"header value not string", `SELECT * FROM outbox.emit('orders', 'k', 't', '{}', '{"a":1}')`, "22023", "header", nil},
		{"revision zero", `SELECT * FROM outbox.emit('orders', 'k', 't', '{}', '{}', 0)`, "22023", "revision", nil},
		{"revision negative", `SELECT * FROM outbox.emit('orders', 'k', 't', '{}', '{}', -3)`, "22023", "revision", nil},
		{"plain insert, bad stream", `INSERT INTO outbox.event (stream, aggregate_key, revision, event_type, payload) VALUES ('9x', 'k', 1, 't', '{}')`, "22023", "stream", nil},
		{"plain insert, null headers", `INSERT INTO outbox.event (stream, aggregate_key, revision, event_type, payload, headers) VALUES ('orders', 'k', 1, 't', '{}', NULL)`, "22023", "headers", nil},
	}
	for _, c := range cases {
		_, err := pool.Exec(ctx, c.sql, c.args...)
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) {
			t.Errorf("%s: err = %v, want a PostgreSQL error", c.name, err)
			continue
		}
		if pgErr.Code != c.state || !strings.Contains(pgErr.Message, c.message) {
			t.Errorf("%s: got %s %q, want SQLSTATE %s mentioning %q", c.name, pgErr.Code, pgErr.Message, c.state, c.message)
		}
	}
	for _, table := range []string{"outbox.event", "outbox.aggregate", "outbox.delivery"} {
		if n := count(t, pool, "SELECT count(*) FROM "+table); n != 0 {
			t.Errorf("%s has %d rows after refused input, want 0", table, n)
		}
	}
	// The same limits hold at exactly the boundary: a payload of the limit
	// itself is accepted.
	// jsonb renders {"x": "…"}: 9 bytes around the string.
	exact := `{"x":"` + strings.Repeat("a", 1024-9) + `"}`
	if _, err := pool.Exec(ctx, `SELECT * FROM outbox.emit('orders', 'k', 't', $1::jsonb)`, exact); err != nil {
		t.Fatalf("payload of exactly the limit refused: %v", err)
	}
}

// Events are immutable once written, and pending ones cannot be deleted.
func TestEventsAreImmutableAndPendingOnesCannotBeDeleted(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.NewPool(t)
	e, err := client.Emit(ctx, pool, client.Event{Stream: "orders", AggregateKey: "1", Type: "Created", Payload: []byte(`{"a":1}`)})
	if err != nil {
		t.Fatal(err)
	}
	_, err = pool.Exec(ctx, `UPDATE outbox.event SET payload = '{"a":2}' WHERE event_id = $1`, e.ID)
	wantSQLState(t, err, "55000")
	_, err = pool.Exec(ctx, `DELETE FROM outbox.event WHERE event_id = $1`, e.ID)
	wantSQLState(t, err, "55000")
	// published_at is outboxd's to set, through an ack of a delivery, and
	// only once; then retention may delete the event.
	_, err = pool.Exec(ctx, `UPDATE outbox.event SET published_at = now() WHERE event_id = $1`, e.ID)
	wantSQLState(t, err, "55000")
	exec(t, pool, `SELECT outbox.discover()`)
	exec(t, pool, `SELECT * FROM outbox.claim(gen_random_uuid(), 'r', 'x', NULL, 1, interval '30 seconds')`)
	exec(t, pool, fmt.Sprintf(`SELECT * FROM outbox.ack(ARRAY['%s'::uuid], 'x')`, e.ID))
	if n := count(t, pool, fmt.Sprintf(`SELECT count(*) FROM outbox.event WHERE published_at IS NOT NULL AND event_id = '%s'`, e.ID)); n != 1 {
		t.Fatal("the ack did not mark the event published")
	}
	_, err = pool.Exec(ctx, `UPDATE outbox.event SET published_at = NULL WHERE event_id = $1`, e.ID)
	wantSQLState(t, err, "55000")
	exec(t, pool, fmt.Sprintf(`DELETE FROM outbox.event WHERE event_id = '%s'`, e.ID))
}

// The settings outboxd's own statements raise to pass the event guards let
// through only what those statements do: an ack marks a pending event
// published, once; a republish makes a published event pending again; a
// re-scan re-stamps an event's xid as frozen. Under none of them can a
// statement mark an event published a second time, publish a pending event
// without an ack, or rewrite an event.
func TestTheGuardsSettingsAllowOnlyWhatTheirStatementsDo(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.NewPool(t)
	pending, err := client.Emit(ctx, pool, client.Event{Stream: "orders", AggregateKey: "1", Type: "Created", Payload: []byte(`{"a":1}`)})
	if err != nil {
		t.Fatal(err)
	}
	published, err := client.Emit(ctx, pool, client.Event{Stream: "orders", AggregateKey: "2", Type: "Created", Payload: []byte(`{"a":1}`)})
	if err != nil {
		t.Fatal(err)
	}
	exec(t, pool, `SELECT outbox.discover()`)
	exec(t, pool, `SELECT * FROM outbox.claim(gen_random_uuid(), 'r', 'x', NULL, 2, interval '30 seconds')`)
	exec(t, pool, fmt.Sprintf(`SELECT * FROM outbox.ack(ARRAY['%s'::uuid], 'x')`, published.ID))
	under := func(setting, update string, id uuid.UUID) error {
		t.Helper()
		return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `SELECT set_config($1, 'on', true)`, setting); err != nil {
				t.Fatal(err)
			}
			_, err := tx.Exec(ctx, `UPDATE outbox.event SET `+update+` WHERE event_id = $1`, id)
			return err
		})
	}
	for _, c := range []struct {
		setting, update string
		id              uuid.UUID
	}{
		{"outbox.acking", "published_at = now()", published.ID},                   // a second mark
		{"outbox.republishing", "published_at = now()", pending.ID},               // a mark without an ack
		{"outbox.republishing", "published_at = now()", published.ID},             // a mark moved
		{"outbox.rescanning", "xid = '3'::xid8", pending.ID},                      // an xid other than frozen
		{"outbox.rescanning", `xid = '2'::xid8, payload = '{"a":2}'`, pending.ID}, // a re-stamp that rewrites
	} {
		wantSQLState(t, under(c.setting, c.update, c.id), "55000")
	}
	if n := count(t, pool, `SELECT count(*) FROM outbox.event WHERE published_at IS NULL AND payload = '{"a":1}'`); n != 1 {
		t.Fatalf("%d events pending as written, want 1", n)
	}
}

// An explicit revision that leaves a gap is accepted (delivery will hold the
// aggregate at the gap); one below the delivery cursor is refused, because it
// could never be delivered.
func TestExplicitRevisionsBelowTheCursorAreRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.NewPool(t)
	emit := func(rev int64) error {
		_, err := client.Emit(ctx, pool, client.Event{Stream: "orders", AggregateKey: "9", Type: "T", Payload: []byte(`{}`), Revision: rev})
		return err
	}
	if err := emit(5); err != nil {
		t.Fatal(err)
	}
	if err := emit(7); err != nil {
		t.Fatalf("gap-leaving revision refused: %v", err)
	}
	if err := emit(6); err != nil {
		t.Fatalf("late revision filling the gap refused: %v", err)
	}
	exec(t, pool, `SELECT outbox.discover()`) // delivery starts before revision 5
	wantSQLState(t, emit(4), "23505")         // below the first revision: before the cursor
	if n := count(t, pool, `SELECT last_revision FROM outbox.aggregate WHERE aggregate_key = '9'`); n != 7 {
		t.Fatalf("counter at %d, want 7", n)
	}
}

func exec(t *testing.T, pool *pgxpool.Pool, sql string) {
	t.Helper()
	if _, err := pool.Exec(testContext(t), sql); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
}

func count(t *testing.T, pool *pgxpool.Pool, sql string) int64 {
	t.Helper()
	var n int64
	if err := pool.QueryRow(testContext(t), sql).Scan(&n); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return n
}

func wantSQLState(t *testing.T, err error, state string) {
	t.Helper()
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != state {
		t.Fatalf("err = %v, want SQLSTATE %s", err, state)
	}
}
