package store_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxd/outboxd/internal/store"
	"github.com/outboxd/outboxd/internal/testdb"
)

// Pools set up by ConfigurePool encode uuid.UUID parameters as uuids, not
// through its driver.Valuer (a string, which pgx encodes only after a
// failed binary attempt), and keep an AfterConnect set before.
func TestConfigurePoolEncodesUUIDsDirectly(t *testing.T) {
	// Not parallel: testing.AllocsPerRun refuses to run in a parallel test.
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(testdb.New(t))
	if err != nil {
		t.Fatal(err)
	}
	earlier := false
	cfg.AfterConnect = func(context.Context, *pgx.Conn) error { earlier = true; return nil }
	store.ConfigurePool(cfg)
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	if !earlier {
		t.Error("the AfterConnect set before ConfigurePool did not run")
	}
	m := conn.Conn().TypeMap()
	if plan := m.PlanEncode(pgtype.UUIDOID, pgtype.BinaryFormatCode, uuid.New()); plan == nil ||
		strings.Contains(fmt.Sprintf("%T", plan), "DriverValuer") {
		t.Errorf("uuid.UUID encodes with %T, want a plan that does not go through driver.Valuer", plan)
	}
	// An array's elements: through driver.Valuer, 16 of them cost over 300
	// allocations (a string and an error each); directly, about 20.
	ids16 := make([]uuid.UUID, 16)
	for i := range ids16 {
		ids16[i] = uuid.New()
	}
	buf := make([]byte, 0, 1024)
	allocs := testing.AllocsPerRun(20, func() {
		if _, err := m.Encode(pgtype.UUIDArrayOID, pgtype.BinaryFormatCode, ids16, buf[:0]); err != nil {
			t.Fatal(err)
		}
	})
	if allocs > 64 {
		t.Errorf("encoding 16 uuids takes %.0f allocations, want at most 64 (not through driver.Valuer)", allocs)
	}
	// And round-trips through the database.
	ids := []uuid.UUID{uuid.New(), uuid.New()}
	var got []uuid.UUID
	var one uuid.UUID
	if err := conn.QueryRow(ctx, `SELECT $1::uuid[], $2::uuid`, ids, ids[1]).Scan(&got, &one); err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 || got[0] != ids[0] || got[1] != ids[1] || one != ids[1] {
		t.Fatalf("round trip: %v %v, want %v", got, one, ids)
	}
}

// Server connections are replaced every MaxConnLifetime or so, so that no
// plan cached while the tables were small outlives it, unless the URL sets
// a lifetime of its own.
func TestPoolReplacesConnectionsSoonerThanPgxpool(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		url          string
		life, jitter time.Duration
	}{
		{"postgres://127.0.0.1/x", store.MaxConnLifetime, store.MaxConnLifetime / 5},
		{"postgres://127.0.0.1/x?pool_max_conn_lifetime=30m", 30 * time.Minute, 0},
	} {
		cfg, err := pgxpool.ParseConfig(tc.url)
		if err != nil {
			t.Fatal(err)
		}
		store.ConfigurePool(cfg)
		if cfg.MaxConnLifetime != tc.life || cfg.MaxConnLifetimeJitter != tc.jitter {
			t.Errorf("%s: lifetime %v, jitter %v; want %v, %v", tc.url, cfg.MaxConnLifetime, cfg.MaxConnLifetimeJitter, tc.life, tc.jitter)
		}
	}
}

