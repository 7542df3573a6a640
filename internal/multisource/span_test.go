package multisource_test

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/servertest"
	"github.com/outboxd/outboxd/internal/testdb"
)

// pageAll pages a listing through (whose pages must hold at most 2 items)
// and returns every item's name and each page's next token.
func pageAll(t *testing.T, page func(token string) ([]string, string, error)) (names, tokens []string) {
	t.Helper()
	token := ""
	for range 50 {
		got, next, err := page(token)
		if err != nil {
			t.Fatalf("page after %q: %v", token, err)
		}
		if len(got) > 2 {
			t.Errorf("a page of size 2 holds %v", got)
		}
		names = append(names, got...)
		if next == "" {
			return names, tokens
		}
		tokens = append(tokens, next)
		token = next
	}
	t.Fatal("the listing did not end after 50 pages")
	return nil, nil
}

// onceEach fails unless got holds every one of want once, and nothing else.
func onceEach(t *testing.T, what string, got, want []string) {
	t.Helper()
	seen := map[string]int{}
	for _, g := range got {
		seen[g]++
	}
	for _, w := range want {
		if seen[w] != 1 {
			t.Errorf("%s: %s listed %d times; want once (listed: %v)", what, w, seen[w], got)
		}
		delete(seen, w)
	}
	for g := range seen {
		t.Errorf("%s: %s listed but not expected", what, g)
	}
}

func eventNames(res *outboxv1.ListEventsResponse) []string {
	var out []string
	for _, e := range res.GetEvents() {
		out = append(out, e.GetEvent().GetSource()+"|"+e.GetEvent().GetEventId())
	}
	return out
}

func aggregateNames(res *outboxv1.ListAggregatesResponse) []string {
	var out []string
	for _, a := range res.GetAggregates() {
		out = append(out, a.GetStream()+"|"+a.GetAggregateKey())
	}
	return out
}

