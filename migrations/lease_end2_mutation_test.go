package migrations_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxd/outboxd/internal/testdb"
)

// Tests written against mutants of the functions that end, extend or
// record the failure of a lease (nack, park, extend_lease, release,
// record_expired, trim_attempts, continue_attempts, stall_reason) that the
// other tests, lease_end_mutation_test.go's included, let through: each
// holds one promise of those functions.

// A claim records an unanswered end only for a lease of the event it is
// about to lease again, the aggregate's next one: an aggregate a republish
// rewound still names (leased_event_id) the later event its last lease,
// since released, was of, and with one attempt per event its claim leases
// the rewound revision with nothing more on record, not a park of that
// later event. (The rewind is Store.Republish's update of the row.) Kills
// a record_expired that takes the lease's event whatever its revision
// (X07).
func TestAClaimAfterARewindRecordsNothingOfTheEventLeasedBefore(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pool := testdb.NewPool(t)
	emitN(t, pool, "a", 2)
	discover(t, pool)
	first := claimFor(t, pool, uuid.New())
	if first.revision != 1 {
		t.Fatalf("claimed %+v, want revision 1", first)
	}
	if n := count(t, pool, fmt.Sprintf(`SELECT count(*) FROM outbox.ack(ARRAY['%s'::uuid], 'x') WHERE status = 'published'`, first.id)); n != 1 {
		t.Fatal("the ack of a/1 did not publish it")
	}
	holder := uuid.New()
	if second := claimFor(t, pool, holder); second.revision != 2 {
		t.Fatalf("claimed %+v, want revision 2", second)
	}
	if n := count(t, pool, fmt.Sprintf(`SELECT outbox.release('%s')`, holder)); n != 1 {
		t.Fatalf("released %d leases, want a/2's", n)
	}
	// Republish a/1: the rewind of Store.Republish (without its mark).
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	for _, q := range []string{
		`SELECT set_config('outbox.republishing', 'on', true)`,
		`UPDATE outbox.event SET published_at = NULL WHERE stream = 'orders' AND aggregate_key = 'a' AND revision = 1`,
		`SELECT set_config('outbox.republishing', 'off', true)`,
		`UPDATE outbox.delivery d
		 SET delivered_revision = 0, state = 'ready', claimable_at = x.created_at, pending_since = x.created_at,
		     holder = NULL, holder_relay_id = NULL, holder_replica_id = NULL, lease_expires_at = NULL,
		     attempt = 0, failures = 0, unanswered = 0, last_error = NULL, next_attempt_at = NULL,
		     parked_at = NULL, parked_reason = NULL, gap_revision = NULL
		 FROM (SELECT min(e.created_at) AS created_at FROM outbox.event e
		       WHERE e.stream = 'orders' AND e.aggregate_key = 'a' AND e.revision >= 1) x
		 WHERE d.stream = 'orders' AND d.aggregate_key = 'a'`,
	} {
		if _, err := tx.Exec(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	var rev int64
	if err := pool.QueryRow(ctx, `SELECT revision FROM outbox.claim(gen_random_uuid(), 'r', 'x', NULL, 1, interval '1 minute', 1)`).
		Scan(&rev); err != nil {
		t.Fatal(err)
	}
	if rev != 1 {
		t.Fatalf("the claim after the rewind leased revision %d, want 1", rev)
	}
	got := attempts(t, pool)
	if len(got) != 1 || got[0].revision != 2 || got[0].outcome != "released" {
		t.Fatalf("attempt history %+v, want only a/2's release", got)
	}
}

// A nack that parks says when and where: the aggregate is parked at the
// event it nacked (parked_revision, the revision parked at), since the
// moment of the nack (parked_at, which the dead-letter list and
// GetAggregate show), out of claims, with no next attempt and no lease
// left on it. Kills a parking nack that leaves parked_at unset (N17) or
// parks at the cursor rather than at the nacked revision (N16).
func TestANackThatParksSaysWhenAndWhere(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pool := testdb.NewPool(t)
	emitN(t, pool, "a", 2)
	discover(t, pool)
	first := claimFor(t, pool, uuid.New())
	if n := count(t, pool, fmt.Sprintf(`SELECT count(*) FROM outbox.ack(ARRAY['%s'::uuid], 'x') WHERE status = 'published'`, first.id)); n != 1 {
		t.Fatal("the ack of a/1 did not publish it")
	}
	l := claimFor(t, pool, uuid.New())
	if l.revision != 2 {
		t.Fatalf("claimed %+v, want revision 2", l)
	}
	var before, after time.Time
	var parked bool
	if err := pool.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&before); err != nil {
		t.Fatal(err)
	}
	if err := pool.QueryRow(ctx, `SELECT parked FROM outbox.nack($1, $2, 'rejected', NULL, interval '1 second', interval '1 minute', 1)`,
		l.id, l.epoch).Scan(&parked); err != nil {
		t.Fatal(err)
	}
	if err := pool.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&after); err != nil {
		t.Fatal(err)
	}
	if !parked {
		t.Fatal("a first failure of at most 1 did not park")
	}
	r := readLease(t, pool, "a")
	noHolder(t, "after the nack that parked", r)
	if r.state != "parked" || r.claimable != nil || r.nextAttempt != nil {
		t.Fatalf("after the nack that parked: %+v; want parked, neither claimable nor due", r)
	}
	if r.parkedAt == nil || r.parkedAt.Before(before) || r.parkedAt.After(after) {
		t.Fatalf("parked at %v, want between %v and %v (the nack)", r.parkedAt, before, after)
	}
	if r.parkedRevision == nil || *r.parkedRevision != 2 {
		t.Fatalf("parked at revision %v, want 2 (the nacked event's)", r.parkedRevision)
	}
}

