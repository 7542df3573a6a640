package migrations_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxd/outboxd/internal/testdb"
)

// expiredLease emits n events of key, makes its aggregate claimable and
// claims it with a lease that has expired already (a negative TTL),
// returning the head event and the lease's epoch.
func expiredLease(t *testing.T, pool *pgxpool.Pool, key string, n int) (uuid.UUID, int64) {
	t.Helper()
	emitN(t, pool, key, n)
	discover(t, pool)
	var id uuid.UUID
	var epoch int64
	if err := pool.QueryRow(testContext(t), `SELECT event_id, epoch FROM outbox.claim(gen_random_uuid(), 'r', 'x', NULL, 1, interval '-1 second')`).
		Scan(&id, &epoch); err != nil {
		t.Fatal(err)
	}
	return id, epoch
}

// park and extend_lease act only for the lease that holds the event now: a
// relay whose lease was replaced (it expired and another relay claimed the
// aggregate) cannot park the aggregate out from under the new holder or
// stretch the new lease, and an event already acked, though its window's
// lease lives on for the events after it, can do neither (the lease no
// longer covers it). Nor can they act through an event past the window the
// lease covers, and a lease a nack ended (its aggregate backs off keeping
// its epoch) can be neither nacked again nor parked.
func TestParkAndExtendActOnlyForTheLeaseThatHoldsTheEvent(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pool := testdb.NewPool(t)
	park := func(id uuid.UUID, epoch int64) error {
		var holder *uuid.UUID
		return pool.QueryRow(ctx, `SELECT holder FROM outbox.park($1, $2, 'too large')`, id, epoch).Scan(&holder)
	}
	extend := func(id uuid.UUID, epoch int64) error {
		var until any
		return pool.QueryRow(ctx, `SELECT lease_expires_at FROM outbox.extend_lease($1, $2, '1 hour')`, id, epoch).Scan(&until)
	}
	delivery := func(key string) (state string, epoch, cursor int64) {
		t.Helper()
		if err := pool.QueryRow(ctx, `SELECT state, epoch, delivered_revision FROM outbox.delivery WHERE aggregate_key = $1`, key).
			Scan(&state, &epoch, &cursor); err != nil {
			t.Fatal(err)
		}
		return state, epoch, cursor
	}

	// A replaced lease: the first lease of a expires at once, and another
	// relay claims a again.
	id, stale := expiredLease(t, pool, "a", 1)
	current := claimAs(t, pool, uuid.New(), "y")
	if current.id != id || current.epoch <= stale {
		t.Fatalf("claimed %v again, want %s at an epoch above %d", current, id, stale)
	}
	if err := park(id, stale); err != pgx.ErrNoRows {
		t.Fatalf("park with the replaced lease's epoch: %v, want no row", err)
	}
	if err := extend(id, stale); err != pgx.ErrNoRows {
		t.Fatalf("extend_lease with the replaced lease's epoch: %v, want no row", err)
	}
	if state, epoch, _ := delivery("a"); state != "leased" || epoch != current.epoch {
		t.Fatalf("a is %s at epoch %d, want still leased at %d", state, epoch, current.epoch)
	}

	// An acked event of a window whose lease goes on.
	emitN(t, pool, "b", 3)
	discover(t, pool)
	holder := uuid.New()
	w := claimWindow(t, pool, holder, 1, 3, 3)
	if len(w) != 3 || w[0].key != "b" {
		t.Fatalf("claimed %v, want b's window of 3", w)
	}
	if st, _ := ackWindow(t, pool, []uuid.UUID{w[0].id}, holder, 3, 0); st[w[0].id] != "published" {
		t.Fatalf("ack of b/1: %v", st)
	}
	state, epoch, cursor := delivery("b")
	if state != "leased" || cursor != 1 {
		t.Fatalf("after the ack of b/1: %s at cursor %d, want leased at 1", state, cursor)
	}
	if err := extend(w[0].id, epoch); err != pgx.ErrNoRows {
		t.Fatalf("extend_lease through the acked b/1: %v, want no row", err)
	}
	if err := park(w[0].id, epoch); err != pgx.ErrNoRows {
		t.Fatalf("park at the acked b/1: %v, want no row", err)
	}
	if state, _, cursor := delivery("b"); state != "leased" || cursor != 1 {
		t.Fatalf("b is %s at cursor %d, want still leased at 1", state, cursor)
	}
	// The same lease's epoch, through an event it still covers: both act.
	if err := extend(w[1].id, epoch); err != nil {
		t.Fatalf("extend_lease through b/2: %v", err)
	}
	if err := park(w[1].id, epoch); err != nil {
		t.Fatalf("park at b/2: %v", err)
	}
	if state, _, _ := delivery("b"); state != "parked" {
		t.Fatalf("b is %s after the park at b/2", state)
	}

	// An event after the last one the lease covers (the lease never sent
	// it): neither acts through it, though the epoch is the lease's own.
	emitN(t, pool, "c", 3)
	discover(t, pool)
	w = claimWindow(t, pool, uuid.New(), 1, 2, 2)
	if len(w) != 2 || w[0].key != "c" {
		t.Fatalf("claimed %v, want c's window of 2", w)
	}
	past := eventID(t, pool, "c", 3)
	if err := extend(past, w[0].epoch); err != pgx.ErrNoRows {
		t.Fatalf("extend_lease through c/3, past the window: %v, want no row", err)
	}
	if err := park(past, w[0].epoch); err != pgx.ErrNoRows {
		t.Fatalf("park at c/3, past the window: %v, want no row", err)
	}
	// A lease a nack ended: its epoch and head (the aggregate backs off
	// with both unchanged) answer no second nack, which would count the
	// failure twice, and no park.
	nack := func(id uuid.UUID, epoch int64) error {
		var failures int
		return pool.QueryRow(ctx, `SELECT failures FROM outbox.nack($1, $2, 'broker down', NULL, '1 minute', '1 hour', 5)`,
			id, epoch).Scan(&failures)
	}
	if err := nack(w[0].id, w[0].epoch); err != nil {
		t.Fatalf("nack of c/1: %v", err)
	}
	if err := nack(w[0].id, w[0].epoch); err != pgx.ErrNoRows {
		t.Fatalf("a second nack of the ended lease: %v, want no row", err)
	}
	if err := park(w[0].id, w[0].epoch); err != pgx.ErrNoRows {
		t.Fatalf("park with the nacked lease's epoch: %v, want no row", err)
	}
	if n := count(t, pool, `SELECT failures FROM outbox.delivery WHERE aggregate_key = 'c' AND state = 'backoff'`); n != 1 {
		t.Fatalf("c backs off with %d failures, want 1", n)
	}
}

