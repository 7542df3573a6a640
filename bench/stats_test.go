package bench

import (
	"math"
	"slices"
	"strings"
	"testing"
	"time"
)

func durations(vs ...int) []time.Duration {
	out := make([]time.Duration, len(vs))
	for i, v := range vs {
		out[i] = time.Duration(v) * time.Millisecond
	}
	return out
}

func TestQuantileNearestRank(t *testing.T) {
	// 1..1000 ms: the nearest-rank p50 is the 500th value, p99 the 990th,
	// p99.9 the 999th; floating-point error must not push a rank up.
	var s []time.Duration
	for i := 1; i <= 1000; i++ {
		s = append(s, time.Duration(i)*time.Millisecond)
	}
	for _, c := range []struct {
		q    float64
		want time.Duration
	}{
		{0.5, 500 * time.Millisecond},
		{0.99, 990 * time.Millisecond},
		{0.999, 999 * time.Millisecond},
		{1, 1000 * time.Millisecond},
		{0, time.Millisecond},
	} {
		if got := Quantile(s, c.q); got != c.want {
			t.Errorf("Quantile(1..1000ms, %v) = %v, want %v", c.q, got, c.want)
		}
	}
}

func TestQuantileSmallSamples(t *testing.T) {
	if got := Quantile(nil, 0.5); got != 0 {
		t.Errorf("empty sample: %v, want 0", got)
	}
	one := durations(7)
	for _, q := range []float64{0, 0.5, 0.999, 1} {
		if got := Quantile(one, q); got != 7*time.Millisecond {
			t.Errorf("single sample, q=%v: %v", q, got)
		}
	}
	// With 10 samples p99 and p99.9 are the largest: never interpolated
	// past it, never below it.
	ten := durations(1, 2, 3, 4, 5, 6, 7, 8, 9, 10)
	if got := Quantile(ten, 0.99); got != 10*time.Millisecond {
		t.Errorf("p99 of 10 samples: %v, want the largest", got)
	}
	if got := Quantile(ten, 0.5); got != 5*time.Millisecond {
		t.Errorf("p50 of 10 samples: %v, want the 5th", got)
	}
}

func TestSummarise(t *testing.T) {
	s := durations(40, 10, 30, 20) // unsorted on purpose
	p := Summarise(s, 1)
	want := Percentiles{N: 4, Censored: 1, P50Ms: 20, P99Ms: 40, P999Ms: 40, MaxMs: 40, MeanMs: 25}
	if p != want {
		t.Fatalf("Summarise = %+v, want %+v", p, want)
	}
	if !slices.IsSorted(s) {
		t.Fatal("Summarise must sort in place")
	}
	if empty := Summarise(nil, 0); empty != (Percentiles{}) {
		t.Fatalf("Summarise(nil) = %+v", empty)
	}
}

func TestCDF(t *testing.T) {
	s := durations(1, 2, 3, 4, 5, 6, 7, 8, 9, 10)
	pts := CDF(s, 5)
	want := []CDFPoint{{2, 0.2}, {4, 0.4}, {6, 0.6}, {8, 0.8}, {10, 1}}
	if !slices.Equal(pts, want) {
		t.Fatalf("CDF = %v, want %v", pts, want)
	}
	// More points than samples: one per sample, ending at the maximum.
	all := CDF(durations(3, 9), 100)
	if len(all) != 2 || all[1] != (CDFPoint{9, 1}) {
		t.Fatalf("CDF of 2 samples = %v", all)
	}
	if CDF(nil, 10) != nil {
		t.Fatal("CDF of nothing")
	}
}

func TestRates(t *testing.T) {
	if got := perSecond(500, 2*time.Second); got != 250 {
		t.Errorf("perSecond = %v, want 250", got)
	}
	if got := perSecond(5, 0); got != 0 {
		t.Errorf("perSecond over no time = %v, want 0", got)
	}
	if got := ratio(3, 4); got != 0.75 {
		t.Errorf("ratio = %v", got)
	}
	if !math.IsNaN(ratio(3, 0)) || !math.IsNaN(ratio(math.NaN(), 1)) {
		t.Error("a ratio over nothing must be NaN, not a number that could pass a goal")
	}
}

// The latency workload runs at half of outboxd's steady rate in the same run
// unless --latency-rate fixes it; a negative or non-finite rate is refused.
func TestLatencyRate(t *testing.T) {
	zero := 0.0
	rep := &Report{Results: []*Result{{Workload: WorkloadSteady, Arm: ArmOutboxd, SinkLatencyMs: &zero, Throughput: 1200}}}
	if got, err := latencyRate(rep, 0, 0); err != nil || got != 600 {
		t.Errorf("derived rate: %v, %v; want 600", got, err)
	}
	if got, err := latencyRate(rep, 0, 250); err != nil || got != 250 {
		t.Errorf("fixed rate: %v, %v; want 250", got, err)
	}
	if _, err := latencyRate(&Report{}, 0, 0); err == nil {
		t.Error("no steady run and no fixed rate: want an error")
	}
	if got, err := latencyRate(&Report{}, 0, 400); err != nil || got != 400 {
		t.Errorf("fixed rate without a steady run: %v, %v; want 400", got, err)
	}
	for _, bad := range []float64{-1, math.Inf(1), math.NaN()} {
		c := Config{LatencyRate: bad, DatabaseURL: "postgres://127.0.0.1/x", ServerBinary: "outboxd"}
		if err := c.setDefaults(); err == nil || !strings.Contains(err.Error(), "--latency-rate") {
			t.Errorf("LatencyRate %v: %v; want an error naming --latency-rate", bad, err)
		}
	}
}
