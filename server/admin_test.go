package server_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	dto "github.com/prometheus/client_model/go"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/outboxd/outboxd/client"
	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/relay"
	"github.com/outboxd/outboxd/server"
)

func nack(t *testing.T, r *replica, d *outboxv1.SubscribeResponse) *outboxv1.NackResponse {
	t.Helper()
	return nackAfter(t, r, 0, d)
}

// nackAfter nacks d asking for its next attempt no sooner than after (0:
// the server's backoff alone; an hour keeps the aggregate backing off well
// past any test, the backoff's five-minute cap in effect).
func nackAfter(t *testing.T, r *replica, after time.Duration, d *outboxv1.SubscribeResponse) *outboxv1.NackResponse {
	t.Helper()
	req := &outboxv1.NackRequest{EventId: d.GetEvent().GetEventId(), LeaseToken: d.GetLeaseToken(), Error: "broker said no"}
	if after > 0 {
		req.RetryAfter = durationpb.New(after)
	}
	res, err := r.Relay.Nack(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	return res
}

func wantCode(t *testing.T, err error, code codes.Code, field string) {
	t.Helper()
	if status.Code(err) != code {
		t.Fatalf("got %v, want %v", err, code)
	}
	if field == "" {
		return
	}
	for _, d := range status.Convert(err).Details() {
		if br, ok := d.(*errdetails.BadRequest); ok {
			for _, v := range br.GetFieldViolations() {
				if v.GetField() == field {
					return
				}
			}
		}
	}
	t.Fatalf("%v names no violation of field %q", err, field)
}

// noiseLoad emits to stream "noise" and relays it until the test ends, so
// the admin RPCs are exercised while delivery is busy.
func noiseLoad(t *testing.T, ctx context.Context, pool *pgxpool.Pool, r *replica) {
	t.Helper()
	runner, err := relay.NewRunner(relay.Config{
		Conn: r.Conn, RelayID: "noise-relay", Streams: []string{"noise"}, MaxInFlight: 16,
		Publisher: publisherFunc(func(context.Context, relay.Event) error { return nil }),
	})
	if err != nil {
		t.Fatal(err)
	}
	emit(t, pool, "noise", "n-0", 1) // the stream exists before the runner subscribes
	done := make(chan struct{}, 2)
	go func() { _ = runner.Run(ctx); done <- struct{}{} }()
	go func() {
		defer func() { done <- struct{}{} }()
		for i := 0; ctx.Err() == nil; i++ {
			_, _ = client.Emit(ctx, pool, client.Event{Stream: "noise", AggregateKey: fmt.Sprintf("n-%d", i%20), Type: "T", Payload: []byte(`{}`)})
		}
	}()
	t.Cleanup(func() { <-done; <-done })
}

type publisherFunc func(context.Context, relay.Event) error

func (f publisherFunc) Publish(ctx context.Context, ev relay.Event) error { return f(ctx, ev) }

// GetLag agrees with plain SQL over the events table, per stream, with every
// delivery state represented, while another stream is under load.
func TestGetLagEqualsSQL(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, func(c *server.Config) {
		c.MaxFailures = 2
		c.BackoffBase, c.BackoffCap = time.Millisecond, time.Hour
	})
	noiseLoad(t, ctx, pool, r)
	hour := durationpb.New(time.Hour)

	// orders: 4 aggregates of 3 events; a relay with credit 2 leases two.
	for a := range 4 {
		emit(t, pool, "orders", fmt.Sprintf("o-%d", a), 3)
	}
	orders := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{Streams: []string{"orders"}, MaxInFlight: 2, LeaseTtl: hour})
	recv(t, orders)
	recv(t, orders)
	// A skipped later revision is not pending.
	var skipID string
	if err := pool.QueryRow(ctx, `SELECT event_id FROM outbox.event WHERE aggregate_key = 'o-3' AND revision = 3`).Scan(&skipID); err != nil {
		t.Fatal(err)
	}
	if _, err := r.Admin.SkipEvent(ctx, &outboxv1.SkipEventRequest{EventId: skipID, Reason: "test"}); err != nil {
		t.Fatal(err)
	}

	// payments: p-1 nacked twice (parked), then p-2 nacked once and told to
	// wait an hour (backoff).
	p1 := emit(t, pool, "payments", "p-1", 2)
	payments := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{Streams: []string{"payments"}, MaxInFlight: 1, LeaseTtl: hour})
	nack(t, r, recv(t, payments))
	d := recv(t, payments) // after a backoff of about a millisecond
	if d.GetAttempt() != 2 {
		t.Fatalf("redelivery attempt %d, want 2", d.GetAttempt())
	}
	if res := nack(t, r, d); !res.GetParked() {
		t.Fatalf("second failure did not park: %v", res)
	}
	emit(t, pool, "payments", "p-2", 1)
	d = recv(t, payments)
	res, err := r.Relay.Nack(ctx, &outboxv1.NackRequest{EventId: d.GetEvent().GetEventId(), LeaseToken: d.GetLeaseToken(),
		Error: "broker said no", RetryAfter: hour})
	if err != nil || res.GetParked() {
		t.Fatalf("first failure of p-2: %v, %v", res, err)
	}

	// inventory: revisions 5 and 7; after 5 is acked, 6 is a gap.
	emitAt(t, pool, "inventory", "i-1", 5)
	i1Seven := emitAt(t, pool, "inventory", "i-1", 7)
	inventory := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{Streams: []string{"inventory"}, MaxInFlight: 1, LeaseTtl: hour})
	five := recv(t, inventory)
	// Revision 7 discovered before 5 is acked: a round that found it after
	// the ack would wake the aggregate out of its gap (its new event might
	// be the missing one), and the claim would put it back only later.
	waitFor(t, func() int32 {
		var undiscovered int32
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox.undiscovered(ARRAY['inventory'])`).Scan(&undiscovered); err != nil {
			t.Error(err)
			return 1
		}
		return 1 - min(undiscovered, 1)
	})
	ack(t, r, five)
	waitState(t, pool, "i-1", "gap")
	waitState(t, pool, "p-2", "backoff")

	lag, err := r.Admin.GetLag(ctx, &outboxv1.GetLagRequest{Streams: []string{"orders", "payments", "inventory"}})
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]*outboxv1.StreamLag{}
	for _, l := range lag.GetStreams() {
		got[l.GetStream()] = l
	}
	rows, err := pool.Query(ctx, `
		SELECT e.stream, count(*), count(DISTINCT e.aggregate_key), min(e.created_at)
		FROM outbox.event e
		WHERE e.published_at IS NULL AND e.stream <> 'noise'
		  AND NOT EXISTS (SELECT 1 FROM outbox.skipped_event s WHERE s.event_id = e.event_id)
		GROUP BY e.stream`)
	if err != nil {
		t.Fatal(err)
	}
	var total int64
	for rows.Next() {
		var stream string
		var events, aggs int64
		var oldest time.Time
		if err := rows.Scan(&stream, &events, &aggs, &oldest); err != nil {
			t.Fatal(err)
		}
		total += events
		l := got[stream]
		if l.GetPendingEvents() != events || l.GetPendingAggregates() != aggs ||
			!l.GetOldestPendingCreatedAt().AsTime().Equal(oldest) {
			t.Errorf("%s: GetLag says %d events, %d aggregates, oldest %v; SQL says %d, %d, %v", stream,
				l.GetPendingEvents(), l.GetPendingAggregates(), l.GetOldestPendingCreatedAt().AsTime(), events, aggs, oldest)
		}
		if l.GetOldestPendingAge().AsDuration() <= 0 {
			t.Errorf("%s: oldest pending age %v", stream, l.GetOldestPendingAge().AsDuration())
		}
	}
	if rows.Err() != nil {
		t.Fatal(rows.Err())
	}
	if total != 4*3-1+3+1 {
		t.Errorf("SQL counts %d pending events, the test made %d", total, 4*3-1+3+1)
	}
	states := func(l *outboxv1.StreamLag) [5]int64 {
		return [5]int64{l.GetReadyAggregates(), l.GetLeasedAggregates(), l.GetBackingOffAggregates(), l.GetParkedAggregates(), l.GetGapAggregates()}
	}
	for stream, want := range map[string][5]int64{
		"orders": {2, 2, 0, 0, 0}, "payments": {0, 0, 1, 1, 0}, "inventory": {0, 0, 0, 0, 1},
	} {
		if s := states(got[stream]); s != want {
			t.Errorf("%s: ready/leased/backoff/parked/gap = %v, want %v", stream, s, want)
		}
	}
	if got["payments"].GetOldestHeldAge() == nil || got["orders"].GetOldestHeldAge() != nil {
		t.Errorf("oldest held age: payments %v, orders %v", got["payments"].GetOldestHeldAge(), got["orders"].GetOldestHeldAge())
	}
	if n := got["inventory"].GetDeliveredLastMinute(); n != 1 {
		t.Errorf("inventory delivered in the last minute = %d, want 1", n)
	}
	if lag.GetTotal().GetPendingEvents() != total {
		t.Errorf("total pending %d, want %d", lag.GetTotal().GetPendingEvents(), total)
	}
	if lag.GetConnectedRelays() != 4 {
		t.Errorf("connected relays %d, want 4 (orders, payments, inventory, noise)", lag.GetConnectedRelays())
	}

	agg, err := r.Admin.GetAggregate(ctx, &outboxv1.GetAggregateRequest{Stream: "payments", AggregateKey: "p-1"})
	if err != nil {
		t.Fatal(err)
	}
	a := agg.GetAggregate()
	if a.GetState() != outboxv1.AggregateState_AGGREGATE_STATE_PARKED || a.GetFailures() != 2 || a.GetAttempt() != 2 ||
		a.GetPendingEvents() != 2 || a.GetNextPendingRevision() != 1 || a.GetLastError() != "broker said no" ||
		a.GetParkedReason() == "" || a.GetParkedAt() == nil || a.GetLastRevision() != 2 ||
		a.GetNextPendingEventId() != p1[0].String() {
		t.Errorf("parked aggregate: %v", a)
	}
	agg, err = r.Admin.GetAggregate(ctx, &outboxv1.GetAggregateRequest{Stream: "inventory", AggregateKey: "i-1"})
	if err != nil {
		t.Fatal(err)
	}
	if a := agg.GetAggregate(); a.GetState() != outboxv1.AggregateState_AGGREGATE_STATE_GAP || a.GetGapRevision() != 6 ||
		a.GetDeliveredRevision() != 5 || a.GetNextPendingRevision() != 7 || a.GetNextPendingEventId() != i1Seven {
		t.Errorf("gap aggregate: %v", a)
	}
	_, err = r.Admin.GetAggregate(ctx, &outboxv1.GetAggregateRequest{Stream: "orders", AggregateKey: "nope"})
	wantCode(t, err, codes.NotFound, "")
	_, err = r.Admin.GetAggregate(ctx, &outboxv1.GetAggregateRequest{Stream: "Bad Stream"})
	wantCode(t, err, codes.InvalidArgument, "stream")
}

// SkipEvent needs a reason, records who and why, ends a lease on the event
// (its holder's ack then reports LEASE_LOST), and lets later revisions go.
func TestSkipEvent(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	ids := emit(t, pool, "orders", "o-1", 2)
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 1, LeaseTtl: durationpb.New(time.Hour)})
	d := recv(t, st)

	_, err := r.Admin.SkipEvent(ctx, &outboxv1.SkipEventRequest{EventId: ids[0].String()})
	wantCode(t, err, codes.InvalidArgument, "reason")
	_, err = r.Admin.SkipEvent(ctx, &outboxv1.SkipEventRequest{EventId: ids[0].String(), Reason: "  "})
	wantCode(t, err, codes.InvalidArgument, "reason")
	_, err = r.Admin.SkipEvent(ctx, &outboxv1.SkipEventRequest{EventId: "x", Reason: "r"})
	wantCode(t, err, codes.InvalidArgument, "event_id")
	_, err = r.Admin.SkipEvent(ctx, &outboxv1.SkipEventRequest{EventId: "00000000-0000-0000-0000-000000000001", Reason: "r"})
	wantCode(t, err, codes.NotFound, "")

	res, err := r.Admin.SkipEvent(ctx, &outboxv1.SkipEventRequest{EventId: ids[0].String(), Reason: "poison payload", Actor: "alice"})
	if err != nil {
		t.Fatal(err)
	}
	if res.GetSkip().GetReason() != "poison payload" || res.GetSkip().GetActor() != "alice" || res.GetSkip().GetSkippedAt() == nil {
		t.Fatalf("skip record %v", res.GetSkip())
	}
	// The lease ended: the relay's credit of 1 is freed and revision 2 comes.
	if next := recv(t, st); next.GetEvent().GetEventId() != ids[1].String() {
		t.Fatalf("after the skip got %v, want revision 2", next.GetEvent())
	} else {
		ack(t, r, next)
	}
	if res := ack(t, r, d); res[0].GetStatus() != outboxv1.AckStatus_ACK_STATUS_LEASE_LOST {
		t.Fatalf("ack of the skipped event: %v", res[0])
	}
	if publishedAt(t, pool, ids[0].String()) != nil {
		t.Fatal("skipped event was marked published")
	}
	_, err = r.Admin.SkipEvent(ctx, &outboxv1.SkipEventRequest{EventId: ids[0].String(), Reason: "again"})
	wantCode(t, err, codes.FailedPrecondition, "")
	_, err = r.Admin.SkipEvent(ctx, &outboxv1.SkipEventRequest{EventId: ids[1].String(), Reason: "too late"})
	wantCode(t, err, codes.FailedPrecondition, "")

	// The skipped event stays queryable, with the decision.
	list, err := r.Admin.ListEvents(ctx, &outboxv1.ListEventsRequest{Stream: "orders", State: outboxv1.EventState_EVENT_STATE_SKIPPED})
	if err != nil {
		t.Fatal(err)
	}
	if len(list.GetEvents()) != 1 || list.GetEvents()[0].GetEvent().GetEventId() != ids[0].String() ||
		list.GetEvents()[0].GetSkip().GetActor() != "alice" {
		t.Fatalf("skipped listing: %v", list.GetEvents())
	}
	// Anonymous callers are recorded with their address.
	more := emit(t, pool, "orders", "o-2", 1)
	res, err = r.Admin.SkipEvent(ctx, &outboxv1.SkipEventRequest{EventId: more[0].String(), Reason: "r"})
	if err != nil {
		t.Fatal(err)
	}
	if res.GetSkip().GetActor() == "" {
		t.Fatal("no actor recorded")
	}
}

// RetryAggregate revives parked work, refuses what it cannot retry, and
// gives up a gap only with accept_gap and a reason, on the record.
func TestRetryAggregate(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, func(c *server.Config) { c.MaxFailures = 1 })
	emit(t, pool, "orders", "o-1", 1)
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 1, LeaseTtl: durationpb.New(time.Hour)})
	d := recv(t, st)

	_, err := r.Admin.RetryAggregate(ctx, &outboxv1.RetryAggregateRequest{Stream: "orders", AggregateKey: "o-1"})
	wantCode(t, err, codes.FailedPrecondition, "") // leased
	if !nack(t, r, d).GetParked() {
		t.Fatal("not parked")
	}
	res, err := r.Admin.RetryAggregate(ctx, &outboxv1.RetryAggregateRequest{Stream: "orders", AggregateKey: "o-1"})
	if err != nil {
		t.Fatal(err)
	}
	if a := res.GetAggregate(); a.GetState() == outboxv1.AggregateState_AGGREGATE_STATE_PARKED || a.GetFailures() != 0 {
		t.Fatalf("after retry: %v", a)
	}
	again := recv(t, st)
	if again.GetEvent().GetEventId() != d.GetEvent().GetEventId() || again.GetAttempt() != 2 {
		t.Fatalf("retry delivered %v attempt %d", again.GetEvent(), again.GetAttempt())
	}
	ack(t, r, again)
	waitState(t, pool, "o-1", "idle")
	if agg, err := r.Admin.GetAggregate(ctx, &outboxv1.GetAggregateRequest{Stream: "orders", AggregateKey: "o-1"}); err != nil ||
		agg.GetAggregate().GetNextPendingEventId() != "" {
		t.Errorf("idle aggregate names a next pending event: %v, %v", agg, err)
	}
	_, err = r.Admin.RetryAggregate(ctx, &outboxv1.RetryAggregateRequest{Stream: "orders", AggregateKey: "o-1"})
	wantCode(t, err, codes.FailedPrecondition, "") // idle
	_, err = r.Admin.RetryAggregate(ctx, &outboxv1.RetryAggregateRequest{Stream: "orders", AggregateKey: "none"})
	wantCode(t, err, codes.NotFound, "")

	// A gap: revisions 1 and 4 of g; 2 and 3 never come.
	emitAt(t, pool, "orders", "g", 1)
	id4 := emitAt(t, pool, "orders", "g", 4)
	// Revision 4 discovered before the ack, so that no discovery round
	// finds it after the gap is set and wakes g (ready for a moment, which
	// a plain retry answers with OK).
	waitDiscovered(t, pool, 2)
	ack(t, r, recv(t, st))
	waitState(t, pool, "g", "gap")
	_, err = r.Admin.RetryAggregate(ctx, &outboxv1.RetryAggregateRequest{Stream: "orders", AggregateKey: "g"})
	wantCode(t, err, codes.FailedPrecondition, "")
	_, err = r.Admin.RetryAggregate(ctx, &outboxv1.RetryAggregateRequest{Stream: "orders", AggregateKey: "g", AcceptGap: true})
	wantCode(t, err, codes.InvalidArgument, "reason")
	res, err = r.Admin.RetryAggregate(ctx, &outboxv1.RetryAggregateRequest{
		Stream: "orders", AggregateKey: "g", AcceptGap: true, Reason: "revisions 2-3 rolled back upstream", Actor: "bob"})
	if err != nil {
		t.Fatal(err)
	}
	if a := res.GetAggregate(); a.GetDeliveredRevision() != 3 || a.GetState() != outboxv1.AggregateState_AGGREGATE_STATE_READY {
		t.Fatalf("after accepting the gap: %v", a)
	}
	if d := recv(t, st); d.GetEvent().GetEventId() != id4 {
		t.Fatalf("after the gap got %v, want revision 4", d.GetEvent())
	}
	var from, to int64
	var actor string
	if err := pool.QueryRow(ctx, `SELECT from_revision, to_revision, actor FROM outbox.accepted_gap WHERE aggregate_key = 'g'`).
		Scan(&from, &to, &actor); err != nil || from != 2 || to != 3 || actor != "bob" {
		t.Fatalf("accepted_gap record: %d-%d by %q, %v", from, to, actor, err)
	}
	// The given-up revisions can no longer be inserted.
	if _, err := client.Emit(ctx, pool, client.Event{Stream: "orders", AggregateKey: "g", Type: "T", Payload: []byte(`{}`), Revision: 2}); err == nil {
		t.Fatal("a revision below the cursor was accepted")
	}
}

// ListEvents pages newest first through every event exactly once, filters,
// and refuses a forged page token.
func TestListEventsPaginates(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	var want []string
	for i := range 5 {
		for _, id := range emit(t, pool, "orders", fmt.Sprintf("o-%d", i), 5) {
			want = append(want, id.String())
		}
	}
	emit(t, pool, "billing", "b", 3)
	seen := map[string]bool{}
	var last time.Time
	token := ""
	pages := 0
	for {
		res, err := r.Admin.ListEvents(ctx, &outboxv1.ListEventsRequest{Stream: "orders", PageSize: 7, PageToken: token})
		if err != nil {
			t.Fatal(err)
		}
		pages++
		if n := len(res.GetEvents()); n > 7 {
			t.Fatalf("page %d holds %d events, more than its size 7", pages, n)
		}
		for _, e := range res.GetEvents() {
			id, at := e.GetEvent().GetEventId(), e.GetEvent().GetCreatedAt().AsTime()
			if seen[id] || e.GetEvent().GetStream() != "orders" || e.GetState() != outboxv1.EventState_EVENT_STATE_PENDING {
				t.Fatalf("page %d: %v (seen %v)", pages, e, seen[id])
			}
			if !last.IsZero() && at.After(last) {
				t.Fatalf("page %d: not newest first", pages)
			}
			seen[id], last = true, at
		}
		if token = res.GetNextPageToken(); token == "" {
			break
		}
	}
	if len(seen) != len(want) || pages != 4 {
		t.Fatalf("listed %d events in %d pages, want %d in 4", len(seen), pages, len(want))
	}
	res, err := r.Admin.ListEvents(ctx, &outboxv1.ListEventsRequest{Stream: "orders", AggregateKey: "o-2"})
	if err != nil || len(res.GetEvents()) != 5 {
		t.Fatalf("by aggregate: %d events, %v", len(res.GetEvents()), err)
	}
	res, err = r.Admin.ListEvents(ctx, &outboxv1.ListEventsRequest{State: outboxv1.EventState_EVENT_STATE_PUBLISHED})
	if err != nil || len(res.GetEvents()) != 0 {
		t.Fatalf("published: %d events, %v", len(res.GetEvents()), err)
	}
	res, err = r.Admin.ListEvents(ctx, &outboxv1.ListEventsRequest{CreatedAfter: timestamppb.New(time.Now().Add(time.Hour))})
	if err != nil || len(res.GetEvents()) != 0 {
		t.Fatalf("created in the future: %d events, %v", len(res.GetEvents()), err)
	}
	_, err = r.Admin.ListEvents(ctx, &outboxv1.ListEventsRequest{PageToken: "forged!"})
	wantCode(t, err, codes.InvalidArgument, "page_token")
	_, err = r.Admin.ListEvents(ctx, &outboxv1.ListEventsRequest{AggregateKey: "o-1"})
	wantCode(t, err, codes.InvalidArgument, "aggregate_key")
	_, err = r.Admin.ListEvents(ctx, &outboxv1.ListEventsRequest{PageSize: 5000})
	wantCode(t, err, codes.InvalidArgument, "page_size")
}

// A page of large events stops short of gRPC's 4 MiB default receive
// limit: fewer rows and a next-page token, every event still listed once.
func TestListEventsBoundsResponseBytes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	const n = 6
	bigBacklog(t, pool, "orders", n) // about 900 KB each: 5.4 MB in all
	seen := map[string]bool{}
	token := ""
	for pages := 1; ; pages++ {
		// The client keeps gRPC's default receive limit (4 MiB).
		res, err := r.Admin.ListEvents(ctx, &outboxv1.ListEventsRequest{Stream: "orders", PageSize: 100, PageToken: token})
		if err != nil {
			t.Fatalf("page %d: %v", pages, err)
		}
		if size := proto.Size(res); size > 2<<20+4<<10 {
			t.Errorf("page %d is %d bytes, over the 2 MiB budget", pages, size)
		}
		if len(res.GetEvents()) == 0 {
			t.Fatalf("page %d is empty", pages)
		}
		for _, e := range res.GetEvents() {
			if seen[e.GetEvent().GetEventId()] {
				t.Fatalf("page %d repeats %s", pages, e.GetEvent().GetEventId())
			}
			seen[e.GetEvent().GetEventId()] = true
		}
		if token = res.GetNextPageToken(); token == "" {
			if len(seen) != n || pages < 3 {
				t.Fatalf("listed %d of %d events in %d pages; want all, in at least 3 pages", len(seen), n, pages)
			}
			return
		}
	}
}

// publishSome acks the first n events of stream through the protocol.
func publishSome(t *testing.T, ctx context.Context, r *replica, stream string, n int) {
	t.Helper()
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	st := subscribe(t, sctx, r, &outboxv1.SubscribeRequest{Streams: []string{stream}, MaxInFlight: 1})
	for range n {
		ack(t, r, recv(t, st))
	}
}

func countEvents(t *testing.T, pool *pgxpool.Pool, where string) int64 {
	t.Helper()
	var n int64
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM outbox.event WHERE `+where).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// Purge deletes published events only, in batches, even with a cut-off in
// the future; a dry run deletes nothing.
func TestPurgeNeverDeletesPending(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	emit(t, pool, "orders", "o-1", 20)
	publishSome(t, ctx, r, "orders", 8)
	skip := emit(t, pool, "orders", "o-2", 1)
	if _, err := r.Admin.SkipEvent(ctx, &outboxv1.SkipEventRequest{EventId: skip[0].String(), Reason: "r"}); err != nil {
		t.Fatal(err)
	}

	purge := func(req *outboxv1.PurgeRequest) []*outboxv1.PurgeResponse {
		t.Helper()
		st, err := r.Admin.Purge(ctx, req)
		if err != nil {
			t.Fatal(err)
		}
		var msgs []*outboxv1.PurgeResponse
		for {
			m, err := st.Recv()
			if errors.Is(err, io.EOF) {
				return msgs
			}
			if err != nil {
				t.Fatal(err)
			}
			msgs = append(msgs, m)
		}
	}
	future := timestamppb.New(time.Now().Add(24 * time.Hour))
	dry := purge(&outboxv1.PurgeRequest{PublishedBefore: future, DryRun: true, BatchSize: 5})
	if last := dry[len(dry)-1]; !last.GetDone() || last.GetDeleted() != 8 || dry[0].GetRemaining() != 8 {
		t.Fatalf("dry run: %v", dry)
	}
	if n := countEvents(t, pool, "true"); n != 21 {
		t.Fatalf("dry run deleted something: %d events left", n)
	}
	msgs := purge(&outboxv1.PurgeRequest{PublishedBefore: future, BatchSize: 5})
	last := msgs[len(msgs)-1]
	// 21 events examined 5 at a time: 5 batches.
	if !last.GetDone() || last.GetDeleted() != 8 || last.GetBatches() != 5 || last.GetRemaining() != 0 {
		t.Fatalf("purge: %v", msgs)
	}
	if len(msgs) != 6 { // the estimate, then one per batch
		t.Fatalf("%d progress messages, want 6", len(msgs))
	}
	if n := countEvents(t, pool, "published_at IS NULL"); n != 13 {
		t.Fatalf("%d unpublished events left, want 13 (12 pending, 1 skipped)", n)
	}
	if n := countEvents(t, pool, "published_at IS NOT NULL"); n != 0 {
		t.Fatalf("%d published events left", n)
	}
	// Events published after the cut-off stay.
	publishSome(t, ctx, r, "orders", 2)
	purge(&outboxv1.PurgeRequest{PublishedBefore: timestamppb.New(time.Now().Add(-time.Hour))})
	if n := countEvents(t, pool, "published_at IS NOT NULL"); n != 2 {
		t.Fatalf("%d published events left, want 2", n)
	}

	st, err := r.Admin.Purge(ctx, &outboxv1.PurgeRequest{})
	if err == nil {
		_, err = st.Recv()
	}
	wantCode(t, err, codes.InvalidArgument, "published_before")
	// Batches of up to 10000, not one more.
	purge(&outboxv1.PurgeRequest{PublishedBefore: timestamppb.Now(), BatchSize: 10000, DryRun: true})
	st, err = r.Admin.Purge(ctx, &outboxv1.PurgeRequest{PublishedBefore: timestamppb.Now(), BatchSize: 10001, DryRun: true})
	if err == nil {
		_, err = st.Recv()
	}
	wantCode(t, err, codes.InvalidArgument, "batch_size")
}

// The janitor purges events older than the retention window, in batches.
func TestJanitorPurgesInBatches(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, func(c *server.Config) {
		c.Retention = time.Minute
		c.JanitorInterval = time.Hour // runs only when the test says
		c.JanitorBatch = 4
	})
	emit(t, pool, "orders", "o-1", 10)
	publishSome(t, ctx, r, "orders", 7)
	// Created and published an hour ago, past the retention window. (With a
	// window of a millisecond, an event published in the last millisecond
	// before the run stayed, once.)
	testdb.RewriteEvents(t, pool, `UPDATE outbox.event SET published_at = published_at - interval '1 hour', created_at = created_at - interval '1 hour' WHERE published_at IS NOT NULL`)
	deleted, batches, err := r.Server.RunJanitor(ctx)
	if err != nil {
		t.Fatal(err)
	}
	// Batches of 4: 4 and 3. (The pending events are newer than the
	// cut-off, so the walk ends there.)
	if deleted != 7 || batches != 2 {
		t.Fatalf("janitor deleted %d in %d batches, want 7 in 2", deleted, batches)
	}
	if n := countEvents(t, pool, "true"); n != 3 {
		t.Fatalf("%d events left, want the 3 pending", n)
	}
}