// An event whose leases were given back unanswered as many times as it may
// be delivered parks its aggregate at the claim that would lease it once
// more, and that claim puts the parking on record: outcome parked, the
// message counting every delivery, at the claim's time (the release left
// no expiry). With two attempts per event, a's lease released twice gets
// released, released, parked. Kills a record_expired whose check or insert
// passes over ready aggregates (X01, X02, X11), counts one delivery short
// (X10), says expired (X04) or takes the released lease's missing expiry
// for the time (X12).
func TestALeaseReleasedUntilTheAttemptsRunOutIsRecordedAsTheParking(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pool := testdb.NewPool(t)
	emitN(t, pool, "a", 1)
	discover(t, pool)
	for i := 0; i < 2; i++ {
		holder := uuid.New()
		if n := count(t, pool, fmt.Sprintf(`SELECT count(*) FROM outbox.claim('%s', 'r', 'x', NULL, 1, interval '1 minute', 2)`, holder)); n != 1 {
			t.Fatalf("claim %d leased %d, want a/1", i+1, n)
		}
		if n := count(t, pool, fmt.Sprintf(`SELECT outbox.release('%s')`, holder)); n != 1 {
			t.Fatalf("release %d gave back %d leases, want a/1's", i+1, n)
		}
	}
	var before, after time.Time
	if err := pool.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&before); err != nil {
		t.Fatal(err)
	}
	if n := count(t, pool, `SELECT count(*) FROM outbox.claim(gen_random_uuid(), 'r', 'x', NULL, 1, interval '1 minute', 2)`); n != 0 {
		t.Fatalf("the third claim leased %d, want a parked instead", n)
	}
	if err := pool.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&after); err != nil {
		t.Fatal(err)
	}
	if r := readLease(t, pool, "a"); r.state != "parked" {
		t.Fatalf("a is %s after the third claim, want parked", r.state)
	}
	got := attempts(t, pool)
	var outcomes []string
	for _, g := range got {
		outcomes = append(outcomes, g.outcome)
	}
	if len(got) != 3 || outcomes[0] != "released" || outcomes[1] != "released" || outcomes[2] != "parked" {
		t.Fatalf("attempt history %v, want released, released, parked", outcomes)
	}
	want := "delivered 2 times without an ack or a nack: each lease expired or the stream holding it ended"
	if p := got[2]; p.revision != 1 || p.attempt != 2 || p.errText != want {
		t.Fatalf("parking on record as %+v, want a/1's attempt 2 with %q", p, want)
	}
	var at time.Time
	if err := pool.QueryRow(ctx, `SELECT at FROM outbox.attempt WHERE outcome = 'parked'`).Scan(&at); err != nil {
		t.Fatal(err)
	}
	if at.Before(before) || at.After(after) {
		t.Fatalf("parking on record at %v, want the claim's time, between %v and %v", at, before, after)
	}
}

