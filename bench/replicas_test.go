package bench

import (
	"context"
	"fmt"
	"math"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strings"
	"testing"
	"time"
)

// Steady through two replicas of one database: both serve (their CPU is
// summed), the relays spread over them, nothing is lost or reordered, and
// every delivered event is counted on one of the three paths of some
// replica's /metrics.
func TestRunReplicas(t *testing.T) {
	if testing.Short() {
		t.Skip("needs PostgreSQL")
	}
	t.Parallel()
	var logs strings.Builder
	rep, err := Run(context.Background(), tinyConfig(t, &logs, []string{WorkloadReplicas}, ArmOutboxd))
	if err != nil {
		t.Fatalf("run: %v\nlogs:\n%s", err, logs.String())
	}
	if len(rep.Results) != 2 || rep.Results[0].Workload != WorkloadSteady {
		t.Fatalf("%d results, want steady, then replicas", len(rep.Results))
	}
	res := rep.find(WorkloadReplicas, ArmOutboxd, 0, 0)
	if res == nil || res.Replicas == nil {
		t.Fatal("no replicas result")
	}
	c, f := res.Counts, res.Replicas
	if c == nil || c.Lost != 0 || c.Reordered != 0 || c.Unexpected != 0 || c.Committed == 0 || c.Delivered != c.Committed {
		t.Fatalf("replicas account %+v", c)
	}
	// Every event reached a relay by one of the paths at least once.
	if f.Replicas != 2 || f.Dispatched+f.HandedOver+f.Claimed < float64(c.Delivered) {
		t.Errorf("replicas figures %+v for %d events delivered", *f, c.Delivered)
	}
	// Each replica has a relay of its own, and leased to it.
	if len(f.PerReplica) != 2 || f.PerReplica[0] == 0 || f.PerReplica[1] == 0 {
		t.Errorf("leases by replica %v: want some on each", f.PerReplica)
	}
	if res.CPU.ServerMsPer1k == nil {
		t.Error("no server CPU: the replicas' processes were not read")
	}
	for _, name := range []string{"outboxd 2 replicas / one replica steady", "outboxd 2 replicas: events the relays claimed"} {
		if r := findRatio(t, rep.Ratios, name); r.Value == nil {
			t.Errorf("%s: no value", name)
		}
	}
	assertNoScratchDatabases(t, rep)
}

// The replicas' figures in the report: the run against one replica's
// steady arm, and the claims' share of the three paths.
func TestReportReplicas(t *testing.T) {
	zero := ptr(0.0)
	reps := result(WorkloadReplicas, ArmOutboxd, zero, 0, 2_700)
	reps.Replicas = &ReplicasFigures{Replicas: 2, Dispatched: 600, HandedOver: 300, Claimed: 100, PerReplica: []float64{600, 400}}
	rep := &Report{Settings: Settings{SinkLatencyMs: []float64{0}}, Results: []*Result{
		result(WorkloadSteady, ArmOutboxd, zero, 0, 3_000), reps,
	}}
	rep.finish()
	for name, want := range map[string]float64{
		"outboxd 2 replicas / one replica steady":       0.9,
		"outboxd 2 replicas: events the relays claimed": 10,
	} {
		r := findRatio(t, rep.Ratios, name)
		if r.Value == nil || math.Abs(*r.Value-want) > 1e-9 || r.Met != nil {
			t.Errorf("%s: value %v met %v, want %v as context", name, deref(r.Value), r.Met, want)
		}
	}
	var text strings.Builder
	rep.WriteTable(&text)
	if !strings.Contains(text.String(), "dispatch 60.0 %, hand-over 30.0 %, claim 10.0 %; leases by replica: 600 / 400") {
		t.Errorf("text report lacks the paths:\n%s", text.String())
	}
	if !math.IsNaN((&ReplicasFigures{}).ClaimedPct()) {
		t.Error("a share of no leases is not NaN")
	}
}

// scrapeCounters sums each counter over its label sets and refuses a
// server that does not serve one of them.
func TestScrapeCounters(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprint(w, "# HELP a_total A.\n# TYPE a_total counter\na_total 3\n"+
			"# HELP b_total B.\n# TYPE b_total counter\nb_total{stream=\"x\"} 2\nb_total{stream=\"y\"} 5\n")
	}))
	defer srv.Close()
	got, err := scrapeCounters(context.Background(), srv.URL, "a_total", "b_total")
	if err != nil || len(got) != 2 || got[0] != 3 || got[1] != 7 {
		t.Fatalf("scrape: %v %v", got, err)
	}
	if _, err := scrapeCounters(context.Background(), srv.URL, "a_total", "c_total"); err == nil || !strings.Contains(err.Error(), "c_total") {
		t.Fatalf("a missing counter: %v", err)
	}
}

// The server's CPU is every replica's: serverCPU sums its processes.
func TestServerCPUSumsTheProcesses(t *testing.T) {
	if _, ok := processCPU(os.Getpid()); !ok {
		t.Skip("no process CPU times on this system")
	}
	// Enough CPU of this process that one reading is well under two.
	for start := time.Now(); time.Since(start) < 50*time.Millisecond; {
	}
	one, _ := processCPU(os.Getpid())
	two, ok := serverCPU(pidList{os.Getpid(), os.Getpid()})
	if !ok || two < 2*one {
		t.Fatalf("two readings of this process %v (ok %v), want at least twice one reading (%v)", two, ok, one)
	}
	if _, ok := serverCPU(pidList{}); ok {
		t.Fatal("no process read as a reading")
	}
}

type pidList []int

func (p pidList) pids() []int { return p }

// The relays spread over the replicas evenly, every one of them placed.
func TestSpread(t *testing.T) {
	for _, c := range []struct {
		k, n int
		want []int
	}{{4, 1, []int{4}}, {4, 2, []int{2, 2}}, {5, 2, []int{3, 2}}, {3, 3, []int{1, 1, 1}}, {7, 3, []int{3, 2, 2}}} {
		if got := spread(c.k, c.n); !slices.Equal(got, c.want) {
			t.Errorf("spread(%d, %d) = %v, want %v", c.k, c.n, got, c.want)
		}
	}
}
