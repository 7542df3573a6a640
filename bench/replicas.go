package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// ReplicasFigures are the replicas workload's own figures: how the events
// reached the relays, summed over every replica's /metrics at the end of
// the arm. A discovery round's dispatch and an ack's hand-over give a
// session its next event with the write that leases it; a claim is a second
// write of the aggregate's delivery row, and under a held xmin horizon a
// walk past the dead entries earlier claims left. With several replicas a
// round that lost its turn to another replica's round could once leave
// most events to claims (BENCHMARKS.md), which no single-replica workload
// shows.
type ReplicasFigures struct {
	Replicas int `json:"replicas"`
	// Dispatched, HandedOver and Claimed count the leases each path gave
	// (outboxd_dispatched_total, outboxd_hand_overs_total,
	// outboxd_claimed_total, summed over the replicas).
	Dispatched float64 `json:"dispatched"`
	HandedOver float64 `json:"handed_over"`
	Claimed    float64 `json:"claimed"`
	// PerReplica is what each replica gave by the three paths together:
	// how evenly the relays' load fell.
	PerReplica []float64 `json:"per_replica"`
}

// ClaimedPct is the claims' share of every lease the three paths gave, in
// percent; NaN when none was given.
func (f *ReplicasFigures) ClaimedPct() float64 {
	return share(f.Claimed, f)
}

func share(n float64, f *ReplicasFigures) float64 {
	all := f.Dispatched + f.HandedOver + f.Claimed
	if all == 0 {
		return math.NaN()
	}
	return 100 * n / all
}

// replicaSet is several `outboxd serve` children on one database, each
// with its own gRPC and metrics address; relays spread over them.
type replicaSet struct {
	servers []*childServer
	metrics []string // each replica's /metrics URL
}

var _ serverHandle = (*replicaSet)(nil)

// startReplicaSet starts n replicas of binary serve against dbURL, named
// bench-r1, bench-r2, ..., each serving its metrics on a loopback port of
// its own.
func startReplicaSet(ctx context.Context, n int, binary string, flags []string, dbURL string, logw io.Writer) (*replicaSet, error) {
	rs := &replicaSet{}
	for i := 1; i <= n; i++ {
		httpAddr, err := freeLoopbackAddr()
		if err != nil {
			return nil, errors.Join(err, rs.stop(ctx))
		}
		// After the arm's own flags, so that these win over any of theirs.
		own := append(flags[:len(flags):len(flags)], "--http-listen="+httpAddr, fmt.Sprintf("--replica-id=bench-r%d", i))
		s, err := startChildServer(ctx, binary, own, dbURL, logw)
		if err != nil {
			return nil, errors.Join(fmt.Errorf("bench: replica %d: %w", i, err), rs.stop(ctx))
		}
		rs.servers = append(rs.servers, s)
		rs.metrics = append(rs.metrics, "http://"+httpAddr+"/metrics")
	}
	return rs, nil
}

func (rs *replicaSet) addrs() []string {
	var out []string
	for _, s := range rs.servers {
		out = append(out, s.addr())
	}
	return out
}

func (rs *replicaSet) pids() []int {
	var out []int
	for _, s := range rs.servers {
		out = append(out, s.pid())
	}
	return out
}

// peakRSS is the largest replica's peak resident set.
func (rs *replicaSet) peakRSS() (int64, bool) {
	var most int64
	for _, s := range rs.servers {
		rss, ok := s.peakRSS()
		if !ok {
			return 0, false
		}
		most = max(most, rss)
	}
	return most, len(rs.servers) > 0
}

func (rs *replicaSet) died() error {
	var errs []error
	for _, s := range rs.servers {
		errs = append(errs, s.died())
	}
	return errors.Join(errs...)
}

func (rs *replicaSet) stop(ctx context.Context) error {
	var errs []error
	for _, s := range rs.servers {
		errs = append(errs, s.stop(ctx))
	}
	return errors.Join(errs...)
}

// paths reads how the events reached the relays from every replica.
func (rs *replicaSet) paths(ctx context.Context) (*ReplicasFigures, error) {
	f := &ReplicasFigures{Replicas: len(rs.servers)}
	for _, url := range rs.metrics {
		values, err := scrapeCounters(ctx, url,
			"outboxd_dispatched_total", "outboxd_hand_overs_total", "outboxd_claimed_total")
		if err != nil {
			return nil, err
		}
		f.Dispatched += values[0]
		f.HandedOver += values[1]
		f.Claimed += values[2]
		f.PerReplica = append(f.PerReplica, values[0]+values[1]+values[2])
	}
	return f, nil
}

// scrapeCounters reads the named metrics, each a sum over its label sets,
// from a Prometheus text endpoint. A name the endpoint does not serve is an
// error: a server too old to count its paths would otherwise read as one
// that used none of them.
func scrapeCounters(ctx context.Context, url string, names ...string) ([]float64, error) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, fmt.Errorf("bench: read %s: %w", url, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("bench: read %s: %s", url, resp.Status)
	}
	parser := expfmt.NewTextParser(model.UTF8Validation)
	families, err := parser.TextToMetricFamilies(resp.Body)
	if err != nil {
		return nil, fmt.Errorf("bench: read %s: %w", url, err)
	}
	values := make([]float64, len(names))
	for i, name := range names {
		fam, ok := families[name]
		if !ok {
			return nil, fmt.Errorf("bench: %s serves no metric %s", url, name)
		}
		for _, m := range fam.GetMetric() {
			values[i] += m.GetCounter().GetValue()
		}
	}
	return values, nil
}
