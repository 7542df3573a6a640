package bench

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sort"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxd/outboxd/relay"
)

// The sources workloads put many source databases behind one server
// (outboxd serve --source NAME=URL, repeated), as docs/benchmark.md
// describes: sources for fairness between a busy source and quiet ones,
// idle-sources for what a source costs while nothing happens.
const (
	// WorkloadSources: Config.Sources source databases on one server, one
	// heavy (P producers at full speed, K relays) and the rest light (one
	// open-loop producer at Config.SourcesLightRate each, one relay each).
	// The light sources run alone first, then with the heavy one.
	WorkloadSources = "sources"
	// WorkloadIdleSources: Config.IdleSources source databases on one
	// server and nothing produced, first with no relay, then with one idle
	// relay per source: the connections each source holds and the CPU the
	// server and PostgreSQL spend.
	WorkloadIdleSources = "idle-sources"
)

// Source names of the sources workloads: heavySource and light01, light02,
// ...; idle01, idle02, ... in idle-sources.
const (
	heavySource      = "heavy"
	lightSourceName  = "light"
	idleSourceName   = "idle"
	lightAggregates  = 100
	lightProducerCap = 2 // connections of a light source's producer pool
)

// SourcesFigures are the sources workload's figures beyond the Result's
// own (whose Throughput is every source's deliveries in the mixed window,
// and whose CommitToSink is the light sources' there).
type SourcesFigures struct {
	Sources        int     `json:"sources"`
	LightRate      float64 `json:"light_rate_per_source"`
	HeavyProducers int     `json:"heavy_producers"`
	HeavyRelays    int     `json:"heavy_relays"`
	// Solo is the window in which only the light sources produce (the
	// heavy source's relays are subscribed, idle); Mixed the one in which
	// the heavy source's producers run at full speed as well.
	SoloWindowS  float64 `json:"solo_window_s"`
	MixedWindowS float64 `json:"mixed_window_s"`
	// Delivered per second in each window: the light sources together,
	// and the heavy one.
	LightSoloPerS  float64 `json:"light_solo_per_s"`
	LightMixedPerS float64 `json:"light_mixed_per_s"`
	HeavyMixedPerS float64 `json:"heavy_mixed_per_s"`
	// Commit→sink of the light sources' events (all of them in one
	// distribution) alone and with the heavy neighbour, and of the heavy
	// source's.
	LightSolo  *Percentiles `json:"light_solo_commit_to_sink"`
	LightMixed *Percentiles `json:"light_mixed_commit_to_sink"`
	HeavyMixed *Percentiles `json:"heavy_mixed_commit_to_sink"`
	// WorstLightMixedP99Ms is the highest p99 of one light source alone
	// in the mixed window, and WorstLightSource names it.
	WorstLightMixedP99Ms float64 `json:"worst_light_mixed_p99_ms"`
	WorstLightSource     string  `json:"worst_light_source"`
	// Solo and Mixed are each window's CPU (% of a core) and transactions.
	Solo  SourcesWindowCost `json:"solo"`
	Mixed SourcesWindowCost `json:"mixed"`
}

// SourcesWindowCost is what one window of the sources workload cost: the
// server's and PostgreSQL's CPU, and the transactions of one light source
// and of the heavy one per second (pg_stat_database, which lags up to a
// second). An empty discovery round ends in ROLLBACK, so rollbacks count
// them.
type SourcesWindowCost struct {
	ServerCorePct      *float64 `json:"server_core_pct,omitempty"`
	PostgresCorePct    *float64 `json:"postgres_core_pct,omitempty"`
	LightCommitsPerS   float64  `json:"light_commits_per_source_per_s"`
	LightRollbacksPerS float64  `json:"light_rollbacks_per_source_per_s"`
	HeavyCommitsPerS   float64  `json:"heavy_commits_per_s"`
	HeavyRollbacksPerS float64  `json:"heavy_rollbacks_per_s"`
}