// TestListingsSpanSources: on a server of two sources, ListEvents and
// ListAggregates without a stream page through both sources (page size 2,
// several pages, every item once, orders' named as its), "orders/" limits
// a listing to orders without naming a stream, "*/pattern" applies a
// pattern in every source, and a malformed token or
// one that goes on in a source not served is INVALID_ARGUMENT.
func TestListingsSpanSources(t *testing.T) {
	t.Parallel()
	r, _, _ := twoSources(t, servertest.Options{})
	var wantEvents, wantAggs, ordersEvents []string
	// Default's 4 fill two pages exactly: the second ends at the source's
	// end, and the listing goes on in orders on the third.
	for i := range 4 {
		wantEvents = append(wantEvents, "|"+emit(t, r.Pool, "sales_order", fmt.Sprint(i)))
		wantAggs = append(wantAggs, fmt.Sprintf("sales_order|%d", i))
	}
	for i := range 5 {
		stream := []string{"billing", "shipping"}[i%2]
		id := "orders|" + emit(t, r.Pools["orders"], stream, fmt.Sprint(i))
		wantEvents, ordersEvents = append(wantEvents, id), append(ordersEvents, id)
		wantAggs = append(wantAggs, fmt.Sprintf("orders/%s|%d", stream, i))
	}

	events := func(stream string) func(string) ([]string, string, error) {
		return func(token string) ([]string, string, error) {
			res, err := r.Admin.ListEvents(t.Context(), &outboxv1.ListEventsRequest{Stream: stream, PageSize: 2, PageToken: token})
			return eventNames(res), res.GetNextPageToken(), err
		}
	}
	got, tokens := pageAll(t, events(""))
	onceEach(t, "ListEvents without a stream", got, wantEvents)
	if len(tokens) < 4 {
		t.Errorf("ListEvents of 9 events by 2 took %d pages; want 5", len(tokens)+1)
	}
	got, _ = pageAll(t, events("orders/"))
	onceEach(t, `ListEvents of "orders/"`, got, ordersEvents)

	// An aggregate is listed once its source's discovery has seen it.
	waitFor(t, "both sources' discovery", func() bool {
		res, err := r.Admin.ListAggregates(t.Context(), &outboxv1.ListAggregatesRequest{PageSize: 9})
		return err == nil && len(res.GetAggregates()) == 9
	})
	got, tokens = pageAll(t, func(token string) ([]string, string, error) {
		res, err := r.Admin.ListAggregates(t.Context(), &outboxv1.ListAggregatesRequest{PageSize: 2, PageToken: token})
		return aggregateNames(res), res.GetNextPageToken(), err
	})
	onceEach(t, "ListAggregates without a stream", got, wantAggs)
	if len(tokens) < 4 {
		t.Errorf("ListAggregates of 9 aggregates by 2 took %d pages; want 5", len(tokens)+1)
	}
	res, err := r.Admin.ListAggregates(t.Context(), &outboxv1.ListAggregatesRequest{Filter: &outboxv1.AggregateFilter{Stream: "orders/*"}})
	onceEach(t, `ListAggregates of "orders/*"`, aggregateNames(res), wantAggs[4:])
	if err != nil {
		t.Error(err)
	}

	// "*/pattern" applies the pattern in every source.
	got, _ = pageAll(t, events("*/sales_order"))
	onceEach(t, `ListEvents of "*/sales_order"`, got, wantEvents[:4])
	res, err = r.Admin.ListAggregates(t.Context(), &outboxv1.ListAggregatesRequest{Filter: &outboxv1.AggregateFilter{Stream: "*/billing"}})
	onceEach(t, `ListAggregates of "*/billing"`, aggregateNames(res), []string{"orders/billing|0", "orders/billing|2", "orders/billing|4"})
	if err != nil {
		t.Error(err)
	}

	for tok, want := range map[string]string{"garbage": "not a token of a listing over every source", "nosuch:abc": `source "nosuch", which is not a source this server serves`} {
		_, err := r.Admin.ListEvents(t.Context(), &outboxv1.ListEventsRequest{PageToken: tok})
		if status.Code(err) != codes.InvalidArgument || !strings.Contains(status.Convert(err).Message(), want) {
			t.Errorf("ListEvents with page_token %q: %v; want INVALID_ARGUMENT saying %q", tok, err, want)
		}
	}
}

// TestListingOfOneSourceUnchanged: a server of default alone answers a
// listing without a stream as it always did: its page token is the
// engine's own, with no source in it.
func TestListingOfOneSourceUnchanged(t *testing.T) {
	t.Parallel()
	r := servertest.Start(t, testdb.New(t), servertest.Options{})
	for i := range 3 {
		emit(t, r.Pool, "sales_order", fmt.Sprint(i))
	}
	res, err := r.Admin.ListEvents(t.Context(), &outboxv1.ListEventsRequest{PageSize: 2})
	if err != nil {
		t.Fatal(err)
	}
	if tok := res.GetNextPageToken(); tok == "" || strings.Contains(tok, ":") {
		t.Errorf("one source's next_page_token %q; want the engine's own", tok)
	}
	// A token of a listing over sources (issued before the others were
	// removed) goes on in default.
	next, err := r.Admin.ListEvents(t.Context(), &outboxv1.ListEventsRequest{PageSize: 2, PageToken: "default:" + res.GetNextPageToken()})
	if err != nil || len(next.GetEvents()) != 1 || next.GetNextPageToken() != "" {
		t.Errorf("one source given default:TOKEN: %v, %v; want the last event", next, err)
	}
}

