package server_test

import (
	"context"
	"encoding/base64"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/relay"
	"github.com/outboxd/outboxd/server"
)

func setting(t *testing.T, pool *pgxpool.Pool, assignment string) {
	t.Helper()
	if _, err := pool.Exec(context.Background(), `UPDATE outbox.settings SET `+assignment); err != nil {
		t.Fatal(err)
	}
}

func attempts(t *testing.T, r *replica, req *outboxv1.ListAttemptsRequest) []*outboxv1.Attempt {
	t.Helper()
	res, err := r.Admin.ListAttempts(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	return res.GetAttempts()
}

func outcomes(list []*outboxv1.Attempt) []string {
	var out []string
	for _, a := range list {
		out = append(out, strings.TrimPrefix(a.GetOutcome().String(), "ATTEMPT_OUTCOME_"))
	}
	return out
}

// Every way a delivery ends without publishing is recorded, newest first,
// with the relay, the replica and the error; an ack records nothing; and
// the history keeps only the newest attempt_history_per_aggregate entries.
func TestAttemptHistory(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, func(c *server.Config) {
		c.MaxFailures = 2
		c.BackoffBase, c.BackoffCap = time.Millisecond, time.Millisecond
	})
	ids := emit(t, pool, "orders", "h", 2)
	ctx1, cancel1 := context.WithCancel(ctx)
	st := subscribe(t, ctx1, r, &outboxv1.SubscribeRequest{RelayId: "relay-a", MaxInFlight: 2, LeaseTtl: durationpb.New(time.Second)})

	nack(t, r, recv(t, st)) // attempt 1: nacked
	d := recv(t, st)        // attempt 2: expires
	if d.GetAttempt() != 2 {
		t.Fatalf("attempt %d", d.GetAttempt())
	}
	d = recv(t, st) // attempt 3, after the expiry
	nack(t, r, d)   // failure 2 of 2: parked
	list := attempts(t, r, &outboxv1.ListAttemptsRequest{Stream: "orders", AggregateKey: "h"})
	if got := outcomes(list); !slices.Equal(got, []string{"PARKED", "EXPIRED", "NACKED"}) {
		t.Fatalf("outcomes %v", got)
	}
	for i, a := range list {
		if a.GetEventId() != ids[0].String() || a.GetRevision() != 1 || a.GetRelayId() != "relay-a" ||
			a.GetReplicaId() == "" || int(a.GetAttempt()) != 3-i || a.GetAt() == nil {
			t.Errorf("attempt %d: %v", i, a)
		}
	}
	if list[0].GetError() != "broker said no" || !strings.Contains(list[1].GetError(), "expired") {
		t.Errorf("errors %q, %q", list[0].GetError(), list[1].GetError())
	}
	// The same history through the event.
	if got := attempts(t, r, &outboxv1.ListAttemptsRequest{EventId: ids[0].String()}); len(got) != 3 {
		t.Fatalf("by event: %d attempts", len(got))
	}

	// A release: a relay's stream ends holding the lease. relay-a's
	// session must be over first: one still running when the retry makes
	// the aggregate ready could claim it and release it as relay-a.
	cancel1()
	waitCtx, cancelWait := context.WithTimeout(ctx, 30*time.Second)
	defer cancelWait()
	if err := r.Server.Wait(waitCtx); err != nil {
		t.Fatalf("relay-a's session did not end: %v", err)
	}
	if _, err := r.Admin.RetryAggregate(ctx, &outboxv1.RetryAggregateRequest{Stream: "orders", AggregateKey: "h"}); err != nil {
		t.Fatal(err)
	}
	ctx2, cancel2 := context.WithCancel(ctx)
	st2 := subscribe(t, ctx2, r, &outboxv1.SubscribeRequest{RelayId: "relay-b", MaxInFlight: 1, LeaseTtl: durationpb.New(time.Hour)})
	recv(t, st2)
	cancel2()
	waitState(t, pool, "h", "ready")
	list = attempts(t, r, &outboxv1.ListAttemptsRequest{Stream: "orders", AggregateKey: "h", PageSize: 1})
	if got := outcomes(list); !slices.Equal(got, []string{"RELEASED"}) || list[0].GetRelayId() != "relay-b" {
		t.Fatalf("after the stream ended: %v", list)
	}

	// An ack writes nothing; paging walks the rest.
	ctx3, cancel3 := context.WithCancel(context.Background())
	defer cancel3()
	st3 := subscribe(t, ctx3, r, &outboxv1.SubscribeRequest{MaxInFlight: 1, LeaseTtl: durationpb.New(time.Hour)})
	ack(t, r, recv(t, st3))
	ack(t, r, recv(t, st3))
	var all []*outboxv1.Attempt
	tok := ""
	for {
		res, err := r.Admin.ListAttempts(ctx3, &outboxv1.ListAttemptsRequest{Stream: "orders", AggregateKey: "h", PageSize: 2, PageToken: tok})
		if err != nil {
			t.Fatal(err)
		}
		all = append(all, res.GetAttempts()...)
		if tok = res.GetNextPageToken(); tok == "" {
			break
		}
	}
	if got := outcomes(all); !slices.Equal(got, []string{"RELEASED", "PARKED", "EXPIRED", "NACKED"}) {
		t.Fatalf("after two acks, paged: %v", got)
	}

	// Bounded: with a history of 3, the oldest go.
	setting(t, pool, "attempt_history_per_aggregate = 3")
	emit(t, pool, "orders", "h", 1)
	nack(t, r, recv(t, st3))
	nack(t, r, recv(t, st3)) // parks
	var n int
	if err := pool.QueryRow(ctx3, `SELECT count(*) FROM outbox.attempt WHERE aggregate_key = 'h'`).Scan(&n); err != nil || n != 3 {
		t.Fatalf("%d attempts kept, %v; want 3", n, err)
	}
	if got := outcomes(attempts(t, r, &outboxv1.ListAttemptsRequest{Stream: "orders", AggregateKey: "h"})); !slices.Equal(got, []string{"PARKED", "NACKED", "RELEASED"}) {
		t.Fatalf("bounded history %v", got)
	}
}