// xactCounts sums xact_commit and xact_rollback over the named databases.
func xactCounts(ctx context.Context, conn *pgx.Conn, names []string) (commits, rollbacks int64, err error) {
	err = conn.QueryRow(ctx, `SELECT coalesce(sum(xact_commit), 0)::bigint, coalesce(sum(xact_rollback), 0)::bigint
		FROM pg_stat_database WHERE datname = ANY($1)`, names).Scan(&commits, &rollbacks)
	if err != nil {
		err = fmt.Errorf("bench: read pg_stat_database: %w", err)
	}
	return commits, rollbacks, err
}

// costWindow measures one window of the sources workload: call it when
// the window opens and call what it returns when it closes.
func costWindow(ctx context.Context, adminURL string, srv serverHandle, heavy *sourceDB, lights []*sourceDB) (func() (SourcesWindowCost, measurement, error), error) {
	conn, err := pgx.Connect(ctx, adminURL)
	if err != nil {
		return nil, fmt.Errorf("bench: connect for measurements: %w", err)
	}
	lightNames, heavyNames := sourceDBNames(lights), []string{heavy.env.dbName}
	pr, err := openWindowOver(ctx, adminURL, append(sourceDBNames(lights), heavyNames...), srv)
	if err != nil {
		conn.Close(context.WithoutCancel(ctx))
		return nil, err
	}
	lc, lr, err1 := xactCounts(ctx, conn, lightNames)
	hc, hr, err2 := xactCounts(ctx, conn, heavyNames)
	if err := errors.Join(err1, err2); err != nil {
		conn.Close(context.WithoutCancel(ctx))
		_, _ = pr.close(ctx)
		return nil, err
	}
	return func() (SourcesWindowCost, measurement, error) {
		defer conn.Close(context.WithoutCancel(ctx))
		var c SourcesWindowCost
		m, err := pr.close(ctx)
		if err != nil {
			return c, m, err
		}
		lc2, lr2, err1 := xactCounts(ctx, conn, lightNames)
		hc2, hr2, err2 := xactCounts(ctx, conn, heavyNames)
		if err := errors.Join(err1, err2); err != nil {
			return c, m, err
		}
		secs := m.elapsed.Seconds()
		if m.serverOK {
			c.ServerCorePct = ptr(100 * m.serverCPU.Seconds() / secs)
		}
		if m.postgresOK {
			c.PostgresCorePct = ptr(100 * m.postgresCPU.Seconds() / secs)
		}
		n := float64(max(len(lights), 1))
		c.LightCommitsPerS, c.LightRollbacksPerS = float64(lc2-lc)/secs/n, float64(lr2-lr)/secs/n
		c.HeavyCommitsPerS, c.HeavyRollbacksPerS = float64(hc2-hc)/secs, float64(hr2-hr)/secs
		return c, m, nil
	}, nil
}

// IdleSourcesFigures are the idle-sources workload's two windows.
type IdleSourcesFigures struct {
	Sources   int               `json:"sources"`
	NoRelays  *IdleSourcesPhase `json:"no_relays"`
	OneRelay  *IdleSourcesPhase `json:"one_relay_each"`
	MaxDBConn int               `json:"max_db_conns"`
}

// IdleSourcesPhase is one idle window over every source database.
type IdleSourcesPhase struct {
	Relays          int      `json:"relays"`
	WindowS         float64  `json:"window_s"`
	ServerCorePct   *float64 `json:"server_core_pct,omitempty"`
	PostgresCorePct *float64 `json:"postgres_core_pct,omitempty"`
	// CommitsPerSourcePerS counts the source databases' commits
	// (pg_stat_database, which lags up to a second) per source and second.
	CommitsPerSourcePerS float64 `json:"commits_per_source_per_s"`
	// RollbacksPerSourcePerS counts their rollbacks the same way: an
	// empty discovery round ends in ROLLBACK.
	RollbacksPerSourcePerS float64 `json:"rollbacks_per_source_per_s"`
	// Connections per source database (pg_stat_activity grouped by
	// datname) at the window's end: the most and the mean, and all.
	ConnsPerSourceMax  int     `json:"conns_per_source_max"`
	ConnsPerSourceMean float64 `json:"conns_per_source_mean"`
	ConnsTotal         int     `json:"conns_total"`
	// Sessions groups those connections by state and by the last
	// statement each ran: what the server keeps them for.
	Sessions []SessionGroup `json:"sessions"`
}

