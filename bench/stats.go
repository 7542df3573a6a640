package bench

import (
	"math"
	"slices"
	"time"
)

// Percentiles summarises one latency sample. Censored samples are lower
// bounds: events that had not reached the sink (or were not marked
// published) when the arm stopped, counted at the time it stopped, so that a
// backlog shows up in the tail instead of vanishing from it.
type Percentiles struct {
	N        int     `json:"n"`
	Censored int     `json:"censored"`
	P50Ms    float64 `json:"p50_ms"`
	P99Ms    float64 `json:"p99_ms"`
	P999Ms   float64 `json:"p999_ms"`
	MaxMs    float64 `json:"max_ms"`
	MeanMs   float64 `json:"mean_ms"`
}

// Quantile returns the nearest-rank q-quantile of sorted: the smallest sample
// such that at least a fraction q of all samples are at or below it. It
// never interpolates, so every figure reported is a latency that was
// actually observed. It returns 0 for an empty sample.
func Quantile(sorted []time.Duration, q float64) time.Duration {
	n := len(sorted)
	if n == 0 {
		return 0
	}
	// The epsilon keeps q*n from landing just above an integer through
	// floating-point error (0.999*1000 must be rank 999, not 1000).
	rank := int(math.Ceil(q*float64(n) - 1e-9))
	rank = min(max(rank, 1), n)
	return sorted[rank-1]
}

// Summarise sorts samples in place and returns their percentiles; censored
// says how many of them are lower bounds.
func Summarise(samples []time.Duration, censored int) Percentiles {
	slices.Sort(samples)
	p := Percentiles{N: len(samples), Censored: censored}
	if len(samples) == 0 {
		return p
	}
	var sum time.Duration
	for _, s := range samples {
		sum += s
	}
	p.P50Ms = ms(Quantile(samples, 0.50))
	p.P99Ms = ms(Quantile(samples, 0.99))
	p.P999Ms = ms(Quantile(samples, 0.999))
	p.MaxMs = ms(samples[len(samples)-1])
	p.MeanMs = ms(sum / time.Duration(len(samples)))
	return p
}

// CDFPoint is one point of an empirical distribution: a fraction of the
// sample is at or below Ms.
type CDFPoint struct {
	Ms       float64 `json:"ms"`
	Fraction float64 `json:"fraction"`
}

// CDF returns at most points points of the empirical distribution of
// sorted, evenly spaced in rank and always including the largest sample, so
// that a plot of a million samples stays small.
func CDF(sorted []time.Duration, points int) []CDFPoint {
	n := len(sorted)
	if n == 0 || points < 1 {
		return nil
	}
	points = min(points, n)
	out := make([]CDFPoint, 0, points)
	for i := 1; i <= points; i++ {
		rank := int(math.Ceil(float64(i) * float64(n) / float64(points)))
		out = append(out, CDFPoint{Ms: ms(sorted[rank-1]), Fraction: float64(rank) / float64(n)})
	}
	return out
}

// perSecond is count events over d as a rate; 0 when d is not positive.
func perSecond(count int64, d time.Duration) float64 {
	if d <= 0 {
		return 0
	}
	return float64(count) / d.Seconds()
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// ratio is a/b, or NaN when b is not positive (a figure that was not
// measured must not read as 0 or +Inf in a goal check).
func ratio(a, b float64) float64 {
	if b <= 0 || math.IsNaN(a) || math.IsNaN(b) {
		return math.NaN()
	}
	return a / b
}

// orNaN is *v, or NaN for a figure that was not measured.
func orNaN(v *float64) float64 {
	if v == nil {
		return math.NaN()
	}
	return *v
}