// A claim records nothing of a lease an operator's skip ended: the skip
// abandons the event (the aggregate made ready, every count reset, as
// Store.SkipEvent does), and with one attempt per event the claim steps
// over it to the next revision with no parking of the skipped event on
// record. Kills a record_expired that records skipped events (X08).
func TestAClaimRecordsNothingOfASkippedEvent(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	emitN(t, pool, "a", 2)
	discover(t, pool)
	l := claimFor(t, pool, uuid.New())
	exec(t, pool, fmt.Sprintf(`INSERT INTO outbox.skipped_event (event_id, reason, actor) VALUES ('%s', 'test', 'test')`, l.id))
	exec(t, pool, `UPDATE outbox.delivery
		SET state = 'ready', claimable_at = clock_timestamp(),
		    holder = NULL, holder_relay_id = NULL, holder_replica_id = NULL, lease_expires_at = NULL,
		    attempt = 0, failures = 0, unanswered = 0, last_error = NULL, next_attempt_at = NULL, parked_at = NULL, parked_reason = NULL
		WHERE stream = 'orders' AND aggregate_key = 'a'`)
	var rev int64
	if err := pool.QueryRow(testContext(t), `SELECT revision FROM outbox.claim(gen_random_uuid(), 'r', 'x', NULL, 1, interval '1 minute', 1)`).
		Scan(&rev); err != nil {
		t.Fatal(err)
	}
	if rev != 2 {
		t.Fatalf("the claim after the skip leased revision %d, want 2", rev)
	}
	if got := attempts(t, pool); len(got) != 0 {
		t.Fatalf("attempt history %+v, want none", got)
	}
}

// stall_reason holds each count to its own setting, reached at the count
// itself: with stalls after 2 unanswered deliveries and after 5 failed
// publishes, an aggregate with work in hand (ready, leased or backing off)
// is stalled at 2 unanswered deliveries, not at 1, and at 5 failures, not
// at 4. Kills a stall_reason that passes over any of those states (S01,
// S02, S03), needs one more than the setting (S05, S06) or holds a count
// to the other one's setting (S08, S09).
func TestStallReasonHoldsEachCountToItsOwnSetting(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pool := testdb.NewPool(t)
	exec(t, pool, `UPDATE outbox.settings SET stall_after_unanswered = 2, stall_after_failures = 5`)
	reason := func(state string, unanswered, failures int) string {
		t.Helper()
		var r *string
		if err := pool.QueryRow(ctx, `SELECT outbox.stall_reason($1, $2, $3, 'broker down')`, state, unanswered, failures).Scan(&r); err != nil {
			t.Fatal(err)
		}
		return deref(r)
	}
	for _, state := range []string{"ready", "leased", "backoff"} {
		if got, want := reason(state, 2, 0), "2 deliveries of the next event ended without an ack or a nack"; !strings.HasPrefix(got, want) {
			t.Fatalf("stall reason of a %s aggregate with 2 unanswered deliveries: %q, want %q...", state, got, want)
		}
		if got, want := reason(state, 0, 5), "5 publishes of the next event failed in a row; last error: broker down"; got != want {
			t.Fatalf("stall reason of a %s aggregate with 5 failures: %q, want %q", state, got, want)
		}
		if got := reason(state, 1, 4); got != "" {
			t.Fatalf("stall reason of a %s aggregate with 1 unanswered delivery and 4 failures: %q, want none", state, got)
		}
	}
}

