package server_test

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/server"
)

// The retention janitor counts what it deleted in
// outboxd_purged_events_total, the figure an operator watches to see that
// retention works.
func TestJanitorCountsWhatItPurged(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	reg := prometheus.NewPedanticRegistry()
	r := startReplica(t, url, func(c *server.Config) {
		c.Registerer = reg
		c.Retention = time.Minute
		c.JanitorInterval = time.Hour // runs only when the test says
		c.JanitorBatch = 2
	})
	emit(t, pool, "orders", "o-1", 5)
	publishSome(t, ctx, r, "orders", 3)
	testdb.RewriteEvents(t, pool, `UPDATE outbox.event SET published_at = published_at - interval '1 hour', created_at = created_at - interval '1 hour' WHERE published_at IS NOT NULL`)
	deleted, _, err := r.Server.RunJanitor(ctx)
	if err != nil || deleted != 3 {
		t.Fatalf("janitor deleted %d, %v; want 3", deleted, err)
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var purged float64 = -1
	for _, mf := range mfs {
		if mf.GetName() == "outboxd_purged_events_total" {
			purged = mf.GetMetric()[0].GetCounter().GetValue()
		}
	}
	if purged != 3 {
		t.Fatalf("outboxd_purged_events_total = %v after the janitor deleted 3, want 3", purged)
	}
}
