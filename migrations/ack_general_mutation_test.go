package migrations_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxd/outboxd/internal/testdb"
)

// Tests added by the mutation sweep of outbox.ack's general (windowed)
// path and of its per-item answers: each pins down a decision that no
// other test held.

// ackAnswers acks ids as replica x with the hand-over arguments given
// (nil for none) and returns every row the call answered other than
// hand-overs, as "id status", and the hand-overs' revisions, in the order
// the call returned them.
func ackAnswers(t *testing.T, pool *pgxpool.Pool, ids []uuid.UUID, holders []uuid.UUID, windows, credits []int32) (answers []string, handed []int64) {
	t.Helper()
	rows, err := pool.Query(testContext(t), `SELECT a.event_id, a.status, (a.handover).revision
		FROM outbox.ack($1, 'x', $2, CASE WHEN $2::uuid[] IS NOT NULL THEN ARRAY[interval '30 seconds'] END, $3, $4) a`,
		ids, holders, windows, credits)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id uuid.UUID
		var st string
		var rev *int64
		if err := rows.Scan(&id, &st, &rev); err != nil {
			t.Fatal(err)
		}
		if st == "handed_over" {
			handed = append(handed, *rev)
			continue
		}
		answers = append(answers, fmt.Sprintf("%s %s", id, st))
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return answers, handed
}

// A session that lends no credit (its credits not passed) is handed over
// no more events than its acks free, whatever window it takes: the ack of
// a/1 by a session taking windows of 3 leases it a/2 alone, though a/2 to
// a/4 are there. Kills a missing credit read as one to lend.
func TestAWindowedAckHandsOverOnlyWhatItsAcksFreeWithoutCredit(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	h := uuid.New()
	emitN(t, pool, "a", 4)
	discover(t, pool)
	a1 := claimAlone(t, pool, h, "a", 1)
	answers, handed := ackAnswers(t, pool, []uuid.UUID{a1.id}, []uuid.UUID{h}, []int32{3}, nil)
	if len(answers) != 1 || answers[0] != a1.id.String()+" published" {
		t.Fatalf("ack of a/1 answered %v, want it published", answers)
	}
	if fmt.Sprint(handed) != "[2]" {
		t.Fatalf("ack of a/1 without credit handed over revisions %v, want [2]: one event for the one ack", handed)
	}
}

// Every id of a call is answered once, however often the call lists it:
// an unknown id listed twice answers one not_found, next to the one
// published answer of an event listed twice. Kills the answers of the
// failed ids read without DISTINCT (a relay would count two answers for
// one ack).
func TestAnAckListingAnIDTwiceAnswersItOnce(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	emitN(t, pool, "a", 1)
	discover(t, pool)
	l := claimFor(t, pool, uuid.New())
	unknown := uuid.New()
	answers, _ := ackAnswers(t, pool, []uuid.UUID{l.id, unknown, l.id, unknown}, nil, nil, nil)
	want := fmt.Sprint([]string{l.id.String() + " published", unknown.String() + " not_found"})
	if fmt.Sprint(answers) != want {
		t.Fatalf("ack of a/1 and an unknown id, each listed twice, answered %v, want %s", answers, want)
	}
}

// An event that exists and is pending, though the call did not lock it
// (it was committed after the call read the events), answers lease_lost,
// never not_found: it is there, and a relay told not_found would take it
// for purged. The call acks x (a/1) and y, whose emit is still in its
// transaction when the call locks the events; the call then waits for a's
// delivery row, which the test holds, while y commits; the answers read y
// as it is then. Kills y answered not_found.
func TestAnAckOfAnEventCommittedAfterItsLocksAnswersLeaseLost(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pool := testdb.NewPoolConfig(t, func(c *pgxpool.Config) { c.MaxConns = 6 })
	emitN(t, pool, "a", 1)
	discover(t, pool)
	x := eventID(t, pool, "a", 1)
	y := uuid.New()

	emit, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer emit.Rollback(ctx)
	if _, err := emit.Exec(ctx, `SELECT outbox.emit('orders', 'b', 'T', '{}', event_id => $1)`, y); err != nil {
		t.Fatal(err)
	}
	row, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer row.Rollback(ctx)
	rowPID := backendPID(t, row)
	if _, err := row.Exec(ctx, `SELECT 1 FROM outbox.delivery WHERE aggregate_key = 'a' FOR UPDATE`); err != nil {
		t.Fatal(err)
	}

	var answers []string
	done := runBehind(t, pool, rowPID, func(ctx context.Context, conn *pgxpool.Conn) error {
		rows, err := conn.Query(ctx, `SELECT event_id::text || ' ' || status FROM outbox.ack($1, 'x')`, []uuid.UUID{x, y})
		if err != nil {
			return err
		}
		answers, err = pgx.CollectRows(rows, pgx.RowTo[string])
		return err
	})
	if err := emit.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := row.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	await(t, done)
	want := fmt.Sprint([]string{x.String() + " published", y.String() + " lease_lost"})
	if fmt.Sprint(answers) != want {
		t.Fatalf("ack of a/1 and of an event committed while the ack waited answered %v, want %s", answers, want)
	}
}

