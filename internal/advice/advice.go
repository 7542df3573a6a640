// Package advice words what the operator's views (`outboxd lag` and the
// console) say about conditions of a lag report that need an operator,
// so that both say the same, from the same thresholds.
package advice

import (
	"fmt"
	"strings"
	"time"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
)

// XminHorizonWarnAge is the age, in transactions, from which a held xmin
// horizon is reported. Delivery commits about one transaction per event
// and writes a few row versions per event, so a hold this old has kept
// tens of thousands of versions that every claim reads past: at 2,500
// events a second the benchmark's delivery was unharmed by a 10 s hold
// (about 25,000 transactions) and at 0.6 × after 30 s (about 75,000).
const XminHorizonWarnAge = 50_000

// XminHorizon says who holds the cluster's xmin horizon, since when (in
// loc, as the view's other times are), and what to do; "" when h is
// younger than XminHorizonWarnAge.
func XminHorizon(h *outboxv1.XminHorizon, loc *time.Location) string {
	if h.GetAgeTransactions() < XminHorizonWarnAge {
		return ""
	}
	var b strings.Builder
	fmt.Fprintf(&b, "%d transactions back", h.GetAgeTransactions())
	if holder := h.GetHolder(); holder != "" {
		fmt.Fprintf(&b, " by %s", holder)
	}
	if src := h.GetSource(); src != "" {
		fmt.Fprintf(&b, " (the cluster of source %s)", src)
	}
	if since := h.GetHeldSince(); since != nil {
		fmt.Fprintf(&b, ", since %s", since.AsTime().In(loc).Format(time.RFC3339))
	}
	b.WriteString("; PostgreSQL keeps every row version written since and delivery slows as they pile up:" +
		" end that transaction, or run long reads and dumps on a standby without hot_standby_feedback")
	return b.String()
}
