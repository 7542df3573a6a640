package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/servertest"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/server"
)

// The operator commands against a server of two sources (default and
// orders, each a database of its own): an event id of orders is
// orders/<id> on input and output, the same id in default is untouched,
// answers print orders' streams as orders/..., events, aggregates and
// actions without --stream list both sources, and purge without --stream
// purges both, a line per source. Checked against SQL.
func TestCLIOfTwoSources(t *testing.T) {
	t.Parallel()
	r := servertest.Start(t, testdb.New(t), servertest.Options{
		Sources: map[string]string{"orders": testdb.New(t)},
		Configure: func(c *server.Config) {
			c.PollInterval, c.ReconcileInterval = 50*time.Millisecond, 100*time.Millisecond
		},
	})
	ts := &testServer{addr: r.Addr, pool: r.Pool, relay: r.Relay}
	def, orders := r.Pool, r.Pools["orders"]
	const shared = "0f8fad5b-d9cb-469f-a165-70867728950e"
	for _, p := range []*pgxpool.Pool{def, orders} {
		if _, err := p.Exec(t.Context(), `SELECT outbox.emit('sales_order', '1', 'T', '{}', event_id => $1)`, shared); err != nil {
			t.Fatal(err)
		}
	}
	skipped := func(p *pgxpool.Pool) int64 {
		var n int64
		if err := p.QueryRow(t.Context(), `SELECT count(*) FROM outbox.skipped_event`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}

	out := ts.cli(t, nil, "events", "--event-id", "orders/"+shared).want(t, exitOK).stdout
	if row := tableRow(t, out, "orders/"+shared); len(row) < 2 || row[1] != "orders/sales_order" {
		t.Errorf("events --event-id orders/...: row %q; want the id and stream with their source", row)
	}
	if ev := parseOne(t, ts.cli(t, nil, "events", "--event-id", "orders/"+shared, "--json").want(t, exitOK),
		func() *outboxv1.ListEventsResponse { return &outboxv1.ListEventsResponse{} }); len(ev.GetEvents()) != 1 || ev.GetEvents()[0].GetEvent().GetSource() != "orders" {
		t.Errorf("events --json: %v; want orders' event with event.source", ev)
	}
	if row := tableRow(t, ts.cli(t, nil, "events", "--event-id", shared).want(t, exitOK).stdout, shared); len(row) < 2 || row[1] != "sales_order" {
		t.Errorf("events --event-id of default's: row %q; want the bare id and stream", row)
	}
	ts.cli(t, nil, "events", "--event-id", "Orders/"+shared).want(t, exitUsage)
	ts.cli(t, nil, "events", "--event-id", "orders/"+shared, "--stream", "sales_order").want(t, exitUsage)

	// The aggregate view names the event as skip takes it.
	if v := keyValue(t, ts.cli(t, nil, "aggregate", "orders/sales_order", "1").want(t, exitOK).stdout, "next pending event"); v != "orders/"+shared {
		t.Errorf("aggregate orders/sales_order 1: next pending event %q; want orders/%s", v, shared)
	}
	if v := keyValue(t, ts.cli(t, nil, "aggregate", "sales_order", "1").want(t, exitOK).stdout, "next pending event"); v != shared {
		t.Errorf("aggregate sales_order 1 (default): next pending event %q; want the bare id", v)
	}
	ts.cli(t, nil, "skip", "Orders/"+shared, "--reason", "x").want(t, exitUsage)
	ts.cli(t, nil, "skip", "shipping/"+shared, "--reason", "x").want(t, exitUsage)
	if out := ts.cli(t, nil, "skip", "orders/"+shared, "--reason", "poison").want(t, exitOK).stdout; !strings.Contains(out, "skipped event orders/"+shared) {
		t.Errorf("skip: %q", out)
	}
	if d, o := skipped(def), skipped(orders); d != 0 || o != 1 {
		t.Errorf("after skip orders/...: %d skipped in default, %d in orders; want 0, 1", d, o)
	}
	if out := ts.cli(t, nil, "actions", "--stream", "orders/sales_order").want(t, exitOK).stdout; !strings.Contains(out, "orders/sales_order") {
		t.Errorf("actions --stream orders/sales_order does not name the stream with its source:\n%s", out)
	}
	ts.cli(t, nil, "attempts", "orders/"+shared).want(t, exitOK)

	// Without --stream the listings cover both sources, page after page.
	out = ts.cli(t, nil, "events", "--page-size", "1").want(t, exitOK).stdout
	if row := tableRow(t, out, "orders/"+shared); row[1] != "orders/sales_order" {
		t.Errorf("events without --stream: orders' row %q", row)
	}
	if row := tableRow(t, out, shared); row[1] != "sales_order" {
		t.Errorf("events without --stream: default's row %q", row)
	}
	if _, err := orders.Exec(t.Context(), `SELECT outbox.emit('sales_order', '2', 'T', '{}')`); err != nil {
		t.Fatal(err)
	}
	// Listed once each source's discovery has seen its pending aggregate
	// (a hang guard, not a timing): orders' new one, and default's first,
	// whose engine may have become ready only after the replica was (CI
	// once listed orders' alone, default's event still undiscovered).
	for _, filter := range []string{"orders/*", "sales_order"} {
		for deadline := time.Now().Add(time.Minute); ; time.Sleep(20 * time.Millisecond) {
			res, err := r.Admin.ListAggregates(t.Context(), &outboxv1.ListAggregatesRequest{Filter: &outboxv1.AggregateFilter{Stream: filter}})
			if err == nil && len(res.GetAggregates()) == 1 {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: the pending aggregate not listed within a minute: %v, %v", filter, res, err)
			}
		}
	}
	if out := ts.cli(t, nil, "aggregates").want(t, exitOK).stdout; !strings.Contains(out, "orders/sales_order") || tableRow(t, out, "sales_order") == nil {
		t.Errorf("aggregates without --stream does not list both sources:\n%s", out)
	}
	if out := ts.cli(t, nil, "actions").want(t, exitOK).stdout; !strings.Contains(out, "orders/sales_order") {
		t.Errorf("actions without --stream does not list orders' skip:\n%s", out)
	}

	// Publish one more event in each source, and purge both.
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	for _, c := range []struct {
		pool   *pgxpool.Pool
		stream string
	}{{def, "audit"}, {orders, "orders/audit"}} {
		if _, err := c.pool.Exec(ctx, `SELECT outbox.emit('audit', '1', 'T', '{}')`); err != nil {
			t.Fatal(err)
		}
		sub, err := r.Relay.Subscribe(ctx, &outboxv1.SubscribeRequest{RelayId: "t", Streams: []string{c.stream}, MaxInFlight: 1})
		if err != nil {
			t.Fatal(err)
		}
		d, err := sub.Recv()
		if err != nil {
			t.Fatal(err)
		}
		if res, err := r.Relay.Ack(ctx, &outboxv1.AckRequest{Acks: []*outboxv1.AckItem{{EventId: d.GetEvent().GetEventId(), LeaseToken: d.GetLeaseToken()}}}); err != nil ||
			res.GetResults()[0].GetStatus() != outboxv1.AckStatus_ACK_STATUS_PUBLISHED {
			t.Fatalf("ack: %v, %v", res, err)
		}
	}
	before := time.Now().Add(time.Hour).Format(time.RFC3339)
	out = ts.cli(t, nil, "purge", "--before", before, "--dry-run").want(t, exitOK).stdout
	if !strings.Contains(out, "would delete 2 events") || !strings.Contains(out, "source default: 1") || !strings.Contains(out, "source orders: 1") {
		t.Errorf("purge --dry-run of two sources:\n%s\nwant 2 in all, 1 per source", out)
	}
	out = ts.cli(t, nil, "purge", "--before", before, "--yes").want(t, exitOK).stdout
	if !strings.Contains(out, "deleted 2 events") || !strings.Contains(out, "source default: 1 in 1 batch") || !strings.Contains(out, "source orders: 1 in 1 batch") {
		t.Errorf("purge of two sources:\n%s\nwant 2 deleted, a line per source", out)
	}
	for name, p := range map[string]*pgxpool.Pool{"default": def, "orders": orders} {
		var n int64
		if err := p.QueryRow(t.Context(), `SELECT count(*) FROM outbox.event WHERE published_at IS NOT NULL`).Scan(&n); err != nil || n != 0 {
			t.Errorf("%s: %d published events left after the purge (%v)", name, n, err)
		}
	}

	// lag warns of a named stream no source has had, and of one named in
	// its own source, but not of */ledger in default, which lacks a stream
	// orders has.
	if _, err := orders.Exec(t.Context(), `SELECT outbox.emit('ledger', '1', 'T', '{}')`); err != nil {
		t.Fatal(err)
	}
	var warned string
	for deadline := time.Now().Add(time.Minute); ; time.Sleep(20 * time.Millisecond) {
		r := ts.cli(t, nil, "lag", "--stream", "*/ledger", "--stream", "*/typo", "--stream", "orders/nosuch").want(t, exitOK)
		warned = r.stderr
		if !strings.Contains(warned, "stream orders/ledger has never") || time.Now().After(deadline) {
			break // orders' lag lists ledger (a hang guard, not a timing)
		}
	}
	for _, want := range []string{"stream typo has never had an event", "stream orders/typo has never had an event", "stream orders/nosuch has never had an event"} {
		if !strings.Contains(warned, want) {
			t.Errorf("lag --stream */ledger */typo orders/nosuch: stderr lacks %q:\n%s", want, warned)
		}
	}
	if strings.Contains(warned, "ledger") {
		t.Errorf("lag warns of */ledger, which orders has:\n%s", warned)
	}
	// Named in default itself, ledger is a mistake there whatever orders has.
	if r := ts.cli(t, nil, "lag", "--stream", "ledger", "--stream", "orders/ledger").want(t, exitOK); !strings.Contains(r.stderr, "stream ledger has never had an event") {
		t.Errorf("lag --stream ledger --stream orders/ledger: no warning of default's ledger:\n%s", r.stderr)
	}
}
