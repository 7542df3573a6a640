package bench

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxd/outboxd/relay"
	"github.com/outboxd/outboxd/relay/sink"
)

const (
	// lateStart is how far behind its schedule an open-loop producer may
	// start an event before the event counts as late.
	lateStart = time.Millisecond
	// drainInFlight is the credit the drain workload keeps outstanding across
	// all relays: the memory goal of docs/benchmark.md is at 1M pending and
	// 1,000 in flight.
	drainInFlight = 1000
	// stallTimeout ends a settle or drain that has made no progress for this
	// long.
	stallTimeout = 10 * time.Second
)

// ErrIncorrect is wrapped by the error Run returns when an arm lost,
// reordered or invented events: the figures are then not worth reading.
var ErrIncorrect = errors.New("bench: delivery was incorrect")

// armSpec is one arm run under one workload.
type armSpec struct {
	workload string
	arm      string
	sink     time.Duration
	backlog  int    // drain: events pending before delivery starts
	holder   string // held-xmin: who holds the transaction id
	window   int    // hot, hot-drain: outboxd relays' max_in_flight_per_aggregate (0: 1)
}

// plan lists the arms to run, in order. The ceilings do not deliver, so they
// run once, in steady. The naive poller drains only the smallest backlog,
// and in the quick set runs in steady only: it is slow, and steady holds the
// goal that involves it. The peers run in steady (the quick set: at the
// first sink latency only) and latency, not in drain or hot. The latency
// and held-xmin workloads compare with outboxd's steady run, so they add
// it when steady is not selected. The producer workload runs its three
// producer paths whatever Arms says.
func plan(cfg *Config) []armSpec {
	var out []armSpec
	add := func(workload, arm string, sink time.Duration, backlog int) {
		if !cfg.uses(arm) || (cfg.Quick && arm == ArmNaivePoller && workload != WorkloadSteady) {
			return
		}
		out = append(out, armSpec{workload: workload, arm: arm, sink: sink, backlog: backlog})
	}
	first := cfg.SinkLatencies[0]
	switch {
	case cfg.runs(WorkloadSteady):
		add(WorkloadSteady, ArmCeilingInsert, 0, 0)
		add(WorkloadSteady, ArmCeilingInsertMark, 0, 0)
		for i, l := range cfg.SinkLatencies {
			add(WorkloadSteady, ArmNaivePoller, l, 0)
			add(WorkloadSteady, ArmOutboxd, l, 0)
			if i == 0 || !cfg.Quick {
				for _, peer := range PeerArms {
					add(WorkloadSteady, peer, l, 0)
				}
			}
		}
	case cfg.runs(WorkloadLatency) || cfg.runs(WorkloadHeldXmin) || cfg.runs(WorkloadSources) || cfg.runs(WorkloadReplicas):
		out = append(out, armSpec{workload: WorkloadSteady, arm: ArmOutboxd, sink: first})
	}
	if cfg.runs(WorkloadLatency) {
		add(WorkloadLatency, ArmNaivePoller, first, 0)
		add(WorkloadLatency, ArmOutboxd, first, 0)
		for _, peer := range PeerArms {
			add(WorkloadLatency, peer, first, 0)
		}
	}
	if cfg.runs(WorkloadDrain) {
		smallest := cfg.DrainSizes[0]
		for _, n := range cfg.DrainSizes {
			smallest = min(smallest, n)
		}
		for _, n := range cfg.DrainSizes {
			if n == smallest {
				add(WorkloadDrain, ArmNaivePoller, first, n)
			}
			add(WorkloadDrain, ArmOutboxd, first, n)
		}
	}
	// Hot aggregates run with one event in flight and pipelined (a window).
	pipelined := func(workload string, backlog int) {
		if cfg.uses(ArmOutboxd) {
			out = append(out, armSpec{workload: workload, arm: ArmOutboxd, sink: first, backlog: backlog, window: HotWindow})
		}
	}
	if cfg.runs(WorkloadHot) {
		add(WorkloadHot, ArmNaivePoller, first, 0)
		add(WorkloadHot, ArmOutboxd, first, 0)
		pipelined(WorkloadHot, 0)
	}
	if cfg.runs(WorkloadHotDrain) {
		add(WorkloadHotDrain, ArmOutboxd, first, hotDrainBacklog(cfg))
		pipelined(WorkloadHotDrain, hotDrainBacklog(cfg))
	}
	if cfg.runs(WorkloadProducer) {
		for _, arm := range []string{ArmCeilingInsert, ArmEmit, ArmInsertTrigger} {
			out = append(out, armSpec{workload: WorkloadProducer, arm: arm})
		}
	}
	if cfg.runs(WorkloadManyRelays) && cfg.uses(ArmOutboxd) {
		out = append(out, armSpec{workload: WorkloadManyRelays, arm: ArmOutboxd, sink: first})
	}
	// Replicas compares with outboxd's steady run at the same sink.
	if cfg.runs(WorkloadReplicas) && cfg.uses(ArmOutboxd) {
		out = append(out, armSpec{workload: WorkloadReplicas, arm: ArmOutboxd, sink: first})
	}
	if cfg.runs(WorkloadHeldXmin) {
		for _, holder := range []string{HolderOtherDB, HolderSameDBRR} {
			arms := []string{ArmOutboxd}
			if !cfg.Quick {
				arms = append(arms, ArmWatermill10ms, ArmRiver)
			}
			for _, arm := range arms {
				if cfg.uses(arm) {
					out = append(out, armSpec{workload: WorkloadHeldXmin, arm: arm, sink: first, holder: holder})
				}
			}
		}
	}
	// The sources workloads are outboxd's alone; sources compares with
	// the steady run above.
	for _, w := range []string{WorkloadSources, WorkloadIdleSources} {
		if cfg.runs(w) && cfg.uses(ArmOutboxd) {
			out = append(out, armSpec{workload: w, arm: ArmOutboxd, sink: first})
		}
	}
	return out
}

