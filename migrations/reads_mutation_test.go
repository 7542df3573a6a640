package migrations_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxd/outboxd/internal/store"
	"github.com/outboxd/outboxd/internal/testdb"
)

// Tests written against mutants of the reads (the claim index's probes:
// claim_ranges, claim_range_heads, claim_probe, waiting_streams; and the
// lag reads: stranded, undiscovered, xmin_horizon_holders) that every
// other test let through: each holds one promise of those functions.

// deliverNext claims the oldest claimable aggregate and acks its event,
// which must be key's revision rev.
func deliverNext(t *testing.T, pool *pgxpool.Pool, key string, rev int64) {
	t.Helper()
	l := claimFor(t, pool, uuid.New())
	if l.key != key || l.revision != rev {
		t.Fatalf("claimed %s/%d, want %s/%d", l.key, l.revision, key, rev)
	}
	if n := count(t, pool, fmt.Sprintf(`SELECT count(*) FROM outbox.ack(ARRAY['%s'::uuid], 'x') WHERE status = 'published'`, l.id)); n != 1 {
		t.Fatalf("the ack of %s/%d did not publish it", key, rev)
	}
}

// A late event stays on record as late (outbox.late_event is never
// emptied), but once delivery has published it, it is delivered, not
// stranded. That happens when an operator skips the late event and then
// republishes with the skipped events included: the republish withdraws
// the skip, rewinds the cursor below the late revision, and delivery hands
// it out and publishes it in revision order. stranded then reads 0 again.
// Kills a stranded whose late part counts a late event however it ended
// up, published included (S8).
func TestStrandedLeavesOutALateEventARepublishDelivered(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pool := testdb.NewPool(t)
	s := store.New(pool)
	emitAtTheCursor(t, pool, nil) // orders/o-1: 5 discovered (cursor 4), then 4 at the cursor
	discover(t, pool)             // records revision 4 as late
	deliverNext(t, pool, "o-1", 5)
	if n := strandedEvents(t, pool); n != 1 {
		t.Fatalf("%d stranded events before the skip, want 1 (revision 4)", n)
	}
	if _, err := s.SkipEvent(ctx, eventID(t, pool, "o-1", 4), "late", "test"); err != nil {
		t.Fatal(err)
	}
	res, err := s.Republish(ctx, store.RepublishParams{Stream: "orders", AggregateKey: "o-1", FromRevision: 1,
		IncludeSkipped: true, Own: &store.OperatorAction{Action: "republish", Actor: "test", Reason: "test", Stream: "orders"}})
	if err != nil {
		t.Fatal(err)
	}
	if res.FromRevision != 4 || res.ToRevision != 5 || res.Unskipped != 1 {
		t.Fatalf("republish %+v, want revisions 4 to 5 with revision 4 unskipped", res)
	}
	deliverNext(t, pool, "o-1", 4)
	deliverNext(t, pool, "o-1", 5)
	if n := count(t, pool, `SELECT count(*) FROM outbox.late_event l JOIN outbox.event e USING (event_id)
		WHERE e.revision = 4 AND e.published_at IS NOT NULL`); n != 1 {
		t.Fatal("revision 4 is not on record as a late event that was published")
	}
	if n := strandedEvents(t, pool); n != 0 {
		t.Fatalf("%d stranded events once the republish delivered the late revision 4, want 0", n)
	}
}

// A replication slot holds the horizon only while it has an xmin (a
// standby's feedback through it): a physical slot without one (no standby
// has used it, or it never asked for feedback) keeps WAL, not row
// versions, and is not listed as a holder. Kills a list that takes every
// slot (X6).
func TestXminHorizonHoldersLeaveOutASlotWithoutAnXmin(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pool := testdb.NewPool(t)
	slot := "reads_" + strings.ReplaceAll(uuid.NewString()[:8], "-", "")
	// Slots are the cluster's, made by a superuser (or a replication role).
	admin, err := pgx.Connect(ctx, testdb.ServerURL())
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close(context.WithoutCancel(ctx))
	if _, err := admin.Exec(ctx, `SELECT pg_create_physical_replication_slot($1)`, slot); err != nil {
		t.Fatal(err)
	}
	defer func() { _, _ = admin.Exec(context.WithoutCancel(ctx), `SELECT pg_drop_replication_slot($1)`, slot) }()
	if n := count(t, pool, fmt.Sprintf(`SELECT count(*) FROM pg_replication_slots WHERE slot_name = '%s' AND xmin IS NULL`, slot)); n != 1 {
		t.Fatal("the new slot has an xmin")
	}
	if n := count(t, pool, fmt.Sprintf(`SELECT count(*) FROM outbox.xmin_horizon_holders() WHERE holder = 'replication slot %s'`, slot)); n != 0 {
		t.Fatalf("the slot without an xmin is listed as a holder")
	}
}

