package bench

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
)

// Report is everything one run measured; WriteJSON writes it whole.
type Report struct {
	Command string `json:"command"`
	// ScratchPrefix starts the name of every database the run created.
	ScratchPrefix string    `json:"scratch_prefix"`
	StartedAt     time.Time `json:"started_at"`
	ElapsedS      float64   `json:"elapsed_s"`
	Machine       Machine   `json:"machine"`
	Settings      Settings  `json:"settings"`
	Results       []*Result `json:"results"`
	Ratios        []Ratio   `json:"ratios"`
	// Failures names every arm of outboxd or the naive poller that lost,
	// reordered or invented events: the run fails.
	Failures []string `json:"failures"`
	// PeerDefects names every peer arm that lost or invented events. A
	// peer's defect invalidates that arm's figures, not the run, which
	// measures outboxd.
	PeerDefects []string `json:"peer_defects,omitempty"`
}

// Settings records the run's configuration.
type Settings struct {
	Quick         bool      `json:"quick"`
	Workloads     []string  `json:"workloads"`
	Arms          []string  `json:"arms"`
	DurationS     float64   `json:"duration_s"`
	WarmupS       float64   `json:"warmup_s"`
	Producers     int       `json:"producers"`
	Relays        int       `json:"relays"`
	MaxInFlight   int       `json:"max_in_flight"`
	Aggregates    int       `json:"aggregates"`
	SinkLatencyMs []float64 `json:"sink_latency_ms"`
	DrainSizes    []int     `json:"drain_sizes"`
	ServerMode    string    `json:"server_mode"`
	PayloadBytes  int       `json:"payload_bytes"`
	// Sink is "in-process", or the real broker's URL (password hidden)
	// every delivery was published to first.
	Sink string `json:"sink"`
}

// Machine describes where the run happened.
type Machine struct {
	Cores            int               `json:"cores"`
	CPUModel         string            `json:"cpu_model,omitempty"`
	MemoryMiB        int64             `json:"memory_mib,omitempty"`
	OS               string            `json:"os"`
	Kernel           string            `json:"kernel,omitempty"`
	GoVersion        string            `json:"go_version"`
	PostgresVersion  string            `json:"postgres_version"`
	PostgresSettings map[string]string `json:"postgres_settings"`
}

// Result holds one arm's figures under one workload. Pointer fields are
// absent when they could not be measured or do not apply.
type Result struct {
	Workload      string   `json:"workload"`
	Arm           string   `json:"arm"`
	SinkLatencyMs *float64 `json:"sink_latency_ms,omitempty"`
	Producers     int      `json:"producers"`
	Relays        int      `json:"relays,omitempty"`
	MaxInFlight   int      `json:"max_in_flight,omitempty"`
	Aggregates    int      `json:"aggregates"`
	Backlog       int      `json:"backlog,omitempty"`
	// Window is the outboxd relays' max_in_flight_per_aggregate, when above
	// one (the pipelined hot arms).
	Window int `json:"window,omitempty"`
	// Holder names who held a transaction id open (held-xmin).
	Holder string `json:"holder,omitempty"`
	// TargetRate is the latency workload's open-loop producer rate, and
	// LateStarts how many events producers started over 1ms behind it.
	TargetRate float64 `json:"target_rate,omitempty"`
	LateStarts int64   `json:"late_starts,omitempty"`

	WindowS float64 `json:"window_s"`
	// Throughput is events delivered per second in the window (the
	// ceilings: events committed, or marked), for drain from the first
	// delivery to the last.
	Throughput   float64 `json:"events_per_s"`
	ProducedPerS float64 `json:"produced_per_s,omitempty"`

	CommitToSink      *Percentiles `json:"commit_to_sink,omitempty"`
	CommitToPublished *Percentiles `json:"commit_to_published_at,omitempty"`
	CDFSink           []CDFPoint   `json:"cdf_commit_to_sink,omitempty"`
	CDFPublished      []CDFPoint   `json:"cdf_commit_to_published_at,omitempty"`

	CPU              CPUFigures `json:"cpu"`
	ServerPeakRSSMiB *float64   `json:"server_peak_rss_mib,omitempty"`
	// Idle is the many-relays workload's window before producers start.
	Idle *IdleFigures `json:"idle,omitempty"`
	// Sources and IdleSources are the sources workloads' own figures.
	Sources     *SourcesFigures     `json:"sources,omitempty"`
	IdleSources *IdleSourcesFigures `json:"idle_sources,omitempty"`
	// Replicas is the replicas workload's own figures.
	Replicas         *ReplicasFigures `json:"replicas,omitempty"`
	WALBytesPerEvent float64          `json:"wal_bytes_per_event"`
	WALSyncsPerEvent float64          `json:"wal_syncs_per_event"`
	// CommitsPerEvent counts the scratch database's committed transactions
	// (pg_stat_database, which lags up to a second) per event.
	CommitsPerEvent float64 `json:"commits_per_event"`

	Counts *Counts `json:"counts,omitempty"`
	// Tables are the arm's tables at the end: dead tuples and growth over
	// the arm (not measured for drain).
	Tables []TableStat `json:"tables,omitempty"`
	Waits  []Wait      `json:"waits"`
	// Limit is a heuristic reading of the figures: what held this arm back.
	Limit       string   `json:"limit"`
	Notes       []string `json:"notes,omitempty"`
	ArmElapsedS float64  `json:"arm_elapsed_s"`
}

// IdleFigures are what a server with many relays subscribed and nothing to
// deliver costs: CPU time over the window as a percentage of one core.
type IdleFigures struct {
	WindowS         float64  `json:"window_s"`
	ServerCorePct   *float64 `json:"server_core_pct,omitempty"`
	PostgresCorePct *float64 `json:"postgres_core_pct,omitempty"`
	// CommitsPerS counts the scratch database's commits per second
	// (pg_stat_database, which lags up to a second): the idle claims.
	CommitsPerS float64 `json:"commits_per_s"`
}

