package store_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxd/outboxd/internal/store"
	"github.com/outboxd/outboxd/internal/testdb"
)

// Tests written against mutants of the store that its other tests and the
// server's let through: each holds one promise of the store's API.

// discovered emits one event of each key, in stream, and runs a discovery
// round with no offer, so that their aggregates are claimable; it returns
// the events' ids in order.
func discovered(t *testing.T, pool *pgxpool.Pool, st *store.Store, stream string, keys ...string) []uuid.UUID {
	t.Helper()
	var ids []uuid.UUID
	for _, k := range keys {
		var id uuid.UUID
		if err := pool.QueryRow(t.Context(), `SELECT event_id FROM outbox.emit($1, $2, 'T', '{}')`, stream, k).Scan(&id); err != nil {
			t.Fatal(err)
		}
		ids = append(ids, id)
	}
	if _, err := st.Discover(t.Context(), "replica", 100, 0, nil, nil); err != nil {
		t.Fatal(err)
	}
	return ids
}

// hangGuard is how long a test waits for what is sure to come before it
// fails naming what never came: a guard against hanging until go test's
// -timeout, not a timed assertion.
const hangGuard = 60 * time.Second

// waitUntilTrue polls query (a boolean, over pg_stat_activity or
// pg_blocking_pids, say) until it is true, failing after hangGuard.
func waitUntilTrue(t *testing.T, pool *pgxpool.Pool, what, query string, args ...any) {
	t.Helper()
	deadline := time.Now().Add(hangGuard)
	for {
		var ok bool
		if err := pool.QueryRow(t.Context(), query, args...).Scan(&ok); err != nil {
			t.Fatal(err)
		}
		if ok {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("waited %v for %s", hangGuard, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func claimOf(limit int) store.ClaimParams {
	return store.ClaimParams{Holder: uuid.New(), RelayID: "r", ReplicaID: "replica", Limit: limit, TTL: time.Minute}
}

// A discovery round whose answer is lost after it was sent (here its
// context is cancelled while the round waits on a lock, which makes pgx
// close the connection under it) may have committed: Discover says so by
// wrapping ErrAnswerLost, which makes the sessions that lent it credit
// sweep for leases they never heard of. Kills a roundError that wraps
// ErrAnswerLost for no error.
func TestDiscoverAnswerLostOnceSent(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	st := store.New(pool)
	if _, err := pool.Exec(t.Context(), `SELECT outbox.emit('orders', 'o', 'T', '{}')`); err != nil {
		t.Fatal(err)
	}
	// Every round reads the event table: locked, the round waits.
	tx, err := pool.Begin(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(context.WithoutCancel(t.Context()))
	if _, err := tx.Exec(t.Context(), `LOCK TABLE outbox.event IN ACCESS EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	pids := make(chan uint32, 1)
	done := make(chan error, 1)
	offer := []store.Offer{{Holder: uuid.New(), RelayID: "r", TTL: time.Minute, Credit: 1}}
	go func() {
		_, err := st.Discover(ctx, "replica", 100, 0, offer, func(pid uint32) { pids <- pid })
		done <- err
	}()
	// The round either says which backend it runs on or fails before it
	// has one (Acquire's error): the test must not wait for a pid then.
	var pid uint32
	select {
	case pid = <-pids:
	case err := <-done:
		t.Fatalf("the round ended before it waited on the event table's lock: %v", err)
	case <-time.After(hangGuard):
		t.Fatalf("the round named no backend after %v", hangGuard)
	}
	waitUntilTrue(t, pool, "the round's backend to wait on the event table's lock",
		`SELECT EXISTS (SELECT FROM pg_stat_activity WHERE pid = $1 AND wait_event_type = 'Lock')`, int64(pid))
	cancel()
	select {
	case err := <-done:
		if !errors.Is(err, store.ErrAnswerLost) {
			t.Errorf("a round cut off after it was sent: %v; want ErrAnswerLost", err)
		}
	case <-time.After(hangGuard):
		t.Fatalf("the round cut off by its context has not returned after %v", hangGuard)
	}
}

// A discovery round never sent (its context cancelled before the
// statement went out) surely did not commit: Discover's error wraps no
// ErrAnswerLost, so no session sweeps for nothing. Kills a roundError that
// takes every error but PostgreSQL's as a lost answer.
func TestDiscoverNotSentLosesNoAnswer(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	st := store.New(pool)
	if _, err := pool.Exec(t.Context(), `SELECT outbox.emit('orders', 'o', 'T', '{}')`); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	offer := []store.Offer{{Holder: uuid.New(), RelayID: "r", TTL: time.Minute, Credit: 1}}
	_, err := st.Discover(ctx, "replica", 100, 0, offer, func(uint32) { cancel() })
	if err == nil || errors.Is(err, store.ErrAnswerLost) {
		t.Errorf("a round cancelled before it was sent: %v; want an error that is not ErrAnswerLost", err)
	}
	d, err := st.Discover(t.Context(), "replica", 100, 0, offer, nil)
	if err != nil || len(d.Dispatched) != 1 {
		t.Errorf("the round after: %+v, %v; want its one event dispatched (the cancelled round did nothing)", d, err)
	}
}

// ClaimParams.MaxAttempts parks an aggregate rather than leasing its event
// again once that event was delivered so many times without an answer:
// here its one lease, of attempt 1, expired unanswered. Kills a Claim that
// does not pass MaxAttempts to outbox.claim.
func TestClaimParksAtMaxAttempts(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	st := store.New(pool)
	discovered(t, pool, st, "orders", "1")
	p := claimOf(1)
	p.MaxAttempts, p.TTL = 1, time.Millisecond
	if leases, err := st.Claim(t.Context(), p); err != nil || len(leases) != 1 {
		t.Fatalf("first claim: %d leases, %v; want 1", len(leases), err)
	}
	// A hang guard, not a timed assertion: the lease expires by the
	// database's clock.
	deadline := time.Now().Add(60 * time.Second)
	for {
		var expired bool
		if err := pool.QueryRow(t.Context(), `SELECT lease_expires_at < clock_timestamp() FROM outbox.delivery`).Scan(&expired); err != nil {
			t.Fatal(err)
		}
		if expired {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the 1 ms lease has not expired after 60 s")
		}
		time.Sleep(5 * time.Millisecond)
	}
	p.Holder = uuid.New()
	leases, err := st.Claim(t.Context(), p)
	if err != nil || len(leases) != 0 {
		t.Fatalf("a claim after one unanswered attempt of 1: %d leases (%+v), %v; want none", len(leases), leases, err)
	}
	var state string
	if err := pool.QueryRow(t.Context(), `SELECT state FROM outbox.delivery`).Scan(&state); err != nil {
		t.Fatal(err)
	}
	if state != "parked" {
		t.Errorf("the aggregate is %s; want parked at its max attempts", state)
	}
}

// An ack of a later event of a window lease, while the earlier one is not
// acked, is not applied and says so: AckOutOfOrder, not a lost lease (the
// relay keeps the lease and acks the earlier one). Kills an ack that reads
// outbox.ack's "out_of_order" as AckLeaseLost.
func TestAckOutOfOrderIsReportedSo(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	st := store.New(pool)
	discovered(t, pool, st, "orders", "1", "1")
	p := claimOf(1)
	p.Window, p.Credit = 2, 2
	leases, err := st.Claim(t.Context(), p)
	if err != nil || len(leases) != 2 {
		t.Fatalf("a window claim of 2 events: %d leases, %v", len(leases), err)
	}
	second := leases[0]
	if second.Event.Revision != 2 {
		second = leases[1]
	}
	res, err := st.Ack(t.Context(), store.AckParams{IDs: []uuid.UUID{second.Event.ID}, ReplicaID: "replica"})
	if err != nil || len(res) != 1 || res[0].Status != store.AckOutOfOrder {
		t.Fatalf("an ack of revision 2 before 1: %+v, %v; want AckOutOfOrder", res, err)
	}
}

// An ack whose statement fails for the database's own reason (class 57,
// here a cancel of its backend while it waits on a lock) is the batch's
// error, not an AckFailed result of its id: the id is not at fault, and
// the server answers UNAVAILABLE rather than retrying it as refused.
// Kills an isItemError that takes every error of PostgreSQL as an item's.
func TestAckCancelledByTheDatabaseIsAnError(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	st := store.New(pool)
	discovered(t, pool, st, "orders", "1")
	p := claimOf(1)
	leases, err := st.Claim(t.Context(), p)
	if err != nil || len(leases) != 1 {
		t.Fatalf("claim: %d leases, %v", len(leases), err)
	}
	tx, err := pool.Begin(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(context.WithoutCancel(t.Context()))
	if _, err := tx.Exec(t.Context(), `LOCK TABLE outbox.event IN EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	type answer struct {
		res []store.AckResult
		err error
	}
	done := make(chan answer, 1)
	go func() {
		res, err := st.Ack(t.Context(), store.AckParams{IDs: []uuid.UUID{leases[0].Event.ID}, ReplicaID: "replica"})
		done <- answer{res, err}
	}()
	deadline := time.Now().Add(hangGuard)
	for {
		var cancelled bool
		if err := pool.QueryRow(t.Context(), `SELECT coalesce(bool_or(pg_cancel_backend(pid)), false) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock' AND strpos(query, 'outbox.ack(') > 0`).Scan(&cancelled); err != nil {
			t.Fatal(err)
		}
		if cancelled {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the ack never waited on the event table's lock")
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err := tx.Rollback(t.Context()); err != nil {
		t.Fatal(err)
	}
	var a answer
	select {
	case a = <-done:
	case <-time.After(hangGuard):
		t.Fatalf("the ack cancelled by the database has not returned after %v", hangGuard)
	}
	// The cancel must come back as the batch's error, PostgreSQL's own
	// query_canceled (57014), not as another error nor as an AckFailed
	// result of the id.
	var pgErr *pgconn.PgError
	if !errors.As(a.err, &pgErr) || pgErr.Code != "57014" {
		t.Errorf("an ack cancelled by the database: %+v, %v; want its error, SQLSTATE 57014", a.res, a.err)
	}
	for _, r := range a.res {
		if r.Status == store.AckFailed {
			t.Errorf("an ack cancelled by the database answered %s AckFailed (%v); want no item failed for the database's error", r.EventID, r.Err)
		}
	}
}

// KnownStreams with no limit (0) lists every stream; with one, at most
// that many, in name order. Kills a KnownStreams that sends LIMIT 0.
func TestKnownStreamsWithoutLimitListsAll(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	st := store.New(pool)
	discovered(t, pool, st, "b", "1")
	discovered(t, pool, st, "a", "1")
	for limit, want := range map[int]string{0: "a,b", 1: "a"} {
		got, err := st.KnownStreams(t.Context(), limit)
		if err != nil || strings.Join(got, ",") != want {
			t.Errorf("KnownStreams(%d) = %v, %v; want %s", limit, got, err, want)
		}
	}
}

// A nack's backoff grows from BackoffBase by the aggregate's failures up
// to BackoffCap: after ten failures, with a base of a second and a cap of
// an hour, the next attempt is minutes away (512 s to 1024 s), not the
// base's second. Kills a Nack that passes base and cap to outbox.nack
// swapped (the cap of a second would then bound every backoff).
func TestNackBackoffGrowsFromBaseToCap(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	st := store.New(pool)
	discovered(t, pool, st, "orders", "1")
	leases, err := st.Claim(t.Context(), claimOf(1))
	if err != nil || len(leases) != 1 {
		t.Fatalf("claim: %d leases, %v", len(leases), err)
	}
	var before time.Time
	if err := pool.QueryRow(t.Context(), `UPDATE outbox.delivery SET failures = 10 RETURNING clock_timestamp()`).Scan(&before); err != nil {
		t.Fatal(err)
	}
	r, err := st.Nack(t.Context(), store.NackParams{EventID: leases[0].Event.ID, Epoch: leases[0].Epoch, Error: "broker down",
		BackoffBase: time.Second, BackoffCap: time.Hour, MaxFailures: 100})
	if err != nil {
		t.Fatal(err)
	}
	if in := r.NextAttemptAt.Sub(before); r.Parked || in < 5*time.Minute || in > time.Hour {
		t.Errorf("after an 11th failure: next attempt in %v (parked %v); want 512 s to 1024 s", in, r.Parked)
	}
}

// An ack's claim hint looks only at the streams the holder's session
// takes: a session of every stream but b, whose ack leaves only b's
// aggregate claimable, is told nothing is claimable for it. Kills an ack
// that passes the session's excluded streams as streams it takes.
func TestAckHintLeavesOutExcludedStreams(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	st := store.New(pool)
	discovered(t, pool, st, "a", "1")
	discovered(t, pool, st, "b", "1")
	p := claimOf(1)
	p.Streams = []string{"a"}
	leases, err := st.Claim(t.Context(), p)
	if err != nil || len(leases) != 1 {
		t.Fatalf("claim of a: %d leases, %v", len(leases), err)
	}
	res, err := st.Ack(t.Context(), store.AckParams{IDs: []uuid.UUID{leases[0].Event.ID}, ReplicaID: "replica",
		Filters: map[uuid.UUID]store.StreamFilter{p.Holder: {ExcludeStreams: []string{"b"}}}})
	if err != nil || len(res) != 1 || res[0].Status != store.AckPublished {
		t.Fatalf("ack: %+v, %v", res, err)
	}
	if h := res[0].Claimable; !h.Seen || !h.None {
		t.Errorf("the hint of a session excluding b, with only b's aggregate claimable: %+v; want none claimable", h)
	}
}

// Credit sessions lend an ack batch is for the whole batch: when a batch
// fails on one id and is tried again in halves, the first half may have
// used the credit, so the second goes without it, or a session could be
// leased more events than its acks free plus the credit it lent. One of
// three acks fails (a trigger planted here refuses aggregate c's), so the
// batch is split: a1 alone, with the loan of 2, slides its window of 3 onto
// a2, a3 and a4; b1, acked in the second half, may then take only what its
// own ack frees, b2. Kills an Ack that lends the credit to both halves.
func TestASplitAckLendsTheSessionsCreditOnce(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	st := store.New(pool)
	for _, key := range []string{"a", "b"} {
		for range 4 {
			if _, err := pool.Exec(t.Context(), `SELECT outbox.emit('s', $1, 'T', '{}')`, key); err != nil {
				t.Fatal(err)
			}
		}
	}
	discovered(t, pool, st, "s", "c")
	p := claimOf(3)
	leases, err := st.Claim(t.Context(), p)
	if err != nil || len(leases) != 3 {
		t.Fatalf("claim: %d leases, %v; want a1, b1 and c1", len(leases), err)
	}
	heads := map[string]uuid.UUID{}
	for _, l := range leases {
		heads[l.Event.AggregateKey] = l.Event.ID
	}
	if _, err := pool.Exec(t.Context(), `
		CREATE FUNCTION public.refuse_c() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN RAISE EXCEPTION 'c is refused here'; END $$;
		CREATE TRIGGER refuse_c BEFORE UPDATE OF published_at ON outbox.event
		FOR EACH ROW WHEN (OLD.aggregate_key = 'c') EXECUTE FUNCTION public.refuse_c()`); err != nil {
		t.Fatal(err)
	}
	res, err := st.Ack(t.Context(), store.AckParams{
		IDs:       []uuid.UUID{heads["a"], heads["c"], heads["b"]},
		ReplicaID: "replica",
		HandOver:  map[uuid.UUID]store.HandOverTarget{p.Holder: {TTL: time.Minute, Window: 3, Credit: 2}},
	})
	if err != nil {
		t.Fatal(err)
	}
	handed := map[uuid.UUID]int{}
	for _, r := range res {
		handed[r.EventID] += len(r.HandOver)
	}
	if handed[heads["a"]] != 3 {
		t.Fatalf("a1's ack, with the loan, handed over %d events; want a2, a3 and a4 (results %+v)", handed[heads["a"]], res)
	}
	if handed[heads["b"]] != 1 {
		t.Errorf("b1's ack, in the second half of the split batch, handed over %d events; want 1 (b2): the loan went with the first half", handed[heads["b"]])
	}
}

// A nack's backoff is equal jitter over the exponential step: between half
// and all of min(BackoffCap, BackoffBase * 2^failures before it), never
// more. Sixteen aggregates nacked after their tenth failure (base a second,
// cap an hour) each come back 512 s to 1024 s later, and eight nacked after
// their twentieth, whose step is past the cap, 30 min to an hour later: a
// jitter that overshoots the step, a step one doubling too far or a
// missing cap puts some outside (each nack's chance of escaping is at most
// a half, sixteen times over). Kills mutants of outbox.nack's retry_at.
func TestNackBackoffStaysWithinItsJitteredStep(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	st := store.New(pool)
	var keys []string
	for i := range 24 {
		keys = append(keys, fmt.Sprintf("k%02d", i))
	}
	discovered(t, pool, st, "orders", keys...)
	leases, err := st.Claim(t.Context(), claimOf(len(keys)))
	if err != nil || len(leases) != len(keys) {
		t.Fatalf("claim: %d leases, %v", len(leases), err)
	}
	if _, err := pool.Exec(t.Context(), `UPDATE outbox.delivery SET failures = CASE WHEN aggregate_key < 'k16' THEN 10 ELSE 20 END`); err != nil {
		t.Fatal(err)
	}
	clock := func() (now time.Time) {
		t.Helper()
		if err := pool.QueryRow(t.Context(), `SELECT clock_timestamp()`).Scan(&now); err != nil {
			t.Fatal(err)
		}
		return now
	}
	before := clock()
	next := map[string]time.Time{}
	for _, l := range leases {
		r, err := st.Nack(t.Context(), store.NackParams{EventID: l.Event.ID, Epoch: l.Epoch, Error: "broker down",
			BackoffBase: time.Second, BackoffCap: time.Hour, MaxFailures: 100})
		if err != nil || r.Parked {
			t.Fatalf("nack of %s: %v (parked %v)", l.Event.AggregateKey, err, r.Parked)
		}
		next[l.Event.AggregateKey] = r.NextAttemptAt
	}
	after := clock()
	for _, k := range keys {
		step := 1024 * time.Second
		if k >= "k16" {
			step = time.Hour
		}
		if at := next[k]; at.Before(before.Add(step/2)) || at.After(after.Add(step)) {
			t.Errorf("%s: next attempt %v after the nacks began, want %v to %v", k, at.Sub(before), step/2, step)
		}
	}
}

// An operator's retry of an aggregate parked because its event was
// delivered too often without an answer gives it a fresh set of attempts:
// the next claim leases the event rather than counting one more unanswered
// delivery and parking it again at once. Kills a RetryAggregate that does
// not reset unanswered.
func TestRetryOfAnAggregateParkedUnansweredLeasesItAgain(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	st := store.New(pool)
	discovered(t, pool, st, "orders", "1")
	claim := func() int {
		t.Helper()
		p := claimOf(1)
		p.MaxAttempts = 2
		leases, err := st.Claim(t.Context(), p)
		if err != nil {
			t.Fatal(err)
		}
		// The relay's stream ends unanswered.
		if _, err := st.Release(t.Context(), p.Holder); err != nil {
			t.Fatal(err)
		}
		return len(leases)
	}
	for i := range 2 {
		if n := claim(); n != 1 {
			t.Fatalf("delivery %d: %d leases, want 1", i+1, n)
		}
	}
	if n := claim(); n != 0 {
		t.Fatalf("a third delivery of an event delivered twice unanswered (max 2): %d leases", n)
	}
	a, err := st.RetryAggregate(t.Context(), store.RetryParams{Stream: "orders", AggregateKey: "1", Reason: "relay fixed", Actor: "test"})
	if err != nil {
		t.Fatalf("retry of the parked aggregate: %v", err)
	}
	if a.State != "ready" {
		t.Fatalf("retried aggregate is %s, want ready", a.State)
	}
	if n := claim(); n != 1 {
		var state string
		if err := pool.QueryRow(t.Context(), `SELECT state FROM outbox.delivery`).Scan(&state); err != nil {
			t.Fatal(err)
		}
		t.Fatalf("the claim after the retry leased %d events and left the aggregate %s; want it leased again", n, state)
	}
}

// A skip of an aggregate's next event resets the count of its unanswered
// deliveries, as it resets its failures: the aggregate's next event is
// another, never delivered, and an aggregate stalled by the skipped one's
// unanswered deliveries is stalled no more (outbox.stall_reason: "an ack or
// a skip resets both counts"), even before a relay claims it again.
func TestSkipOfTheNextEventClearsItsStall(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	st := store.New(pool)
	ids := discovered(t, pool, st, "orders", "1")
	if _, err := pool.Exec(t.Context(), `SELECT outbox.emit('orders', '1', 'T', '{}')`); err != nil {
		t.Fatal(err)
	}
	// Delivered four times, each stream ending holding the lease: three
	// deliveries before the last one ended unanswered (stall_after_unanswered
	// is 3).
	for range 4 {
		p := claimOf(1)
		if leases, err := st.Claim(t.Context(), p); err != nil || len(leases) != 1 || leases[0].Event.ID != ids[0] {
			t.Fatalf("claim: %+v, %v; want revision 1", leases, err)
		}
		if _, err := st.Release(t.Context(), p.Holder); err != nil {
			t.Fatal(err)
		}
	}
	if a, err := st.GetAggregate(t.Context(), "orders", "1"); err != nil || a.StalledReason == "" {
		t.Fatalf("before the skip: %+v, %v; want stalled", a, err)
	}
	if _, err := st.SkipEvent(t.Context(), ids[0], "poison", "ann"); err != nil {
		t.Fatal(err)
	}
	a, err := st.GetAggregate(t.Context(), "orders", "1")
	if err != nil {
		t.Fatal(err)
	}
	if a.State != "ready" || a.StalledReason != "" {
		t.Fatalf("after the skip of its next event: %s, stalled %q; want ready and not stalled", a.State, a.StalledReason)
	}
}
