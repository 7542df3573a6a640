package server_test

// The housekeeping sweep's tests of the session refresh loop (sweep-house).

import (
	"context"
	"errors"
	"io"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/protobuf/types/known/timestamppb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"

	"github.com/outboxd/outboxd/internal/servertest"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/server"
)

// sentContaining is how many statements c counted whose text contains sub.
func sentContaining(c *statementCounter, sub string) (n int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for sql, k := range c.sent {
		if strings.Contains(sql, sub) {
			n += k
		}
	}
	return n
}

// The clean-up of stale session rows and delivery counts follows its own
// minute (staleStatsInterval), not the session refresh: over the first
// refreshes at 5 ms it runs once, at the first. The loop's hook counts
// its turns; a turn's clean-up is over before the next turn's hook runs.
// (The bound is the constant's minute, which a test of six 5 ms turns does
// not approach.) Kills H07 (the time of the last clean-up never kept).
func TestStaleRowCleanupRunsOncePerItsInterval(t *testing.T) {
	t.Parallel()
	url := testdb.New(t)
	sent := &statementCounter{}
	r := servertest.Start(t, url, servertest.Options{
		Configure:     func(c *server.Config) { c.SessionRefreshInterval = 5 * time.Millisecond },
		ConfigurePool: func(c *pgxpool.Config) { c.ConnConfig.Tracer = sent },
	})
	var turns atomic.Int32
	r.Server.SetAfterLoopWait(func(loop string, _, _ time.Duration, _ time.Time) {
		if loop == "refresh" {
			turns.Add(1)
		}
	})
	waitFor(t, func() int32 { return b2i(turns.Load() >= 6) })
	if n := sentContaining(sent, "stale_sessions"); n != 1 {
		t.Fatalf("%d clean-ups of stale session rows over the first 6 refreshes, want 1", n)
	}
}

// The janitor keeps what was published within the retention window and
// deletes what was published before it: with a window of an hour, events
// published (and created) two hours ago go and those of half an hour ago
// stay. Kills H12 (the cut-off a window after now instead of before).
func TestJanitorKeepsEventsPublishedWithinRetention(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, func(c *server.Config) {
		c.Retention = time.Hour
		c.JanitorInterval = time.Hour // runs only when the test says
	})
	emit(t, pool, "orders", "old", 3)
	emit(t, pool, "orders", "recent", 2)
	publishSome(t, ctx, r, "orders", 5)
	testdb.RewriteEvents(t, pool, `UPDATE outbox.event SET published_at = published_at - interval '2 hours', created_at = created_at - interval '2 hours' WHERE aggregate_key = 'old'`)
	testdb.RewriteEvents(t, pool, `UPDATE outbox.event SET published_at = published_at - interval '30 minutes', created_at = created_at - interval '30 minutes' WHERE aggregate_key = 'recent'`)
	deleted, _, err := r.Server.RunJanitor(ctx)
	if err != nil || deleted != 3 {
		t.Fatalf("janitor deleted %d, %v; want the 3 published two hours ago", deleted, err)
	}
	if n := countEvents(t, pool, "aggregate_key = 'recent'"); n != 2 {
		t.Fatalf("%d of the 2 events published half an hour ago left, with a retention of an hour", n)
	}
}

// A purge's last report is done with nothing remaining even when it
// deleted fewer events than its first estimate: here one of the 6 counted
// is deleted by another transaction while the purge's delete waits for
// its row lock, so the purge deletes 5. Kills H18 (remaining left at the
// estimate less what was deleted, 1, when done).
func TestPurgeDoneReportsNothingRemainingBelowItsEstimate(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute) // a hang guard
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	ids := emit(t, pool, "orders", "o-1", 6)
	publishSome(t, ctx, r, "orders", 6)
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(context.Background()) }()
	if _, err := tx.Exec(ctx, `DELETE FROM outbox.event WHERE event_id = $1`, ids[0]); err != nil {
		t.Fatal(err)
	}
	st, err := r.Admin.Purge(ctx, &outboxv1.PurgeRequest{PublishedBefore: timestamppb.New(time.Now().Add(time.Hour))})
	if err != nil {
		t.Fatal(err)
	}
	first, err := st.Recv()
	if err != nil || first.GetRemaining() != 6 || first.GetDone() {
		t.Fatalf("first report %v, %v; want the estimate of 6, not done", first, err)
	}
	waitBlocked(t, ctx, pool, "the purge's delete", "%DELETE FROM outbox.event e USING scan%")
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	last := first
	for {
		m, err := st.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		last = m
	}
	if !last.GetDone() || last.GetDeleted() != 5 || last.GetRemaining() != 0 {
		t.Fatalf("last report %v; want done, 5 deleted and none remaining", last)
	}
}