// Run runs the benchmark and returns its report. The error wraps
// ErrIncorrect when some arm lost or reordered events; the report is then
// complete and says which. Any other error means the run could not finish;
// the report then holds the arms that did. Every database the run created is
// dropped before Run returns.
func Run(ctx context.Context, cfg Config) (rep *Report, err error) {
	if err := cfg.setDefaults(); err != nil {
		return nil, err
	}
	rep = newReport(&cfg)
	rep.ScratchPrefix = newPrefix()
	sc, err := newScratch(ctx, cfg.DatabaseURL, rep.ScratchPrefix, cfg.ServerBinary, cfg.Logger)
	if err != nil {
		return rep, err
	}
	defer func() {
		if cerr := sc.close(ctx); cerr != nil {
			err = errors.Join(err, fmt.Errorf("bench: cleaning up: %w", cerr))
		}
	}()
	rep.Machine = describeMachine(ctx, &cfg)
	var broker relay.Sink
	if cfg.SinkURL != "" {
		if broker, err = sink.Open(ctx, cfg.SinkURL, sink.Options{Logger: cfg.Logger}); err != nil {
			return rep, fmt.Errorf("bench: --sink: %w", err)
		}
		defer func() { err = errors.Join(err, broker.Close()) }()
	}

	started := time.Now()
	// A run cut short still reports the arms that finished, checked.
	defer func() {
		rep.ElapsedS = time.Since(started).Seconds()
		rep.finish()
	}()
	specs := plan(&cfg)
	for i, spec := range specs {
		if err := ctx.Err(); err != nil {
			return rep, err
		}
		run := runArm
		switch spec.workload {
		case WorkloadSources:
			run = runSources
		case WorkloadIdleSources:
			run = runIdleSources
		}
		res, err := run(ctx, &cfg, sc, spec, rep, broker)
		if err != nil && ctx.Err() != nil {
			// Every goroutine of the arm reports the cancellation; one line
			// says it.
			return rep, fmt.Errorf("bench: interrupted during %s/%s: %w", spec.workload, spec.arm, ctx.Err())
		}
		if err != nil {
			return rep, fmt.Errorf("bench: %s/%s: %w", spec.workload, spec.arm, err)
		}
		rep.Results = append(rep.Results, res)
		fmt.Fprintf(cfg.Progress, "[%2d/%d] %s\n", i+1, len(specs), res.progressLine())
	}
	rep.finish()
	if len(rep.Failures) > 0 {
		return rep, fmt.Errorf("%w: %v", ErrIncorrect, rep.Failures)
	}
	return rep, nil
}