// SessionGroup is a set of the source databases' backends that ran the
// same last statement and are in the same state.
type SessionGroup struct {
	State string `json:"state"`
	Query string `json:"query"`
	Count int    `json:"count"`
}

// sourceDB is one source database of a sources workload.
type sourceDB struct {
	name string // the source's name on the server
	env  *armEnv
}

// sourceSink hands each delivery to the counting sink of the source the
// event names (relay.Event.Source), so that every source keeps its own
// ledger: aggregate keys repeat across sources.
type sourceSink struct {
	bySource map[string]*countingSink
	strays   atomic.Int64 // deliveries of a source nobody produced to
	// fault, when set, is the tests' broken broker (Config.sinkFault).
	fault func(relay.Event) sinkFault
}

// sinkFault is what a broken broker does with one delivery: the tests
// check that the sources workload's account catches it.
type sinkFault int

const (
	sinkOK        sinkFault = iota
	sinkDrop                // accept the event and lose it
	sinkDuplicate           // receive it twice
)

func (s *sourceSink) Publish(ctx context.Context, ev relay.Event) error {
	cs, ok := s.bySource[ev.Source]
	if !ok {
		s.strays.Add(1)
		return nil // a retry would not make it better
	}
	if s.fault != nil {
		switch s.fault(ev) {
		case sinkDrop:
			return nil
		case sinkDuplicate:
			if err := cs.Publish(ctx, ev); err != nil {
				return err
			}
		}
	}
	return cs.Publish(ctx, ev)
}

// err reports malformed deliveries of any source and deliveries naming a
// source the run has no database for.
func (s *sourceSink) err() error {
	var errs []error
	if n := s.strays.Load(); n > 0 {
		errs = append(errs, fmt.Errorf("bench: %d deliveries named a source the run did not create", n))
	}
	for name, cs := range s.bySource {
		if err := cs.err(); err != nil {
			errs = append(errs, fmt.Errorf("source %s: %w", name, err))
		}
	}
	return errors.Join(errs...)
}

// createSources creates n source databases named prefix01, prefix02, ...
// (as scratch databases of the run, dropped by the returned function),
// each with a pool of at most poolConns connections and a ledger of
// aggregates aggregates and producers producers.
func createSources(ctx context.Context, cfg *Config, sc *scratch, names []string, aggregates func(i int) int, producers func(i int) int, poolConns func(i int) int32, sinkLatency time.Duration, next relay.Publisher) (srcs []*sourceDB, sink *sourceSink, drop func() error, err error) {
	sink = &sourceSink{bySource: map[string]*countingSink{}, fault: cfg.sinkFault}
	var dbNames []string
	drop = func() error {
		var errs []error
		for _, s := range srcs {
			s.env.pool.Close()
		}
		for _, name := range dbNames {
			errs = append(errs, sc.drop(ctx, name))
		}
		return errors.Join(errs...)
	}
	defer func() {
		if err != nil {
			err = errors.Join(err, drop())
		}
	}()
	for i, name := range names {
		dbName, dbURL, err := sc.clone(ctx, "src_"+name)
		if err != nil {
			return nil, nil, nil, err
		}
		dbNames = append(dbNames, dbName)
		poolCfg, err := pgxpool.ParseConfig(dbURL)
		if err != nil {
			return nil, nil, nil, err
		}
		poolCfg.MaxConns = poolConns(i)
		pool, err := pgxpool.NewWithConfig(ctx, poolCfg)
		if err != nil {
			return nil, nil, nil, err
		}
		srcCfg := *cfg
		srcCfg.Producers = producers(i)
		ledger := NewLedger(aggregates(i), srcCfg.Producers)
		cs := &countingSink{latency: sinkLatency, ledger: ledger, next: next}
		sink.bySource[name] = cs
		srcs = append(srcs, &sourceDB{name: name, env: &armEnv{
			cfg: &srcCfg, dbName: dbName, dbURL: dbURL, pool: pool, ledger: ledger, sink: cs,
			aggregates: aggregates(i), relays: 1, maxInFlight: cfg.MaxInFlight,
			log: cfg.Logger.With("source", name),
		}})
	}
	return srcs, sink, drop, nil
}

