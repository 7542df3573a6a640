package migrations_test

import (
	"fmt"
	"testing"

	"github.com/google/uuid"

	"github.com/outboxd/outboxd/client"
	"github.com/outboxd/outboxd/internal/testdb"
)

// Tests added by the claim mutation sweep for the producer path: each one
// fails with a mutant of outbox.event_before_insert that every other test
// let through.

// An explicit revision at or below the delivery cursor is refused whoever
// chose the event's id: an id the producer brings that names no recorded
// event is a new event, which could never be delivered, just like one
// whose id the trigger generates. (TestExplicitRevisionsBelowTheCursorAreRefused
// leaves the id to the trigger.)
func TestARevisionBelowTheCursorIsRefusedWithTheProducersOwnID(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pool := testdb.NewPool(t)
	if _, err := client.Emit(ctx, pool, client.Event{Stream: "orders", AggregateKey: "9", Type: "T", Payload: []byte(`{}`), Revision: 5}); err != nil {
		t.Fatal(err)
	}
	discover(t, pool) // delivery starts before revision 5
	_, err := client.Emit(ctx, pool, client.Event{ID: uuid.New(), Stream: "orders", AggregateKey: "9", Type: "T", Payload: []byte(`{}`), Revision: 4})
	wantSQLState(t, err, "23505")
	if n := count(t, pool, `SELECT count(*) FROM outbox.event WHERE aggregate_key = '9'`); n != 1 {
		t.Fatalf("%d events of the aggregate, want 1 (revision 4 refused)", n)
	}
	if n := count(t, pool, `SELECT last_revision FROM outbox.aggregate WHERE aggregate_key = '9'`); n != 5 {
		t.Fatalf("counter at %d, want 5", n)
	}
}

// An explicit revision equal to the counter is refused when delivery has
// passed it, even once the event that had it is gone (published, then
// deleted by retention): no unique constraint is left to refuse it, and
// the new event could never be delivered.
func TestARevisionAtTheCounterOfAPurgedEventIsRefused(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pool := testdb.NewPool(t)
	if _, err := client.Emit(ctx, pool, client.Event{Stream: "orders", AggregateKey: "p", Type: "T", Payload: []byte(`{}`)}); err != nil {
		t.Fatal(err)
	}
	discover(t, pool)
	if got := claimRevisions(t, pool); got["p"] != 1 {
		t.Fatalf("claim = %v, want p at revision 1", got)
	}
	ackEvents(t, pool, `aggregate_key = 'p' AND revision = 1`)
	// Retention deletes the published event; the counter and the cursor stay at 1.
	exec(t, pool, `DELETE FROM outbox.event WHERE aggregate_key = 'p'`)

	for _, id := range []uuid.UUID{{}, uuid.New()} { // the trigger's id, and the producer's own
		_, err := client.Emit(ctx, pool, client.Event{ID: id, Stream: "orders", AggregateKey: "p", Type: "T", Payload: []byte(`{}`), Revision: 1})
		wantSQLState(t, err, "23505")
	}
	if n := count(t, pool, `SELECT count(*) FROM outbox.event WHERE aggregate_key = 'p'`); n != 0 {
		t.Fatalf("%d events recorded at revision 1 after delivery passed it, want 0", n)
	}
	if n := strandedEvents(t, pool); n != 0 {
		t.Fatalf("%d stranded events", n)
	}
}

