package app_test

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/outboxd/outboxd/internal/app"
	"github.com/outboxd/outboxd/internal/servertest"
	"github.com/outboxd/outboxd/internal/store"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/server"
)

// A replica spreads its idle-check budget over its sources: with the
// default (50 a second) one source keeps the idle interval (25ms), and
// each source added lengthens every source's quiet interval by its share,
// the ones already running too. Config.IdleChecksPerSecond sets the budget.
func TestIdleChecksAreSpreadOverTheSources(t *testing.T) {
	t.Parallel()
	source := func(i int) app.Source {
		url := testdb.New(t)
		return app.Source{Name: fmt.Sprintf("s%d", i),
			Server: server.Config{Store: store.New(testdb.NewPoolURL(t, url)), DatabaseURL: url, Logger: servertest.Logger(t)}}
	}
	sources := func(n int) []app.Source {
		var srcs []app.Source
		for i := range n {
			srcs = append(srcs, source(i))
		}
		return srcs
	}
	check := func(rep *app.Replica, n int, want time.Duration) {
		t.Helper()
		for i := range n {
			if got := rep.Source(fmt.Sprintf("s%d", i)).DiscoveryQuietInterval(); got != want {
				t.Errorf("%d sources: s%d checks every %v when quiet, want %v", n, i, got, want)
			}
		}
	}
	rep, err := app.New(t.Context(), app.Config{Sources: sources(5), LabelSources: true})
	if err != nil {
		t.Fatal(err)
	}
	defer rep.Shutdown()
	check(rep, 5, 100*time.Millisecond)
	if err := rep.AddSource(t.Context(), source(5)); err != nil {
		t.Fatal(err)
	}
	check(rep, 6, 120*time.Millisecond)

	// A budget of 200 a second: 2 sources at 25ms still, 7 at 35ms.
	for n, want := range map[int]time.Duration{2: 25 * time.Millisecond, 7: 35 * time.Millisecond} {
		rep, err := app.New(t.Context(), app.Config{Sources: sources(n), LabelSources: true, IdleChecksPerSecond: 200})
		if err != nil {
			t.Fatal(err)
		}
		check(rep, n, want)
		rep.Shutdown()
	}
}

// A replica refuses negative durations and budgets before it opens
// anything: a negative health interval would check readiness in a loop,
// a negative shutdown timeout would end every drain at once.
func TestNewRefusesNegativeSettings(t *testing.T) {
	t.Parallel()
	for name, cfg := range map[string]app.Config{
		"ShutdownTimeout":     {ShutdownTimeout: -time.Second},
		"HealthInterval":      {HealthInterval: -time.Second},
		"IdleChecksPerSecond": {IdleChecksPerSecond: -1},
	} {
		rep, err := app.New(t.Context(), cfg)
		if err == nil {
			rep.Shutdown()
			t.Errorf("a negative %s was accepted", name)
		} else if !strings.Contains(err.Error(), name) {
			t.Errorf("a negative %s: %v; want an error naming it", name, err)
		}
	}
}