// ListRelays shows each open stream with its figures, across replicas.
func TestListRelays(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	a := startReplica(t, url, func(c *server.Config) { c.ReplicaID = "replica-a" })
	b := startReplica(t, url, func(c *server.Config) { c.ReplicaID = "replica-b" })
	emit(t, pool, "orders", "o-1", 3)
	emit(t, pool, "billing", "b-1", 1)
	sctx, stop := context.WithCancel(ctx)
	st := subscribe(t, sctx, a, &outboxv1.SubscribeRequest{RelayId: "relay-1", Streams: []string{"orders"}, MaxInFlight: 3})
	ack(t, a, recv(t, st))
	recv(t, st) // in flight
	subscribe(t, ctx, b, &outboxv1.SubscribeRequest{RelayId: "relay-2", MaxInFlight: 7})

	var relays []*outboxv1.Relay
	waitFor(t, func() int32 {
		res, err := b.Admin.ListRelays(ctx, &outboxv1.ListRelaysRequest{})
		if err != nil {
			t.Fatal(err)
		}
		relays = res.GetRelays()
		return int32(len(relays) / 2)
	})
	byID := map[string]*outboxv1.Relay{}
	for _, r := range relays {
		byID[r.GetRelayId()] = r
	}
	r1, r2 := byID["relay-1"], byID["relay-2"]
	if r1 == nil || r2 == nil || r1.GetReplicaId() != "replica-a" || r2.GetReplicaId() != "replica-b" ||
		len(r1.GetStreams()) != 1 || r1.GetStreams()[0] != "orders" || len(r2.GetStreams()) != 0 ||
		r1.GetMaxInFlight() != 3 || r2.GetMaxInFlight() != 7 || r1.GetPeer() == "" || r1.GetConnectedAt() == nil {
		t.Fatalf("relays: %v", relays)
	}
	// ListRelays on a refreshes a's own figures first.
	res, err := a.Admin.ListRelays(ctx, &outboxv1.ListRelaysRequest{})
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range res.GetRelays() {
		if r.GetRelayId() == "relay-1" && (r.GetAcked() != 1 || r.GetInFlight() != 1) {
			t.Fatalf("relay-1 acked %d in flight %d, want 1 and 1", r.GetAcked(), r.GetInFlight())
		}
	}
	stop()
	waitFor(t, func() int32 {
		res, err := b.Admin.ListRelays(ctx, &outboxv1.ListRelaysRequest{})
		if err != nil {
			t.Fatal(err)
		}
		if len(res.GetRelays()) == 1 {
			return 1
		}
		return 0
	})
}