// CPUFigures are the window's CPU costs. Seconds are totals over the window;
// MsPer1k are CPU milliseconds per 1,000 events (equivalently µs per event).
type CPUFigures struct {
	MachineBusyPct   *float64 `json:"machine_busy_pct,omitempty"`
	MachineIOWaitPct *float64 `json:"machine_iowait_pct,omitempty"`
	// OtherLoadPct is the machine's busy share not accounted for by this
	// run's processes (bench, server, PostgreSQL): someone else's load,
	// which makes the window's figures suspect when it is large.
	OtherLoadPct      *float64 `json:"other_load_pct,omitempty"`
	BenchSeconds      float64  `json:"bench_process_s"`
	ServerSeconds     *float64 `json:"server_s,omitempty"`
	PostgresSeconds   *float64 `json:"postgres_s,omitempty"`
	BenchMsPer1k      float64  `json:"bench_process_ms_per_1k"`
	ServerMsPer1k     *float64 `json:"server_ms_per_1k,omitempty"`
	PostgresMsPer1k   *float64 `json:"postgres_ms_per_1k,omitempty"`
	TotalMsPer1k      *float64 `json:"total_ms_per_1k,omitempty"`
	SampledWaitPoints int      `json:"wait_samples"`
}

// Ratio is one of the goals of docs/benchmark.md (or a ratio given for context), checked
// against this run's figures.
type Ratio struct {
	Name  string   `json:"name"`
	Value *float64 `json:"value,omitempty"`
	Unit  string   `json:"unit,omitempty"`
	Goal  string   `json:"goal,omitempty"`
	Met   *bool    `json:"met,omitempty"`
	Note  string   `json:"note,omitempty"`
}

func newReport(cfg *Config) *Report {
	mode := "child process (outboxd serve)"
	s := Settings{
		Quick: cfg.Quick, Workloads: cfg.Workloads, Arms: cfg.Arms,
		DurationS: cfg.Duration.Seconds(), WarmupS: cfg.Warmup.Seconds(),
		Producers: cfg.Producers, Relays: cfg.Relays, MaxInFlight: cfg.MaxInFlight,
		Aggregates: cfg.Aggregates, DrainSizes: cfg.DrainSizes, ServerMode: mode, PayloadBytes: payloadSize,
		Sink: "in-process",
	}
	if cfg.SinkURL != "" {
		s.Sink = "in-process after " + redactURL(cfg.SinkURL)
	}
	for _, l := range cfg.SinkLatencies {
		s.SinkLatencyMs = append(s.SinkLatencyMs, ms(l))
	}
	return &Report{Command: cfg.Command, StartedAt: time.Now().UTC().Truncate(time.Second), Settings: s}
}

// describeMachine records the hardware and PostgreSQL the figures come from.
func describeMachine(ctx context.Context, cfg *Config) Machine {
	m := Machine{
		Cores: runtime.NumCPU(), OS: runtime.GOOS + "/" + runtime.GOARCH, GoVersion: runtime.Version(),
		PostgresSettings: map[string]string{},
	}
	m.CPUModel = procField("/proc/cpuinfo", "model name")
	if kb := procField("/proc/meminfo", "MemTotal"); kb != "" {
		var n int64
		fmt.Sscanf(kb, "%d", &n)
		m.MemoryMiB = n / 1024
	}
	if b, err := os.ReadFile("/proc/sys/kernel/osrelease"); err == nil {
		m.Kernel = strings.TrimSpace(string(b))
	}
	conn, err := pgx.Connect(ctx, cfg.DatabaseURL)
	if err != nil {
		return m
	}
	defer conn.Close(context.WithoutCancel(ctx))
	_ = conn.QueryRow(ctx, `SELECT version()`).Scan(&m.PostgresVersion)
	rows, err := conn.Query(ctx, `
		SELECT name, current_setting(name) FROM pg_settings
		WHERE name = ANY ($1) ORDER BY name`, []string{
		"shared_buffers", "synchronous_commit", "fsync", "wal_sync_method", "full_page_writes",
		"max_wal_size", "checkpoint_timeout", "wal_level", "commit_delay", "wal_compression",
		"work_mem", "max_connections", "autovacuum", "huge_pages",
	})
	if err != nil {
		return m
	}
	for rows.Next() {
		var k, v string
		if rows.Scan(&k, &v) == nil {
			m.PostgresSettings[k] = v
		}
	}
	rows.Close()
	return m
}

// procField returns the value of the first "key: value" line of a /proc file.
func procField(path, key string) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	for s.Scan() {
		k, v, ok := strings.Cut(s.Text(), ":")
		if ok && strings.TrimSpace(k) == key {
			return strings.TrimSpace(v)
		}
	}
	return ""
}

// find returns the result of arm under workload at sink latency sink (any
// latency for the ceilings) and, for drain, backlog; nil if it did not run.
func (r *Report) find(workload, arm string, sink time.Duration, backlog int) *Result {
	for _, res := range r.Results {
		if res.Workload != workload || res.Arm != arm || res.Backlog != backlog || res.Window > 1 {
			continue
		}
		if res.SinkLatencyMs == nil || *res.SinkLatencyMs == ms(sink) {
			return res
		}
	}
	return nil
}

// setLatencies summarises the window's latency samples.
func (res *Result) setLatencies(toSink, toPublished []time.Duration, censoredSink, censoredPublished int) {
	s := Summarise(toSink, censoredSink)
	res.CommitToSink = &s
	if len(toPublished) > 0 {
		p := Summarise(toPublished, censoredPublished)
		res.CommitToPublished = &p
	}
	if res.Workload == WorkloadLatency {
		res.CDFSink = CDF(toSink, 200)
		if len(toPublished) > 0 {
			res.CDFPublished = CDF(toPublished, 200)
		}
	}
}

