package migrations_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/outboxd/outboxd/internal/testdb"
)

// An expired lease's attempt is recorded at the moment the lease expired,
// not at the claim that found it expired, which may come long after (a
// quiet stream is claimed again only when a relay asks): the history says
// when the relay went silent.
func TestAnExpiredLeaseIsRecordedWhenItExpired(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	emitN(t, pool, "a", 1)
	discover(t, pool)
	var id uuid.UUID
	var expired time.Time
	if err := pool.QueryRow(testContext(t), `SELECT event_id, lease_expires_at
		FROM outbox.claim(gen_random_uuid(), 'r', 'x', NULL, 1, interval '-1 hour')`).Scan(&id, &expired); err != nil {
		t.Fatal(err)
	}
	if again := claimAs(t, pool, uuid.New(), "y"); again.id != id {
		t.Fatalf("claimed %v, want the expired lease's event %s again", again, id)
	}
	var outcome string
	var at time.Time
	if err := pool.QueryRow(testContext(t), `SELECT outcome, at FROM outbox.attempt WHERE event_id = $1`, id).
		Scan(&outcome, &at); err != nil {
		t.Fatal(err)
	}
	if outcome != "expired" || !at.Equal(expired) {
		t.Fatalf("attempt %s at %v, want expired at the lease's expiry %v", outcome, at, expired)
	}
}

// The attempt history is trimmed per aggregate: a statement that records
// attempts of several aggregates of one stream (a release of a session's
// leases) keeps the newest attempt_history_per_aggregate of each one, not
// of the stream.
func TestAttemptHistoryIsTrimmedPerAggregate(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	exec(t, pool, `UPDATE outbox.settings SET attempt_history_per_aggregate = 2`)
	emitN(t, pool, "a", 1)
	emitN(t, pool, "b", 1)
	discover(t, pool)
	holder := uuid.New()
	for i := range 3 {
		if got := claimWindow(t, pool, holder, 2, 1, 2); len(got) != 2 {
			t.Fatalf("claim %d: %v, want a and b", i+1, got)
		}
		if n := count(t, pool, fmt.Sprintf(`SELECT outbox.release('%s')`, holder)); n != 2 {
			t.Fatalf("release %d gave back %d leases, want 2", i+1, n)
		}
	}
	var history string
	if err := pool.QueryRow(testContext(t), `SELECT string_agg(aggregate_key || ' ' || attempt || ' ' || outcome, ', '
		ORDER BY aggregate_key, attempt_id) FROM outbox.attempt`).Scan(&history); err != nil {
		t.Fatal(err)
	}
	if want := "a 2 released, a 3 released, b 2 released, b 3 released"; history != want {
		t.Fatalf("attempt history %q, want %q", history, want)
	}
}
