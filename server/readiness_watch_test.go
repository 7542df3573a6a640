package server_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/server"
)

// WatchReadiness reports every change, not only the first answer: ready,
// then not ready once a migration is pending, then ready again once it is
// not, each once, in that order.
func TestWatchReadinessReportsEachChange(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, func(c *server.Config) {
		c.DiscoveryIdleInterval = 5 * time.Millisecond
		c.SchemaCheckInterval = 10 * time.Millisecond
	})
	reports := make(chan server.Readiness, 64)
	watchCtx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		r.Server.WatchReadiness(watchCtx, 10*time.Millisecond, func(rd server.Readiness) { reports <- rd })
	}()
	defer func() { stop(); <-done }()
	next := func(what string) server.Readiness {
		t.Helper()
		select {
		case rd := <-reports:
			return rd
		case <-ctx.Done():
			t.Fatalf("no report %s", what)
			return server.Readiness{}
		}
	}
	if rd := next("at the start"); !rd.Ready {
		t.Fatalf("first report: not ready (%s), want ready", rd.Reason)
	}
	var pending int64
	if err := pool.QueryRow(ctx, `INSERT INTO outbox.goose_db_version (version_id, is_applied)
		SELECT max(version_id), false FROM outbox.goose_db_version RETURNING id`).Scan(&pending); err != nil {
		t.Fatal(err)
	}
	if rd := next("once a migration is pending"); rd.Ready || !strings.Contains(rd.Reason, "migration(s) pending") {
		t.Fatalf("report after a migration became pending: %+v, want not ready for it", rd)
	}
	if _, err := pool.Exec(ctx, `DELETE FROM outbox.goose_db_version WHERE id = $1`, pending); err != nil {
		t.Fatal(err)
	}
	if rd := next("once no migration is pending"); !rd.Ready {
		t.Fatalf("report after the migration was marked applied again: not ready (%s), want ready", rd.Reason)
	}
}
