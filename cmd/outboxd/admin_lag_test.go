package main

import (
	"bytes"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/advice"
)

// `outboxd lag` reports a held xmin horizon once it is old enough to slow
// delivery (advice.XminHorizonWarnAge transactions), with its holder and source
// and what to do, and says nothing of a younger one. Its start is in local
// time, as every other time the CLI prints (fmtTime). Not parallel: it sets
// time.Local.
func TestLagReportsAHeldXminHorizon(t *testing.T) {
	local := time.Local
	time.Local = time.FixedZone("UTC+3", 3*60*60)
	t.Cleanup(func() { time.Local = local })
	lag := func(age int64) string {
		t.Helper()
		var out bytes.Buffer
		if err := printLag(&out, &outboxv1.GetLagResponse{Total: &outboxv1.StreamLag{}, XminHorizon: &outboxv1.XminHorizon{
			AgeTransactions: age, Holder: "pid 4242 (database shop, user report, idle in transaction)", Source: "orders",
			HeldSince: timestamppb.New(time.Date(2026, 12, 4, 3, 0, 0, 0, time.UTC))}}); err != nil {
			t.Fatal(err)
		}
		return out.String()
	}
	out := lag(advice.XminHorizonWarnAge)
	for _, want := range []string{"XMIN HORIZON HELD: 50000 transactions back by pid 4242 (database shop, user report, idle in transaction)",
		"(the cluster of source orders)", ", since 2026-12-04T06:00:00+03:00", "end that transaction"} {
		if !strings.Contains(out, want) {
			t.Errorf("lag with a horizon held %d transactions back does not say %q:\n%s", advice.XminHorizonWarnAge, want, out)
		}
	}
	if out := lag(advice.XminHorizonWarnAge - 1); strings.Contains(out, "XMIN") {
		t.Errorf("lag reports a horizon held %d transactions back:\n%s", advice.XminHorizonWarnAge-1, out)
	}
}
