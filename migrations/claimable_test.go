package migrations_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxd/outboxd/internal/testdb"
)

// ackClaimable acks the event of key's revision rev and returns its status
// and claimable_in (nil for NULL).
func ackClaimable(t *testing.T, pool *pgxpool.Pool, key string, rev int64) (string, *time.Duration) {
	t.Helper()
	var status string
	var in *time.Duration
	id := eventID(t, pool, key, rev)
	if err := pool.QueryRow(context.Background(),
		`SELECT status, claimable_in FROM outbox.ack(ARRAY[$1::uuid], 'x')`, id).Scan(&status, &in); err != nil {
		t.Fatal(err)
	}
	return status, in
}

// An ack batch says what it saw of claimable work once applied: zero while
// an aggregate is claimable, else the time until the first would be (here
// a lease expiring), and nothing on the rows of acks it did not apply.
func TestAckSaysWhenWorkIsClaimable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.NewPool(t)
	holder := uuid.New()
	emitN(t, pool, "a", 1)
	emitN(t, pool, "b", 1)
	discover(t, pool)
	if got := claimWindow(t, pool, holder, 1, 1, 1); len(got) != 1 || got[0].key != "a" {
		t.Fatalf("claimed %v, want orders/a, the oldest", got)
	}
	if status, in := ackClaimable(t, pool, "a", 1); status != "published" || in == nil || *in != 0 {
		t.Fatalf("ack of a with b ready: %s, claimable in %v; want published, 0", status, in)
	}

	if got := claimWindow(t, pool, holder, 1, 1, 1); len(got) != 1 || got[0].key != "b" {
		t.Fatalf("claimed %v, want orders/b", got)
	}
	emitN(t, pool, "c", 1)
	discover(t, pool)
	if got := claimWindow(t, pool, holder, 1, 1, 1); len(got) != 1 || got[0].key != "c" {
		t.Fatalf("claimed %v, want orders/c", got)
	}
	// b is leased for 30 seconds: nothing is claimable before that.
	status, in := ackClaimable(t, pool, "c", 1)
	if status != "published" || in == nil || *in <= 20*time.Second || *in > 30*time.Second {
		t.Fatalf("ack of c with b leased for 30s: %s, claimable in %v; want published, 20-30s", status, in)
	}
	if status, in := ackClaimable(t, pool, "c", 1); status != "already_published" || in != nil {
		t.Fatalf("second ack of c: %s, claimable in %v; want already_published, NULL", status, in)
	}
	// The last lease ends: nothing is or will become claimable.
	if status, in := ackClaimable(t, pool, "b", 1); status != "published" || in != nil {
		t.Fatalf("ack of b, the last lease: %s, claimable in %v; want published, NULL", status, in)
	}
	var claimable int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox.delivery WHERE claimable_at IS NOT NULL`).Scan(&claimable); err != nil || claimable != 0 {
		t.Fatalf("%d aggregates claimable or leased, %v; want none", claimable, err)
	}
}

// A windowed ack (the general statement) says the same: a lease that goes
// on is claimable only when it expires.
func TestWindowedAckSaysWhenWorkIsClaimable(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	holder := uuid.New()
	emitN(t, pool, "a", 3)
	discover(t, pool)
	if got := claimWindow(t, pool, holder, 1, 3, 3); len(got) != 3 {
		t.Fatalf("claimed %v, want a's three revisions", got)
	}
	var status string
	var in *time.Duration
	if err := pool.QueryRow(context.Background(),
		`SELECT status, claimable_in FROM outbox.ack(ARRAY[$1::uuid], 'x', ARRAY[$2::uuid], ARRAY[interval '30 seconds'], ARRAY[3], ARRAY[0])`,
		eventID(t, pool, "a", 1), holder).Scan(&status, &in); err != nil {
		t.Fatal(err)
	}
	if status != "published" || in == nil || *in <= 20*time.Second || *in > 30*time.Second {
		t.Fatalf("ack of a/1 in a window of 3: %s, claimable in %v; want published, 20-30s (the window's lease)", status, in)
	}
}

// A release that gave leases back sends one outbox_wakeup, so idle sessions
// on every replica claim the aggregates at once; one that released nothing
// sends none.
func TestReleaseWakesIdleSessions(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.NewPool(t)
	listener, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer listener.Release()
	if _, err := listener.Exec(ctx, `LISTEN outbox_wakeup`); err != nil {
		t.Fatal(err)
	}
	holder := uuid.New()
	emitN(t, pool, "a", 1)
	discover(t, pool) // may notify: it made a ready
	if got := claimWindow(t, pool, holder, 1, 1, 1); len(got) != 1 {
		t.Fatalf("claimed %v, want orders/a", got)
	}
	// Notifications are delivered to an idle connection before it answers
	// its next query: this drains what discovery sent.
	drain := func() (n int) {
		t.Helper()
		if _, err := listener.Exec(ctx, `SELECT 1`); err != nil {
			t.Fatal(err)
		}
		for {
			wctx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
			_, err := listener.Conn().WaitForNotification(wctx)
			cancel()
			if err != nil {
				return n
			}
			n++
		}
	}
	drain()
	if n := count(t, pool, fmt.Sprintf(`SELECT outbox.release('%s')`, uuid.New())); n != 0 {
		t.Fatalf("released %d for a holder with no leases", n)
	}
	if n := drain(); n != 0 {
		t.Fatalf("%d wake-ups from a release of nothing, want none", n)
	}
	if n := count(t, pool, fmt.Sprintf(`SELECT outbox.release('%s')`, holder)); n != 1 {
		t.Fatalf("released %d, want 1", n)
	}
	if n := drain(); n != 1 {
		t.Fatalf("%d wake-ups from a release of one lease, want 1", n)
	}
}

// A released aggregate keeps its place in the claim order (its head
// event's created_at), not the time of the release: the aggregates of a
// stream that ended do not fall behind newer work.
func TestReleaseKeepsTheClaimOrder(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	emitN(t, pool, "a", 1)
	emitN(t, pool, "b", 1)
	discover(t, pool)
	holder := uuid.New()
	if got := claimAs(t, pool, holder, "x"); got.key != "a" {
		t.Fatalf("claimed %v, want a, the older", got)
	}
	if n := count(t, pool, fmt.Sprintf(`SELECT outbox.release('%s')`, holder)); n != 1 {
		t.Fatalf("released %d, want 1", n)
	}
	if got := claimAs(t, pool, uuid.New(), "x"); got.key != "a" {
		t.Fatalf("claimed %v after a's release, want a again (older than b)", got)
	}
}

// A batch of acks (the batch statements, not the one-row path) says the
// same per holder: zero while work is claimable in the streams the
// holder's session takes, nothing when none is nor will be, and zero for a
// holder the call does not describe (it is not probed).
func TestBatchAckSaysWhenWorkIsClaimable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.NewPool(t)
	orders, quiet, other := uuid.New(), uuid.New(), uuid.New()
	for _, k := range []string{"a", "b", "c"} {
		exec(t, pool, fmt.Sprintf(`SELECT outbox.emit('orders', '%s', 'T', '{}')`, k))
	}
	exec(t, pool, `SELECT outbox.emit('quiet', 'q', 'T', '{}')`)
	discover(t, pool)
	claim := func(holder uuid.UUID, stream, want string) {
		t.Helper()
		var key string
		if err := pool.QueryRow(ctx, `SELECT aggregate_key FROM outbox.claim($1, 'r', 'x', ARRAY[$2], 1, interval '30 seconds')`,
			holder, stream).Scan(&key); err != nil || key != want {
			t.Fatalf("claim of %s: %q, %v; want %s", stream, key, err, want)
		}
	}
	claim(orders, "orders", "a")
	claim(quiet, "quiet", "q")
	claim(other, "orders", "b")
	// orders' session takes orders, quiet's takes quiet; other's is not
	// described.
	ack := func(ids ...uuid.UUID) map[uuid.UUID]*time.Duration {
		t.Helper()
		rows, err := pool.Query(ctx, `SELECT event_id, status, claimable_in FROM outbox.ack($1, 'x', NULL, NULL, NULL, NULL,
			ARRAY[$2::uuid, $3::uuid], ARRAY['orders', 'quiet'], ARRAY[false, false], interval '1 minute')`, ids, orders, quiet)
		if err != nil {
			t.Fatal(err)
		}
		defer rows.Close()
		out := map[uuid.UUID]*time.Duration{}
		for rows.Next() {
			var id uuid.UUID
			var status string
			var in *time.Duration
			if err := rows.Scan(&id, &status, &in); err != nil {
				t.Fatal(err)
			}
			if status == "published" {
				out[id] = in
			}
		}
		if err := rows.Err(); err != nil {
			t.Fatal(err)
		}
		return out
	}
	a, q, b := eventID(t, pool, "a", 1), eventIDIn(t, pool, "quiet", "q", 1), eventID(t, pool, "b", 1)
	got := ack(a, q)
	if in := got[a]; in == nil || *in != 0 {
		t.Errorf("a, with c ready in orders: claimable in %v, want 0", in)
	}
	if in, ok := got[q]; !ok || in != nil {
		t.Errorf("q, with nothing in quiet: claimable in %v (published %t), want NULL", in, ok)
	}
	claim(orders, "orders", "c")
	// Nothing is ready now, and c's and b's leases run 30 seconds: a probe
	// of every stream would say so. other is not probed: zero.
	got = ack(b, uuid.New())
	if in := got[b]; in == nil || *in != 0 {
		t.Errorf("b, held by a session the call does not describe: claimable in %v, want 0", in)
	}
}