// fillCosts turns the window's measurement into per-event costs and a
// reading of what limited the arm.
func (res *Result) fillCosts(m measurement, events int64, cfg *Config, rss *float64, sink time.Duration) {
	per1k := func(d time.Duration) float64 {
		if events <= 0 {
			return math.NaN()
		}
		return d.Seconds() * 1000 / float64(events) * 1000
	}
	perEvent := func(n int64) float64 {
		if events <= 0 {
			return math.NaN()
		}
		return float64(n) / float64(events)
	}
	c := &res.CPU
	c.SampledWaitPoints = m.samples
	if m.machine.ok && m.machine.total > 0 {
		c.MachineBusyPct = ptr(100 * float64(m.machine.busy) / float64(m.machine.total))
		c.MachineIOWaitPct = ptr(100 * float64(m.machine.iowait) / float64(m.machine.total))
	}
	c.BenchSeconds = m.benchCPU.Seconds()
	c.BenchMsPer1k = per1k(m.benchCPU)
	total := m.benchCPU
	totalOK := true
	if m.serverOK {
		c.ServerSeconds, c.ServerMsPer1k = ptr(m.serverCPU.Seconds()), ptr(per1k(m.serverCPU))
		total += m.serverCPU
	} else if res.Arm == ArmOutboxd && cfg.ServerBinary != "" {
		totalOK = false
	}
	if m.postgresOK {
		c.PostgresSeconds, c.PostgresMsPer1k = ptr(m.postgresCPU.Seconds()), ptr(per1k(m.postgresCPU))
		total += m.postgresCPU
	} else {
		totalOK = false
	}
	if totalOK {
		c.TotalMsPer1k = ptr(per1k(total))
		if c.MachineBusyPct != nil && m.elapsed > 0 {
			ours := 100 * total.Seconds() / (m.elapsed.Seconds() * float64(runtime.NumCPU()))
			c.OtherLoadPct = ptr(max(*c.MachineBusyPct-ours, 0))
		}
	}
	res.ServerPeakRSSMiB = rss
	res.WALBytesPerEvent = perEvent(m.walBytes)
	res.WALSyncsPerEvent = perEvent(m.walSyncs)
	res.CommitsPerEvent = perEvent(m.commits)
	res.Waits = m.waits
	res.Limit = limitOf(c.MachineBusyPct, m.waits, sink)
}

// limitOf reads what held an arm back from the machine's load and the
// backends' waits: a saturated CPU first (everything here competes for two
// cores), then the largest wait that is not CPU.
func limitOf(busyPct *float64, waits []Wait, sink time.Duration) string {
	var top Wait
	for _, w := range waits {
		if w.Name != "CPU" && !strings.HasPrefix(w.Name, "CPU (") {
			top = w
			break
		}
	}
	busy := "machine load unknown"
	if busyPct != nil {
		busy = fmt.Sprintf("machine %.0f%% busy", *busyPct)
	}
	detail := ""
	if top.Name != "" {
		detail = fmt.Sprintf("; top wait %s %.2f", top.Name, top.AvgSessions)
	}
	switch {
	case busyPct != nil && *busyPct >= 85:
		return "CPU (" + busy + ")" + detail
	case top.AvgSessions >= 0.3 && (strings.Contains(top.Name, "WALSync") || strings.Contains(top.Name, "WALWrite")):
		return "fsync (" + busy + ")" + detail
	case top.AvgSessions >= 0.3 && strings.HasPrefix(top.Name, "Lock:"):
		return "row locks (" + busy + ")" + detail
	case top.AvgSessions >= 0.3 && top.Name == "idle in transaction":
		return "transactions held open across the publish (" + busy + ")" + detail
	case sink > 0:
		return "sink latency x concurrency (" + busy + ")" + detail
	}
	return "round trips (" + busy + ")" + detail
}

func (res *Result) label() string {
	s := res.Workload + " " + res.Arm
	if res.SinkLatencyMs != nil {
		s += " sink=" + fmtMs(*res.SinkLatencyMs)
	}
	if res.Backlog > 0 {
		s += " backlog=" + fmtCount(res.Backlog)
	}
	if res.Holder != "" {
		s += " holder=" + res.Holder
	}
	if res.Window > 1 {
		s += fmt.Sprintf(" window=%d", res.Window)
	}
	return s
}

// armName is the arm, and who held the xmin in held-xmin.
func (res *Result) armName() string {
	switch {
	case res.Holder != "":
		return res.Arm + " (" + res.Holder + ")"
	case res.Window > 1:
		return fmt.Sprintf("%s (window %d)", res.Arm, res.Window)
	}
	return res.Arm
}

func (res *Result) progressLine() string {
	s := fmt.Sprintf("%-48s %9.0f ev/s", res.label(), res.Throughput)
	if c := res.Counts; c != nil {
		s += fmt.Sprintf("  lost %d reordered %d dup %d backlog %d", c.Lost, c.Reordered, c.Duplicates, c.Backlog)
	}
	return s + fmt.Sprintf("  (%.0fs)", res.ArmElapsedS)
}

// finish checks correctness and the goals once every arm has run.
func (r *Report) finish() {
	r.Failures, r.PeerDefects = nil, nil
	for _, res := range r.Results {
		c := res.Counts
		if c == nil {
			continue
		}
		defect := fmt.Sprintf("%s: lost %d, reordered %d, unexpected %d", res.label(), c.Lost, c.Reordered, c.Unexpected)
		switch {
		case promisesOrder(res.Arm) && (c.Lost > 0 || c.Unexpected > 0 || c.Reordered > 0):
			r.Failures = append(r.Failures, defect)
		case !promisesOrder(res.Arm) && (c.Lost > 0 || c.Unexpected > 0):
			r.PeerDefects = append(r.PeerDefects, defect)
		}
	}
	r.Ratios = r.ratios()
}

// fmtCounts lists counts, as "1,200 / 1,187".
func fmtCounts(counts []float64) string {
	var parts []string
	for _, c := range counts {
		parts = append(parts, fmtCount(int(c)))
	}
	return strings.Join(parts, " / ")
}

