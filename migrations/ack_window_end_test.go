package migrations_test

import (
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/outboxd/outboxd/internal/testdb"
)

// A windowed ack that ends its lease with nothing handed over (no holder
// to hand to) leaves the aggregate as an ack of one event would: the
// failure counts and last error of the deliveries before it cleared, since
// a publish succeeded (a later failure starts counting towards parking
// from zero), and, with a next revision waiting, ready in the claim order
// and lag of that revision's created_at, not of the ack's clock. Written
// against mutants of the general path's UPDATE that kept failures,
// unanswered or last_error, or put v_now in pending_since or claimable_at;
// each survived every test before it.
func TestAWindowedAckEndingItsLeaseResetsTheRowAsAnyAck(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	emitN(t, pool, "a", 3)
	discover(t, pool)
	ls := claimWindow(t, pool, uuid.New(), 1, 2, 2)
	if len(ls) != 2 || ls[0].revision != 1 || ls[1].revision != 2 {
		t.Fatalf("claimed %v, want a/1 and a/2 under one lease", ls)
	}
	// What earlier deliveries of this lease's events left on the row.
	exec(t, pool, `UPDATE outbox.delivery SET failures = 2, unanswered = 1, last_error = 'broker down' WHERE aggregate_key = 'a'`)
	var third time.Time
	if err := pool.QueryRow(testContext(t), `SELECT created_at FROM outbox.event WHERE aggregate_key = 'a' AND revision = 3`).Scan(&third); err != nil {
		t.Fatal(err)
	}
	answers, handed := ackAnswers(t, pool, []uuid.UUID{ls[0].id, ls[1].id}, nil, nil, nil)
	if len(answers) != 2 || len(handed) != 0 {
		t.Fatalf("ack of a/1 and a/2 answered %v, handed %v; want both published, nothing handed over", answers, handed)
	}
	var state string
	var failures, unanswered int
	var lastError *string
	var pendingSince, claimableAt time.Time
	if err := pool.QueryRow(testContext(t), `SELECT state, failures, unanswered, last_error, pending_since, claimable_at
		FROM outbox.delivery WHERE aggregate_key = 'a'`).Scan(&state, &failures, &unanswered, &lastError, &pendingSince, &claimableAt); err != nil {
		t.Fatal(err)
	}
	if state != "ready" || failures != 0 || unanswered != 0 || lastError != nil {
		t.Errorf("after the ack: state %s, failures %d, unanswered %d, last error %v; want ready with all cleared",
			state, failures, unanswered, lastError)
	}
	if !pendingSince.Equal(third) || !claimableAt.Equal(third) {
		t.Errorf("pending since %v, claimable at %v; want both a/3's created_at %v", pendingSince, claimableAt, third)
	}
}