// windowRow is what a delivery row says about a windowed lease.
type windowRow struct {
	state              string
	holder             *uuid.UUID
	relay, replica     *string
	through            *int64
	attempt            int
	epoch              int64
	claimableIsExpires bool
}

func readWindow(t *testing.T, pool *pgxpool.Pool, key string) windowRow {
	t.Helper()
	var r windowRow
	if err := pool.QueryRow(testContext(t), `SELECT state, holder, holder_relay_id, holder_replica_id, leased_through,
		       attempt, epoch, claimable_at IS NOT DISTINCT FROM lease_expires_at
		FROM outbox.delivery WHERE stream = 'orders' AND aggregate_key = $1`, key).
		Scan(&r.state, &r.holder, &r.relay, &r.replica, &r.through, &r.attempt, &r.epoch, &r.claimableIsExpires); err != nil {
		t.Fatal(err)
	}
	return r
}

// A lease whose window reaches past the acked revisions goes on as the
// lease it was: same holder, relay and replica (the next ack, from this
// replica, must not take it for another replica's lease), same epoch and
// attempt (a lease given again after it expired stays on its second
// attempt as it slides), still claimable only when it expires; whether the
// ack slides it forward (a/4 there) or not (nothing after a/3). Another
// session's claim then finds nothing. Kills a continuing lease that loses
// its replica or its attempt, or is made claimable from its next event's
// creation.
func TestAWindowThatGoesOnKeepsItsLease(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	ctx := testContext(t)
	h := uuid.New()
	emitN(t, pool, "a", 4)
	discover(t, pool)
	// A first lease of a/1-a/3 that expires at once, then the same window
	// claimed again: its second attempt.
	if _, err := pool.Exec(ctx, `SELECT * FROM outbox.claim($1, 'r', 'x', NULL, 1, interval '-1 second', NULL, NULL, 3, 3)`, h); err != nil {
		t.Fatal(err)
	}
	ls := claimWindow(t, pool, h, 1, 3, 3)
	if r := revisions(ls, "a"); fmt.Sprint(r) != "[1 2 3]" {
		t.Fatalf("claimed %v again, want a/1-a/3", ls)
	}
	before := readWindow(t, pool, "a")
	if before.state != "leased" || before.attempt != 2 || !before.claimableIsExpires || deref(before.replica) != "x" {
		t.Fatalf("the lease claimed again: %+v, want leased on its second attempt, replica x, claimable when it expires", before)
	}
	check := func(what string, through int64) {
		t.Helper()
		got := readWindow(t, pool, "a")
		if got.state != "leased" || deref(got.holder) != h || deref(got.relay) != "r" || deref(got.replica) != "x" ||
			deref(got.through) != through || got.attempt != before.attempt || got.epoch != before.epoch || !got.claimableIsExpires {
			t.Fatalf("%s: %+v (holder %v, relay %v, replica %v, through %v); want leased by %v of r on x through %d, attempt %d, epoch %d, claimable when it expires",
				what, got, deref(got.holder), deref(got.relay), deref(got.replica), deref(got.through), h, through, before.attempt, before.epoch)
		}
	}
	st, handed := ackWindow(t, pool, []uuid.UUID{ls[0].id}, h, 3, 0)
	if st[ls[0].id] != "published" || fmt.Sprint(revisions(handed, "a")) != "[4]" {
		t.Fatalf("ack of a/1: %v, handed %v; want published, a/4 handed over", st, handed)
	}
	check("after the ack of a/1, which slid the window to a/4", 4)
	st, handed = ackWindow(t, pool, []uuid.UUID{ls[1].id}, h, 3, 0)
	if st[ls[1].id] != "published" || len(handed) != 0 {
		t.Fatalf("ack of a/2: %v, handed %v; want published, nothing handed over", st, handed)
	}
	check("after the ack of a/2, with nothing to slide onto", 4)
	if got := claimWindow(t, pool, uuid.New(), 1, 1, 1); len(got) != 0 {
		t.Fatalf("another session claimed %v from a lease that goes on", got)
	}
}