func (r *Report) ratios() []Ratio {
	var out []Ratio
	atLeast := func(name string, v float64, goal float64, unit, note string) {
		rt := Ratio{Name: name, Unit: unit, Note: note}
		if !math.IsNaN(v) {
			rt.Value = ptr(v)
			if goal > 0 {
				rt.Met = ptr(v >= goal)
			}
		}
		if goal > 0 {
			rt.Goal = "≥ " + trimFloat(goal)
		}
		out = append(out, rt)
	}
	atMost := func(name string, v float64, goal float64, unit, note string) {
		rt := Ratio{Name: name, Unit: unit, Goal: "≤ " + trimFloat(goal), Note: note}
		if !math.IsNaN(v) {
			rt.Value, rt.Met = ptr(v), ptr(v <= goal)
		}
		out = append(out, rt)
	}
	rate := func(res *Result) float64 {
		if res == nil {
			return math.NaN()
		}
		return res.Throughput
	}
	sinks := r.Settings.SinkLatencyMs
	ceiling := r.find(WorkloadSteady, ArmCeilingInsert, 0, 0)
	if ceiling != nil {
		if outboxd := r.find(WorkloadSteady, ArmOutboxd, 0, 0); outboxd != nil {
			atLeast("outboxd steady / ceiling-insert (sink 0, same P)", ratio(rate(outboxd), rate(ceiling)), 0.7, "×", "")
		}
	}
	steady0 := r.find(WorkloadSteady, ArmOutboxd, 0, 0)
	if mark := r.find(WorkloadSteady, ArmCeilingInsertMark, 0, 0); mark != nil && steady0 != nil {
		atLeast("outboxd steady / ceiling-insert-mark (sink 0, same P)", ratio(rate(steady0), rate(mark)), 0.9, "×",
			"insert, then mark published: the shape an outbox asks of the database")
	}
	if many := r.find(WorkloadManyRelays, ArmOutboxd, durationMs(firstOr(sinks, 0)), 0); many != nil {
		note := fmt.Sprintf("%d relays on one server", many.Relays)
		if many.Idle != nil {
			atMost("outboxd many relays: server CPU while they idle", orNaN(many.Idle.ServerCorePct), 3, "% of a core", note)
		}
		if many.CommitToSink != nil {
			atMost(fmt.Sprintf("outboxd many relays: p99 commit→sink at %.0f ev/s", many.TargetRate), many.CommitToSink.P99Ms, 250, "ms", note)
		}
	}
	naive1 := r.find(WorkloadSteady, ArmNaivePoller, time.Millisecond, 0)
	outboxd1 := r.find(WorkloadSteady, ArmOutboxd, time.Millisecond, 0)
	if naive1 != nil && outboxd1 != nil {
		atLeast(fmt.Sprintf("outboxd / naive-poller steady (sink 1ms, K=%d)", r.Settings.Relays),
			ratio(rate(outboxd1), rate(naive1)), 5, "×", "")
	}
	if lat := r.find(WorkloadLatency, ArmOutboxd, durationMs(firstOr(sinks, 0)), 0); lat != nil && lat.CommitToPublished != nil {
		note := fmt.Sprintf("open loop at %.0f ev/s, sink %s", lat.TargetRate, fmtMs(firstOr(sinks, 0)))
		atMost("outboxd latency p50 commit→published_at", lat.CommitToPublished.P50Ms, 5, "ms", note)
		atMost("outboxd latency p99 commit→published_at", lat.CommitToPublished.P99Ms, 25, "ms", note)
		if lat.CommitToSink != nil {
			atMost("outboxd latency p50 commit→sink", lat.CommitToSink.P50Ms, 2, "ms", note)
			atMost("outboxd latency p99 commit→sink", lat.CommitToSink.P99Ms, 10, "ms", note)
		}
	}
	var drains []*Result
	for _, res := range r.Results {
		if res.Workload == WorkloadDrain && res.Arm == ArmOutboxd {
			drains = append(drains, res)
		}
	}
	if len(drains) > 0 {
		small, large := drains[0], drains[0]
		slowest := drains[0]
		for _, d := range drains {
			if d.Backlog < small.Backlog {
				small = d
			}
			if d.Backlog > large.Backlog {
				large = d
			}
			if d.Throughput < slowest.Throughput {
				slowest = d
			}
		}
		// What steady delivery costs against what producing the same events
		// and draining them as a backlog cost, each CPU per event of all
		// processes: the fixed costs of small rounds and calls under a
		// steady feed are what exceeds 1.
		if emit := r.find(WorkloadProducer, ArmEmit, 0, 0); steady0 != nil && emit != nil {
			atMost(fmt.Sprintf("outboxd steady CPU per event / (emit + drain %s)", fmtCount(small.Backlog)),
				ratio(orNaN(steady0.CPU.TotalMsPer1k), orNaN(emit.CPU.TotalMsPer1k)+orNaN(small.CPU.TotalMsPer1k)), 1.15, "×",
				"bench, server and PostgreSQL CPU per event")
		}
		note := ""
		if large.Backlog < 1_000_000 {
			note = "the goal is at 1M pending; this run's largest backlog is smaller"
		}
		if large != small {
			atLeast(fmt.Sprintf("outboxd drain %s / drain %s", fmtCount(large.Backlog), fmtCount(small.Backlog)),
				ratio(large.Throughput, small.Throughput), 0.9, "×", note)
		}
		atLeast(fmt.Sprintf("outboxd drain, slowest backlog (%s)", fmtCount(slowest.Backlog)), slowest.Throughput, 30_000, "ev/s", "")
		if large.ServerPeakRSSMiB != nil {
			atMost(fmt.Sprintf("outboxd server peak RSS, drain %s, %d in flight", fmtCount(large.Backlog), large.MaxInFlight*large.Relays),
				*large.ServerPeakRSSMiB, 150, "MiB", note)
		}
	}
	if hot := r.find(WorkloadHot, ArmOutboxd, 0, 0); hot != nil {
		atLeast("outboxd hot aggregate (sink 0)", hot.Throughput, 1000, "ev/s", "")
	}
	for _, hot := range r.Results {
		if hot.Arm != ArmOutboxd || (hot.Workload != WorkloadHot && hot.Workload != WorkloadHotDrain) {
			continue
		}
		name := "outboxd hot aggregate"
		if hot.Workload == WorkloadHotDrain {
			name += ", backlog of " + fmtCount(hot.Backlog)
		} else if hot.Window <= 1 {
			continue // above
		}
		goal := 1000.0
		if hot.Workload == WorkloadHotDrain {
			// From a backlog every revision is there to hand over at once:
			// one in flight is the ack's round trip alone.
			goal = 1500
		}
		if hot.Window > 1 {
			name += fmt.Sprintf(", pipelined (window %d)", hot.Window)
			goal = 5000
		}
		atLeast(name, hot.Throughput, goal, "ev/s", "")
	}
	// Several replicas of one database against one, and how much of their
	// delivery fell to claims: context, no goal of an issue.
	if rep := r.find(WorkloadReplicas, ArmOutboxd, durationMs(firstOr(sinks, 0)), 0); rep != nil && rep.Replicas != nil {
		note := fmt.Sprintf("%d replicas, K=%d relays over them", rep.Replicas.Replicas, rep.Relays)
		if steady := r.find(WorkloadSteady, ArmOutboxd, durationMs(firstOr(sinks, 0)), 0); steady != nil {
			atLeast(fmt.Sprintf("outboxd %d replicas / one replica steady", rep.Replicas.Replicas), ratio(rep.Throughput, steady.Throughput), 0, "×", note)
		}
		atLeast(fmt.Sprintf("outboxd %d replicas: events the relays claimed", rep.Replicas.Replicas), rep.Replicas.ClaimedPct(), 0, "%", note+"; the rest dispatched by rounds or handed over by acks")
	}
	if src := r.find(WorkloadSources, ArmOutboxd, durationMs(firstOr(sinks, 0)), 0); src != nil && src.Sources != nil {
		f := src.Sources
		note := fmt.Sprintf("%d sources: 1 heavy (P=%d, K=%d), %d light at %.0f ev/s each", f.Sources, f.HeavyProducers, f.HeavyRelays, f.Sources-1, f.LightRate)
		atLeast("outboxd sources: every source's ev/s / single-source steady", ratio(src.Throughput, rate(r.find(WorkloadSteady, ArmOutboxd, durationMs(firstOr(sinks, 0)), 0))), 0.9, "×", note)
		if f.LightSolo != nil && f.LightMixed != nil {
			atMost("outboxd sources: light p99 commit→sink with the heavy source / alone", ratio(f.LightMixed.P99Ms, f.LightSolo.P99Ms), 2, "×", note)
		}
	}
	if idle := r.find(WorkloadIdleSources, ArmOutboxd, durationMs(firstOr(sinks, 0)), 0); idle != nil && idle.IdleSources != nil {
		for _, ph := range []*IdleSourcesPhase{idle.IdleSources.NoRelays, idle.IdleSources.OneRelay} {
			if ph == nil {
				continue
			}
			what := fmt.Sprintf("outboxd %d idle sources, %d relays:", idle.IdleSources.Sources, ph.Relays)
			atMost(what+" connections per source (most)", float64(ph.ConnsPerSourceMax), 2, "", "")
			cpu := math.NaN()
			if ph.ServerCorePct != nil && ph.PostgresCorePct != nil {
				cpu = *ph.ServerCorePct + *ph.PostgresCorePct
			}
			atMost(what+" server + postgres CPU", cpu, 5, "% of a core", "")
		}
	}
	// Context, no goals: how each arm compares with the database's floor and
	// with the naive poller at every sink latency.
	if ceiling != nil {
		for _, arm := range append([]string{ArmCeilingInsertMark, ArmNaivePoller, ArmOutboxd}, PeerArms...) {
			for _, l := range sinks {
				if res := r.find(WorkloadSteady, arm, durationMs(l), 0); res != nil && (arm != ArmCeilingInsertMark || l == sinks[0]) {
					name := arm + " steady / ceiling-insert"
					if res.SinkLatencyMs != nil {
						name += " (sink " + fmtMs(l) + ")"
					}
					atLeast(name, ratio(rate(res), rate(ceiling)), 0, "×", "context")
				}
			}
		}
	}
	for _, l := range sinks {
		if l == 1 {
			continue // the goal above
		}
		n, o := r.find(WorkloadSteady, ArmNaivePoller, durationMs(l), 0), r.find(WorkloadSteady, ArmOutboxd, durationMs(l), 0)
		if n != nil && o != nil {
			atLeast("outboxd / naive-poller steady (sink "+fmtMs(l)+")", ratio(rate(o), rate(n)), 0, "×", "context")
		}
	}
	n, o := r.find(WorkloadHot, ArmNaivePoller, durationMs(firstOr(sinks, 0)), 0), r.find(WorkloadHot, ArmOutboxd, durationMs(firstOr(sinks, 0)), 0)
	if n != nil && o != nil {
		atLeast("outboxd / naive-poller hot aggregate", ratio(rate(o), rate(n)), 0, "×", "context")
	}
	// outboxd against each peer, at every sink latency both ran; the goal
	// is against Watermill at its default poll with a 0 sink.
	for _, l := range sinks {
		o := r.find(WorkloadSteady, ArmOutboxd, durationMs(l), 0)
		for _, peer := range PeerArms {
			p := r.find(WorkloadSteady, peer, durationMs(l), 0)
			if o == nil || p == nil {
				continue
			}
			goal, note := 0.0, "context"
			switch {
			case peer == ArmWatermill && l == 0:
				goal, note = 1.3, ""
			case peer == ArmWatermill10ms && l == 0:
				goal, note = 1, ""
			case peer == ArmWatermill10ms && l == 1:
				goal, note = 3, ""
			}
			atLeast(fmt.Sprintf("outboxd / %s steady (sink %s)", peer, fmtMs(l)), ratio(rate(o), rate(p)), goal, "×", note)
		}
	}
	// The producer's tax: each outbox path against a plain INSERT, back to
	// back in the same run.
	if plain := r.find(WorkloadProducer, ArmCeilingInsert, 0, 0); plain != nil {
		if e := r.find(WorkloadProducer, ArmEmit, 0, 0); e != nil {
			atLeast("producer: outbox.emit / plain INSERT", ratio(rate(e), rate(plain)), 0.8, "×", "")
		}
		if t := r.find(WorkloadProducer, ArmInsertTrigger, 0, 0); t != nil {
			atLeast("producer: client.Emit (INSERT, trigger) / plain INSERT", ratio(rate(t), rate(plain)), 0.85, "×", "")
		}
	}
	// A held transaction id against the same arm's steady run.
	for _, res := range r.Results {
		if res.Workload != WorkloadHeldXmin {
			continue
		}
		sink := durationMs(orZero(res.SinkLatencyMs))
		steady := r.find(WorkloadSteady, res.Arm, sink, 0)
		if steady == nil {
			continue
		}
		goal, note := 0.0, "context"
		if res.Arm == ArmOutboxd {
			goal, note = 0.8, ""
		}
		atLeast(fmt.Sprintf("%s held-xmin (%s) / steady (sink %s)", res.Arm, res.Holder, fmtMs(ms(sink))),
			ratio(rate(res), rate(steady)), goal, "×", note)
	}
	return out
}

