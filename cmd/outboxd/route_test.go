package main

import (
	"context"
	"log/slog"
	"net"
	"reflect"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
)

func TestParseRoutes(t *testing.T) {
	t.Parallel()
	rs, err := parseRoutes([]string{
		"billing,invoices=kafka://k1:9092,k2:9092?topic=outbox.{stream}",
		"*=nats://user:secret@127.0.0.1:4222",
		"audit=stdout://",
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(rs) != 3 {
		t.Fatalf("%d routes, want 3", len(rs))
	}
	if !reflect.DeepEqual(rs[0].streams, []string{"billing", "invoices"}) || rs[0].sinkURL != "kafka://k1:9092,k2:9092?topic=outbox.{stream}" || rs[0].exclude != nil {
		t.Errorf("route 0 = %+v", rs[0])
	}
	if rs[1].streams != nil || !reflect.DeepEqual(rs[1].exclude, []string{"audit", "billing", "invoices"}) || rs[1].label() != "*" {
		t.Errorf("catch-all = %+v; want every stream the other routes name excluded", rs[1])
	}

	for _, c := range []struct {
		routes []string
		want   string
	}{
		{[]string{"billing=stdout://", "orders,billing=nats://u:pw@h:4222"}, `stream "billing" is already routed by "billing=stdout://"`},
		{[]string{"*=stdout://", "*=nats://h:4222"}, "a second catch-all"},
		{[]string{"billing.*=stdout://"}, `"billing.*" is a pattern`},
		// NATS's and AMQP's wildcards, written by habit, are named as patterns too.
		{[]string{"billing.>=stdout://"}, `"billing.>" is a pattern`},
		{[]string{"billing.?=stdout://"}, `"billing.?" is a pattern`},
		{[]string{"Billing=stdout://"}, "not a stream name"},
		{[]string{"billing"}, "want STREAMS=SINK_URL"},
		{[]string{"=stdout://"}, "want STREAMS=SINK_URL"},
		{[]string{"a,,b=stdout://"}, `"" is not a stream name`},
	} {
		_, err := parseRoutes(c.routes)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("parseRoutes(%q) = %v, want an error mentioning %q", c.routes, err, c.want)
		}
		if err != nil && strings.Contains(err.Error(), "pw@") {
			t.Errorf("error shows a password: %v", err)
		}
	}
}

func TestParseRoutesOfSources(t *testing.T) {
	t.Parallel()
	rs, err := parseRoutes([]string{
		"sales_order,orders/sales_order,default/invoices=nats://h:4222",
		"orders/*=stdout://",
		"*=kafka://k:9092",
		"billing/payments=stdout://",
	})
	if err != nil {
		t.Fatal(err)
	}
	type want struct {
		index            int
		source           string
		streams, exclude []string
		label            string
	}
	wants := []want{
		// One --route over two sources: one subscription per source,
		// sharing the route's sink (index 0). default/x is x.
		{0, "default", []string{"sales_order", "invoices"}, nil, "sales_order,invoices"},
		{0, "orders", []string{"orders/sales_order"}, nil, "orders/sales_order"},
		// A source's catch-all excludes that source's routed streams only.
		{1, "orders", []string{"orders/*"}, []string{"orders/sales_order"}, "orders/*"},
		{2, "default", nil, []string{"invoices", "sales_order"}, "*"},
		{3, "billing", []string{"billing/payments"}, nil, "billing/payments"},
	}
	if len(rs) != len(wants) {
		t.Fatalf("%d routes, want %d: %+v", len(rs), len(wants), rs)
	}
	for i, w := range wants {
		r := rs[i]
		if r.index != w.index || r.source != w.source || !reflect.DeepEqual(r.streams, w.streams) || !reflect.DeepEqual(r.exclude, w.exclude) || r.label() != w.label {
			t.Errorf("route %d = %+v (label %q); want %+v", i, r, r.label(), w)
		}
	}

	for _, c := range []struct {
		routes []string
		want   string
	}{
		{[]string{"Orders/x=stdout://"}, `source name "Orders"`},
		{[]string{"or-ders/x=stdout://"}, `source name "or-ders"`},
		{[]string{"/x=stdout://"}, `source name ""`},
		{[]string{"or*/payments=stdout://"}, `"or*/payments": a source pattern is * alone`},
		{[]string{"*/pay.*=stdout://"}, `"*/pay.*" is a pattern`},
		{[]string{"*/Pay=stdout://"}, `"*/Pay" is not a stream name`},
		{[]string{"*/payments=stdout://", "*/payments=nats://u:pw@h:4222"}, `stream "*/payments" is already routed`},
		{[]string{"*/*=stdout://", "*/*=nats://u:pw@h:4222"}, `a second catch-all (*/*) of source "*"`},
		{[]string{"*/a,*/*=stdout://"}, `"*/*" takes every stream of source "*"`},
		{[]string{"orders/Bad=stdout://"}, `"orders/Bad" is not a stream name`},
		{[]string{"orders/=stdout://"}, `"orders/" is not a stream name`},
		{[]string{"orders/a/b=stdout://"}, `"orders/a/b" is not a stream name`},
		{[]string{"orders/pay.*=stdout://"}, `"orders/pay.*" is a pattern`},
		{[]string{"orders/*=stdout://", "orders/*=nats://h:4222"}, `a second catch-all (orders/*) of source "orders"`},
		{[]string{"orders/a,orders/*=stdout://"}, `"orders/*" takes every stream of source "orders"`},
		{[]string{"orders/*,orders/a=stdout://"}, `whose catch-all this route already is`},
		{[]string{"*,x=stdout://"}, `whose catch-all this route already is`},
		{[]string{"orders/a=stdout://", "orders/a=nats://u:pw@h:4222"}, `stream "orders/a" is already routed`},
		{[]string{"a=stdout://", "default/a=nats://u:pw@h:4222"}, `stream "a" is already routed`},
	} {
		_, err := parseRoutes(c.routes)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("parseRoutes(%q) = %v, want an error mentioning %q", c.routes, err, c.want)
		}
		if err != nil && strings.Contains(err.Error(), "pw@") {
			t.Errorf("error shows a password: %v", err)
		}
	}
}

