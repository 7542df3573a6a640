package server_test

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/server"
)

func listActions(t *testing.T, r *replica, req *outboxv1.ListOperatorActionsRequest) []*outboxv1.OperatorAction {
	t.Helper()
	res, err := r.Admin.ListOperatorActions(context.Background(), req)
	if err != nil {
		t.Fatal(err)
	}
	return res.GetActions()
}

func detail(t *testing.T, a *outboxv1.OperatorAction) map[string]any {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal([]byte(a.GetDetailJson()), &m); err != nil {
		t.Fatalf("detail of %v: %v", a, err)
	}
	return m
}

// Single retries (with and without an accepted gap) and skips are recorded
// like bulk actions, with who, when, why and what they did to which
// aggregate; a refused retry records nothing; the listing filters and pages.
func TestOperatorActionsRecorded(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, func(c *server.Config) { c.MaxFailures = 1 })
	emit(t, pool, "orders", "p", 1)
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 1, LeaseTtl: durationpb.New(time.Hour)})
	nack(t, r, recv(t, st)) // parks p
	before := time.Now()
	if _, err := r.Admin.RetryAggregate(ctx, &outboxv1.RetryAggregateRequest{Stream: "orders", AggregateKey: "p",
		Reason: "broker is back", Actor: "bob"}); err != nil {
		t.Fatal(err)
	}
	ack(t, r, recv(t, st))
	waitState(t, pool, "p", "idle")
	n := countWhere(t, pool, "outbox.operator_action", "true")
	_, err := r.Admin.RetryAggregate(ctx, &outboxv1.RetryAggregateRequest{Stream: "orders", AggregateKey: "p", Reason: "again"})
	wantCode(t, err, codes.FailedPrecondition, "")
	if m := countWhere(t, pool, "outbox.operator_action", "true"); m != n {
		t.Fatalf("a refused retry was recorded: %d actions, was %d", m, n)
	}

	// A gap accepted: the revisions given up are on the aggregate's record.
	emitAt(t, pool, "orders", "g", 1)
	emitAt(t, pool, "orders", "g", 4)
	ack(t, r, recv(t, st))
	waitState(t, pool, "g", "gap")
	if _, err := r.Admin.RetryAggregate(ctx, &outboxv1.RetryAggregateRequest{Stream: "orders", AggregateKey: "g",
		AcceptGap: true, Reason: "2-3 rolled back", Actor: "carol"}); err != nil {
		t.Fatal(err)
	}
	ack(t, r, recv(t, st))

	// A bulk retry, linked to each aggregate it retried.
	emit(t, pool, "orders", "b1", 1)
	emit(t, pool, "orders", "b2", 1)
	nack(t, r, recv(t, st))
	nack(t, r, recv(t, st))
	bulk, err := r.Admin.BulkRetry(ctx, &outboxv1.BulkRetryRequest{Filter: &outboxv1.AggregateFilter{Stream: "orders",
		States: []outboxv1.AggregateState{outboxv1.AggregateState_AGGREGATE_STATE_PARKED}}, Reason: "all of them", Actor: "dave"})
	if err != nil || bulk.GetRetried() != 2 {
		t.Fatalf("bulk retry %v, %v", bulk, err)
	}

	p := listActions(t, r, &outboxv1.ListOperatorActionsRequest{Stream: "orders", AggregateKey: "p"})
	if len(p) != 1 || p[0].GetAction() != "retry" || p[0].GetActor() != "bob" || p[0].GetReason() != "broker is back" ||
		p[0].GetStream() != "orders" || p[0].GetAggregates() != 1 || p[0].GetStartedAt().AsTime().Before(before.Add(-time.Minute)) ||
		p[0].GetFinishedAt() == nil || detail(t, p[0])["state"] != "parked" {
		t.Fatalf("actions of orders/p: %v", p)
	}
	g := listActions(t, r, &outboxv1.ListOperatorActionsRequest{Stream: "orders", AggregateKey: "g"})
	if len(g) != 1 || g[0].GetActor() != "carol" || g[0].GetReason() != "2-3 rolled back" {
		t.Fatalf("actions of orders/g: %v", g)
	}
	if gap, _ := detail(t, g[0])["accepted_gap"].(map[string]any); gap["from_revision"] != 2.0 || gap["to_revision"] != 3.0 {
		t.Fatalf("accept-gap detail %s", g[0].GetDetailJson())
	}
	b1 := listActions(t, r, &outboxv1.ListOperatorActionsRequest{Stream: "orders", AggregateKey: "b1"})
	if len(b1) != 1 || b1[0].GetAction() != "bulk_retry" || b1[0].GetAggregates() != 2 || b1[0].GetEvents() != 2 ||
		detail(t, b1[0])["state"] != "parked" {
		t.Fatalf("actions of orders/b1: %v", b1)
	}

	// Filters: by kind, by time; paging walks every action once, newest
	// first.
	if got := listActions(t, r, &outboxv1.ListOperatorActionsRequest{Action: "retry"}); len(got) != 2 || got[0].GetActor() != "carol" {
		t.Fatalf("retries: %v", got)
	}
	if got := listActions(t, r, &outboxv1.ListOperatorActionsRequest{Since: timestamppb.New(time.Now().Add(time.Hour))}); len(got) != 0 {
		t.Fatalf("actions since an hour ahead: %v", got)
	}
	if got := listActions(t, r, &outboxv1.ListOperatorActionsRequest{Stream: "other"}); len(got) != 0 {
		t.Fatalf("actions of another stream: %v", got)
	}
	var ids []int64
	tok := ""
	for {
		res, err := r.Admin.ListOperatorActions(ctx, &outboxv1.ListOperatorActionsRequest{PageSize: 1, PageToken: tok})
		if err != nil {
			t.Fatal(err)
		}
		if len(res.GetActions()) > 1 {
			t.Fatalf("a page of size 1 holds %d actions", len(res.GetActions()))
		}
		for _, a := range res.GetActions() {
			ids = append(ids, a.GetActionId())
		}
		if tok = res.GetNextPageToken(); tok == "" {
			break
		}
	}
	if len(ids) != 3 || !slices.IsSortedFunc(ids, func(a, b int64) int { return int(b - a) }) {
		t.Fatalf("paged action ids %v, want 3 newest first", ids)
	}

	for _, c := range []struct {
		req   *outboxv1.ListOperatorActionsRequest
		field string
	}{
		{&outboxv1.ListOperatorActionsRequest{Action: "delete"}, "action"},
		{&outboxv1.ListOperatorActionsRequest{AggregateKey: "p"}, "stream"},
		{&outboxv1.ListOperatorActionsRequest{Stream: "Bad Stream"}, "stream"},
		{&outboxv1.ListOperatorActionsRequest{PageToken: "!"}, "page_token"},
		{&outboxv1.ListOperatorActionsRequest{PageToken: base64.RawURLEncoding.EncodeToString([]byte("0"))}, "page_token"},
		{&outboxv1.ListOperatorActionsRequest{PageSize: 5000}, "page_size"},
	} {
		_, err := r.Admin.ListOperatorActions(ctx, c.req)
		wantCode(t, err, codes.InvalidArgument, c.field)
	}
}