// noisyLoadPct is the share of the machine other processes may take during
// a window before the table says its figures are suspect.
const noisyLoadPct = 20

// WriteJSON writes the whole report to path.
func (r *Report) WriteJSON(path string) error {
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	return os.WriteFile(path, append(b, '\n'), 0o644)
}

// MarshalJSON keeps NaN (a figure with nothing to divide by) out of the
// JSON, which has no such number.
func (c CPUFigures) MarshalJSON() ([]byte, error) {
	type plain CPUFigures
	p := plain(c)
	if math.IsNaN(p.BenchMsPer1k) {
		p.BenchMsPer1k = 0
	}
	for _, f := range []**float64{&p.ServerMsPer1k, &p.PostgresMsPer1k, &p.TotalMsPer1k} {
		if *f != nil && math.IsNaN(**f) {
			*f = nil
		}
	}
	return json.Marshal(p)
}

// MarshalJSON writes NaN per-event figures (no events) as 0.
func (res *Result) MarshalJSON() ([]byte, error) {
	type plain Result
	p := plain(*res)
	for _, f := range []*float64{&p.WALBytesPerEvent, &p.WALSyncsPerEvent, &p.CommitsPerEvent} {
		if math.IsNaN(*f) {
			*f = 0
		}
	}
	return json.Marshal(p)
}

