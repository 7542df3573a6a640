package migrations_test

import (
	"fmt"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxd/outboxd/internal/testdb"
)

// These tests hold promises of the functions operators read lag through
// (outbox.pending_of, pending_by_stream, undiscovered, stranded,
// waiting_streams), each found missing by a mutation sweep.

// streamCounts runs sql, which returns (stream text, n bigint) rows, and
// returns them as "stream=n" pairs in stream order ("" for no row).
func streamCounts(t *testing.T, pool *pgxpool.Pool, sql string) string {
	t.Helper()
	var got string
	if err := pool.QueryRow(testContext(t), `SELECT coalesce(string_agg(format('%s=%s', s, n), ' ' ORDER BY s), '')
		FROM (`+sql+`) x(s, n)`).Scan(&got); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return got
}

// emitTo emits n events to stream's aggregate key.
func emitTo(t *testing.T, pool *pgxpool.Pool, stream, key string, n int) {
	t.Helper()
	exec(t, pool, fmt.Sprintf(`DO $$ BEGIN FOR i IN 1..%d LOOP PERFORM outbox.emit('%s', '%s', 'T', '{}'); END LOOP; END $$`,
		n, stream, key))
}

// An aggregate is a stream and a key: the pending events pending_of counts
// (and so GetLag, GetAggregate and the metrics) are those of its own
// stream, not of an aggregate of another stream under the same key.
func TestPendingOfCountsOnlyItsOwnStream(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	emitTo(t, pool, "orders", "k", 1)
	emitTo(t, pool, "payments", "k", 2)
	discover(t, pool)
	if got := streamCounts(t, pool, `SELECT d.stream, p.events FROM outbox.delivery d,
		outbox.pending_of(d.stream, d.aggregate_key, d.delivered_revision) p`); got != "orders=1 payments=2" {
		t.Fatalf("pending_of per aggregate: %q, want orders=1 payments=2", got)
	}
	if got := streamCounts(t, pool, `SELECT stream, events FROM outbox.pending_by_stream(NULL)`); got != "orders=1 payments=2" {
		t.Fatalf("pending_by_stream: %q, want orders=1 payments=2", got)
	}
}

// pending_by_stream and undiscovered read only the streams named (a token
// limited to some streams sees only those in GetLag), every stream when
// given NULL.
func TestLagCountsReadOnlyTheStreamsNamed(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	emitTo(t, pool, "orders", "o-1", 1)
	emitTo(t, pool, "payments", "p-1", 2)
	discover(t, pool)
	if got := streamCounts(t, pool, `SELECT stream, events FROM outbox.pending_by_stream(ARRAY['orders'])`); got != "orders=1" {
		t.Fatalf("pending_by_stream of orders: %q, want orders=1", got)
	}
	emitTo(t, pool, "orders", "o-2", 1)
	emitTo(t, pool, "payments", "p-2", 1)
	if got := streamCounts(t, pool, `SELECT stream, events FROM outbox.undiscovered(ARRAY['orders'])`); got != "orders=1" {
		t.Fatalf("undiscovered of orders: %q, want orders=1", got)
	}
	if got := streamCounts(t, pool, `SELECT stream, events FROM outbox.undiscovered(NULL)`); got != "orders=1 payments=1" {
		t.Fatalf("undiscovered of every stream: %q, want orders=1 payments=1", got)
	}
}

// Events of an aggregate that delivery does not keep pending (its row says
// idle while events wait, as a delivery bug would leave it) are stranded,
// not pending: pending_by_stream counts only the aggregates delivery keeps
// pending, and stranded counts these (StreamLag.Stranded: "Such events are
// not in PendingEvents").
func TestPendingByStreamLeavesStrandedEventsOut(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	emitTo(t, pool, "orders", "lost", 1)
	emitTo(t, pool, "orders", "fine", 1)
	discover(t, pool)
	exec(t, pool, `UPDATE outbox.delivery SET state = 'idle', claimable_at = NULL, pending_since = NULL WHERE aggregate_key = 'lost'`)
	if got := streamCounts(t, pool, `SELECT stream, events FROM outbox.pending_by_stream(NULL)`); got != "orders=1" {
		t.Fatalf("pending_by_stream: %q, want orders=1 (only fine; lost is stranded)", got)
	}
	if got := streamCounts(t, pool, `SELECT stream, events FROM outbox.stranded(NULL)`); got != "orders=1" {
		t.Fatalf("stranded: %q, want orders=1", got)
	}
}

