package server

import (
	"context"
	"sync"
	"time"

	"github.com/outboxd/outboxd/internal/ration"
	"github.com/outboxd/outboxd/internal/store"
)

// lag reads the backlog of the streams of filter (nil: every stream) with
// the stranded audit's latest counts (strandedCounts).
func (s *Server) lag(ctx context.Context, filter []string) (store.Lag, error) {
	lag, err := s.store.Lag(ctx, filter, s.sessionTTL())
	if err != nil {
		return lag, err
	}
	counts, at, err := s.strandedCounts(ctx)
	if err != nil {
		return lag, err
	}
	lag.SetStranded(counts, at)
	return lag, nil
}

// strandedAudit rations the stranded-events audit (store.Stranded) for every
// reader of lag: GetLag, the lag metrics, the console's samples. The audit
// trusts nothing of delivery's states, so it reads every aggregate (about a
// quarter of a second of PostgreSQL per 100,000 aggregates, and a snapshot
// held as long); inline in every lag read, as it was, the console's sample
// every 10 s alone kept a database of a million aggregates a quarter busy,
// and made up half of what 50 idle sources cost PostgreSQL. Its counts can
// change only through a producer's late revision or a bug, so a minute old
// is fresh enough for an alert; each answer says when it was read.
type strandedAudit struct {
	mu      sync.Mutex
	counts  map[string]int64
	at      time.Time     // when the audit that read counts began; zero before the first
	tried   time.Time     // when the last audit, whether it succeeded or not, began
	took    time.Duration // how long that one ran
	running chan struct{} // closed when the audit under way ends; nil when none is
	err     error         // the last audit's error, for those who waited on it
	started int           // audits begun, for tests
}

// strandedAuditTimeout ends an audit that runs longer than this, whoever
// asked for it: a reader's own deadline (a metrics scrape's few seconds)
// does not cut it short, or on a large database no audit would ever finish.
const strandedAuditTimeout = 5 * time.Minute

// strandedFirstWait is how long a reader waits for the first audit before
// it answers without stranded counts: a metrics scrape (5 s) or an
// operator's lag must not fail because a large database's first audit
// takes longer than they do.
const strandedFirstWait = 2 * time.Second

// strandedCounts returns the stranded events per stream and when the audit
// that counted them began. When the counts are older than their pause it
// starts an audit, and waits for it only when there are no counts yet (then
// up to strandedFirstWait or ctx's end; without counts, at is zero and the
// counts nil, so that the reader reports them as not audited rather than
// fail); otherwise it answers with the last counts at once and the next
// reader gets the new ones. One audit runs at a time, whoever asks.
func (s *Server) strandedCounts(ctx context.Context) (map[string]int64, time.Time, error) {
	a := &s.stranded
	a.mu.Lock()
	// A failed audit waits out its pause too: one that timed out on a huge
	// table is not started again by the next reader.
	fresh := !a.tried.IsZero() && time.Since(a.tried) < ration.Pause(s.cfg.StrandedAuditInterval, a.took)
	if !fresh && a.running == nil {
		a.running, a.tried = make(chan struct{}), time.Now()
		a.started++
		go s.auditStranded(context.WithoutCancel(ctx), a.running)
	}
	counts, at, running := a.counts, a.at, a.running
	a.mu.Unlock()
	if !at.IsZero() || running == nil {
		// Counts to answer with, or none and no audit to wait for (the
		// first failed and its pause has not passed).
		return counts, at, nil
	}
	wait := time.NewTimer(strandedFirstWait)
	defer wait.Stop()
	select {
	case <-running:
	case <-wait.C:
		return nil, time.Time{}, nil
	case <-ctx.Done():
		return nil, time.Time{}, nil
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.at.IsZero() {
		return nil, time.Time{}, a.err
	}
	return a.counts, a.at, nil
}

// auditStranded runs one audit and records what it found, then closes done.
func (s *Server) auditStranded(ctx context.Context, done chan struct{}) {
	ctx, cancel := context.WithTimeout(ctx, strandedAuditTimeout)
	defer cancel()
	start := time.Now()
	counts, err := s.store.Stranded(ctx)
	took := time.Since(start)
	a := &s.stranded
	a.mu.Lock()
	defer a.mu.Unlock()
	a.err, a.took = err, took
	if err == nil {
		a.counts, a.at = counts, start
	} else {
		s.log.Warn("counting stranded events failed", "err", err, "took", took)
	}
	a.running = nil
	close(done)
}
