package console_test

import (
	"context"
	"encoding/json"
	"net/http"
	"net/url"
	"regexp"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/metadata"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/testdb"
)

// TestConsoleWithTwoSources: a replica serving default and orders, each
// with a parked aggregate billing/1 under the same names. The streams page
// shows each source's lag, streams and health (orders unhealthy once its
// database refuses connections, default still reported); the aggregates,
// events, event and actions pages of orders list orders' rows with links
// that carry "orders/billing", and following them reaches orders' database,
// not default's; every action names its source in its confirmation and in
// the operator log; a single-event skip outside default reaches its source.
func TestConsoleWithTwoSources(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessOptions{sources: []string{"orders"}})
	orders := h.sourcePools["orders"]
	h.park(t, "billing", "1", 2)
	ordersEvent := h.parkIn(t, "orders", "billing", "1", 2)
	h.parkIn(t, "orders", "billing", "2", 1)
	b := h.browser(t)
	b.login(t, adminSecret)

	_, body := b.get(t, "/")
	for _, want := range []string{`id="sources"`, `id="source-default"`, `id="source-orders"`,
		`href="/events?state=pending&amp;stream=orders%2Fbilling"`, `href="/aggregates?source=orders"`, `href="/actions?source=orders"`} {
		if !strings.Contains(body, want) {
			t.Errorf("streams page lacks %s:\n%s", want, body)
		}
	}

	if _, body := b.get(t, "/api/lag"); !strings.Contains(body, `"sources":[{"name":"default","ready":true,`) ||
		!strings.Contains(body, `{"name":"orders","ready":true,"total":{"stream":"orders","pending":3,`) {
		t.Errorf("/api/lag: want both sources, orders with its 3 pending events:\n%s", body)
	}

	// The aggregates of orders: links to orders/billing only.
	_, body = b.get(t, "/aggregates?source=orders")
	if !strings.Contains(body, `href="/aggregate?key=1&amp;stream=orders%2Fbilling"`) ||
		!strings.Contains(body, `href="/aggregate?key=2&amp;stream=orders%2Fbilling"`) || strings.Contains(body, "stream=billing") {
		t.Errorf("aggregates of orders: want links to orders/billing 1 and 2 only:\n%s", body)
	}
	if !strings.Contains(body, `<option value="orders" selected>`) {
		t.Errorf("aggregates of orders: the source picker does not show orders:\n%s", body)
	}
	_, body = b.get(t, "/aggregates?source=default")
	if !strings.Contains(body, `href="/aggregate?key=1&amp;stream=billing"`) || strings.Contains(body, "orders%2Fbilling") {
		t.Errorf("aggregates of default: want default's billing/1 only:\n%s", body)
	}
	_, body = b.get(t, "/events?source=orders&state=pending")
	if !strings.Contains(body, `href="/aggregate?key=1&amp;stream=orders%2Fbilling"`) || strings.Contains(body, "stream=billing&") {
		t.Errorf("pending events of orders: want links to orders/billing:\n%s", body)
	}
	_, body = b.get(t, "/event?id="+ordersEvent.GetEventId())
	if !strings.Contains(body, `href="/aggregate?key=1&amp;stream=orders%2Fbilling"`) {
		t.Errorf("event %s of orders, found by id: want its aggregate's link in orders:\n%s", ordersEvent.GetEventId(), body)
	}
	// As its sinks name it (the broker's message id): orders/EVENT_ID.
	_, body = b.get(t, "/event?id=orders/"+ordersEvent.GetEventId())
	if !strings.Contains(body, `href="/aggregate?key=1&amp;stream=orders%2Fbilling"`) {
		t.Errorf("event orders/%s, found by its message id: want its aggregate's link in orders:\n%s", ordersEvent.GetEventId(), body)
	}

	// The aggregate page of orders' billing/1, and its retry: orders'
	// aggregate leaves parked, default's stays.
	_, body = b.get(t, "/aggregate?stream=orders/billing&key=1")
	if !strings.Contains(body, `id="agg-state">parked<`) || !strings.Contains(body, `name="stream" value="orders/billing"`) {
		t.Fatalf("aggregate orders/billing/1: want parked, with forms for orders/billing:\n%s", body)
	}
	csrf := b.csrf(t, "/aggregate?stream=orders/billing&key=1")
	_, body = b.post(t, "/act/retry", url.Values{"csrf": {csrf}, "stream": {"orders/billing"}, "key": {"1"}, "reason": {"sink fixed"}})
	if !strings.Contains(body, "Retried billing/1 of source orders: now ready.") {
		t.Errorf("retry confirmation does not name source orders:\n%s", body)
	}
	if got := parkedIn(t, h, "orders", "1"); got {
		t.Error("orders' billing/1 still parked after the retry")
	}
	if got := parkedIn(t, h, "", "1"); !got {
		t.Error("default's billing/1 left parked state: the retry reached the wrong source")
	}

	// A single skip in orders reaches orders: the console names the event
	// orders/EVENT_ID, as the router routes it.
	_, body = b.post(t, "/act/skip", url.Values{"csrf": {csrf}, "stream": {"orders/billing"}, "key": {"1"},
		"event_id": {ordersEvent.GetEventId()}, "reason": {"poison"}})
	if !strings.Contains(body, "Event orders/"+ordersEvent.GetEventId()+" skipped by") {
		t.Errorf("skip of an orders event: want it skipped in orders:\n%s", body)
	}
	var skippedHere int
	if err := orders.QueryRow(t.Context(), `SELECT count(*) FROM outbox.skipped_event WHERE event_id = $1`, ordersEvent.GetEventId()).Scan(&skippedHere); err != nil {
		t.Fatal(err)
	}
	if skippedHere != 1 {
		t.Errorf("orders' skipped_event holds %d rows of the skipped event; want 1", skippedHere)
	}

	// Bulk skip on orders: the dry run and the confirmation name it.
	form := url.Values{"csrf": {csrf}, "action": {"skip"}, "source": {"orders"}, "stream": {"billing"}, "state": {"parked"}, "reason": {"replayed elsewhere"}}
	_, body = b.post(t, "/bulk", form)
	if !strings.Contains(body, "Dry run on source orders: 1 aggregate(s) match") || !strings.Contains(body, `name="source" value="orders"`) {
		t.Fatalf("bulk dry run on orders:\n%s", body)
	}
	form.Set("confirm", "yes")
	form.Set("expected", "1")
	_, body = b.post(t, "/bulk/confirm", form)
	if !strings.Contains(body, "Bulk skip on source orders: 1 matched, 1 skipped") {
		t.Errorf("bulk skip confirmation does not name source orders:\n%s", body)
	}
	var skipped int
	if err := orders.QueryRow(t.Context(), `SELECT count(*) FROM outbox.skipped_event JOIN outbox.event USING (event_id) WHERE aggregate_key = '2'`).Scan(&skipped); err != nil {
		t.Fatal(err)
	}
	if skipped != 1 {
		t.Errorf("orders' billing/2: %d skipped events; want 1", skipped)
	}

	// The operator log of orders names the source on every row; default's
	// has none of orders' actions.
	_, body = b.get(t, "/actions?source=orders")
	if !strings.Contains(body, `of source <span id="actions-source">orders</span>`) ||
		strings.Count(body, `<td class="source">orders</td>`) != 3 || !strings.Contains(body, "<td>orders/billing</td>") {
		t.Errorf("operator log of orders: want its retry, skip and bulk skip, each naming orders:\n%s", body)
	}
	_, body = b.get(t, "/actions?source=default")
	if !strings.Contains(body, "No operator action matches.") {
		t.Errorf("operator log of default lists actions of orders:\n%s", body)
	}
	_, body = b.post(t, "/purge", url.Values{"csrf": {csrf}, "older_than": {"0s"}, "source": {"orders"}})
	if !strings.Contains(body, "event(s) on source orders.") {
		t.Errorf("purge dry run on orders does not name it:\n%s", body)
	}

	// A viewer of orders alone sees orders, not default, and its pages
	// start at every source it may see: orders.
	ob := h.browser(t)
	ob.login(t, ordersSecret)
	_, body = ob.get(t, "/")
	if !strings.Contains(body, `id="source-orders"`) || strings.Contains(body, `id="source-default"`) {
		t.Errorf("streams page of a viewer of orders: want orders' row alone:\n%s", body)
	}
	for _, page := range []string{"/aggregates?state=any", "/events", "/actions"} {
		code, body := ob.get(t, page)
		if code != http.StatusOK || !strings.Contains(body, `<option value="*" selected>all sources</option>`) || !strings.Contains(body, "orders/billing") {
			t.Errorf("%s for a viewer of orders: %d; want orders' rows:\n%s", page, code, body)
		}
	}

	// orders' database refuses connections: the streams page says orders
	// is unhealthy, that its figures could not be read (not zeros, and a
	// warning: the totals leave its pending events out), and still shows
	// default.
	var dbname string
	if err := orders.QueryRow(t.Context(), `SELECT current_database()`).Scan(&dbname); err != nil {
		t.Fatal(err)
	}
	admin := h.pool
	allow := testdb.RefuseConnections(t, admin, dbname)
	eventually(t, 30*time.Second, "the streams page to show orders unhealthy", func() bool {
		testdb.TerminateBackends(t, admin, dbname) // one that slipped in
		code, body := b.get(t, "/")
		row, _, _ := strings.Cut(body[strings.Index(body, `id="source-orders"`)+1:], "</tr>")
		return code == http.StatusOK && strings.Contains(row, "unhealthy") && strings.Contains(row, "could not be read") &&
			strings.Contains(body, "Source orders: its lag could not be read") && strings.Contains(body, `id="source-default"`) &&
			strings.Contains(body, `href="/events?state=pending&amp;stream=billing"`)
	})
	// And back: orders is reported ready again once it takes connections
	// (which the harness's clean-up needs too).
	allow()
	eventually(t, 30*time.Second, "the streams page to show orders ready again", func() bool {
		_, body := b.get(t, "/")
		row, _, _ := strings.Cut(body[strings.Index(body, `id="source-orders"`)+1:], "</tr>")
		return strings.Contains(row, `badge ready`)
	})
}

