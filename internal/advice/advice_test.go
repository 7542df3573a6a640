package advice_test

import (
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/advice"
)

// A horizon held from XminHorizonWarnAge transactions back is reported, one
// younger is not: `outboxd lag` and the console share this threshold, so
// both warn from the same age.
func TestXminHorizonReportedFromTheWarnAge(t *testing.T) {
	t.Parallel()
	if s := advice.XminHorizon(&outboxv1.XminHorizon{AgeTransactions: advice.XminHorizonWarnAge - 1}, time.UTC); s != "" {
		t.Errorf("a horizon %d transactions back is reported: %q", advice.XminHorizonWarnAge-1, s)
	}
	if s := advice.XminHorizon(&outboxv1.XminHorizon{AgeTransactions: advice.XminHorizonWarnAge}, time.UTC); s == "" {
		t.Errorf("a horizon %d transactions back is not reported", advice.XminHorizonWarnAge)
	}
	if s := advice.XminHorizon(nil, time.UTC); s != "" {
		t.Errorf("no horizon is reported: %q", s)
	}
}

// The report names who holds the horizon, on which source's cluster, and
// since when in the view's location (the operator compares it with the
// view's other times, and with the holder's own clock in
// pg_stat_activity).
func TestXminHorizonNamesHolderSourceAndSinceInTheViewsLocation(t *testing.T) {
	t.Parallel()
	loc := time.FixedZone("UTC+2", 2*3600)
	since := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	s := advice.XminHorizon(&outboxv1.XminHorizon{AgeTransactions: 60_000, Holder: "pid 42 (pg_dump)",
		Source: "orders", HeldSince: timestamppb.New(since)}, loc)
	for _, want := range []string{"60000 transactions back", "by pid 42 (pg_dump)", "(the cluster of source orders)",
		"since 2026-01-02T05:04:05+02:00"} {
		if !strings.Contains(s, want) {
			t.Errorf("report %q does not say %q", s, want)
		}
	}
	// Without holder, source or start, none is made up.
	s = advice.XminHorizon(&outboxv1.XminHorizon{AgeTransactions: 60_000}, loc)
	for _, not := range []string{" by ", "source", "since 2"} {
		if strings.Contains(s, not) {
			t.Errorf("report without holder, source or start %q says %q", s, not)
		}
	}
}
