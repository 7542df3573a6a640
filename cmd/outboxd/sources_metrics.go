package main

import (
	"maps"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/outboxd/outboxd/internal/app"
)

// sourcePoolCollector exports, per served source, its pool's connections
// and the trimmer's verdicts on it (see poolTrimmer), and the pause its
// engine's discovery loop takes between checks while the source is quiet
// (internal/app spreads --idle-checks-per-second over the sources). The
// figures are read at scrape time, from the sources served then: a source
// a reload adds appears with its pool, one it removes disappears. Every
// series carries the source's name, default's too, whether or not the
// engines' own metrics do (they carry it only with several sources or a
// source: list): these exist to compare sources.
type sourcePoolCollector struct {
	mu    sync.Mutex
	pools map[string]*sourcePool
	// rep, once built, has the engines whose quiet interval is exported.
	rep atomic.Pointer[app.Replica]

	conns, opened, acquires, checks, quietInterval *prometheus.Desc
}

// newSourcePoolCollector registers the collector on reg; serve adds each
// source's pool as it opens it (add) and sets the replica once built. The
// collector is also where a pool gets its engine (sourcePool.followEngine):
// it is the one list of the pools served, at startup and after reloads.
func newSourcePoolCollector(reg prometheus.Registerer) *sourcePoolCollector {
	c := &sourcePoolCollector{
		pools: map[string]*sourcePool{},
		conns: prometheus.NewDesc("outboxd_source_pool_connections",
			"Connections of the source's pool by state: total (idle, acquired, and any being opened), idle, acquired. The source's LISTEN connection is not of the pool.",
			[]string{"source", "state"}, nil),
		opened: prometheus.NewDesc("outboxd_source_pool_connections_opened_total",
			"Connections the source's pool opened (each a PostgreSQL backend start). Rising while the source is busy or has events means its pool is trimmed and reopens connections.",
			[]string{"source"}, nil),
		acquires: prometheus.NewDesc("outboxd_source_pool_acquires_total",
			"Connections taken from the source's pool (one per database call, about): under 100 a second, and no event found for 10s, the pool is quiet and trimmed.",
			[]string{"source"}, nil),
		checks: prometheus.NewDesc("outboxd_source_pool_trim_checks_total",
			"Looks of the pool trimmer (4 a second) at the source's pool, by outcome: trimmed (quiet: idle connections but the oldest closed), busy (100 or more calls over the last second), in_use (events found within the last 10s).",
			[]string{"source", "outcome"}, nil),
		quietInterval: prometheus.NewDesc("outboxd_discovery_quiet_check_interval_seconds",
			"Pause between the discovery checks of the source once it has found no event for 10s: the sources' share of --idle-checks-per-second (SOURCES/N seconds, 25ms at least).",
			[]string{"source"}, nil),
	}
	reg.MustRegister(c)
	return c
}

// add exports the pool of source name and, once the replica is set, has
// the trimmer follow its engine.
func (c *sourcePoolCollector) add(name string, p *sourcePool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.pools[name] = p
	if rep := c.rep.Load(); rep != nil {
		p.followEngine(rep, name)
	}
}

// remove stops exporting source name (removed by a reload).
func (c *sourcePoolCollector) remove(name string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.pools, name)
}

// setReplica gives the collector the engines once serve has built them,
// and has the trimmer follow each pool's engine.
func (c *sourcePoolCollector) setReplica(rep *app.Replica) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.rep.Store(rep)
	for name, p := range c.pools {
		p.followEngine(rep, name)
	}
}

func (c *sourcePoolCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.conns, c.opened, c.acquires, c.checks, c.quietInterval} {
		ch <- d
	}
}

func (c *sourcePoolCollector) Collect(ch chan<- prometheus.Metric) {
	c.mu.Lock()
	pools := maps.Clone(c.pools)
	c.mu.Unlock()
	rep := c.rep.Load()
	for _, name := range slices.Sorted(maps.Keys(pools)) {
		p := pools[name]
		st := p.Stat()
		for state, n := range map[string]int32{"total": st.TotalConns(), "idle": st.IdleConns(), "acquired": st.AcquiredConns()} {
			ch <- prometheus.MustNewConstMetric(c.conns, prometheus.GaugeValue, float64(n), name, state)
		}
		ch <- prometheus.MustNewConstMetric(c.opened, prometheus.CounterValue, float64(st.NewConnsCount()), name)
		ch <- prometheus.MustNewConstMetric(c.acquires, prometheus.CounterValue, float64(st.AcquireCount()), name)
		for o := range trimOutcomes {
			ch <- prometheus.MustNewConstMetric(c.checks, prometheus.CounterValue, float64(p.checks[o].Load()), name, o.String())
		}
		if rep == nil {
			continue
		}
		if e := rep.Source(name); e != nil {
			ch <- prometheus.MustNewConstMetric(c.quietInterval, prometheus.GaugeValue, e.DiscoveryQuietInterval().Seconds(), name)
		}
	}
}
