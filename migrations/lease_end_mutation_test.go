package migrations_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxd/outboxd/internal/testdb"
)

// Tests written against mutants of the functions that end, extend or
// record the failure of a lease (nack, park, extend_lease, release,
// record_expired, trim_attempts, stall_reason) that the other tests let
// through: each holds one promise of those functions.

// leaseRow is what a delivery row says about its lease and its failures.
type leaseRow struct {
	state                                     string
	holder                                    *uuid.UUID
	relay, replica                            *string
	expires, claimable, nextAttempt, parkedAt *time.Time
	parkedRevision                            *int64
	parkedReason, lastError                   *string
	failures                                  int
}

func readLease(t *testing.T, pool *pgxpool.Pool, key string) leaseRow {
	t.Helper()
	var r leaseRow
	if err := pool.QueryRow(testContext(t), `SELECT state, holder, holder_relay_id, holder_replica_id, lease_expires_at,
		       claimable_at, next_attempt_at, parked_at, parked_revision, parked_reason, last_error, failures
		FROM outbox.delivery WHERE stream = 'orders' AND aggregate_key = $1`, key).
		Scan(&r.state, &r.holder, &r.relay, &r.replica, &r.expires, &r.claimable, &r.nextAttempt, &r.parkedAt,
			&r.parkedRevision, &r.parkedReason, &r.lastError, &r.failures); err != nil {
		t.Fatal(err)
	}
	return r
}

// noHolder fails unless the row's lease is gone: no holder, no holder's
// relay or replica, no expiry (a lease that ended keeps none of them).
func noHolder(t *testing.T, what string, r leaseRow) {
	t.Helper()
	if r.holder != nil || r.relay != nil || r.replica != nil || r.expires != nil {
		t.Fatalf("%s: holder %v, relay %v, replica %v, expiry %v; want all NULL", what, r.holder, r.relay, r.replica, r.expires)
	}
}

// attemptRow is one row of outbox.attempt.
type attemptRow struct {
	key            string
	revision       int64
	event          uuid.UUID
	attempt        int
	outcome        string
	errText        string
	relay, replica *string
}

