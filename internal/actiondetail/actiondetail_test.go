package actiondetail

import "testing"

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
		if got := Describe(c.action, c.detail); got != c.want {
			t.Errorf("Describe(%q, %s) = %q, want %q", c.action, c.detail, got, c.want)
		}
	}
}
