package relay

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/outboxd/outboxd/internal/servertest"
	"github.com/outboxd/outboxd/server"
)

// orderedPublisher records every publish attempt in the order they start,
// fails one revision's first attempt, and reports two publishes of one
// aggregate at once.
type orderedPublisher struct {
	mu       sync.Mutex
	attempts []Event // in start order
	inFlight map[string]bool
	overlap  error
	failRev  int64
	failed   bool
	// hold, when set, makes the first publish of revision 1 wait for it.
	hold chan struct{}
}

func (p *orderedPublisher) Publish(ctx context.Context, ev Event) error {
	p.mu.Lock()
	if p.inFlight[ev.AggregateKey] && p.overlap == nil {
		p.overlap = fmt.Errorf("two publishes of aggregate %s at once (revision %d)", ev.AggregateKey, ev.Revision)
	}
	p.inFlight[ev.AggregateKey] = true
	p.attempts = append(p.attempts, ev)
	fail := ev.Revision == p.failRev && !p.failed
	if fail {
		p.failed = true
	}
	hold := p.hold
	if ev.Revision == 1 {
		p.hold = nil
	}
	p.mu.Unlock()
	defer func() {
		p.mu.Lock()
		p.inFlight[ev.AggregateKey] = false
		p.mu.Unlock()
	}()
	if hold != nil && ev.Revision == 1 {
		select {
		case <-hold:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	if fail {
		return errors.New("broker refused it this once")
	}
	return nil
}

// With a window, the runner publishes an aggregate's events one at a time
// in revision order, and stops at the first failure: it nacks the failed
// event once the acks before it have landed (the nack is applied, not
// refused as naming a revision past the lease's head), drops the rest of
// that window, and publishes nothing of the aggregate past the failed
// revision until it comes again.
func TestRunnerWindowStopsAtFirstFailure(t *testing.T) {
	t.Parallel()
	e := newEnv(t, servertest.Options{Configure: func(c *server.Config) {
		c.BackoffBase, c.BackoffCap = 5*time.Millisecond, 20*time.Millisecond
	}})
	const n = 30
	var ids []string
	for range n {
		ids = append(ids, e.emit(t, "orders", "a"))
	}
	// Found before the runner subscribes, so that its first claim leases
	// a whole window (a discovery round dispatches one event).
	waitUntil(t, "the aggregate discovered", func() bool { return e.aggregate(t, "orders", "a") != nil })
	hold := make(chan struct{})
	pub := &orderedPublisher{inFlight: map[string]bool{}, failRev: 7, hold: hold}
	queued := make(chan string, 4*n)
	dropped := make(chan string, 4*n)
	start(t, Config{Conn: e.srv.Conn, Publisher: pub, MaxInFlight: 16, MaxInFlightPerAggregate: 8}, hooks{
		windowQueued:  func(id string) { queued <- id },
		windowDropped: func(id string) { dropped <- id },
	})
	openAtEnd(t, hold)
	// The first lease covers revisions 1-8; hold revision 1 until all
	// eight are queued, so that 8 waits behind the failure of 7.
	for range 8 {
		waitSignal(t, "a window of 8 queued", queued)
	}
	close(hold)
	e.waitPublished(t, ids...)
	waitSignal(t, "a delivery of the failed window dropped", dropped)

	pub.mu.Lock()
	defer pub.mu.Unlock()
	if pub.overlap != nil {
		t.Fatal(pub.overlap)
	}
	// Attempts: 1..7 (7 fails), then 7 again before anything past it.
	var seq []int64
	for _, ev := range pub.attempts {
		seq = append(seq, ev.Revision)
	}
	failedAt := -1
	for i, r := range seq {
		if r == 7 {
			failedAt = i
			break
		}
	}
	if failedAt < 0 || failedAt+1 >= len(seq) || seq[failedAt+1] != 7 {
		t.Fatalf("attempts %v: after revision 7 failed, the next attempt must be 7 again", seq)
	}
	// First copies in revision order.
	next := int64(1)
	for _, r := range seq {
		if r > next {
			t.Fatalf("attempts %v: revision %d before %d", seq, r, next)
		}
		if r == next {
			next++
		}
	}
	var nacked int
	if err := e.pool.QueryRow(context.Background(),
		`SELECT count(*) FROM outbox.attempt WHERE revision = 7 AND outcome = 'nacked'`).Scan(&nacked); err != nil {
		t.Fatal(err)
	}
	if nacked != 1 {
		t.Fatalf("%d nacks of revision 7 recorded, want 1 (the nack must land after the acks of 1-6)", nacked)
	}
}

// Lines kept only to drop a failed lease's deliveries are forgotten once
// that lease has lapsed; lines still busy, or whose lease has not lapsed,
// stay.
func TestAggregateLinesPruneLapsedFailures(t *testing.T) {
	t.Parallel()
	now := time.Now()
	a := newAggregateLines(nil, nil, nil, context.Background(), context.Background())
	a.lines[aggregateRef{"s", "lapsed"}] = &aggregateLine{failedEpoch: 7, expiry: now.Add(-time.Second)}
	a.lines[aggregateRef{"s", "live"}] = &aggregateLine{failedEpoch: 7, expiry: now.Add(time.Minute)}
	a.lines[aggregateRef{"s", "busy"}] = &aggregateLine{failedEpoch: 7, expiry: now.Add(-time.Second), running: true}
	a.prune(now)
	if _, ok := a.lines[aggregateRef{"s", "lapsed"}]; ok {
		t.Error("a line whose failed lease lapsed is kept")
	}
	for _, k := range []string{"live", "busy"} {
		if _, ok := a.lines[aggregateRef{"s", k}]; !ok {
			t.Errorf("line %s was forgotten", k)
		}
	}
}
