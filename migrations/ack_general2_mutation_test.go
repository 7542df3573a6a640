package migrations_test

import (
	"context"
	"fmt"
	"slices"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxd/outboxd/internal/testdb"
)

// Tests added by the second mutation sweep of outbox.ack's general
// (windowed) path, its lock-and-judge statement and its per-item answers:
// each pins down a decision that no other test held.

// A lease the general path grants anew, after the lease it ends, is a
// first attempt held by the same relay and replica as the one acked: the
// ack of a/1, leased again after its first lease expired (its second
// attempt), by a session taking windows of 2 with one credit to lend,
// hands a/2 and a/3 over under a new lease on attempt 1, still of relay r
// on replica x. Kills a new grant that keeps the ended lease's attempt
// (M30) and one that drops the holder's relay (M31).
func TestAWindowedAckGrantsAFirstAttemptUnderTheHoldersRelay(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	ctx := testContext(t)
	h := uuid.New()
	emitN(t, pool, "a", 3)
	discover(t, pool)
	if _, err := pool.Exec(ctx, `SELECT * FROM outbox.claim($1, 'r', 'x', NULL, 1, interval '-1 second', NULL, NULL, 1, 1)`, h); err != nil {
		t.Fatal(err)
	}
	a1 := claimAlone(t, pool, h, "a", 1)
	if before := readWindow(t, pool, "a"); before.attempt != 2 {
		t.Fatalf("a/1 claimed again: %+v, want its second attempt", before)
	}
	st, handed := ackWindow(t, pool, []uuid.UUID{a1.id}, h, 2, 1)
	if st[a1.id] != "published" || fmt.Sprint(revisions(handed, "a")) != "[2 3]" {
		t.Fatalf("ack of a/1: %v, handed %v; want published, a/2 and a/3 handed over", st, handed)
	}
	got := readWindow(t, pool, "a")
	if got.state != "leased" || deref(got.holder) != h || deref(got.relay) != "r" || deref(got.replica) != "x" ||
		deref(got.through) != 3 || got.attempt != 1 || !got.claimableIsExpires {
		t.Fatalf("a after the hand-over: %+v (holder %v, relay %v, replica %v, through %v); want leased by %v of r on x through 3, attempt 1",
			got, deref(got.holder), deref(got.relay), deref(got.replica), deref(got.through), h)
	}
}

// What a holder's acks free is shared over its aggregates in key order:
// the ack of a/1 and b/1 (a/2-a/3 and b/2-b/3 there) by a session taking
// windows of 2 and lending nothing frees two units, both a's, the first
// key. Kills the shares handed out in the reverse key order (M23).
func TestAWindowedAckSharesWhatItFreesInKeyOrder(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	h := uuid.New()
	emitN(t, pool, "a", 3)
	emitN(t, pool, "b", 3)
	discover(t, pool)
	ls := claimWindow(t, pool, h, 2, 1, 2)
	if len(ls) != 2 || ls[0].revision != 1 || ls[1].revision != 1 {
		t.Fatalf("claimed %v, want a/1 and b/1", ls)
	}
	_, handed := ackWindow(t, pool, []uuid.UUID{ls[0].id, ls[1].id}, h, 2, 0)
	if got := fmt.Sprint(revisions(handed, "a")); got != "[2 3]" || len(handed) != 2 {
		t.Fatalf("ack of a/1 and b/1 handed over %v, want a/2 and a/3 (a first in key order)", handed)
	}
	if got := readWindow(t, pool, "b"); got.state != "ready" || got.holder != nil {
		t.Fatalf("b after the ack: %+v, want ready with no holder", got)
	}
}

