package migrations_test

import (
	"fmt"
	"testing"

	"github.com/google/uuid"

	"github.com/outboxd/outboxd/internal/testdb"
)

// A stalled aggregate counts as stalled while it waits, not only while a
// relay holds its next attempt: one whose publishes keep failing is stalled
// while it backs off between them, and one whose deliveries keep ending
// unanswered is stalled while it is ready for the next relay. (Only parked
// and gap-held aggregates are reported as such instead.)
func TestStalledAggregatesCountWhileTheyWait(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	exec(t, pool, `UPDATE outbox.settings SET stall_after_failures = 2, stall_after_unanswered = 2`)
	emitN(t, pool, "failing", 1)
	discover(t, pool)
	for _, backoff := range []string{"1 microsecond", "1 hour"} {
		l := claimAs(t, pool, uuid.New(), "x")
		exec(t, pool, fmt.Sprintf(`SELECT * FROM outbox.nack('%s', %d, 'broker down', NULL, interval '%s', interval '1 hour', 10)`,
			l.id, l.epoch, backoff))
	}
	emitN(t, pool, "silent", 1)
	discover(t, pool)
	holder := uuid.New()
	for range 3 {
		if got := claimWindow(t, pool, holder, 1, 1, 1); len(got) != 1 || got[0].key != "silent" {
			t.Fatalf("claimed %v, want silent", got)
		}
		exec(t, pool, fmt.Sprintf(`SELECT outbox.release('%s')`, holder))
	}
	var states string
	if err := pool.QueryRow(testContext(t), `SELECT string_agg(format('%s %s %s/%s %s', aggregate_key, state, failures, unanswered,
		outbox.stall_reason(state, unanswered, failures, last_error) IS NOT NULL), ', ' ORDER BY aggregate_key)
		FROM outbox.delivery`).Scan(&states); err != nil {
		t.Fatal(err)
	}
	if want := "failing backoff 2/0 t, silent ready 0/2 t"; states != want {
		t.Fatalf("aggregates (key state failures/unanswered stalled): %q, want %q", states, want)
	}
	if n := count(t, pool, `SELECT stalled FROM outbox.pending_by_stream(NULL)`); n != 2 {
		t.Fatalf("pending_by_stream counts %d stalled aggregates, want 2", n)
	}
}
