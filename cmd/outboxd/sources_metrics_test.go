package main_test

import (
	"context"
	"fmt"
	"math"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/outboxd/outboxd/internal/app"
	"github.com/outboxd/outboxd/internal/testdb"
)

// scrapeMetrics reads serve's /metrics: each series, written as the text
// format writes it (labels in name order, `name{a="1",b="2"}`), and its
// value; nil while /metrics does not answer.
func scrapeMetrics(t *testing.T, httpAddr string) map[string]float64 {
	t.Helper()
	code, body := httpGet("http://" + httpAddr + "/metrics")
	if code != http.StatusOK {
		return nil
	}
	series := map[string]float64{}
	for line := range strings.Lines(body) {
		line = strings.TrimSpace(line)
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err != nil {
			t.Fatalf("/metrics: %q: %v", line, err)
		}
		series[line[:i]] = v
	}
	return series
}

// quietInterval is outboxd_discovery_quiet_check_interval_seconds of
// source in m, and whether m has it.
func quietInterval(m map[string]float64, source string) (time.Duration, bool) {
	v, ok := m[`outboxd_discovery_quiet_check_interval_seconds{source="`+source+`"}`]
	return time.Duration(math.Round(v * float64(time.Second))), ok
}

// poolFigures are the figures /metrics gives of one source's pool.
type poolFigures struct {
	total, opened           float64
	trimmed, busy, inUse    float64 // the trimmer's checks by outcome
	present, checksReported bool
}

// checks counts the trimmer's looks at the pool: one per trimmer tick.
func (f poolFigures) checks() float64 { return f.trimmed + f.busy + f.inUse }

func poolOf(m map[string]float64, source string) poolFigures {
	var f poolFigures
	f.total, f.present = m[`outboxd_source_pool_connections{source="`+source+`",state="total"}`]
	f.opened = m[`outboxd_source_pool_connections_opened_total{source="`+source+`"}`]
	check := func(outcome string) float64 {
		v, ok := m[`outboxd_source_pool_trim_checks_total{outcome="`+outcome+`",source="`+source+`"}`]
		f.checksReported = f.checksReported || ok
		return v
	}
	f.trimmed, f.busy, f.inUse = check("trimmed"), check("busy"), check("in_use")
	return f
}

// quietFloor is server.Config.DiscoveryIdleInterval's default: a quiet
// source never checks more often.
const quietFloor = 25 * time.Millisecond

// serve passes --idle-checks-per-second to its engines: with 8 and two
// sources, each quiet source checks every 2/8 s; without the flag, the
// default budget is spread over the sources (three here, so that the
// answer is not the 25ms floor that any budget of 80 or more gives two).
// Both replicas serve the same databases at once, as two replicas would.
func TestQuietCheckIntervalFollowsIdleChecksFlag(t *testing.T) {
	t.Parallel()
	def, a, b := testdb.New(t), testdb.New(t), testdb.New(t)
	httpFlag, httpDefault := freeAddr(t), freeAddr(t)
	flagged := start(t, "serve", "--database-url", def, "--source", "a="+a, "--idle-checks-per-second", "8",
		"--listen", freeAddr(t), "--http-listen", httpFlag)
	defer flagged.signal(os.Interrupt)
	byDefault := start(t, "serve", "--database-url", def, "--source", "a="+a, "--source", "b="+b,
		"--listen", freeAddr(t), "--http-listen", httpDefault)
	defer byDefault.signal(os.Interrupt)

	for _, c := range []struct {
		what     string
		httpAddr string
		sources  []string
		want     time.Duration
	}{
		{"--idle-checks-per-second 8, 2 sources", httpFlag, []string{"default", "a"}, 2 * time.Second / 8},
		{"no --idle-checks-per-second, 3 sources", httpDefault, []string{"default", "a", "b"},
			max(3*time.Second/app.DefaultIdleChecksPerSecond, quietFloor)},
	} {
		for _, src := range c.sources {
			var got time.Duration
			eventually(t, c.what+": source "+src+"'s quiet check interval on /metrics", func() bool {
				var ok bool
				got, ok = quietInterval(scrapeMetrics(t, c.httpAddr), src)
				return ok
			})
			if got != c.want {
				t.Errorf("%s: source %s checks every %v while quiet, want %v", c.what, src, got, c.want)
			}
		}
	}
}