// A lease that goes on keeps its window when the holder's freed credit ran
// out on an earlier aggregate: a session (windows of 3, lending nothing)
// holds b/1-b/2 and a/1; a/2-a/4 and b/3 are there. Its ack of a/1 and
// b/1 frees two units, both taken by a (first in key order, three events
// wanted); b's lease still covers b/2 and must go on through b/2, not be
// cut back by the share a overdrew. Kills the grant not floored at zero
// (M21), which shrinks the going-on lease to b/1.
func TestAWindowThatGoesOnIsNotCutBackWhenItsHolderHasNoCreditLeft(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	h := uuid.New()
	emitN(t, pool, "b", 2)
	discover(t, pool)
	if got := revisions(claimWindow(t, pool, h, 1, 3, 2), "b"); fmt.Sprint(got) != "[1 2]" {
		t.Fatalf("claimed b %v, want b/1 and b/2", got)
	}
	emitN(t, pool, "a", 1)
	discover(t, pool)
	claimAlone(t, pool, h, "a", 1)
	emitN(t, pool, "a", 3)
	emitN(t, pool, "b", 1)
	discover(t, pool)
	a1, b1 := eventID(t, pool, "a", 1), eventID(t, pool, "b", 1)
	st, handed := ackWindow(t, pool, []uuid.UUID{a1, b1}, h, 3, 0)
	if st[a1] != "published" || st[b1] != "published" || fmt.Sprint(revisions(handed, "a")) != "[2 3]" || len(handed) != 2 {
		t.Fatalf("ack of a/1 and b/1: %v, handed %v; want both published, a/2 and a/3 handed over", st, handed)
	}
	if got := readWindow(t, pool, "b"); got.state != "leased" || deref(got.holder) != h || deref(got.through) != 2 {
		t.Fatalf("b after the ack: %+v (through %v), want still leased by %v through b/2", got, deref(got.through), h)
	}
}

// A windowed hand-over keeps the claim order against the first event it
// would hand over, the one the claim order reaches first: b/1 is claimable
// and younger than a/2 but older than a/3, so the ack of a/1 by a session
// taking windows of 2 with credit to lend hands a/2 and a/3 over (a/2 goes
// ahead of b/1 in the claim order, and a/3 comes with it in its window).
// Kills the claim order judged against the window's youngest event (M19).
func TestAWindowedHandOverIsJudgedByItsFirstEvent(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	h := uuid.New()
	emitN(t, pool, "a", 2)
	emitN(t, pool, "b", 1)
	emitN(t, pool, "a", 1)
	discover(t, pool)
	a1 := claimAlone(t, pool, h, "a", 1)
	st, handed := ackWindow(t, pool, []uuid.UUID{a1.id}, h, 2, 1)
	if st[a1.id] != "published" || fmt.Sprint(revisions(handed, "a")) != "[2 3]" || len(handed) != 2 {
		t.Fatalf("ack of a/1 with b/1 (between a/2 and a/3) claimable: %v, handed %v; want published, a/2 and a/3 handed over", st, handed)
	}
}

// A batch locks its events in event id order, as every batch does, so that
// two batches cannot deadlock on them: while the test holds the event with
// the larger id, an ack of both events waits for it holding the smaller
// one already. Kills the events locked in another order (M01).
func TestAnAckBatchLocksItsEventsInIDOrder(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pool := testdb.NewPool(t)
	id := func(n int) uuid.UUID { return uuid.MustParse(fmt.Sprintf("00000000-0000-0000-0000-%012d", n)) }
	for _, e := range []struct {
		key string
		id  uuid.UUID
	}{{"a", id(1)}, {"b", id(2)}} {
		if _, err := pool.Exec(ctx, `SELECT outbox.emit('orders', $1, 'T', '{}', event_id => $2)`, e.key, e.id); err != nil {
			t.Fatal(err)
		}
	}
	discover(t, pool)
	if ls := claimWindow(t, pool, uuid.New(), 2, 1, 2); len(ls) != 2 {
		t.Fatalf("claimed %v, want a/1 and b/1", ls)
	}
	ackLocksFirstWhileItWaits(t, pool, []uuid.UUID{id(2), id(1)},
		fmt.Sprintf(`SELECT 1 FROM outbox.event WHERE event_id = '%s' FOR UPDATE`, id(2)),
		fmt.Sprintf(`SELECT 1 FROM outbox.event WHERE event_id = '%s' FOR UPDATE NOWAIT`, id(1)),
		"the ack waiting for the event with the larger id had not locked the one with the smaller id")
}