// parkedIn reports whether billing/key of source ("" default) is parked,
// as the AdminService says.
func parkedIn(t *testing.T, h *harness, source, key string) bool {
	t.Helper()
	address := "billing"
	if source != "" {
		address = source + "/billing"
	}
	admin, with := h.as(adminSecret)
	resp, err := admin.GetAggregate(with(t.Context()), &outboxv1.GetAggregateRequest{Stream: address, AggregateKey: key})
	if err != nil {
		t.Fatal(err)
	}
	return resp.GetAggregate().GetState() == outboxv1.AggregateState_AGGREGATE_STATE_PARKED
}

// eventually polls cond until it holds or the deadline passes.
func eventually(t *testing.T, within time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(within)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %v", what, within)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestConsoleAllSources: the source picker's "all sources", chosen unless
// a page names a source, lists the events, aggregates and operator actions
// of both sources, each row naming its source, and a bulk action on it
// acts on both, each recording it. A purge dry run of one stream on "all
// sources" is refused by the form, saying to pick the stream's source.
func TestConsoleAllSources(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessOptions{sources: []string{"orders"}})
	h.park(t, "billing", "1", 2)
	h.parkIn(t, "orders", "billing", "1", 2)
	b := h.browser(t)
	b.login(t, adminSecret)

	_, body := b.get(t, "/aggregates") // every source unless one is picked
	for _, want := range []string{`href="/aggregate?key=1&amp;stream=billing"`, `href="/aggregate?key=1&amp;stream=orders%2Fbilling"`,
		`<option value="*" selected>all sources</option>`} {
		if !strings.Contains(body, want) {
			t.Errorf("aggregates of all sources lack %s:\n%s", want, body)
		}
	}
	_, body = b.get(t, "/events?source=*")
	if !strings.Contains(body, `stream=orders%2Fbilling`) || !strings.Contains(body, `stream=billing`) {
		t.Errorf("events of all sources: want both sources' billing:\n%s", body)
	}
	csrf := b.csrf(t, "/bulk?source=*&state=parked")
	form := url.Values{"csrf": {csrf}, "action": {"retry"}, "source": {"*"}, "state": {"parked"}}
	_, body = b.post(t, "/bulk", form)
	if !strings.Contains(body, "Dry run on every source: 2 aggregate(s) match") {
		t.Fatalf("bulk dry run on all sources: want 2 matched, on every source:\n%s", body)
	}
	form.Set("confirm", "yes")
	form.Set("expected", "2")
	if _, body = b.post(t, "/bulk/confirm", form); !strings.Contains(body, "Bulk retry on every source: 2 matched, 2 retried") {
		t.Errorf("bulk retry on all sources:\n%s", body)
	}
	csrf = b.csrf(t, "/purge")
	code, body := b.post(t, "/purge", url.Values{"csrf": {csrf}, "older_than": {"0s"}, "source": {"*"}, "stream": {"billing"}})
	if code != http.StatusBadRequest || !strings.Contains(body, "is of one source: pick its source") {
		t.Errorf("purge dry run of one stream on all sources: %d, want 400 saying to pick its source:\n%s", code, body)
	}
	if code, body = b.post(t, "/purge", url.Values{"csrf": {csrf}, "older_than": {"0s"}, "source": {"*"}}); code != http.StatusOK ||
		!strings.Contains(body, "would delete") {
		t.Errorf("purge dry run of every source: %d\n%s", code, body)
	}
	_, body = b.get(t, "/actions?source=*")
	if !strings.Contains(body, "Operator actions of every source") || !strings.Contains(body, `<td class="source">orders</td>`) ||
		!strings.Contains(body, `<td class="source">default</td>`) || !strings.Contains(body, "<td>orders/*</td>") {
		t.Errorf("operator log of every source: want each source's bulk retry, naming its source:\n%s", body)
	}
}