// runArm runs one arm in a fresh database and returns its figures.
func runArm(ctx context.Context, cfg *Config, sc *scratch, spec armSpec, rep *Report, broker relay.Publisher) (res *Result, err error) {
	started := time.Now()
	dbName, dbURL, err := sc.clone(ctx, spec.arm)
	if err != nil {
		return nil, err
	}
	defer func() { err = errors.Join(err, sc.drop(ctx, dbName)) }()

	aggregates, revisions := cfg.Aggregates, drainRevisions
	switch spec.workload {
	case WorkloadHot:
		aggregates = 1
	case WorkloadDrain:
		aggregates = spec.backlog / drainRevisions
	case WorkloadHotDrain:
		aggregates, revisions = 1, spec.backlog
	}
	maxInFlight := cfg.MaxInFlight
	if spec.workload == WorkloadDrain {
		maxInFlight = max(maxInFlight, (drainInFlight+cfg.Relays-1)/cfg.Relays)
	}
	maxInFlight = max(maxInFlight, spec.window)
	relays, replicas := cfg.Relays, 1
	switch spec.workload {
	case WorkloadManyRelays:
		relays = cfg.ManyRelays
	case WorkloadReplicas:
		replicas = cfg.Replicas
	}
	poolCfg, err := pgxpool.ParseConfig(dbURL)
	if err != nil {
		return nil, err
	}
	poolCfg.MaxConns = int32(cfg.Producers + runtime.NumCPU() + 1)
	pool, err := pgxpool.NewWithConfig(ctx, poolCfg)
	if err != nil {
		return nil, err
	}
	defer pool.Close()

	ledger := NewLedger(aggregates, cfg.Producers)
	env := &armEnv{
		cfg: cfg, dbName: dbName, dbURL: dbURL, pool: pool, ledger: ledger,
		sink:       &countingSink{latency: spec.sink, ledger: ledger, next: broker},
		aggregates: aggregates, revisions: revisions, relays: relays, replicas: replicas, maxInFlight: maxInFlight, window: spec.window,
		log: cfg.Logger.With("arm", spec.arm),
	}
	res = &Result{
		Workload: spec.workload, Arm: spec.arm, Producers: cfg.Producers, Relays: relays,
		MaxInFlight: maxInFlight, Aggregates: aggregates, Backlog: spec.backlog, Holder: spec.holder,
		Window: spec.window,
	}
	a := newArm(spec.arm, cfg)
	if a.delivers() {
		res.SinkLatencyMs = ptr(ms(spec.sink))
	} else {
		res.Relays, res.MaxInFlight = 0, 0
	}
	defer func() {
		if serr := a.stop(ctx); serr != nil {
			err = errors.Join(err, serr)
		}
	}()
	if err := a.prepare(ctx, env, spec.backlog); err != nil {
		return nil, err
	}
	var sizes map[string]int64
	if spec.workload != WorkloadDrain && spec.workload != WorkloadHotDrain {
		if sizes, err = tableSizes(ctx, pool, a.tables()); err != nil {
			return nil, err
		}
	}
	srv, err := a.startServer(ctx, env)
	if err != nil {
		return nil, err
	}
	if spec.workload == WorkloadDrain || spec.workload == WorkloadHotDrain {
		err = measureDrain(ctx, env, a, srv, res)
	} else {
		var rate float64
		switch spec.workload {
		case WorkloadLatency:
			if rate, err = latencyRate(rep, spec.sink, env.cfg.LatencyRate); err != nil {
				return nil, err
			}
		case WorkloadManyRelays:
			rate = env.cfg.ManyRelaysRate
		}
		err = measureProducers(ctx, env, a, srv, spec, rate, res)
	}
	if err != nil {
		return nil, err
	}
	if err := env.sink.err(); err != nil {
		return nil, err
	}
	if sizes != nil {
		// Every session of the arm ends first: a backend reports its dead
		// tuples to the statistics when it exits, or up to 10s after it
		// goes idle.
		pool.Close()
		if res.Tables, err = tableStats(ctx, dbURL, a.tables(), sizes); err != nil {
			return nil, err
		}
	}
	res.ArmElapsedS = time.Since(started).Seconds()
	return res, nil
}

