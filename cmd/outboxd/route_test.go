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