// seedSources commits one event (aggregate 0, written by no producer) to
// each source, so that its stream exists before relays subscribe: a
// Subscribe to a stream that never had an event is refused, and the relay
// would retry on its back-off instead of waiting on the server.
func seedSources(ctx context.Context, srcs []*sourceDB) error {
	a := &outboxdArm{}
	for _, s := range srcs {
		conn, err := s.env.pool.Acquire(ctx)
		if err != nil {
			return err
		}
		rev, err := a.produce(ctx, conn, 0, appendPayload(nil, 0, -1, 0, time.Now().UnixNano()))
		conn.Release()
		if err != nil {
			return fmt.Errorf("bench: seed source %s: %w", s.name, err)
		}
		if err := s.env.ledger.Commit(0, rev, time.Now().UnixNano()); err != nil {
			return err
		}
	}
	return nil
}

// waitSeeded waits until every source's seed (all it has committed so
// far) reached the sink.
func waitSeeded(ctx context.Context, srcs []*sourceDB, timeout time.Duration) error {
	for _, s := range srcs {
		if !waitDelivered(ctx, s.env.ledger, timeout, false) {
			return fmt.Errorf("bench: source %s: its first event did not reach the sink within %v", s.name, timeout)
		}
	}
	return nil
}

// sourceStreams is what a relay of source subscribes to: every stream of
// the source ("source/*"), as the steady arm's relays take every stream,
// or with Config.SourcesNamedStream the benchmark's stream by name.
func sourceStreams(cfg *Config, source string) []string {
	if cfg.SourcesNamedStream {
		return []string{source + "/" + benchStream}
	}
	return []string{source + "/*"}
}

// sourceFlags are the serve flags naming every source.
func sourceFlags(cfg *Config, srcs []*sourceDB) []string {
	flags := append([]string(nil), cfg.ServeFlags...)
	for _, s := range srcs {
		flags = append(flags, "--source="+s.name+"="+s.env.dbURL)
	}
	return flags
}

func sourceDBNames(srcs []*sourceDB) []string {
	names := make([]string, len(srcs))
	for i, s := range srcs {
		names[i] = s.env.dbName
	}
	return names
}

// sourceNames are prefix01, prefix02, ... prefixNN.
func sourceNames(prefix string, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("%s%02d", prefix, i+1)
	}
	return out
}

