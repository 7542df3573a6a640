package app_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/outboxd/outboxd/internal/app"
	"github.com/outboxd/outboxd/internal/servertest"
	"github.com/outboxd/outboxd/internal/store"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/server"
)

// A replica spreads IdleChecksPerSecond over its sources: up to 5 sources
// keep the idle interval (25ms), and each source added lengthens every
// source's quiet interval by its share, the ones already running too.
func TestIdleChecksAreSpreadOverTheSources(t *testing.T) {
	t.Parallel()
	source := func(i int) app.Source {
		url := testdb.New(t)
		return app.Source{Name: fmt.Sprintf("s%d", i),
			Server: server.Config{Store: store.New(testdb.NewPoolURL(t, url)), DatabaseURL: url, Logger: servertest.Logger(t)}}
	}
	var sources []app.Source
	for i := range 5 {
		sources = append(sources, source(i))
	}
	rep, err := app.New(t.Context(), app.Config{Sources: sources, LabelSources: true})
	if err != nil {
		t.Fatal(err)
	}
	defer rep.Shutdown()
	check := func(n int, want time.Duration) {
		t.Helper()
		for i := range n {
			if got := rep.Source(fmt.Sprintf("s%d", i)).DiscoveryQuietInterval(); got != want {
				t.Errorf("%d sources: s%d checks every %v when quiet, want %v", n, i, got, want)
			}
		}
	}
	check(5, 25*time.Millisecond)
	if err := rep.AddSource(t.Context(), source(5)); err != nil {
		t.Fatal(err)
	}
	check(6, 6*time.Second/app.IdleChecksPerSecond)
}
