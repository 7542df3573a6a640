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

// coldBacklog is how many ready aggregates the tests below leave in a
// stream no session takes: far more than any claim or probe of another
// stream may read.
const coldBacklog = 2000

// seedCold commits coldBacklog ready aggregates in stream cold, older than
// anything the test emits after.
func seedCold(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	exec(t, pool, fmt.Sprintf(`INSERT INTO outbox.event (stream, aggregate_key, revision, event_type, payload)
		SELECT 'cold', 'k' || g, 1, 'T', '{}' FROM generate_series(1, %d) g`, coldBacklog))
}

// emitIn emits n events of stream's aggregate key.
func emitIn(t *testing.T, pool *pgxpool.Pool, stream, key string, n int) {
	t.Helper()
	exec(t, pool, fmt.Sprintf(`DO $$ BEGIN FOR i IN 1..%d LOOP PERFORM outbox.emit('%s', '%s', 'T', '{}'); END LOOP; END $$`,
		n, stream, key))
}

// claimIndexReads runs query in a transaction it rolls back, and returns the
// first column of its rows as text and how many index entries of
// outbox.delivery the transaction read (the statistics of the transaction
// itself, so nothing else running counts).
func claimIndexReads(t *testing.T, pool *pgxpool.Pool, query string, args ...any) ([]string, int64) {
	t.Helper()
	ctx := testContext(t) // a claim that waits for a lock fails the test, not the package
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	before := deliveryIndexReads(t, tx)
	rows, err := tx.Query(ctx, query, args...)
	if err != nil {
		t.Fatal(err)
	}
	got, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (string, error) {
		var v *string
		err := r.Scan(&v)
		if v == nil {
			return "NULL", err
		}
		return *v, err
	})
	if err != nil {
		t.Fatal(err)
	}
	return got, deliveryIndexReads(t, tx) - before
}

// deliveryIndexReads is how many index entries of outbox.delivery (the
// claim index, the primary key, all of them) the connection has read and
// not yet reported (earlier transactions' reads may be among them: read it
// before and after, in one transaction, and take the difference).
func deliveryIndexReads(t *testing.T, tx pgx.Tx) int64 {
	t.Helper()
	var reads int64
	if err := tx.QueryRow(t.Context(), `
		SELECT sum(pg_stat_get_xact_tuples_returned(i.indexrelid))::bigint FROM pg_index i
		WHERE i.indrelid = 'outbox.delivery'::regclass`).Scan(&reads); err != nil {
		t.Fatal(err)
	}
	return reads
}

// A claim reads the claim index of the streams its session takes, never the
// ready backlog of a stream it does not take, whether it names its streams
// or takes every stream but some. (The claim index used to be ordered by
// claimable_at alone, and the stream filter applied row by row: a claim
// for one stream walked every older ready aggregate of the others.)
func TestClaimReadsOnlyTheStreamsItTakes(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	seedCold(t, pool)
	emitIn(t, pool, "live", "a", 1)
	emitIn(t, pool, "other", "b", 1)
	discover(t, pool)
	const bound = 20 // a few probes per stream and range, and the rows claimed

	for _, c := range []struct {
		name             string
		streams, exclude []string
		want             []string
	}{
		{"named stream", []string{"live"}, nil, []string{"a"}},
		{"every stream but cold", nil, []string{"cold"}, []string{"a", "b"}},
	} {
		got, reads := claimIndexReads(t, pool,
			`SELECT aggregate_key FROM outbox.claim($1, 'r', 'x', $2, 64, interval '30 seconds', NULL, $3, 1, 64, interval '1 hour')
			 ORDER BY aggregate_key`, uuid.New(), c.streams, c.exclude)
		if fmt.Sprint(got) != fmt.Sprint(c.want) {
			t.Errorf("%s: claimed %v, want %v", c.name, got, c.want)
		}
		if reads > bound {
			t.Errorf("%s: the claim read %d index entries of outbox.delivery with %d ready aggregates in cold; want at most %d",
				c.name, reads, coldBacklog, bound)
		}
	}
}