// A windowed hand-over yields only to strictly older work, as on the
// one-row path: b/1 and a/2, emitted in one transaction, were created at
// the same instant, so b/1 is not older than a/2 and the ack of a/1 by a
// session taking windows of 2 hands a/2 over. Kills a tie read as older
// work (M20).
func TestAWindowedHandOverGoesAheadOfWorkCreatedWithIt(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	h := uuid.New()
	emitN(t, pool, "a", 1)
	exec(t, pool, `DO $$ BEGIN PERFORM outbox.emit('orders', 'a', 'T', '{}'); PERFORM outbox.emit('orders', 'b', 'T', '{}'); END $$`)
	discover(t, pool)
	if n := count(t, pool, `SELECT count(DISTINCT created_at) FROM outbox.event WHERE (aggregate_key, revision) IN (('a', 2), ('b', 1))`); n != 1 {
		t.Fatalf("a/2 and b/1 were created at %d instants, want one", n)
	}
	a1 := claimAlone(t, pool, h, "a", 1)
	st, handed := ackWindow(t, pool, []uuid.UUID{a1.id}, h, 2, 0)
	if st[a1.id] != "published" || fmt.Sprint(revisions(handed, "a")) != "[2]" || len(handed) != 1 {
		t.Fatalf("ack of a/1 with b/1 as old as a/2 claimable: %v, handed %v; want published, a/2 handed over", st, handed)
	}
}

// A batch locks its aggregates' delivery rows in key order, as every batch
// does, so that two batches cannot deadlock on them: while the test holds
// b's row, an ack of a/1 and b/1 waits for it holding a's row already.
// Kills the rows locked in another order (M02).
func TestAnAckBatchLocksItsDeliveryRowsInKeyOrder(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	emitN(t, pool, "a", 1)
	emitN(t, pool, "b", 1)
	discover(t, pool)
	if ls := claimWindow(t, pool, uuid.New(), 2, 1, 2); len(ls) != 2 {
		t.Fatalf("claimed %v, want a/1 and b/1", ls)
	}
	ackLocksFirstWhileItWaits(t, pool, []uuid.UUID{eventID(t, pool, "b", 1), eventID(t, pool, "a", 1)},
		`SELECT 1 FROM outbox.delivery WHERE aggregate_key = 'b' FOR UPDATE`,
		`SELECT 1 FROM outbox.delivery WHERE aggregate_key = 'a' FOR UPDATE NOWAIT`,
		"the ack waiting for b's delivery row had not locked a's")
}

// ackLocksFirstWhileItWaits holds the row lock of hold, runs an ack of ids
// behind it, and, once the ack waits for that lock, tries the row the ack
// must have locked first (tryFirst, FOR UPDATE NOWAIT): it must fail with
// lock_not_available (else the test fails with why). Then it lets the ack
// go, which must answer each id once, published.
func ackLocksFirstWhileItWaits(t *testing.T, pool *pgxpool.Pool, ids []uuid.UUID, hold, tryFirst, why string) {
	t.Helper()
	release, holder := holdLock(t, pool, hold)
	var answers []string
	done := runBehind(t, pool, holder, func(ctx context.Context, conn *pgxpool.Conn) error {
		rows, err := conn.Query(ctx, `SELECT event_id::text || ' ' || status FROM outbox.ack($1, 'x') ORDER BY 1`, ids)
		if err != nil {
			return err
		}
		answers, err = pgx.CollectRows(rows, pgx.RowTo[string])
		return err
	})
	_, lockErr := pool.Exec(testContext(t), tryFirst)
	release()
	await(t, done)
	if lockErr == nil {
		t.Fatal(why)
	}
	wantSQLState(t, lockErr, "55P03")
	var want []string
	for _, id := range ids {
		want = append(want, id.String()+" published")
	}
	slices.Sort(want)
	if fmt.Sprint(answers) != fmt.Sprint(want) {
		t.Fatalf("the ack answered %v, want %v", answers, want)
	}
}

// A hand-over holder passed without a window takes windows of one: the ack
// of a/1 and a/2 (a window of 2; a/3 and a/4 there) by a holder given a TTL
// but no window hands a/3 over alone, though its two acks free two units.
// Kills a missing window read as more than one (M43).
func TestAWindowedAckToAHolderGivenNoWindowHandsOverOneEvent(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	h := uuid.New()
	emitN(t, pool, "a", 4)
	discover(t, pool)
	ls := claimWindow(t, pool, h, 1, 2, 2)
	if fmt.Sprint(revisions(ls, "a")) != "[1 2]" {
		t.Fatalf("claimed %v, want a/1 and a/2", ls)
	}
	answers, handed := ackAnswers(t, pool, []uuid.UUID{ls[0].id, ls[1].id}, []uuid.UUID{h}, nil, nil)
	if len(answers) != 2 || fmt.Sprint(handed) != "[3]" {
		t.Fatalf("ack of a/1 and a/2 by a holder given no window answered %v, handed over %v; want both published, a/3 alone", answers, handed)
	}
}
