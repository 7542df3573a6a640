package multisource_test

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/servertest"
)

// TestBulkRecordKeepsHTMLCharacters: a bulk action over both sources whose
// filter's error_contains holds '<', '>' and '&' (a broker's HTML error
// page, say) is recorded by each source with the filter as the operator
// wrote it: ListOperatorActions gives request_json with those characters
// as they are, orders' rewritten to name the source, not "\u003c". The
// action retries orders' aggregate parked with that error.
func TestBulkRecordKeepsHTMLCharacters(t *testing.T) {
	t.Parallel()
	r, _, _ := twoSources(t, servertest.Options{})
	const (
		brokerErr = "broker answered <html><b>503</b> Service & Co</html>"
		contains  = "<b>503</b> Service & Co"
	)
	id := emit(t, r.Pools["orders"], "billing", "1")
	d := recv(t, subscribe(t, r.Relay, "orders/billing"))
	if got := d.GetEvent().GetEventId(); got != id {
		t.Fatalf("delivered %s; want orders' event %s", got, id)
	}
	if _, err := r.Relay.Nack(t.Context(), &outboxv1.NackRequest{EventId: id, LeaseToken: d.GetLeaseToken(), Error: brokerErr, Permanent: true}); err != nil {
		t.Fatal(err)
	}
	res, err := r.Admin.BulkRetry(t.Context(), &outboxv1.BulkRetryRequest{Filter: &outboxv1.AggregateFilter{ErrorContains: contains}, Reason: "broker back"})
	if err != nil || res.GetRetried() != 1 {
		t.Fatalf("BulkRetry of error_contains %q over both sources: %v, %v; want orders' parked aggregate retried", contains, res, err)
	}
	acts, err := r.Admin.ListOperatorActions(t.Context(), &outboxv1.ListOperatorActionsRequest{Action: "bulk_retry"})
	if err != nil {
		t.Fatal(err)
	}
	var streams []string
	for _, a := range acts.GetActions() {
		streams = append(streams, a.GetStream())
		rj := a.GetRequestJson()
		var rec struct {
			Filter struct {
				ErrorContains string `json:"error_contains"`
			}
		}
		if err := json.Unmarshal([]byte(rj), &rec); err != nil {
			t.Fatalf("request_json %q: %v", rj, err)
		}
		if rec.Filter.ErrorContains != contains {
			t.Errorf("%s: request_json's error_contains is %q; want %q", a.GetStream(), rec.Filter.ErrorContains, contains)
		}
		if !strings.Contains(rj, contains) || strings.Contains(rj, `\u00`) {
			t.Errorf("%s: request_json %s; want error_contains with its '<', '>' and '&' as they are, not escaped", a.GetStream(), rj)
		}
	}
	onceEach(t, "bulk_retry actions' streams", streams, []string{"*", "orders/*"})
}

// emitAggregates emits one event of n aggregates of stream in pool.
func emitAggregates(t *testing.T, pool *pgxpool.Pool, stream string, n int) {
	t.Helper()
	if _, err := pool.Exec(t.Context(), `SELECT outbox.emit($1, 'k' || i, 'T', '{}') FROM generate_series(1, $2) i`, stream, n); err != nil {
		t.Fatal(err)
	}
}