// The backoff keeps doubling with every failure up to its cap, well past a
// few failures: the tenth failure of a publish, with a one-second base and
// a one-hour cap, waits 2^9 seconds less the jitter (256 to 512 seconds),
// not the eighth-failure wait of at most 8 seconds. Kills a nack whose
// exponent stops growing after a few failures (N29).
func TestNackBackoffKeepsDoublingToItsCap(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pool := testdb.NewPool(t)
	emitN(t, pool, "a", 1)
	discover(t, pool)
	l := claimFor(t, pool, uuid.New())
	// Nine publishes of a/1 failed before this lease.
	exec(t, pool, `UPDATE outbox.delivery SET failures = 9 WHERE stream = 'orders' AND aggregate_key = 'a'`)
	var before, next time.Time
	var failures int
	if err := pool.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&before); err != nil {
		t.Fatal(err)
	}
	if err := pool.QueryRow(ctx, `SELECT next_attempt_at, failures FROM outbox.nack($1, $2, 'broker down', NULL, interval '1 second', interval '1 hour', 20)`,
		l.id, l.epoch).Scan(&next, &failures); err != nil {
		t.Fatal(err)
	}
	if wait := next.Sub(before); failures != 10 || wait < 256*time.Second || wait > 513*time.Second {
		t.Fatalf("failure %d waits %v, want the tenth waiting 256s to 512s", failures, wait)
	}
}

// releaseBehindAWindowedAck leases a/1-3 of an aggregate of events events
// to a session as one window, holds the session's ack of a/1 open (which
// slides the window on to a/2-4 when there is an a/4), runs a release of
// the session's leases keeping keep(window) behind it (runBehind), commits
// the ack and returns the window and what the release released.
func releaseBehindAWindowedAck(t *testing.T, pool *pgxpool.Pool, events int, keep func([]leased) []uuid.UUID) (holder uuid.UUID, window []leased, released int64) {
	t.Helper()
	ctx := testContext(t)
	emitN(t, pool, "a", events)
	discover(t, pool)
	holder = uuid.New()
	window = claimWindow(t, pool, holder, 1, 3, 3)
	if r := revisions(window, "a"); len(r) != 3 {
		t.Fatalf("claimed %v, want a/1-3", window)
	}
	ack, ackPID := openWindowedAck(t, pool, []uuid.UUID{window[0].id}, &holder, 3)
	done := runBehind(t, pool, ackPID, func(ctx context.Context, conn *pgxpool.Conn) error {
		return conn.QueryRow(ctx, `SELECT outbox.release($1, $2)`, holder, keep(window)).Scan(&released)
	})
	if err := ack.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	return holder, window, released
}

// A release judges what it keeps by the lease as it is once the row is
// its own: a release keeping a/2 and a/3, the rest of a window whose ack
// of a/1 is on its way, that waits for that ack's lock on a's row keeps
// the lease once the ack commits (it then covers a/2-3, which the session
// sent), rather than give it back by what it was before the ack (a/1-3,
// whose head it was not told to keep). Kills a release that reads its
// leases without locking them, and so never reads them again (R09).
func TestAReleaseWaitingForAnAckJudgesTheLeaseAsTheAckLeftIt(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	holder, _, released := releaseBehindAWindowedAck(t, pool, 3, func(w []leased) []uuid.UUID { return []uuid.UUID{w[1].id, w[2].id} })
	if released != 0 {
		t.Fatalf("released %d leases, want none: after the ack a's lease covers a/2-3, both kept", released)
	}
	if r := readLease(t, pool, "a"); r.state != "leased" || r.holder == nil || *r.holder != holder {
		t.Fatalf("after the ack and the release: %+v, want a still leased to %s", r, holder)
	}
}