// A hint that knows nothing claims at once; "none" claims only at a poll;
// otherwise by the time given. Combined (the halves of a split ack batch),
// the hint that claims sooner wins.
func TestClaimHint(t *testing.T) {
	now := time.Unix(1000, 0)
	unknown := store.ClaimHint{}
	none := store.ClaimHint{Seen: true, None: true}
	ready := store.ClaimHint{Seen: true}
	in := func(d time.Duration) store.ClaimHint { return store.ClaimHint{Seen: true, In: d} }
	for _, c := range []struct {
		name    string
		h       store.ClaimHint
		wantNow bool
		wantBy  time.Time
	}{
		{"unknown", unknown, true, time.Time{}},
		{"ready", ready, true, time.Time{}},
		{"none", none, false, time.Time{}},
		{"in 5s", in(5 * time.Second), false, now.Add(5 * time.Second)},
		{"unknown and in 5s", unknown.Earliest(in(5 * time.Second)), true, time.Time{}},
		{"in 5s and unknown", in(5 * time.Second).Earliest(unknown), true, time.Time{}},
		{"none and in 5s", none.Earliest(in(5 * time.Second)), false, now.Add(5 * time.Second)},
		{"in 5s and none", in(5 * time.Second).Earliest(none), false, now.Add(5 * time.Second)},
		{"none and none", none.Earliest(none), false, time.Time{}},
		{"in 5s and in 2s", in(5 * time.Second).Earliest(in(2 * time.Second)), false, now.Add(2 * time.Second)},
		{"in 2s and ready", in(2 * time.Second).Earliest(ready), true, time.Time{}},
	} {
		gotNow, gotBy := c.h.ClaimAt(now)
		if gotNow != c.wantNow || !gotBy.Equal(c.wantBy) {
			t.Errorf("%s: ClaimAt = %v, %v; want %v, %v", c.name, gotNow, gotBy, c.wantNow, c.wantBy)
		}
	}
}