// An event committed to an idle aggregate (its earlier events all
// delivered) counts as undiscovered until discovery reaches it: the idle
// delivery row does not count it as pending, so lag shows it from its
// commit on.
func TestUndiscoveredCountsAnIdleAggregatesNewEvent(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	emitTo(t, pool, "orders", "o-1", 1)
	discover(t, pool)
	l := claimAs(t, pool, uuid.New(), "x")
	exec(t, pool, fmt.Sprintf(`SELECT * FROM outbox.ack(ARRAY['%s'::uuid], 'x')`, l.id))
	if n := count(t, pool, `SELECT count(*) FROM outbox.delivery WHERE state = 'idle' AND pending_since IS NULL`); n != 1 {
		t.Fatalf("%d idle aggregates after the ack, want 1", n)
	}
	emitTo(t, pool, "orders", "o-1", 1)
	if got := streamCounts(t, pool, `SELECT stream, events FROM outbox.undiscovered(NULL)`); got != "orders=1" {
		t.Fatalf("undiscovered: %q, want orders=1 (revision 2 of an idle aggregate)", got)
	}
}

// An event delivered before discovery reached it (an ack's hand-over leased
// it, and its ack published it) is not pending, so undiscovered does not
// count it: lag must not show a delivered event as waiting.
func TestUndiscoveredLeavesOutAnEventDeliveredBeforeDiscovery(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	holder := uuid.New()
	emitTo(t, pool, "orders", "o-1", 1)
	discover(t, pool)
	first := claimWindow(t, pool, holder, 1, 1, 1)
	if len(first) != 1 {
		t.Fatalf("claimed %v, want revision 1", first)
	}
	emitTo(t, pool, "orders", "o-1", 1) // revision 2, not discovered
	status, handed := ackWindow(t, pool, []uuid.UUID{first[0].id}, holder, 1, 1)
	if status[first[0].id] != "published" || len(handed) != 1 || handed[0].revision != 2 {
		t.Fatalf("ack of revision 1: %v, handed over %v; want published and revision 2 handed over", status, handed)
	}
	exec(t, pool, fmt.Sprintf(`SELECT * FROM outbox.ack(ARRAY['%s'::uuid], 'x')`, handed[0].id))
	if n := count(t, pool, `SELECT count(*) FROM outbox.event WHERE published_at IS NULL`); n != 0 {
		t.Fatalf("%d events still pending, want none", n)
	}
	if got := streamCounts(t, pool, `SELECT stream, events FROM outbox.undiscovered(NULL)`); got != "" {
		t.Fatalf("undiscovered: %q, want nothing (revision 2 was delivered)", got)
	}
}

// A discovered aggregate with no delivery row at all (a delivery bug: no
// rule will ever claim it) is stranded, like one whose row says idle.
func TestStrandedCountsAnAggregateWithoutADeliveryRow(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	emitTo(t, pool, "orders", "o-1", 2)
	discover(t, pool)
	exec(t, pool, `DELETE FROM outbox.delivery`)
	if got := streamCounts(t, pool, `SELECT stream, events FROM outbox.stranded(NULL)`); got != "orders=2" {
		t.Fatalf("stranded: %q, want orders=2", got)
	}
}

// stranded sums a stream's stranded events over its aggregates, those
// behind an idle row and those below a cursor alike, so that two
// aggregates with the same count are two, not one; and it reads only the
// streams named.
func TestStrandedSumsEveryAggregateOfTheStreamsNamed(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	for _, s := range []string{"orders", "payments"} {
		emitTo(t, pool, s, "a", 1)
		emitTo(t, pool, s, "b", 1)
	}
	discover(t, pool)
	exec(t, pool, `UPDATE outbox.delivery SET state = 'idle', claimable_at = NULL, pending_since = NULL`)
	if got := streamCounts(t, pool, `SELECT stream, events FROM outbox.stranded(NULL)`); got != "orders=2 payments=2" {
		t.Fatalf("stranded: %q, want orders=2 payments=2", got)
	}
	if got := streamCounts(t, pool, `SELECT stream, events FROM outbox.stranded(ARRAY['orders'])`); got != "orders=2" {
		t.Fatalf("stranded of orders: %q, want orders=2", got)
	}
}