func TestStreamsRoutesOfSources(t *testing.T) {
	t.Parallel()
	rs, err := streamsRoutes([]string{"a", "orders/b", "orders/c", "b"}, nil, "stdout://")
	if err != nil {
		t.Fatal(err)
	}
	if len(rs) != 2 || !reflect.DeepEqual(rs[0].streams, []string{"a", "b"}) || !reflect.DeepEqual(rs[1].streams, []string{"orders/b", "orders/c"}) {
		t.Errorf("streamsRoutes = %+v; want default's a,b and orders' b,c apart", rs)
	}
	if rs, err := streamsRoutes(nil, []string{"x"}, "stdout://"); err != nil || len(rs) != 1 || rs[0].streams != nil || !reflect.DeepEqual(rs[0].exclude, []string{"x"}) {
		t.Errorf("streamsRoutes(no streams, exclude x) = %+v, %v; want one catch-all", rs, err)
	}
	for _, c := range []struct {
		streams, exclude []string
		want             string
	}{
		{[]string{"a", "orders/b"}, []string{"c"}, "--exclude-streams cannot go with them"},
		{[]string{"Orders/b"}, nil, `--streams: "Orders/b": source name "Orders"`},
		{[]string{"x*/b"}, nil, `"x*/b": a source pattern is * alone`},
		{[]string{"*/B"}, nil, `"*/B" is not a stream name`},
		{[]string{"*/*", "*/b"}, nil, "*/* takes every stream of every source"},
		{[]string{"*/b"}, []string{"c"}, "--exclude-streams cannot go with it"},
		{nil, []string{"x-y/b"}, `--exclude-streams: "x-y/b": source name`},
		{nil, []string{"*/x"}, `--exclude-streams: "*/x" spans sources`},
		{[]string{"*/payments", "*/payments"}, nil, `--streams: "*/payments" is given twice`},
		{[]string{"a", "b", "a"}, nil, `--streams: "a" is given twice`},
		{nil, []string{"x", "x"}, `--exclude-streams: "x" is given twice`},
	} {
		_, err := streamsRoutes(c.streams, c.exclude, "stdout://")
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("streamsRoutes(%q, %q) = %v, want an error mentioning %q", c.streams, c.exclude, err, c.want)
		}
	}
}