// A hand-over names the ack it continues: the last of its aggregate's acks
// in the call (the session sends it on behind that one). The ack of a/1
// and a/2, a window of 2 with a/3 and a/4 there, hands a/3 and a/4 over,
// each naming a/2. Kills the first ack named.
func TestAHandOverNamesItsAggregatesLastAck(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	h := uuid.New()
	emitN(t, pool, "a", 4)
	discover(t, pool)
	ls := claimWindow(t, pool, h, 1, 2, 2)
	if r := revisions(ls, "a"); fmt.Sprint(r) != "[1 2]" {
		t.Fatalf("claimed %v, want a/1 and a/2", ls)
	}
	rows, err := pool.Query(testContext(t), `SELECT a.event_id, (a.handover).revision
		FROM outbox.ack($1, 'x', ARRAY[$2::uuid], ARRAY[interval '30 seconds'], ARRAY[2], ARRAY[0]) a
		WHERE a.status = 'handed_over'`, []uuid.UUID{ls[0].id, ls[1].id}, h)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for rows.Next() {
		var by uuid.UUID
		var rev int64
		if err := rows.Scan(&by, &rev); err != nil {
			t.Fatal(err)
		}
		got = append(got, fmt.Sprintf("a/%d by %s", rev, by))
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	want := fmt.Sprint([]string{"a/3 by " + ls[1].id.String(), "a/4 by " + ls[1].id.String()})
	if fmt.Sprint(got) != want {
		t.Fatalf("the ack of a/1 and a/2 handed over %v, want %s (a/2 the last ack)", got, want)
	}
}

// A windowed hand-over keeps the claim order only against older work: b/1,
// claimable but younger than a/2, comes after a/2 in the claim order, so
// the ack of a/1 by a session taking windows of 2 hands a/2 over (the
// one-row path's "younger work claimable" case, on the windowed path).
// Kills the claim order judged against the clock alone, which any
// claimable work, however young, would hold back.
func TestAWindowedHandOverGoesAheadOfYoungerWork(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	h := uuid.New()
	emitN(t, pool, "a", 2)
	emitN(t, pool, "b", 1)
	discover(t, pool)
	a1 := claimAlone(t, pool, h, "a", 1)
	st, handed := ackWindow(t, pool, []uuid.UUID{a1.id}, h, 2, 0)
	if st[a1.id] != "published" || fmt.Sprint(revisions(handed, "a")) != "[2]" {
		t.Fatalf("ack of a/1 with only younger b/1 claimable: %v, handed %v; want published, a/2 handed over", st, handed)
	}
}

// A windowed hand-over covers the next revisions only while they are
// there and not skipped, and never more than the window: with a/3 skipped
// the ack of a/1 (windows of 3, credit to spare) hands a/2 alone; with b/3
// missing (b/4 there) the ack of b/1 hands b/2 alone; the ack of c/1
// (windows of 2, credit to spare, c/2-c/5 there) hands c/2 and c/3, and
// the ack of c/2 then slides the window by one, to c/4. Kills skipped
// revisions counted in the window, a window not stopped at the first
// revision missing or skipped, a window one wider than asked, and a slide
// one wider than the acks free.
func TestAWindowedHandOverStopsAtASkipAGapAndTheWindow(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	h := uuid.New()
	emitN(t, pool, "a", 4)
	emitN(t, pool, "b", 2)
	exec(t, pool, `INSERT INTO outbox.event (stream, aggregate_key, revision, event_type, payload) VALUES ('orders', 'b', 4, 'T', '{}')`)
	emitN(t, pool, "c", 5)
	exec(t, pool, `INSERT INTO outbox.skipped_event (event_id, reason, actor)
		SELECT event_id, 'test', 'test' FROM outbox.event WHERE aggregate_key = 'a' AND revision = 3`)
	discover(t, pool)
	ls := claimWindow(t, pool, h, 3, 1, 3)
	heads := map[string]uuid.UUID{}
	for _, l := range ls {
		heads[l.key] = l.id
	}
	if len(ls) != 3 || len(heads) != 3 {
		t.Fatalf("claimed %v, want a/1, b/1 and c/1", ls)
	}
	for _, c := range []struct {
		key, want string
		window    int
	}{{"a", "[2]", 3}, {"b", "[2]", 3}, {"c", "[2 3]", 2}} {
		_, handed := ackWindow(t, pool, []uuid.UUID{heads[c.key]}, h, c.window, 10)
		if got := fmt.Sprint(revisions(handed, c.key)); got != c.want || len(handed) != len(revisions(handed, c.key)) {
			t.Fatalf("ack of %s/1 (windows of %d) handed over %v, want %s/%s", c.key, c.window, handed, c.key, c.want)
		}
	}
	_, handed := ackWindow(t, pool, []uuid.UUID{eventID(t, pool, "c", 2)}, h, 2, 10)
	if got := fmt.Sprint(revisions(handed, "c")); got != "[4]" || len(handed) != 1 {
		t.Fatalf("ack of c/2 (a window of 2 through c/3) handed over %v, want c/4 alone", handed)
	}
	if n := count(t, pool, `SELECT leased_through FROM outbox.delivery WHERE aggregate_key = 'c'`); n != 4 {
		t.Fatalf("c leased through %d, want 4", n)
	}
}

// What a holder's acks free is shared over all of its aggregates in the
// call: the ack of a/1 (nothing after it) and b/1 (b/2 and b/3 there), by
// a session taking windows of 2 and lending nothing, hands b/2 and b/3
// over, a's freed unit going to b. Kills the credit counted per aggregate.
func TestAWindowedAckSharesWhatItFreesOverTheHoldersAggregates(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	h := uuid.New()
	emitN(t, pool, "a", 1)
	emitN(t, pool, "b", 3)
	discover(t, pool)
	ls := claimWindow(t, pool, h, 2, 1, 2)
	if len(ls) != 2 || ls[0].revision != 1 || ls[1].revision != 1 {
		t.Fatalf("claimed %v, want a/1 and b/1", ls)
	}
	_, handed := ackWindow(t, pool, []uuid.UUID{ls[0].id, ls[1].id}, h, 2, 0)
	if got := fmt.Sprint(revisions(handed, "b")); got != "[2 3]" || len(handed) != 2 {
		t.Fatalf("ack of a/1 and b/1 handed over %v, want b/2 and b/3", handed)
	}
}

// A windowed ack hands nothing over past a next revision that is skipped
// or missing, and leaves the aggregate ready for a claim once the revision
// after it is there: a/2 skipped (a/3 there), b/2 missing (b/3 there),
// each a/1 and b/1 acked by a session taking windows of 1 with credit to
// lend (the windowed path). Kills a skipped next revision handed over, and
// a revision after a missing one not seen (the aggregate left idle, which
// no claim takes).
func TestAWindowedAckLeavesAnAggregateReadyBehindASkipOrAGap(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	h := uuid.New()
	emitN(t, pool, "a", 3)
	emitN(t, pool, "b", 1)
	exec(t, pool, `INSERT INTO outbox.event (stream, aggregate_key, revision, event_type, payload) VALUES ('orders', 'b', 3, 'T', '{}')`)
	exec(t, pool, `INSERT INTO outbox.skipped_event (event_id, reason, actor)
		SELECT event_id, 'test', 'test' FROM outbox.event WHERE aggregate_key = 'a' AND revision = 2`)
	discover(t, pool)
	ls := claimWindow(t, pool, h, 2, 1, 2)
	if len(ls) != 2 {
		t.Fatalf("claimed %v, want a/1 and b/1", ls)
	}
	st, handed := ackWindow(t, pool, []uuid.UUID{ls[0].id, ls[1].id}, h, 1, 2)
	if st[ls[0].id] != "published" || st[ls[1].id] != "published" || len(handed) != 0 {
		t.Fatalf("ack of a/1 and b/1: %v, handed %v; want both published, nothing handed over", st, handed)
	}
	for _, key := range []string{"a", "b"} {
		if got := readWindow(t, pool, key); got.state != "ready" || got.holder != nil {
			t.Fatalf("%s after the ack: %+v, want ready with no holder", key, got)
		}
	}
}

// A holder handed over as many events as it acked in the call takes the
// credit its acks free with them, so its session does not claim on this
// ack and its hint is not probed: it says "claim" (zero), which misses
// nothing were it read. The ack of a/1 by a session taking windows of 2,
// lending nothing, hands a/2 over; nothing else is claimable, which a
// probe would have said (no hint). Kills the holder probed when it was
// handed exactly what it acked.
func TestAHolderHandedWhatItAckedIsToldToClaim(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	h := uuid.New()
	emitN(t, pool, "a", 2)
	discover(t, pool)
	a1 := claimAlone(t, pool, h, "a", 1)
	rows, err := pool.Query(testContext(t), `SELECT a.status, a.claimable_in::text
		FROM outbox.ack($1, 'x', ARRAY[$2::uuid], ARRAY[interval '30 seconds'], ARRAY[2], ARRAY[0]) a`,
		[]uuid.UUID{a1.id}, h)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for rows.Next() {
		var st string
		var in *string
		if err := rows.Scan(&st, &in); err != nil {
			t.Fatal(err)
		}
		got = append(got, fmt.Sprintf("%s %v", st, deref(in)))
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(got) != "[published 00:00:00 handed_over ]" {
		t.Fatalf("ack of a/1, a/2 handed over, answered %q; want published with a hint of zero (claim), then the hand-over", got)
	}
}