// undiscovered's oldest is the created_at of a stream's oldest event not
// yet discovered (lag shows from when work has waited), not its newest.
// Kills an undiscovered that reports the newest (U12).
func TestUndiscoveredReportsTheOldestEvent(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	emitTo(t, pool, "orders", "first", 1) // one transaction each: created_at rises
	emitTo(t, pool, "orders", "second", 1)
	var got string
	if err := pool.QueryRow(testContext(t), `SELECT u.events || ' events, the oldest of ' ||
		(SELECT e.aggregate_key FROM outbox.event e WHERE e.created_at = u.oldest_created_at)
		FROM outbox.undiscovered(NULL) u`).Scan(&got); err != nil {
		t.Fatal(err)
	}
	if want := "2 events, the oldest of first"; got != want {
		t.Fatalf("undiscovered: %q, want %q", got, want)
	}
}

// An event is left to its own aggregate's delivery row, of its own
// stream: a new aggregate of payments is undiscovered though orders has a
// pending aggregate under the same key, whose row counts only orders'
// events. Kills an undiscovered that probes delivery by key alone (U13).
func TestUndiscoveredJudgesAnEventByItsOwnStreamsRow(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	emitTo(t, pool, "orders", "k", 1)
	discover(t, pool) // orders/k pending, revision 1 after its cursor
	emitTo(t, pool, "payments", "k", 1)
	if got := streamCounts(t, pool, `SELECT stream, events FROM outbox.undiscovered(NULL)`); got != "payments=1" {
		t.Fatalf("undiscovered: %q, want payments=1", got)
	}
}

// A backoff whose next attempt lies further ahead than any the server
// sets (p_max_due), as a clock stepped back leaves it, is claimable now,
// as such a lease is: the claim takes it, and the probe says work is
// claimable. Within the bound it still waits. (The tests of a clock step
// back hold leases only.) Kills claim_ranges without its backoff range
// beyond p_max_due (CR5).
func TestABackoffBeyondTheLongestIsClaimableAfterAClockStepBack(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	emitTo(t, pool, "orders", "far", 1)
	emitTo(t, pool, "orders", "near", 1)
	discover(t, pool)
	exec(t, pool, `UPDATE outbox.delivery SET state = 'backoff', failures = 1, last_error = 'broker down',
		next_attempt_at = clock_timestamp() + CASE aggregate_key WHEN 'far' THEN interval '10 hours' ELSE interval '30 minutes' END,
		claimable_at = clock_timestamp() + CASE aggregate_key WHEN 'far' THEN interval '10 hours' ELSE interval '30 minutes' END`)
	if n := count(t, pool, `SELECT count(*) FROM outbox.probe_claims(NULL, NULL, interval '1 hour') WHERE oldest IS NOT NULL`); n != 1 {
		t.Fatal("the probe does not say a backoff ten hours ahead, beyond max_due, is claimable")
	}
	if got := streamCounts(t, pool, `SELECT aggregate_key, attempt FROM outbox.claim(gen_random_uuid(), 'r', 'x', NULL, 10,
		interval '1 minute', NULL, NULL, 1, NULL, interval '1 hour')`); got != "far=1" {
		t.Fatalf("claimed %q, want far alone (near's next attempt is within max_due)", got)
	}
}

// A session of another database holds this database's horizon only from
// its transaction id on: its snapshot, older, holds back only its own
// database's (pg_dump there is nothing to this one). Its age here is that
// of its id, not of its snapshot. Kills an age that takes the snapshot of
// a session of any database (X1).
func TestXminHorizonHoldersAgeAnotherDatabasesSessionByItsID(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	url, elsewhere := testdb.New(t), testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	app := "elsewhere-" + uuid.NewString()[:8]
	cfg, err := pgx.ParseConfig(elsewhere)
	if err != nil {
		t.Fatal(err)
	}
	cfg.RuntimeParams["application_name"] = app
	holder, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Close(context.WithoutCancel(ctx))
	// The snapshot first, 1000 transactions before the id (far more than
	// the tests running beside this one commit between the id and the
	// read).
	if _, err := holder.Exec(ctx, `BEGIN ISOLATION LEVEL REPEATABLE READ`); err != nil {
		t.Fatal(err)
	}
	if _, err := holder.Exec(ctx, `SELECT 1`); err != nil {
		t.Fatal(err)
	}
	exec(t, pool, `DO $$ BEGIN FOR i IN 1..1000 LOOP PERFORM txid_current(); COMMIT; END LOOP; END $$`)
	if _, err := holder.Exec(ctx, `SELECT txid_current()`); err != nil {
		t.Fatal(err)
	}
	var age int64
	if err := pool.QueryRow(ctx, `SELECT age FROM outbox.xmin_horizon_holders() WHERE holder LIKE '%application ' || $1 || '%'`, app).
		Scan(&age); err != nil {
		t.Fatalf("the other database's session with an id is not listed: %v", err)
	}
	if age >= 1000 {
		t.Fatalf("the other database's session is listed %d transactions back, want its id's age (its snapshot is 1000 back)", age)
	}
}

