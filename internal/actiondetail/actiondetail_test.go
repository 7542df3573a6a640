package actiondetail

import (
	"testing"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
)

func TestDescribe(t *testing.T) {
	for _, c := range []struct{ action, detail, want string }{
		{"retry", `{"state":"parked"}`, "retried (was parked)"},
		{"bulk_retry", `{"state":"backoff"}`, "retried (was backing off)"},
		{"retry", `{"state":"gap","accepted_gap":{"from_revision":2,"to_revision":3}}`,
			"retried (was held at a gap); accepted the gap: revisions 2-3 given up for good"},
		{"skip", `{"event_id":"e1","revision":4}`, "skipped revision 4 (event e1)"},
		{"republish", `{"from_revision":2,"to_revision":2,"events":1,"unskipped":1}`,
			"revision 2 delivered again (1 event, 1 of them skipped before)"},
		{"republish", `{"from_revision":3,"to_revision":5,"events":3}`, "revisions 3-5 delivered again (3 events)"},
		{"retry", "", ""},
		{"retry", "{}", ""},                         // no detail: nothing to say
		{"bulk_retry", `{"revision":0}`, "retried"}, // no state recorded: none named
		{"bulk_skip", `{"event_id":"e2","revision":7}`, "skipped revision 7 (event e2)"},
		{"republish", `{"from_revision":4,"to_revision":4,"events":0}`, "revision 4 delivered again (0 events)"},
		{"future", `{"x":1}`, `{"x":1}`},
		{"retry", `not json`, `not json`},
	} {
		if got := Describe(c.action, c.detail, ""); got != c.want {
			t.Errorf("Describe(%q, %s) = %q, want %q", c.action, c.detail, got, c.want)
		}
	}
	// An event of another source is named as its message id is.
	if got, want := Describe("skip", `{"event_id":"e1","revision":4}`, "orders/"), "skipped revision 4 (event orders/e1)"; got != want {
		t.Errorf("Describe of a skip in source orders = %q, want %q", got, want)
	}
}

// Of names the event of an action by its address: source/event_id outside
// default (the action's stream says the source), the bare id in it.
func TestOfNamesTheEventInItsSource(t *testing.T) {
	for stream, want := range map[string]string{
		"orders/refund": "skipped revision 1 (event orders/e1)",
		"refund":        "skipped revision 1 (event e1)",
	} {
		a := &outboxv1.OperatorAction{Action: "skip", Stream: stream, DetailJson: `{"event_id":"e1","revision":1}`}
		if got := Of(a); got != want {
			t.Errorf("Of(skip in %s) = %q, want %q", stream, got, want)
		}
	}
}
