package bench

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/outboxd/outboxd/relay"
)

// tinySourcesConfig is the sources workloads at the smallest scale that
// still has a heavy source, two light ones and two idle ones.
func tinySourcesConfig(t *testing.T, workloads []string, logs *strings.Builder) Config {
	cfg := tinyConfig(t, logs, workloads, ArmOutboxd)
	cfg.Warmup = 200 * time.Millisecond
	cfg.Sources, cfg.SourcesLightRate = 3, 50
	cfg.IdleSources, cfg.IdleSourcesSettle = 2, 200*time.Millisecond
	return cfg
}

// Both sources workloads at tiny scale against the real PostgreSQL and
// server: sources runs its light-only and mixed windows over three source
// databases behind one serve, with the steady run it compares with, and
// accounts for every event; idle-sources reads the connections and CPU of
// its two idle sources with one relay each and with none. No timing is
// asserted.
func TestRunSources(t *testing.T) {
	if testing.Short() {
		t.Skip("needs PostgreSQL")
	}
	t.Parallel()
	var logs strings.Builder
	rep, err := Run(context.Background(), tinySourcesConfig(t, []string{WorkloadSources, WorkloadIdleSources}, &logs))
	if err != nil {
		t.Fatalf("run: %v\nlogs:\n%s", err, logs.String())
	}
	if len(rep.Results) != 3 {
		t.Fatalf("%d results, want steady, sources and idle-sources", len(rep.Results))
	}
	src := rep.find(WorkloadSources, ArmOutboxd, 0, 0)
	if src == nil || src.Sources == nil {
		t.Fatal("no sources result")
	}
	f, c := src.Sources, src.Counts
	if c == nil || c.Lost != 0 || c.Reordered != 0 || c.Unexpected != 0 || c.Duplicates != 0 {
		t.Errorf("sources account %+v", c)
	}
	// Every source's seed, the light producers in both windows and the
	// heavy producers: more than the seeds were committed, and all of it
	// reached the sink (it had the settle to catch up).
	if c != nil && (c.Committed <= 3 || c.Delivered+c.Backlog != c.Committed) {
		t.Errorf("sources: %d committed, %d delivered + %d left", c.Committed, c.Delivered, c.Backlog)
	}
	if f.Sources != 3 || f.LightSolo == nil || f.LightSolo.N == 0 || f.LightMixed == nil || f.LightMixed.N == 0 ||
		f.HeavyMixed == nil || f.HeavyMixed.N == 0 {
		t.Errorf("sources figures %+v: want latency samples of the light sources in both windows and of the heavy one", f)
	}
	if src.Throughput <= 0 || f.HeavyMixedPerS <= 0 {
		t.Errorf("sources: %.0f ev/s in all, heavy %.0f", src.Throughput, f.HeavyMixedPerS)
	}
	idle := rep.find(WorkloadIdleSources, ArmOutboxd, 0, 0)
	if idle == nil || idle.IdleSources == nil || idle.IdleSources.NoRelays == nil || idle.IdleSources.OneRelay == nil {
		t.Fatal("no idle-sources windows")
	}
	for _, ph := range []*IdleSourcesPhase{idle.IdleSources.NoRelays, idle.IdleSources.OneRelay} {
		// Each engine holds at least its LISTEN connection.
		if ph.ConnsTotal < 2 || ph.ConnsPerSourceMax < 1 || len(ph.Sessions) == 0 {
			t.Errorf("idle-sources, %d relays: %d connections (most %d per source), sessions %v", ph.Relays, ph.ConnsTotal, ph.ConnsPerSourceMax, ph.Sessions)
		}
	}
	if idle.IdleSources.OneRelay.Relays != 2 || idle.IdleSources.NoRelays.Relays != 0 {
		t.Errorf("idle-sources relays %d and %d, want 2 and 0", idle.IdleSources.OneRelay.Relays, idle.IdleSources.NoRelays.Relays)
	}
	var goals int
	for _, r := range rep.Ratios {
		if strings.Contains(r.Name, "sources") && r.Value != nil {
			goals++
		}
	}
	if goals != 6 { // 2 of sources, 2 per idle-sources window
		t.Errorf("%d sources goals with a value, want 6: %+v", goals, rep.Ratios)
	}
	assertNoScratchDatabases(t, rep)
}

// A broker that loses one light source's event and receives another
// light source's event twice: the sources workload's account, summed over
// its per-source ledgers, reports the loss (and the run fails) and the
// duplicate, and names the source that lost it.
func TestRunSourcesCatchesLossAndDuplicate(t *testing.T) {
	if testing.Short() {
		t.Skip("needs PostgreSQL")
	}
	t.Parallel()
	var logs strings.Builder
	cfg := tinySourcesConfig(t, []string{WorkloadSources}, &logs)
	var dropped, duplicated atomic.Bool
	seed := func(ev relay.Event) bool { return ev.AggregateKey == "0" && ev.Revision == 1 }
	cfg.sinkFault = func(ev relay.Event) sinkFault {
		switch {
		case seed(ev): // the run waits for every seed before it starts
		case ev.Source == lightSourceName+"01" && dropped.CompareAndSwap(false, true):
			return sinkDrop
		case ev.Source == lightSourceName+"02" && duplicated.CompareAndSwap(false, true):
			return sinkDuplicate
		}
		return sinkOK
	}
	rep, err := Run(context.Background(), cfg)
	if !errors.Is(err, ErrIncorrect) {
		t.Fatalf("run: %v, want ErrIncorrect\nlogs:\n%s", err, logs.String())
	}
	if !dropped.Load() || !duplicated.Load() {
		t.Fatal("the faulty broker was not used")
	}
	src := rep.find(WorkloadSources, ArmOutboxd, 0, 0)
	if src == nil || src.Counts == nil {
		t.Fatal("no sources account")
	}
	if c := src.Counts; c.Lost != 1 || c.Duplicates != 1 || c.Unexpected != 0 {
		t.Errorf("account %+v, want 1 lost and 1 duplicate", *c)
	}
	if len(rep.Failures) != 1 || !strings.Contains(rep.Failures[0], WorkloadSources) {
		t.Errorf("failures %v, want the sources arm's", rep.Failures)
	}
	if !strings.Contains(strings.Join(src.Notes, "\n"), "source "+lightSourceName+"01: lost 1") {
		t.Errorf("notes %v, want the source that lost the event named", src.Notes)
	}
	assertNoScratchDatabases(t, rep)
}