// WriteTable prints a table per workload, then the goals.
func (r *Report) WriteTable(w io.Writer) {
	m := r.Machine
	fmt.Fprintf(w, "outboxd-bench: %s, %d cores (%s), %s\n", m.OS, m.Cores, m.CPUModel, firstLine(m.PostgresVersion))
	s := r.Settings
	fmt.Fprintf(w, "P=%d producers, K=%d relays/pollers (max in flight %d each), %d aggregates, %s window after %s warm-up, server %s, sink %s\n",
		s.Producers, s.Relays, s.MaxInFlight, s.Aggregates, fmtSeconds(s.DurationS), fmtSeconds(s.WarmupS), s.ServerMode, s.Sink)
	fmt.Fprintln(w, "latency = commit→sink (commit→published_at) p50/p99/p99.9 ms; CPU in ms per 1,000 events (= µs per event); * = includes censored samples")

	for _, workload := range AllWorkloads {
		var rows []*Result
		for _, res := range r.Results {
			// idle-sources delivers nothing: its own lines below say what it measured.
			if res.Workload == workload && res.IdleSources == nil {
				rows = append(rows, res)
			}
		}
		if len(rows) == 0 {
			continue
		}
		fmt.Fprintf(w, "\n== %s ==\n", workload)
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintln(tw, "arm\tsink\tbacklog\tev/s\tproduced/s\tcommit→sink p50/p99/p99.9\tcommit→published_at p50/p99/p99.9\tlost\treord\tdup\tleft\t")
		for _, res := range rows {
			sink, backlog := "-", "-"
			if res.SinkLatencyMs != nil {
				sink = fmtMs(*res.SinkLatencyMs)
			}
			if res.Backlog > 0 {
				backlog = fmtCount(res.Backlog)
			}
			produced := "-"
			if res.ProducedPerS > 0 {
				produced = fmt.Sprintf("%.0f", res.ProducedPerS)
			}
			lost, reord, dup, left := "-", "-", "-", "-"
			if c := res.Counts; c != nil {
				lost, reord, dup, left = fmt.Sprint(c.Lost), fmt.Sprint(c.Reordered), fmt.Sprint(c.Duplicates), fmt.Sprint(c.Backlog)
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%.0f\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t\n", res.armName(), sink, backlog, res.Throughput, produced,
				fmtPercentiles(res.CommitToSink), fmtPercentiles(res.CommitToPublished), lost, reord, dup, left)
		}
		tw.Flush()
		fmt.Fprintln(w)
		tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintln(tw, "arm\tsink\tbacklog\tCPU bench\tserver\tpostgres\ttotal\tbusy%\tother%\tRSS MiB\tWAL B/ev\tsyncs/ev\tcommits/ev\t limit\t")
		for _, res := range rows {
			sink, backlog := "-", "-"
			if res.SinkLatencyMs != nil {
				sink = fmtMs(*res.SinkLatencyMs)
			}
			if res.Backlog > 0 {
				backlog = fmtCount(res.Backlog)
			}
			c := res.CPU
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%.0f\t%.2f\t%.2f\t %s\t\n", res.armName(), sink, backlog,
				fmtOpt(&c.BenchMsPer1k, "%.0f"), fmtOpt(c.ServerMsPer1k, "%.0f"), fmtOpt(c.PostgresMsPer1k, "%.0f"),
				fmtOpt(c.TotalMsPer1k, "%.0f"), fmtOpt(c.MachineBusyPct, "%.0f"), fmtOpt(c.OtherLoadPct, "%.0f"),
				fmtOpt(res.ServerPeakRSSMiB, "%.0f"),
				res.WALBytesPerEvent, res.WALSyncsPerEvent, res.CommitsPerEvent, res.Limit)
		}
		tw.Flush()
		for _, res := range rows {
			if i := res.Idle; i != nil {
				fmt.Fprintf(w, "%s, %d relays idle for %s before producers: server %s %% of a core, postgres %s %%, %.0f commits/s\n",
					res.armName(), res.Relays, fmtSeconds(i.WindowS), fmtOpt(i.ServerCorePct, "%.1f"), fmtOpt(i.PostgresCorePct, "%.1f"), i.CommitsPerS)
			}
		}
	}

	for _, res := range r.Results {
		if f := res.Sources; f != nil {
			fmt.Fprintf(w, "\n== sources: %d source databases on one server ==\n", f.Sources)
			fmt.Fprintf(w, "light sources alone (%d at %.0f ev/s each): %.0f ev/s delivered, commit→sink %s\n",
				f.Sources-1, f.LightRate, f.LightSoloPerS, fmtPercentiles(f.LightSolo))
			fmt.Fprintf(w, "with the heavy source (P=%d, K=%d): %.0f ev/s in all = heavy %.0f + light %.0f; light commit→sink %s (worst source %s p99 %s), heavy %s\n",
				f.HeavyProducers, f.HeavyRelays, res.Throughput, f.HeavyMixedPerS, f.LightMixedPerS, fmtPercentiles(f.LightMixed),
				f.WorstLightSource, fmtLatency(f.WorstLightMixedP99Ms), fmtPercentiles(f.HeavyMixed))
			for _, c := range []struct {
				name string
				cost SourcesWindowCost
			}{{"alone", f.Solo}, {"with heavy", f.Mixed}} {
				fmt.Fprintf(w, "  %s: server %s %% of a core, postgres %s %%; per light source %.1f commits/s, %.1f rollbacks/s (empty discovery rounds); heavy %.1f commits/s, %.1f rollbacks/s\n",
					c.name, fmtOpt(c.cost.ServerCorePct, "%.1f"), fmtOpt(c.cost.PostgresCorePct, "%.1f"),
					c.cost.LightCommitsPerS, c.cost.LightRollbacksPerS, c.cost.HeavyCommitsPerS, c.cost.HeavyRollbacksPerS)
			}
		}
		if f := res.Replicas; f != nil {
			fmt.Fprintf(w, "\n== replicas: %d outboxd serve on one database, %d relays over them ==\n", f.Replicas, res.Relays)
			fmt.Fprintf(w, "%.0f ev/s; the relays got their events by: dispatch %.1f %%, hand-over %.1f %%, claim %.1f %%; leases by replica: %s\n",
				res.Throughput, share(f.Dispatched, f), share(f.HandedOver, f), share(f.Claimed, f), fmtCounts(f.PerReplica))
		}
		if f := res.IdleSources; f != nil {
			fmt.Fprintf(w, "\n== idle-sources: %d idle source databases on one server (--max-db-conns %d) ==\n", f.Sources, f.MaxDBConn)
			for _, ph := range []*IdleSourcesPhase{f.NoRelays, f.OneRelay} {
				if ph == nil {
					continue
				}
				fmt.Fprintf(w, "%d relays, %s: server %s %% of a core, postgres %s %%, per source %.2f commits/s and %.1f rollbacks/s (empty discovery rounds), connections per source %.2f mean, %d most (%d in all)\n",
					ph.Relays, fmtSeconds(ph.WindowS), fmtOpt(ph.ServerCorePct, "%.1f"), fmtOpt(ph.PostgresCorePct, "%.1f"),
					ph.CommitsPerSourcePerS, ph.RollbacksPerSourcePerS, ph.ConnsPerSourceMean, ph.ConnsPerSourceMax, ph.ConnsTotal)
				for _, g := range ph.Sessions {
					fmt.Fprintf(w, "    %4d  %-20s %s\n", g.Count, g.State, g.Query)
				}
			}
		}
	}

	r.writeSideBySide(w)
	r.writeTables(w)

	fmt.Fprintln(w, "\n== goals (docs/benchmark.md) and context ratios, all from this run ==")
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "\tvalue\tgoal\tmet\tnote")
	for _, rt := range r.Ratios {
		v, met := "not measured", ""
		if rt.Value != nil {
			v = fmt.Sprintf("%.2f", *rt.Value)
			if rt.Unit == "ev/s" {
				v = fmt.Sprintf("%.0f", *rt.Value)
			}
			v += " " + rt.Unit
		}
		if rt.Met != nil {
			met = "MISSED"
			if *rt.Met {
				met = "yes"
			}
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\n", rt.Name, v, rt.Goal, met, rt.Note)
	}
	tw.Flush()
	var noisy []string
	for _, res := range r.Results {
		if o := res.CPU.OtherLoadPct; o != nil && *o >= noisyLoadPct {
			noisy = append(noisy, fmt.Sprintf("%s (%.0f%%)", res.label(), *o))
		}
	}
	if len(noisy) > 0 {
		fmt.Fprintf(w, "\nnote: other processes kept the machine busy during %s; those figures are suspect, rerun them\n",
			strings.Join(noisy, ", "))
	}
	if len(r.PeerDefects) > 0 {
		fmt.Fprintln(w, "\n!!! A PEER LOST OR INVENTED EVENTS; its figures are not valid (the run goes on) !!!")
		for _, f := range r.PeerDefects {
			fmt.Fprintln(w, "!!!   "+f)
		}
	}
	if len(r.Failures) > 0 {
		fmt.Fprintln(w, "\n!!! INCORRECT DELIVERY: events were lost, reordered or invented !!!")
		for _, f := range r.Failures {
			fmt.Fprintln(w, "!!!   "+f)
		}
	}
}

