package migrations_test

import (
	"context"
	"fmt"
	"slices"
	"testing"

	"github.com/google/uuid"

	"github.com/outboxd/outboxd/internal/testdb"
)

// Tests added by the claim mutation sweep: each one fails with a mutant of
// outbox.claim or outbox.lease_heads that every other test let through.

// With credit to spare, a window is cut by its size and by a skipped
// revision alone: it covers exactly p_window revisions from the head, and
// none from a skipped one on. (TestWindowLeasesConsecutiveRevisions cuts
// its windows by the credit first, which hides a window one revision too
// wide and one that runs over a skipped revision.)
func TestAWindowWithCreditToSpareStopsAtItsSizeAndAtASkip(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	emitN(t, pool, "a", 6)
	emitN(t, pool, "c", 6)
	// c: revision 3 skipped, so c's window stops at 2, however wide.
	exec(t, pool, `INSERT INTO outbox.skipped_event (event_id, reason, actor)
		SELECT event_id, 'test', 'test' FROM outbox.event WHERE aggregate_key = 'c' AND revision = 3`)
	discover(t, pool)

	got := claimWindow(t, pool, uuid.New(), 10, 3, 100)
	if a := revisions(got, "a"); !slices.Equal(a, []int64{1, 2, 3}) {
		t.Errorf("a leased %v with a window of 3; want [1 2 3]", a)
	}
	if c := revisions(got, "c"); !slices.Equal(c, []int64{1, 2}) {
		t.Errorf("c leased %v with revision 3 skipped; want [1 2]", c)
	}
	if n := count(t, pool, `SELECT leased_through FROM outbox.delivery WHERE aggregate_key = 'a'`); n != 3 {
		t.Errorf("a leased through %d, want 3", n)
	}
	if n := count(t, pool, `SELECT leased_through FROM outbox.delivery WHERE aggregate_key = 'c'`); n != 2 {
		t.Errorf("c leased through %d, want 2", n)
	}
}

// A nacked aggregate backs off: no claim takes it before its next attempt,
// with a bound on due times (p_max_due) or without, and the claim probe
// says when it will be claimable rather than that it is. Once the next
// attempt has come, a claim takes it again, as the event's second attempt.
func TestABackingOffAggregateWaitsForItsNextAttempt(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	emitN(t, pool, "k", 1)
	discover(t, pool)
	l := claimAs(t, pool, uuid.New(), "x")
	exec(t, pool, fmt.Sprintf(`SELECT * FROM outbox.nack('%s', %d, 'broker down', interval '1 hour', interval '1 hour', interval '1 hour', 10)`,
		l.id, l.epoch))
	if n := count(t, pool, `SELECT count(*) FROM outbox.delivery WHERE state = 'backoff' AND claimable_at > now() + interval '59 minutes'`); n != 1 {
		t.Fatal("the nack did not back the aggregate off for an hour")
	}
	for _, maxDue := range []string{"NULL", "interval '2 hours'"} {
		if got := claimWindow(t, pool, uuid.New(), 10, 1, 10); len(got) != 0 {
			t.Fatalf("claimed %v while it backs off", got)
		}
		if n := count(t, pool, `SELECT count(*) FROM outbox.claim(gen_random_uuid(), 'r', 'x', '{orders}', 10, interval '30 seconds',
			NULL, NULL, 1, 10, `+maxDue+`)`); n != 0 {
			t.Fatalf("max_due %s: claimed %d while it backs off", maxDue, n)
		}
		if n := count(t, pool, `SELECT count(*) FROM outbox.probe_claims(NULL, NULL, `+maxDue+`) p
			WHERE p.oldest IS NULL AND p.next_at > now() + interval '59 minutes'`); n != 1 {
			t.Fatalf("max_due %s: the probe does not say the aggregate is claimable in an hour", maxDue)
		}
	}
	// The next attempt comes.
	exec(t, pool, `UPDATE outbox.delivery SET claimable_at = now() - interval '1 second', next_attempt_at = now() - interval '1 second'`)
	if n := count(t, pool, `SELECT count(*) FROM outbox.claim(gen_random_uuid(), 'r', 'x', NULL, 10, interval '30 seconds')
		WHERE aggregate_key = 'k' AND revision = 1 AND attempt = 2`); n != 1 {
		t.Fatal("the aggregate was not claimed again, as its second attempt, once its next attempt came")
	}
}

// A claim that locked some of its first candidates and reads further to
// get past those another transaction holds leases exactly as many
// aggregates as it asks for, each once: the ones it locked first, then
// the next oldest past the locked ones, never more than its limit.
// (TestClaimWalksPastLockedAggregates has every first candidate locked
// elsewhere, so its second pass starts from nothing.)
func TestAClaimReadingFurtherLeasesUpToItsLimitEachOnce(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	for i := range 8 {
		emitIn(t, pool, "orders", fmt.Sprintf("k%d", i), 1)
	}
	discover(t, pool)
	ctx := t.Context()
	other, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = other.Rollback(context.WithoutCancel(ctx)) }()
	// Two of the four oldest, as a concurrent claim would hold them.
	if _, err := other.Exec(ctx, `SELECT 1 FROM outbox.delivery WHERE aggregate_key IN ('k0', 'k1') FOR UPDATE`); err != nil {
		t.Fatal(err)
	}
	got, _ := claimIndexReads(t, pool,
		`SELECT aggregate_key FROM outbox.claim($1, 'r', 'x', '{orders}', 4, interval '30 seconds', NULL, NULL, 1, 4, interval '1 hour')
		 ORDER BY aggregate_key`, uuid.New())
	if want := "[k2 k3 k4 k5]"; fmt.Sprint(got) != want {
		t.Fatalf("claimed %v with k0 and k1 locked elsewhere; want %s", got, want)
	}
}

// Claims go oldest first across streams: with one candidate per stream in
// hand, a claim of one leases the oldest stream's aggregate, then the
// next. (Within one stream a claim reads its candidates oldest first
// anyway, which hides an order turned around among the candidates.)
func TestClaimsGoOldestFirstAcrossStreams(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	// Each in its own transaction, so each has a later created_at; the
	// streams sort opposite to their age.
	for _, stream := range []string{"s3", "s2", "s1"} {
		emitIn(t, pool, stream, "k", 1)
	}
	discover(t, pool)
	for _, want := range []string{"s3", "s2", "s1"} {
		got, _ := claimIndexReads(t, pool,
			`SELECT stream FROM outbox.claim($1, 'r', 'x', NULL, 1, interval '30 seconds', NULL, NULL, 1, 1, interval '1 hour')`, uuid.New())
		if fmt.Sprint(got) != "["+want+"]" {
			t.Fatalf("claimed %v, want the oldest claimable, %s", got, want)
		}
		// claimIndexReads rolls its claim back: lease it for real.
		exec(t, pool, `SELECT * FROM outbox.claim(gen_random_uuid(), 'r', 'x', '{`+want+`}', 1, interval '30 seconds')`)
	}
}
