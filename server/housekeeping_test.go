package server_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/store"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/server"
)

// A retention purge that cannot finish (here: blocked on a table lock) does
// not stop the replica refreshing its relay sessions, so they do not go
// stale and vanish from ListRelays.
func TestJanitorDoesNotStarveSessionRefresh(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	emit(t, pool, "orders", "o-1", 1)
	r := startReplica(t, url, func(c *server.Config) {
		c.Retention = time.Millisecond
		c.JanitorInterval = 10 * time.Millisecond
		c.SessionRefreshInterval = 20 * time.Millisecond
	})
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{Streams: []string{"orders"}, MaxInFlight: 1})
	header, err := st.Header()
	if err != nil {
		t.Fatal(err)
	}
	sessionID := header.Get(server.SessionIDHeader)[0]

	// Readers pass, the janitor's DELETE waits until this transaction ends.
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(context.Background())
	if _, err := tx.Exec(ctx, `LOCK TABLE outbox.event IN SHARE MODE`); err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() int32 {
		var n int32
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE wait_event_type = 'Lock' AND query LIKE '%DELETE FROM outbox.event%'
			  AND datname = current_database()`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	})
	var blockedAt time.Time
	if err := pool.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&blockedAt); err != nil {
		t.Fatal(err)
	}
	// The session's row is refreshed while the janitor stays blocked.
	waitFor(t, func() int32 {
		var seen time.Time
		if err := pool.QueryRow(ctx, `SELECT seen_at FROM outbox.relay_session WHERE session_id = $1`, sessionID).Scan(&seen); err != nil {
			t.Fatal(err)
		}
		if seen.After(blockedAt) {
			return 1
		}
		return 0
	})
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
}

// A replica removes the relay sessions other replicas stopped refreshing,
// never its own: a refresh delayed on a busy machine must not make its live
// sessions vanish from ListRelays (this made the test above flaky).
func TestStaleSessionCleanupSparesOwnSessions(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.NewPool(t)
	exec := func(sql string) {
		t.Helper()
		if _, err := pool.Exec(ctx, sql); err != nil {
			t.Fatal(err)
		}
	}
	exec(`INSERT INTO outbox.relay_session (session_id, relay_id, peer, replica_id, streams, max_in_flight, connected_at, seen_at)
		VALUES (gen_random_uuid(), 'r', 'p', 'me', '{}', 1, now(), now() - interval '1 hour'),
		       (gen_random_uuid(), 'r', 'p', 'crashed', '{}', 1, now(), now() - interval '1 hour')`)
	exec(`INSERT INTO outbox.delivered_count (stream, bucket, backend_pid, events)
		VALUES ('old', now() - interval '1 hour', 1, 5), ('recent', now(), 1, 5)`)
	if err := store.New(pool).DeleteStaleStats(ctx, time.Second, "me"); err != nil {
		t.Fatal(err)
	}
	var counts []string
	crows, err := pool.Query(ctx, `SELECT stream FROM outbox.delivered_count ORDER BY stream`)
	if err != nil {
		t.Fatal(err)
	}
	if counts, err = pgx.CollectRows(crows, pgx.RowTo[string]); err != nil {
		t.Fatal(err)
	}
	if len(counts) != 1 || counts[0] != "recent" {
		t.Fatalf("delivery counts left: %v, want only the recent bucket's", counts)
	}
	var left []string
	rows, err := pool.Query(ctx, `SELECT replica_id FROM outbox.relay_session`)
	if err != nil {
		t.Fatal(err)
	}
	if left, err = pgx.CollectRows(rows, pgx.RowTo[string]); err != nil {
		t.Fatal(err)
	}
	if len(left) != 1 || left[0] != "me" {
		t.Fatalf("sessions left: %v, want only this replica's", left)
	}
}

// A relay session's row goes when the session ends, even when a refresh of
// the replica's rows (here ListRelays's; the refresh loop's is the same)
// took the session into its snapshot before it ended and writes after: the
// refresh must not write the ended session's row back, where it would show
// in ListRelays and GetLag until it went stale and stay until another
// replica deleted it.
func TestARefreshDoesNotWriteBackAnEndedSessionsRow(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	emit(t, pool, "orders", "o-1", 1)
	r := startReplica(t, url, func(c *server.Config) { c.SessionRefreshInterval = time.Hour })
	streamCtx, endStream := context.WithCancel(ctx)
	defer endStream()
	st := subscribe(t, streamCtx, r, &outboxv1.SubscribeRequest{Streams: []string{"orders"}, MaxInFlight: 1})
	header, err := st.Header()
	if err != nil {
		t.Fatal(err)
	}
	sessionID := header.Get(server.SessionIDHeader)[0]
	rows := func() (n int32) {
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox.relay_session WHERE session_id = $1`, sessionID).Scan(&n); err != nil {
			t.Error(err)
		}
		return n
	}
	if n := rows(); n != 1 {
		t.Fatalf("subscribed session has %d rows, want 1", n)
	}

	// The refresh pauses between its snapshot and its write until the
	// removal has gone as far as it can: to waiting for the refresh, or,
	// were the two not serialized, through its DELETE.
	snapshotTaken, removalWaits, rowGone := make(chan struct{}), make(chan struct{}), make(chan struct{})
	r.Server.SetBeforeSaveSessions(sync.OnceFunc(func() {
		close(snapshotTaken)
		select {
		case <-removalWaits:
		case <-rowGone:
		}
	}), sync.OnceFunc(func() { close(removalWaits) }))
	listed := make(chan error, 1)
	go func() {
		_, err := r.Admin.ListRelays(ctx, &outboxv1.ListRelaysRequest{})
		listed <- err
	}()
	<-snapshotTaken
	var watch sync.WaitGroup
	watch.Add(1)
	go func() {
		defer watch.Done()
		for rows() != 0 {
			select {
			case <-ctx.Done():
				return
			case <-time.After(10 * time.Millisecond):
			}
		}
		close(rowGone)
	}()
	endStream()
	if err := <-listed; err != nil {
		t.Fatal(err)
	}
	<-r.Server.SessionsDone()
	if n := rows(); n != 0 {
		t.Errorf("the ended session has %d rows after the refresh, want none", n)
		cancel() // the watch would wait for the row for good
	}
	// Gone, the row ends the watch by itself: cancelled, its query under
	// way would fail the test with "context canceled".
	watch.Wait()
}
