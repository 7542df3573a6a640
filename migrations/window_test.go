package migrations_test

import (
	"context"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxd/outboxd/internal/testdb"
)

// These tests pin down per-aggregate windows (max_in_flight_per_aggregate):
// one lease, one epoch, covering consecutive revisions; acks applied in
// revision order; the window sliding forward on acks; a nack or a park
// ending the whole lease.

// leased is one event a delivery function leased.
type leased struct {
	key      string
	revision int64
	id       uuid.UUID
	epoch    int64
}

func collectLeases(t *testing.T, rows pgx.Rows) []leased {
	t.Helper()
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (leased, error) {
		var l leased
		err := row.Scan(&l.key, &l.revision, &l.id, &l.epoch)
		return l, err
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// claimWindow claims up to limit aggregates for holder with a window and a
// credit, returning the leases in the order claim returns them.
func claimWindow(t *testing.T, pool *pgxpool.Pool, holder uuid.UUID, limit, window, credit int) []leased {
	t.Helper()
	rows, err := pool.Query(context.Background(),
		`SELECT aggregate_key, revision, event_id, epoch
		 FROM outbox.claim($1, 'r', 'x', NULL, $2, interval '30 seconds', NULL, NULL, $3, $4)`,
		holder, limit, window, credit)
	if err != nil {
		t.Fatal(err)
	}
	return collectLeases(t, rows)
}

// claimAlone claims one event of one aggregate for holder (a window of 1,
// credit 1) and fails unless it is key's revision rev.
func claimAlone(t *testing.T, pool *pgxpool.Pool, holder uuid.UUID, key string, rev int64) leased {
	t.Helper()
	ls := claimWindow(t, pool, holder, 1, 1, 1)
	if len(ls) != 1 || ls[0].key != key || ls[0].revision != rev {
		t.Fatalf("claimed %v, want %s/%d alone", ls, key, rev)
	}
	return ls[0]
}

// ackWindow acks ids with holder as a local session taking a window of
// window and lending credit, and returns each ack's status and the leases
// handed over.
func ackWindow(t *testing.T, pool *pgxpool.Pool, ids []uuid.UUID, holder uuid.UUID, window, credit int) (map[uuid.UUID]string, []leased) {
	t.Helper()
	rows, err := pool.Query(context.Background(),
		`SELECT a.event_id, a.status, (a.handover).aggregate_key, (a.handover).revision, (a.handover).event_id, (a.handover).epoch
		 FROM outbox.ack($1, 'x', ARRAY[$2::uuid], ARRAY[interval '30 seconds'], ARRAY[$3::integer], ARRAY[$4::integer]) a`,
		ids, holder, window, credit)
	if err != nil {
		t.Fatal(err)
	}
	status := map[uuid.UUID]string{}
	var handed []leased
	for rows.Next() {
		var id uuid.UUID
		var st string
		var key *string
		var rev, epoch *int64
		var lid *uuid.UUID
		if err := rows.Scan(&id, &st, &key, &rev, &lid, &epoch); err != nil {
			t.Fatal(err)
		}
		if st == "handed_over" {
			handed = append(handed, leased{*key, *rev, *lid, *epoch})
			continue
		}
		status[id] = st
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return status, handed
}

func emitN(t *testing.T, pool *pgxpool.Pool, key string, n int) {
	t.Helper()
	exec(t, pool, fmt.Sprintf(`DO $$ BEGIN FOR i IN 1..%d LOOP PERFORM outbox.emit('orders', '%s', 'T', '{}'); END LOOP; END $$`, n, key))
}

func revisions(ls []leased, key string) []int64 {
	var out []int64
	for _, l := range ls {
		if l.key == key {
			out = append(out, l.revision)
		}
	}
	return out
}

func eventID(t *testing.T, pool *pgxpool.Pool, key string, revision int64) uuid.UUID {
	t.Helper()
	var id uuid.UUID
	if err := pool.QueryRow(context.Background(),
		`SELECT event_id FROM outbox.event WHERE aggregate_key = $1 AND revision = $2`, key, revision).Scan(&id); err != nil {
		t.Fatal(err)
	}
	return id
}

// A claim with a window leases consecutive revisions under one epoch, in
// revision order, never past a skipped or missing revision, and shares its
// credit so that every aggregate gets its next event before any gets a
// second.
func TestWindowLeasesConsecutiveRevisions(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	emitN(t, pool, "a", 6)
	emitN(t, pool, "b", 2)
	emitN(t, pool, "c", 5)
	// c: revision 3 skipped, so c's window stops at 2.
	exec(t, pool, `INSERT INTO outbox.skipped_event (event_id, reason, actor)
		SELECT event_id, 'test', 'test' FROM outbox.event WHERE aggregate_key = 'c' AND revision = 3`)
	discover(t, pool)

	// Credit 7: the three heads, then every aggregate's second (c's
	// window stops at the skip), then a's third; a's fourth is past it.
	got := claimWindow(t, pool, uuid.New(), 3, 4, 7)
	if a, b, c := revisions(got, "a"), revisions(got, "b"), revisions(got, "c"); !slices.Equal(a, []int64{1, 2, 3}) ||
		!slices.Equal(b, []int64{1, 2}) || !slices.Equal(c, []int64{1, 2}) {
		t.Fatalf("leased a %v b %v c %v; want a [1 2 3], b [1 2], c [1 2]", a, b, c)
	}
	epochs := map[string]int64{}
	for i, l := range got {
		if e, ok := epochs[l.key]; ok && e != l.epoch {
			t.Fatalf("aggregate %s leased under epochs %d and %d", l.key, e, l.epoch)
		}
		epochs[l.key] = l.epoch
		if i > 0 && got[i-1].key == l.key && got[i-1].revision+1 != l.revision {
			t.Fatalf("not in revision order: %v", got)
		}
	}
	if n := count(t, pool, `SELECT leased_through FROM outbox.delivery WHERE aggregate_key = 'a'`); n != 3 {
		t.Fatalf("a leased through %d, want 3", n)
	}

	// A claim that steps over a skipped head leases a window from the
	// next revision (the claim's second pass): e's 1 is skipped.
	emitN(t, pool, "e", 3)
	exec(t, pool, `INSERT INTO outbox.skipped_event (event_id, reason, actor)
		SELECT event_id, 'test', 'test' FROM outbox.event WHERE aggregate_key = 'e' AND revision = 1`)
	discover(t, pool)
	if e := revisions(claimWindow(t, pool, uuid.New(), 10, 8, 100), "e"); !slices.Equal(e, []int64{2, 3}) {
		t.Fatalf("e leased %v, want [2 3] (past its skipped head)", e)
	}

	// A gap ends a window too: d has revisions 1, 2 and 4.
	exec(t, pool, `SELECT outbox.emit('orders', 'd', 'T', '{}', '{}', 1)`)
	exec(t, pool, `SELECT outbox.emit('orders', 'd', 'T', '{}', '{}', 2)`)
	exec(t, pool, `SELECT outbox.emit('orders', 'd', 'T', '{}', '{}', 4)`)
	discover(t, pool)
	if d := revisions(claimWindow(t, pool, uuid.New(), 10, 8, 100), "d"); !slices.Equal(d, []int64{1, 2}) {
		t.Fatalf("d leased %v, want [1 2] (stopping at the gap)", d)
	}
}

// Acks apply in revision order: an ack whose earlier revision is pending
// answers out_of_order and changes nothing; given together, in any order,
// the acks of consecutive revisions all apply.
func TestWindowAcksApplyInRevisionOrder(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	emitN(t, pool, "a", 4)
	discover(t, pool)
	holder := uuid.New()
	got := claimWindow(t, pool, holder, 1, 4, 4)
	if len(got) != 4 {
		t.Fatalf("leased %v", got)
	}
	st, _ := ackWindow(t, pool, []uuid.UUID{got[2].id}, holder, 4, 0)
	if st[got[2].id] != "out_of_order" {
		t.Fatalf("ack of revision 3 alone: %v, want out_of_order", st)
	}
	if n := count(t, pool, `SELECT count(*) FROM outbox.event WHERE published_at IS NOT NULL`); n != 0 {
		t.Fatalf("%d published after an out-of-order ack", n)
	}
	// 2, 1 and 3 together (4 stays out): all three apply, the lease goes
	// on with 4 as its head.
	st, _ = ackWindow(t, pool, []uuid.UUID{got[1].id, got[0].id, got[2].id}, holder, 4, 0)
	for _, l := range got[:3] {
		if st[l.id] != "published" {
			t.Fatalf("ack statuses %v", st)
		}
	}
	var state string
	var cursor, through int64
	var head uuid.UUID
	if err := pool.QueryRow(context.Background(),
		`SELECT state, delivered_revision, leased_through, leased_event_id FROM outbox.delivery WHERE aggregate_key = 'a'`).
		Scan(&state, &cursor, &through, &head); err != nil {
		t.Fatal(err)
	}
	if state != "leased" || cursor != 3 || through != 4 || head != got[3].id {
		t.Fatalf("after acking 1-3: %s, cursor %d, through %d, head %v; want leased, 3, 4, revision 4", state, cursor, through, head)
	}
	// Publication times follow revisions.
	if n := count(t, pool, `SELECT count(*) FROM (
		SELECT published_at < lag(published_at) OVER (ORDER BY revision) AS back FROM outbox.event) x WHERE back`); n != 0 {
		t.Fatal("published out of revision order")
	}
}

// Acks slide a local holder's window forward under the same epoch, never
// leasing it more events than the acks free plus the credit it lends, and
// never past its window; the ack that ends a lease leases the next
// revisions under a new epoch.
func TestWindowSlidesOnAcks(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	emitN(t, pool, "a", 20)
	discover(t, pool)
	holder := uuid.New()
	got := claimWindow(t, pool, holder, 1, 4, 2) // credit 2: a window of 2 for now
	if r := revisions(got, "a"); !slices.Equal(r, []int64{1, 2}) {
		t.Fatalf("claimed %v", r)
	}
	epoch := got[0].epoch

	// Acking 1 frees one unit: the window slides to 2-3, same epoch.
	st, handed := ackWindow(t, pool, []uuid.UUID{got[0].id}, holder, 4, 0)
	if st[got[0].id] != "published" || len(handed) != 1 || handed[0].revision != 3 || handed[0].epoch != epoch {
		t.Fatalf("ack of 1: %v, handed %v; want revision 3 at epoch %d", st, handed, epoch)
	}
	// Acking 2 with 2 units lent: the window grows to its limit of 4
	// (revisions 3-6), one unit of the loan unused.
	_, handed = ackWindow(t, pool, []uuid.UUID{got[1].id}, holder, 4, 2)
	if r := revisions(handed, "a"); !slices.Equal(r, []int64{4, 5, 6}) {
		t.Fatalf("ack of 2 with 2 lent: handed %v, want [4 5 6]", r)
	}
	for _, l := range handed {
		if l.epoch != epoch {
			t.Fatalf("window slid to a new epoch %d (was %d)", l.epoch, epoch)
		}
	}
	// A holder that is not local (not named) gets nothing: the lease goes
	// on, its window not sliding.
	if _, h := ackWindow(t, pool, []uuid.UUID{eventID(t, pool, "a", 3)}, uuid.New(), 4, 10); len(h) != 0 {
		t.Fatalf("another session was handed %v", h)
	}
	if n := count(t, pool, `SELECT leased_through FROM outbox.delivery WHERE aggregate_key = 'a'`); n != 6 {
		t.Fatalf("leased through %d, want 6", n)
	}
	// Acking 4, 5 and 6 ends the lease: the next revisions come under a new
	// lease of at most 3 (what those acks free).
	_, handed = ackWindow(t, pool, []uuid.UUID{eventID(t, pool, "a", 4), eventID(t, pool, "a", 5), eventID(t, pool, "a", 6)}, holder, 4, 0)
	if r := revisions(handed, "a"); !slices.Equal(r, []int64{7, 8, 9}) {
		t.Fatalf("handed %v, want [7 8 9]", r)
	}
	if handed[0].epoch <= epoch {
		t.Fatalf("the new lease's epoch %d is not above %d", handed[0].epoch, epoch)
	}
}

// A nack, which must name the lease's head, ends the whole window and
// lists every event it covered; ExtendLease takes any event the lease
// still covers; a park may name any of them and ends the lease from there.
func TestWindowNackAndParkEndTheLease(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	ctx := context.Background()
	emitN(t, pool, "a", 5)
	emitN(t, pool, "b", 5)
	discover(t, pool)
	got := claimWindow(t, pool, uuid.New(), 2, 4, 8)
	a, b := got[:4], got[4:]
	if a[0].key != "a" || b[0].key != "b" {
		t.Fatalf("claimed %v", got)
	}
	// The same key in another stream: another aggregate, which no lease
	// here covers.
	emitIn(t, pool, "payments", "a", 4)
	var ended []uuid.UUID
	nack := func(l leased) error {
		return pool.QueryRow(ctx, `SELECT ended FROM outbox.nack($1, $2, 'broker down', NULL, '1 second', '1 minute', 5)`,
			l.id, l.epoch).Scan(&ended)
	}
	if err := nack(a[1]); err != pgx.ErrNoRows {
		t.Fatalf("nack of revision 2 while 1 is pending: %v, want no row (not the head)", err)
	}
	var until time.Time
	if err := pool.QueryRow(ctx, `SELECT lease_expires_at FROM outbox.extend_lease($1, $2, '1 hour')`, a[2].id, a[2].epoch).Scan(&until); err != nil {
		t.Fatalf("extending through the window's third event: %v", err)
	}
	if time.Until(until) < 50*time.Minute {
		t.Fatalf("extended to %v", until)
	}
	if err := nack(a[0]); err != nil {
		t.Fatal(err)
	}
	want := []uuid.UUID{a[0].id, a[1].id, a[2].id, a[3].id}
	if !slices.Equal(ended, want) {
		t.Fatalf("nack ended %v, want the whole window %v", ended, want)
	}
	if n := count(t, pool, `SELECT count(*) FROM outbox.delivery WHERE aggregate_key = 'a' AND state = 'backoff'`); n != 1 {
		t.Fatal("a is not backing off")
	}
	if err := pool.QueryRow(ctx, `SELECT lease_expires_at FROM outbox.extend_lease($1, $2, '1 hour')`, a[2].id, a[2].epoch).Scan(&until); err != pgx.ErrNoRows {
		t.Fatalf("extending a nacked lease: %v, want no row", err)
	}

	// Parking b at its third event: the lease ends from there on; the acks
	// of 1 and 2 (with the relay already) still land.
	if err := pool.QueryRow(ctx, `SELECT ended FROM outbox.park($1, $2, 'too large')`, b[2].id, b[2].epoch).Scan(&ended); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(ended, []uuid.UUID{b[2].id, b[3].id}) {
		t.Fatalf("park ended %v, want revisions 3 and 4", ended)
	}
	// ... and leave it parked, at its third event, with the reason: the
	// ack of 1 alone (the ack's path for batches with no window in play)
	// and then that of 2 with a window target (its general path).
	stillParked := func(want int64) {
		t.Helper()
		var state, reason string
		var cursor int64
		if err := pool.QueryRow(ctx, `SELECT state, delivered_revision, coalesce(parked_reason, '') FROM outbox.delivery WHERE aggregate_key = 'b'`).
			Scan(&state, &cursor, &reason); err != nil {
			t.Fatal(err)
		}
		if state != "parked" || cursor != want || reason != "too large" {
			t.Fatalf("after the acks before the parked event: %s, cursor %d, reason %q; want parked at %d, \"too large\"", state, cursor, reason, want)
		}
	}
	if st, _ := ackWindow(t, pool, []uuid.UUID{b[0].id}, uuid.New(), 1, 0); st[b[0].id] != "published" {
		t.Fatalf("ack of 1 before the parked event: %v", st)
	}
	stillParked(1)
	if st, _ := ackWindow(t, pool, []uuid.UUID{b[1].id}, uuid.New(), 4, 0); st[b[1].id] != "published" {
		t.Fatalf("ack of 2 before the parked event: %v", st)
	}
	stillParked(2)
}

// A session that sweeps its orphans (an ack batch's answer was lost) keeps
// a lease only when it knows both its head and the last event it covers:
// a window the lost batch slid forward is given back, or its next slide
// would send revisions past events the session never saw.
func TestReleaseGivesBackAWindowSlidUnseen(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	emitN(t, pool, "a", 8)
	discover(t, pool)
	holder := uuid.New()
	got := claimWindow(t, pool, holder, 1, 4, 4) // 1-4
	// The batch acking 1 and 2 slid the window to 3-6; its answer is lost,
	// so the session knows 3 and 4 only.
	if _, handed := ackWindow(t, pool, []uuid.UUID{got[0].id, got[1].id}, holder, 4, 0); len(handed) != 2 {
		t.Fatalf("handed %v", handed)
	}
	release := func(keep ...uuid.UUID) int64 {
		var n int64
		if err := pool.QueryRow(context.Background(), `SELECT outbox.release($1, $2)`, holder, keep).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	if n := release(got[2].id, got[3].id, eventID(t, pool, "a", 5), eventID(t, pool, "a", 6)); n != 0 {
		t.Fatalf("released %d leases the session knows whole", n)
	}
	if n := release(got[2].id, got[3].id); n != 1 {
		t.Fatalf("released %d, want the window slid past what the session knows", n)
	}
	// Nor when it knows the last event the lease covers but not its head.
	again := claimWindow(t, pool, holder, 1, 4, 4)
	if r := revisions(again, "a"); !slices.Equal(r, []int64{3, 4, 5, 6}) {
		t.Fatalf("claimed %v again, want 3-6", r)
	}
	if n := release(again[2].id, again[3].id); n != 1 {
		t.Fatalf("released %d keeping only the window's tail, want its lease", n)
	}
}

// Producers, discovery rounds and workers that claim with a window and ack
// (partly out of order, then all) race on a few hot aggregates: every event
// is published, in revision order, with nothing stranded.
func TestWindowClaimAndAckRace(t *testing.T) {
	t.Parallel()
	worker := func(ctx context.Context, pool *pgxpool.Pool) error {
		holder := uuid.New()
		rows, err := pool.Query(ctx, `SELECT aggregate_key, revision, event_id, epoch
			FROM outbox.claim($1, 'r', 'x', NULL, 3, interval '30 seconds', NULL, NULL, 4, 6)`, holder)
		if err != nil {
			return err
		}
		held, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (leased, error) {
			var l leased
			return l, row.Scan(&l.key, &l.revision, &l.id, &l.epoch)
		})
		for err == nil && len(held) > 0 {
			ids := make([]uuid.UUID, len(held))
			for i, l := range held {
				ids[len(held)-1-i] = l.id // reversed: the array's order must not matter
			}
			// The later half alone first: mostly out of order, no harm.
			if _, err = pool.Exec(ctx, `SELECT * FROM outbox.ack($1, 'x')`, ids[:len(ids)/2]); err != nil {
				break
			}
			rows, err = pool.Query(ctx, `SELECT (a.handover).aggregate_key, (a.handover).revision, (a.handover).event_id, (a.handover).epoch
				FROM outbox.ack($1, 'x', ARRAY[$2::uuid], ARRAY[interval '30 seconds'], ARRAY[4], ARRAY[1]) a
				WHERE a.status = 'handed_over'`, ids, holder)
			if err != nil {
				break
			}
			held, err = pgx.CollectRows(rows, func(row pgx.CollectableRow) (leased, error) {
				var l leased
				return l, row.Scan(&l.key, &l.revision, &l.id, &l.epoch)
			})
		}
		return err
	}
	raceDelivery(t, func(ctx context.Context, pool *pgxpool.Pool) error {
		_, err := pool.Exec(ctx, `SELECT * FROM outbox.discover()`)
		return err
	}, worker)
}

// An aggregate stays parked only while the parked revision is still ahead
// of its cursor: acks of a window's revisions through the parked one, in
// one batch, publish it too (its relay did send it), and the aggregate goes
// on from the next revision, no longer parked. Each ack is decided on its
// own, but what the aggregate becomes is decided on all of them: the last
// one acked here is the parked revision itself.
func TestAWindowAckedThroughItsParkedRevisionGoesOn(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	ctx := testContext(t)
	emitN(t, pool, "a", 3)
	discover(t, pool)
	ls := claimWindow(t, pool, uuid.New(), 1, 3, 3)
	if len(ls) != 3 {
		t.Fatalf("claimed %v, want a window of 3", ls)
	}
	var ended []uuid.UUID
	if err := pool.QueryRow(ctx, `SELECT ended FROM outbox.park($1, $2, 'too large')`, ls[1].id, ls[1].epoch).Scan(&ended); err != nil {
		t.Fatal(err)
	}
	st, _ := ackWindow(t, pool, []uuid.UUID{ls[0].id, ls[1].id}, uuid.New(), 1, 0)
	if st[ls[0].id] != "published" || st[ls[1].id] != "published" {
		t.Fatalf("acks of revisions 1 and 2 (parked at 2): %v, want both published", st)
	}
	var state string
	var cursor int64
	var parkedAt *time.Time
	if err := pool.QueryRow(ctx, `SELECT state, delivered_revision, parked_at FROM outbox.delivery WHERE aggregate_key = 'a'`).
		Scan(&state, &cursor, &parkedAt); err != nil {
		t.Fatal(err)
	}
	if state != "ready" || cursor != 2 || parkedAt != nil {
		t.Fatalf("after the acks through the parked revision: %s at %d, parked at %v; want ready at 2, not parked", state, cursor, parkedAt)
	}
}

// A hand-over with a window in play keeps the claim order as one of a
// single event does (TestOneAckDecidesAsABatch, "older claimable work"):
// b/1, older than a/2, is claimable, so the ack of a/1 by a session taking
// windows of 2, with no credit to spare, leases it nothing, and a goes back
// to ready behind b.
func TestAWindowedHandOverYieldsToOlderWork(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	ctx := testContext(t)
	h := uuid.New()
	emitN(t, pool, "a", 1)
	emitN(t, pool, "b", 1)
	emitN(t, pool, "a", 2)
	discover(t, pool)
	a1 := claimAlone(t, pool, h, "a", 1)
	st, handed := ackWindow(t, pool, []uuid.UUID{a1.id}, h, 2, 0)
	if st[a1.id] != "published" || len(handed) != 0 {
		t.Fatalf("ack of a/1 with b/1 older than a/2 claimable: %v, handed over %v; want published, nothing handed over", st, handed)
	}
	var state string
	if err := pool.QueryRow(ctx, `SELECT state FROM outbox.delivery WHERE aggregate_key = 'a'`).Scan(&state); err != nil {
		t.Fatal(err)
	}
	if state != "ready" {
		t.Fatalf("a is %s after the ack, want ready", state)
	}
	// With the older work gone, the same hand-over goes ahead.
	if got := claimWindow(t, pool, uuid.New(), 1, 1, 1); len(got) != 1 || got[0].key != "b" {
		t.Fatalf("the next claim took %v, want b/1, the oldest", got)
	}
	a2 := claimAlone(t, pool, h, "a", 2)
	if _, handed := ackWindow(t, pool, []uuid.UUID{a2.id}, h, 2, 0); len(handed) != 1 || handed[0].revision != 3 {
		t.Fatalf("ack of a/2 with nothing older claimable handed over %v, want a/3", handed)
	}
}
