package server_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/server"
)

// bulkPages makes a replica's bulk actions stop after each page of n
// aggregates until the test has let a relay deliver: pages receives one
// value per page acted on, and the action reads the next page once resume
// has received one.
type bulkPages struct {
	pages, resume chan struct{}
}

func pauseBulkPages(t *testing.T, r *replica, n int) *bulkPages {
	b := &bulkPages{pages: make(chan struct{}), resume: make(chan struct{})}
	stop := make(chan struct{})
	t.Cleanup(func() { close(stop) }) // before the replica stops: let a held action go
	r.Server.SetBulkPage(n, func() {
		select {
		case b.pages <- struct{}{}:
			select {
			case <-b.resume:
			case <-stop:
			}
		case <-stop:
		}
	})
	return b
}

// run calls action in its own goroutine and, each time it stops between
// pages, between(page) in the test's goroutine before it goes on; it
// returns once action has.
func (b *bulkPages) run(ctx context.Context, t *testing.T, action func() error, between func(page int)) {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- action() }()
	for page := 1; ; page++ {
		select {
		case <-b.pages:
			between(page)
			b.resume <- struct{}{}
		case err := <-done:
			if err != nil {
				t.Fatal(err)
			}
			return
		case <-ctx.Done():
			t.Fatal("bulk action did not end in time")
		}
	}
}

// Issue 24 item 1. A bulk skip skips one event per matched aggregate, even
// when a relay delivers what it released between its pages and the
// aggregate then fails again the same way (so that it matches the filter
// again, with a pending_since later than every other's).
func TestBulkSkipActsOncePerAggregateWhileRelaysDeliver(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, func(c *server.Config) {
		c.MaxFailures = 100 // back off, never park
		c.BackoffBase, c.BackoffCap = time.Hour, time.Hour
	})
	const aggs, page = 6, 2
	pages := pauseBulkPages(t, r, page)
	// Revision 1 of every aggregate, then every revision 2, then every 3:
	// a revision 3 is younger than every revision 1.
	for rev := 1; rev <= 3; rev++ {
		for i := range aggs {
			emit(t, pool, "bulk", fmt.Sprintf("k-%d", i), 1)
		}
	}
	// The receiver refuses revisions 1 and 3 and accepts 2.
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{Streams: []string{"bulk"}, MaxInFlight: 4, LeaseTtl: durationpb.New(time.Hour)})
	refuse := func(d *outboxv1.SubscribeResponse) {
		t.Helper()
		if _, err := r.Relay.Nack(ctx, &outboxv1.NackRequest{EventId: d.GetEvent().GetEventId(), LeaseToken: d.GetLeaseToken(),
			Error: fmt.Sprintf("receiver refused revision %d", d.GetEvent().GetRevision())}); err != nil {
			t.Fatal(err)
		}
	}
	for range aggs {
		d := recv(t, st)
		if d.GetEvent().GetRevision() != 1 {
			t.Fatalf("first deliveries: got revision %d", d.GetEvent().GetRevision())
		}
		refuse(d)
	}
	filter := &outboxv1.AggregateFilter{Stream: "bulk", States: []outboxv1.AggregateState{outboxv1.AggregateState_AGGREGATE_STATE_BACKOFF},
		ErrorContains: "refused"}
	dry, err := r.Admin.BulkSkip(ctx, &outboxv1.BulkSkipRequest{Filter: filter, Reason: "poison", DryRun: true})
	if err != nil || dry.GetMatched() != aggs {
		t.Fatalf("dry run: %v, %v; want %d matched", dry, err, aggs)
	}

	var res *outboxv1.BulkSkipResponse
	delivered := 0
	pages.run(ctx, t, func() (err error) {
		res, err = r.Admin.BulkSkip(ctx, &outboxv1.BulkSkipRequest{Filter: filter, Reason: "poison"})
		return err
	}, func(n int) {
		if n > aggs/page {
			t.Fatalf("the bulk skip read a page after its %d pages of %d: an aggregate came round again", aggs/page, page)
		}
		// The page's aggregates were released at revision 2: the relay
		// publishes it and is refused revision 3, so each is in backoff
		// again with a matching error, behind every other aggregate.
		for refused := 0; refused < page; {
			d := recv(t, st)
			switch d.GetEvent().GetRevision() {
			case 2:
				ack(t, r, d)
				delivered++
			case 3:
				refuse(d)
				refused++
			default:
				t.Fatalf("between pages: got revision %d of %s", d.GetEvent().GetRevision(), d.GetEvent().GetAggregateKey())
			}
		}
	})
	if delivered == 0 {
		t.Fatal("no relay delivered between pages: the race was not set up")
	}
	if res.GetSkipped() != dry.GetMatched() || res.GetMatched() != dry.GetMatched() {
		t.Fatalf("skipped %d of %d matched; the dry run matched %d", res.GetSkipped(), res.GetMatched(), dry.GetMatched())
	}
	if n := countWhere(t, pool, `outbox.skipped_event s JOIN outbox.event e USING (event_id)`, `e.revision = 1`); n != aggs {
		t.Errorf("%d revisions 1 skipped, want %d", n, aggs)
	}
	if n := countWhere(t, pool, `outbox.skipped_event s JOIN outbox.event e USING (event_id)`, `e.revision <> 1`); n != 0 {
		t.Errorf("%d later revisions skipped, want none", n)
	}
}

