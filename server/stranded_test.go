package server_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/store"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/server"
	"github.com/prometheus/client_golang/prometheus"
)

// lockLateEvents holds outbox.late_event in ACCESS EXCLUSIVE mode from a
// transaction of its own, which the caller ends (rolled back at the test's
// end otherwise): a stranded audit reads the table, so it waits there. It
// returns the transaction and its backend's pid, for pg_blocking_pids.
func lockLateEvents(t *testing.T, ctx context.Context, pool *pgxpool.Pool) (pgx.Tx, int) {
	t.Helper()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	var locker int
	if err := tx.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&locker); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, `LOCK TABLE outbox.late_event IN ACCESS EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	return tx, locker
}

// strandLost makes the delivery row of aggregate "lost" say idle while its
// event is pending, as a delivery bug would leave it, and puts it back when
// the test ends (the replica's cleanup counts stranded events).
func strandLost(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	ctx := context.Background()
	var claimable, since time.Time
	if err := pool.QueryRow(ctx, `UPDATE outbox.delivery d SET state = 'idle', claimable_at = NULL, pending_since = NULL
		FROM outbox.delivery o WHERE o.stream = d.stream AND o.aggregate_key = d.aggregate_key AND d.aggregate_key = 'lost'
		RETURNING o.claimable_at, o.pending_since`).Scan(&claimable, &since); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if _, err := pool.Exec(ctx, `UPDATE outbox.delivery SET state = 'ready', claimable_at = $1, pending_since = $2
			WHERE aggregate_key = 'lost'`, claimable, since); err != nil {
			t.Error(err)
		}
	})
}

// audited asks for lag until its stranded counts come from an audit
// (GetLag answers without them while the first audit runs longer than a
// reader waits for it).
func audited(t *testing.T, r *replica) (lag *outboxv1.GetLagResponse) {
	t.Helper()
	eventually(t, func() (bool, string) {
		var err error
		if lag, err = r.Admin.GetLag(context.Background(), &outboxv1.GetLagRequest{}); err != nil {
			t.Fatal(err)
		}
		return lag.GetStrandedAuditedAt() != nil, "no stranded audit finished"
	})
	return lag
}

// The stranded audit reads every aggregate, so its counts serve every lag
// reader until StrandedAuditInterval has passed: a stranded event appears
// only at the next audit, and each answer says when its audit began.
func TestStrandedAuditServesReadersUntilItsInterval(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, func(c *server.Config) { c.StrandedAuditInterval = time.Hour })
	emit(t, pool, "orders", "lost", 1)
	waitState(t, pool, "lost", "ready")
	first := audited(t, r)
	if n := first.GetTotal().GetStrandedEvents(); n != 0 {
		t.Fatalf("stranded before the test stranded anything: %d", n)
	}
	strandLost(t, pool)
	for range 3 {
		lag, err := r.Admin.GetLag(ctx, &outboxv1.GetLagRequest{})
		if err != nil {
			t.Fatal(err)
		}
		if n, at := lag.GetTotal().GetStrandedEvents(), lag.GetStrandedAuditedAt(); n != 0 || !at.AsTime().Equal(first.GetStrandedAuditedAt().AsTime()) {
			t.Fatalf("within the interval: %d stranded as of %v, want the first audit's 0 as of %v", n, at.AsTime(), first.GetStrandedAuditedAt().AsTime())
		}
	}
	if n := r.Server.StrandedAudits(); n != 1 {
		t.Fatalf("%d audits begun for 4 readers within the interval, want 1", n)
	}
}

// Past the interval the next reader starts an audit and a later one gets
// its counts: the stranded event shows, from an audit that began after it
// was stranded.
func TestStrandedAuditRunsAgainAfterItsInterval(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, func(c *server.Config) { c.StrandedAuditInterval = time.Millisecond })
	emit(t, pool, "orders", "lost", 1)
	waitState(t, pool, "lost", "ready")
	audited(t, r)
	var stranded time.Time
	if err := pool.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&stranded); err != nil {
		t.Fatal(err)
	}
	strandLost(t, pool)
	var lag *outboxv1.GetLagResponse
	eventually(t, func() (bool, string) {
		var err error
		if lag, err = r.Admin.GetLag(ctx, &outboxv1.GetLagRequest{}); err != nil {
			t.Fatal(err)
		}
		return lag.GetStrandedAuditedAt().AsTime().After(stranded),
			fmt.Sprintf("no audit after the interval: the last began at %v", lag.GetStrandedAuditedAt().AsTime())
	})
	if n := lag.GetTotal().GetStrandedEvents(); n != 1 {
		t.Fatalf("an audit begun after the event was stranded counts %d stranded, want 1", n)
	}
}

// A reader does not wait long for the first audit, nor does its end cut
// the audit short: with the audit blocked (a lock on a table only it
// reads), GetLag answers without stranded counts, the audit keeps waiting
// for the lock, and once the lock goes its counts serve the next readers.
func TestStrandedAuditOutlivesItsReader(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	reg := prometheus.NewPedanticRegistry()
	r := startReplica(t, url, func(c *server.Config) { c.Registerer = reg })
	// A stream, so that the metric would have a sample; its round is over
	// before the lock (a round's statement names late_event).
	emit(t, pool, "orders", "a", 1)
	waitState(t, pool, "a", "ready")
	tx, locker := lockLateEvents(t, ctx, pool)
	asked := time.Now()
	lag, err := r.Admin.GetLag(ctx, &outboxv1.GetLagRequest{})
	if err != nil {
		t.Fatalf("GetLag while the first audit is blocked: %v", err)
	}
	if at := lag.GetStrandedAuditedAt(); at != nil {
		t.Fatalf("stranded counts as of %v while the only audit is blocked", at.AsTime())
	}
	// Unknown is no sample, not a 0 an alert would take for "none".
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == "outboxd_stranded_events" {
			t.Fatalf("outboxd_stranded_events has %d samples before any audit finished", len(mf.GetMetric()))
		}
	}
	answered := time.Now()
	// The audit outlived the call: it waits for the lock (it may take a
	// moment to reach it on a loaded machine).
	eventually(t, func() (bool, string) {
		var blocked int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE $1 = ANY (pg_blocking_pids(pid)) AND query LIKE '%outbox.stranded(NULL)%'`, locker).Scan(&blocked); err != nil {
			t.Fatal(err)
		}
		return blocked == 1, fmt.Sprintf("%d audits wait for the lock after the reader returned, want 1", blocked)
	})
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	// With the default interval no second audit starts: the counts are
	// the first reader's audit's, once it could read.
	if at := audited(t, r).GetStrandedAuditedAt().AsTime(); at.Before(asked) || at.After(answered) {
		t.Fatalf("counts as of %v: not from the audit the reader at %v..%v started", at, asked, answered)
	}
}

