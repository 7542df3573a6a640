package server_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/store"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/server"
)

// A database restored into another PostgreSQL cluster stops discovery on a
// running replica: the round fails, readiness (what /readyz and gRPC health
// serve) and GetLag say discovery is stopped, why, and what to run; events
// committed meanwhile wait. After the re-scan the same replica resumes by
// itself and delivers them, once and in order.
func TestRestoredDatabaseStopsDiscoveryUntilRescan(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	reg := prometheus.NewPedanticRegistry()
	r := startReplica(t, url, func(c *server.Config) { c.Registerer = reg })
	stoppedRounds := make(chan struct{}, 1)
	r.Server.SetAfterDiscover(func(d store.Discovery, err error) (store.Discovery, error) {
		if errors.Is(err, store.ErrDiscoveryStopped) {
			select {
			case stoppedRounds <- struct{}{}:
			default:
			}
		}
		return d, err
	})
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 4})
	emit(t, pool, "orders", "before", 1)
	ack(t, r, recv(t, st))

	// The restore, as far as discovery can tell: its state was stored by
	// another cluster.
	if _, err := pool.Exec(ctx, `UPDATE outbox.discovery SET system_identifier = 42`); err != nil {
		t.Fatal(err)
	}
	during := emit(t, pool, "orders", "during", 2)
	// Two stopped rounds: the loop has dealt with the first one.
	for range 2 {
		select {
		case <-stoppedRounds:
		case <-ctx.Done():
			t.Fatal("no discovery round stopped")
		}
	}
	if got := gatherSum(t, reg, "outboxd_discovery_stopped"); got != 1 {
		t.Fatalf("outboxd_discovery_stopped = %v, want 1", got)
	}

	wantStopped := func(what, reason string) {
		t.Helper()
		for _, s := range []string{"another PostgreSQL cluster", "outboxd rescan"} {
			if !strings.Contains(reason, s) {
				t.Fatalf("%s = %q, want it to say %q", what, reason, s)
			}
		}
	}
	rd := r.Server.CheckReadiness(ctx)
	if rd.Ready {
		t.Fatal("ready while discovery is stopped")
	}
	wantStopped("readiness reason", rd.Reason)
	// The replica's published readiness follows within its health interval.
	for r.App.Readiness().Ready {
		select {
		case <-ctx.Done():
			t.Fatal("the replica still reports ready")
		case <-time.After(50 * time.Millisecond):
		}
	}
	wantStopped("/readyz reason", r.App.Readiness().Reason)
	lag, err := r.Admin.GetLag(ctx, &outboxv1.GetLagRequest{})
	if err != nil {
		t.Fatal(err)
	}
	wantStopped("GetLag discovery_stopped", lag.GetDiscoveryStopped())
	var recorded bool
	if err := pool.QueryRow(ctx, `SELECT stopped_reason IS NOT NULL FROM outbox.discovery`).Scan(&recorded); err != nil || !recorded {
		t.Fatalf("the stop is not recorded in outbox.discovery (%v)", err)
	}

	res, err := store.New(pool).RescanDiscovery(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if res.Events != 2 || res.Aggregates != 1 {
		t.Fatalf("rescan = %+v, want 2 events of 1 aggregate", res)
	}
	for i, id := range during {
		d := recv(t, st)
		if d.GetEvent().GetEventId() != id.String() {
			t.Fatalf("delivery %d after the re-scan: %s revision %d, want during revision %d",
				i+1, d.GetEvent().GetAggregateKey(), d.GetEvent().GetRevision(), i+1)
		}
		ack(t, r, d)
	}
	if rd := r.Server.CheckReadiness(ctx); !rd.Ready {
		t.Fatalf("not ready after the re-scan: %s", rd.Reason)
	}
	if lag, err := r.Admin.GetLag(ctx, &outboxv1.GetLagRequest{}); err != nil || lag.GetDiscoveryStopped() != "" {
		t.Fatalf("GetLag after the re-scan: %q, %v", lag.GetDiscoveryStopped(), err)
	}
	// And new events are discovered again by the same replica.
	after := emit(t, pool, "orders", "after", 1)
	if d := recv(t, st); d.GetEvent().GetEventId() != after[0].String() {
		t.Fatalf("after the re-scan got %s revision %d, want the new event", d.GetEvent().GetAggregateKey(), d.GetEvent().GetRevision())
	} else {
		ack(t, r, d)
	}
}
