package server_test

import (
	"context"
	neturl "net/url"
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

// outbox.xmin_horizon_holders names each session that holds this
// database's horizon: with a transaction id in any database, or with a
// snapshot alone in this one (one in another database holds only that
// database's, and is not listed), of the server's role or another (whose
// start the server's role, not a member of pg_read_all_stats, is not
// shown), with how far back; and no longer once its transaction ends.
func TestXminHorizonHoldersNameEachHold(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	url, elsewhere := testdb.New(t), testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	admin := testdb.NewPoolURL(t, testdb.ServerURL())
	tag := strings.ReplaceAll(uuid.NewString(), "-", "")[:12]
	role := "xmin_holder_" + tag
	if _, err := admin.Exec(ctx, `CREATE ROLE `+role+` LOGIN`); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = admin.Exec(context.Background(), `DROP ROLE `+role) })
	asRole, err := neturl.Parse(url)
	if err != nil {
		t.Fatal(err)
	}
	asRole.User = neturl.User(role)
	type hold struct {
		app, url  string
		withID    bool
		listed    bool
		since     bool
		atLeast   int64
		holderHas string
	}
	holds := []hold{
		{app: "snapshot-" + tag, url: url, listed: true, since: true},
		{app: "xid-" + tag, url: url, withID: true, listed: true, since: true},
		{app: "other-role-" + tag, url: asRole.String(), listed: true, holderHas: "user " + role},
		{app: "elsewhere-snapshot-" + tag, url: elsewhere},
		{app: "elsewhere-xid-" + tag, url: elsewhere, withID: true, listed: true, since: true},
	}
	const n = 100
	for i := range holds {
		testdb.HoldXminHorizon(t, ctx, holds[i].url, holds[i].app, holds[i].withID, n)
	}
	type found struct {
		age    int64
		holder string
		since  *time.Time
	}
	read := func() map[string]found {
		rows, _ := pool.Query(ctx, `SELECT age, holder, since FROM outbox.xmin_horizon_holders()`)
		byApp := map[string]found{}
		var f found
		if _, err := pgx.ForEachRow(rows, []any{&f.age, &f.holder, &f.since}, func() error {
			for _, h := range holds {
				if strings.Contains(f.holder, "application "+h.app+",") || strings.HasSuffix(f.holder, "application "+h.app+")") {
					byApp[h.app] = f
				}
			}
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		return byApp
	}
	byApp := read()
	for _, h := range holds {
		f, ok := byApp[h.app]
		switch {
		case ok != h.listed:
			t.Errorf("%s: listed %v, want %v (%v)", h.app, ok, h.listed, f)
		case !ok:
		case f.age < n:
			t.Errorf("%s: age %d, want at least %d", h.app, f.age, n)
		case !strings.HasPrefix(f.holder, "pid ") || !strings.Contains(f.holder, h.holderHas):
			t.Errorf("%s: holder %q does not say its pid and %q", h.app, f.holder, h.holderHas)
		case (f.since != nil) != h.since:
			t.Errorf("%s: start time %v, want one shown: %v", h.app, f.since, h.since)
		case h.since && !strings.Contains(f.holder, "idle in transaction"):
			t.Errorf("%s: holder %q does not say its state", h.app, f.holder)
		}
	}
	var apps []string
	for _, h := range holds {
		apps = append(apps, h.app)
	}
	if _, err := admin.Exec(ctx, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = ANY ($1)`, apps); err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() int32 { return b2i(len(read()) == 0) })
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
	app := "report-" + uuid.NewString()[:8]
	testdb.HoldXminHorizon(t, ctx, url, app, false, n)
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
	// When the oldest hold is this test's own session (another package's
	// test may hold an older one, of a role whose start this one cannot
	// see), the response says since when.
	if h := lag.GetXminHorizon(); strings.Contains(h.GetHolder(), "application "+app) {
		since := h.GetHeldSince()
		if since == nil || since.AsTime().After(time.Now().Add(time.Second)) || time.Since(since.AsTime()) > time.Minute {
			t.Fatalf("xmin_horizon %v: held_since %v, want the holder's transaction start", h, since)
		}
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