// With nothing claimable, the probe's next_at is when the first aggregate
// becomes so, the earliest of every stream's leases and backoffs, and of
// the leases within a stream the first to expire: an idle replica's polls
// skip their claims until then (RoundDue's NextIn), so a later time would
// leave the first expiry unclaimed past it. Kills a next_at that takes the
// last of the ranges' heads (CP3), and range heads read from the end of
// each range (CRH1).
func TestTheClaimProbeSaysWhenTheFirstAggregateBecomesClaimable(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	emitTo(t, pool, "orders", "first", 1)
	emitTo(t, pool, "orders", "later", 1)
	emitTo(t, pool, "orders", "backoff", 1)
	emitTo(t, pool, "payments", "later", 1)
	discover(t, pool)
	// orders/first's lease expires in 10 minutes, the others' in 2 hours;
	// orders/backoff's next attempt is in an hour.
	exec(t, pool, `UPDATE outbox.delivery SET state = 'leased', holder = gen_random_uuid(), attempt = 1, leased_through = 1,
		leased_event_id = (SELECT e.event_id FROM outbox.event e WHERE e.stream = delivery.stream AND e.aggregate_key = delivery.aggregate_key),
		lease_expires_at = clock_timestamp() + CASE aggregate_key WHEN 'first' THEN interval '10 minutes' ELSE interval '2 hours' END,
		claimable_at = clock_timestamp() + CASE aggregate_key WHEN 'first' THEN interval '10 minutes' ELSE interval '2 hours' END
		WHERE aggregate_key IN ('first', 'later')`)
	exec(t, pool, `UPDATE outbox.delivery SET state = 'backoff', failures = 1, last_error = 'broker down',
		next_attempt_at = clock_timestamp() + interval '1 hour', claimable_at = clock_timestamp() + interval '1 hour'
		WHERE aggregate_key = 'backoff'`)
	for _, maxDue := range []string{"NULL", "interval '3 hours'"} {
		if n := count(t, pool, `SELECT count(*) FROM outbox.probe_claims(NULL, NULL, `+maxDue+`) p
			WHERE p.oldest IS NULL AND p.next_at BETWEEN now() + interval '9 minutes' AND now() + interval '11 minutes'`); n != 1 {
			t.Fatalf("max_due %s: the probe does not say the first aggregate is claimable in 10 minutes", maxDue)
		}
	}
}

// waiting_streams lists a stream only once its oldest ready aggregate has
// waited longer than idle_relay_after: work that came a moment ago, which
// any relay may be claiming now, does not make its relays look idle.
// Kills a waiting_streams without the idle_relay_after margin (W4).
func TestWaitingStreamsLeaveOutWorkYoungerThanTheLimit(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	exec(t, pool, `UPDATE outbox.settings SET idle_relay_after = '1 hour'`)
	emitTo(t, pool, "orders", "new", 1)
	discover(t, pool)
	if got := streamCounts(t, pool, `SELECT stream, 1 FROM outbox.waiting_streams(NULL)`); got != "" {
		t.Fatalf("waiting streams: %q, want none (orders' work came a moment ago)", got)
	}
}

// The claim order of a ready aggregate whose head lies ahead of the clock
// (a clock stepped back) is now, in the probe as in the claim: the probe's
// oldest is never later than its clock, so an ack's hand-over still yields
// to such work, which is the oldest there is. Kills a probe that takes the
// head's created_at as it is (CP1).
func TestTheClaimProbesOldestIsNeverAheadOfItsClock(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	emitTo(t, pool, "orders", "ahead", 1)
	discover(t, pool)
	shiftIntoFuture(t, pool, "orders", 20*time.Minute)
	if n := count(t, pool, `SELECT count(*) FROM outbox.probe_claims(NULL, NULL, interval '1 hour') p
		WHERE p.oldest <= now()`); n != 1 {
		t.Fatal("the probe's oldest lies ahead of its clock (or it finds nothing claimable)")
	}
}

// The probe's oldest is the claim order of the oldest claimable aggregate
// across every stream it takes, not of some stream's: an ack's hand-over
// yields while anything older waits. Kills a probe whose oldest is the
// newest of the streams' heads (CP4).
func TestTheClaimProbesOldestIsTheOldestAcrossStreams(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	emitTo(t, pool, "orders", "old", 1) // one transaction each: created_at rises
	emitTo(t, pool, "payments", "new", 1)
	discover(t, pool)
	var got string
	if err := pool.QueryRow(testContext(t), `SELECT (SELECT e.aggregate_key FROM outbox.event e WHERE e.created_at = p.oldest)
		FROM outbox.probe_claims(NULL, NULL, interval '1 hour') p`).Scan(&got); err != nil {
		t.Fatal(err)
	}
	if got != "old" {
		t.Fatalf("the probe's oldest is %s's claim order, want old's", got)
	}
}