// The lag chart's history is sampled once for everyone, without a token;
// a token limited to some streams must see only those in it, as in the
// streams table: neither another stream's line nor its share of the total.
func TestLagHistoryShowsAStreamLimitedTokenOnlyItsStreams(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessOptions{sources: []string{"orders"}})
	h.emit(t, "billing", "1", 3)
	h.emitIn(t, h.sourcePools["orders"], "billing", "1", 1)

	type history struct {
		History []struct {
			Streams map[string]struct {
				Pending int64 `json:"pending"`
			} `json:"streams"`
			Total struct {
				Pending int64 `json:"pending"`
			} `json:"total"`
		} `json:"history"`
	}
	read := func(b *browser) history {
		t.Helper()
		code, body := b.get(t, "/api/lag")
		var out history
		if err := json.Unmarshal([]byte(body), &out); code != http.StatusOK || err != nil {
			t.Fatalf("/api/lag: %d, %v\n%s", code, err, body)
		}
		return out
	}
	admin := h.browser(t)
	admin.login(t, adminSecret)
	// Wait until the sampler has recorded both sources' pending events.
	eventually(t, 30*time.Second, "a lag sample of both sources", func() bool {
		for _, p := range read(admin).History {
			if p.Streams["billing"].Pending == 3 && p.Streams["orders/billing"].Pending == 1 {
				return true
			}
		}
		return false
	})

	viewer := h.browser(t)
	viewer.login(t, ordersSecret)
	sawOrders := false
	for _, p := range read(viewer).History {
		for name := range p.Streams {
			if !strings.HasPrefix(name, "orders/") {
				t.Errorf("a viewer of orders/* sees stream %q in the lag history", name)
			}
		}
		if o, ok := p.Streams["orders/billing"]; ok {
			sawOrders = true
			if p.Total.Pending != o.Pending {
				t.Errorf("a viewer of orders/* sees a history total of %d pending, want orders/billing's %d", p.Total.Pending, o.Pending)
			}
		}
	}
	if !sawOrders {
		t.Error("a viewer of orders/* does not see orders/billing in the lag history")
	}
}