// latencyRate is the latency workload's open-loop rate: fixed when given,
// else half of what outboxd (or, without it, the naive poller) delivered in
// steady at this sink latency earlier in the run.
func latencyRate(rep *Report, sink time.Duration, fixed float64) (float64, error) {
	if fixed > 0 {
		return fixed, nil
	}
	for _, arm := range []string{ArmOutboxd, ArmNaivePoller} {
		if r := rep.find(WorkloadSteady, arm, sink, 0); r != nil && r.Throughput > 0 {
			return r.Throughput / 2, nil
		}
	}
	return 0, errors.New("the latency workload needs a steady run of outboxd or the naive poller first")
}

// measureProducers runs steady, hot and latency: producers (and delivery)
// warm up, the window opens for cfg.Duration, producers stop, delivery gets
// a chance to catch up, and the database is read back.
func measureProducers(ctx context.Context, env *armEnv, a arm, srv serverHandle, spec armSpec, rate float64, res *Result) error {
	cfg := env.cfg
	if a.delivers() {
		if err := a.startDelivery(ctx, env); err != nil {
			return err
		}
	}
	if spec.workload == WorkloadManyRelays {
		if err := measureIdle(ctx, env, srv, res); err != nil {
			return err
		}
	}
	var ceilingDone atomic.Int64
	completed := env.ledger.Delivered
	committed := env.ledger.Committed
	if !a.delivers() {
		completed, committed = ceilingDone.Load, ceilingDone.Load
	}
	var schedule func(p int, n int64) time.Time
	if rate > 0 {
		res.TargetRate = rate
		t0, p := time.Now(), float64(cfg.Producers)
		schedule = func(producer int, n int64) time.Time {
			slot := float64(n-1)*p + float64(producer)
			return t0.Add(time.Duration(slot / rate * float64(time.Second)))
		}
	}
	if spec.holder != "" {
		h, err := holdXmin(ctx, env, spec.holder)
		if err != nil {
			return err
		}
		// Held until the database has been read back, past the window.
		defer h.release(ctx)
	}
	prods := startProducers(ctx, env, a, schedule, &ceilingDone)
	defer prods.stop()

	if err := prods.sleep(ctx, cfg.Warmup); err != nil {
		return err
	}
	// The window measures a steady state, which has not begun before the
	// first delivery: a short warm-up on a loaded machine (the tests' tiny
	// runs) could end before it, measure nothing and leave every ratio
	// with this arm undefined.
	if err := prods.waitFor(ctx, func() bool { return completed() > 0 }, firstDeliveryBound); err != nil {
		return err
	}
	pr, err := openWindow(ctx, cfg.DatabaseURL, env.dbName, srv)
	if err != nil {
		return err
	}
	fromNs, fromDone, fromCommitted := time.Now().UnixNano(), completed(), committed()
	sleepErr := prods.sleep(ctx, cfg.Duration)
	toNs, toDone, toCommitted := time.Now().UnixNano(), completed(), committed()
	m, err := pr.close(ctx)
	if err = errors.Join(sleepErr, err, prods.stop()); err != nil {
		return err
	}
	window := time.Duration(toNs - fromNs)
	res.WindowS = window.Seconds()
	res.Throughput = perSecond(toDone-fromDone, window)
	res.ProducedPerS = perSecond(toCommitted-fromCommitted, window)
	res.LateStarts = prods.late.Load()

	if !a.delivers() {
		res.fillCosts(m, toDone-fromDone, env.cfg, nil, spec.sink)
		return nil
	}
	settle(ctx, env.ledger, max(5*time.Second, cfg.Duration))
	endNs := time.Now().UnixNano()
	rss := serverRSS(srv)
	if rs, ok := srv.(*replicaSet); ok {
		var err error
		if res.Replicas, err = rs.paths(ctx); err != nil {
			return err
		}
	}
	if err := a.stop(ctx); err != nil {
		return err
	}
	if err := readBack(ctx, env, a); err != nil {
		return err
	}
	counts := env.ledger.Counts()
	res.Counts = &counts
	toSink, toPublished, cs, cp := env.ledger.Latencies(fromNs, toNs, endNs)
	res.setLatencies(toSink, toPublished, cs, cp)
	res.fillCosts(m, toDone-fromDone, env.cfg, rss, spec.sink)
	return nil
}