// A release gives back a lease that an ack still on its way slides onto
// events the releasing session never saw, as it does once that ack has
// landed (TestReleaseGivesBackAWindowSlidUnseen): a session sweeping its
// orphans after a lost ack answer keeps a/1-3, all it sent, while the ack
// of a/1 (its answer lost) has yet to commit and then slides the lease to
// a/2-4. The release waits for the ack's lock on a's row, judges the lease
// as the ack left it, gives it back, and records the attempt as that lease
// (head a/2), not as the snapshot before the ack had it (a/1, published).
func TestAReleaseGivesBackALeaseAnAckInFlightSlidUnseen(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	holder, w, released := releaseBehindAWindowedAck(t, pool, 4, func(w []leased) []uuid.UUID { return []uuid.UUID{w[0].id, w[1].id, w[2].id} })
	r := readLease(t, pool, "a")
	if released != 1 || (r.holder != nil && *r.holder == holder) {
		t.Fatalf("released %d; a is %+v: the session keeps a lease covering a/4, which it never saw", released, r)
	}
	var last attemptRow
	for _, a := range attempts(t, pool) {
		last = a
	}
	if last.outcome != "released" || last.event != w[1].id || last.revision != 2 {
		t.Fatalf("last attempt %+v, want a/2 released (the head the ack slid the lease to)", last)
	}
}

// The attempt history is kept per aggregate, and an aggregate is its
// stream and key: with one attempt kept per aggregate, a release of
// payments/a leaves the attempt of orders/a on record. Kills a trim that
// counts the attempts of every stream's aggregate of the same key together
// (T05).
func TestAttemptHistoryIsTrimmedPerStreamsAggregate(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	exec(t, pool, `UPDATE outbox.settings SET attempt_history_per_aggregate = 1`)
	emitIn(t, pool, "orders", "a", 1)
	emitIn(t, pool, "payments", "a", 1)
	discover(t, pool)
	for _, stream := range []string{"orders", "payments"} {
		holder := uuid.New()
		if n := count(t, pool, fmt.Sprintf(`SELECT count(*) FROM outbox.claim('%s', 'r', 'x', '{%s}', 1, interval '1 minute')`, holder, stream)); n != 1 {
			t.Fatalf("claimed %d of %s/a, want 1", n, stream)
		}
		if n := count(t, pool, fmt.Sprintf(`SELECT outbox.release('%s')`, holder)); n != 1 {
			t.Fatalf("released %d leases, want %s/a's", n, stream)
		}
	}
	for _, stream := range []string{"orders", "payments"} {
		if n := count(t, pool, fmt.Sprintf(`SELECT count(*) FROM outbox.attempt WHERE stream = '%s' AND aggregate_key = 'a'`, stream)); n != 1 {
			t.Fatalf("%d attempts of %s/a on record, want its release", n, stream)
		}
	}
}

