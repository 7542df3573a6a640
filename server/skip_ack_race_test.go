package server_test

// Tests written against mutants of the SQL SkipEvent sends (internal/store)
// that the server's tests let through.

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/types/known/durationpb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/testdb"
)

// waitBlocked polls pg_blocking_pids until a session of this database
// whose statement matches one of the LIKE patterns waits for a lock.
func waitBlocked(t *testing.T, ctx context.Context, pool *pgxpool.Pool, what string, patterns ...string) {
	t.Helper()
	for {
		var blocked bool
		if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_stat_activity
			WHERE datname = current_database() AND cardinality(pg_blocking_pids(pid)) > 0 AND query LIKE ANY ($1))`, patterns).Scan(&blocked); err != nil {
			t.Fatal(err)
		}
		if blocked {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatalf("waiting for %s to block: %v", what, ctx.Err())
		case <-time.After(5 * time.Millisecond): // poll interval of pg_blocking_pids, bounded by ctx
		}
	}
}

// A skip racing an ack of the same event: whichever locks the event first
// decides, and an event is never both published and skipped (invariant 3).
// Here the ack has locked the event and waits for the delivery row (a
// test transaction holds it); the skip comes next, must wait for the ack
// and then refuse the published event, rather than record a skip beside
// the publish.
func TestSkipRacingAnAckOfItsEventWaitsForIt(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	ids := emit(t, pool, "orders", "k", 1)
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{Streams: []string{"orders"}, MaxInFlight: 1, LeaseTtl: durationpb.New(time.Hour)})
	d := recv(t, st)

	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx))
	if _, err := tx.Exec(ctx, `SELECT 1 FROM outbox.delivery WHERE stream = 'orders' AND aggregate_key = 'k' FOR UPDATE`); err != nil {
		t.Fatal(err)
	}
	acked := make(chan error, 1)
	go func() {
		res, err := r.Relay.Ack(ctx, &outboxv1.AckRequest{Acks: []*outboxv1.AckItem{{EventId: d.GetEvent().GetEventId(), LeaseToken: d.GetLeaseToken()}}})
		if err == nil && res.GetResults()[0].GetStatus() != outboxv1.AckStatus_ACK_STATUS_PUBLISHED {
			err = fmt.Errorf("ack answered %v", res.GetResults()[0])
		}
		acked <- err
	}()
	waitBlocked(t, ctx, pool, "the ack", "%outbox.ack%")
	skipped := make(chan error, 1)
	go func() {
		_, err := r.Admin.SkipEvent(ctx, &outboxv1.SkipEventRequest{EventId: ids[0].String(), Reason: "racing"})
		skipped <- err
	}()
	// Waiting for the event (the ack's), or for the delivery row (the test's).
	waitBlocked(t, ctx, pool, "the skip", "%FROM outbox.event e WHERE e.event_id = $1%", "%leased_through%FROM outbox.delivery%")
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-acked; err != nil {
		t.Fatal(err)
	}
	wantCode(t, <-skipped, codes.FailedPrecondition, "")
	if n := countWhere(t, pool, "outbox.event e", "published_at IS NOT NULL AND EXISTS (SELECT 1 FROM outbox.skipped_event s WHERE s.event_id = e.event_id)"); n != 0 {
		t.Fatalf("%d events both published and skipped", n)
	}
}
