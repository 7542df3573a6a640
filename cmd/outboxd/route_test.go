package main

import (
	"reflect"
	"strings"
	"testing"
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
		{[]string{"*/payments=stdout://"}, `"*/payments" spans sources`},
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
		{[]string{"*/b"}, nil, `"*/b" spans sources`},
		{nil, []string{"x-y/b"}, `--exclude-streams: "x-y/b": source name`},
	} {
		_, err := streamsRoutes(c.streams, c.exclude, "stdout://")
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("streamsRoutes(%q, %q) = %v, want an error mentioning %q", c.streams, c.exclude, err, c.want)
		}
	}
}
