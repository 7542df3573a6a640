// Package actiondetail puts into words what an operator action did to one
// aggregate (outbox.v1.OperatorAction.detail_json), for the CLI and the
// console alike.
package actiondetail

import (
	"encoding/json"
	"fmt"
	"strings"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/multisource"
)

// detail is the union of the fields the server writes per action kind.
type detail struct {
	State       string `json:"state"`
	AcceptedGap *struct {
		From int64 `json:"from_revision"`
		To   int64 `json:"to_revision"`
	} `json:"accepted_gap"`
	EventID      string `json:"event_id"`
	Revision     int64  `json:"revision"`
	FromRevision int64  `json:"from_revision"`
	ToRevision   int64  `json:"to_revision"`
	Events       int64  `json:"events"`
	Unskipped    int64  `json:"unskipped"`
}

// Of says what a did to the aggregate a listing named (Describe), an
// event of a source other than default named source/event_id.
func Of(a *outboxv1.OperatorAction) string {
	src, _ := multisource.SplitStream(a.GetStream())
	return Describe(a.GetAction(), a.GetDetailJson(), multisource.JoinStream(src, ""))
}

// Describe says what an action of kind action did, given its detail JSON;
// "" when there is no detail (a listing that named no aggregate). Unknown
// shapes come back as the JSON itself rather than as nothing. idPrefix
// goes before an event id: "orders/" for an action of source orders, as
// message ids and admin calls name its events; "" in the default source.
func Describe(action, detailJSON, idPrefix string) string {
	if detailJSON == "" || detailJSON == "{}" {
		return ""
	}
	var d detail
	if err := json.Unmarshal([]byte(detailJSON), &d); err != nil {
		return detailJSON
	}
	switch action {
	case "retry", "bulk_retry":
		s := "retried"
		if d.State != "" {
			s += " (was " + stateWords(d.State) + ")"
		}
		if g := d.AcceptedGap; g != nil {
			s += "; accepted the gap: " + revisions(g.From, g.To) + " given up for good"
		}
		return s
	case "skip", "bulk_skip":
		return fmt.Sprintf("skipped revision %d (event %s%s)", d.Revision, idPrefix, d.EventID)
	case "republish":
		s := fmt.Sprintf("%s delivered again (%s", revisions(d.FromRevision, d.ToRevision), plural(d.Events, "event"))
		if d.Unskipped > 0 {
			s += fmt.Sprintf(", %d of them skipped before", d.Unskipped)
		}
		return s + ")"
	}
	return detailJSON
}

func stateWords(s string) string {
	switch s {
	case "backoff":
		return "backing off"
	case "gap":
		return "held at a gap"
	}
	return strings.ReplaceAll(s, "_", " ")
}

func revisions(from, to int64) string {
	if from == to {
		return fmt.Sprintf("revision %d", from)
	}
	return fmt.Sprintf("revisions %d-%d", from, to)
}

func plural(n int64, one string) string {
	if n == 1 {
		return "1 " + one
	}
	return fmt.Sprintf("%d %ss", n, one)
}
