package devdb_test

import (
	"context"
	"log/slog"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/goleak"

	"github.com/outboxd/outboxd/internal/devdb"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// serverURL is the PostgreSQL the rest of the test suite uses.
func serverURL() string {
	if u := os.Getenv("TEST_DATABASE_URL"); u != "" {
		return u
	}
	return devdb.LocalURL
}

func testLogger(t *testing.T) *slog.Logger {
	return slog.New(slog.NewTextHandler(t.Output(), &slog.HandlerOptions{Level: slog.LevelDebug}))
}

func TestResolveUsesDatabaseURL(t *testing.T) {
	want := serverURL()
	t.Setenv(devdb.EnvVar, want)

	db, err := devdb.Resolve(t.Context(), testLogger(t), "")
	if err != nil {
		t.Fatal(err)
	}
	if db.URL != want || db.Source != devdb.SourceEnv {
		t.Errorf("Resolve = {URL: %q, Source: %q}, want {%q, %q}", db.URL, db.Source, want, devdb.SourceEnv)
	}
	if err := db.Close(t.Context()); err != nil {
		t.Errorf("Close: %v", err)
	}
}

func TestResolveBadDatabaseURLNamesVariable(t *testing.T) {
	t.Setenv(devdb.EnvVar, "postgres://postgres@127.0.0.1:"+closedPort(t)+"/postgres?sslmode=disable")

	db, err := devdb.Resolve(t.Context(), testLogger(t), "")
	if err == nil {
		db.Close(t.Context())
		t.Fatal("Resolve succeeded with DATABASE_URL pointing at a closed port")
	}
	if !strings.Contains(err.Error(), devdb.EnvVar) {
		t.Errorf("error does not name %s: %v", devdb.EnvVar, err)
	}
}

func TestFindBinariesPicksHighestVersion(t *testing.T) {
	root := t.TempDir()
	for _, v := range []string{"9.6", "15", "10", "nobin"} {
		dir := filepath.Join(root, v, "bin")
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		if v == "nobin" {
			continue
		}
		for _, name := range []string{"initdb", "pg_ctl"} {
			if err := os.WriteFile(filepath.Join(dir, name), []byte("#!/bin/sh\n"), 0o755); err != nil {
				t.Fatal(err)
			}
		}
	}

	initdb, pgCtl, err := devdb.FindBinaries([]string{filepath.Join(root, "*", "bin")})
	if err != nil {
		t.Fatal(err)
	}
	want := filepath.Join(root, "15", "bin")
	if initdb != filepath.Join(want, "initdb") || pgCtl != filepath.Join(want, "pg_ctl") {
		t.Errorf("FindBinaries = %q, %q; want both in %s", initdb, pgCtl, want)
	}

	if _, _, err := devdb.FindBinaries([]string{filepath.Join(root, "nobin", "bin")}); err == nil ||
		!strings.Contains(err.Error(), devdb.EnvVar) {
		t.Errorf("FindBinaries with no binaries: err = %v, want one suggesting %s", err, devdb.EnvVar)
	}
}

func TestThrowawayCluster(t *testing.T) {
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()

	db, err := devdb.StartThrowaway(ctx, testLogger(t))
	if err != nil {
		t.Fatal(err)
	}
	closed := false
	t.Cleanup(func() {
		if !closed {
			db.Close(context.Background())
		}
	})
	if db.Source != devdb.SourceThrowaway {
		t.Errorf("Source = %q, want %q", db.Source, devdb.SourceThrowaway)
	}
	dir := devdb.Dir(db)
	if _, err := os.Stat(dir); err != nil {
		t.Fatalf("cluster directory: %v", err)
	}

	conn, err := pgx.Connect(ctx, db.URL)
	if err != nil {
		t.Fatal(err)
	}
	var one int
	err = conn.QueryRow(ctx, "SELECT 1").Scan(&one)
	if cerr := conn.Close(ctx); cerr != nil {
		t.Errorf("closing connection: %v", cerr)
	}
	if err != nil || one != 1 {
		t.Fatalf("SELECT 1 = %d, %v", one, err)
	}

	u, err := url.Parse(db.URL)
	if err != nil {
		t.Fatal(err)
	}
	closed = true
	if err := db.Close(ctx); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if err := db.Close(ctx); err != nil {
		t.Errorf("second Close: %v", err)
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("cluster directory %s still there after Close (stat: %v)", dir, err)
	}
	if c, err := net.DialTimeout("tcp", u.Host, time.Second); err == nil {
		c.Close()
		t.Errorf("%s still accepts connections after Close", u.Host)
	}
}

// closedPort returns a loopback port nothing listens on.
func closedPort(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	_, port, _ := net.SplitHostPort(l.Addr().String())
	l.Close()
	return port
}