// measureIdle measures the many-relays workload's idle window: the relays
// have subscribed (given the warm-up to do so) and nothing is produced; the
// window's CPU time of the server and of PostgreSQL, as a share of one core,
// is what the relays' sessions cost while they wait.
func measureIdle(ctx context.Context, env *armEnv, srv serverHandle, res *Result) error {
	if err := sleepCtx(ctx, env.cfg.Warmup); err != nil {
		return err
	}
	pr, err := openWindow(ctx, env.cfg.DatabaseURL, env.dbName, srv)
	if err != nil {
		return err
	}
	sleepErr := sleepCtx(ctx, env.cfg.Duration)
	m, err := pr.close(ctx)
	if err := errors.Join(sleepErr, err); err != nil {
		return err
	}
	idle := &IdleFigures{WindowS: m.elapsed.Seconds()}
	if m.serverOK {
		idle.ServerCorePct = ptr(100 * m.serverCPU.Seconds() / m.elapsed.Seconds())
	}
	if m.postgresOK {
		idle.PostgresCorePct = ptr(100 * m.postgresCPU.Seconds() / m.elapsed.Seconds())
	}
	if m.commits > 0 {
		idle.CommitsPerS = float64(m.commits) / m.elapsed.Seconds()
	}
	res.Idle = idle
	return nil
}

// sleepCtx waits d or until ctx ends.
func sleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// measureDrain runs drain: the server is up, the backlog committed; the
// window opens, relays (or pollers) start, and it closes when the sink has
// every event or after twice the configured duration, whichever is first.
// A backlog that is not emptied by then was still almost whole during the
// window, which is what "drain rate at N pending" asks about; the events
// left are reported as backlog.
func measureDrain(ctx context.Context, env *armEnv, a arm, srv serverHandle, res *Result) error {
	pr, err := openWindow(ctx, env.cfg.DatabaseURL, env.dbName, srv)
	if err != nil {
		return err
	}
	fromNs := time.Now().UnixNano()
	if err := a.startDelivery(ctx, env); err != nil {
		_, _ = pr.close(ctx)
		return err
	}
	timeout := 2 * env.cfg.Duration
	complete := waitDelivered(ctx, env.ledger, timeout, false)
	toNs := time.Now().UnixNano()
	m, err := pr.close(ctx)
	if err != nil {
		return err
	}
	rss := serverRSS(srv)
	if err := a.stop(ctx); err != nil {
		return err
	}
	if err := readBack(ctx, env, a); err != nil {
		return err
	}
	counts := env.ledger.Counts()
	res.Counts = &counts
	window := time.Duration(toNs - fromNs)
	res.WindowS = window.Seconds()
	// The rate from the first delivery to the last leaves out connecting and
	// the first claim, which would weigh on small backlogs only.
	if first, last, n, ok := env.ledger.DeliverySpan(); ok && n > 1 && last > first {
		res.Throughput = perSecond(n-1, time.Duration(last-first))
		if wait := time.Duration(first - fromNs); wait > time.Second {
			res.Notes = append(res.Notes, fmt.Sprintf("first event delivered %.1fs after the window opened", wait.Seconds()))
		}
	}
	if !complete {
		res.Notes = append(res.Notes, fmt.Sprintf("window closed after %v with events still pending", timeout))
	}
	res.fillCosts(m, counts.Delivered, env.cfg, rss, 0)
	return nil
}