// Metrics move when events flow, and the backlog gauges equal the backlog.
func TestMetrics(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	reg := prometheus.NewPedanticRegistry()
	r := startReplica(t, url, func(c *server.Config) { c.Registerer = reg })
	emit(t, pool, "orders", "o-1", 5)
	publishSome(t, ctx, r, "orders", 3)

	// The session may have leased a fourth event before the relay hung up.
	if got := gatherSum(t, reg, "outboxd_deliveries_total"); got < 3 || got > 4 {
		t.Errorf("outboxd_deliveries_total = %v, want 3 or 4", got)
	}
	if got := gatherSum(t, reg, "outboxd_pending_events"); got != 2 {
		t.Errorf("outboxd_pending_events = %v, want 2", got)
	}
	if n, err := testutil.GatherAndCount(reg, "outboxd_ack_duration_seconds", "outboxd_commit_to_published_seconds"); err != nil || n != 2 {
		t.Errorf("histograms: %d, %v", n, err)
	}
	if got := gatherSum(t, reg, "outboxd_commit_to_published_seconds"); got != 3 {
		t.Errorf("commit-to-published observations %v, want 3", got)
	}
	if got := gatherSum(t, reg, "outboxd_acks_total"); got != 3 {
		t.Errorf("acks %v, want 3", got)
	}
	// Two forged acks in one call: each counted, under its result.
	if _, err := r.Relay.Ack(ctx, &outboxv1.AckRequest{Acks: []*outboxv1.AckItem{
		{EventId: uuid.NewString(), LeaseToken: "forged"}, {EventId: uuid.NewString(), LeaseToken: "forged too"}}}); err != nil {
		t.Fatal(err)
	}
	for result, want := range map[string]float64{"published": 3, "invalid": 2} {
		if got := testutil.ToFloat64(ackCounter(t, reg, result)); got != want {
			t.Errorf("outboxd_acks_total{result=%q} = %v, want %v", result, got, want)
		}
	}
	problems, err := testutil.GatherAndLint(reg)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		t.Errorf("metric %s: %s", p.Metric, p.Text)
	}
}

// ackCounter is outboxd_acks_total{result} as gathered from reg.
func ackCounter(t *testing.T, reg *prometheus.Registry, result string) prometheus.Collector {
	t.Helper()
	c := prometheus.NewCounter(prometheus.CounterOpts{Name: "acks"})
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "outboxd_acks_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "result" && l.GetValue() == result {
					c.Add(m.GetCounter().GetValue())
				}
			}
		}
	}
	return c
}

// gatherSum sums a metric family's values (counters, gauges), or sample
// counts for histograms.
func gatherSum(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	return sumFamilies(mfs, name)
}

// sumFamilies is gatherSum over metric families already gathered.
func sumFamilies(mfs []*dto.MetricFamily, name string) float64 {
	sum := 0.0
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			switch {
			case m.Counter != nil:
				sum += m.GetCounter().GetValue()
			case m.Gauge != nil:
				sum += m.GetGauge().GetValue()
			case m.Histogram != nil:
				sum += float64(m.GetHistogram().GetSampleCount())
			}
		}
	}
	return sum
}