func fmtPercentiles(p *Percentiles) string {
	if p == nil || p.N == 0 {
		return "-"
	}
	s := fmtLatency(p.P50Ms) + "/" + fmtLatency(p.P99Ms) + "/" + fmtLatency(p.P999Ms)
	if p.Censored > 0 {
		s += "*"
	}
	return s
}

func fmtLatency(v float64) string {
	switch {
	case v >= 100:
		return fmt.Sprintf("%.0f", v)
	case v >= 10:
		return fmt.Sprintf("%.1f", v)
	}
	return fmt.Sprintf("%.2f", v)
}

func fmtOpt(v *float64, format string) string {
	if v == nil || math.IsNaN(*v) {
		return "-"
	}
	return fmt.Sprintf(format, *v)
}

func fmtMs(v float64) string { return durationMs(v).String() }

func durationMs(v float64) time.Duration { return time.Duration(v * float64(time.Millisecond)) }

func fmtSeconds(s float64) string { return (time.Duration(s * float64(time.Second))).String() }

// fmtCount writes 10000 as 10k and 1000000 as 1M.
func fmtCount(n int) string {
	switch {
	case n >= 1_000_000 && n%1_000_000 == 0:
		return fmt.Sprintf("%dM", n/1_000_000)
	case n >= 1000 && n%1000 == 0:
		return fmt.Sprintf("%dk", n/1000)
	}
	return fmt.Sprint(n)
}