// settle gives delivery time to catch up once producers have stopped, so
// that the backlog count means "could not keep up", not "stopped too soon".
// It gives up early when the recent rate says the backlog cannot be
// delivered in the time left.
func settle(ctx context.Context, l *Ledger, timeout time.Duration) {
	waitDelivered(ctx, l, timeout, true)
}

// waitDelivered waits until the sink has every committed event, timeout
// passes, progress stalls, or (giveUpEarly) the rate over the last second
// says the rest cannot arrive in time. It reports whether everything
// arrived. Progress counts as stalled only once some event has arrived: a
// replica's first discovery round over a large backlog is one transaction
// (over 10 s for a cold 1M-event backlog once), and a window closed before
// it ended measured nothing (a drain of 0 events/s).
func waitDelivered(ctx context.Context, l *Ledger, timeout time.Duration, giveUpEarly bool) bool {
	return waitDeliveredStall(ctx, l, timeout, stallTimeout, giveUpEarly)
}

// waitDeliveredStall is waitDelivered with the stall timeout given.
func waitDeliveredStall(ctx context.Context, l *Ledger, timeout, stall time.Duration, giveUpEarly bool) bool {
	deadline := time.Now().Add(timeout)
	lastN, lastAt := l.Delivered(), time.Now()
	seenN, progressAt := lastN, lastAt
	t := time.NewTicker(20 * time.Millisecond)
	defer t.Stop()
	for {
		if l.Delivered() >= l.Committed() {
			return true
		}
		select {
		case <-ctx.Done():
			return false
		case <-t.C:
		}
		now := time.Now()
		if now.After(deadline) {
			return false
		}
		if n := l.Delivered(); n > seenN {
			seenN, progressAt = n, now
			if giveUpEarly && n > lastN && now.Sub(lastAt) >= time.Second {
				rate := float64(n-lastN) / now.Sub(lastAt).Seconds()
				if float64(l.Committed()-n)/rate > deadline.Sub(now).Seconds() {
					return false
				}
				lastN, lastAt = n, now
			}
		} else if n > 0 && now.Sub(progressAt) > stall {
			return false
		}
	}
}

// readBack records in the ledger what the database holds for every event.
func readBack(ctx context.Context, env *armEnv, a arm) error {
	err := a.scan(ctx, env.pool, env.ledger.RecordDB)
	if err == nil {
		if a.deletesOnAck() {
			env.ledger.MarkAbsentAcked()
		}
		env.ledger.MarkScanned()
	}
	return err
}

func serverRSS(srv serverHandle) *float64 {
	if srv == nil {
		return nil
	}
	if b, ok := srv.peakRSS(); ok {
		return ptr(float64(b) / (1 << 20))
	}
	return nil
}

// producers are P connections committing one event per transaction, each
// to a random aggregate (uniform), or on a schedule for the open-loop
// latency workload.
type producers struct {
	stopOnce sync.Once
	stopCh   chan struct{}
	wg       sync.WaitGroup
	late     atomic.Int64

	mu   sync.Mutex
	errs []error
}