// Issue 24 item 1. A bulk retry with accept_gap accepts one gap per matched
// aggregate, even when a relay delivers what it released between its pages
// and the aggregate stops at its next gap: with revisions 1, 3 and 5, it
// gives up revision 2 only, and revision 4 can still be written.
func TestBulkAcceptGapActsOncePerAggregateWhileRelaysDeliver(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	const aggs, page = 6, 2
	pages := pauseBulkPages(t, r, page)
	keys := make([]string, aggs)
	for i := range keys {
		keys[i] = fmt.Sprintf("g-%d", i)
	}
	for _, rev := range []int64{1, 3, 5} {
		for _, k := range keys {
			emitAt(t, pool, "gaps", k, rev)
		}
	}
	// All discovered first: a round that found revision 3 or 5 after the
	// gap at 2 was set would wake the aggregate for a moment.
	waitDiscovered(t, pool, aggs)
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{Streams: []string{"gaps"}, MaxInFlight: 4, LeaseTtl: durationpb.New(time.Hour)})
	for range aggs {
		ack(t, r, recv(t, st))
	}
	for _, k := range keys {
		waitState(t, pool, k, "gap")
	}
	filter := &outboxv1.AggregateFilter{Stream: "gaps", States: []outboxv1.AggregateState{outboxv1.AggregateState_AGGREGATE_STATE_GAP}}
	dry, err := r.Admin.BulkRetry(ctx, &outboxv1.BulkRetryRequest{Filter: filter, AcceptGap: true, Reason: "rolled back", DryRun: true})
	if err != nil || dry.GetMatched() != aggs {
		t.Fatalf("dry run: %v, %v; want %d matched", dry, err, aggs)
	}

	var res *outboxv1.BulkRetryResponse
	var through []string
	pages.run(ctx, t, func() (err error) {
		res, err = r.Admin.BulkRetry(ctx, &outboxv1.BulkRetryRequest{Filter: filter, AcceptGap: true, Reason: "rolled back"})
		return err
	}, func(n int) {
		if n > aggs/page {
			t.Fatalf("the bulk retry read a page after its %d pages of %d: an aggregate came round again", aggs/page, page)
		}
		// The page's aggregates go on at revision 3, which the relay
		// publishes; each then stops at the gap at revision 4.
		for range page {
			d := recv(t, st)
			if d.GetEvent().GetRevision() != 3 {
				t.Fatalf("between pages: got revision %d of %s", d.GetEvent().GetRevision(), d.GetEvent().GetAggregateKey())
			}
			ack(t, r, d)
			through = append(through, d.GetEvent().GetAggregateKey())
		}
		for _, k := range through {
			waitState(t, pool, k, "gap")
		}
	})
	if len(through) == 0 {
		t.Fatal("no relay delivered between pages: the race was not set up")
	}
	if res.GetRetried() != dry.GetMatched() || res.GetMatched() != dry.GetMatched() {
		t.Fatalf("retried %d of %d matched; the dry run matched %d", res.GetRetried(), res.GetMatched(), dry.GetMatched())
	}
	if n := countWhere(t, pool, `outbox.accepted_gap`, `stream = 'gaps'`); n != aggs {
		t.Errorf("%d gaps accepted, want %d", n, aggs)
	}
	if n := countWhere(t, pool, `outbox.accepted_gap`, `stream = 'gaps' AND (from_revision, to_revision) <> (2, 2)`); n != 0 {
		t.Errorf("%d gaps other than 2-2 accepted", n)
	}
	// Revision 4 of an aggregate that went through a page can still be
	// written, and is delivered.
	id4 := emitAt(t, pool, "gaps", through[0], 4)
	if d := recv(t, st); d.GetEvent().GetEventId() != id4 {
		t.Fatalf("after writing revision 4 of %s got %v", through[0], d.GetEvent())
	} else {
		ack(t, r, d)
	}
}
