package bench

import (
	"bytes"
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func result(workload, arm string, sinkMs *float64, backlog int, rate float64) *Result {
	return &Result{Workload: workload, Arm: arm, SinkLatencyMs: sinkMs, Backlog: backlog, Throughput: rate,
		Relays: 4, MaxInFlight: 250, Counts: &Counts{}}
}

func findRatio(t *testing.T, rs []Ratio, prefix string) Ratio {
	t.Helper()
	for _, r := range rs {
		if strings.HasPrefix(r.Name, prefix) {
			return r
		}
	}
	t.Fatalf("no ratio %q in %+v", prefix, rs)
	return Ratio{}
}

func TestReportGoals(t *testing.T) {
	zero, one := ptr(0.0), ptr(1.0)
	rep := &Report{Settings: Settings{Relays: 4, SinkLatencyMs: []float64{0, 1}}}
	lat := result(WorkloadLatency, ArmOutboxd, zero, 0, 4000)
	lat.CommitToPublished = &Percentiles{N: 10, P50Ms: 4, P99Ms: 30}
	lat.CommitToSink = &Percentiles{N: 10, P50Ms: 1.5, P99Ms: 12}
	bigDrain := result(WorkloadDrain, ArmOutboxd, zero, 1_000_000, 19_000)
	bigDrain.ServerPeakRSSMiB = ptr(120.0)
	// The pipelined hot arm has its own goal, and the one-in-flight goal
	// is not read off it.
	pipelined := result(WorkloadHot, ArmOutboxd, zero, 0, 6_000)
	pipelined.Window = HotWindow
	rep.Results = []*Result{
		result(WorkloadSteady, ArmCeilingInsert, nil, 0, 10_000),
		result(WorkloadSteady, ArmOutboxd, zero, 0, 7_500),
		result(WorkloadSteady, ArmNaivePoller, one, 0, 1_000),
		result(WorkloadSteady, ArmOutboxd, one, 0, 4_000),
		lat,
		result(WorkloadDrain, ArmOutboxd, zero, 10_000, 20_000),
		bigDrain,
		result(WorkloadHot, ArmOutboxd, zero, 0, 900),
		pipelined,
	}
	rep.finish()
	check := func(prefix string, value float64, met bool) {
		t.Helper()
		r := findRatio(t, rep.Ratios, prefix)
		if r.Value == nil || math.Abs(*r.Value-value) > 1e-9 || r.Met == nil || *r.Met != met {
			t.Errorf("%s: value %v met %v, want %v met %v", r.Name, deref(r.Value), deref(r.Met), value, met)
		}
	}
	check("outboxd steady / ceiling-insert (sink 0", 0.75, true)
	check("outboxd / naive-poller steady (sink 1ms", 4, false)
	check("outboxd latency p50", 4, true)
	check("outboxd latency p99 commit→published_at", 30, false)
	check("outboxd latency p50 commit→sink", 1.5, true)
	check("outboxd latency p99 commit→sink", 12, false)
	check("outboxd drain 1M / drain 10k", 0.95, true)
	check("outboxd drain, slowest backlog (1M)", 19_000, false)
	check("outboxd server peak RSS, drain 1M, 1000 in flight", 120, true)
	check("outboxd hot aggregate (sink 0)", 900, false)
	check("outboxd hot aggregate, pipelined (window 64)", 6_000, true)
	if len(rep.Failures) != 0 {
		t.Fatalf("failures %v from clean counts", rep.Failures)
	}
}

func deref[T any](p *T) any {
	if p == nil {
		return nil
	}
	return *p
}

func TestReportMissingFiguresAreNotMeasured(t *testing.T) {
	rep := &Report{Settings: Settings{SinkLatencyMs: []float64{1}}}
	rep.Results = []*Result{
		result(WorkloadSteady, ArmNaivePoller, ptr(1.0), 0, 0),
		result(WorkloadSteady, ArmOutboxd, ptr(1.0), 0, 4_000),
	}
	rep.finish()
	r := findRatio(t, rep.Ratios, "outboxd / naive-poller steady (sink 1ms")
	if r.Value != nil || r.Met != nil {
		t.Fatalf("a ratio over a zero rate must read as not measured, got %+v", r)
	}
}

func TestReportFailures(t *testing.T) {
	rep := &Report{}
	bad := result(WorkloadSteady, ArmOutboxd, ptr(0.0), 0, 100)
	bad.Counts = &Counts{Committed: 10, Delivered: 9, Lost: 1}
	dup := result(WorkloadSteady, ArmNaivePoller, ptr(0.0), 0, 100)
	dup.Counts = &Counts{Committed: 10, Delivered: 10, Duplicates: 3}
	rep.Results = []*Result{bad, dup}
	rep.finish()
	if len(rep.Failures) != 1 || !strings.Contains(rep.Failures[0], "outboxd") || !strings.Contains(rep.Failures[0], "lost 1") {
		t.Fatalf("failures %v, want one naming outboxd's lost event", rep.Failures)
	}
	var out bytes.Buffer
	rep.WriteTable(&out)
	if !strings.Contains(out.String(), "INCORRECT DELIVERY") {
		t.Fatalf("the table does not shout about the failure:\n%s", out.String())
	}
}

// Peers promise no per-aggregate order: their reorders are reported and do
// not fail the run; their losses are reported loudly as defects of that arm
// and do not fail it either (the run measures outboxd); outboxd fails on a
// reorder.
func TestReportPeersReorderWithoutFailing(t *testing.T) {
	rep := &Report{}
	river := result(WorkloadSteady, ArmRiver, ptr(0.0), 0, 100)
	river.Counts = &Counts{Committed: 10, Delivered: 10, Reordered: 4}
	outboxd := result(WorkloadSteady, ArmOutboxd, ptr(0.0), 0, 100)
	outboxd.Counts = &Counts{Committed: 10, Delivered: 10, Reordered: 1}
	lossy := result(WorkloadSteady, ArmWatermill, ptr(0.0), 0, 100)
	lossy.Counts = &Counts{Committed: 10, Delivered: 9, Lost: 1}
	rep.Results = []*Result{river, outboxd, lossy}
	rep.finish()
	if len(rep.Failures) != 1 || !strings.Contains(rep.Failures[0], "outboxd") {
		t.Fatalf("failures %v, want only outboxd's reorder", rep.Failures)
	}
	if len(rep.PeerDefects) != 1 || !strings.Contains(rep.PeerDefects[0], "watermill") || !strings.Contains(rep.PeerDefects[0], "lost 1") {
		t.Fatalf("peer defects %v, want watermill's loss", rep.PeerDefects)
	}
	var out bytes.Buffer
	rep.WriteTable(&out)
	if !strings.Contains(out.String(), "A PEER LOST OR INVENTED EVENTS") {
		t.Fatalf("the table does not report the peer's loss:\n%s", out.String())
	}
	if !strings.Contains(out.String(), "4 (no order promised)") {
		t.Fatalf("the side-by-side table does not report river's reorders:\n%s", out.String())
	}
}

// The peer, producer and held-xmin ratios come from the same run.
func TestReportPeerProducerHeldXminRatios(t *testing.T) {
	zero := ptr(0.0)
	held := result(WorkloadHeldXmin, ArmOutboxd, zero, 0, 1500)
	held.Holder = HolderSameDBRR
	rep := &Report{Settings: Settings{SinkLatencyMs: []float64{0}}, Results: []*Result{
		result(WorkloadSteady, ArmCeilingInsert, nil, 0, 10_000),
		result(WorkloadSteady, ArmOutboxd, zero, 0, 2_000),
		result(WorkloadSteady, ArmWatermill, zero, 0, 8_000),
		result(WorkloadSteady, ArmRiver, zero, 0, 4_000),
		result(WorkloadProducer, ArmCeilingInsert, nil, 0, 10_000),
		result(WorkloadProducer, ArmEmit, nil, 0, 7_000),
		result(WorkloadProducer, ArmInsertTrigger, nil, 0, 9_000),
		held,
	}}
	rep.finish()
	for _, c := range []struct {
		name string
		want float64
		met  *bool
	}{
		{"outboxd / watermill steady (sink 0s)", 0.25, ptr(false)},
		{"outboxd / river steady (sink 0s)", 0.5, nil},
		{"watermill steady / ceiling-insert", 0.8, nil},
		{"producer: outbox.emit / plain INSERT", 0.7, ptr(false)},
		{"producer: client.Emit (INSERT, trigger)", 0.9, ptr(true)},
		{"outboxd held-xmin (same-db-rr) / steady", 0.75, ptr(false)},
	} {
		r := findRatio(t, rep.Ratios, c.name)
		if r.Value == nil || math.Abs(*r.Value-c.want) > 1e-9 {
			t.Errorf("%s = %v, want %v", c.name, r.Value, c.want)
		}
		if (c.met == nil) != (r.Met == nil) || (c.met != nil && *c.met != *r.Met) {
			t.Errorf("%s: met %v, want %v", c.name, r.Met, c.met)
		}
	}
}

func TestReportJSONAndPlot(t *testing.T) {
	rep := &Report{Settings: Settings{Producers: 8, Relays: 4, SinkLatencyMs: []float64{0}}}
	steady := result(WorkloadSteady, ArmOutboxd, ptr(0.0), 0, 5000)
	steady.WALBytesPerEvent = math.NaN() // no events: must not break the JSON
	steady.CPU.ServerMsPer1k = ptr(math.NaN())
	lat := result(WorkloadLatency, ArmOutboxd, ptr(0.0), 0, 2500)
	lat.setLatencies(durations(1, 2, 3, 50), durations(2, 3, 4, 60), 0, 0)
	rep.Results = []*Result{
		result(WorkloadSteady, ArmCeilingInsert, nil, 0, 9000), steady, lat,
		result(WorkloadDrain, ArmOutboxd, ptr(0.0), 10_000, 20_000),
		result(WorkloadHot, ArmOutboxd, ptr(0.0), 0, 1200),
	}
	rep.finish()
	dir := t.TempDir()
	jsonPath := filepath.Join(dir, "bench.json")
	if err := rep.WriteJSON(jsonPath); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(jsonPath)
	if err != nil {
		t.Fatal(err)
	}
	var back Report
	if err := json.Unmarshal(b, &back); err != nil {
		t.Fatalf("the JSON does not read back: %v", err)
	}
	if len(back.Results) != 5 || back.Results[2].CommitToPublished.P99Ms != 60 || len(back.Results[2].CDFPublished) != 4 {
		t.Fatalf("JSON lost figures: %s", b)
	}
	for _, name := range []string{"bench.svg", "bench.png"} {
		path := filepath.Join(dir, name)
		if err := rep.WritePlot(path); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if st, err := os.Stat(path); err != nil || st.Size() < 1000 {
			t.Fatalf("%s: %v, %v", name, st, err)
		}
	}
	if err := rep.WritePlot(filepath.Join(dir, "bench.jpg")); err == nil {
		t.Fatal("a .jpg plot was accepted")
	}
	// A report with nothing in it has nothing to draw, and says so.
	if err := (&Report{}).WritePlot(filepath.Join(dir, "empty.png")); err == nil {
		t.Fatal("an empty report drew a plot")
	}
}

func TestPayload(t *testing.T) {
	b := appendPayload(nil, 4217, 3, 99, time.Now().UnixNano())
	if len(b) != payloadSize {
		t.Fatalf("payload is %d bytes, want %d", len(b), payloadSize)
	}
	var order payloadOrder
	if err := json.Unmarshal(b, &order); err != nil {
		t.Fatalf("payload %s: %v", b, err)
	}
	if order.Producer != 3 || order.Seq != 99 {
		t.Fatalf("payload reads back as %+v", order)
	}
	// What the sink sees: the payload as jsonb prints it (keys reordered,
	// spaces after colons), the SQL-filled backlog's, and something else.
	for _, c := range []struct {
		payload string
		want    payloadOrder
		ok      bool
	}{
		{`{"p": 3, "t": 1, "agg": "4217", "pad": "xx", "seq": 99}`, payloadOrder{3, 99}, true},
		{`{"p": -1, "t": 0, "agg": "7", "pad": "xx", "seq": 0}`, payloadOrder{-1, 0}, true},
		{string(b), payloadOrder{3, 99}, true},
		{`{"seq": 5}`, payloadOrder{-1, 5}, true},
		{`not json`, payloadOrder{}, false},
	} {
		got, err := readPayloadOrder([]byte(c.payload))
		if (err == nil) != c.ok || (c.ok && got != c.want) {
			t.Errorf("readPayloadOrder(%s) = %+v, %v; want %+v", c.payload, got, err, c.want)
		}
	}
}

func TestWaitName(t *testing.T) {
	for _, c := range []struct{ kind, state, waitType, wait, want string }{
		{"client backend", "idle", "Client", "ClientRead", ""},
		{"client backend", "active", "", "", "CPU"},
		{"client backend", "active", "IO", "WALSync", "IO:WALSync"},
		{"client backend", "idle in transaction", "Client", "ClientRead", "idle in transaction"},
		{"walwriter", "", "Activity", "WalWriterMain", ""},
		{"walwriter", "", "IO", "WALWrite", "IO:WALWrite (walwriter)"},
		{"checkpointer", "", "", "", "CPU (checkpointer)"},
	} {
		if got := waitName(c.kind, c.state, c.waitType, c.wait); got != c.want {
			t.Errorf("waitName(%q, %q, %q, %q) = %q, want %q", c.kind, c.state, c.waitType, c.wait, got, c.want)
		}
	}
}

func TestLimitOf(t *testing.T) {
	busy, calm := ptr(95.0), ptr(40.0)
	for _, c := range []struct {
		busy  *float64
		waits []Wait
		sink  time.Duration
		want  string
	}{
		{busy, []Wait{{"CPU", 3}, {"IO:WALSync", 1}}, 0, "CPU"},
		{calm, []Wait{{"CPU", 0.5}, {"IO:WALSync", 1.2}}, 0, "fsync"},
		{calm, []Wait{{"Lock:transactionid", 2}}, 0, "row locks"},
		{calm, []Wait{{"idle in transaction", 3}}, time.Millisecond, "transactions held open"},
		{calm, nil, time.Millisecond, "sink latency"},
		{calm, nil, 0, "round trips"},
	} {
		if got := limitOf(c.busy, c.waits, c.sink); !strings.HasPrefix(got, c.want) {
			t.Errorf("limitOf(%v, %v, %v) = %q, want it to start %q", *c.busy, c.waits, c.sink, got, c.want)
		}
	}
}

func TestPlan(t *testing.T) {
	cfg := Config{DatabaseURL: "x", ServerBinary: "outboxd"}
	if err := cfg.setDefaults(); err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, s := range plan(&cfg) {
		names = append(names, s.workload+"/"+s.arm+"/"+s.sink.String()+"/"+fmtCount(s.backlog))
	}
	got := strings.Join(names, " ")
	for _, want := range []string{
		"steady/ceiling-insert/0s/0", "steady/outboxd/5ms/0", "latency/outboxd/0s/0",
		"drain/naive-poller/0s/10k", "drain/outboxd/0s/1M", "hot/outboxd/0s/0",
		"steady/watermill/0s/0", "steady/watermill-10ms/5ms/0", "steady/river/1ms/0", "latency/river/0s/0",
		"producer/ceiling-insert/0s/0", "producer/emit/0s/0", "producer/insert-trigger/0s/0",
		"held-xmin/outboxd/0s/0", "held-xmin/river/0s/0", "replicas/outboxd/0s/0",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("plan lacks %s: %s", want, got)
		}
	}
	if strings.Contains(got, "drain/naive-poller/0s/1M") || strings.Contains(got, "steady/ceiling-insert/1ms") ||
		strings.Contains(got, "drain/river") || strings.Contains(got, "hot/watermill") {
		t.Errorf("plan runs what it should not: %s", got)
	}

	// Latency alone still measures the steady maximum it depends on, first.
	lat := Config{DatabaseURL: "x", ServerBinary: "outboxd", Workloads: []string{WorkloadLatency}, Arms: []string{ArmOutboxd}}
	if err := lat.setDefaults(); err != nil {
		t.Fatal(err)
	}
	p := plan(&lat)
	if len(p) != 2 || p[0].workload != WorkloadSteady || p[1].workload != WorkloadLatency {
		t.Fatalf("latency-only plan %+v", p)
	}
	// So do replicas alone.
	reps := Config{DatabaseURL: "x", ServerBinary: "outboxd", Workloads: []string{WorkloadReplicas}, Arms: []string{ArmOutboxd}}
	if err := reps.setDefaults(); err != nil {
		t.Fatal(err)
	}
	p = plan(&reps)
	if len(p) != 2 || p[0].workload != WorkloadSteady || p[1].workload != WorkloadReplicas {
		t.Fatalf("replicas-only plan %+v", p)
	}
}