func attempts(t *testing.T, pool *pgxpool.Pool) []attemptRow {
	t.Helper()
	rows, err := pool.Query(testContext(t), `SELECT aggregate_key, revision, event_id, attempt, outcome, coalesce(error, ''),
		relay_id, replica_id FROM outbox.attempt ORDER BY attempt_id`)
	if err != nil {
		t.Fatal(err)
	}
	out, err := pgx.CollectRows(rows, func(row pgx.CollectableRow) (attemptRow, error) {
		var a attemptRow
		err := row.Scan(&a.key, &a.revision, &a.event, &a.attempt, &a.outcome, &a.errText, &a.relay, &a.replica)
		return a, err
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// claimFor leases the oldest claimable aggregate to holder, as relay r of
// replica x, for a minute.
func claimFor(t *testing.T, pool *pgxpool.Pool, holder uuid.UUID) leased {
	t.Helper()
	rows, err := pool.Query(testContext(t),
		`SELECT aggregate_key, revision, event_id, epoch FROM outbox.claim($1, 'r', 'x', NULL, 1, interval '1 minute')`, holder)
	if err != nil {
		t.Fatal(err)
	}
	got := collectLeases(t, rows)
	if len(got) != 1 {
		t.Fatalf("claimed %v, want one lease", got)
	}
	return got[0]
}

// A nack ends the lease it names and schedules the next attempt: the row
// backs off with no holder left on it (no holder, relay, replica nor
// expiry), claimable when the next attempt is due, with the error; the
// nack answers the holder it took the lease from (whose credit comes back)
// and the attempt is on record as nacked, by the relay and replica that
// held it. Kills a nack that leaves the expiry or the holder on the row,
// answers the holder as it is after the update (NULL), or records no
// attempt.
func TestANackEndsItsLeaseAndSaysWhoseItWas(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pool := testdb.NewPool(t)
	emitN(t, pool, "a", 1)
	discover(t, pool)
	holder := uuid.New()
	l := claimFor(t, pool, holder)
	var parked bool
	var next time.Time
	var failures int
	var from *uuid.UUID
	var ended []uuid.UUID
	if err := pool.QueryRow(ctx, `SELECT parked, next_attempt_at, failures, holder, ended
		FROM outbox.nack($1, $2, 'broker down', NULL, interval '1 hour', interval '2 hours', 5)`, l.id, l.epoch).
		Scan(&parked, &next, &failures, &from, &ended); err != nil {
		t.Fatal(err)
	}
	if parked || failures != 1 || from == nil || *from != holder || !slices.Equal(ended, []uuid.UUID{l.id}) {
		t.Fatalf("nack answered parked %v, failures %d, holder %v, ended %v; want backing off after 1 failure, holder %s, ended [%s]",
			parked, failures, from, ended, holder, l.id)
	}
	r := readLease(t, pool, "a")
	noHolder(t, "after the nack", r)
	if r.state != "backoff" || r.nextAttempt == nil || !r.nextAttempt.Equal(next) || r.claimable == nil || !r.claimable.Equal(next) ||
		r.lastError == nil || *r.lastError != "broker down" || r.parkedAt != nil || r.parkedReason != nil || r.parkedRevision != nil {
		t.Fatalf("after the nack: %+v; want backoff, claimable and next attempt at %v, last error \"broker down\", nothing parked", r, next)
	}
	got := attempts(t, pool)
	if len(got) != 1 || got[0].event != l.id || got[0].revision != 1 || got[0].attempt != 1 || got[0].outcome != "nacked" ||
		got[0].errText != "broker down" || got[0].relay == nil || *got[0].relay != "r" || got[0].replica == nil || *got[0].replica != "x" {
		t.Fatalf("attempt history %+v, want a/1's attempt 1 nacked with \"broker down\" by relay r of replica x", got)
	}
}

// The backoff is jittered: aggregates nacked alike do not all come back at
// the same moment (a broker outage would otherwise bring every one of them
// back in the same instant, again and again). Twenty first failures with a
// one-hour base are due between half an hour and an hour after their nacks,
// spread over that range: not all within a minute of each other (with the
// jitter, the chance of that is about 20 * (1/30)^19). Kills a nack
// without jitter.
func TestNackBackoffIsJittered(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pool := testdb.NewPool(t)
	const n = 20
	for i := range n {
		emitN(t, pool, fmt.Sprintf("k%02d", i), 1)
	}
	discover(t, pool)
	leases := claimWindow(t, pool, uuid.New(), n, 1, n)
	if len(leases) != n {
		t.Fatalf("claimed %d leases, want %d", len(leases), n)
	}
	var lo, hi time.Duration
	for i, l := range leases {
		// The delay as the nack set it, read right after it in the same
		// statement: microseconds short of the jittered step.
		var in time.Duration
		if err := pool.QueryRow(ctx, `SELECT n.next_attempt_at - clock_timestamp()
			FROM outbox.nack($1, $2, 'broker down', NULL, interval '1 hour', interval '2 hours', 5) n`, l.id, l.epoch).Scan(&in); err != nil {
			t.Fatal(err)
		}
		if in < 29*time.Minute || in > time.Hour {
			t.Fatalf("%s: next attempt in %v, want half an hour to an hour", l.key, in)
		}
		if i == 0 || in < lo {
			lo = in
		}
		if i == 0 || in > hi {
			hi = in
		}
	}
	if hi-lo < time.Minute {
		t.Fatalf("%d nacks' next attempts all within %v of each other (%v to %v), want them spread", n, hi-lo, lo, hi)
	}
}

// The error a nack records is cut to 4096 characters, on the row and in
// the attempt history (a relay's error text is not bounded), and the
// parked reason quotes its first 1024 after saying how often the publish
// failed ("once" for a single failure). Kills a nack that stores the error
// whole in either place, or miscounts "once".
func TestANacksErrorIsBounded(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pool := testdb.NewPool(t)
	emitN(t, pool, "a", 1)
	discover(t, pool)
	l := claimFor(t, pool, uuid.New())
	long := strings.Repeat("e", 5000)
	var parked bool
	if err := pool.QueryRow(ctx, `SELECT parked FROM outbox.nack($1, $2, $3, NULL, interval '1 second', interval '1 minute', 1)`,
		l.id, l.epoch, long).Scan(&parked); err != nil {
		t.Fatal(err)
	}
	if !parked {
		t.Fatal("a first failure of at most 1 did not park")
	}
	r := readLease(t, pool, "a")
	if r.lastError == nil || *r.lastError != long[:4096] {
		t.Fatalf("last error of %d characters, want the first 4096", len(deref(r.lastError)))
	}
	if want := "publish failed once; last error: " + long[:1024]; deref(r.parkedReason) != want {
		t.Fatalf("parked reason %.60q... (%d characters), want %.60q... (%d)", deref(r.parkedReason), len(deref(r.parkedReason)), want, len(want))
	}
	if got := attempts(t, pool); len(got) != 1 || got[0].outcome != "parked" || got[0].errText != long[:4096] {
		t.Fatalf("attempt history: %d rows, the first with an error of %d characters; want one parked attempt with the first 4096",
			len(got), len(got[0].errText))
	}
}

func deref[T any](p *T) (v T) {
	if p != nil {
		v = *p
	}
	return v
}

// nackOrParkRacingAnAck holds an ack of a's only event open in a
// transaction, starts call (a nack or a park of the same lease) behind it
// (runBehind), commits the ack and returns the call's error.
func nackOrParkRacingAnAck(t *testing.T, pool *pgxpool.Pool, call string) (leased, error) {
	t.Helper()
	ctx := testContext(t)
	emitN(t, pool, "a", 1)
	discover(t, pool)
	l := claimFor(t, pool, uuid.New())
	ack, ackPID := openAck(t, pool, []uuid.UUID{l.id}, nil)
	done := runBehind(t, pool, ackPID, func(ctx context.Context, conn *pgxpool.Conn) error {
		var n int
		return conn.QueryRow(ctx, `SELECT count(*) FROM `+call+` x HAVING count(*) > 0`, l.id, l.epoch).Scan(&n)
	})
	if err := ack.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	return l, <-done
}

// A nack that waits for an ack of the same lease (the relay's broker did
// take the event, and its ack landed first) finds the lease gone once the
// ack commits: it answers no row and leaves the row as the ack left it
// (idle, published), not backing off over it. Kills a nack that reads the
// lease without locking the row (FOR UPDATE OF d), whose update then
// overwrites whatever the ack made of it.
func TestANackWaitingForAnAckOfItsLeaseFindsItGone(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	_, err := nackOrParkRacingAnAck(t, pool,
		`outbox.nack($1, $2, 'broker down', NULL, interval '1 hour', interval '2 hours', 5)`)
	if !errors.Is(err, pgx.ErrNoRows) {
		t.Fatalf("nack after the ack of its lease: %v, want no row", err)
	}
	if r := readLease(t, pool, "a"); r.state != "idle" || r.failures != 0 || r.nextAttempt != nil {
		t.Fatalf("after the ack and the nack: %+v, want idle with no failure", r)
	}
}

// The same for a park: it finds the lease the ack ended gone and parks
// nothing. Kills a park that reads the lease without locking the row.
func TestAParkWaitingForAnAckOfItsLeaseFindsItGone(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	_, err := nackOrParkRacingAnAck(t, pool, `outbox.park($1, $2, 'too large')`)
	if !errors.Is(err, pgx.ErrNoRows) {
		t.Fatalf("park after the ack of its lease: %v, want no row", err)
	}
	if r := readLease(t, pool, "a"); r.state != "idle" || r.parkedAt != nil {
		t.Fatalf("after the ack and the park: %+v, want idle, not parked", r)
	}
}

// A park ends the lease it names at once and keeps the aggregate out of
// every claim: parked at the event named (the head here), claimable never
// (claimable_at is NULL exactly when no claim may take the row), with the
// reason as the parked reason and the last error, parked_at set, no holder
// left on the row; it answers the holder it took the lease from, and the
// attempt is on record as parked with the reason. Kills a park that leaves
// claimable_at, the holder or the expiry on the row, sets no parked_at,
// reason or last error, answers the holder after the update, or records
// the attempt as anything but parked.
func TestAParkEndsItsLeaseAndKeepsTheAggregateOutOfClaims(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pool := testdb.NewPool(t)
	emitN(t, pool, "a", 2)
	discover(t, pool)
	holder := uuid.New()
	l := claimFor(t, pool, holder)
	var from *uuid.UUID
	var ended []uuid.UUID
	if err := pool.QueryRow(ctx, `SELECT holder, ended FROM outbox.park($1, $2, 'too large')`, l.id, l.epoch).Scan(&from, &ended); err != nil {
		t.Fatal(err)
	}
	if from == nil || *from != holder || !slices.Equal(ended, []uuid.UUID{l.id}) {
		t.Fatalf("park answered holder %v, ended %v; want %s, [%s]", from, ended, holder, l.id)
	}
	r := readLease(t, pool, "a")
	noHolder(t, "after the park", r)
	if r.state != "parked" || r.claimable != nil || r.nextAttempt != nil || r.parkedAt == nil || deref(r.parkedRevision) != 1 ||
		deref(r.parkedReason) != "too large" || deref(r.lastError) != "too large" {
		t.Fatalf("after the park: %+v; want parked at revision 1, \"too large\", claimable never", r)
	}
	if n := count(t, pool, `SELECT count(*) FROM outbox.claim(gen_random_uuid(), 'r', 'y', NULL, 10, interval '1 minute')`); n != 0 {
		t.Fatalf("a claim after the park leased %d events", n)
	}
	got := attempts(t, pool)
	if len(got) != 1 || got[0].event != l.id || got[0].outcome != "parked" || got[0].errText != "too large" || deref(got[0].relay) != "r" {
		t.Fatalf("attempt history %+v, want a/1 parked with \"too large\" by relay r", got)
	}
}

// A park at an event inside a window parks the aggregate at that event
// (parked_revision), not at the lease's head, whose ack (already sent) is
// still to land: GetAggregate and a retry name the event that cannot be
// delivered. Kills a park that records the head's revision.
func TestAParkInsideAWindowRecordsTheEventItParkedAt(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pool := testdb.NewPool(t)
	emitN(t, pool, "a", 3)
	discover(t, pool)
	w := claimWindow(t, pool, uuid.New(), 1, 3, 3)
	if len(w) != 3 {
		t.Fatalf("claimed %v, want a window of 3", w)
	}
	var ended []uuid.UUID
	if err := pool.QueryRow(ctx, `SELECT ended FROM outbox.park($1, $2, 'too large')`, w[1].id, w[1].epoch).Scan(&ended); err != nil {
		t.Fatal(err)
	}
	if r := readLease(t, pool, "a"); r.state != "parked" || deref(r.parkedRevision) != 2 {
		t.Fatalf("after parking a/2 of the window: %+v, want parked at revision 2", r)
	}
	if got := attempts(t, pool); len(got) != 1 || got[0].revision != 2 || got[0].event != w[1].id {
		t.Fatalf("attempt history %+v, want a/2's", got)
	}
}

// An extension sets the lease's expiry to now + the TTL asked for, also
// when that is sooner than the expiry it had (a relay that asks for less
// gives the rest back), and the claim order (claimable_at) with it: one
// lease, one expiry. Kills an extension that only ever pushes the expiry
// later.
func TestAnExtensionSetsTheExpiryItAsksFor(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pool := testdb.NewPool(t)
	emitN(t, pool, "a", 1)
	discover(t, pool)
	var id uuid.UUID
	var epoch int64
	if err := pool.QueryRow(ctx, `SELECT event_id, epoch FROM outbox.claim(gen_random_uuid(), 'r', 'x', NULL, 1, interval '1 hour')`).
		Scan(&id, &epoch); err != nil {
		t.Fatal(err)
	}
	var until time.Time
	var in time.Duration
	if err := pool.QueryRow(ctx, `SELECT x.lease_expires_at, x.lease_expires_at - clock_timestamp()
		FROM outbox.extend_lease($1, $2, '1 minute') x`, id, epoch).Scan(&until, &in); err != nil {
		t.Fatal(err)
	}
	if in > time.Minute || in < 50*time.Second {
		t.Fatalf("extended by a minute to %v, %v from now; want a minute from now", until, in)
	}
	// (claimable_at reads the clock again, a microsecond or so apart.)
	if r := readLease(t, pool, "a"); r.expires == nil || !r.expires.Equal(until) || r.claimable == nil ||
		r.claimable.Sub(until).Abs() > time.Second {
		t.Fatalf("after the extension: expiry %v, claimable %v; want both %v", r.expires, r.claimable, until)
	}
}

// A release ends each lease whole: the rows it gives back keep no holder,
// relay, replica or expiry, and the attempt on record is the lease's head
// (event and revision), released, by the relay and replica that held it,
// for a window as for a single event. Kills a release that leaves the
// expiry or the holder's relay and replica on the row, or records the
// window's last revision as the attempt's.
func TestAReleaseEndsEachLeaseWhole(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	emitN(t, pool, "a", 3)
	discover(t, pool)
	holder := uuid.New()
	w := claimWindow(t, pool, holder, 1, 3, 3)
	if len(w) != 3 {
		t.Fatalf("claimed %v, want a window of 3", w)
	}
	if n := count(t, pool, fmt.Sprintf(`SELECT outbox.release('%s')`, holder)); n != 1 {
		t.Fatalf("released %d leases, want 1", n)
	}
	r := readLease(t, pool, "a")
	noHolder(t, "after the release", r)
	if r.state != "ready" || r.claimable == nil {
		t.Fatalf("after the release: %+v, want ready and claimable", r)
	}
	got := attempts(t, pool)
	if len(got) != 1 || got[0].event != w[0].id || got[0].revision != 1 || got[0].attempt != 1 || got[0].outcome != "released" ||
		deref(got[0].relay) != "r" || deref(got[0].replica) != "x" {
		t.Fatalf("attempt history %+v, want the window's head a/1, attempt 1, released by relay r of replica x", got)
	}
}

// A release locks its rows in key order, the order ack batches lock
// delivery rows in, so that a release and a batch never wait for each
// other in a cycle: while b's row is held elsewhere, a release of a
// session's leases on a and b has a's row locked already as it waits for
// b's. Kills a release that locks in any other order.
func TestAReleaseLocksItsRowsInKeyOrder(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pool := testdb.NewPool(t)
	emitN(t, pool, "a", 1)
	emitN(t, pool, "b", 1)
	discover(t, pool)
	holder := uuid.New()
	if got := claimWindow(t, pool, holder, 2, 1, 2); len(got) != 2 {
		t.Fatalf("claimed %v, want a and b", got)
	}
	other, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer other.Rollback(context.Background())
	otherPID := backendPID(t, other)
	exec2 := func(sql string) error { _, err := other.Exec(ctx, sql); return err }
	if err := exec2(`SELECT 1 FROM outbox.delivery WHERE aggregate_key = 'b' FOR UPDATE`); err != nil {
		t.Fatal(err)
	}
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	pid := backendPID(t, conn)
	done := make(chan error, 1)
	go func() {
		var n int
		done <- conn.QueryRow(ctx, `SELECT outbox.release($1)`, holder).Scan(&n)
	}()
	waitUntilBlockedBy(t, pool, pid, otherPID)
	// a's row: locked by the waiting release.
	locked := exec2(`SELECT 1 FROM outbox.delivery WHERE aggregate_key = 'a' FOR UPDATE NOWAIT`)
	if err := other.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	var pgErr *pgconn.PgError
	if !errors.As(locked, &pgErr) || pgErr.Code != "55P03" {
		t.Fatalf("locking a while the release waits for b: %v, want lock_not_available (55P03): the release locks a first", locked)
	}
}

// stall_reason reports only aggregates with work in hand (ready, leased,
// backing off): a parked or gap-held one is reported as such, never as
// stalled, whatever its counts; and it quotes at most 512 characters of the
// last error. Kills a stall_reason that takes parked or gap-held rows, or
// quotes the error whole.
func TestStallReasonSkipsParkedAndGapAndBoundsTheError(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pool := testdb.NewPool(t)
	for _, state := range []string{"parked", "gap", "idle"} {
		var reason *string
		if err := pool.QueryRow(ctx, `SELECT outbox.stall_reason($1, 100, 100, 'broker down')`, state).Scan(&reason); err != nil {
			t.Fatal(err)
		}
		if reason != nil {
			t.Fatalf("stall_reason of a %s aggregate: %q, want NULL", state, *reason)
		}
	}
	long := strings.Repeat("e", 2000)
	var reason string
	if err := pool.QueryRow(ctx, `SELECT outbox.stall_reason('backoff', 0, 100, $1)`, long).Scan(&reason); err != nil {
		t.Fatal(err)
	}
	if want := "100 publishes of the next event failed in a row; last error: " + long[:512]; reason != want {
		t.Fatalf("stall reason of %d characters, want %d (the error cut to 512)", len(reason), len(want))
	}
}

// An expired lease is on record as the lease it was: its head event and
// revision, its attempt number, the relay and replica that held it, and
// when it expired, never later than the claim that found it (a lease whose
// expiry lies beyond the claim's max_due, after a clock step back, is
// claimed as due, and did not expire in the future). Kills a record that
// numbers the attempt one on, leaves out the relay, or takes the later of
// the expiry and the claim's time.
func TestAnExpiredLeaseIsRecordedAsTheLeaseItWas(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pool := testdb.NewPool(t)
	emitN(t, pool, "a", 1)
	emitN(t, pool, "b", 1)
	discover(t, pool)
	// a's lease runs ten hours (as after a clock step back, beyond the
	// claim's max_due); b's has expired.
	var a, b uuid.UUID
	if err := pool.QueryRow(ctx, `SELECT event_id FROM outbox.claim(gen_random_uuid(), 'r', 'x', NULL, 1, interval '10 hours')`).Scan(&a); err != nil {
		t.Fatal(err)
	}
	if err := pool.QueryRow(ctx, `SELECT event_id FROM outbox.claim(gen_random_uuid(), 'r', 'x', NULL, 1, interval '-1 second')`).Scan(&b); err != nil {
		t.Fatal(err)
	}
	if a == b {
		t.Fatal("the second claim took a again")
	}
	if n := count(t, pool, `SELECT count(*) FROM outbox.claim(gen_random_uuid(), 'r2', 'y', NULL, 2, interval '1 minute',
		NULL, NULL, 1, NULL, interval '1 hour')`); n != 2 {
		t.Fatalf("the claim took %d of the two leases due, want both", n)
	}
	var claimed time.Time
	if err := pool.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&claimed); err != nil {
		t.Fatal(err)
	}
	got := attempts(t, pool)
	if len(got) != 2 {
		t.Fatalf("attempt history %+v, want a's and b's expired leases", got)
	}
	for _, g := range got {
		if (g.event != a && g.event != b) || g.revision != 1 || g.attempt != 1 || g.outcome != "expired" ||
			deref(g.relay) != "r" || deref(g.replica) != "x" || !strings.HasPrefix(g.errText, "the lease expired at ") {
			t.Fatalf("attempt %+v, want revision 1's attempt 1 expired, held by relay r of replica x", g)
		}
	}
	var late int64
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox.attempt WHERE at > $1`, claimed).Scan(&late); err != nil {
		t.Fatal(err)
	}
	if late != 0 {
		t.Fatalf("%d expired leases recorded as expiring after the claim that found them (%v)", late, claimed)
	}
}

// A claim records only the leases of the events it leases again that ended
// unanswered: with at most one attempt per event, an aggregate an ack made
// ready (its last lease was of the event the ack published) and one a
// release made ready (its release is on record already) get no further
// record, though the expired lease claimed with them does. Kills a record
// that takes a lease of an event other than the aggregate's next one, or
// every ready aggregate.
func TestAClaimRecordsOnlyLeasesThatEndedUnanswered(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pool := testdb.NewPool(t)
	// One stream each, so that each claim below takes the one it names.
	emitIn(t, pool, "acked", "a", 2)
	emitIn(t, pool, "released", "b", 1)
	emitIn(t, pool, "expired", "c", 1)
	discover(t, pool)
	// a/1 acked (a ready at a/2); b released once; c's lease expired.
	var a1 uuid.UUID
	if err := pool.QueryRow(ctx, `SELECT event_id FROM outbox.claim(gen_random_uuid(), 'r', 'x', '{acked}', 1, interval '1 minute')`).Scan(&a1); err != nil {
		t.Fatal(err)
	}
	if n := count(t, pool, fmt.Sprintf(`SELECT count(*) FROM outbox.ack(ARRAY['%s'::uuid], 'x') WHERE status = 'published'`, a1)); n != 1 {
		t.Fatal("the ack of a/1 did not publish it")
	}
	released := uuid.New()
	if n := count(t, pool, fmt.Sprintf(`SELECT count(*) FROM outbox.claim('%s', 'r', 'x', '{released}', 1, interval '1 minute')`, released)); n != 1 {
		t.Fatalf("claimed %d of b, want 1", n)
	}
	if n := count(t, pool, fmt.Sprintf(`SELECT outbox.release('%s')`, released)); n != 1 {
		t.Fatalf("released %d leases, want b's", n)
	}
	if n := count(t, pool, `SELECT count(*) FROM outbox.claim(gen_random_uuid(), 'r', 'x', '{expired}', 1, interval '-1 second')`); n != 1 {
		t.Fatalf("claimed %d of c, want 1", n)
	}
	before := attempts(t, pool)
	if len(before) != 1 || before[0].key != "b" || before[0].outcome != "released" {
		t.Fatalf("attempt history before the claim: %+v, want b's release", before)
	}
	n := count(t, pool, `SELECT count(*) FROM outbox.claim(gen_random_uuid(), 'r', 'x', NULL, 10, interval '1 minute', 5)`)
	if n != 3 {
		t.Fatalf("claimed %d, want a/2, b and c", n)
	}
	got := attempts(t, pool)
	var keys []string
	for _, g := range got {
		keys = append(keys, g.key+" "+g.outcome)
	}
	if want := []string{"b released", "c expired"}; !slices.Equal(keys, want) {
		t.Fatalf("attempt history %v, want %v", keys, want)
	}
}
