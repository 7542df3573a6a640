package bench

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"go.uber.org/goleak"

	"github.com/outboxd/outboxd/internal/testdb"
)

// serverBinary is cmd/outboxd built once for the package's tests.
var serverBinary string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "outboxd-bench-test-")
	if err != nil {
		panic(err)
	}
	serverBinary, err = BuildServer(context.Background(), dir)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	// goleak.VerifyTestMain exits; the binary's directory goes first.
	goleak.VerifyTestMain(exitHook{m, dir})
}

// exitHook removes the test binary's directory once the tests ran.
type exitHook struct {
	m   *testing.M
	dir string
}

func (h exitHook) Run() int {
	code := h.m.Run()
	os.RemoveAll(h.dir)
	return code
}

// The whole pipeline, briefly, against the real PostgreSQL: every arm and
// workload runs and the account is clean. Nothing here asserts a timing: on
// a shared machine (and under -race) they mean nothing.
// tinyConfig is a run of workloads and arms at the tests' scale: windows of
// 300 ms after 100 ms of warm-up, 2 producers and 2 relays over 50
// aggregates, a 0 sink, warnings to logs.
func tinyConfig(t *testing.T, logs *strings.Builder, workloads []string, arms ...string) Config {
	return Config{
		DatabaseURL:   testdb.ServerURL(),
		ServerBinary:  serverBinary,
		Arms:          arms,
		Workloads:     workloads,
		Duration:      300 * time.Millisecond,
		Warmup:        100 * time.Millisecond,
		Producers:     2,
		Relays:        2,
		Aggregates:    50,
		SinkLatencies: []time.Duration{0},
		Logger:        slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelWarn})),
		Progress:      tWriter{t},
	}
}

func TestRunEndToEnd(t *testing.T) {
	if testing.Short() {
		t.Skip("needs PostgreSQL")
	}
	t.Parallel()
	ctx := context.Background()
	var logs strings.Builder
	cfg := tinyConfig(t, &logs, []string{WorkloadSteady, WorkloadLatency, WorkloadDrain, WorkloadHot},
		ArmCeilingInsert, ArmCeilingInsertMark, ArmNaivePoller, ArmOutboxd)
	cfg.SinkLatencies = []time.Duration{time.Millisecond}
	cfg.DrainSizes = []int{200}
	rep, err := Run(ctx, cfg)
	if err != nil {
		t.Fatalf("run: %v\nlogs:\n%s", err, logs.String())
	}
	// Every arm of every workload: 2 ceilings and 2 delivering arms in
	// steady, then 2 each in latency and drain, and in hot 3 (outboxd with
	// one event in flight and pipelined).
	if len(rep.Results) != 11 {
		t.Fatalf("%d results, want 11", len(rep.Results))
	}
	if w := rep.Results[len(rep.Results)-1]; w.Workload != WorkloadHot || w.Window != HotWindow {
		t.Fatalf("last result %s, want hot outboxd at window %d", w.label(), HotWindow)
	}
	for _, res := range rep.Results {
		if res.Arm == ArmCeilingInsert || res.Arm == ArmCeilingInsertMark {
			if res.Counts != nil {
				t.Errorf("%s: the ceilings deliver nothing to count", res.label())
			}
			continue
		}
		c := res.Counts
		if c == nil {
			t.Errorf("%s: no account", res.label())
			continue
		}
		if c.Lost != 0 || c.Reordered != 0 || c.Unexpected != 0 {
			t.Errorf("%s: %+v", res.label(), *c)
		}
		if c.Committed == 0 {
			t.Errorf("%s: nothing was committed", res.label())
		}
		// Every event of a drain is accounted for: delivered, or still
		// pending when the window closed. How many were delivered in time
		// depends on the machine (under -race on 2 busy cores the naive
		// poller may not finish 200 events in the window), so it is not
		// asserted.
		if res.Workload == WorkloadDrain && (c.Committed != int64(res.Backlog) || c.Delivered+c.Backlog != c.Committed) {
			t.Errorf("%s: %d committed (backlog %d), %d delivered + %d pending", res.label(),
				c.Committed, res.Backlog, c.Delivered, c.Backlog)
		}
	}
	if len(rep.Ratios) == 0 {
		t.Error("no ratios")
	}
	assertNoScratchDatabases(t, rep)
}