// The lag metrics read the backlog at most every 2 s, and after a slow read
// no sooner than 20 times its length after it began: a lag read's cost
// follows the aggregates pending. On the test's clock: each read "takes"
// what the test says.
func TestLagMetricsRationSlowReads(t *testing.T) {
	t.Parallel()
	clock := time.Unix(1_700_000_000, 0)
	var reads int
	var takes time.Duration
	scrape := server.LagScraper(func(context.Context) (store.Lag, error) {
		reads++
		clock = clock.Add(takes)
		return store.Lag{}, nil
	}, func() time.Time { return clock })
	for i, step := range []struct {
		advance, takes time.Duration // before the scrape; how long a read it makes takes
		reads          int           // reads made in all after it
	}{
		{0, 3 * time.Second, 1},
		{10 * time.Second, 0, 1},                     // 13 s after the slow read began: within its 60 s
		{48 * time.Second, 10 * time.Millisecond, 2}, // 61 s after
		{1 * time.Second, 0, 2},                      // a fast read holds for 2 s
		{1500 * time.Millisecond, 0, 3},
	} {
		clock, takes = clock.Add(step.advance), step.takes
		if err := scrape(); err != nil {
			t.Fatal(err)
		}
		if reads != step.reads {
			t.Fatalf("scrape %d: %d reads in all, want %d", i+1, reads, step.reads)
		}
	}
}
