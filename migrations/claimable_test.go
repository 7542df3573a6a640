package migrations_test

import (
	"context"
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
	var ready int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox.delivery WHERE claimable_at <= now()`).Scan(&ready); err != nil || ready != 0 {
		t.Fatalf("%d aggregates claimable, %v; want none", ready, err)
	}
}
