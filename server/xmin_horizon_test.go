package server_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/server"
)

// outbox.xmin_horizon_holders names each session that holds the horizon,
// with a transaction id or with a snapshot alone, how far back and since
// when (the server's own role sees that of its sessions), and no longer
// once its transaction ends.
func TestXminHorizonHoldersNameEachHold(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	tag := uuid.NewString()[:8]
	snapshotApp, idApp := "snapshot-"+tag, "xid-"+tag
	testdb.HoldXminHorizon(t, ctx, url, snapshotApp, false, 100)
	testdb.HoldXminHorizon(t, ctx, url, idApp, true, 100)
	type hold struct {
		age    int64
		holder string
		since  *time.Time
	}
	holds := func() map[string]hold {
		rows, _ := pool.Query(ctx, `SELECT age, holder, since FROM outbox.xmin_horizon_holders()`)
		found := map[string]hold{}
		var h hold
		if _, err := pgx.ForEachRow(rows, []any{&h.age, &h.holder, &h.since}, func() error {
			for _, app := range []string{snapshotApp, idApp} {
				if strings.Contains(h.holder, "application "+app) {
					found[app] = h
				}
			}
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		return found
	}
	found := holds()
	// The snapshot was taken before the id, with 100 commits between.
	for app, least := range map[string]int64{snapshotApp: 200, idApp: 100} {
		h, ok := found[app]
		switch {
		case !ok:
			t.Fatalf("no hold of %s listed: %v", app, found)
		case h.age < least:
			t.Errorf("%s: age %d, want at least %d", app, h.age, least)
		case !strings.Contains(h.holder, "idle in transaction") || !strings.HasPrefix(h.holder, "pid "):
			t.Errorf("%s: holder %q does not say its pid and state", app, h.holder)
		case h.since == nil:
			t.Errorf("%s: no start time for a session of the server's own role", app)
		}
	}
	if _, err := pool.Exec(ctx, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name IN ($1, $2)`,
		snapshotApp, idApp); err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() int32 { return b2i(len(holds()) == 0) })
}

// GetLag and the metrics say how far back the cluster's xmin horizon is
// held and by whom; a stream-limited token is told how far, not by whom
// (the holder may be any database's session).
func TestLagSaysWhatHoldsTheXminHorizon(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	url := testdb.New(t)
	reg := prometheus.NewPedanticRegistry()
	r := startReplica(t, url, func(c *server.Config) { c.Registerer = reg })
	const n = 300
	testdb.HoldXminHorizon(t, ctx, url, "report-"+uuid.NewString()[:8], false, n)
	// The oldest hold in the cluster is this one or an older one.
	lag, err := r.Admin.GetLag(ctx, &outboxv1.GetLagRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if h := lag.GetXminHorizon(); h.GetAgeTransactions() < n || !strings.HasPrefix(h.GetHolder(), "pid ") &&
		!strings.HasPrefix(h.GetHolder(), "prepared transaction ") && !strings.HasPrefix(h.GetHolder(), "replication slot ") &&
		!strings.HasPrefix(h.GetHolder(), "standby ") {
		t.Fatalf("xmin_horizon %v while a snapshot is held %d transactions back", h, n)
	}
	if got := gatherSum(t, reg, "outboxd_xmin_horizon_age_transactions"); got < n {
		t.Fatalf("outboxd_xmin_horizon_age_transactions = %v while a snapshot is held %d transactions back", got, n)
	}

	ar := startAuthReplica(t, url)
	limited, err := outboxv1.NewAdminServiceClient(dialAs(t, ar, billingOps)).GetLag(ctx, &outboxv1.GetLagRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if h := limited.GetXminHorizon(); h.GetAgeTransactions() < n || h.GetHolder() != "" {
		t.Fatalf("a stream-limited token's xmin_horizon %v: want the age (at least %d) without the holder", h, n)
	}
	full, err := outboxv1.NewAdminServiceClient(dialAs(t, ar, adminToken)).GetLag(ctx, &outboxv1.GetLagRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if full.GetXminHorizon().GetHolder() == "" {
		t.Fatalf("an unrestricted admin token's xmin_horizon %v names no holder", full.GetXminHorizon())
	}
}