// TestListingsOfAScopedToken: a viewer scoped "orders/*" lists, without a
// stream, orders' events and operator actions only.
func TestListingsOfAScopedToken(t *testing.T) {
	t.Parallel()
	const (
		adminToken  = "all-admin-token-0123456789"
		viewerToken = "orders-viewer-token-0123456789"
	)
	r, dial := twoSourcesWithTokens(t, "ops admin "+adminToken+"\nviewer viewer "+viewerToken+" streams=orders/*\n")
	admin := outboxv1.NewAdminServiceClient(dial(adminToken))
	var want []string
	for i := range 3 {
		emit(t, r.Pool, "sales_order", fmt.Sprint(i))
		want = append(want, "orders|"+emit(t, r.Pools["orders"], "sales_order", fmt.Sprint(i)))
	}
	for _, id := range []string{strings.TrimPrefix(want[0], "orders|"), strings.TrimPrefix(want[1], "orders|")} {
		if _, err := admin.SkipEvent(t.Context(), &outboxv1.SkipEventRequest{EventId: "orders/" + id, Reason: "test"}); err != nil {
			t.Fatal(err)
		}
	}
	ev, err := admin.ListEvents(t.Context(), &outboxv1.ListEventsRequest{State: outboxv1.EventState_EVENT_STATE_PENDING, PageSize: 1})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := admin.SkipEvent(t.Context(), &outboxv1.SkipEventRequest{EventId: ev.GetEvents()[0].GetEvent().GetEventId(), Reason: "test"}); err != nil {
		t.Fatal(err)
	}

	viewer := outboxv1.NewAdminServiceClient(dial(viewerToken))
	got, _ := pageAll(t, func(token string) ([]string, string, error) {
		res, err := viewer.ListEvents(t.Context(), &outboxv1.ListEventsRequest{PageSize: 2, PageToken: token})
		return eventNames(res), res.GetNextPageToken(), err
	})
	onceEach(t, "orders/* viewer's ListEvents", got, want)
	var actions []string
	pageAll(t, func(token string) ([]string, string, error) {
		res, err := viewer.ListOperatorActions(t.Context(), &outboxv1.ListOperatorActionsRequest{PageSize: 1, PageToken: token})
		for _, a := range res.GetActions() {
			actions = append(actions, a.GetStream())
		}
		return nil, res.GetNextPageToken(), err
	})
	if len(actions) != 2 || actions[0] != "orders/sales_order" || actions[1] != "orders/sales_order" {
		t.Errorf("orders/* viewer's operator actions on %v; want orders' two skips", actions)
	}
	all, _ := admin.ListOperatorActions(t.Context(), &outboxv1.ListOperatorActionsRequest{})
	if len(all.GetActions()) != 3 {
		t.Errorf("the admin's operator actions: %v; want the three skips of both sources", all.GetActions())
	}
}