// outbox.emit_event is a producer contract of its own (emit's older
// sibling): it records an event with the next revision, takes NULL headers
// for none, and answers a retry of a recorded event with that event, as
// outbox.emit does. A retry must repeat the event exactly: other headers,
// or another explicit revision, name a different event and are refused.
func TestEmitEventRecordsAndAnswersRetries(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pool := testdb.NewPool(t)
	type emitted struct {
		id  uuid.UUID
		rev int64
	}
	emitEvent := func(sql string, args ...any) (emitted, error) {
		t.Helper()
		var e emitted
		err := pool.QueryRow(ctx, sql, args...).Scan(&e.id, &e.rev)
		return e, err
	}
	first, err := emitEvent(`SELECT event_id, revision FROM outbox.emit_event('orders', 'e', 'T', '{"a":1}', '{"h":"v"}')`)
	if err != nil || first.rev != 1 || first.id == uuid.Nil {
		t.Fatalf("emit_event = %+v, %v; want a generated id at revision 1", first, err)
	}
	// NULL headers are no headers, through emit_event and emit alike.
	for i, sql := range []string{
		`SELECT event_id, revision FROM outbox.emit_event('orders', 'e', 'T', '{}', NULL)`,
		`SELECT event_id, revision FROM outbox.emit('orders', 'e', 'T', '{}', headers => NULL)`,
	} {
		e, err := emitEvent(sql)
		if err != nil || e.rev != int64(i)+2 {
			t.Fatalf("%s = %+v, %v; want revision %d", sql, e, err, i+2)
		}
	}
	if n := count(t, pool, `SELECT count(*) FROM outbox.event WHERE aggregate_key = 'e' AND headers = '{}'`); n != 2 {
		t.Fatalf("%d events with empty headers, want 2", n)
	}
	// A retry answers with the recorded event and records nothing.
	again, err := emitEvent(`SELECT event_id, revision FROM outbox.emit_event('orders', 'e', 'T', '{"a":1}', '{"h":"v"}', p_event_id => $1)`, first.id)
	if err != nil || again != first {
		t.Fatalf("retry through emit_event = %+v, %v; want the recorded %+v", again, err, first)
	}
	again, err = emitEvent(`SELECT event_id, revision FROM outbox.emit_event('orders', 'e', 'T', '{"a":1}', '{"h":"v"}', 1, $1)`, first.id)
	if err != nil || again != first {
		t.Fatalf("retry with its revision through emit_event = %+v, %v; want the recorded %+v", again, err, first)
	}
	// The same id for anything else is refused.
	for _, sql := range []string{
		`SELECT event_id, revision FROM outbox.emit_event('orders', 'e', 'T', '{"a":1}', '{"h":"w"}', p_event_id => $1)`,
		`SELECT event_id, revision FROM outbox.emit_event('orders', 'e', 'T', '{"a":1}', '{}', p_event_id => $1)`,
		`SELECT event_id, revision FROM outbox.emit_event('orders', 'e', 'T', '{"a":1}', '{"h":"v"}', 7, $1)`,
		`SELECT event_id, revision FROM outbox.emit('orders', 'e', 'T', '{"a":1}', '{"h":"v"}', 7, $1)`,
	} {
		_, err := emitEvent(sql, first.id)
		wantSQLState(t, err, "23505")
	}
	if n := count(t, pool, `SELECT count(*) FROM outbox.event WHERE aggregate_key = 'e'`); n != 3 {
		t.Fatalf("%d events, want 3", n)
	}
	if n := count(t, pool, `SELECT last_revision FROM outbox.aggregate WHERE aggregate_key = 'e'`); n != 3 {
		t.Fatalf("counter at %d, want 3", n)
	}
}

// The limits on an event's parts hold at exactly their bounds: headers of
// 65536 bytes of JSON, a key of 1024 bytes and a type of 256 are accepted,
// one byte more is refused (54000). (TestEventSizeIsBounded tries headers
// far above the limit.)
func TestEventLimitsHoldAtTheirBounds(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pool := testdb.NewPool(t)
	big := func(n int) string { return fmt.Sprintf("%0*d", n, 0) }
	// jsonb renders {"h": "…"}: 9 bytes around the value.
	for _, c := range []struct {
		name, sql string
		arg       string
	}{
		{"headers", `SELECT outbox.emit('orders', 'o-1', 'T', '{}', jsonb_build_object('h', $1::text))`, big(65536 - 9)},
		{"aggregate_key", `SELECT outbox.emit('orders', $1, 'T', '{}')`, big(1024)},
		{"event_type", `SELECT outbox.emit('orders', 'o-1', $1, '{}')`, big(256)},
	} {
		if _, err := pool.Exec(ctx, c.sql, c.arg); err != nil {
			t.Errorf("%s at its limit refused: %v", c.name, err)
		}
		_, err := pool.Exec(ctx, c.sql, c.arg+"0")
		wantSQLState(t, err, "54000")
	}
	if n := count(t, pool, `SELECT count(*) FROM outbox.event`); n != 3 {
		t.Fatalf("%d events, want the 3 at their limits", n)
	}
}