func TestConfigRejects(t *testing.T) {
	for _, cfg := range []Config{
		{},
		{DatabaseURL: "x", Workloads: []string{"stedy"}},
		{DatabaseURL: "x", Arms: []string{"kafka"}},
		{DatabaseURL: "x", Producers: -1},
		{DatabaseURL: "x", DrainSizes: []int{5}},
		{DatabaseURL: "x", SinkLatencies: []time.Duration{-time.Millisecond}},
		{DatabaseURL: "x", Arms: []string{ArmOutboxd}}, // no server binary
		{DatabaseURL: "x", ServerBinary: "outboxd", Replicas: 1},
		// A replica without a relay.
		{DatabaseURL: "x", ServerBinary: "outboxd", Workloads: []string{WorkloadReplicas}, Relays: 1},
	} {
		if err := cfg.setDefaults(); err == nil {
			t.Errorf("config %+v accepted", cfg)
		}
	}
}

func TestWithDatabase(t *testing.T) {
	u, err := withDatabase("postgres://u:p@h:5433/postgres?sslmode=disable", "x_1")
	if err != nil || u != "postgres://u:p@h:5433/x_1?sslmode=disable" {
		t.Fatalf("URL: %q %v", u, err)
	}
	kv, err := withDatabase("host=h user=u dbname=postgres", "x_1")
	if err != nil || !strings.HasSuffix(kv, " dbname=x_1") {
		t.Fatalf("key=value: %q %v", kv, err)
	}
}