func TestListAttemptsBadInput(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	r := startReplica(t, url, nil)
	for _, c := range []struct {
		req   *outboxv1.ListAttemptsRequest
		field string
	}{
		{&outboxv1.ListAttemptsRequest{}, "event_id"},
		{&outboxv1.ListAttemptsRequest{EventId: "nope"}, "event_id"},
		{&outboxv1.ListAttemptsRequest{EventId: uuid.NewString(), Stream: "orders"}, "event_id"},
		{&outboxv1.ListAttemptsRequest{Stream: "orders"}, "aggregate_key"},
		{&outboxv1.ListAttemptsRequest{Stream: "Bad", AggregateKey: "k"}, "stream"},
		{&outboxv1.ListAttemptsRequest{Stream: "orders", AggregateKey: "k", PageSize: 1001}, "page_size"},
		{&outboxv1.ListAttemptsRequest{Stream: "orders", AggregateKey: "k", PageToken: "!!"}, "page_token"},
		{&outboxv1.ListAttemptsRequest{Stream: "orders", AggregateKey: "k", PageToken: base64.RawURLEncoding.EncodeToString([]byte("0"))}, "page_token"},
	} {
		_, err := r.Admin.ListAttempts(ctx, c.req)
		wantCode(t, err, codes.InvalidArgument, c.field)
	}
	_, err := r.Admin.ListAttempts(ctx, &outboxv1.ListAttemptsRequest{EventId: uuid.NewString()})
	wantCode(t, err, codes.NotFound, "")
}

// An aggregate whose leases keep expiring is stalled, in GetAggregate,
// ListAggregates, GetLag and the metric, until it makes progress.
func TestStalledAfterRepeatedExpiriesClearedOnProgress(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	reg := prometheus.NewPedanticRegistry()
	r := startReplica(t, url, func(c *server.Config) { c.Registerer = reg })
	setting(t, pool, "stall_after_unanswered = 2")
	emit(t, pool, "orders", "s", 2)
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{Streams: []string{"orders"}, MaxInFlight: 2, LeaseTtl: durationpb.New(time.Second)})
	recv(t, st)
	stalled := func() *outboxv1.Aggregate {
		t.Helper()
		res, err := r.Admin.GetAggregate(ctx, &outboxv1.GetAggregateRequest{Stream: "orders", AggregateKey: "s"})
		if err != nil {
			t.Fatal(err)
		}
		return res.GetAggregate()
	}
	recv(t, st) // attempt 2: one lease ended unanswered
	if a := stalled(); a.GetStalled() {
		t.Fatalf("stalled after one expiry: %v", a)
	}
	d := recv(t, st) // attempt 3: two ended unanswered
	if d.GetAttempt() != 3 {
		t.Fatalf("attempt %d", d.GetAttempt())
	}
	a := stalled()
	if !a.GetStalled() || !strings.Contains(a.GetStalledReason(), "2 deliveries") {
		t.Fatalf("not stalled after two expiries: %v", a)
	}
	lag, err := r.Admin.GetLag(ctx, &outboxv1.GetLagRequest{Streams: []string{"orders"}})
	if err != nil {
		t.Fatal(err)
	}
	if lag.GetStreams()[0].GetStalledAggregates() != 1 || lag.GetTotal().GetStalledAggregates() != 1 {
		t.Fatalf("lag: %v", lag)
	}
	if got := gatherSum(t, reg, "outboxd_stalled_aggregates"); got != 1 {
		t.Fatalf("outboxd_stalled_aggregates = %v", got)
	}
	list, err := r.Admin.ListAggregates(ctx, &outboxv1.ListAggregatesRequest{Filter: &outboxv1.AggregateFilter{StalledOnly: true}})
	if err != nil || len(list.GetAggregates()) != 1 || list.GetAggregates()[0].GetAggregateKey() != "s" {
		t.Fatalf("stalled_only: %v, %v", list, err)
	}
	// Progress clears it.
	ack(t, r, d)
	if a := stalled(); a.GetStalled() || a.GetStalledReason() != "" {
		t.Fatalf("still stalled after an ack: %v", a)
	}
	lag, err = r.Admin.GetLag(ctx, &outboxv1.GetLagRequest{Streams: []string{"orders"}})
	if err != nil || lag.GetTotal().GetStalledAggregates() != 0 {
		t.Fatalf("lag after progress: %v, %v", lag, err)
	}
}

// Repeated failures stall an aggregate too (before it parks).
func TestStalledAfterRepeatedFailures(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, func(c *server.Config) {
		c.BackoffBase, c.BackoffCap = time.Millisecond, time.Millisecond
	})
	setting(t, pool, "stall_after_failures = 2")
	emit(t, pool, "orders", "f", 1)
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 1, LeaseTtl: durationpb.New(time.Hour)})
	nack(t, r, recv(t, st))
	nack(t, r, recv(t, st))
	d := recv(t, st)
	res, err := r.Admin.GetAggregate(ctx, &outboxv1.GetAggregateRequest{Stream: "orders", AggregateKey: "f"})
	if err != nil || !res.GetAggregate().GetStalled() || !strings.Contains(res.GetAggregate().GetStalledReason(), "broker said no") {
		t.Fatalf("%v, %v", res, err)
	}
	ack(t, r, d)
}