// ackAsSession acks id as the local session holder that takes streams (nil:
// every stream) and takes hand-overs, and returns the ack's status, its
// claimable_in and whether it handed a lease over.
func ackAsSession(t *testing.T, pool *pgxpool.Pool, id, holder uuid.UUID, streams []string) (string, *time.Duration, bool, int64) {
	t.Helper()
	var filterHolders []uuid.UUID
	var filterStreams []*string
	var filterExcluded []bool
	if streams == nil {
		filterHolders, filterStreams, filterExcluded = []uuid.UUID{holder}, []*string{nil}, []bool{false}
	}
	for _, s := range streams {
		filterHolders, filterStreams, filterExcluded = append(filterHolders, holder), append(filterStreams, &s), append(filterExcluded, false)
	}
	ctx := t.Context()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	before := deliveryIndexReads(t, tx)
	rows, err := tx.Query(ctx,
		`SELECT a.status, a.claimable_in FROM outbox.ack(ARRAY[$1::uuid], 'x', ARRAY[$2::uuid], ARRAY[interval '30 seconds'],
		     NULL, NULL, $3, $4, $5, interval '1 hour') a`, id, holder, filterHolders, filterStreams, filterExcluded)
	if err != nil {
		t.Fatal(err)
	}
	var status string
	var in *time.Duration
	handed := false
	for rows.Next() {
		var st string
		var i *time.Duration
		if err := rows.Scan(&st, &i); err != nil {
			t.Fatal(err)
		}
		if st == "handed_over" {
			handed = true
			continue
		}
		status, in = st, i
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	reads := deliveryIndexReads(t, tx) - before
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	return status, in, handed, reads
}

// An ack looks at the streams of the holder's session alone: older ready
// work in a stream it does not take neither stops the hand-over of its
// aggregate's next event nor makes it claim, and the ack reads none of
// that stream's claim index. A session that takes every stream yields to
// the older work, and is told to claim.
func TestAckProbesOnlyTheHoldersStreams(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	seedCold(t, pool)
	emitIn(t, pool, "live", "hot", 3)
	discover(t, pool)
	holder := uuid.New()

	// The session takes live alone: revision 2 is handed over although
	// cold's ready aggregates are older.
	status, _, handed, reads := ackAsSession(t, pool, claimIn(t, pool, holder, "live"), holder, []string{"live"})
	if status != "published" || !handed {
		t.Fatalf("ack of live/hot 1 by a session of live: %s, handed over %v; want published, handed over", status, handed)
	}
	if reads > 20 {
		t.Errorf("the ack read %d index entries of outbox.delivery with %d ready aggregates in cold; want at most 20", reads, coldBacklog)
	}

	// A session that takes every stream must not jump cold's older work.
	status, in, handed, _ := ackAsSession(t, pool, eventIDIn(t, pool, "live", "hot", 2), holder, nil)
	if status != "published" || handed || in == nil || *in != 0 {
		t.Fatalf("ack of live/hot 2 by a session of every stream: %s, handed over %v, claimable in %v; want published, no hand-over, 0",
			status, handed, in)
	}

	// The last revision, acked by a session of live: nothing follows, so
	// the credit it frees waits, whatever cold holds: nothing in live is
	// claimable, nor becomes so without a change.
	status, in, handed, reads = ackAsSession(t, pool, claimIn(t, pool, holder, "live"), holder, []string{"live"})
	if status != "published" || handed || in != nil {
		t.Fatalf("ack of live/hot 3 by a session of live: %s, handed over %v, claimable in %v; want published, no hand-over, nothing claimable",
			status, handed, in)
	}
	if reads > 20 {
		t.Errorf("the last ack read %d index entries of outbox.delivery with %d ready aggregates in cold; want at most 20", reads, coldBacklog)
	}
}

// An ack that hands its holder as many events as it acked takes the credit
// it frees with the hand-over, so the session does not claim on it and the
// ack skips the claim hint's probe: its hint says "claim" (zero), which
// misses nothing were it read. An ack that frees more credit than it hands
// over is probed as before. Both paths: one ack, and a batch.
func TestAHandOverSkipsTheClaimHint(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	emitIn(t, pool, "live", "a", 3)
	emitIn(t, pool, "live", "b", 2)
	discover(t, pool)
	holder := uuid.New()
	// Both aggregates leased: nothing in live is claimable before a lease
	// expires, which a probe would say (20-30 seconds).
	a1, b1 := claimKeyIn(t, pool, holder, "live", "a"), claimKeyIn(t, pool, holder, "live", "b")

	// One ack (the one-row path): live/a 1 hands 2 over.
	status, in, handed, _ := ackAsSession(t, pool, a1, holder, []string{"live"})
	if status != "published" || !handed || in == nil || *in != 0 {
		t.Fatalf("one ack handing over: %s, handed over %v, claimable in %v; want published, handed over, 0 (not probed)",
			status, handed, in)
	}

	// A batch whose acks all hand over: live/a 2 (3 follows), live/b 1 (2
	// follows).
	requireBatchHints(t, pool, []uuid.UUID{eventIDIn(t, pool, "live", "a", 2), b1}, holder, 2,
		"batch handing over every ack", "0 (not probed)", func(in *time.Duration) bool { return in != nil && *in == 0 })

	// A batch that hands nothing over (live/a 3 and live/b 2 are the last
	// revisions) is probed: nothing in live is claimable any more.
	requireBatchHints(t, pool, []uuid.UUID{eventIDIn(t, pool, "live", "a", 3), eventIDIn(t, pool, "live", "b", 2)}, holder, 0,
		"batch handing nothing over", "nothing claimable (probed)", func(in *time.Duration) bool { return in == nil })
}

// A holder the call does not describe (p_filter_holders names this
// replica's sessions, and the holder is not among them: another replica's
// session, or one that ended) is told zero, "claim": nothing on this
// replica reads its hint, and a probe of every stream (what an undescribed
// session is taken to take) would say nothing true of its filter. Both
// paths: a lone ack, and the same in a batch with an id that names no
// event. Here a probe would say "not before b's lease expires".
func TestAnAckTellsAHolderItDoesNotDescribeToClaim(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	emitIn(t, pool, "live", "a", 1)
	emitIn(t, pool, "live", "b", 1)
	emitIn(t, pool, "live", "c", 1)
	discover(t, pool)
	holder, described := uuid.New(), uuid.New()
	a1 := claimKeyIn(t, pool, holder, "live", "a")
	b1 := claimKeyIn(t, pool, holder, "live", "b")
	claimKeyIn(t, pool, holder, "live", "c") // leased: nothing in live is claimable before it expires
	for _, c := range []struct {
		path string
		ids  []uuid.UUID
	}{
		{"one ack", []uuid.UUID{a1}},
		{"a batch", []uuid.UUID{b1, uuid.New()}},
	} {
		var status string
		var in *time.Duration
		if err := pool.QueryRow(t.Context(),
			`SELECT a.status, a.claimable_in FROM outbox.ack($1, 'x', NULL, NULL, NULL, NULL,
			     ARRAY[$2::uuid], ARRAY['live'], ARRAY[false], interval '1 hour') a
			 WHERE a.event_id = $3`, c.ids, described, c.ids[0]).Scan(&status, &in); err != nil {
			t.Fatal(err)
		}
		if status != "published" || in == nil || *in != 0 {
			t.Fatalf("%s of a lease whose holder the call does not describe: %s, claimable in %v; want published, 0", c.path, status, in)
		}
	}
}

// TestAMixedBatchIsProbed: a holder handed fewer events than it acked
// frees credit, and its hint is probed.
func TestAMixedBatchIsProbed(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	emitIn(t, pool, "live", "a", 2)
	emitIn(t, pool, "live", "b", 1)
	discover(t, pool)
	holder := uuid.New()
	a1, b1 := claimKeyIn(t, pool, holder, "live", "a"), claimKeyIn(t, pool, holder, "live", "b")
	// live/a 1 hands 2 over (leased for 30 seconds), live/b 1 frees its
	// credit: the probe finds the hand-over's lease, due in 20-30 seconds.
	requireBatchHints(t, pool, []uuid.UUID{a1, b1}, holder, 1, "mixed batch", "20-30s (probed)",
		func(in *time.Duration) bool { return in != nil && *in > 20*time.Second && *in <= 30*time.Second })
}

// claimIn claims the next event of stream for holder, and returns its id.
func claimIn(t *testing.T, pool *pgxpool.Pool, holder uuid.UUID, stream string) uuid.UUID {
	t.Helper()
	var id uuid.UUID
	if err := pool.QueryRow(t.Context(), `SELECT event_id FROM outbox.claim($1, 'r', 'x', ARRAY[$2], 1, interval '30 seconds')`,
		holder, stream).Scan(&id); err != nil {
		t.Fatalf("claiming in %s: %v", stream, err)
	}
	return id
}

// claimKeyIn claims the next event of stream for holder, which must be
// key's (claims go oldest first, and the tests emit in the order they
// claim), and returns its id.
func claimKeyIn(t *testing.T, pool *pgxpool.Pool, holder uuid.UUID, stream, key string) uuid.UUID {
	t.Helper()
	var id uuid.UUID
	var got string
	if err := pool.QueryRow(t.Context(), `SELECT event_id, aggregate_key FROM outbox.claim($1, 'r', 'x', ARRAY[$2], 1, interval '30 seconds')`,
		holder, stream).Scan(&id, &got); err != nil {
		t.Fatalf("claiming %s/%s: %v", stream, key, err)
	}
	if got != key {
		t.Fatalf("claimed %s/%s, want %s/%s", stream, got, stream, key)
	}
	return id
}

// requireBatchHints acks ids in one batch (ackBatchAsSession) and fails
// unless it handed wantHanded leases over and every ack was published with
// a hint that ok accepts (want says which, for the message).
func requireBatchHints(t *testing.T, pool *pgxpool.Pool, ids []uuid.UUID, holder uuid.UUID, wantHanded int,
	what, want string, ok func(*time.Duration) bool) {
	t.Helper()
	hints, handed := ackBatchAsSession(t, pool, ids, holder)
	if handed != wantHanded || len(hints) != len(ids) {
		t.Fatalf("%s: %d handed over, hints %v; want %d handed over, %d published", what, handed, hints, wantHanded, len(ids))
	}
	for id, in := range hints {
		if !ok(in) {
			t.Errorf("%s: ack %s claimable in %v; want %s", what, id, in, want)
		}
	}
}

// ackBatchAsSession acks ids in one call of outbox.ack, as the batch path
// runs it (hand-over windows given), by the session holder that takes
// stream live, and returns each published ack's claimable_in and how many
// leases were handed over.
func ackBatchAsSession(t *testing.T, pool *pgxpool.Pool, ids []uuid.UUID, holder uuid.UUID) (map[uuid.UUID]*time.Duration, int) {
	t.Helper()
	rows, err := pool.Query(t.Context(),
		`SELECT a.event_id, a.status, a.claimable_in FROM outbox.ack($1, 'x', ARRAY[$2::uuid], ARRAY[interval '30 seconds'],
		     ARRAY[1], ARRAY[0], ARRAY[$2::uuid], ARRAY['live'], ARRAY[false], interval '1 hour') a`, ids, holder)
	if err != nil {
		t.Fatal(err)
	}
	hints := map[uuid.UUID]*time.Duration{}
	handed := 0
	for rows.Next() {
		var id uuid.UUID
		var st string
		var in *time.Duration
		if err := rows.Scan(&id, &st, &in); err != nil {
			t.Fatal(err)
		}
		switch st {
		case "published":
			hints[id] = in
		case "handed_over":
			handed++
		default:
			t.Fatalf("ack of %s: %s", id, st)
		}
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return hints, handed
}

func eventIDIn(t *testing.T, pool *pgxpool.Pool, stream, key string, rev int64) uuid.UUID {
	t.Helper()
	var id uuid.UUID
	if err := pool.QueryRow(t.Context(), `SELECT event_id FROM outbox.event WHERE stream = $1 AND aggregate_key = $2 AND revision = $3`,
		stream, key, rev).Scan(&id); err != nil {
		t.Fatal(err)
	}
	return id
}

// shiftIntoFuture makes the events of stream, and the delivery rows'
// stored times, lie d ahead of the clock, as they do after the database
// clock stepped back by d.
func shiftIntoFuture(t *testing.T, pool *pgxpool.Pool, stream string, d time.Duration) {
	t.Helper()
	ctx := t.Context()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	for _, q := range []string{
		`ALTER TABLE outbox.event DISABLE TRIGGER USER`,
		`UPDATE outbox.event SET created_at = created_at + $2 WHERE stream = $1`,
		`ALTER TABLE outbox.event ENABLE TRIGGER USER`,
		`UPDATE outbox.delivery SET claimable_at = claimable_at + $2, pending_since = pending_since + $2,
		     lease_expires_at = lease_expires_at + $2, next_attempt_at = next_attempt_at + $2 WHERE stream = $1`,
	} {
		var args []any
		if q[0] == 'U' {
			args = []any{stream, d}
		}
		if _, err := tx.Exec(ctx, q, args...); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
}

// After the database clock stepped back, a ready aggregate is claimable at
// once whatever its head's created_at says; a lease whose expiry lies
// further ahead than any lease the server gives (p_max_due) is claimable
// too; one within that bound still waits for its expiry.
func TestClockSteppedBackStallsNothingReady(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	for i := range 10 {
		emitIn(t, pool, "orders", fmt.Sprintf("r%d", i), 1)
	}
	emitIn(t, pool, "orders", "long", 1)
	emitIn(t, pool, "orders", "short", 1)
	discover(t, pool)
	holder := uuid.New()
	exec(t, pool, `UPDATE outbox.delivery SET state = 'leased', holder = '00000000-0000-0000-0000-000000000001',
		leased_event_id = (SELECT event_id FROM outbox.event e WHERE e.stream = 'orders' AND e.aggregate_key = delivery.aggregate_key),
		leased_through = 1, epoch = 1, attempt = 1,
		lease_expires_at = clock_timestamp() + CASE aggregate_key WHEN 'long' THEN interval '50 minutes' ELSE interval '1 minute' END,
		claimable_at = clock_timestamp() + CASE aggregate_key WHEN 'long' THEN interval '50 minutes' ELSE interval '1 minute' END
		WHERE aggregate_key IN ('long', 'short')`)
	shiftIntoFuture(t, pool, "orders", 20*time.Minute)

	got, _ := claimIndexReads(t, pool,
		`SELECT aggregate_key FROM outbox.claim($1, 'r', 'x', '{orders}', 64, interval '30 seconds', NULL, NULL, 1, 64, interval '1 hour')
		 ORDER BY aggregate_key`, holder)
	want := "[long r0 r1 r2 r3 r4 r5 r6 r7 r8 r9]"
	if fmt.Sprint(got) != want {
		t.Fatalf("claimed %v after a step back of 20 minutes; want %s (short's lease still runs)", got, want)
	}
}

// A claim gets past aggregates another transaction holds locked (sessions
// that claim at once read the same oldest candidates): it still leases as
// many as it asks for when that many are claimable, the next oldest.
func TestClaimWalksPastLockedAggregates(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	for i := range 8 {
		emitIn(t, pool, "orders", fmt.Sprintf("k%d", i), 1)
	}
	discover(t, pool)
	ctx := testContext(t)
	other, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = other.Rollback(context.WithoutCancel(ctx)) }()
	// The four oldest, as a concurrent claim would hold them.
	if _, err := other.Exec(ctx, `SELECT 1 FROM outbox.delivery WHERE aggregate_key IN ('k0', 'k1', 'k2', 'k3') FOR UPDATE`); err != nil {
		t.Fatal(err)
	}
	for _, streams := range [][]string{{"orders"}, nil} {
		got, _ := claimIndexReads(t, pool,
			`SELECT aggregate_key FROM outbox.claim($1, 'r', 'x', $2, 4, interval '30 seconds', NULL, NULL, 1, 4, interval '1 hour')
			 ORDER BY aggregate_key`, uuid.New(), streams)
		if want := "[k4 k5 k6 k7]"; fmt.Sprint(got) != want {
			t.Errorf("streams %v: claimed %v with k0-k3 locked elsewhere; want %s", streams, got, want)
		}
	}
}

// A lease granted while a claim runs is not taken for one a clock step left
// far ahead. The claim reads its candidates, then locks them in a statement
// of its own; an ack or another claim may lease a candidate in between, for
// the longest TTL there is, from a clock reading later than the one the
// claim started with. Judged against the claim's start, that lease's expiry
// lies further ahead than any lease the server sets, which is what only a
// clock stepped back makes happen, and the claim would lease the aggregate
// a second time, to a second holder. The test holds the claim between its
// two statements with a table lock (pg_blocking_pids says when it waits
// there), leases the candidate for the longest TTL meanwhile, and lets the
// claim go on: it must leave the aggregate to its holder.
func TestClaimLeavesALeaseGrantedWhileItRan(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pool := testdb.NewPool(t)
	emitIn(t, pool, "orders", "k", 1)
	discover(t, pool)

	// EXCLUSIVE lets the claim's plain read of its candidates through and
	// stops its FOR UPDATE.
	other, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = other.Rollback(context.WithoutCancel(ctx)) }()
	otherPID := backendPID(t, other)
	if _, err := other.Exec(ctx, `LOCK TABLE outbox.delivery IN EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}

	claimer, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer claimer.Release()
	claimerPID := backendPID(t, claimer)
	type result struct {
		keys []string
		err  error
	}
	done := make(chan result, 1)
	go func() {
		rows, err := claimer.Query(ctx,
			`SELECT aggregate_key FROM outbox.claim($1, 'r', 'x', '{orders}', 1, interval '30 seconds', NULL, NULL, 1, 1, interval '1 hour')`,
			uuid.New())
		if err != nil {
			done <- result{err: err}
			return
		}
		keys, err := pgx.CollectRows(rows, pgx.RowTo[string])
		done <- result{keys, err}
	}()
	waitUntilBlockedBy(t, pool, claimerPID, otherPID)

	// What an ack's hand-over or another replica's claim writes: a lease
	// for the longest TTL (the claim's p_max_due), from the clock now.
	if _, err := other.Exec(ctx, `UPDATE outbox.delivery
		SET state = 'leased', holder = '00000000-0000-0000-0000-000000000001',
		    leased_event_id = (SELECT event_id FROM outbox.event WHERE aggregate_key = 'k'),
		    leased_through = 1, epoch = epoch + 1, attempt = 1,
		    lease_expires_at = clock_timestamp() + interval '1 hour',
		    claimable_at = clock_timestamp() + interval '1 hour'
		WHERE aggregate_key = 'k'`); err != nil {
		t.Fatal(err)
	}
	if err := other.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case r := <-done:
		if r.err != nil {
			t.Fatal(r.err)
		}
		if len(r.keys) != 0 {
			t.Fatalf("claim leased %v, which another holder leased for an hour while the claim ran", r.keys)
		}
	case <-ctx.Done():
		t.Fatal("claim never finished")
	}
	if n := count(t, pool, `SELECT count(*) FROM outbox.delivery
		WHERE aggregate_key = 'k' AND holder = '00000000-0000-0000-0000-000000000001'`); n != 1 {
		t.Fatalf("the lease's holder changed (%d rows still held by it)", n)
	}
}

// A lease an ack hands over runs its TTL from when the ack has the rows, not
// from when the ack started: an ack that waited for a delivery row (behind
// a claim, a discovery round, a re-scan) would otherwise hand over a lease
// shorter than its TTL, or one already over, which the next claim takes
// from its holder at once. The test holds the row, waits on
// pg_blocking_pids until the ack waits for it, reads the clock, lets the
// ack go on, and wants the hand-over to expire a full TTL after that read.
// Both paths of outbox.ack: a lone ack, and the same ack in a batch with
// an id that names no event, which the one-row path leaves to the batch.
func TestHandOverRunsItsTTLFromTheLocks(t *testing.T) {
	t.Parallel()
	for _, batch := range []bool{false, true} {
		t.Run(fmt.Sprintf("batch=%v", batch), func(t *testing.T) {
			t.Parallel()
			handOverAfterWaiting(t, batch)
		})
	}
}

func handOverAfterWaiting(t *testing.T, batch bool) {
	ctx := testContext(t)
	pool := testdb.NewPool(t)
	emitIn(t, pool, "orders", "k", 2)
	discover(t, pool)
	holder := uuid.New()
	exec(t, pool, fmt.Sprintf(`SELECT * FROM outbox.claim('%s', 'r', 'x', '{orders}', 1, interval '30 seconds', NULL, NULL, 1, 1, interval '1 hour')`, holder))
	first := eventIDIn(t, pool, "orders", "k", 1)

	locker, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = locker.Rollback(context.WithoutCancel(ctx)) }()
	lockerPID := backendPID(t, locker)
	if _, err := locker.Exec(ctx, `SELECT 1 FROM outbox.delivery WHERE aggregate_key = 'k' FOR UPDATE`); err != nil {
		t.Fatal(err)
	}
	acker, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer acker.Release()
	ackerPID := backendPID(t, acker)
	done := make(chan error, 1)
	go func() {
		ids := []uuid.UUID{first}
		holders := []uuid.UUID{holder}
		ttls := []string{"10 seconds"}
		if batch {
			ids, holders, ttls = append(ids, uuid.New()), append(holders, holder), append(ttls, "10 seconds")
		}
		rows, err := acker.Query(ctx, `SELECT a.status FROM outbox.ack($1::uuid[], 'x', $2::uuid[], $3::interval[]) a`,
			ids, holders, ttls)
		if err == nil {
			rows.Close()
			err = rows.Err()
		}
		done <- err
	}()
	waitUntilBlockedBy(t, pool, ackerPID, lockerPID)
	var released time.Time
	if err := locker.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&released); err != nil {
		t.Fatal(err)
	}
	if err := locker.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-ctx.Done():
		t.Fatal("the ack never finished")
	}
	var rev int64
	var expires time.Time
	if err := pool.QueryRow(ctx, `SELECT leased_through, lease_expires_at FROM outbox.delivery WHERE aggregate_key = 'k' AND state = 'leased'`).
		Scan(&rev, &expires); err != nil {
		t.Fatalf("no hand-over: %v", err)
	}
	if want := released.Add(10 * time.Second); rev != 2 || expires.Before(want) {
		t.Fatalf("handed over revision %d expiring %v; want revision 2 expiring at or after %v (10s after the row was free)",
			rev, expires, want)
	}
}

// While a transaction holds the xmin horizon back, every row version
// written since is kept with its index entry: a lease handed over a hundred
// times leaves a hundred dead entries in the claim index, ordered by their
// expiries before the live one. A claim, and the claim hints of several
// sessions, must step over them: streams are found from the end of their
// ranges (the versions written last), the leases' range ahead of now is
// probed only when nothing is claimable, and sessions that share a stream
// filter share one probe. (A probe that walked them cost an ack 20 ms in
// the benchmark's held-xmin arms, and halved their throughput.)
func TestProbesStepOverTheLeasesAHeldXminKeeps(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	ctx := t.Context()
	const handOvers = 100
	emitIn(t, pool, "live", "a", handOvers+1)
	discover(t, pool)
	holder := uuid.New()
	claimKeyIn(t, pool, holder, "live", "a")

	// A REPEATABLE READ snapshot holds the horizon of this database alone,
	// so no other test's tables keep their versions.
	snapshot, err := pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = snapshot.Rollback(context.WithoutCancel(ctx)) }()
	if _, err := snapshot.Exec(ctx, `SELECT 1`); err != nil {
		t.Fatal(err)
	}
	for rev := int64(1); rev <= handOvers; rev++ {
		status, _, handed, _ := ackAsSession(t, pool, eventIDIn(t, pool, "live", "a", rev), holder, []string{"live"})
		if status != "published" || !handed {
			t.Fatalf("ack of live/a %d: %s, handed over %v; want published, handed over", rev, status, handed)
		}
	}
	var dead int64
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox.delivery WHERE state = 'leased'`).Scan(&dead); err != nil || dead != 1 {
		t.Fatalf("leased rows: %d, %v; want 1", dead, err)
	}
	// Claimable work, newer than every lease of live/a.
	emitIn(t, pool, "live", "b", 1)
	discover(t, pool)

	const bound = 40 // a few entries per stream and range, well below handOvers
	hint := `SELECT (p.next_at = now())::text FROM outbox.claim_probe_for($1, NULL, NULL, NULL, now(), interval '1 hour') p`
	hints, one := claimIndexReads(t, pool, hint, []uuid.UUID{uuid.New()})
	if fmt.Sprint(hints) != "[true]" || one > bound {
		t.Errorf("the claim hint of a session of every stream: next at now %v, read %d index entries of outbox.delivery with %d dead leases kept; want [true] (live/b is claimable), at most %d",
			hints, one, handOvers, bound)
	}
	hints, three := claimIndexReads(t, pool, hint, []uuid.UUID{uuid.New(), uuid.New(), uuid.New()})
	if fmt.Sprint(hints) != "[true true true]" || three != one {
		t.Errorf("the claim hints of three sessions of every stream: next at now %v, read %d index entries; want [true true true], one probe's %d",
			hints, three, one)
	}
	claimed, reads := claimIndexReads(t, pool,
		`SELECT aggregate_key FROM outbox.claim($1, 'r', 'x', NULL, 1, interval '30 seconds', NULL, NULL, 1, 1, interval '1 hour')`, uuid.New())
	if fmt.Sprint(claimed) != "[b]" {
		t.Errorf("a claim of every stream took %v; want [b]", claimed)
	}
	if reads > bound {
		t.Errorf("the claim read %d index entries of outbox.delivery with %d dead leases kept; want at most %d", reads, handOvers, bound)
	}
}