// runSources runs the sources workload: Config.Sources databases behind
// one server, the first heavy, the rest light; a window with the light
// sources alone, then one with the heavy source's producers at full speed
// too.
func runSources(ctx context.Context, cfg *Config, sc *scratch, spec armSpec, _ *Report, broker relay.Publisher) (res *Result, err error) {
	started := time.Now()
	names := append([]string{heavySource}, sourceNames(lightSourceName, cfg.Sources-1)...)
	heavyOr := func(heavy, light int) func(int) int {
		return func(i int) int {
			if i == 0 {
				return heavy
			}
			return light
		}
	}
	fmt.Fprintf(cfg.Progress, "        creating %d source databases...\n", len(names))
	srcs, sink, drop, err := createSources(ctx, cfg, sc, names,
		heavyOr(cfg.Aggregates, lightAggregates), heavyOr(cfg.Producers, 1),
		func(i int) int32 { return int32(heavyOr(cfg.Producers+runtime.NumCPU()+1, lightProducerCap)(i)) },
		spec.sink, broker)
	if err != nil {
		return nil, err
	}
	defer func() { err = errors.Join(err, drop()) }()
	heavy, lights := srcs[0], srcs[1:]

	res = &Result{
		Workload: spec.workload, Arm: ArmOutboxd, SinkLatencyMs: ptr(ms(spec.sink)), Producers: cfg.Producers + len(lights),
		Relays: cfg.Relays + len(lights), MaxInFlight: cfg.MaxInFlight, Aggregates: cfg.Aggregates,
		TargetRate: cfg.SourcesLightRate * float64(len(lights)),
	}
	fig := &SourcesFigures{Sources: len(srcs), LightRate: cfg.SourcesLightRate, HeavyProducers: cfg.Producers, HeavyRelays: cfg.Relays}
	res.Sources = fig

	if err := seedSources(ctx, srcs); err != nil {
		return nil, err
	}
	srv, err := startChildServer(ctx, cfg.ServerBinary, sourceFlags(cfg, srcs), "", logWriter{cfg.Logger.With("arm", "sources")})
	if err != nil {
		return nil, err
	}
	var fleet *relayFleet
	stopAll := func() error {
		var errs []error
		if fleet != nil {
			errs = append(errs, fleet.stop())
			fleet = nil
		}
		if srv != nil {
			errs = append(errs, srv.died(), srv.stop(ctx))
			srv = nil
		}
		return errors.Join(errs...)
	}
	defer func() { err = errors.Join(err, stopAll()) }()

	// As real relays would run: one Subscribe per source, K for the heavy
	// one as in steady, one for each light one.
	fleet = newRelayFleet(ctx)
	if err := fleet.add(srv.addr(), cfg.Relays, cfg.MaxInFlight, 0, sourceStreams(cfg, heavySource), "bench-"+heavySource, sink, heavy.env.log); err != nil {
		return nil, err
	}
	for _, l := range lights {
		if err := fleet.add(srv.addr(), 1, cfg.MaxInFlight, 0, sourceStreams(cfg, l.name), "bench-"+l.name, sink, l.env.log); err != nil {
			return nil, err
		}
	}

	if err := waitSeeded(ctx, srcs, serverStartTimeout); err != nil {
		return nil, err
	}
	a := &outboxdArm{}
	var unused atomic.Int64
	delivered := func(of []*sourceDB) int64 {
		var n int64
		for _, s := range of {
			n += s.env.ledger.Delivered()
		}
		return n
	}
	committed := func(of []*sourceDB) int64 {
		var n int64
		for _, s := range of {
			n += s.env.ledger.Committed()
		}
		return n
	}
	// Light producers: open loop, each at the light rate on its own
	// schedule, started a little apart so that they do not all commit in
	// the same millisecond.
	var lightProds []*producers
	stopLight := func() error {
		var errs []error
		for _, p := range lightProds {
			errs = append(errs, p.stop())
		}
		lightProds = nil
		return errors.Join(errs...)
	}
	defer func() { err = errors.Join(err, stopLight()) }()
	t0 := time.Now()
	for i, l := range lights {
		offset := time.Duration(float64(i) / float64(len(lights)) / cfg.SourcesLightRate * float64(time.Second))
		schedule := func(_ int, n int64) time.Time {
			return t0.Add(offset + time.Duration(float64(n-1)/cfg.SourcesLightRate*float64(time.Second)))
		}
		lightProds = append(lightProds, startProducers(ctx, l.env, a, schedule, &unused))
	}
	sleepAll := func(d time.Duration, ps ...*producers) error {
		if err := sleepCtx(ctx, d); err != nil {
			return err
		}
		for _, p := range ps {
			select {
			case <-p.stopCh: // a producer failed
				return p.stop()
			default:
			}
		}
		return nil
	}

	// The light sources alone.
	if err := sleepAll(cfg.Warmup, lightProds...); err != nil {
		return nil, err
	}
	closeSolo, err := costWindow(ctx, cfg.DatabaseURL, srv, heavy, lights)
	if err != nil {
		return nil, err
	}
	fromSolo, soloLight := time.Now().UnixNano(), delivered(lights)
	sleepErr := sleepAll(cfg.Duration, lightProds...)
	toSolo := time.Now().UnixNano()
	if fig.Solo, _, err = closeSolo(); errors.Join(sleepErr, err) != nil {
		return nil, errors.Join(sleepErr, err)
	}
	fig.SoloWindowS = time.Duration(toSolo - fromSolo).Seconds()
	fig.LightSoloPerS = perSecond(delivered(lights)-soloLight, time.Duration(toSolo-fromSolo))

	// With the heavy neighbour at full speed.
	heavyProds := startProducers(ctx, heavy.env, a, nil, &unused)
	defer heavyProds.stop()
	all := append(lightProds[:len(lightProds):len(lightProds)], heavyProds)
	if err := sleepAll(cfg.Warmup, all...); err != nil {
		return nil, err
	}
	closeMixed, err := costWindow(ctx, cfg.DatabaseURL, srv, heavy, lights)
	if err != nil {
		return nil, err
	}
	fromMixed := time.Now().UnixNano()
	fromAll, fromLight, fromHeavy, fromCommitted := delivered(srcs), delivered(lights), delivered(srcs[:1]), committed(srcs)
	sleepErr = sleepAll(cfg.Duration, all...)
	toMixed := time.Now().UnixNano()
	toAll, toLight, toHeavy, toCommitted := delivered(srcs), delivered(lights), delivered(srcs[:1]), committed(srcs)
	var m measurement
	fig.Mixed, m, err = closeMixed()
	if err = errors.Join(sleepErr, err, heavyProds.stop(), stopLight()); err != nil {
		return nil, err
	}
	window := time.Duration(toMixed - fromMixed)
	res.WindowS, fig.MixedWindowS = window.Seconds(), window.Seconds()
	res.Throughput = perSecond(toAll-fromAll, window)
	res.ProducedPerS = perSecond(toCommitted-fromCommitted, window)
	fig.LightMixedPerS = perSecond(toLight-fromLight, window)
	fig.HeavyMixedPerS = perSecond(toHeavy-fromHeavy, window)

	for _, s := range srcs {
		settle(ctx, s.env.ledger, max(5*time.Second, cfg.Duration))
	}
	endNs := time.Now().UnixNano()
	rss := serverRSS(srv)
	if err := stopAll(); err != nil {
		return nil, err
	}
	if err := sink.err(); err != nil {
		return nil, err
	}
	var total Counts
	for _, s := range srcs {
		if err := readBack(ctx, s.env, a); err != nil {
			return nil, fmt.Errorf("source %s: %w", s.name, err)
		}
		c := s.env.ledger.Counts()
		total.add(c)
		if c.Failed() {
			res.Notes = append(res.Notes, fmt.Sprintf("source %s: lost %d, reordered %d, unexpected %d", s.name, c.Lost, c.Reordered, c.Unexpected))
		}
	}
	res.Counts = &total

	var soloSink, mixedSink []time.Duration
	var soloCensored, mixedCensored int
	for _, l := range lights {
		s, _, cs, _ := l.env.ledger.Latencies(fromSolo, toSolo, endNs)
		soloSink, soloCensored = append(soloSink, s...), soloCensored+cs
		mx, _, cm, _ := l.env.ledger.Latencies(fromMixed, toMixed, endNs)
		mixedSink, mixedCensored = append(mixedSink, mx...), mixedCensored+cm
		if p := Summarise(mx, cm); p.N > 0 && p.P99Ms > fig.WorstLightMixedP99Ms {
			fig.WorstLightMixedP99Ms, fig.WorstLightSource = p.P99Ms, l.name
		}
	}
	solo, mixed := Summarise(soloSink, soloCensored), Summarise(mixedSink, mixedCensored)
	fig.LightSolo, fig.LightMixed = &solo, &mixed
	hs, _, hc, _ := heavy.env.ledger.Latencies(fromMixed, toMixed, endNs)
	h := Summarise(hs, hc)
	fig.HeavyMixed = &h
	res.CommitToSink = &mixed
	res.fillCosts(m, toAll-fromAll, cfg, rss, spec.sink)
	res.ArmElapsedS = time.Since(started).Seconds()
	return res, nil
}