// PendingMigrations, in its one statement: every migration is pending in a
// database never migrated (no version table, which it must not create),
// none once migrated, and a version whose latest row is a rollback is
// pending again.
func TestPendingMigrations(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	empty := testdb.NewPoolURL(t, testdb.NewEmpty(t))
	if n, err := store.New(empty).PendingMigrations(ctx); err != nil || n != 1 {
		t.Fatalf("never migrated: %d pending, %v; want 1 (the one embedded migration)", n, err)
	}
	var created bool
	if err := empty.QueryRow(ctx, `SELECT to_regclass('outbox.goose_db_version') IS NOT NULL`).Scan(&created); err != nil || created {
		t.Fatalf("the check created the version table (%v, %v)", created, err)
	}
	pool := testdb.NewPoolURL(t, testdb.New(t))
	s := store.New(pool)
	if n, err := s.PendingMigrations(ctx); err != nil || n != 0 {
		t.Fatalf("migrated: %d pending, %v; want 0", n, err)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO outbox.goose_db_version (version_id, is_applied)
		SELECT max(version_id), false FROM outbox.goose_db_version`); err != nil {
		t.Fatal(err)
	}
	if n, err := s.PendingMigrations(ctx); err != nil || n != 1 {
		t.Fatalf("latest migration rolled back: %d pending, %v; want 1", n, err)
	}
	pool.Close()
	if _, err := s.PendingMigrations(ctx); err == nil || !strings.HasPrefix(err.Error(), "database unreachable: ") {
		t.Fatalf("closed pool: %v, want database unreachable", err)
	}
}

// A pool configured for outboxd pings an acquired connection only after
// PingAfterIdle, not after pgxpool's one second: a quiet source's checks
// come further apart than a second, and each would pay a round trip more.
func TestPoolPingsOnlyLongIdleConnections(t *testing.T) {
	cfg, err := pgxpool.ParseConfig("postgres://127.0.0.1:1/x")
	if err != nil {
		t.Fatal(err)
	}
	store.ConfigurePool(cfg)
	for idle, want := range map[time.Duration]bool{2 * time.Second: false, 10 * time.Second: false, store.PingAfterIdle + time.Second: true} {
		if got := cfg.ShouldPing(t.Context(), pgxpool.ShouldPingParams{IdleDuration: idle}); got != want {
			t.Errorf("idle %v: ping %v, want %v", idle, got, want)
		}
	}
}

// An idle replica's check runs up to 40 times a second per source, so
// PostgreSQL must plan it once, not on every call: the check with the probe
// and the check without each have no parameter, so that the connection's
// one cached plan serves every call and no custom plan is ever made. One
// statement with the probe switched off by a parameter was planned afresh
// on every call without it (its custom plan looked far cheaper than the
// generic one): 550 against 170 µs of backend CPU. The probe's statement
// took the longest due time as a parameter, and in some of 50 idle source
// databases (by their statistics) PostgreSQL kept choosing custom plans
// for it, 1.2 ms each: whether it does depends on statistics a test does
// not reproduce, so the test asks for none at all.
func TestRoundDueIsNotReplannedOnEveryCall(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	// One connection, so pg_prepared_statements shows the check's own.
	pool := testdb.NewPoolConfig(t, func(c *pgxpool.Config) { c.MaxConns = 1 })
	st := store.New(pool)
	const calls = 20
	for range calls {
		for _, probe := range []bool{false, true} {
			if _, _, err := st.RoundDue(ctx, probe, time.Hour); err != nil {
				t.Fatal(err)
			}
		}
	}
	rows, err := pool.Query(ctx, `SELECT left(statement, 60), generic_plans, custom_plans FROM pg_prepared_statements
		WHERE statement LIKE '%pg_snapshot_xmax(d.snapshot)%' AND statement NOT LIKE '%pg_prepared_statements%'`)
	if err != nil {
		t.Fatal(err)
	}
	type plans struct {
		Statement       string
		Generic, Custom int64
	}
	got, err := pgx.CollectRows(rows, pgx.RowToStructByPos[plans])
	if err != nil {
		t.Fatal(err)
	}
	if len(got) == 0 {
		t.Fatal("no prepared check statement on the connection")
	}
	if len(got) != 2 {
		t.Errorf("%d prepared check statements on the connection: %v; want 2 (with the probe and without)", len(got), got)
	}
	for _, p := range got {
		if p.Custom > 0 || p.Generic < calls {
			t.Errorf("%q: %d generic and %d custom plans over %d calls; want the one cached plan for every call (no custom plan)",
				p.Statement, p.Generic, p.Custom, calls)
		}
	}
}

// A discovery check that probes the claims says whether a claim of every
// stream would find an aggregate, and when the first one would be
// claimable; one that does not probe says nothing of them.
func TestRoundDueProbesTheClaims(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.NewPool(t)
	st := store.New(pool)
	const maxDue = 2 * time.Hour
	probe := func(want store.ClaimProbe, what string) {
		t.Helper()
		_, got, err := st.RoundDue(ctx, true, maxDue)
		if err != nil {
			t.Fatal(err)
		}
		if got.Probed != want.Probed || got.Claimable != want.Claimable || (got.NextIn < 0) != (want.NextIn < 0) ||
			want.NextIn >= 0 && (got.NextIn < want.NextIn-time.Minute || got.NextIn > want.NextIn) {
			t.Fatalf("%s: probe %+v, want %+v", what, got, want)
		}
	}
	exec := func(sql string) {
		t.Helper()
		if _, err := pool.Exec(ctx, sql); err != nil {
			t.Fatal(err)
		}
	}
	probe(store.ClaimProbe{Probed: true, NextIn: -1}, "nothing pending")
	exec(`SELECT outbox.emit('orders', 'a', 'created', '{}')`)
	exec(`SELECT outbox.discover()`)
	probe(store.ClaimProbe{Probed: true, Claimable: true, NextIn: 0}, "a ready aggregate")
	if _, got, err := st.RoundDue(ctx, false, maxDue); err != nil || got.Probed || got.Claimable {
		t.Fatalf("a check that does not probe: %+v, %v; want no probe", got, err)
	}
	exec(`SELECT count(*) FROM outbox.claim(gen_random_uuid(), 'r', 'replica', NULL, 10, interval '1 hour')`)
	probe(store.ClaimProbe{Probed: true, NextIn: time.Hour}, "an aggregate leased for an hour")
	exec(`UPDATE outbox.delivery SET lease_expires_at = now() - interval '1 second', claimable_at = now() - interval '1 second'`)
	probe(store.ClaimProbe{Probed: true, Claimable: true, NextIn: 0}, "a lease that expired")
}

// A lag read is one round trip: the console samples every source's lag
// every 10 s and each metrics scrape reads it, and on a quiet source every
// round trip wakes an idle backend, which costs PostgreSQL more than the
// statements do. Its statements go as one batch, from one acquire of the
// pool, with or without a stream filter.
func TestLagIsOneRoundTrip(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.NewPoolConfig(t, func(c *pgxpool.Config) { c.MaxConns = 1 })
	if _, err := pool.Exec(ctx, `INSERT INTO outbox.event (stream, aggregate_key, event_type, payload)
		VALUES ('orders', 'o1', 'created', '{}'), ('payments', 'p1', 'created', '{}')`); err != nil {
		t.Fatal(err)
	}
	st := store.New(pool)
	for _, filter := range [][]string{nil, {"orders"}} {
		before := pool.Stat().AcquireCount()
		lag, err := st.Lag(ctx, filter, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		if n := pool.Stat().AcquireCount() - before; n != 1 {
			t.Errorf("lag of %v took %d connections from the pool, want 1 (one batch)", filter, n)
		}
		want := 2
		if filter != nil {
			want = 1
		}
		if len(lag.Streams) != want || lag.Streams[0].Stream != "orders" || lag.Streams[0].PendingEvents != 1 ||
			lag.Now.IsZero() {
			t.Errorf("lag of %v: %+v, want %d streams from orders (1 pending) and the database clock", filter, lag, want)
		}
	}
}

// A discovery round that PostgreSQL refused or rolled back leased nothing,
// and Discover says so: only an answer lost after the round was sent wraps
// ErrAnswerLost, which makes every session that lent credit sweep for
// orphans (each sweep holds the replica's hand-over lock and costs a
// statement). A stopped discovery, retried every second or so until an
// operator re-scans, must not make them sweep each time.
func TestDiscoverLosesNoAnswerItWasRefused(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.NewPool(t)
	st := store.New(pool)
	if _, err := pool.Exec(ctx, `SELECT outbox.emit('orders', 'o', 'T', '{}')`); err != nil {
		t.Fatal(err)
	}
	offer := []store.Offer{{Holder: uuid.New(), RelayID: "r", TTL: time.Minute, Credit: 1}}

	bad := []store.Offer{{Holder: uuid.New(), RelayID: "r", TTL: 0, Credit: 1}}
	if _, err := st.Discover(ctx, "replica", 100, 0, bad, nil); err == nil || errors.Is(err, store.ErrAnswerLost) {
		t.Errorf("a refused offer: got %v, want an error that is not ErrAnswerLost", err)
	}
	if _, err := pool.Exec(ctx, `UPDATE outbox.discovery SET stopped_reason = 'test', stopped_at = now()`); err != nil {
		t.Fatal(err)
	}
	_, err := st.Discover(ctx, "replica", 100, 0, offer, nil)
	if !errors.Is(err, store.ErrDiscoveryStopped) || errors.Is(err, store.ErrAnswerLost) {
		t.Errorf("a stopped discovery: got %v, want ErrDiscoveryStopped and not ErrAnswerLost", err)
	}
	if _, err := pool.Exec(ctx, `UPDATE outbox.discovery SET stopped_reason = NULL, stopped_at = NULL`); err != nil {
		t.Fatal(err)
	}
	d, err := st.Discover(ctx, "replica", 100, 0, offer, nil)
	if err != nil || len(d.Dispatched) != 1 || d.LastHolder != offer[0].Holder {
		t.Fatalf("the round after: %+v, %v; want its one event dispatched to the offer", d, err)
	}
}