// stranded's late events (below their aggregate's cursor) are counted
// only for the streams named.
func TestStrandedLateEventsOfTheStreamsNamed(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	for _, s := range []string{"orders", "payments"} {
		emitTo(t, pool, s, "a", 1)
	}
	discover(t, pool)
	// Both events as if they had come in below a cursor already past them.
	exec(t, pool, `UPDATE outbox.delivery SET delivered_revision = 1, state = 'idle', claimable_at = NULL, pending_since = NULL`)
	exec(t, pool, `INSERT INTO outbox.late_event (event_id) SELECT event_id FROM outbox.event`)
	if got := streamCounts(t, pool, `SELECT stream, events FROM outbox.stranded(NULL)`); got != "orders=1 payments=1" {
		t.Fatalf("stranded: %q, want orders=1 payments=1", got)
	}
	if got := streamCounts(t, pool, `SELECT stream, events FROM outbox.stranded(ARRAY['orders'])`); got != "orders=1" {
		t.Fatalf("stranded of orders: %q, want orders=1", got)
	}
}

// waiting_streams lists a stream whose oldest ready aggregate has waited
// longer than idle_relay_after, judged by that oldest one even when newer
// ready ones have not; and only of the streams named.
func TestWaitingStreamsJudgeTheOldestReadyAggregate(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	exec(t, pool, `UPDATE outbox.settings SET idle_relay_after = '1 hour'`)
	emitTo(t, pool, "orders", "old", 1)
	emitTo(t, pool, "orders", "new", 1)
	emitTo(t, pool, "payments", "old", 1)
	discover(t, pool)
	exec(t, pool, `UPDATE outbox.delivery SET claimable_at = clock_timestamp() - interval '2 hours' WHERE aggregate_key = 'old'`)
	waiting := func(streams string) string {
		return streamCounts(t, pool, `SELECT stream, 1 FROM outbox.waiting_streams(`+streams+`)`)
	}
	if got := waiting("NULL"); got != "orders=1 payments=1" {
		t.Fatalf("waiting streams: %q, want orders and payments", got)
	}
	if got := waiting("ARRAY['orders']"); got != "orders=1" {
		t.Fatalf("waiting streams of orders: %q, want orders alone", got)
	}
}