// The steady-cost goals: steady delivery against the insert-then-mark
// ceiling and against Watermill at its 10 ms poll, its CPU per event
// against producing plus draining the same events, the producer paths, a
// hot aggregate from a backlog, and many relays on one server.
func TestReportSteadyCostGoals(t *testing.T) {
	zero, one := ptr(0.0), ptr(1.0)
	cpu := func(r *Result, total float64) *Result {
		r.CPU.TotalMsPer1k = ptr(total)
		return r
	}
	many := result(WorkloadManyRelays, ArmOutboxd, zero, 0, 500)
	many.Relays, many.TargetRate = 300, 500
	many.Idle = &IdleFigures{ServerCorePct: ptr(2.5)}
	many.CommitToSink = &Percentiles{N: 10, P50Ms: 3, P99Ms: 300}
	hotDrain := result(WorkloadHotDrain, ArmOutboxd, zero, 5_000, 1_200)
	rep := &Report{Settings: Settings{SinkLatencyMs: []float64{0, 1}}, Results: []*Result{
		result(WorkloadSteady, ArmCeilingInsertMark, nil, 0, 4_000),
		cpu(result(WorkloadSteady, ArmOutboxd, zero, 0, 3_800), 480),
		result(WorkloadSteady, ArmWatermill10ms, zero, 0, 7_600),
		result(WorkloadSteady, ArmOutboxd, one, 0, 3_600),
		result(WorkloadSteady, ArmWatermill10ms, one, 0, 600),
		result(WorkloadProducer, ArmCeilingInsert, nil, 0, 10_000),
		cpu(result(WorkloadProducer, ArmEmit, nil, 0, 7_000), 200),
		result(WorkloadProducer, ArmInsertTrigger, nil, 0, 8_000),
		cpu(result(WorkloadDrain, ArmOutboxd, zero, 100_000, 20_000), 999),
		cpu(result(WorkloadDrain, ArmOutboxd, zero, 10_000, 20_000), 100),
		hotDrain,
		many,
	}}
	rep.finish()
	for _, c := range []struct {
		name string
		want float64
		met  bool
	}{
		{"outboxd steady / ceiling-insert-mark", 0.95, true},
		// The smallest backlog's drain: 480 / (200 + 100).
		{"outboxd steady CPU per event / (emit + drain 10k)", 1.6, false},
		{"outboxd / watermill-10ms steady (sink 0s)", 0.5, false},
		{"outboxd / watermill-10ms steady (sink 1ms)", 6, true},
		{"producer: client.Emit (INSERT, trigger) / plain INSERT", 0.8, false},
		{"outboxd hot aggregate, backlog of 5k", 1_200, false},
		{"outboxd many relays: server CPU while they idle", 2.5, true},
		{"outboxd many relays: p99 commit→sink at 500 ev/s", 300, false},
	} {
		r := findRatio(t, rep.Ratios, c.name)
		if r.Value == nil || math.Abs(*r.Value-c.want) > 1e-9 || r.Met == nil || *r.Met != c.met {
			t.Errorf("%s: value %v met %v, want %v met %v", r.Name, deref(r.Value), deref(r.Met), c.want, c.met)
		}
	}
}
