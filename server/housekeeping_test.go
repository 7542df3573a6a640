package server_test

import (
	"context"
	"testing"
	"time"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
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