// A relay connected for a stream's work, holding nothing while the stream's
// ready work waits, is idle in GetLag and the metric.
func TestIdleRelays(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	reg := prometheus.NewPedanticRegistry()
	r := startReplica(t, url, func(c *server.Config) { c.Registerer = reg })
	setting(t, pool, "idle_relay_after = '1 millisecond'")
	emit(t, pool, "idle", "k", 1)
	waitState(t, pool, "k", "ready")
	// Another replica's relay, as that replica records it: connected a
	// while ago, refreshed now, holding nothing.
	if _, err := pool.Exec(ctx, `
		INSERT INTO outbox.relay_session (session_id, relay_id, peer, replica_id, streams, max_in_flight, in_flight, connected_at, seen_at)
		VALUES (gen_random_uuid(), 'stuck', '10.0.0.1:1', 'other-replica', '{idle}', 8, 0, now() - interval '1 hour', clock_timestamp()),
		       (gen_random_uuid(), 'elsewhere', '10.0.0.2:1', 'other-replica', '{other}', 8, 0, now() - interval '1 hour', clock_timestamp())`); err != nil {
		t.Fatal(err)
	}
	lag, err := r.Admin.GetLag(ctx, &outboxv1.GetLagRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if len(lag.GetStreams()) != 1 || lag.GetStreams()[0].GetIdleRelays() != 1 || lag.GetTotal().GetIdleRelays() != 1 {
		t.Fatalf("lag %v", lag)
	}
	if got := gatherSum(t, reg, "outboxd_idle_relays"); got != 1 {
		t.Fatalf("outboxd_idle_relays = %v", got)
	}
	// Holding a delivery, it is not idle.
	if _, err := pool.Exec(ctx, `UPDATE outbox.relay_session SET in_flight = 1 WHERE relay_id = 'stuck'`); err != nil {
		t.Fatal(err)
	}
	lag, err = r.Admin.GetLag(ctx, &outboxv1.GetLagRequest{})
	if err != nil || lag.GetTotal().GetIdleRelays() != 0 {
		t.Fatalf("lag %v, %v", lag, err)
	}
}

// Pending events that no rule will deliver (here: a delivery row that says
// idle with an event pending, as a delivery bug would leave it) are
// stranded in GetLag, per stream and in the total, and in the metric.
func TestStrandedEventsInLagAndMetric(t *testing.T) {
	t.Parallel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	reg := prometheus.NewPedanticRegistry()
	r := startReplica(t, url, func(c *server.Config) { c.Registerer = reg })
	emit(t, pool, "orders", "lost", 1)
	emit(t, pool, "billing", "fine", 1)
	waitState(t, pool, "lost", "ready")
	waitState(t, pool, "fine", "ready")
	strandLost(t, pool)
	lag := audited(t, r)
	byStream := map[string]int64{}
	for _, l := range lag.GetStreams() {
		byStream[l.GetStream()] = l.GetStrandedEvents()
	}
	if byStream["orders"] != 1 || byStream["billing"] != 0 || lag.GetTotal().GetStrandedEvents() != 1 {
		t.Fatalf("stranded events in lag: %v, total %d", byStream, lag.GetTotal().GetStrandedEvents())
	}
	if got := gatherSum(t, reg, "outboxd_stranded_events"); got != 1 {
		t.Fatalf("outboxd_stranded_events = %v", got)
	}
}

// parkSome parks n aggregates of stream (MaxFailures 1), each with one
// pending event, and returns their keys.
func parkSome(t *testing.T, ctx context.Context, r *replica, pool *pgxpool.Pool, stream string, n int, errText string) []string {
	t.Helper()
	var keys []string
	for i := range n {
		keys = append(keys, fmt.Sprintf("%s-%03d", stream, i))
		emit(t, pool, stream, keys[i], 1)
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel() // the relay leaves; it holds nothing by then
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{Streams: []string{stream}, MaxInFlight: 1, LeaseTtl: durationpb.New(time.Hour)})
	for range n {
		d := recv(t, st)
		if _, err := r.Relay.Nack(ctx, &outboxv1.NackRequest{EventId: d.GetEvent().GetEventId(), LeaseToken: d.GetLeaseToken(), Error: errText}); err != nil {
			t.Fatal(err)
		}
	}
	return keys
}

func TestListAggregatesFiltersAndPages(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, func(c *server.Config) { c.MaxFailures = 1 })
	parked := parkSome(t, ctx, r, pool, "billing.invoice", 5, "HTTP 503 Service Unavailable")
	parkSome(t, ctx, r, pool, "billing.refund", 2, "timeout")
	emit(t, pool, "sales", "ready-1", 2)
	waitState(t, pool, "ready-1", "ready")

	list := func(f *outboxv1.AggregateFilter, size uint32) []string {
		t.Helper()
		var keys []string
		tok := ""
		var prev time.Time
		for {
			res, err := r.Admin.ListAggregates(ctx, &outboxv1.ListAggregatesRequest{Filter: f, PageSize: size, PageToken: tok})
			if err != nil {
				t.Fatal(err)
			}
			for _, a := range res.GetAggregates() {
				if at := a.GetOldestPendingCreatedAt().AsTime(); at.Before(prev) {
					t.Fatalf("not oldest first: %v after %v", at, prev)
				} else {
					prev = at
				}
				keys = append(keys, a.GetAggregateKey())
			}
			if tok = res.GetNextPageToken(); tok == "" {
				return keys
			}
		}
	}
	if got := list(&outboxv1.AggregateFilter{Stream: "billing.invoice"}, 2); !slices.Equal(got, parked) {
		t.Fatalf("exact stream, pages of 2: %v", got)
	}
	// A page that holds the last of them says so: no token to an empty page.
	if res, err := r.Admin.ListAggregates(ctx, &outboxv1.ListAggregatesRequest{Filter: &outboxv1.AggregateFilter{Stream: "billing.invoice"},
		PageSize: uint32(len(parked))}); err != nil || len(res.GetAggregates()) != len(parked) || res.GetNextPageToken() != "" {
		t.Fatalf("all %d invoices in one page of %d: %v, %v; want them all and no next page", len(parked), len(parked), res, err)
	}
	if got := list(&outboxv1.AggregateFilter{Stream: "billing.*"}, 0); len(got) != 7 {
		t.Fatalf("prefix: %v", got)
	}
	if got := list(nil, 3); len(got) != 8 {
		t.Fatalf("no filter: %v", got)
	}
	if got := list(&outboxv1.AggregateFilter{ErrorContains: "service UNAVAILABLE"}, 0); len(got) != 5 {
		t.Fatalf("error text: %v", got)
	}
	if got := list(&outboxv1.AggregateFilter{States: []outboxv1.AggregateState{outboxv1.AggregateState_AGGREGATE_STATE_READY}}, 0); !slices.Equal(got, []string{"ready-1"}) {
		t.Fatalf("ready: %v", got)
	}
	if got := list(&outboxv1.AggregateFilter{Stream: "billing.*", PendingBefore: timestamppb.New(time.Now().Add(-time.Hour))}, 0); len(got) != 0 {
		t.Fatalf("pending before an hour ago: %v", got)
	}
	// The invoices were emitted before the refunds: a cut between them.
	var cut time.Time
	if err := pool.QueryRow(ctx, `SELECT min(created_at) FROM outbox.event WHERE stream = 'billing.refund'`).Scan(&cut); err != nil {
		t.Fatal(err)
	}
	if got := list(&outboxv1.AggregateFilter{Stream: "billing.*", PendingBefore: timestamppb.New(cut)}, 0); !slices.Equal(got, parked) {
		t.Fatalf("pending before the first refund: %v, want the invoices %v", got, parked)
	}
	if got := list(&outboxv1.AggregateFilter{Stream: "billing.*", PendingBefore: timestamppb.Now()}, 0); len(got) != 7 {
		t.Fatalf("pending before now: %v", got)
	}

	for _, c := range []struct {
		req   *outboxv1.ListAggregatesRequest
		field string
	}{
		{&outboxv1.ListAggregatesRequest{Filter: &outboxv1.AggregateFilter{Stream: "Billing"}}, "filter.stream"},
		{&outboxv1.ListAggregatesRequest{Filter: &outboxv1.AggregateFilter{Stream: "billing.*.x"}}, "filter.stream"},
		{&outboxv1.ListAggregatesRequest{Filter: &outboxv1.AggregateFilter{States: []outboxv1.AggregateState{outboxv1.AggregateState_AGGREGATE_STATE_IDLE}}}, "filter.states[0]"},
		{&outboxv1.ListAggregatesRequest{Filter: &outboxv1.AggregateFilter{ErrorContains: strings.Repeat("x", 1025)}}, "filter.error_contains"},
		{&outboxv1.ListAggregatesRequest{Filter: &outboxv1.AggregateFilter{PendingBefore: &timestamppb.Timestamp{Seconds: -1 << 62}}}, "filter.pending_before"},
		{&outboxv1.ListAggregatesRequest{PageSize: 1001}, "page_size"},
		{&outboxv1.ListAggregatesRequest{PageToken: "x"}, "page_token"},
		{&outboxv1.ListAggregatesRequest{PageToken: base64.RawURLEncoding.EncodeToString([]byte(`{"t":0,"s":"","k":""}`))}, "page_token"},
	} {
		_, err := r.Admin.ListAggregates(ctx, c.req)
		wantCode(t, err, codes.InvalidArgument, c.field)
	}
}

