package migrations_test

import (
	"fmt"
	"testing"

	"github.com/outboxd/outboxd/internal/store"
	"github.com/outboxd/outboxd/internal/testdb"
)

// A second republish of an aggregate while delivery is still handing out
// a first one's events must not take those events out of the first
// republish: each is still a republished event, delivered again as the
// attempt after its earlier deliveries (continue_attempts: "a relay and
// the attempt history never see attempt 1 of an event twice") and naming
// the republish that made it pending (republish_action: a broker that
// deduplicates by message id would otherwise drop the copy as the
// original's duplicate). Both halves once failed: Store.Republish set the
// mark (delivery.republished_through) to its own range's end, the cursor
// at the time, below the first republish's remaining events; and
// continue_attempts read the aggregate's newest republish, which does not
// hold them. They came as attempt 1 with republish action 0, exactly as
// first published.
func TestASecondRepublishKeepsTheFirstOnesRemainingEvents(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pool := testdb.NewPool(t)
	s := store.New(pool)
	emitN(t, pool, "a", 3)
	discover(t, pool)
	for rev := int64(1); rev <= 3; rev++ {
		deliverNext(t, pool, "a", rev)
	}
	own := &store.OperatorAction{Action: "republish", Actor: "test", Reason: "test", Stream: "orders"}
	first, err := s.Republish(ctx, store.RepublishParams{Stream: "orders", AggregateKey: "a", FromRevision: 1, Own: own})
	if err != nil {
		t.Fatal(err)
	}
	deliverNext(t, pool, "a", 1) // the first republish's a/1; a/2 and a/3 wait
	second, err := s.Republish(ctx, store.RepublishParams{Stream: "orders", AggregateKey: "a", FromRevision: 1, Own: own})
	if err != nil {
		t.Fatal(err)
	}
	deliverNext(t, pool, "a", 1) // the second republish's a/1
	var got string
	if err := pool.QueryRow(ctx, `SELECT format('a/%s attempt %s action %s', revision, attempt, republish_action)
		FROM outbox.claim(gen_random_uuid(), 'r', 'x', NULL, 1, interval '1 minute')`).Scan(&got); err != nil {
		t.Fatal(err)
	}
	if want := fmt.Sprintf("a/2 attempt 2 action %d", first.ActionID); got != want {
		t.Fatalf("after a second republish (action %d): %s, want %s (the first republish's a/2, delivered once before)",
			second.ActionID, got, want)
	}
}