// Routes of every source ("*/payments", "*/*") parse to routes of source
// "*", and expand per listed source: a route naming the source itself
// takes precedence (its streams are left out of the wildcard's, and a
// source with a catch-all of its own gets nothing from wildcards), "*/*"
// is each source's catch-all without what any route names, and a wildcard
// left with nothing for a source yields no subscription for it.
func TestExpandRoutesOfEverySource(t *testing.T) {
	t.Parallel()
	rs, err := parseRoutes([]string{
		"*/payments,*/refunds,orders/audit=nats://h:4222", // 0
		"billing/payments=stdout://",                      // 1
		"*/*=kafka://k:9092",                              // 2
		"legacy/*=stdout://",                              // 3
	})
	if err != nil {
		t.Fatal(err)
	}
	fixed, wild := spansSources(rs)
	if len(wild) != 2 || !reflect.DeepEqual(wild[0].streams, []string{"*/payments", "*/refunds"}) || wild[0].source != anySource ||
		!reflect.DeepEqual(wild[1].streams, []string{"*/*"}) || !reflect.DeepEqual(wild[1].exclude, []string{"*/payments", "*/refunds"}) {
		t.Fatalf("wildcard routes = %+v", wild)
	}
	if len(fixed) != 3 {
		t.Fatalf("fixed routes = %+v; want orders/audit, billing/payments and legacy/*", fixed)
	}
	type want struct {
		index            int
		source           string
		streams, exclude []string
	}
	wants := []want{
		{0, "billing", []string{"billing/refunds"}, nil}, // billing/payments is route 1's
		{0, "default", []string{"payments", "refunds"}, nil},
		// legacy has a catch-all of its own: no wildcard applies.
		{0, "orders", []string{"orders/payments", "orders/refunds"}, nil},
		{2, "billing", []string{"billing/*"}, []string{"billing/payments", "billing/refunds"}},
		{2, "default", nil, []string{"payments", "refunds"}},
		{2, "orders", []string{"orders/*"}, []string{"orders/audit", "orders/payments", "orders/refunds"}},
	}
	all := []string{"billing", "default", "legacy", "orders"}
	got := expandRoutes(fixed, wild, [][]string{all, all})
	if len(got) != len(wants) {
		t.Fatalf("expandRoutes = %+v; want %d routes", got, len(wants))
	}
	for i, w := range wants {
		r := got[i]
		if r.index != w.index || r.source != w.source || !reflect.DeepEqual(r.streams, w.streams) || !reflect.DeepEqual(r.exclude, w.exclude) {
			t.Errorf("expanded route %d = %+v; want %+v", i, r, w)
		}
	}
	if r := got[0]; r.sinkURL != "nats://h:4222" || r.label() != "billing/refunds" {
		t.Errorf("expanded route 0: sink %q, label %q; want route 0's sink, label billing/refunds", r.sinkURL, r.label())
	}

	// Each wildcard gets the sources listed for it (those where the token
	// allows its streams): */* of orders alone, */payments of default.
	if got := expandRoutes(fixed, wild, [][]string{{"default"}, {"orders"}}); len(got) != 2 ||
		got[0].index != 0 || got[0].source != "default" || got[1].index != 2 || got[1].source != "orders" {
		t.Errorf("expandRoutes with sources per wildcard = %+v; want route 0 of default, route 2 of orders", got)
	}

	// */payments alone: a source whose payments another route takes gets
	// no subscription, and default's catch-all (*) shuts out */* for it.
	rs, err = parseRoutes([]string{"*/payments=stdout://", "orders/payments=nats://h:4222"})
	if err != nil {
		t.Fatal(err)
	}
	fixed, wild = spansSources(rs)
	if got := expandRoutes(fixed, wild, [][]string{{"default", "orders"}}); len(got) != 1 || got[0].source != "default" || !reflect.DeepEqual(got[0].streams, []string{"payments"}) {
		t.Errorf("*/payments beside orders/payments expands to %+v; want default's payments alone", got)
	}
	rs, err = streamsRoutes([]string{"*/*", "a"}, nil, "stdout://")
	if err != nil {
		t.Fatal(err)
	}
	fixed, wild = spansSources(rs)
	if got := expandRoutes(fixed, wild, [][]string{{"default", "orders"}}); len(got) != 2 ||
		!reflect.DeepEqual(got[0].exclude, []string{"a"}) || got[0].streams != nil || !reflect.DeepEqual(got[1].streams, []string{"orders/*"}) {
		t.Errorf("--streams */*,a expands to %+v; want default's catch-all without a, and orders/*", got)
	}
	rs, err = parseRoutes([]string{"*=stdout://", "*/*=nats://h:4222"})
	if err != nil {
		t.Fatal(err)
	}
	fixed, wild = spansSources(rs)
	if got := expandRoutes(fixed, wild, [][]string{{"default", "orders"}}); len(got) != 1 || got[0].source != "orders" {
		t.Errorf("* beside */* expands to %+v; want orders' alone (default has its own catch-all)", got)
	}
}