// add sums another account into c.
func (c *Counts) add(o Counts) {
	c.Committed += o.Committed
	c.Delivered += o.Delivered
	c.Duplicates += o.Duplicates
	c.Reordered += o.Reordered
	c.Lost += o.Lost
	c.Backlog += o.Backlog
	c.Unacked += o.Unacked
	c.Unexpected += o.Unexpected
}

// runIdleSources runs the idle-sources workload: Config.IdleSources
// databases behind one server and nothing produced, a window with no relay
// and one with one relay subscribed to each source.
func runIdleSources(ctx context.Context, cfg *Config, sc *scratch, spec armSpec, _ *Report, broker relay.Publisher) (res *Result, err error) {
	started := time.Now()
	names := sourceNames(idleSourceName, cfg.IdleSources)
	one := func(int) int { return 1 }
	fmt.Fprintf(cfg.Progress, "        creating %d source databases...\n", len(names))
	srcs, sink, drop, err := createSources(ctx, cfg, sc, names, one, one, func(int) int32 { return 1 }, spec.sink, broker)
	if err != nil {
		return nil, err
	}
	defer func() { err = errors.Join(err, drop()) }()
	res = &Result{Workload: spec.workload, Arm: ArmOutboxd, SinkLatencyMs: ptr(ms(spec.sink)), Relays: len(srcs), MaxInFlight: cfg.MaxInFlight}
	fig := &IdleSourcesFigures{Sources: len(srcs), MaxDBConn: serveMaxDBConns(cfg.ServeFlags)}
	res.IdleSources = fig

	// The bench's own pools hold no connection while the windows are
	// open: what pg_stat_activity shows is the server's.
	if err := seedSources(ctx, srcs); err != nil {
		return nil, err
	}
	for _, s := range srcs {
		s.env.pool.Reset()
	}
	srv, err := startChildServer(ctx, cfg.ServerBinary, sourceFlags(cfg, srcs), "", logWriter{cfg.Logger.With("arm", "idle-sources")})
	if err != nil {
		return nil, err
	}
	var fleet *relayFleet
	stopAll := func() error {
		var errs []error
		if fleet != nil {
			errs = append(errs, fleet.stop())
			fleet = nil
		}
		if srv != nil {
			errs = append(errs, srv.died(), srv.stop(ctx))
			srv = nil
		}
		return errors.Join(errs...)
	}
	defer func() { err = errors.Join(err, stopAll()) }()

	dbNames := sourceDBNames(srcs)
	window := func(relays int) (*IdleSourcesPhase, error) {
		if err := sleepCtx(ctx, max(cfg.Warmup, cfg.IdleSourcesSettle)); err != nil {
			return nil, err
		}
		conn, err := pgx.Connect(ctx, cfg.DatabaseURL)
		if err != nil {
			return nil, fmt.Errorf("bench: connect for measurements: %w", err)
		}
		defer conn.Close(context.WithoutCancel(ctx))
		_, rollbacks, err := xactCounts(ctx, conn, dbNames)
		if err != nil {
			return nil, err
		}
		pr, err := openWindowOver(ctx, cfg.DatabaseURL, dbNames, srv)
		if err != nil {
			return nil, err
		}
		sleepErr := sleepCtx(ctx, cfg.Duration)
		m, err := pr.close(ctx)
		_, rollbacks2, xerr := xactCounts(ctx, conn, dbNames)
		if err := errors.Join(sleepErr, err, xerr, srv.died()); err != nil {
			return nil, err
		}
		ph := &IdleSourcesPhase{Relays: relays, WindowS: m.elapsed.Seconds()}
		ph.RollbacksPerSourcePerS = float64(rollbacks2-rollbacks) / m.elapsed.Seconds() / float64(len(srcs))
		if m.serverOK {
			ph.ServerCorePct = ptr(100 * m.serverCPU.Seconds() / m.elapsed.Seconds())
		}
		if m.postgresOK {
			ph.PostgresCorePct = ptr(100 * m.postgresCPU.Seconds() / m.elapsed.Seconds())
		}
		ph.CommitsPerSourcePerS = float64(m.commits) / m.elapsed.Seconds() / float64(len(srcs))
		if err := readSourceSessions(ctx, cfg.DatabaseURL, dbNames, ph); err != nil {
			return nil, err
		}
		return ph, nil
	}
	// Every source's stream has an event, delivered before the windows:
	// the relays wait on the server, not on a refused Subscribe, and
	// nothing is pending. One relay each first, then none.
	fleet = newRelayFleet(ctx)
	for _, s := range srcs {
		if err := fleet.add(srv.addr(), 1, cfg.MaxInFlight, 0, sourceStreams(cfg, s.name), "bench-"+s.name, sink, s.env.log); err != nil {
			return nil, err
		}
	}
	if err := waitSeeded(ctx, srcs, serverStartTimeout); err != nil {
		return nil, err
	}
	if fig.OneRelay, err = window(len(srcs)); err != nil {
		return nil, err
	}
	if err := fleet.stop(); err != nil {
		return nil, err
	}
	fleet = nil
	if fig.NoRelays, err = window(0); err != nil {
		return nil, err
	}
	res.WindowS = fig.OneRelay.WindowS
	if err := stopAll(); err != nil {
		return nil, err
	}
	if err := sink.err(); err != nil {
		return nil, err
	}
	var total Counts
	for _, s := range srcs {
		total.add(s.env.ledger.Counts())
	}
	if total.Delivered != int64(len(srcs)) || total.Unexpected > 0 || total.Duplicates > 0 {
		return nil, fmt.Errorf("bench: idle sources delivered %d events, %d duplicates, %d unexpected: want each source's one seed once", total.Delivered, total.Duplicates, total.Unexpected)
	}
	res.ArmElapsedS = time.Since(started).Seconds()
	return res, nil
}