// TestOperatorLogNamesTheSource: an operator action of a source other than
// default names it in its stream and in its request_json, as the caller
// wrote the request (event id, stream, bulk filter); default's are as one
// source records them.
func TestOperatorLogNamesTheSource(t *testing.T) {
	t.Parallel()
	r, _, _ := twoSources(t, servertest.Options{})
	skipped := emit(t, r.Pools["orders"], "billing", "1")
	emit(t, r.Pools["orders"], "billing", "2")
	defID := emit(t, r.Pool, "billing", "1")
	for _, id := range []string{"orders/" + skipped, defID} {
		if _, err := r.Admin.SkipEvent(t.Context(), &outboxv1.SkipEventRequest{EventId: id, Reason: "test <skip>"}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := r.Admin.BulkSkip(t.Context(), &outboxv1.BulkSkipRequest{Filter: &outboxv1.AggregateFilter{Stream: "orders/*"}, Reason: "bulk"}); err != nil {
		t.Fatal(err)
	}
	res, err := r.Admin.ListOperatorActions(t.Context(), &outboxv1.ListOperatorActionsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	type record struct {
		Stream  string
		EventID string `json:"event_id"`
		Filter  struct{ Stream string }
	}
	byKind := map[string]record{}
	for _, a := range res.GetActions() {
		var rec record
		if err := json.Unmarshal([]byte(a.GetRequestJson()), &rec); err != nil {
			t.Fatalf("request_json %q: %v", a.GetRequestJson(), err)
		}
		src := "orders"
		if !strings.HasPrefix(a.GetStream(), "orders/") {
			src = "default"
		}
		byKind[src+" "+a.GetAction()] = rec
	}
	want := map[string]record{
		"orders skip":      {EventID: "orders/" + skipped},
		"default skip":     {EventID: defID},
		"orders bulk_skip": {Filter: struct{ Stream string }{"orders/*"}},
	}
	for k, w := range want {
		if g, ok := byKind[k]; !ok || g != w {
			t.Errorf("%s: request_json says %+v; want %+v (all: %v)", k, g, w, res.GetActions())
		}
	}
}

// TestBulkAcrossSources: BulkSkip without a stream skips the next pending
// event of every matching aggregate of both sources, once each (the
// second event of each aggregate stays pending), and each source records
// its own action naming it; a dry run counts both and changes nothing. A
// token that may run it on default but only on some streams of orders is
// refused before default changes. A filter stream "*/*" matches in both.
func TestBulkAcrossSources(t *testing.T) {
	t.Parallel()
	const (
		adminToken = "all-admin-token-0123456789"
		partToken  = "part-admin-token-0123456789"
	)
	r, dial := twoSourcesWithTokens(t, "ops admin "+adminToken+"\npart admin "+partToken+" streams=default/*,orders/billing.*\n")
	admin := outboxv1.NewAdminServiceClient(dial(adminToken))
	type agg struct {
		pool  string
		first string
		next  string
	}
	var aggs []agg
	for _, src := range []string{"default", "orders"} {
		pool := r.Pool
		if src == "orders" {
			pool = r.Pools["orders"]
		}
		for _, k := range []string{"1", "2"} {
			aggs = append(aggs, agg{src, emit(t, pool, "sales_order", k), emit(t, pool, "sales_order", k)})
		}
	}
	state := func(a agg, id string) string {
		if a.pool == "orders" {
			return eventState(t, r.Pools["orders"], id)
		}
		return eventState(t, r.Pool, id)
	}
	ready := &outboxv1.AggregateFilter{States: []outboxv1.AggregateState{outboxv1.AggregateState_AGGREGATE_STATE_READY}}
	// An aggregate is ready once its source's discovery has seen it.
	waitFor(t, "both sources' discovery", func() bool {
		res, err := admin.ListAggregates(t.Context(), &outboxv1.ListAggregatesRequest{Filter: ready})
		return err == nil && len(res.GetAggregates()) == 4
	})

	_, err := outboxv1.NewAdminServiceClient(dial(partToken)).BulkSkip(t.Context(), &outboxv1.BulkSkipRequest{Filter: ready, Reason: "part"})
	if status.Code(err) != codes.PermissionDenied || !strings.Contains(status.Convert(err).Message(), "source orders") {
		t.Errorf("BulkSkip of a token limited on orders: %v; want PERMISSION_DENIED naming orders", err)
	}
	dry, err := admin.BulkSkip(t.Context(), &outboxv1.BulkSkipRequest{Filter: ready, Reason: "dry", DryRun: true})
	if err != nil || dry.GetMatched() != 4 || dry.GetSkipped() != 0 || len(dry.GetSample()) != 4 {
		t.Errorf("dry run: %v, %v; want 4 matched in both sources", dry, err)
	}
	for _, a := range aggs {
		if s := state(a, a.first); s != "pending" {
			t.Fatalf("%s's event %s is %s after a refused bulk skip and a dry run", a.pool, a.first, s)
		}
	}

	res, err := admin.BulkSkip(t.Context(), &outboxv1.BulkSkipRequest{Filter: ready, Reason: "both"})
	if err != nil || res.GetMatched() != 4 || res.GetSkipped() != 4 {
		t.Fatalf("BulkSkip without a stream: %v, %v; want 4 skipped", res, err)
	}
	var sample []string
	for _, a := range res.GetSample() {
		sample = append(sample, a.GetStream()+"|"+a.GetAggregateKey())
	}
	onceEach(t, "the sample", sample, []string{"sales_order|1", "sales_order|2", "orders/sales_order|1", "orders/sales_order|2"})
	for _, a := range aggs {
		if s, n := state(a, a.first), state(a, a.next); s != "skipped" || n != "pending" {
			t.Errorf("%s: first event %s, second %s; want skipped, pending", a.pool, s, n)
		}
	}
	acts, err := admin.ListOperatorActions(t.Context(), &outboxv1.ListOperatorActionsRequest{Action: "bulk_skip"})
	if err != nil {
		t.Fatal(err)
	}
	var streams, filters []string
	for _, a := range acts.GetActions() {
		streams = append(streams, a.GetStream())
		var rec struct{ Filter struct{ Stream string } }
		if err := json.Unmarshal([]byte(a.GetRequestJson()), &rec); err != nil {
			t.Fatalf("request_json %q: %v", a.GetRequestJson(), err)
		}
		filters = append(filters, rec.Filter.Stream)
		if a.GetAggregates() != 2 {
			t.Errorf("action %v changed %d aggregates; want 2", a, a.GetAggregates())
		}
	}
	onceEach(t, "bulk_skip actions' streams", streams, []string{"*", "orders/*"})
	// The request as the caller wrote it (no stream): default's record is
	// the engine's, orders' names the source as its stream does.
	onceEach(t, "bulk_skip actions' request_json filter streams", filters, []string{"", "orders/*"})

	// "*/*" is every stream of every source; "*" alone, every stream of
	// default (a bare name is default's).
	for stream, want := range map[string]int64{"*/*": 4, "*": 2, "orders/*": 2} {
		dry, err := admin.BulkSkip(t.Context(), &outboxv1.BulkSkipRequest{Filter: &outboxv1.AggregateFilter{Stream: stream}, Reason: "dry", DryRun: true})
		if err != nil || dry.GetMatched() != want {
			t.Errorf("dry run of %q: %v, %v; want %d matched", stream, dry, err, want)
		}
	}
}

// TestListingWithASourceDown: with orders' database refusing connections,
// a listing without a stream lists default's events and names orders in
// skipped_sources, with the reason; a bulk action over every source fails
// naming orders, and default's event stays pending.
func TestListingWithASourceDown(t *testing.T) {
	t.Parallel()
	r, _, ordersURL := twoSources(t, servertest.Options{})
	id := emit(t, r.Pool, "sales_order", "1")
	emit(t, r.Pools["orders"], "sales_order", "1")
	waitFor(t, "default's discovery", func() bool {
		res, err := r.Admin.ListAggregates(t.Context(), &outboxv1.ListAggregatesRequest{Filter: &outboxv1.AggregateFilter{Stream: "default/*"}})
		return err == nil && len(res.GetAggregates()) == 1
	})
	admin, _ := refuseConnections(t, ordersURL)
	var res *outboxv1.ListEventsResponse
	// Until a session that slipped in is gone too.
	waitFor(t, "a listing that skips orders", func() bool {
		testdb.TerminateBackends(t, admin, dbName(ordersURL))
		var err error
		if res, err = r.Admin.ListEvents(t.Context(), &outboxv1.ListEventsRequest{}); err != nil {
			t.Fatalf("ListEvents with orders down: %v", err)
		}
		return len(res.GetSkippedSources()) > 0
	})
	onceEach(t, "ListEvents with orders down", eventNames(res), []string{"|" + id})
	if s := res.GetSkippedSources(); len(s) != 1 || s[0].GetName() != "orders" || s[0].GetReady() || s[0].GetReason() == "" || res.GetNextPageToken() != "" {
		t.Errorf("skipped_sources %v, next %q; want orders, with a reason, and no next page", s, res.GetNextPageToken())
	}
	if _, err := r.Admin.ListEvents(t.Context(), &outboxv1.ListEventsRequest{PageToken: "orders:"}); status.Code(err) == codes.OK {
		t.Error("a page of orders alone, down, answered; want its error")
	}
	// A bulk action over every source fails, naming orders, before it
	// changes default.
	_, err := r.Admin.BulkSkip(t.Context(), &outboxv1.BulkSkipRequest{Filter: &outboxv1.AggregateFilter{Stream: "*/*"}, Reason: "x"})
	if err == nil || !strings.Contains(err.Error(), "source orders") || !strings.Contains(err.Error(), "no source was changed") {
		t.Errorf("BulkSkip of every source with orders down: %v; want an error naming orders, nothing changed", err)
	}
	if s := eventState(t, r.Pool, id); s != "pending" {
		t.Errorf("default's event is %s after a bulk skip that failed on orders", s)
	}
}

// TestListingsOfATokenLimitedOnASource: a token limited to billing.* on
// default and to every stream of orders lists, without a stream, orders'
// events, and names default in skipped_sources saying to name a stream of
// it (never listing default's events the token may not see); naming
// default's stream lists it. A token that sees only some streams of its
// one source is refused, naming that source. An error naming the sources
// served names only those the token may see.
func TestListingsOfATokenLimitedOnASource(t *testing.T) {
	t.Parallel()
	const (
		mixedToken   = "mixed-viewer-token-0123456789"
		billingToken = "billing-viewer-token-0123456789"
	)
	r, dial := twoSourcesWithTokens(t, "mixed viewer "+mixedToken+" streams=billing.*,orders/*\n"+
		"billing viewer "+billingToken+" streams=billing.*\n")
	billing := emit(t, r.Pool, "billing.x", "1")
	emit(t, r.Pool, "sales_order", "1")
	orders := emit(t, r.Pools["orders"], "sales_order", "1")

	mixed := outboxv1.NewAdminServiceClient(dial(mixedToken))
	res, err := mixed.ListEvents(t.Context(), &outboxv1.ListEventsRequest{})
	if err != nil {
		t.Fatalf("ListEvents without a stream, token billing.*,orders/*: %v", err)
	}
	onceEach(t, "the mixed token's ListEvents", eventNames(res), []string{"orders|" + orders})
	if s := res.GetSkippedSources(); len(s) != 1 || s[0].GetName() != "default" ||
		!strings.Contains(s[0].GetReason(), "billing.*") || !strings.Contains(s[0].GetReason(), "name a stream of source default") {
		t.Errorf("skipped_sources %v; want default, saying the token is limited to billing.* and to name a stream", s)
	}
	aggs, err := mixed.ListAggregates(t.Context(), &outboxv1.ListAggregatesRequest{Filter: &outboxv1.AggregateFilter{Stream: "*/*"}})
	if err != nil || len(aggs.GetSkippedSources()) != 1 || aggs.GetSkippedSources()[0].GetName() != "default" {
		t.Errorf("ListAggregates of \"*/*\", token billing.*,orders/*: %v, %v; want default skipped", aggs, err)
	}
	one, err := mixed.ListEvents(t.Context(), &outboxv1.ListEventsRequest{Stream: "default/billing.x"})
	if err != nil {
		t.Fatal(err)
	}
	onceEach(t, "the mixed token's ListEvents of default/billing.x", eventNames(one), []string{"|" + billing})

	only := outboxv1.NewAdminServiceClient(dial(billingToken))
	_, err = only.ListEvents(t.Context(), &outboxv1.ListEventsRequest{})
	if status.Code(err) != codes.PermissionDenied || !strings.Contains(err.Error(), "source default") {
		t.Errorf("ListEvents without a stream, token billing.*: %v; want PERMISSION_DENIED naming source default", err)
	}
	for what, call := range map[string]func() error{
		"a page token of an unknown source": func() error {
			_, err := only.ListEvents(t.Context(), &outboxv1.ListEventsRequest{PageToken: "nosuch:"})
			return err
		},
		"an unknown source": func() error {
			_, err := only.ListEvents(t.Context(), &outboxv1.ListEventsRequest{Stream: "nosuch/billing.x"})
			return err
		},
		"GetLag of an unknown source": func() error {
			_, err := only.GetLag(t.Context(), &outboxv1.GetLagRequest{Streams: []string{"nosuch/billing.x"}})
			return err
		},
	} {
		err := call()
		if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "default") || strings.Contains(err.Error(), "orders") {
			t.Errorf("%s, token billing.*: %v; want INVALID_ARGUMENT naming default, not orders", what, err)
		}
	}
}
