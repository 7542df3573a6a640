package server_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/server"
)

// parkedAndLeased leaves aggregate p of stream orders parked and q leased
// by a session that stays connected, and returns q's delivery.
func parkedAndLeased(t *testing.T) (context.Context, *replica, *pgxpool.Pool, *outboxv1.SubscribeResponse) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	t.Cleanup(cancel)
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, func(c *server.Config) { c.MaxFailures = 1 })
	emit(t, pool, "orders", "p", 1)
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 1, LeaseTtl: durationpb.New(time.Hour)})
	nack(t, r, recv(t, st)) // parks p
	emit(t, pool, "orders", "q", 1)
	q := recv(t, st)
	if q.GetEvent().GetAggregateKey() != "q" {
		t.Fatalf("delivered %v, want q", q.GetEvent())
	}
	return ctx, r, pool, q
}

// A bulk retry without states retries what it can, parked and backing-off
// aggregates, and counts only those as matched: a leased one is neither
// matched nor sampled.
func TestBulkRetryMatchesOnlyRetryableStates(t *testing.T) {
	t.Parallel()
	ctx, r, _, _ := parkedAndLeased(t)
	filter := &outboxv1.AggregateFilter{Stream: "orders"}
	dry, err := r.Admin.BulkRetry(ctx, &outboxv1.BulkRetryRequest{Filter: filter, DryRun: true})
	if err != nil || dry.GetMatched() != 1 || len(dry.GetSample()) != 1 || dry.GetSample()[0].GetAggregateKey() != "p" {
		t.Fatalf("dry run of a bulk retry of orders: %v, %v; want p alone matched", dry, err)
	}
	res, err := r.Admin.BulkRetry(ctx, &outboxv1.BulkRetryRequest{Filter: filter, Reason: "broker is back"})
	if err != nil || res.GetMatched() != 1 || res.GetRetried() != 1 {
		t.Fatalf("bulk retry of orders: %v, %v; want p matched and retried", res, err)
	}
}

// A bulk retry with accept_gap retries a parked aggregate as a plain retry:
// it does not take the producers' lock of the aggregate, which only
// accepting a gap needs, so a producer's open transaction on it does not
// hold the retry up.
func TestBulkAcceptGapRetriesParkedWithoutTheProducersLock(t *testing.T) {
	t.Parallel()
	ctx, r, pool, _ := parkedAndLeased(t)
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(context.Background())
	if _, err := tx.Exec(ctx, `SELECT outbox.emit('orders', 'p', 'Changed', '{}'::jsonb)`); err != nil {
		t.Fatal(err)
	}
	res, err := r.Admin.BulkRetry(ctx, &outboxv1.BulkRetryRequest{Filter: &outboxv1.AggregateFilter{Stream: "orders",
		States: []outboxv1.AggregateState{outboxv1.AggregateState_AGGREGATE_STATE_PARKED, outboxv1.AggregateState_AGGREGATE_STATE_GAP}},
		AcceptGap: true, Reason: "broker is back"})
	if err != nil || res.GetRetried() != 1 {
		t.Fatalf("bulk accept_gap retry with a producer's transaction open on p: %v, %v (%v); want p retried", res, err, status.Code(err))
	}
}

// A bulk retry's answer counts as matched every aggregate it came to act
// on, one that came to match ahead of its walk included: matched is never
// below retried. The walk reads one aggregate a page; q, leased at the
// start, is parked (its relay nacks it) once the walk has acted on p.
func TestBulkRetryMatchedCountsWhatCameToMatchDuringTheWalk(t *testing.T) {
	t.Parallel()
	ctx, r, _, q := parkedAndLeased(t)
	// The hook runs on the admin call's goroutine, where t.Fatal may not.
	var once sync.Once
	nacked := make(chan error, 1)
	r.Server.SetBulkPage(1, func() {
		once.Do(func() {
			_, err := r.Relay.Nack(ctx, &outboxv1.NackRequest{EventId: q.GetEvent().GetEventId(),
				LeaseToken: q.GetLeaseToken(), Error: "broker said no"})
			nacked <- err
		})
	})
	res, err := r.Admin.BulkRetry(ctx, &outboxv1.BulkRetryRequest{Filter: &outboxv1.AggregateFilter{Stream: "orders"}})
	if err != nil {
		t.Fatal(err)
	}
	if err := <-nacked; err != nil {
		t.Fatalf("nack of q during the walk: %v", err)
	}
	if res.GetRetried() != 2 || res.GetMatched() != 2 {
		t.Errorf("bulk retry: matched %d, retried %d; want 2 and 2 (q came to match ahead of the walk)",
			res.GetMatched(), res.GetRetried())
	}
}