// cleanupTracer is a pgx tracer that runs before just before the first
// clean-up of stale session rows (store.DeleteStaleStats) is sent, and
// closes ended once that statement has returned.
type cleanupTracer struct {
	before        func()
	ended         chan struct{}
	started, done sync.Once
}

type cleanupStatementKey struct{}

func (c *cleanupTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	if !strings.Contains(data.SQL, "stale_sessions") {
		return ctx
	}
	first := false
	c.started.Do(func() { first = true; c.before() })
	return context.WithValue(ctx, cleanupStatementKey{}, first)
}

func (c *cleanupTracer) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryEndData) {
	if first, _ := ctx.Value(cleanupStatementKey{}).(bool); first {
		c.done.Do(func() { close(c.ended) })
	}
}

// The clean-up spares another replica's session row refreshed within three
// refresh intervals (sessionTTL), as ListRelays shows it: a row seen one
// and a half intervals ago stays, a row seen an hour ago goes. The rows are
// written just before the first clean-up's statement is sent (from the
// pool's tracer), so their ages are the database clock's, not the test's.
// Kills H05 (the clean-up given one refresh interval).
func TestStaleRowCleanupSparesRowsSeenWithinThreeRefreshes(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second) // a hang guard
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	tr := &cleanupTracer{ended: make(chan struct{}), before: func() {
		if _, err := pool.Exec(context.Background(), `INSERT INTO outbox.relay_session
			    (session_id, relay_id, peer, replica_id, streams, max_in_flight, connected_at, seen_at)
			VALUES (gen_random_uuid(), 'late', 'p', 'other', '{}', 1, now(), clock_timestamp() - interval '6 seconds'),
			       (gen_random_uuid(), 'crashed', 'p', 'other', '{}', 1, now(), clock_timestamp() - interval '1 hour')`); err != nil {
			t.Error(err)
		}
	}}
	servertest.Start(t, url, servertest.Options{
		Configure:     func(c *server.Config) { c.SessionRefreshInterval = 4 * time.Second }, // a TTL of 12 s
		ConfigurePool: func(c *pgxpool.Config) { c.ConnConfig.Tracer = tr },
	})
	select {
	case <-tr.ended:
	case <-ctx.Done():
		t.Fatal("no clean-up of stale session rows within 30s")
	}
	var relays []string
	rows, err := pool.Query(ctx, `SELECT relay_id FROM outbox.relay_session ORDER BY relay_id`)
	if err != nil {
		t.Fatal(err)
	}
	relays, err = pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	if len(relays) != 1 || relays[0] != "late" {
		t.Fatalf("session rows after the clean-up: %v; want late (seen 6 s ago, within 3 refreshes of 4 s) and not crashed", relays)
	}
}

// The clean-up deletes only delivery counts older than the minute GetLag's
// rate covers: events acked just before it still count in
// delivered_last_minute after it. The first clean-up waits (in the pool's
// tracer, before its statement is sent) until the test has acked three
// events. Kills L07 (every delivery count deleted).
func TestStaleRowCleanupKeepsTheLastMinutesDeliveryCounts(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second) // a hang guard
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	acked := make(chan struct{})
	tr := &cleanupTracer{ended: make(chan struct{}), before: func() {
		select {
		case <-acked:
		case <-ctx.Done():
		}
	}}
	r := servertest.Start(t, url, servertest.Options{
		Configure:     func(c *server.Config) { c.SessionRefreshInterval = 4 * time.Second },
		ConfigurePool: func(c *pgxpool.Config) { c.ConnConfig.Tracer = tr },
	})
	emit(t, pool, "orders", "o-1", 3)
	publishSome(t, ctx, r, "orders", 3)
	close(acked)
	select {
	case <-tr.ended:
	case <-ctx.Done():
		t.Fatal("no clean-up of stale rows within 30s")
	}
	lag, err := r.Admin.GetLag(ctx, &outboxv1.GetLagRequest{Streams: []string{"orders"}})
	if err != nil {
		t.Fatal(err)
	}
	if len(lag.GetStreams()) != 1 || lag.GetStreams()[0].GetDeliveredLastMinute() != 3 {
		t.Fatalf("lag after the clean-up: %v; want orders with 3 delivered in the last minute", lag)
	}
}