func startProducers(ctx context.Context, env *armEnv, a arm, schedule func(p int, n int64) time.Time, ceilingDone *atomic.Int64) *producers {
	ps := &producers{stopCh: make(chan struct{})}
	for p := range env.cfg.Producers {
		ps.wg.Add(1)
		go func() {
			defer ps.wg.Done()
			if err := ps.run(ctx, env, a, p, schedule, ceilingDone); err != nil {
				ps.mu.Lock()
				ps.errs = append(ps.errs, err)
				ps.mu.Unlock()
				ps.halt()
			}
		}()
	}
	return ps
}

func (ps *producers) run(ctx context.Context, env *armEnv, a arm, p int, schedule func(int, int64) time.Time, ceilingDone *atomic.Int64) error {
	conn, err := env.pool.Acquire(ctx)
	if err != nil {
		return fmt.Errorf("bench: producer %d: %w", p, err)
	}
	defer conn.Release()
	rng := rand.New(rand.NewPCG(uint64(p), uint64(time.Now().UnixNano())))
	payload := make([]byte, 0, payloadSize)
	for seq := int64(1); ; seq++ {
		if schedule != nil {
			at := schedule(p, seq)
			if wait := time.Until(at); wait > 0 {
				t := time.NewTimer(wait)
				select {
				case <-ps.stopCh:
					t.Stop()
					return nil
				case <-t.C:
				}
			} else if -wait > lateStart {
				ps.late.Add(1)
			}
		}
		select {
		case <-ps.stopCh:
			return nil
		default:
		}
		agg := 0
		if env.aggregates > 1 {
			agg = rng.IntN(env.aggregates)
		}
		payload = appendPayload(payload, agg, p, seq, time.Now().UnixNano())
		// The statement runs to completion even when the run is being
		// stopped, so that a commit is never left in doubt.
		rev, err := a.produce(context.WithoutCancel(ctx), conn, agg, payload)
		if err != nil {
			return fmt.Errorf("bench: producer %d: %w", p, err)
		}
		if !a.delivers() {
			ceilingDone.Add(1)
			continue
		}
		if err := env.ledger.Commit(agg, rev, time.Now().UnixNano()); err != nil {
			return err
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
	}
}

func (ps *producers) halt() { ps.stopOnce.Do(func() { close(ps.stopCh) }) }

// stop stops every producer after its transaction under way and returns
// their errors.
func (ps *producers) stop() error {
	ps.halt()
	ps.wg.Wait()
	ps.mu.Lock()
	defer ps.mu.Unlock()
	return errors.Join(ps.errs...)
}

// sleep waits d, or less if a producer fails (its error is returned) or ctx
// ends.
func (ps *producers) sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	case <-ps.stopCh:
		return ps.stop()
	}
}

// firstDeliveryBound is how long a window waits past the warm-up for an
// arm's first delivery; an arm that delivers nothing by then is measured
// as it is.
const firstDeliveryBound = 30 * time.Second

// waitFor waits until cond holds, at most bound (then it returns nil: the
// caller measures what there is), checking every 10 ms, or less if a
// producer fails (its error is returned) or ctx ends.
func (ps *producers) waitFor(ctx context.Context, cond func() bool, bound time.Duration) error {
	for deadline := time.Now().Add(bound); !cond() && time.Now().Before(deadline); {
		if err := ps.sleep(ctx, 10*time.Millisecond); err != nil {
			return err
		}
	}
	return nil
}

func ptr[T any](v T) *T { return &v }

// HotWindow is the per-aggregate window (max_in_flight_per_aggregate) of
// the pipelined hot and hot-drain arms.
const HotWindow = 64

// hotDrainBacklog is how many events of one aggregate the hot-drain workload
// delivers: enough for a few seconds at the hot-aggregate goal.
func hotDrainBacklog(cfg *Config) int {
	if cfg.Quick {
		return 2_000
	}
	return 5_000
}