// The peers, the producer workload and held-xmin, briefly: every peer
// delivers through the same sink and ledger, nothing is lost, counts add
// up, and every arm reports its tables.
func TestRunPeersProducerHeldXmin(t *testing.T) {
	if testing.Short() {
		t.Skip("needs PostgreSQL")
	}
	t.Parallel()
	var logs strings.Builder
	cfg := tinyConfig(t, &logs, []string{WorkloadSteady, WorkloadProducer, WorkloadHeldXmin}, ArmOutboxd, ArmWatermill10ms, ArmRiver)
	cfg.Quick, cfg.Relays = true, 1
	rep, err := Run(t.Context(), cfg)
	if err != nil {
		t.Fatalf("run: %v\nlogs:\n%s", err, logs.String())
	}
	// steady: outboxd and two peers; producer: three paths; held-xmin:
	// outboxd under each holder (the quick set).
	want := map[string]int{WorkloadSteady: 3, WorkloadProducer: 3, WorkloadHeldXmin: 2}
	got := map[string]int{}
	for _, res := range rep.Results {
		got[res.Workload]++
		if len(res.Tables) == 0 {
			t.Errorf("%s: no table statistics", res.label())
		}
		if res.Workload == WorkloadProducer {
			if res.Counts != nil || res.Throughput <= 0 {
				t.Errorf("%s: counts %v, %v ev/s; want no account and some commits", res.label(), res.Counts, res.Throughput)
			}
			continue
		}
		c := res.Counts
		if c == nil {
			t.Errorf("%s: no account", res.label())
			continue
		}
		if c.Lost != 0 || c.Unexpected != 0 || (promisesOrder(res.Arm) && c.Reordered != 0) {
			t.Errorf("%s: %+v", res.label(), *c)
		}
		if c.Committed == 0 || c.Delivered+c.Backlog != c.Committed {
			t.Errorf("%s: %d committed, %d delivered + %d pending", res.label(), c.Committed, c.Delivered, c.Backlog)
		}
	}
	for w, n := range want {
		if got[w] != n {
			t.Errorf("%s: %d results, want %d", w, got[w], n)
		}
	}
	assertNoScratchDatabases(t, rep)
}

// An interrupted run still drops what it created.
func TestRunCancelledCleansUp(t *testing.T) {
	if testing.Short() {
		t.Skip("needs PostgreSQL")
	}
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(700*time.Millisecond, cancel)
	rep, err := Run(ctx, Config{
		DatabaseURL: testdb.ServerURL(), ServerBinary: serverBinary,
		Workloads: []string{WorkloadSteady}, Arms: []string{ArmOutboxd},
		Duration: 10 * time.Second, Warmup: 100 * time.Millisecond, Producers: 2, Relays: 1, Aggregates: 10,
		SinkLatencies: []time.Duration{0},
	})
	if err == nil {
		t.Fatal("an interrupted run reported success")
	}
	t.Logf("the interrupted run returned: %v", err) // (why, should a database be left)
	assertNoScratchDatabases(t, rep)
}

// assertNoScratchDatabases fails if a database of rep's run is left.
func assertNoScratchDatabases(t *testing.T, rep *Report) {
	t.Helper()
	if rep == nil || rep.ScratchPrefix == "" {
		t.Fatal("the report does not name the run's databases")
	}
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, testdb.ServerURL())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	rows, err := conn.Query(ctx, `SELECT datname FROM pg_database WHERE starts_with(datname, $1)`, rep.ScratchPrefix)
	if err != nil {
		t.Fatal(err)
	}
	left, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	if len(left) > 0 {
		t.Errorf("databases left behind: %v", left)
	}
}

// tWriter shows the run's progress lines with the test's output.
type tWriter struct{ t *testing.T }

func (w tWriter) Write(p []byte) (int, error) {
	w.t.Helper()
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

// --sink: every delivery goes through a real NATS JetStream first and is
// counted once the broker accepted it. Needs NATS on 127.0.0.1:4222 (CI
// starts it); the stream is the test's own and is deleted afterwards.
func TestRunWithNATSSink(t *testing.T) {
	if testing.Short() {
		t.Skip("needs PostgreSQL and NATS")
	}
	t.Parallel()
	const natsURL = "nats://127.0.0.1:4222"
	nc, err := nats.Connect(natsURL)
	if err != nil {
		t.Skipf("no NATS at %s: %v", natsURL, err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	name := strings.ToUpper(strings.TrimPrefix(newPrefix(), DatabasePrefix))
	stream := "OUTBOXD_BENCH_TEST_" + name
	t.Cleanup(func() { _ = js.DeleteStream(context.Background(), stream) })
	sinkURL := fmt.Sprintf("%s?stream=%s&subject=outboxdbenchtest%s.{stream}.{aggregate_key}&duplicates=10s",
		natsURL, stream, strings.ToLower(name))
	rep, err := Run(t.Context(), Config{
		DatabaseURL: testdb.ServerURL(), SinkURL: sinkURL,
		Workloads: []string{WorkloadSteady}, Arms: []string{ArmRiver},
		Duration: 300 * time.Millisecond, Warmup: 100 * time.Millisecond, Producers: 2, Aggregates: 20,
		SinkLatencies: []time.Duration{0}, Progress: tWriter{t},
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Results) != 1 || rep.Results[0].Counts == nil {
		t.Fatalf("results %+v", rep.Results)
	}
	c := rep.Results[0].Counts
	if c.Lost != 0 || c.Delivered == 0 || c.Delivered+c.Backlog != c.Committed {
		t.Fatalf("counts %+v", *c)
	}
	info, err := js.Stream(t.Context(), stream)
	if err != nil {
		t.Fatal(err)
	}
	// JetStream deduplicates on Nats-Msg-Id, so it holds each delivered
	// event once.
	if got := info.CachedInfo().State.Msgs; got != uint64(c.Delivered) {
		t.Errorf("the stream holds %d messages, the sink counted %d deliveries", got, c.Delivered)
	}
	if !strings.Contains(rep.Settings.Sink, "nats://") {
		t.Errorf("the report's sink is %q", rep.Settings.Sink)
	}
}