// oldRelayService is the RelayService of a server that predates
// ListSources.
type oldRelayService struct {
	outboxv1.UnimplementedRelayServiceServer
}

// A server that predates ListSources answers UNIMPLEMENTED: the follower of
// */payments takes it to serve default alone, and expands the route for
// default (over real gRPC on loopback).
func TestListSourcesOfAnOldServer(t *testing.T) {
	t.Parallel()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer()
	outboxv1.RegisterRelayServiceServer(g, oldRelayService{})
	go func() { _ = g.Serve(l) }()
	defer g.Stop()
	conn, err := grpc.NewClient(l.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()

	rs, err := parseRoutes([]string{"*/payments=stdout://"})
	if err != nil {
		t.Fatal(err)
	}
	fixed, wild := spansSources(rs)
	started := make(chan route, 1)
	ctx, cancel := context.WithCancel(t.Context())
	sf := &sourceFollower{client: outboxv1.NewRelayServiceClient(conn), fixed: fixed, wild: wild, every: time.Hour,
		log: slog.New(slog.DiscardHandler),
		run: func(ctx context.Context, rt route) error { started <- rt; <-ctx.Done(); return nil }}
	done := make(chan error, 1)
	go func() { done <- sf.Run(ctx) }()
	select {
	case rt := <-started:
		if rt.source != "default" || !reflect.DeepEqual(rt.streams, []string{"payments"}) {
			t.Errorf("against a server without ListSources, */payments started %+v; want default's payments", rt)
		}
	case <-time.After(time.Minute): // a hang guard
		t.Fatal("against a server without ListSources, */payments started nothing within a minute")
	}
	cancel()
	if err := <-done; err != nil {
		t.Errorf("follower stopped with %v; want nil", err)
	}
}

// `outboxd relay` refuses at start, exit 2 and before dialing the server,
// an --exclude-streams of source * (which the server would refuse only
// later, as INVALID_ARGUMENT: exit 2 too) and a stream given twice in --streams.
func TestRelayRefusesBadStreamsAtStart(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--exclude-streams", "*/x"}, `"*/x" spans sources`},
		{[]string{"--streams", "*/payments,*/payments"}, `"*/payments" is given twice`},
	} {
		args := append([]string{"relay", "--server", "127.0.0.1:1", "--sink", "stdout://"}, c.args...)
		// A relay that got past its checks would run until this deadline.
		ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
		r := runCLI(t, ctx, nil, nil, args...)
		cancel()
		if r.code != exitUsage || !strings.Contains(r.stderr, c.want) {
			t.Errorf("outboxd %s: exit %d, %q; want exit %d mentioning %q", strings.Join(args, " "), r.code, r.stderr, exitUsage, c.want)
		}
	}
}