func trimFloat(v float64) string {
	if v == math.Trunc(v) && v >= 1000 {
		return fmt.Sprintf("%.0f", v)
	}
	return strings.TrimRight(strings.TrimRight(fmt.Sprintf("%.2f", v), "0"), ".")
}

func firstOr(v []float64, def float64) float64 {
	if len(v) == 0 {
		return def
	}
	return v[0]
}

func firstLine(s string) string {
	if i := strings.Index(s, " on "); i > 0 {
		return s[:i]
	}
	return s
}

// writeSideBySide prints outboxd and the peers in steady at each sink
// latency: events/s, the ratio to the ceiling and outboxd's ratio to each,
// latency and reorders.
func (r *Report) writeSideBySide(w io.Writer) {
	ceiling := r.find(WorkloadSteady, ArmCeilingInsert, 0, 0)
	var rows []*Result
	for _, res := range r.Results {
		if res.Workload == WorkloadSteady && (res.Arm == ArmOutboxd || slices.Contains(PeerArms, res.Arm)) {
			rows = append(rows, res)
		}
	}
	if len(rows) == 0 {
		return
	}
	fmt.Fprintln(w, "\n== outboxd and the peers side by side (steady) ==")
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "arm\tsink\tev/s\t× ceiling-insert\toutboxd ÷ arm\tcommit→sink p50/p99/p99.9\treordered\tlost\t")
	for _, res := range rows {
		sink := "-"
		if res.SinkLatencyMs != nil {
			sink = fmtMs(*res.SinkLatencyMs)
		}
		toCeiling, fromOutboxd := "-", "-"
		if ceiling != nil && ceiling.Throughput > 0 {
			toCeiling = fmt.Sprintf("%.2f", res.Throughput/ceiling.Throughput)
		}
		if o := r.find(WorkloadSteady, ArmOutboxd, durationMs(orZero(res.SinkLatencyMs)), 0); o != nil && res.Throughput > 0 {
			fromOutboxd = fmt.Sprintf("%.2f", o.Throughput/res.Throughput)
		}
		reord, lost := "-", "-"
		if c := res.Counts; c != nil {
			reord, lost = fmt.Sprint(c.Reordered), fmt.Sprint(c.Lost)
			if c.Reordered > 0 && !promisesOrder(res.Arm) {
				reord += " (no order promised)"
			}
		}
		fmt.Fprintf(tw, "%s\t%s\t%.0f\t%s\t%s\t%s\t%s\t%s\t\n", res.Arm, sink, res.Throughput, toCeiling, fromOutboxd,
			fmtPercentiles(res.CommitToSink), reord, lost)
	}
	tw.Flush()
}

// writeTables prints every arm's tables: dead tuples at the end and growth
// over the arm.
func (r *Report) writeTables(w io.Writer) {
	header := false
	for _, res := range r.Results {
		if len(res.Tables) == 0 || (res.Workload != WorkloadSteady && res.Workload != WorkloadHeldXmin) {
			continue
		}
		if !header {
			fmt.Fprintln(w, "\n== tables at the end of steady and held-xmin arms: dead tuples (n_dead_tup), growth (pg_total_relation_size) ==")
			header = true
		}
		var parts []string
		for _, t := range res.Tables {
			if t.DeadTuples == 0 && t.GrowthBytes == 0 {
				continue
			}
			parts = append(parts, fmt.Sprintf("%s dead %d live %d +%s", t.Name, t.DeadTuples, t.LiveTuples, fmtBytes(t.GrowthBytes)))
		}
		if len(parts) == 0 {
			parts = []string{"no dead tuples, no growth"}
		}
		fmt.Fprintf(w, "%-52s %s\n", res.label(), strings.Join(parts, "; "))
	}
}

// fmtBytes writes a size in KiB or MiB.
func fmtBytes(b int64) string {
	if b >= 1<<20 || b <= -(1<<20) {
		return fmt.Sprintf("%.1fMiB", float64(b)/(1<<20))
	}
	return fmt.Sprintf("%dKiB", b/1024)
}
