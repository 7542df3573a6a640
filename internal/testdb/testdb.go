// Package testdb gives each test its own freshly migrated PostgreSQL database,
// cloned from a template that is migrated once per schema version, so tests
// run in parallel without touching each other.
//
// The server comes from TEST_DATABASE_URL, defaulting to the local
// PostgreSQL with trust auth (postgres://postgres@127.0.0.1:5432/postgres).
package testdb

import (
	"context"
	"database/sql"
	"fmt"
	"net/url"
	"os"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/jackc/pgx/v5/stdlib" // the "pgx" database/sql driver pgtestdb uses
	"github.com/peterldowns/pgtestdb"

	"github.com/outboxd/outboxd/migrations"
)

// DefaultURL is the server tests use when TEST_DATABASE_URL is unset.
const DefaultURL = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"

// ServerURL returns the URL of the PostgreSQL server tests run against.
func ServerURL() string {
	if u := os.Getenv("TEST_DATABASE_URL"); u != "" {
		return u
	}
	return DefaultURL
}

// New creates a fresh migrated database for t, dropped when t ends, and
// returns its connection URL.
func New(t testing.TB) string {
	t.Helper()
	return pgtestdb.Custom(t, serverConfig(t), migrator{}).URL()
}

// NewEmpty creates a fresh database with no outbox schema, for testing
// migrations themselves.
func NewEmpty(t testing.TB) string {
	t.Helper()
	return pgtestdb.Custom(t, serverConfig(t), pgtestdb.NoopMigrator{}).URL()
}

func serverConfig(t testing.TB) pgtestdb.Config {
	t.Helper()
	u, err := url.Parse(ServerURL())
	if err != nil {
		t.Fatalf("testdb: TEST_DATABASE_URL: %v", err)
	}
	pw, _ := u.User.Password()
	conf := pgtestdb.Config{
		DriverName: "pgx",
		Host:       u.Hostname(),
		Port:       u.Port(),
		User:       u.User.Username(),
		Password:   pw,
		Database:   trimSlash(u.Path),
		Options:    u.RawQuery,
		// Servers under test may leave connections behind when a test kills
		// them on purpose; the database must still be dropped.
		ForceTerminateConnections: true,
	}
	if conf.Port == "" {
		conf.Port = "5432"
	}
	return conf
}

// NewPool creates a fresh migrated database for t and a pool on it, closed
// before the database is dropped.
func NewPool(t testing.TB) *pgxpool.Pool {
	t.Helper()
	return NewPoolConfig(t, nil)
}

// NewPoolConfig is NewPool with a chance to adjust the pool's configuration
// (for example MaxConns) before it connects.
func NewPoolConfig(t testing.TB, configure func(*pgxpool.Config)) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(New(t))
	if err != nil {
		t.Fatalf("testdb: %v", err)
	}
	if configure != nil {
		configure(cfg)
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatalf("testdb: connect: %v", err)
	}
	t.Cleanup(pool.Close)
	return pool
}

func trimSlash(p string) string {
	if len(p) > 0 && p[0] == '/' {
		return p[1:]
	}
	return p
}

// migrator adapts the embedded migrations to pgtestdb's template cache.
type migrator struct{}

func (migrator) Hash() (string, error) { return migrations.Hash() }

func (migrator) Migrate(ctx context.Context, db *sql.DB, _ pgtestdb.Config) error {
	_, err := migrations.Up(ctx, db, nil)
	return err
}

// NewPoolURL returns a pool on the database at url, closed when t ends.
func NewPoolURL(t testing.TB, url string) *pgxpool.Pool {
	t.Helper()
	pool, err := pgxpool.New(context.Background(), url)
	if err != nil {
		t.Fatalf("testdb: connect: %v", err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// RewriteEvents runs sql (an UPDATE of outbox.event) with the table's
// triggers off, for tests that need what no producer or server may do, such
// as events created or published hours ago. The triggers are back on when it
// returns; the table is locked meanwhile.
func RewriteEvents(t testing.TB, pool *pgxpool.Pool, sql string, args ...any) {
	t.Helper()
	ctx := context.Background()
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, `ALTER TABLE outbox.event DISABLE TRIGGER USER`); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, sql, args...); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, `ALTER TABLE outbox.event ENABLE TRIGGER USER`)
		return err
	})
	if err != nil {
		t.Fatalf("testdb: rewrite events: %v", err)
	}
}

// HoldXminHorizon opens a session named app (its application_name) that
// holds the cluster's xmin horizon: withID, a transaction id left idle
// in transaction, else a REPEATABLE READ snapshot alone (no id: what
// pg_dump holds). It then commits n transactions elsewhere, so that the
// hold is at least n transactions back. release ends the session (and
// the hold); the test's end does too.
func HoldXminHorizon(t testing.TB, ctx context.Context, url, app string, withID bool, n int) (release func()) {
	t.Helper()
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.RuntimeParams["application_name"] = app
	holder, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	release = func() { holder.Close(context.Background()) }
	t.Cleanup(release)
	begin, take := `BEGIN ISOLATION LEVEL REPEATABLE READ`, `SELECT 1`
	if withID {
		begin, take = `BEGIN`, `SELECT txid_current()`
	}
	if _, err := holder.Exec(ctx, begin); err != nil {
		t.Fatal(err)
	}
	if _, err := holder.Exec(ctx, take); err != nil {
		t.Fatal(err)
	}
	burner, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer burner.Close(ctx)
	if _, err := burner.Exec(ctx, `SET synchronous_commit = off`); err != nil {
		t.Fatal(err)
	}
	// One statement, a commit per id (a DO block may commit when it is
	// the statement's only one).
	if _, err := burner.Exec(ctx, fmt.Sprintf(`DO $$ BEGIN FOR i IN 1..%d LOOP PERFORM txid_current(); COMMIT; END LOOP; END $$`, n)); err != nil {
		t.Fatal(err)
	}
	return release
}

// RefuseConnections makes database dbname refuse new connections
// (ALLOW_CONNECTIONS false), as a source that went down does, and ends the
// sessions it has, until allow is called or the test ends. A session that
// was starting while the setting changed still gets in, and is not in
// pg_stat_activity until it has: a test that waits for a server to notice
// the database is gone calls TerminateBackends in each turn of its wait, or
// that one session can keep the server's view of the database healthy.
func RefuseConnections(t testing.TB, admin *pgxpool.Pool, dbname string) (allow func()) {
	t.Helper()
	set := func(ctx context.Context, allowed bool) error {
		_, err := admin.Exec(ctx, fmt.Sprintf(`ALTER DATABASE %s ALLOW_CONNECTIONS %t`, pgx.Identifier{dbname}.Sanitize(), allowed))
		return err
	}
	if err := set(t.Context(), false); err != nil {
		t.Fatalf("testdb: refuse connections to %s: %v", dbname, err)
	}
	// When the test ends early: clean-ups that drop or reuse the database
	// need it to take connections.
	t.Cleanup(func() { _ = set(context.Background(), true) })
	TerminateBackends(t, admin, dbname)
	return func() {
		t.Helper()
		if err := set(t.Context(), true); err != nil {
			t.Fatalf("testdb: allow connections to %s: %v", dbname, err)
		}
	}
}

// TerminateBackends ends every session of database dbname but admin's own.
func TerminateBackends(t testing.TB, admin *pgxpool.Pool, dbname string) {
	t.Helper()
	if _, err := admin.Exec(t.Context(),
		`SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()`, dbname); err != nil {
		t.Fatalf("testdb: terminate the sessions of %s: %v", dbname, err)
	}
}
