package server_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/outboxd/outboxd/client"
	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/testdb"
)

// Issue 24 item 9. Accepting a gap while a producer of the missing revision
// has inserted it but not committed: the accept waits for the producer (it
// takes the producers' row lock), then finds the revision there, so it
// records no gap and the revision is delivered in order, not stranded below
// the cursor. The race is forced: the producer's transaction is held until
// pg_blocking_pids shows the accept waiting for it.
func TestAcceptGapWaitsForProducerOfMissingRevision(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	emitAt(t, pool, "orders", "g", 1)
	emitAt(t, pool, "orders", "g", 3)
	waitDiscovered(t, pool, 1) // no round wakes g once it is held at the gap
	first, endFirst := context.WithCancel(ctx)
	ack(t, r, recv(t, subscribe(t, first, r, &outboxv1.SubscribeRequest{MaxInFlight: 4, LeaseTtl: durationpb.New(time.Hour)})))
	waitState(t, pool, "g", "gap")
	// No session while the accept runs: once the producer commits, a
	// discovery round may wake g before the accept locks its delivery row,
	// and with a session waiting it would lease revision 2 to it, which the
	// accept would then refuse as leased. Without one, the round can only
	// make g ready, and the accept finds it gap or ready: either way
	// revision 2 is there and no gap is accepted.
	endFirst()
	waitFor(t, func() int32 {
		if r.Server.Sessions() == 0 {
			return 1
		}
		return 0
	})

	// The producer of revision 2 inserts it and holds its transaction.
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(context.Background()) //nolint:errcheck // committed below
	var producer int32
	if err := tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&producer); err != nil {
		t.Fatal(err)
	}
	id2, err := client.Emit(ctx, tx, client.Event{Stream: "orders", AggregateKey: "g", Type: "T", Payload: []byte(`{}`), Revision: 2})
	if err != nil {
		t.Fatal(err)
	}

	type result struct {
		res *outboxv1.RetryAggregateResponse
		err error
	}
	done := make(chan result, 1)
	go func() {
		res, err := r.Admin.RetryAggregate(ctx, &outboxv1.RetryAggregateRequest{Stream: "orders", AggregateKey: "g",
			AcceptGap: true, Reason: "revision 2 is lost", Actor: "ops"})
		done <- result{res, err}
	}()
	// Commit the producer once the accept waits for it; an accept that does
	// not wait ends first, and the producer commits after it.
	var accepted result
	blocked := false
	for !blocked {
		select {
		case accepted = <-done:
			blocked = true
			t.Log("the accept did not wait for the producer")
			continue
		case <-ctx.Done():
			t.Fatal("the accept neither finished nor blocked on the producer")
		case <-time.After(5 * time.Millisecond): // poll interval of pg_blocking_pids, bounded by ctx
		}
		if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_stat_activity
			WHERE $1 = ANY (pg_blocking_pids(pid)) AND query LIKE '%FROM outbox.aggregate%FOR UPDATE%')`, producer).Scan(&blocked); err != nil {
			t.Fatal(err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if accepted.res == nil && accepted.err == nil {
		select {
		case accepted = <-done:
		case <-ctx.Done():
			t.Fatal("the accept did not finish after the producer committed")
		}
	}
	if accepted.err != nil {
		t.Fatalf("accept gap: %v", accepted.err)
	}
	if a := accepted.res.GetAggregate(); a.GetDeliveredRevision() != 1 || a.GetState() != outboxv1.AggregateState_AGGREGATE_STATE_READY {
		t.Errorf("after the accept: delivered %d, state %v; want 1, ready (revision 2 is there)", a.GetDeliveredRevision(), a.GetState())
	}
	if n := countWhere(t, pool, "outbox.accepted_gap", "true"); n != 0 {
		t.Errorf("%d gaps recorded for a revision that was committed", n)
	}
	// Revision 2 is delivered, then 3: nothing stranded, order kept.
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 4, LeaseTtl: durationpb.New(time.Hour)})
	if d := recv(t, st); d.GetEvent().GetEventId() != id2.ID.String() {
		t.Fatalf("after the accept got revision %d, want the producer's revision 2", d.GetEvent().GetRevision())
	} else {
		ack(t, r, d)
	}
	if d := recv(t, st); d.GetEvent().GetRevision() != 3 {
		t.Fatalf("then revision %d, want 3", d.GetEvent().GetRevision())
	}
}

// wokenFromGap starts a replica on a new database and leaves aggregate g
// of stream orders woken from its gap with no session connected:
// revisions 1, 4 and 5 committed, 1 delivered, g held at the gap of 2-3
// until a round that found 5 woke it (ready).
func wokenFromGap(t *testing.T) (context.Context, *replica, *pgxpool.Pool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	t.Cleanup(cancel)
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	emitAt(t, pool, "orders", "g", 1)
	emitAt(t, pool, "orders", "g", 4)
	waitDiscovered(t, pool, 1)
	first, endFirst := context.WithCancel(ctx)
	ack(t, r, recv(t, subscribe(t, first, r, &outboxv1.SubscribeRequest{MaxInFlight: 1, LeaseTtl: durationpb.New(time.Hour)})))
	waitState(t, pool, "g", "gap")
	// No session: nothing claims g once the round below wakes it.
	endFirst()
	waitFor(t, func() int32 { return 1 - int32(min(r.Server.Sessions(), 1)) })
	emitAt(t, pool, "orders", "g", 5)
	waitState(t, pool, "g", "ready")
	return ctx, r, pool
}

// bulkAcceptGap bulk-retries the gap-held aggregates of stream orders with
// accept_gap.
func bulkAcceptGap(t *testing.T, ctx context.Context, r *replica) *outboxv1.BulkRetryResponse {
	t.Helper()
	filter := &outboxv1.AggregateFilter{Stream: "orders", States: []outboxv1.AggregateState{outboxv1.AggregateState_AGGREGATE_STATE_GAP}}
	res, err := r.Admin.BulkRetry(ctx, &outboxv1.BulkRetryRequest{Filter: filter, AcceptGap: true, Reason: "revisions 2-3 rolled back", Actor: "ops"})
	if err != nil {
		t.Fatal(err)
	}
	return res
}

// requireGapOfGAccepted fails unless revisions 2-3 of g are on record as
// an accepted gap.
func requireGapOfGAccepted(t *testing.T, ctx context.Context, pool *pgxpool.Pool) {
	t.Helper()
	var from, to int64
	if err := pool.QueryRow(ctx, `SELECT from_revision, to_revision FROM outbox.accepted_gap WHERE aggregate_key = 'g'`).
		Scan(&from, &to); err != nil || from != 2 || to != 3 {
		t.Fatalf("accepted gap %d-%d (%v), want 2-3 on record", from, to, err)
	}
}

// requireNextOfG subscribes one event at a time, and fails unless the
// event delivered is revision rev of g; it acks it.
func requireNextOfG(t *testing.T, ctx context.Context, r *replica, rev int64) {
	t.Helper()
	d := recv(t, subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 1, LeaseTtl: durationpb.New(time.Hour)}))
	if e := d.GetEvent(); e.GetAggregateKey() != "g" || e.GetRevision() != rev {
		t.Fatalf("delivered %s revision %d, want g revision %d", e.GetAggregateKey(), e.GetRevision(), rev)
	}
	ack(t, r, d)
}

// An aggregate a discovery round woke out of its gap (it found a later
// event, which might have been the missing revision) reads ready until its
// next claim holds it at the gap again. An operator's accept_gap then still
// gives the missing revisions up: it records them and moves the cursor,
// and the next existing revision is delivered. (It answered "ready,
// nothing to change" before, and the aggregate went back to its gap.)
func TestAcceptGapOfAnAggregateWokenFromItsGap(t *testing.T) {
	t.Parallel()
	ctx, r, pool := wokenFromGap(t)

	res, err := r.Admin.RetryAggregate(ctx, &outboxv1.RetryAggregateRequest{Stream: "orders", AggregateKey: "g",
		AcceptGap: true, Reason: "revisions 2-3 rolled back", Actor: "ops"})
	if err != nil {
		t.Fatal(err)
	}
	if a := res.GetAggregate(); a.GetState() != outboxv1.AggregateState_AGGREGATE_STATE_READY || a.GetDeliveredRevision() != 3 {
		t.Fatalf("after accepting the gap: %v, want ready past revision 3", a)
	}
	requireGapOfGAccepted(t, ctx, pool)
	if n := countWhere(t, pool, "outbox.operator_action", "action = 'retry'"); n != 1 {
		t.Errorf("%d retries on record, want 1", n)
	}
	requireNextOfG(t, ctx, r, 4)
}

// The same through BulkRetry: with accept_gap, a bulk retry of the gap-held
// aggregates takes the ones a discovery round woke (ready, their next
// revision still missing) as well, and leaves a ready aggregate with nothing
// missing alone.
func TestBulkAcceptGapTakesAggregatesWokenFromTheirGap(t *testing.T) {
	t.Parallel()
	ctx, r, pool := wokenFromGap(t)
	emitAt(t, pool, "orders", "h", 1)
	emitAt(t, pool, "orders", "h", 2)
	waitState(t, pool, "h", "ready")

	if res := bulkAcceptGap(t, ctx, r); res.GetMatched() != 1 || res.GetRetried() != 1 {
		t.Fatalf("bulk retry matched %d and retried %d, want g alone (1 and 1)", res.GetMatched(), res.GetRetried())
	}
	requireGapOfGAccepted(t, ctx, pool)
	if n := countWhere(t, pool, "outbox.accepted_gap", "aggregate_key = 'h'"); n != 0 {
		t.Fatalf("%d gaps accepted for h, which has none", n)
	}
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 2, LeaseTtl: durationpb.New(time.Hour)})
	// Each aggregate's first delivery, in whatever order they interleave:
	// a claim may lease g alone, and the ack of g's revision 4 then hands
	// over revision 5 (older than h's first) before h comes.
	first := map[string]int64{}
	for n := 0; len(first) < 2; n++ {
		if n == 4 {
			t.Fatalf("4 deliveries, first revisions %v: want g and h", first)
		}
		d := recv(t, st)
		if _, seen := first[d.GetEvent().GetAggregateKey()]; !seen {
			first[d.GetEvent().GetAggregateKey()] = d.GetEvent().GetRevision()
		}
		ack(t, r, d)
	}
	if first["g"] != 4 || first["h"] != 1 {
		t.Fatalf("first delivered %v, want g at revision 4 and h at 1", first)
	}
}

// A bulk accept_gap that matched an aggregate woken from its gap, whose
// missing revisions a producer then commits before the retry reaches it,
// accepts no gap (the retry checks under the producers' lock) and does not
// count the aggregate as retried: the response says what was done.
func TestBulkAcceptGapCountsNoneWhoseGapFilledAfterTheMatch(t *testing.T) {
	t.Parallel()
	ctx, r, pool := wokenFromGap(t)
	// The hook runs on the admin call's goroutine, where t.Fatal may not:
	// it sends its outcome, checked after the call.
	filled := make(chan error, 1)
	r.Server.SetBeforeBulkAct(func(_ context.Context, stream, key string) {
		if key != "g" {
			return
		}
		var err error
		for rev := int64(2); rev <= 3 && err == nil; rev++ {
			_, err = client.Emit(ctx, pool, client.Event{Stream: "orders", AggregateKey: "g", Type: "T", Payload: []byte(`{}`), Revision: rev})
		}
		filled <- err
	})

	res := bulkAcceptGap(t, ctx, r)
	select {
	case err := <-filled:
		if err != nil {
			t.Fatalf("committing revisions 2-3 of g before its retry: %v", err)
		}
	default:
		t.Fatal("the bulk retry never came to act on g")
	}
	if res.GetMatched() != 1 || res.GetRetried() != 0 {
		t.Fatalf("bulk retry matched %d and retried %d, want g matched (1) and none retried (its gap filled)", res.GetMatched(), res.GetRetried())
	}
	// Its record says the same: finished, having retried nothing.
	if acts := listActions(t, r, &outboxv1.ListOperatorActionsRequest{Action: "bulk_retry"}); len(acts) != 1 ||
		acts[0].GetFinishedAt() == nil || acts[0].GetAggregates() != 0 || acts[0].GetEvents() != 0 {
		t.Fatalf("bulk retry on record: %v, want one, finished, with 0 aggregates and 0 events", acts)
	}
	if n := countWhere(t, pool, "outbox.accepted_gap", "aggregate_key = 'g'"); n != 0 {
		t.Fatalf("%d gaps accepted for g, whose revisions 2-3 were committed before the retry", n)
	}
	requireNextOfG(t, ctx, r, 2)
}