// xmin_horizon_holders lists what holds the horizon back, the oldest
// first (GetLag reports the first row as the holder), and never the
// caller's own session, whose snapshot exists only to read the list.
func TestXminHorizonHoldersOldestFirstWithoutTheCaller(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	testdb.HoldXminHorizon(t, ctx, url, "older-"+uuid.NewString()[:8], false, 100)
	testdb.HoldXminHorizon(t, ctx, url, "younger-"+uuid.NewString()[:8], false, 50)
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	rows, err := conn.Query(ctx, `SELECT age, holder, holder LIKE format('pid %s %%', pg_backend_pid()) FROM outbox.xmin_horizon_holders()`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	var ages []int64
	for rows.Next() {
		var age int64
		var holder string
		var self bool
		if err := rows.Scan(&age, &holder, &self); err != nil {
			t.Fatal(err)
		}
		if self {
			t.Errorf("the caller's own session is listed: %s (age %d)", holder, age)
		}
		ages = append(ages, age)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if len(ages) < 2 {
		t.Fatalf("%d holders listed while two sessions hold snapshots", len(ages))
	}
	for i := 1; i < len(ages); i++ {
		if ages[i] > ages[i-1] {
			t.Fatalf("holders' ages %v: not the oldest first", ages)
		}
	}
}

// An age is never negative: a session in another database that took its
// transaction id after the caller's transaction fixed its own view of the
// newest id is listed at age 0, not below.
func TestXminHorizonHoldersAgesAreNeverNegative(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	url, elsewhere := testdb.New(t), testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	// age() measures from the newest id as of its transaction's first call.
	if _, err := tx.Exec(ctx, `SELECT age('3'::xid)`); err != nil {
		t.Fatal(err)
	}
	other := testdb.NewPoolURL(t, elsewhere)
	if _, err := other.Exec(ctx, `SELECT txid_current()`); err != nil {
		t.Fatal(err)
	}
	app := "newer-" + uuid.NewString()[:8]
	testdb.HoldXminHorizon(t, ctx, elsewhere, app, true, 0)
	var listed, negative int64
	if err := tx.QueryRow(ctx, `SELECT count(*) FILTER (WHERE holder LIKE '%application ' || $1 || '%'), count(*) FILTER (WHERE age < 0)
		FROM outbox.xmin_horizon_holders()`, app).Scan(&listed, &negative); err != nil {
		t.Fatal(err)
	}
	if listed != 1 || negative != 0 {
		t.Fatalf("the newer session listed %d times, %d holders with a negative age; want once and none", listed, negative)
	}
}

// pending_of counts an aggregate's pending events beyond its cursor: not
// the delivered ones, not the skipped ones; its next revision is the
// lowest of them (what GetAggregate says delivery hands out next) and its
// oldest created_at that of the earliest.
func TestPendingOfDescribesTheEventsBeyondTheCursor(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	for range 4 {
		emitTo(t, pool, "orders", "o-1", 1) // one transaction each: created_at rises
	}
	discover(t, pool)
	l := claimAs(t, pool, uuid.New(), "x")
	exec(t, pool, fmt.Sprintf(`SELECT * FROM outbox.ack(ARRAY['%s'::uuid], 'x')`, l.id))
	exec(t, pool, `INSERT INTO outbox.skipped_event (event_id, reason, actor)
		SELECT event_id, 'test', 'test' FROM outbox.event WHERE revision = 3`)
	var got string
	if err := pool.QueryRow(testContext(t), `SELECT format('%s events, next %s, oldest is revision %s', p.events, p.next_revision,
		(SELECT e.revision FROM outbox.event e WHERE e.created_at = p.oldest_created_at))
		FROM outbox.delivery d, outbox.pending_of(d.stream, d.aggregate_key, d.delivered_revision) p`).Scan(&got); err != nil {
		t.Fatal(err)
	}
	if want := "2 events, next 2, oldest is revision 2"; got != want {
		t.Fatalf("pending_of: %q, want %q (revisions 2 and 4; 1 delivered, 3 skipped)", got, want)
	}
}

// An aggregate counts as pending only while it has pending events: right
// after an operator skips a ready aggregate's only event (SkipEvent leaves
// the row ready, for the next claim to step over the skip), it is neither
// a pending aggregate nor a ready one in the lag counts.
func TestPendingByStreamCountsOnlyAggregatesWithPendingEvents(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	emitTo(t, pool, "orders", "skipped", 1)
	emitTo(t, pool, "orders", "waiting", 1)
	discover(t, pool)
	exec(t, pool, `INSERT INTO outbox.skipped_event (event_id, reason, actor)
		SELECT event_id, 'test', 'test' FROM outbox.event WHERE aggregate_key = 'skipped'`)
	var got string
	if err := pool.QueryRow(testContext(t), `SELECT format('%s: %s events, %s aggregates, %s ready', stream, events, aggregates, ready)
		FROM outbox.pending_by_stream(NULL)`).Scan(&got); err != nil {
		t.Fatal(err)
	}
	if want := "orders: 1 events, 1 aggregates, 1 ready"; got != want {
		t.Fatalf("pending_by_stream: %q, want %q", got, want)
	}
}

// Per stream, pending_by_stream's oldest is the created_at of its oldest
// pending event, and oldest_held that of the oldest pending event of an
// aggregate held back (parked, backing off or held at a gap), whichever of
// the three holds it, none for a stream whose aggregates are all ready;
// and each state is counted as itself.
func TestPendingByStreamOldestAndHeldCoverEveryState(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	holds := map[string]string{
		"parked":  `state = 'parked', claimable_at = NULL, parked_at = clock_timestamp(), parked_reason = 'test'`,
		"backoff": `state = 'backoff', claimable_at = clock_timestamp() + interval '1 hour', next_attempt_at = clock_timestamp() + interval '1 hour'`,
		"gap":     `state = 'gap', claimable_at = NULL, gap_revision = 2`,
	}
	for stream := range holds {
		emitTo(t, pool, stream, "held", 1) // older than ready's: a transaction of its own
		emitTo(t, pool, stream, "ready", 1)
	}
	emitTo(t, pool, "ready", "old", 1)
	emitTo(t, pool, "ready", "new", 1)
	discover(t, pool)
	for stream, set := range holds {
		exec(t, pool, fmt.Sprintf(`UPDATE outbox.delivery SET %s WHERE stream = '%s' AND aggregate_key = 'held'`, set, stream))
	}
	keyAt := func(at string) string {
		return `coalesce((SELECT e.aggregate_key FROM outbox.event e WHERE e.stream = p.stream AND e.created_at = ` + at + ` LIMIT 1), 'none')`
	}
	got := streamCounts(t, pool, `SELECT p.stream, format('oldest %s held %s ready %s backoff %s parked %s gap %s',
		`+keyAt("p.oldest")+`, `+keyAt("p.oldest_held")+`, p.ready, p.backoff, p.parked, p.gap)
		FROM outbox.pending_by_stream(NULL) p`)
	want := "backoff=oldest held held held ready 1 backoff 1 parked 0 gap 0 " +
		"gap=oldest held held held ready 1 backoff 0 parked 0 gap 1 " +
		"parked=oldest held held held ready 1 backoff 0 parked 1 gap 0 " +
		"ready=oldest old held none ready 2 backoff 0 parked 0 gap 0"
	if got != want {
		t.Fatalf("per stream:\n%s\nwant\n%s", got, want)
	}
}

// An event committed at its aggregate's cursor (a REPEATABLE READ producer
// whose snapshot predates the cursor) is undiscovered until discovery
// reaches it: the delivery row counts only the revisions after the
// cursor, so without this lag would not show it at all before discovery
// reports it stranded.
func TestUndiscoveredCountsAnEventAtTheCursor(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	emitAtTheCursor(t, pool, nil)
	if got := streamCounts(t, pool, `SELECT stream, events FROM outbox.undiscovered(NULL)`); got != "orders=1" {
		t.Fatalf("undiscovered: %q, want orders=1 (revision 4, at the cursor)", got)
	}
}

// stranded counts each event once: one at its aggregate's cursor is late,
// not also one behind an idle row (whose stranded events are those after
// the cursor), even when the row says idle with events after it.
func TestStrandedCountsAnEventAtTheCursorOnce(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	emitAtTheCursor(t, pool, nil)
	discover(t, pool) // records revision 4 as late
	// A delivery bug, simulated: the row says idle with revision 5 pending.
	exec(t, pool, `UPDATE outbox.delivery SET state = 'idle', claimable_at = NULL, pending_since = NULL`)
	if n := strandedEvents(t, pool); n != 2 {
		t.Fatalf("%d stranded events, want 2 (revision 4 at the cursor, revision 5 behind an idle row)", n)
	}
}

// waiting_streams judges ready aggregates only: a stream whose only
// claimable work is a lease or a backoff that ran out long ago (claimable
// again, but not ready, and so not what idle relays are reported against)
// is not listed.
func TestWaitingStreamsJudgeOnlyReadyAggregates(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	exec(t, pool, `UPDATE outbox.settings SET idle_relay_after = '1 hour'`)
	emitTo(t, pool, "orders", "backoff", 1)
	discover(t, pool)
	exec(t, pool, `UPDATE outbox.delivery SET state = 'backoff', claimable_at = clock_timestamp() - interval '2 hours',
		next_attempt_at = clock_timestamp() - interval '2 hours'`)
	if got := streamCounts(t, pool, `SELECT stream, 1 FROM outbox.waiting_streams(NULL)`); got != "" {
		t.Fatalf("waiting streams: %q, want none (no ready aggregate)", got)
	}
}