func TestBulkRetryAndSkip(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, func(c *server.Config) { c.MaxFailures = 1 })
	parkSome(t, ctx, r, pool, "billing.invoice", 30, "HTTP 503")
	parkSome(t, ctx, r, pool, "billing.refund", 4, "bad payload")

	// Refused: an empty filter, states BulkRetry does not retry, skips
	// without a reason.
	_, err := r.Admin.BulkRetry(ctx, &outboxv1.BulkRetryRequest{})
	wantCode(t, err, codes.InvalidArgument, "filter")
	_, err = r.Admin.BulkSkip(ctx, &outboxv1.BulkSkipRequest{Filter: &outboxv1.AggregateFilter{}, Reason: "r"})
	wantCode(t, err, codes.InvalidArgument, "filter")
	_, err = r.Admin.BulkRetry(ctx, &outboxv1.BulkRetryRequest{Filter: &outboxv1.AggregateFilter{
		States: []outboxv1.AggregateState{outboxv1.AggregateState_AGGREGATE_STATE_LEASED}}})
	wantCode(t, err, codes.InvalidArgument, "filter.states")
	_, err = r.Admin.BulkRetry(ctx, &outboxv1.BulkRetryRequest{Filter: &outboxv1.AggregateFilter{Stream: "*"}, AcceptGap: true})
	wantCode(t, err, codes.InvalidArgument, "reason")
	_, err = r.Admin.BulkSkip(ctx, &outboxv1.BulkSkipRequest{Filter: &outboxv1.AggregateFilter{Stream: "*"}})
	wantCode(t, err, codes.InvalidArgument, "reason")

	// Older than: the invoices were parked before the refunds were emitted.
	var cut time.Time
	if err := pool.QueryRow(ctx, `SELECT min(created_at) FROM outbox.event WHERE stream = 'billing.refund'`).Scan(&cut); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		before time.Time
		want   int64
	}{{cut, 30}, {time.Now(), 34}, {time.Now().Add(-time.Hour), 0}} {
		res, err := r.Admin.BulkSkip(ctx, &outboxv1.BulkSkipRequest{Filter: &outboxv1.AggregateFilter{Stream: "billing.*",
			PendingBefore: timestamppb.New(c.before)}, Reason: "r", DryRun: true})
		if err != nil || res.GetMatched() != c.want {
			t.Fatalf("bulk skip dry run pending before %v: %v, %v; want %d matched", c.before, res, err, c.want)
		}
	}

	// Dry runs count and sample, and change nothing.
	dry, err := r.Admin.BulkRetry(ctx, &outboxv1.BulkRetryRequest{Filter: &outboxv1.AggregateFilter{ErrorContains: "503"}, DryRun: true})
	if err != nil {
		t.Fatal(err)
	}
	if dry.GetMatched() != 30 || dry.GetRetried() != 0 || len(dry.GetSample()) != 20 {
		t.Fatalf("dry run: matched %d retried %d sample %d", dry.GetMatched(), dry.GetRetried(), len(dry.GetSample()))
	}
	if n := countWhere(t, pool, `outbox.delivery`, `state = 'parked'`); n != 34 {
		t.Fatalf("dry run changed something: %d parked", n)
	}
	real, err := r.Admin.BulkRetry(ctx, &outboxv1.BulkRetryRequest{Filter: &outboxv1.AggregateFilter{ErrorContains: "503"},
		Reason: "broker is back", Actor: "alice"})
	if err != nil {
		t.Fatal(err)
	}
	if real.GetMatched() != dry.GetMatched() || real.GetRetried() != dry.GetMatched() {
		t.Fatalf("real run: matched %d retried %d, dry run matched %d", real.GetMatched(), real.GetRetried(), dry.GetMatched())
	}
	if n := countWhere(t, pool, `outbox.delivery`, `state = 'ready' AND stream = 'billing.invoice'`); n != 30 {
		t.Fatalf("%d ready after the retry", n)
	}

	skipDry, err := r.Admin.BulkSkip(ctx, &outboxv1.BulkSkipRequest{Filter: &outboxv1.AggregateFilter{Stream: "billing.refund"},
		Reason: "poison", DryRun: true})
	if err != nil || skipDry.GetMatched() != 4 || skipDry.GetSkipped() != 0 {
		t.Fatalf("skip dry run %v, %v", skipDry, err)
	}
	skip, err := r.Admin.BulkSkip(ctx, &outboxv1.BulkSkipRequest{Filter: &outboxv1.AggregateFilter{Stream: "billing.refund"},
		Reason: "poison", Actor: "bob"})
	if err != nil || skip.GetMatched() != 4 || skip.GetSkipped() != 4 {
		t.Fatalf("skip %v, %v", skip, err)
	}
	if n := countWhere(t, pool, `outbox.skipped_event`, `actor = 'bob' AND reason LIKE 'poison (bulk skip, action %)'`); n != 4 {
		t.Fatalf("%d skips recorded", n)
	}
	if n := countWhere(t, pool, `outbox.operator_action`,
		`(action, actor, reason, aggregates) IN (('bulk_retry', 'alice', 'broker is back', 30), ('bulk_skip', 'bob', 'poison', 4)) AND finished_at IS NOT NULL`); n != 2 {
		t.Fatalf("%d actions recorded", n)
	}
}