// readSourceSessions counts the source databases' backends, per database
// and grouped by state and last statement.
func readSourceSessions(ctx context.Context, adminURL string, dbNames []string, ph *IdleSourcesPhase) error {
	conn, err := pgx.Connect(ctx, adminURL)
	if err != nil {
		return fmt.Errorf("bench: connect for measurements: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	perDB := make(map[string]int, len(dbNames))
	rows, err := conn.Query(ctx, `SELECT datname, coalesce(state, ''), left(regexp_replace(query, '\s+', ' ', 'g'), 120)
		FROM pg_stat_activity WHERE datname = ANY($1) AND backend_type = 'client backend'`, dbNames)
	if err != nil {
		return fmt.Errorf("bench: read the sources' sessions: %w", err)
	}
	groups := map[SessionGroup]int{}
	for rows.Next() {
		var db, state, query string
		if err := rows.Scan(&db, &state, &query); err != nil {
			rows.Close()
			return err
		}
		perDB[db]++
		groups[SessionGroup{State: state, Query: strings.TrimSpace(query)}]++
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("bench: read the sources' sessions: %w", err)
	}
	for _, name := range dbNames {
		n := perDB[name]
		ph.ConnsTotal += n
		ph.ConnsPerSourceMax = max(ph.ConnsPerSourceMax, n)
	}
	ph.ConnsPerSourceMean = float64(ph.ConnsTotal) / float64(max(len(dbNames), 1))
	for g, n := range groups {
		g.Count = n
		ph.Sessions = append(ph.Sessions, g)
	}
	sort.Slice(ph.Sessions, func(i, j int) bool {
		if ph.Sessions[i].Count != ph.Sessions[j].Count {
			return ph.Sessions[i].Count > ph.Sessions[j].Count
		}
		return ph.Sessions[i].Query < ph.Sessions[j].Query
	})
	return nil
}

// serveMaxDBConns is the pool size per source the server runs with: serve's
// default unless a --serve-flag sets --max-db-conns.
func serveMaxDBConns(flags []string) int {
	n := 16 // outboxd serve --max-db-conns default
	for _, f := range flags {
		if v, ok := strings.CutPrefix(f, "--max-db-conns="); ok {
			_, _ = fmt.Sscan(v, &n)
		}
	}
	return n
}