// A source with a steady trickle of events keeps its pool's connections:
// the process-wide trimmer asks the source's engine whether it found
// events lately (sourcePool.followEngine), both for a source serve opened
// at startup and for one a reload of the --config file added later. The
// trimmer's looks at each pool are counted on /metrics by outcome, one per
// tick: over a dozen ticks while events flow, none trims either pool, and
// neither pool closed a connection it opened over them (what it opened
// then, it still holds; before its first event a source is quiet, and its
// pool may be trimmed). The trickle, an event every 200ms, is slow enough that the
// calls alone would let the trimmer trim (under 100 a second: measured
// 59 a second, against 120 with an event every 50ms and 210 every 20ms),
// so that it is the engine's word that keeps the pool. The quiet check
// interval follows the sources a reload adds and removes, and a removed
// source's series leave /metrics.
func TestPoolsOfSourcesWithEventsAreNotTrimmed(t *testing.T) {
	t.Parallel()
	def, busy, late := testdb.New(t), testdb.New(t), testdb.New(t)
	dir := t.TempDir()
	cfg := filepath.Join(dir, "outboxd.yaml")
	busyEntry := "  - busy=" + withoutPassword(t, busy) + "\n"
	lateEntry := "  - late=" + withoutPassword(t, late) + "\n"
	replaceFile(t, dir, cfg, "source:\n"+busyEntry)
	httpAddr := freeAddr(t)
	p := start(t, "serve", "--config", cfg, "--database-url", def, "--idle-checks-per-second", "8",
		"--listen", freeAddr(t), "--http-listen", httpAddr)
	defer p.signal(os.Interrupt)
	eventually(t, "the first reload", func() bool { ok, _ := sourceReloads(t, httpAddr); return ok >= 1 })

	ctx, cancel := context.WithCancel(t.Context())
	var producers sync.WaitGroup
	defer producers.Wait()
	defer cancel()
	trickle := func(url string) {
		pool := testdb.NewPoolURL(t, url)
		producers.Go(func() {
			tick := time.NewTicker(200 * time.Millisecond)
			defer tick.Stop()
			for {
				if _, err := pool.Exec(ctx, `SELECT outbox.emit('orders', '1', 'T', '{}')`); err != nil && ctx.Err() == nil {
					t.Errorf("emit: %v", err)
				}
				select {
				case <-ctx.Done():
					return
				case <-tick.C:
				}
			}
		})
	}
	trickle(busy)

	// late is added by a reload, and its events flow too.
	okBefore, _ := sourceReloads(t, httpAddr)
	replaceFile(t, dir, cfg, "source:\n"+busyEntry+lateEntry)
	eventually(t, "the reload that adds late", func() bool { ok, _ := sourceReloads(t, httpAddr); return ok > okBefore })
	eventually(t, "late's pool on /metrics", func() bool { return poolOf(scrapeMetrics(t, httpAddr), "late").present })
	trickle(late)
	// The ticks count from when the trimmer has found both sources in use
	// (their first events discovered): before that a source is quiet.
	inUse := func() (busyN, lateN float64) {
		m := scrapeMetrics(t, httpAddr)
		return poolOf(m, "busy").inUse, poolOf(m, "late").inUse
	}
	busy0, late0 := inUse()
	eventually(t, "the trimmer finds both sources in use", func() bool { b, l := inUse(); return b > busy0 && l > late0 })
	m := scrapeMetrics(t, httpAddr)
	for _, src := range []string{"default", "busy", "late"} {
		if got, _ := quietInterval(m, src); got != 3*time.Second/8 {
			t.Errorf("3 sources at --idle-checks-per-second 8: source %s checks every %v while quiet, want %v", src, got, 3*time.Second/8)
		}
	}

	const ticks = 12
	before := map[string]poolFigures{"busy": poolOf(m, "busy"), "late": poolOf(m, "late")}
	for src, f := range before {
		if !f.checksReported {
			t.Fatalf("source %s: no outboxd_source_pool_trim_checks_total on /metrics", src)
		}
	}
	var after map[string]poolFigures
	eventually(t, fmt.Sprintf("%d trimmer ticks over both pools", ticks), func() bool {
		m := scrapeMetrics(t, httpAddr)
		after = map[string]poolFigures{"busy": poolOf(m, "busy"), "late": poolOf(m, "late")}
		for src, f := range after {
			if f.checks() < before[src].checks()+ticks {
				return false
			}
		}
		return true
	})
	for _, src := range []string{"busy", "late"} {
		b, a := before[src], after[src]
		t.Logf("source %s over %v trimmer ticks: %v in use, %v busy, %v trimmed; its pool opened %v connections in all, holds %v",
			src, a.checks()-b.checks(), a.inUse-b.inUse, a.busy-b.busy, a.trimmed-b.trimmed, a.opened, a.total)
		if a.trimmed != b.trimmed {
			t.Errorf("source %s, events every 200ms: trimmed %v times in %v trimmer ticks, want never (in use %v, busy %v)",
				src, a.trimmed-b.trimmed, a.checks()-b.checks(), a.inUse-b.inUse, a.busy-b.busy)
		}
		if a.inUse == b.inUse && a.busy > b.busy {
			t.Errorf("source %s: no trimmer tick found it in use, but %v busy: the trickle makes too many calls for this test to tell",
				src, a.busy-b.busy)
		}
		// Over the ticks, not since the start: before its first event a
		// source is quiet, and its pool is trimmed like any idle one.
		if opened, held := a.opened-b.opened, a.total-b.total; opened > held {
			t.Errorf("source %s, events every 200ms: over the ticks its pool opened %v connections and holds %v more: it closed some (trimmed) and opened them again",
				src, opened, held)
		}
	}

	// late leaves with its series, and the others' share of the budget grows.
	okBefore, _ = sourceReloads(t, httpAddr)
	replaceFile(t, dir, cfg, "source:\n"+busyEntry)
	eventually(t, "the reload that removes late", func() bool { ok, _ := sourceReloads(t, httpAddr); return ok > okBefore })
	m = scrapeMetrics(t, httpAddr)
	if f := poolOf(m, "late"); f.present || f.checksReported {
		t.Error("late's pool is still on /metrics after its removal")
	}
	if _, ok := quietInterval(m, "late"); ok {
		t.Error("late's quiet check interval is still on /metrics after its removal")
	}
	for _, src := range []string{"default", "busy"} {
		if got, _ := quietInterval(m, src); got != 2*time.Second/8 {
			t.Errorf("2 sources at --idle-checks-per-second 8: source %s checks every %v while quiet, want %v", src, got, 2*time.Second/8)
		}
	}
}