func countWhere(t *testing.T, pool *pgxpool.Pool, table, where string) int64 {
	t.Helper()
	var n int64
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM `+table+` WHERE `+where).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// recordingSink publishes into memory, recording every copy in order.
type recordingSink struct {
	mu     sync.Mutex
	got    []relay.Event
	signal chan struct{}
}

func newRecordingSink() *recordingSink { return &recordingSink{signal: make(chan struct{}, 1)} }

func (s *recordingSink) Publish(_ context.Context, ev relay.Event) error {
	s.mu.Lock()
	s.got = append(s.got, ev)
	s.mu.Unlock()
	select {
	case s.signal <- struct{}{}:
	default:
	}
	return nil
}

func (s *recordingSink) events() []relay.Event {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.got)
}

// Bulk skips and retries racing live relays lose nothing and never skip a
// published event: at the end every event is published or skipped, not
// both, and each aggregate's first copies kept revision order.
func TestBulkActionsRacingRelays(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, func(c *server.Config) {
		c.MaxFailures = 1
		c.BackoffBase, c.BackoffCap = time.Millisecond, time.Millisecond
	})
	const aggs, revs = 40, 5
	for i := range aggs {
		emit(t, pool, "race", fmt.Sprintf("k-%02d", i), revs)
	}
	sink := newRecordingSink()
	// Every third publish fails, so aggregates park and bulk retry has work.
	var mu sync.Mutex
	n := 0
	pub := publisherFunc(func(ctx context.Context, ev relay.Event) error {
		mu.Lock()
		n++
		fail := n%3 == 0
		mu.Unlock()
		if fail {
			return fmt.Errorf("flaky broker")
		}
		return sink.Publish(ctx, ev)
	})
	var wg sync.WaitGroup
	for i := range 2 {
		runner, err := relay.NewRunner(relay.Config{Conn: r.Conn, RelayID: fmt.Sprintf("racer-%d", i), Streams: []string{"race"},
			MaxInFlight: 8, Publisher: pub})
		if err != nil {
			t.Fatal(err)
		}
		wg.Add(1)
		go func() { defer wg.Done(); _ = runner.Run(ctx) }()
	}
	defer wg.Wait()
	defer cancel()

	// Operators act while the relays deliver: skip the next event of every
	// aggregate that failed and made no progress since (whatever its state:
	// parked, retried and ready, or leased again), retry parked ones, until
	// nothing is pending.
	var skipped int64
	for round := 0; ; round++ {
		res, err := r.Admin.BulkSkip(ctx, &outboxv1.BulkSkipRequest{Filter: &outboxv1.AggregateFilter{Stream: "race", ErrorContains: "flaky"}, Reason: "race"})
		if err != nil {
			t.Fatal(err)
		}
		skipped += res.GetSkipped()
		if _, err := r.Admin.BulkRetry(ctx, &outboxv1.BulkRetryRequest{Filter: &outboxv1.AggregateFilter{Stream: "race"}}); err != nil {
			t.Fatal(err)
		}
		if countWhere(t, pool, `outbox.event e`, `e.published_at IS NULL AND NOT EXISTS (SELECT 1 FROM outbox.skipped_event s WHERE s.event_id = e.event_id)`) == 0 {
			break
		}
		if round > 10000 {
			t.Fatal("events still pending after many rounds")
		}
	}
	if n := countWhere(t, pool, `outbox.event e JOIN outbox.skipped_event s USING (event_id)`, `e.published_at IS NOT NULL`); n != 0 {
		t.Fatalf("%d events both skipped and published", n)
	}
	if n := countWhere(t, pool, `outbox.skipped_event`, `true`); n != skipped {
		t.Fatalf("%d skips recorded, bulk skip reported %d", n, skipped)
	}
	published := countWhere(t, pool, `outbox.event`, `published_at IS NOT NULL`)
	if published+skipped != aggs*revs {
		t.Fatalf("%d published + %d skipped != %d", published, skipped, aggs*revs)
	}
	t.Logf("%d published, %d skipped", published, skipped)
	if published == 0 {
		t.Fatal("nothing was published")
	}
	// First copies of published events in revision order per aggregate (a
	// skipped event may reach the broker late: its relay was mid-publish).
	seen := map[string]bool{}
	rows, err := pool.Query(ctx, `SELECT event_id::text FROM outbox.skipped_event`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			t.Fatal(err)
		}
		seen[id] = true
	}
	rows.Close()
	firstSeen := map[string][]int64{}
	for _, ev := range sink.events() {
		if !seen[ev.ID] {
			seen[ev.ID] = true
			firstSeen[ev.AggregateKey] = append(firstSeen[ev.AggregateKey], ev.Revision)
		}
	}
	for k, rs := range firstSeen {
		if !slices.IsSorted(rs) {
			t.Errorf("aggregate %s first copies out of order: %v", k, rs)
		}
	}
}

func TestRepublish(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	ids := emit(t, pool, "orders", "rp", 5)
	other := emit(t, pool, "orders", "rp-other", 2)
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{RelayId: "first", MaxInFlight: 1, LeaseTtl: durationpb.New(time.Hour)})
	for range 7 {
		ack(t, r, recv(t, st))
	}
	var firstPublished time.Time
	if err := pool.QueryRow(ctx, `SELECT published_at FROM outbox.event WHERE event_id = $1`, ids[2]).Scan(&firstPublished); err != nil {
		t.Fatal(err)
	}

	// Bad input.
	instant := timestamppb.Now()
	for _, c := range []struct {
		req   *outboxv1.RepublishRequest
		field string
	}{
		{&outboxv1.RepublishRequest{AggregateKey: "rp", FromRevision: 1, Reason: "r"}, "stream"},
		{&outboxv1.RepublishRequest{Stream: "orders", AggregateKey: "rp", FromRevision: 1}, "reason"},
		{&outboxv1.RepublishRequest{Stream: "orders", AggregateKey: "rp", Reason: "r"}, "from_revision"},
		{&outboxv1.RepublishRequest{Stream: "orders", FromRevision: 2, Reason: "r"}, "from_revision"},
		{&outboxv1.RepublishRequest{Stream: "orders", AggregateKey: "rp", FromRevision: 2, PublishedAfter: timestamppb.New(time.Now().Add(-time.Hour)), Reason: "r"}, "from_revision"},
		{&outboxv1.RepublishRequest{Stream: "orders", AggregateKey: "rp", FromRevision: -1, Reason: "r"}, "from_revision"},
		{&outboxv1.RepublishRequest{Stream: "orders", PublishedBefore: timestamppb.Now(), Reason: "r"}, "published_after"},
		{&outboxv1.RepublishRequest{Stream: "orders", PublishedAfter: timestamppb.Now(), PublishedBefore: timestamppb.New(time.Now().Add(-time.Hour)), Reason: "r"}, "published_before"},
		{&outboxv1.RepublishRequest{Stream: "orders", PublishedAfter: instant, PublishedBefore: instant, Reason: "r"}, "published_before"},
	} {
		_, err := r.Admin.Republish(ctx, c.req)
		wantCode(t, err, codes.InvalidArgument, c.field)
	}
	_, err := r.Admin.Republish(ctx, &outboxv1.RepublishRequest{Stream: "orders", AggregateKey: "nope", FromRevision: 1, Reason: "r"})
	wantCode(t, err, codes.NotFound, "")
	_, err = r.Admin.Republish(ctx, &outboxv1.RepublishRequest{Stream: "orders", AggregateKey: "rp", FromRevision: 6, Reason: "r"})
	wantCode(t, err, codes.FailedPrecondition, "")

	actions := countWhere(t, pool, "outbox.operator_action", "true")
	dry, err := r.Admin.Republish(ctx, &outboxv1.RepublishRequest{Stream: "orders", AggregateKey: "rp", FromRevision: 3, Reason: "lost", DryRun: true})
	if err != nil || dry.GetAggregates() != 1 || dry.GetEvents() != 3 {
		t.Fatalf("dry run %v, %v", dry, err)
	}
	if n := countWhere(t, pool, `outbox.event`, `published_at IS NULL`); n != 0 {
		t.Fatalf("dry run made %d pending", n)
	}
	if n := countWhere(t, pool, "outbox.operator_action", "true"); n != actions {
		t.Fatalf("dry run recorded %d operator actions", n-actions)
	}
	res, err := r.Admin.Republish(ctx, &outboxv1.RepublishRequest{Stream: "orders", AggregateKey: "rp", FromRevision: 3,
		Reason: "consumer lost its data", Actor: "carol"})
	if err != nil || res.GetAggregates() != 1 || res.GetEvents() != 3 {
		t.Fatalf("republish %v, %v", res, err)
	}
	// Pending again: lag counts them, purge spares them.
	lag, err := r.Admin.GetLag(ctx, &outboxv1.GetLagRequest{Streams: []string{"orders"}})
	if err != nil || lag.GetTotal().GetPendingEvents() != 3 {
		t.Fatalf("lag after republish %v, %v", lag, err)
	}
	if _, err := pool.Exec(ctx, `DELETE FROM outbox.event WHERE event_id = $1`, ids[2]); err == nil {
		t.Fatal("an event awaiting re-delivery was deleted")
	}
	// The relay sees them again: same ids, in order, then nothing else.
	for _, want := range ids[2:] {
		d := recv(t, st)
		if d.GetEvent().GetEventId() != want.String() {
			t.Fatalf("redelivered %s (revision %d), want %s", d.GetEvent().GetEventId(), d.GetEvent().GetRevision(), want)
		}
		ackPublished(t, r, d)
	}
	var again time.Time
	if err := pool.QueryRow(ctx, `SELECT published_at FROM outbox.event WHERE event_id = $1`, ids[2]).Scan(&again); err != nil || !again.After(firstPublished) {
		t.Fatalf("published again at %v (first %v), %v", again, firstPublished, err)
	}
	var previous string
	if err := pool.QueryRow(ctx, `
		SELECT r.previous_published_at ->> $1 FROM outbox.republished r
		JOIN outbox.operator_action a USING (action_id)
		WHERE a.action = 'republish' AND a.actor = 'carol' AND a.reason = 'consumer lost its data'
		  AND r.from_revision = 3 AND r.to_revision = 5 AND r.events = 3 AND a.events = 3`, ids[2].String()).Scan(&previous); err != nil {
		t.Fatal(err)
	}
	if p, err := time.Parse(time.RFC3339Nano, previous); err != nil || !p.Equal(firstPublished) {
		t.Fatalf("previous published_at %q, want %v", previous, firstPublished)
	}

	// A time range: every aggregate with an event published in it, from its
	// first such revision; a lease in flight ends and its event follows.
	emit(t, pool, "orders", "rp-other", 1)
	inflight := recv(t, st) // rp-other revision 3, leased
	since := firstPublished.Add(-time.Hour)
	res, err = r.Admin.Republish(ctx, &outboxv1.RepublishRequest{Stream: "orders", PublishedAfter: timestamppb.New(since), Reason: "replay"})
	if err != nil || res.GetAggregates() != 2 || res.GetEvents() != 7 || res.GetRefusedAggregates() != 0 {
		t.Fatalf("time range %v, %v", res, err)
	}
	if res := ack(t, r, inflight); res[0].GetStatus() != outboxv1.AckStatus_ACK_STATUS_LEASE_LOST {
		t.Fatalf("ack of the lease the republish ended: %v", res[0])
	}
	got := map[string][]string{}
	for range 5 + 3 {
		d := recv(t, st)
		got[d.GetEvent().GetAggregateKey()] = append(got[d.GetEvent().GetAggregateKey()], d.GetEvent().GetEventId())
		ack(t, r, d)
	}
	want := append(slices.Clone(other), uuid.MustParse(inflight.GetEvent().GetEventId()))
	if !slices.Equal(got["rp"], strs(ids)) || !slices.Equal(got["rp-other"], strs(want)) {
		t.Fatalf("time-range redeliveries %v", got)
	}
}

func strs(ids []uuid.UUID) []string {
	out := make([]string, len(ids))
	for i, id := range ids {
		out[i] = id.String()
	}
	return out
}

// Republish refuses what delivery could not walk through again, and a
// parked aggregate.
func TestRepublishRefuses(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, func(c *server.Config) { c.MaxFailures = 1 })
	emit(t, pool, "orders", "purged", 3)
	emit(t, pool, "orders", "parked", 2)
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{Streams: []string{"orders"}, MaxInFlight: 1, LeaseTtl: durationpb.New(time.Hour)})
	for range 4 {
		d := recv(t, st)
		ack(t, r, d)
	}
	d := recv(t, st)
	nack(t, r, d) // the last one parks
	var parkedKey, doneKey string = d.GetEvent().GetAggregateKey(), "purged"
	if parkedKey == "purged" {
		doneKey = "parked"
	}
	_, err := r.Admin.Republish(ctx, &outboxv1.RepublishRequest{Stream: "orders", AggregateKey: parkedKey, FromRevision: 1, Reason: "r"})
	wantCode(t, err, codes.FailedPrecondition, "")
	// Purge revision 2 of the other one: republishing across it is refused.
	if _, err := pool.Exec(ctx, `DELETE FROM outbox.event WHERE aggregate_key = $1 AND revision = 2`, doneKey); err != nil {
		t.Fatal(err)
	}
	_, err = r.Admin.Republish(ctx, &outboxv1.RepublishRequest{Stream: "orders", AggregateKey: doneKey, FromRevision: 1, Reason: "r"})
	wantCode(t, err, codes.FailedPrecondition, "")
	// A time range of one aggregate is refused like its revision would be,
	// not counted as refused in an answer of success.
	_, err = r.Admin.Republish(ctx, &outboxv1.RepublishRequest{Stream: "orders", AggregateKey: parkedKey,
		PublishedAfter: timestamppb.New(time.Now().Add(-time.Hour)), Reason: "r"})
	wantCode(t, err, codes.FailedPrecondition, "")
	_, err = r.Admin.Republish(ctx, &outboxv1.RepublishRequest{Stream: "orders", AggregateKey: "never", FromRevision: 1, Reason: "r"})
	wantCode(t, err, codes.NotFound, "")
	// A time range in which the aggregate published nothing: nothing to
	// do, an empty answer.
	if res, err := r.Admin.Republish(ctx, &outboxv1.RepublishRequest{Stream: "orders", AggregateKey: doneKey,
		PublishedAfter: timestamppb.New(time.Now().Add(time.Minute)), PublishedBefore: timestamppb.New(time.Now().Add(time.Hour)), Reason: "r"}); err != nil ||
		res.GetAggregates() != 0 || res.GetEvents() != 0 || res.GetRefusedAggregates() != 0 {
		t.Fatalf("republish of a range without events: %v, %v", res, err)
	}
	// Refused, or with nothing to do, a republish of one aggregate did
	// nothing and is not recorded (as a refused retry or skip is not).
	if n := countWhere(t, pool, "outbox.operator_action", "action = 'republish'"); n != 0 {
		t.Errorf("%d republish actions recorded for calls refused", n)
	}
	res, err := r.Admin.Republish(ctx, &outboxv1.RepublishRequest{Stream: "orders", PublishedAfter: timestamppb.New(time.Now().Add(-time.Hour)),
		Reason: "r", DryRun: true})
	if err != nil || res.GetRefusedAggregates() != 2 || len(res.GetRefused()) != 2 || res.GetAggregates() != 0 {
		t.Fatalf("time range over refused aggregates: %v, %v", res, err)
	}
}

// A republish refuses a range holding a stranded event (pending below the
// cursor, which delivery will never offer again): rewinding over it would
// deliver it among the republished events as if it were one of them, with
// its stranding unexplained. One such event is enough.
func TestRepublishRefusesARangeWithOneStrandedEvent(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	publishedOnOneCredit(t, ctx, r, pool, "a", 3)
	// Revision 2 pending again behind the cursor, as only a fault would
	// leave it (published_at goes back to NULL only under the republish
	// setting).
	if _, err := pool.Exec(ctx, `DO $$ BEGIN
		PERFORM set_config('outbox.republishing', 'on', true);
		UPDATE outbox.event SET published_at = NULL WHERE aggregate_key = 'a' AND revision = 2;
	END $$`); err != nil {
		t.Fatal(err)
	}
	_, err := r.Admin.Republish(ctx, &outboxv1.RepublishRequest{Stream: "orders", AggregateKey: "a", FromRevision: 1, Reason: "r"})
	wantCode(t, err, codes.FailedPrecondition, "")
	if !strings.Contains(status.Convert(err).Message(), "1 stranded events") {
		t.Errorf("refusal does not name the stranded event: %v", err)
	}
	if n := countWhere(t, pool, "outbox.event", "aggregate_key = 'a' AND published_at IS NOT NULL"); n != 2 {
		t.Errorf("%d of the other two events still published, want 2: the refused rewind changed them", n)
	}
	if n := countWhere(t, pool, "outbox.operator_action", "action = 'republish'"); n != 0 {
		t.Errorf("%d republish actions recorded for a refused call", n)
	}
}

// A purge that deletes an event of the range while a republish counts it
// (the purge's DELETE uncommitted, so the count still sees the event
// published; the republish's reset then waits for the row and finds it
// gone) makes the republish refuse, not rewind over a missing revision,
// where delivery would stop at the gap it made.
func TestRepublishRacingAPurgeOfItsRangeRefuses(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	publishedOnOneCredit(t, ctx, r, pool, "a", 3)
	purge, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = purge.Rollback(context.Background()) }()
	if _, err := purge.Exec(ctx, `DELETE FROM outbox.event WHERE aggregate_key = 'a' AND revision = 2`); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := r.Admin.Republish(ctx, &outboxv1.RepublishRequest{Stream: "orders", AggregateKey: "a", FromRevision: 1, Reason: "r"})
		done <- err
	}()
	waitBlocked(t, ctx, pool, "the republish's reset", "%UPDATE outbox.event e SET published_at = NULL%")
	if err := purge.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	err = <-done
	wantCode(t, err, codes.FailedPrecondition, "")
	if !strings.Contains(status.Convert(err).Message(), "changed while being rewound") {
		t.Errorf("refusal does not say the aggregate changed: %v", err)
	}
	if n := countWhere(t, pool, "outbox.event", "aggregate_key = 'a' AND published_at IS NULL"); n != 0 {
		t.Errorf("%d events made pending by a refused rewind", n)
	}
	if n := countWhere(t, pool, "outbox.delivery", "aggregate_key = 'a' AND delivered_revision = 3"); n != 1 {
		t.Errorf("the refused rewind moved the cursor")
	}
}

// Purging a published event deletes its attempt history too; a pending
// event's history stays.
func TestPurgeTakesAttemptsAlong(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, func(c *server.Config) { c.BackoffBase, c.BackoffCap = time.Millisecond, time.Millisecond })
	ids := emit(t, pool, "orders", "p", 2)
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 1, LeaseTtl: durationpb.New(time.Hour)})
	nack(t, r, recv(t, st))
	ack(t, r, recv(t, st))  // revision 1 published after one failure
	nack(t, r, recv(t, st)) // revision 2 fails once and stays pending
	if n := countWhere(t, pool, "outbox.attempt", "true"); n != 2 {
		t.Fatalf("%d attempts recorded, want 2", n)
	}
	purge, err := r.Admin.Purge(ctx, &outboxv1.PurgeRequest{PublishedBefore: timestamppb.New(time.Now().Add(time.Hour))})
	if err != nil {
		t.Fatal(err)
	}
	for {
		res, err := purge.Recv()
		if err != nil {
			t.Fatal(err)
		}
		if res.GetDone() {
			if res.GetDeleted() != 1 {
				t.Fatalf("purged %d events, want 1", res.GetDeleted())
			}
			break
		}
	}
	if n := countWhere(t, pool, "outbox.attempt", "event_id = '"+ids[0].String()+"'"); n != 0 {
		t.Fatalf("%d attempts of the purged event left", n)
	}
	if n := countWhere(t, pool, "outbox.attempt", "event_id = '"+ids[1].String()+"'"); n != 1 {
		t.Fatalf("%d attempts of the pending event left, want 1", n)
	}
}

// A time-range republish walks every aggregate with an event published in
// the range, beyond its first page of candidates (100), and its response
// samples at most 20 of the aggregates it refused while counting them all.
func TestRepublishTimeRangeWalksEveryAggregate(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, func(c *server.Config) { c.MaxFailures = 1 })
	const aggregates, parked = 101, 25
	for i := range aggregates {
		emit(t, pool, "orders", fmt.Sprintf("a-%03d", i), 1)
	}
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{Streams: []string{"orders"}, MaxInFlight: aggregates, LeaseTtl: durationpb.New(time.Hour)})
	ds := make([]*outboxv1.SubscribeResponse, aggregates)
	for i := range ds {
		ds[i] = recv(t, st)
	}
	ackPublished(t, r, ds...)
	// A second revision of some, parked: republishing those is refused.
	for i := range parked {
		emit(t, pool, "orders", fmt.Sprintf("a-%03d", i), 1)
	}
	for range parked {
		nack(t, r, recv(t, st))
	}
	if n := countWhere(t, pool, "outbox.delivery", "state = 'parked'"); n != parked {
		t.Fatalf("%d aggregates parked, want %d", n, parked)
	}
	res, err := r.Admin.Republish(ctx, &outboxv1.RepublishRequest{Stream: "orders", PublishedAfter: timestamppb.New(time.Now().Add(-time.Hour)),
		Reason: "replay", DryRun: true})
	if err != nil {
		t.Fatal(err)
	}
	if res.GetAggregates() != aggregates-parked || res.GetEvents() != aggregates-parked || res.GetRefusedAggregates() != parked || len(res.GetRefused()) != 20 {
		t.Fatalf("time range over %d aggregates, %d of them parked: %d aggregates, %d events, %d refused (%d named); want %d, %d, %d (20 named)",
			aggregates, parked, res.GetAggregates(), res.GetEvents(), res.GetRefusedAggregates(), len(res.GetRefused()),
			aggregates-parked, aggregates-parked, parked)
	}
}

// A bulk action cut short (its caller gone) is still recorded as finished,
// with what it did: the record is written on a context of its own. The
// caller of a bulk retry of two parked aggregates hangs up as the action is
// about to retry the second, and the server's call sees it first.
func TestABulkActionCutShortIsRecorded(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, func(c *server.Config) { c.MaxFailures = 1 })
	parkSome(t, ctx, r, pool, "billing", 2, "HTTP 503")

	callCtx, hangUp := context.WithCancel(ctx)
	var acts atomic.Int32
	sawCancel := make(chan bool, 1)
	r.Server.SetBeforeBulkAct(func(serverCtx context.Context, _, _ string) {
		if acts.Add(1) != 2 {
			return
		}
		hangUp()
		select {
		case <-serverCtx.Done():
			sawCancel <- true
		case <-time.After(30 * time.Second):
			sawCancel <- false
		}
	})
	_, err := r.Admin.BulkRetry(callCtx, &outboxv1.BulkRetryRequest{Filter: &outboxv1.AggregateFilter{Stream: "billing"}})
	wantCode(t, err, codes.Canceled, "")
	if !<-sawCancel {
		t.Fatal("the server's call was not cancelled within 30s of the caller hanging up")
	}
	var aggregates int64
	waitFor(t, func() int32 {
		err := pool.QueryRow(ctx, `SELECT aggregates FROM outbox.operator_action
			WHERE action = 'bulk_retry' AND finished_at IS NOT NULL`).Scan(&aggregates)
		return b2i(err == nil)
	})
	if aggregates != 1 {
		t.Errorf("the action cut short records %d aggregates retried, want the 1 it retried", aggregates)
	}
}