// Extending a lease keeps its aggregate from being claimed until the new
// expiry: extend_lease moves the claim order (claimable_at) with
// lease_expires_at, or a lease whose first TTL ran out would be claimed
// again while its holder still publishes under the extension.
func TestAnExtendedLeaseIsNotClaimedAgain(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	id, epoch := expiredLease(t, pool, "a", 1)
	var until time.Time
	if err := pool.QueryRow(testContext(t), `SELECT lease_expires_at FROM outbox.extend_lease($1, $2, '1 hour')`, id, epoch).Scan(&until); err != nil {
		t.Fatalf("extend_lease of the current lease: %v", err)
	}
	if n := count(t, pool, `SELECT count(*) FROM outbox.claim(gen_random_uuid(), 'r', 'y', NULL, 1, interval '30 seconds')`); n != 0 {
		t.Fatalf("claimed %d events of a lease extended to %v", n, until)
	}
}

// An extension runs from when it is made, not from the lease's old expiry:
// a lease that ran out an hour ago (its holder was slow, and no claim came
// meanwhile), extended by ten minutes, expires ten minutes from now, and
// its aggregate is not claimed again until then. From the old expiry it
// would have run out fifty minutes ago, the holder publishing under a lease
// any claim may take.
func TestAnExtensionRunsFromNow(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pool := testdb.NewPool(t)
	emitN(t, pool, "a", 1)
	discover(t, pool)
	var id uuid.UUID
	var epoch int64
	if err := pool.QueryRow(ctx, `SELECT event_id, epoch FROM outbox.claim(gen_random_uuid(), 'r', 'x', NULL, 1, interval '-1 hour')`).
		Scan(&id, &epoch); err != nil {
		t.Fatal(err)
	}
	var before, until, after time.Time
	if err := pool.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&before); err != nil {
		t.Fatal(err)
	}
	if err := pool.QueryRow(ctx, `SELECT lease_expires_at FROM outbox.extend_lease($1, $2, '10 minutes')`, id, epoch).Scan(&until); err != nil {
		t.Fatalf("extend_lease of the current lease: %v", err)
	}
	if err := pool.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&after); err != nil {
		t.Fatal(err)
	}
	if until.Before(before.Add(10*time.Minute)) || until.After(after.Add(10*time.Minute)) {
		t.Fatalf("extended to %v, want ten minutes after the extension (%v)", until, before.Add(10*time.Minute))
	}
	if n := count(t, pool, `SELECT count(*) FROM outbox.claim(gen_random_uuid(), 'r', 'y', NULL, 1, interval '30 seconds')`); n != 0 {
		t.Fatalf("claimed %d events of a lease extended to %v", n, until)
	}
}

// An ack batch that names an event the cursor already stepped over (it was
// skipped after its lease expired) together with the event its aggregate
// now has leased publishes the leased one: the stale event does not take
// the place in line of the one after the cursor.
func TestAStaleAckInABatchDoesNotDisplaceTheNextRevision(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pool := testdb.NewPool(t)
	first, _ := expiredLease(t, pool, "a", 2)
	exec(t, pool, fmt.Sprintf(`INSERT INTO outbox.skipped_event (event_id, reason, actor) VALUES ('%s', 'test', 'test')`, first))
	next := claimAs(t, pool, uuid.New(), "y")
	second := eventID(t, pool, "a", 2)
	if next.id != second {
		t.Fatalf("claimed %v after skipping a/1, want a/2 (%s)", next, second)
	}
	// The claim recorded no expiry for a/1: record_expired writes the
	// history of the events a claim leases again, and a skipped one never
	// is.
	if n := count(t, pool, fmt.Sprintf(`SELECT count(*) FROM outbox.attempt WHERE event_id = '%s'`, first)); n != 0 {
		t.Fatalf("%d attempts recorded for the skipped a/1, want none", n)
	}
	rows, err := pool.Query(ctx, `SELECT event_id, status FROM outbox.ack(ARRAY[$1::uuid, $2::uuid], 'x')`, first, second)
	if err != nil {
		t.Fatal(err)
	}
	status := map[uuid.UUID]string{}
	for rows.Next() {
		var id uuid.UUID
		var st string
		if err := rows.Scan(&id, &st); err != nil {
			t.Fatal(err)
		}
		status[id] = st
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if status[second] != "published" {
		t.Fatalf("a/2 answered %q, want published (a/1 answered %q)", status[second], status[first])
	}
	if status[first] == "published" {
		t.Fatal("the skipped a/1 was published")
	}
	if n := count(t, pool, fmt.Sprintf(`SELECT count(*) FROM outbox.event WHERE event_id = '%s' AND published_at IS NOT NULL`, first)); n != 0 {
		t.Fatal("the skipped a/1 is marked published")
	}
}