// republishOne rewinds key's aggregate, whose only event (revision 1) was
// published, as Store.Republish does: an operator action, the event
// pending again, the delivery row ready at revision 1 and marked
// (republished_through), and the republish on record with the event's
// earlier deliveries.
func republishOne(t *testing.T, pool *pgxpool.Pool, key string, earlier int) {
	t.Helper()
	exec(t, pool, fmt.Sprintf(`DO $$
	DECLARE
	    v_action bigint;
	    v_event uuid;
	BEGIN
	    INSERT INTO outbox.operator_action (action, actor, reason, request) VALUES ('republish', 'test', 'test', '{}')
	    RETURNING action_id INTO v_action;
	    SELECT event_id INTO v_event FROM outbox.event WHERE stream = 'orders' AND aggregate_key = '%[1]s' AND revision = 1;
	    PERFORM set_config('outbox.republishing', 'on', true);
	    UPDATE outbox.event SET published_at = NULL WHERE event_id = v_event;
	    PERFORM set_config('outbox.republishing', 'off', true);
	    UPDATE outbox.delivery d
	    SET delivered_revision = 0, state = 'ready', claimable_at = e.created_at, pending_since = e.created_at,
	        holder = NULL, holder_relay_id = NULL, holder_replica_id = NULL, lease_expires_at = NULL,
	        attempt = 0, failures = 0, unanswered = 0, last_error = NULL, next_attempt_at = NULL,
	        parked_at = NULL, parked_reason = NULL, gap_revision = NULL, republished_through = 1
	    FROM outbox.event e
	    WHERE e.event_id = v_event AND d.stream = 'orders' AND d.aggregate_key = '%[1]s';
	    INSERT INTO outbox.republished (action_id, stream, aggregate_key, from_revision, to_revision, events,
	                                    previous_published_at, earlier_attempts)
	    VALUES (v_action, 'orders', '%[1]s', 1, 1, 1, '{}', jsonb_build_object(v_event::text, %[2]d));
	END $$`, key, earlier))
}

// The first lease of a republished event continues the numbers of its
// earlier deliveries, from its own aggregate's republish: a/1, delivered
// once before, is delivered again as attempt 2 though b's republish came
// after a's. And the mark goes once delivery leases a revision past the
// republished ones: a's next event, a/2, is attempt 1 and leaves a's row
// unmarked. Kills a continue_attempts that reads the stream's newest
// republish whatever its aggregate (C06) or never clears the mark (C02).
func TestARepublishedEventContinuesItsOwnAttempts(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pool := testdb.NewPool(t)
	emitN(t, pool, "a", 1)
	emitN(t, pool, "b", 1)
	discover(t, pool)
	for i := 0; i < 2; i++ {
		l := claimFor(t, pool, uuid.New())
		if n := count(t, pool, fmt.Sprintf(`SELECT count(*) FROM outbox.ack(ARRAY['%s'::uuid], 'x') WHERE status = 'published'`, l.id)); n != 1 {
			t.Fatalf("the ack of %s/1 did not publish it", l.key)
		}
	}
	republishOne(t, pool, "a", 1)
	republishOne(t, pool, "b", 1)
	attemptOf := func(key string) (int64, int) {
		t.Helper()
		var rev int64
		var attempt int
		if err := pool.QueryRow(ctx, `SELECT revision, attempt FROM outbox.claim(gen_random_uuid(), 'r', 'x', NULL, 2, interval '1 minute')
			WHERE aggregate_key = $1`, key).Scan(&rev, &attempt); err != nil {
			t.Fatal(err)
		}
		return rev, attempt
	}
	if rev, attempt := attemptOf("a"); rev != 1 || attempt != 2 {
		t.Fatalf("a/%d delivered again as attempt %d, want a/1 as attempt 2", rev, attempt)
	}
	id := eventID(t, pool, "a", 1)
	if n := count(t, pool, fmt.Sprintf(`SELECT count(*) FROM outbox.ack(ARRAY['%s'::uuid], 'x') WHERE status = 'published'`, id)); n != 1 {
		t.Fatal("the ack of the republished a/1 did not publish it")
	}
	emitN(t, pool, "a", 1)
	discover(t, pool)
	if rev, attempt := attemptOf("a"); rev != 2 || attempt != 1 {
		t.Fatalf("a/%d delivered as attempt %d, want a/2 as attempt 1", rev, attempt)
	}
	if n := count(t, pool, `SELECT count(*) FROM outbox.delivery WHERE aggregate_key = 'a' AND republished_through IS NOT NULL`); n != 0 {
		t.Fatal("a's row still carries the republish mark after a lease of a/2")
	}
}