// TestConsoleRelaysNameTheirSource: a catch-all subscription of orders
// ("orders/*") is shown as orders/*, not as "all", which a catch-all of
// default (every stream of default) still is.
func TestConsoleRelaysNameTheirSource(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessOptions{sources: []string{"orders"}})
	ctx, cancel := context.WithCancel(metadata.AppendToOutgoingContext(t.Context(), "authorization", "Bearer "+relaySecret))
	defer cancel()
	for _, sub := range []struct {
		id      string
		streams []string
	}{{"catch-orders", []string{"orders/*"}}, {"catch-default", nil}} {
		if _, err := h.rep.Relay.Subscribe(ctx, &outboxv1.SubscribeRequest{RelayId: sub.id, Streams: sub.streams, MaxInFlight: 1}); err != nil {
			t.Fatal(err)
		}
	}
	b := h.browser(t)
	b.login(t, viewerSecret)
	var body string
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		var code int
		if code, body = b.get(t, "/relays"); code != http.StatusOK {
			t.Fatalf("relays page: %d\n%s", code, body)
		}
		if strings.Contains(body, "catch-orders") && strings.Contains(body, "catch-default") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the two relays never showed:\n%s", body)
		}
	}
	streamsCell := func(relay string) string {
		m := regexp.MustCompile(`<td>` + relay + `</td><td>[^<]*</td><td>[^<]*</td><td>(.*?)</td>`).FindStringSubmatch(body)
		if m == nil {
			t.Fatalf("no row of %s:\n%s", relay, body)
		}
		return m[1]
	}
	if got := streamsCell("catch-orders"); got != "orders/*" {
		t.Errorf("catch-all of orders: streams cell %q, want orders/*", got)
	}
	if got := streamsCell("catch-default"); got != `<span class="muted">all</span>` {
		t.Errorf("catch-all of default: streams cell %q, want all", got)
	}
}