// A skipped event can be delivered after all: a republish with
// include_skipped withdraws the skip (keeping its record with the action)
// and delivers it in its place in revision order, under its own id, payload
// and headers; every republished delivery continues its event's attempt
// numbers; where it cannot, the error says why.
func TestRepublishSkippedEvent(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, func(c *server.Config) { c.MaxFailures = 1 })
	ids := emit(t, pool, "orders", "k", 3)
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 1, LeaseTtl: durationpb.New(time.Hour)})
	ack(t, r, recv(t, st))
	d2 := recv(t, st)
	nack(t, r, d2) // revision 2 parks at attempt 1
	if _, err := r.Admin.SkipEvent(ctx, &outboxv1.SkipEventRequest{EventId: ids[1].String(), Reason: "poison", Actor: "ann"}); err != nil {
		t.Fatal(err)
	}
	d3 := recv(t, st)
	if d3.GetEvent().GetRevision() != 3 || d3.GetAttempt() != 1 {
		t.Fatalf("after the skip: revision %d attempt %d", d3.GetEvent().GetRevision(), d3.GetAttempt())
	}
	ack(t, r, d3)
	waitState(t, pool, "k", "idle")

	res, err := r.Admin.Republish(ctx, &outboxv1.RepublishRequest{Stream: "orders", AggregateKey: "k", FromRevision: 2,
		IncludeSkipped: true, Reason: "receiver fixed", Actor: "ann"})
	if err != nil || res.GetEvents() != 2 || res.GetUnskippedEvents() != 1 {
		t.Fatalf("republish with the skipped event: %v, %v", res, err)
	}
	// Revision 2 again, as it was, numbered after its one delivery on
	// record and the one in flight when it was skipped; then revision 3,
	// after the delivery that published it.
	again := recv(t, st)
	if !proto.Equal(again.GetEvent(), d2.GetEvent()) || again.GetAttempt() != 3 {
		t.Fatalf("republished skipped event %v attempt %d; want %v attempt 3", again.GetEvent(), again.GetAttempt(), d2.GetEvent())
	}
	ackPublished(t, r, again)
	if d := recv(t, st); d.GetEvent().GetEventId() != ids[2].String() || d.GetAttempt() != 2 {
		t.Fatalf("then %v attempt %d; want revision 3 attempt 2", d.GetEvent(), d.GetAttempt())
	} else {
		ack(t, r, d)
	}
	if n := countWhere(t, pool, "outbox.skipped_event", "true"); n != 0 {
		t.Fatalf("%d skips left after the republish withdrew them", n)
	}
	var prevReason string
	if err := pool.QueryRow(ctx, `SELECT previous_skips -> $1 ->> 'reason' FROM outbox.republished`, ids[1].String()).Scan(&prevReason); err != nil || prevReason != "poison" {
		t.Fatalf("the withdrawn skip's record: %q, %v", prevReason, err)
	}
	if evs, err := r.Admin.ListEvents(ctx, &outboxv1.ListEventsRequest{EventId: ids[1].String()}); err != nil ||
		len(evs.GetEvents()) != 1 || evs.GetEvents()[0].GetState() != outboxv1.EventState_EVENT_STATE_PUBLISHED {
		t.Fatalf("the formerly skipped event: %v, %v", evs, err)
	}

	// A second republish continues from where the first left off.
	if _, err := r.Admin.Republish(ctx, &outboxv1.RepublishRequest{Stream: "orders", AggregateKey: "k", FromRevision: 3, Reason: "once more"}); err != nil {
		t.Fatal(err)
	}
	if d := recv(t, st); d.GetEvent().GetEventId() != ids[2].String() || d.GetAttempt() != 3 {
		t.Fatalf("second republish: %v attempt %d; want revision 3 attempt 3", d.GetEvent(), d.GetAttempt())
	} else {
		ack(t, r, d)
	}

	// On the aggregate's record: the skip and both republishes, newest first.
	acts := listActions(t, r, &outboxv1.ListOperatorActionsRequest{Stream: "orders", AggregateKey: "k"})
	var kinds []string
	for _, a := range acts {
		kinds = append(kinds, a.GetAction())
	}
	if !slices.Equal(kinds, []string{"republish", "republish", "skip"}) || detail(t, acts[1])["unskipped"] != 1.0 ||
		detail(t, acts[2])["event_id"] != ids[1].String() || acts[2].GetReason() != "poison" {
		t.Fatalf("actions of orders/k: %v", acts)
	}

	// Only skipped events in the range, without include_skipped: refused,
	// saying how.
	emit(t, pool, "orders", "only", 1)
	only := recv(t, st)
	nack(t, r, only)
	if _, err := r.Admin.SkipEvent(ctx, &outboxv1.SkipEventRequest{EventId: only.GetEvent().GetEventId(), Reason: "r"}); err != nil {
		t.Fatal(err)
	}
	waitState(t, pool, "only", "idle")
	_, err = r.Admin.Republish(ctx, &outboxv1.RepublishRequest{Stream: "orders", AggregateKey: "only", FromRevision: 1, Reason: "r"})
	wantCode(t, err, codes.FailedPrecondition, "")
	if !strings.Contains(status.Convert(err).Message(), "include_skipped") {
		t.Fatalf("refusal without include_skipped: %v", err)
	}

	// A skipped event delivery has not reached yet: refused.
	ahead := emit(t, pool, "orders", "ahead", 2)
	first := recv(t, st) // revision 1, leased
	if _, err := r.Admin.SkipEvent(ctx, &outboxv1.SkipEventRequest{EventId: ahead[1].String(), Reason: "r"}); err != nil {
		t.Fatal(err)
	}
	_, err = r.Admin.Republish(ctx, &outboxv1.RepublishRequest{Stream: "orders", AggregateKey: "ahead", FromRevision: 2,
		IncludeSkipped: true, Reason: "r"})
	wantCode(t, err, codes.FailedPrecondition, "")
	if !strings.Contains(status.Convert(err).Message(), "not reached it yet") {
		t.Fatalf("refusal of a skipped event ahead of delivery: %v", err)
	}
	ack(t, r, first)
}