// TestBulkSampleOverSourcesIsCapped: a bulk action over two sources of 15
// matching aggregates each counts all 30, and its sample lists 20 in all
// (the cap is on the sum, not on each source's part): default's 15, then 5
// of orders, each named as route names it and none twice. A dry run's
// sample is capped alike.
func TestBulkSampleOverSourcesIsCapped(t *testing.T) {
	t.Parallel()
	r, _, _ := twoSources(t, servertest.Options{})
	const each = 15
	emitAggregates(t, r.Pool, "sales_order", each)
	emitAggregates(t, r.Pools["orders"], "sales_order", each)
	ready := &outboxv1.AggregateFilter{States: []outboxv1.AggregateState{outboxv1.AggregateState_AGGREGATE_STATE_READY}}
	waitFor(t, "both sources' discovery", func() bool {
		res, err := r.Admin.ListAggregates(t.Context(), &outboxv1.ListAggregatesRequest{Filter: ready})
		return err == nil && len(res.GetAggregates()) == 2*each
	})
	checkSample := func(what string, sample []*outboxv1.Aggregate) {
		t.Helper()
		seen := map[string]bool{}
		fromOrders := 0
		for _, a := range sample {
			name := a.GetStream() + "|" + a.GetAggregateKey()
			if seen[name] {
				t.Errorf("%s: %s is in the sample twice", what, name)
			}
			seen[name] = true
			switch a.GetStream() {
			case "orders/sales_order":
				fromOrders++
			case "sales_order":
			default:
				t.Errorf("%s: the sample lists %s", what, name)
			}
		}
		if len(sample) != 20 || fromOrders != 20-each {
			t.Errorf("%s: the sample lists %d aggregates, %d of orders; want 20 in all, default's %d and %d of orders",
				what, len(sample), fromOrders, each, 20-each)
		}
	}
	dry, err := r.Admin.BulkSkip(t.Context(), &outboxv1.BulkSkipRequest{Filter: ready, Reason: "dry", DryRun: true})
	if err != nil || dry.GetMatched() != 2*each {
		t.Fatalf("dry run: %d matched, %v; want %d", dry.GetMatched(), err, 2*each)
	}
	checkSample("dry run", dry.GetSample())
	res, err := r.Admin.BulkSkip(t.Context(), &outboxv1.BulkSkipRequest{Filter: ready, Reason: "both"})
	if err != nil || res.GetMatched() != 2*each || res.GetSkipped() != 2*each {
		t.Fatalf("BulkSkip: %d matched, %d skipped, %v; want %d of each", res.GetMatched(), res.GetSkipped(), err, 2*each)
	}
	checkSample("BulkSkip", res.GetSample())
}

// emitPayload emits an event of stream in pool whose payload's JSON text is
// n bytes long.
func emitPayload(t *testing.T, pool *pgxpool.Pool, stream, key string, n int) string {
	t.Helper()
	payload := `{"p":"` + strings.Repeat("x", n-8) + `"}`
	var id string
	if err := pool.QueryRow(t.Context(), `SELECT event_id::text FROM outbox.emit($1, $2, 'T', $3::jsonb)`, stream, key, payload).Scan(&id); err != nil {
		t.Fatal(err)
	}
	return id
}

// TestListingOverSourcesStopsAtItsByteBound: a listing of events over both
// sources whose page holds 1 MiB or more after one source's events does
// not go on into the next source: the page ends early (2 events, of a page
// size of 100) with a token that goes on in orders, so that what orders
// adds next (here one event of almost 3 MiB, the largest payload the
// schema allows) never makes a response a client cannot receive (gRPC's
// default 4 MiB). Paging on lists every event once.
func TestListingOverSourcesStopsAtItsByteBound(t *testing.T) {
	t.Parallel()
	r, _, _ := twoSources(t, servertest.Options{})
	const kib = 1 << 10
	for _, pool := range []*pgxpool.Pool{r.Pool, r.Pools["orders"]} {
		if _, err := pool.Exec(t.Context(), `UPDATE outbox.settings SET max_payload_bytes = 3145728`); err != nil {
			t.Fatal(err)
		}
	}
	// Default's two, 1.2 MiB together, end its listing within its own
	// bound (2 MiB).
	want := []string{"|" + emitPayload(t, r.Pool, "blob", "1", 600*kib), "|" + emitPayload(t, r.Pool, "blob", "2", 600*kib)}
	// Orders' large event is its newest, so listed first (ListEvents lists
	// newest first): under 3 MiB, it is more than a page may add to default's
	// 1.2 MiB within 4 MiB.
	want = append(want, "orders|"+emitPayload(t, r.Pools["orders"], "blob", "1", kib),
		"orders|"+emitPayload(t, r.Pools["orders"], "blob", "2", 3000*kib))

	var got []string
	token := ""
	for page := 1; ; page++ {
		res, err := r.Admin.ListEvents(t.Context(), &outboxv1.ListEventsRequest{PageSize: 100, PageToken: token})
		if err != nil {
			t.Fatalf("page %d (token %q): %v; want every page receivable", page, token, err)
		}
		names := eventNames(res)
		got = append(got, names...)
		if page == 1 {
			onceEach(t, "the first page", names, want[:2])
			if res.GetNextPageToken() != "orders:" {
				t.Errorf("first page's next_page_token %q; want \"orders:\", going on in orders", res.GetNextPageToken())
			}
		}
		token = res.GetNextPageToken()
		if token == "" {
			break
		}
		if page == 10 {
			t.Fatal("the listing did not end after 10 pages")
		}
	}
	onceEach(t, "ListEvents of large events over both sources", got, want)

}
