package server_test

// Tests written against mutants of the SQL SkipEvent sends (internal/store)
// that the server's tests let through.

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/types/known/durationpb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/store"
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

// A skip of the revision after the head, racing a claim that would lease
// it in a window with the head: the skip locks the delivery row before it
// decides whether a lease covers its event, so a claim either leased the
// window before (and the skip ends that lease) or waits for the skip and
// then steps over the event. Here the skip has read the row and waits to
// record itself (a test transaction holds outbox.skipped_event in SHARE
// mode); a window session's claim comes next and must wait for it, not
// lease the skipped revision beside the head unseen by the skip.
func TestSkipOfARevisionAWindowWouldCoverHoldsItsRowAgainstClaims(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	ids := emit(t, pool, "orders", "w", 2)
	// Discovered with no session to dispatch to: ready for a claim.
	eventually(t, func() (bool, string) {
		n := countWhere(t, pool, "outbox.delivery", "stream = 'orders' AND aggregate_key = 'w' AND state = 'ready'")
		return n == 1, "orders/w not ready"
	})

	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx))
	if _, err := tx.Exec(ctx, `LOCK TABLE outbox.skipped_event IN SHARE MODE`); err != nil {
		t.Fatal(err)
	}
	skipped := make(chan error, 1)
	go func() {
		_, err := r.Admin.SkipEvent(ctx, &outboxv1.SkipEventRequest{EventId: ids[1].String(), Reason: "racing a claim"})
		skipped <- err
	}()
	waitBlocked(t, ctx, pool, "the skip", "%INSERT INTO outbox.skipped_event%")

	// The first claim, made while the skip holds the row, passes over the
	// aggregate (claims skip locked rows); one that does not see the
	// skip's lock leases the window, the skipped revision in it.
	claimed := make(chan []store.Lease, 1)
	var once sync.Once
	r.Server.SetAfterClaim(func(leases []store.Lease, err error) ([]store.Lease, error) {
		if err == nil {
			once.Do(func() { claimed <- leases })
		}
		return leases, err
	})
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{Streams: []string{"orders"}, MaxInFlight: 2,
		MaxInFlightPerAggregate: 2, LeaseTtl: durationpb.New(time.Hour)})
	select {
	case leases := <-claimed:
		for _, l := range leases {
			t.Errorf("the claim leased revision %d while the skip of revision 2 held the aggregate's row", l.Event.Revision)
		}
	case <-ctx.Done():
		t.Fatalf("waiting for the session's first claim: %v", ctx.Err())
	}
	deliveries := make(chan *outboxv1.SubscribeResponse, 4)
	go func() {
		defer close(deliveries)
		for {
			d, err := st.Recv()
			if err != nil {
				return
			}
			deliveries <- d
		}
	}()
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-skipped; err != nil {
		t.Fatalf("skip: %v", err)
	}
	// The claim leases the head alone; the next delivery steps over the
	// skipped revision.
	d := <-deliveries
	if d.GetEvent().GetRevision() != 1 {
		t.Fatalf("first delivery is revision %d, want 1", d.GetEvent().GetRevision())
	}
	ackPublished(t, r, d)
	emit(t, pool, "orders", "w", 1)
	if d := <-deliveries; d.GetEvent().GetRevision() != 3 {
		t.Fatalf("after the head, revision %d was delivered, want 3 (2 is skipped)", d.GetEvent().GetRevision())
	}
}