// A bulk skip skips the event that was next when its aggregate matched,
// and when a relay publishes that event before the skip reaches it, the
// skip passes it by without failing the action: here q's relay acks q while
// the walk is about to act on q. p is skipped, q is published, not skipped,
// and the call succeeds.
func TestBulkSkipPassesByAnEventPublishedMeanwhile(t *testing.T) {
	t.Parallel()
	ctx, r, pool, q := parkedAndLeased(t)
	acked := make(chan []*outboxv1.AckResult, 1)
	r.Server.SetBeforeBulkAct(func(_ context.Context, _, key string) {
		if key != "q" {
			return
		}
		res, err := r.Relay.Ack(ctx, &outboxv1.AckRequest{Acks: []*outboxv1.AckItem{{EventId: q.GetEvent().GetEventId(), LeaseToken: q.GetLeaseToken()}}})
		if err != nil {
			res = nil
		}
		acked <- res.GetResults()
	})
	res, err := r.Admin.BulkSkip(ctx, &outboxv1.BulkSkipRequest{Filter: &outboxv1.AggregateFilter{Stream: "orders"}, Reason: "poison"})
	if err != nil {
		t.Fatalf("bulk skip with q published during the walk: %v", err)
	}
	if got := <-acked; len(got) != 1 || got[0].GetStatus() != outboxv1.AckStatus_ACK_STATUS_PUBLISHED {
		t.Fatalf("q's ack during the walk: %v", got)
	}
	if res.GetSkipped() != 1 {
		t.Errorf("bulk skip: %d skipped, want 1 (p; q was published meanwhile)", res.GetSkipped())
	}
	if publishedAt(t, pool, q.GetEvent().GetEventId()) == nil {
		t.Error("q's event is not published")
	}
	if n := countWhere(t, pool, "outbox.skipped_event", "true"); n != 1 {
		t.Errorf("%d events skipped, want 1", n)
	}
}

// A bulk retry passes by an aggregate whose state changed since it matched
// (here leased again: an operator's single retry and the relay's claim
// come between the match and the act), without failing the action.
func TestBulkRetryPassesByAnAggregateLeasedMeanwhile(t *testing.T) {
	t.Parallel()
	ctx, r, pool, q := parkedAndLeased(t)
	leased := make(chan error, 1)
	var once sync.Once
	r.Server.SetBeforeBulkAct(func(_ context.Context, _, key string) {
		if key != "p" {
			return
		}
		once.Do(func() {
			// q's ack frees the session's credit; the retry makes p ready
			// and wakes the session, which leases it.
			if _, err := r.Relay.Ack(ctx, &outboxv1.AckRequest{Acks: []*outboxv1.AckItem{{EventId: q.GetEvent().GetEventId(), LeaseToken: q.GetLeaseToken()}}}); err != nil {
				leased <- err
				return
			}
			if _, err := r.Admin.RetryAggregate(ctx, &outboxv1.RetryAggregateRequest{Stream: "orders", AggregateKey: "p"}); err != nil {
				leased <- err
				return
			}
			for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
				var st string
				if err := pool.QueryRow(ctx, `SELECT state FROM outbox.delivery WHERE aggregate_key = 'p'`).Scan(&st); err == nil && st == "leased" {
					leased <- nil
					return
				}
			}
			leased <- errors.New("p not leased again within 30s")
		})
	})
	res, err := r.Admin.BulkRetry(ctx, &outboxv1.BulkRetryRequest{Filter: &outboxv1.AggregateFilter{Stream: "orders"}})
	if err != nil {
		t.Fatalf("bulk retry with p leased again during the walk: %v", err)
	}
	if err := <-leased; err != nil {
		t.Fatal(err)
	}
	if res.GetRetried() != 0 {
		t.Errorf("bulk retry: %d retried, want 0 (p was leased when the walk came to it)", res.GetRetried())
	}
}
