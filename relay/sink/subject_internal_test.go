package sink

import (
	"strings"
	"testing"
	"time"

	"github.com/outboxd/outboxd/relay"
)

func TestSubjectTemplateFilterAndRender(t *testing.T) {
	t.Parallel()
	tm, err := parseSubjectTemplate("outbox.{stream}.evt.{event_type}.{aggregate_key}")
	if err != nil {
		t.Fatal(err)
	}
	if got, want := tm.filter(), "outbox.*.evt.*.*"; got != want {
		t.Errorf("filter = %q, want %q", got, want)
	}
	subj, err := tm.render(relay.Event{ID: "x", Stream: "orders.eu", Type: "Placed", AggregateKey: "a b", CreatedAt: time.Now()})
	if err != nil {
		t.Fatal(err)
	}
	if want := "outbox.orders%2Eeu.evt.Placed.a%20b"; subj != want {
		t.Errorf("render = %q, want %q", subj, want)
	}
	if !subjectSubsetOf(subj, tm.filter()) {
		t.Errorf("rendered subject %q is outside filter %q", subj, tm.filter())
	}

	if _, err := tm.render(relay.Event{ID: "x", AggregateKey: strings.Repeat(".", maxSubjectLen)}); err == nil {
		t.Error("render of an oversize subject succeeded, want an error")
	}
	// A subject that fits NATS's default max_control_line (4096 bytes) on
	// its own but not with the HPUB line's reply inbox and sizes would make
	// the server drop the connection under every publish in flight: refused
	// here, for this event alone.
	if subj, err := tm.render(relay.Event{ID: "x", Stream: "s", Type: "t", AggregateKey: strings.Repeat("k", 4050)}); err == nil {
		t.Errorf("render of a %d-byte subject succeeded, want an error: its HPUB line passes 4096 bytes", len(subj))
	}

	lit, err := parseSubjectTemplate("outbox.all")
	if err != nil {
		t.Fatal(err)
	}
	if got := lit.filter(); got != "outbox.all" {
		t.Errorf("literal filter = %q", got)
	}
}

func TestSubjectSubsetOf(t *testing.T) {
	t.Parallel()
	cases := []struct {
		sub, filter string
		want        bool
	}{
		{"outbox.*.*", "outbox.>", true},
		{"outbox.*.*", "outbox.*.*", true},
		{"outbox.*.*", ">", true},
		{"outbox.*.*", "*.*.*", true},
		{"outbox.*.*", "outbox.*", false},
		{"outbox.*.*", "outbox.a.*", false},
		{"outbox.*.*", "other.>", false},
		{"outbox", "outbox.>", false},
		{"outbox.>", "outbox.*", false},
		{"outbox.>", "outbox.>", true},
		{"outbox.a", "outbox.a", true},
		{"outbox.a.b", "outbox.a", false},
	}
	for _, c := range cases {
		if got := subjectSubsetOf(c.sub, c.filter); got != c.want {
			t.Errorf("subjectSubsetOf(%q, %q) = %v, want %v", c.sub, c.filter, got, c.want)
		}
	}
}
