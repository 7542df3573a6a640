package server_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/testdb"
)

// An admin token limited to billing.* neither sees nor acts on other streams
// through any AdminService RPC, against a real replica behind the
// production interceptors. Overviews (GetLag, ListRelays) are narrowed to
// what the token may see; a request naming another stream, or meaning "all
// streams" where the answer is events (ListEvents, Purge), is refused.
func TestStreamLimitedAdminToken(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startAuthReplica(t, url)
	bills := emit(t, pool, "billing.invoice", "i-1", 2)
	orders := emit(t, pool, "sales_order", "o-1", 2)

	// Three relays: one on billing, one on sales_order, one on everything.
	for _, sub := range []struct {
		token   string
		streams []string
	}{{billingToken, []string{"billing.invoice"}}, {relayToken, []string{"sales_order"}}, {relayToken, nil}} {
		st, err := outboxv1.NewRelayServiceClient(dialAs(t, r, sub.token)).Subscribe(ctx,
			&outboxv1.SubscribeRequest{RelayId: "r", Streams: sub.streams, MaxInFlight: 1})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := st.Header(); err != nil {
			t.Fatal(err)
		}
	}
	limited := outboxv1.NewAdminServiceClient(dialAs(t, r, billingOps))
	full := outboxv1.NewAdminServiceClient(dialAs(t, r, adminToken))
	denied := func(rpc string, err error) {
		t.Helper()
		if status.Code(err) != codes.PermissionDenied {
			t.Errorf("%s with the billing.* admin token: %v, want PermissionDenied", rpc, err)
		}
	}
	covered := map[string]bool{}

	covered["GetLag"] = true
	lag, err := limited.GetLag(ctx, &outboxv1.GetLagRequest{})
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, l := range lag.GetStreams() {
		names = append(names, l.GetStream())
	}
	if !slices.Equal(names, []string{"billing.invoice"}) || lag.GetTotal().GetPendingEvents() != 2 || lag.GetConnectedRelays() != 1 {
		t.Errorf("GetLag for billing.*: streams %v, total pending %d, relays %d; want [billing.invoice], 2, 1",
			names, lag.GetTotal().GetPendingEvents(), lag.GetConnectedRelays())
	}
	if all, err := full.GetLag(ctx, &outboxv1.GetLagRequest{}); err != nil || len(all.GetStreams()) != 2 || all.GetConnectedRelays() != 3 {
		t.Fatalf("GetLag for the unrestricted admin: %v, %v", all, err)
	}
	_, err = limited.GetLag(ctx, &outboxv1.GetLagRequest{Streams: []string{"sales_order"}})
	denied("GetLag{sales_order}", err)
	_, err = limited.GetLag(ctx, &outboxv1.GetLagRequest{Streams: []string{"billing.invoice", "sales_order"}})
	denied("GetLag{billing.invoice, sales_order}", err)

	covered["ListRelays"] = true
	relays, err := limited.ListRelays(ctx, &outboxv1.ListRelaysRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if len(relays.GetRelays()) != 1 || !slices.Equal(relays.GetRelays()[0].GetStreams(), []string{"billing.invoice"}) {
		t.Errorf("ListRelays for billing.*: %v, want only the billing.invoice relay", relays.GetRelays())
	}
	if all, err := full.ListRelays(ctx, &outboxv1.ListRelaysRequest{}); err != nil || len(all.GetRelays()) != 3 {
		t.Fatalf("ListRelays for the unrestricted admin: %v, %v", all, err)
	}

	covered["GetAggregate"] = true
	_, err = limited.GetAggregate(ctx, &outboxv1.GetAggregateRequest{Stream: "sales_order", AggregateKey: "o-1"})
	denied("GetAggregate(sales_order)", err)
	if _, err := limited.GetAggregate(ctx, &outboxv1.GetAggregateRequest{Stream: "billing.invoice", AggregateKey: "i-1"}); err != nil {
		t.Errorf("GetAggregate(billing.invoice): %v", err)
	}

	covered["ListEvents"] = true
	_, err = limited.ListEvents(ctx, &outboxv1.ListEventsRequest{})
	denied("ListEvents{}", err)
	_, err = limited.ListEvents(ctx, &outboxv1.ListEventsRequest{Stream: "sales_order"})
	denied("ListEvents{sales_order}", err)
	if evs, err := limited.ListEvents(ctx, &outboxv1.ListEventsRequest{Stream: "billing.invoice"}); err != nil || len(evs.GetEvents()) != len(bills) {
		t.Errorf("ListEvents{billing.invoice}: %v, %v", evs, err)
	}

	covered["RetryAggregate"] = true
	_, err = limited.RetryAggregate(ctx, &outboxv1.RetryAggregateRequest{Stream: "sales_order", AggregateKey: "o-1"})
	denied("RetryAggregate(sales_order)", err)

	covered["SkipEvent"] = true
	_, err = limited.SkipEvent(ctx, &outboxv1.SkipEventRequest{EventId: orders[1].String(), Reason: "not mine"})
	denied("SkipEvent(sales_order event)", err)
	if ev, err := full.ListEvents(ctx, &outboxv1.ListEventsRequest{Stream: "sales_order", State: outboxv1.EventState_EVENT_STATE_SKIPPED}); err != nil || len(ev.GetEvents()) != 0 {
		t.Fatalf("a refused skip skipped: %v, %v", ev, err)
	}

	covered["Purge"] = true
	purge := func(req *outboxv1.PurgeRequest) error {
		st, err := limited.Purge(ctx, req)
		for err == nil {
			var res *outboxv1.PurgeResponse
			if res, err = st.Recv(); err == nil && res.GetDone() {
				return nil
			}
		}
		return err
	}
	cutoff := timestamppb.New(time.Now().Add(time.Hour))
	denied("Purge{}", purge(&outboxv1.PurgeRequest{PublishedBefore: cutoff, DryRun: true}))
	denied("Purge{sales_order}", purge(&outboxv1.PurgeRequest{PublishedBefore: cutoff, Stream: "sales_order"}))
	if err := purge(&outboxv1.PurgeRequest{PublishedBefore: cutoff, Stream: "billing.invoice", DryRun: true}); err != nil {
		t.Errorf("Purge{billing.invoice}: %v", err)
	}

	covered["ListAggregates"] = true
	for _, f := range []*outboxv1.AggregateFilter{nil, {Stream: "*"}, {Stream: "sales_order"}, {Stream: "sales.*"}} {
		_, err = limited.ListAggregates(ctx, &outboxv1.ListAggregatesRequest{Filter: f})
		denied("ListAggregates{"+f.GetStream()+"}", err)
	}
	for _, st := range []string{"billing.invoice", "billing.*", "billing.in*"} {
		if _, err := limited.ListAggregates(ctx, &outboxv1.ListAggregatesRequest{Filter: &outboxv1.AggregateFilter{Stream: st}}); err != nil &&
			!(st == "billing.in*" && status.Code(err) == codes.InvalidArgument) {
			t.Errorf("ListAggregates{%s}: %v", st, err)
		}
	}

	covered["ListAttempts"] = true
	_, err = limited.ListAttempts(ctx, &outboxv1.ListAttemptsRequest{Stream: "sales_order", AggregateKey: "o-1"})
	denied("ListAttempts(sales_order)", err)
	_, err = limited.ListAttempts(ctx, &outboxv1.ListAttemptsRequest{EventId: orders[0].String()})
	denied("ListAttempts(sales_order event)", err)
	if _, err := limited.ListAttempts(ctx, &outboxv1.ListAttemptsRequest{EventId: bills[0].String()}); err != nil {
		t.Errorf("ListAttempts(billing event): %v", err)
	}

	covered["BulkRetry"] = true
	_, err = limited.BulkRetry(ctx, &outboxv1.BulkRetryRequest{Filter: &outboxv1.AggregateFilter{Stream: "*"}})
	denied("BulkRetry{*}", err)
	_, err = limited.BulkRetry(ctx, &outboxv1.BulkRetryRequest{Filter: &outboxv1.AggregateFilter{Stream: "sales_order"}})
	denied("BulkRetry{sales_order}", err)

	covered["BulkSkip"] = true
	_, err = limited.BulkSkip(ctx, &outboxv1.BulkSkipRequest{Filter: &outboxv1.AggregateFilter{Stream: "*"}, Reason: "r"})
	denied("BulkSkip{*}", err)
	_, err = limited.BulkSkip(ctx, &outboxv1.BulkSkipRequest{Filter: &outboxv1.AggregateFilter{Stream: "sales_order"}, Reason: "r"})
	denied("BulkSkip{sales_order}", err)
	if n := countWhere(t, pool, "outbox.skipped_event", "true"); n != 0 {
		t.Fatalf("a refused bulk skip skipped %d events", n)
	}

	covered["Republish"] = true
	_, err = limited.Republish(ctx, &outboxv1.RepublishRequest{Stream: "sales_order", AggregateKey: "o-1", FromRevision: 1, Reason: "r"})
	denied("Republish(sales_order)", err)

	covered["ListOperatorActions"] = true
	if _, err := full.SkipEvent(ctx, &outboxv1.SkipEventRequest{EventId: orders[1].String(), Reason: "sales"}); err != nil {
		t.Fatal(err)
	}
	if _, err := limited.SkipEvent(ctx, &outboxv1.SkipEventRequest{EventId: bills[1].String(), Reason: "billing"}); err != nil {
		t.Fatal(err)
	}
	_, err = limited.ListOperatorActions(ctx, &outboxv1.ListOperatorActionsRequest{Stream: "sales_order"})
	denied("ListOperatorActions{sales_order}", err)
	_, err = limited.ListOperatorActions(ctx, &outboxv1.ListOperatorActionsRequest{Stream: "sales_order", AggregateKey: "o-1"})
	denied("ListOperatorActions(sales_order/o-1)", err)
	if acts, err := limited.ListOperatorActions(ctx, &outboxv1.ListOperatorActionsRequest{}); err != nil ||
		len(acts.GetActions()) != 1 || acts.GetActions()[0].GetStream() != "billing.invoice" {
		t.Errorf("ListOperatorActions{} for billing.*: %v, %v; want only the billing skip", acts, err)
	}
	if acts, err := full.ListOperatorActions(ctx, &outboxv1.ListOperatorActionsRequest{}); err != nil || len(acts.GetActions()) != 2 {
		t.Errorf("ListOperatorActions{} for the unrestricted admin: %v, %v; want both skips", acts, err)
	}
	// Finding an event by id is limited to the token's streams too.
	_, err = limited.ListEvents(ctx, &outboxv1.ListEventsRequest{EventId: orders[0].String()})
	denied("ListEvents{event_id of sales_order}", err)
	if evs, err := limited.ListEvents(ctx, &outboxv1.ListEventsRequest{EventId: bills[0].String()}); err != nil || len(evs.GetEvents()) != 1 {
		t.Errorf("ListEvents{event_id of billing.invoice}: %v, %v", evs, err)
	}

	for _, m := range outboxv1.AdminService_ServiceDesc.Methods {
		if !covered[m.MethodName] {
			t.Errorf("AdminService.%s is not checked with a stream-limited token", m.MethodName)
		}
	}
	for _, m := range outboxv1.AdminService_ServiceDesc.Streams {
		if !covered[m.StreamName] {
			t.Errorf("AdminService.%s is not checked with a stream-limited token", m.StreamName)
		}
	}
}

// A relay subscribed to a billing stream and to another stream is not
// shown to an admin token limited to billing.*, in ListRelays nor in
// GetLag's relay count: a relay is listed to a stream-limited token only if
// every stream it subscribed to is one the token may see.
func TestStreamLimitedAdminDoesNotSeeARelayWithAnotherStreamToo(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startAuthReplica(t, url)
	emit(t, pool, "billing.invoice", "i-1", 1)
	emit(t, pool, "sales_order", "o-1", 1)
	st, err := outboxv1.NewRelayServiceClient(dialAs(t, r, relayToken)).Subscribe(ctx,
		&outboxv1.SubscribeRequest{RelayId: "mixed", Streams: []string{"billing.invoice", "sales_order"}, MaxInFlight: 1})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := st.Header(); err != nil {
		t.Fatal(err)
	}
	if all, err := outboxv1.NewAdminServiceClient(dialAs(t, r, adminToken)).ListRelays(ctx, &outboxv1.ListRelaysRequest{}); err != nil || len(all.GetRelays()) != 1 {
		t.Fatalf("ListRelays for the unrestricted admin: %v, %v; want the mixed relay", all, err)
	}
	limited := outboxv1.NewAdminServiceClient(dialAs(t, r, billingOps))
	if relays, err := limited.ListRelays(ctx, &outboxv1.ListRelaysRequest{}); err != nil || len(relays.GetRelays()) != 0 {
		t.Errorf("ListRelays for billing.*: %v, %v; want no relay", relays.GetRelays(), err)
	}
	if lag, err := limited.GetLag(ctx, &outboxv1.GetLagRequest{}); err != nil || lag.GetConnectedRelays() != 0 {
		t.Errorf("GetLag for billing.*: %d connected relays, %v; want 0", lag.GetConnectedRelays(), err)
	}
}
