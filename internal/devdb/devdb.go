// Package devdb finds a PostgreSQL server for `outboxd dev`, so that the
// command works on a fresh machine with no configuration at all.
//
// Resolve tries, in order: the server named by DATABASE_URL, a server with
// trust auth on the standard local port, and finally a throwaway cluster it
// creates with the PostgreSQL server binaries installed on the machine.
package devdb

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outboxd/outboxd/internal/connstring"
)

// Sources of a Database, reported in Database.Source so that `outboxd dev`
// can tell the user which server it is using and whether its data will
// survive the process.
const (
	// SourceEnv means the URL came from the DATABASE_URL environment
	// variable: the user chose the server explicitly.
	SourceEnv = "DATABASE_URL"
	// SourceFlag means the URL was given to Resolve (outboxd dev
	// --database-url): the user chose the server explicitly.
	SourceFlag = "--database-url"
	// SourceLocal means a server already running on 127.0.0.1:5432 with trust
	// auth for the postgres role was found; its data outlives the process.
	SourceLocal = "local"
	// SourceThrowaway means Resolve started a private cluster in a temporary
	// directory; Close stops it and deletes its data.
	SourceThrowaway = "throwaway"
)

// EnvVar is the environment variable Resolve consults first, the
// conventional name used by most tools, so an explicit choice always wins.
const EnvVar = "DATABASE_URL"

// LocalURL is the server Resolve probes when DATABASE_URL is unset: a stock
// package install (Debian, Homebrew, the official Docker image with
// POSTGRES_HOST_AUTH_METHOD=trust) listens here.
const LocalURL = "postgres://postgres@127.0.0.1:5432/postgres?sslmode=disable"

// Probe timeouts. The local probe is short because on most machines nothing
// listens there and the fallback should start promptly; an explicit
// DATABASE_URL may point at a remote server and gets more patience.
const (
	localProbeTimeout = 2 * time.Second
	envProbeTimeout   = 10 * time.Second
)

// Database is a PostgreSQL server ready for `outboxd dev`. It must be closed
// so that a throwaway cluster does not outlive the process.
type Database struct {
	// URL is a libpq-style connection URL for the server's postgres database.
	URL string
	// Source says where URL came from: SourceEnv, SourceLocal or
	// SourceThrowaway.
	Source string

	// stop shuts down and deletes a throwaway cluster; nil otherwise.
	stop func(ctx context.Context) error
	// pgCtl runs pg_ctl start or stop on a throwaway cluster; nil otherwise.
	pgCtl func(ctx context.Context, action string) error
	// dir is the throwaway cluster's temporary directory (data directory,
	// socket and log); empty otherwise. Kept for tests.
	dir string

	closeOnce sync.Once
	closeErr  error
}

// Close releases the database. For a throwaway cluster it stops the server
// (pg_ctl stop -m fast) and removes its temporary directory, so a dev run
// leaves nothing behind; for a server Resolve did not start it does nothing,
// because that server and its data belong to someone else. ctx bounds the
// shutdown, so pass a live context (not one already canceled by the signal
// that ended the dev run). Close is safe to call more than once and on nil.
func (d *Database) Close(ctx context.Context) error {
	if d == nil || d.stop == nil {
		return nil
	}
	d.closeOnce.Do(func() { d.closeErr = d.stop(ctx) })
	return d.closeErr
}

// StartThrowaway starts a throwaway cluster whatever else is available, for
// tests that must stop and restart their database server, or that need a
// server setting the shared one lacks: each of settings is a
// postgresql.conf line ("max_prepared_transactions = 4").
func StartThrowaway(ctx context.Context, logger *slog.Logger, settings ...string) (*Database, error) {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	return startThrowaway(ctx, logger, settings...)
}

// StopServer stops a throwaway cluster's server (pg_ctl stop -m fast) and
// keeps its data, so StartServer can bring it back on the same port.
func (d *Database) StopServer(ctx context.Context) error {
	if d.pgCtl == nil {
		return errors.New("devdb: only a throwaway cluster can be stopped")
	}
	return d.pgCtl(ctx, "stop")
}

// CrashServer stops a throwaway cluster's server the way a crash would
// (pg_ctl stop -m immediate: no checkpoint, nothing flushed), keeping its
// data; StartServer then runs crash recovery.
func (d *Database) CrashServer(ctx context.Context) error {
	if d.pgCtl == nil {
		return errors.New("devdb: only a throwaway cluster can be crashed")
	}
	return d.pgCtl(ctx, "crash")
}

// StartServer starts a throwaway cluster's server stopped by StopServer or
// CrashServer.
func (d *Database) StartServer(ctx context.Context) error {
	if d.pgCtl == nil {
		return errors.New("devdb: only a throwaway cluster can be started")
	}
	return d.pgCtl(ctx, "start")
}

// Resolve finds a PostgreSQL server for `outboxd dev`: given if not empty
// (--database-url), else DATABASE_URL if set (either must connect: a typo
// there should fail loudly rather than silently use another server), else
// the local server at LocalURL, else a throwaway cluster started from the
// installed server binaries. logger receives one line saying which was
// chosen, and debug lines about what was skipped; nil discards them. The
// returned error names every option that was tried.
func Resolve(ctx context.Context, logger *slog.Logger, given string) (*Database, error) {
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}

	for _, c := range []struct{ url, from, unset string }{
		{given, SourceFlag, "leave it out"},
		{os.Getenv(EnvVar), SourceEnv, "unset it"},
	} {
		if c.url == "" {
			continue
		}
		if err := ping(ctx, c.url, envProbeTimeout); err != nil {
			return nil, fmt.Errorf("devdb: %s is set but its server does not accept connections (%s to use a local or throwaway PostgreSQL instead): %w", c.from, c.unset, err)
		}
		logger.Info("using PostgreSQL from "+c.from, "url", connstring.Redact(c.url))
		return &Database{URL: c.url, Source: c.from}, nil
	}

	localErr := ping(ctx, LocalURL, localProbeTimeout)
	if localErr == nil {
		logger.Info("using local PostgreSQL", "url", LocalURL)
		return &Database{URL: LocalURL, Source: SourceLocal}, nil
	}
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("devdb: probing %s: %w", LocalURL, err)
	}
	logger.Debug("no local PostgreSQL", "url", LocalURL, "err", localErr)

	db, err := startThrowaway(ctx, logger)
	if err != nil {
		return nil, fmt.Errorf("devdb: no PostgreSQL available: %s is unset; %s did not answer (%v); starting a throwaway cluster failed: %w",
			EnvVar, LocalURL, localErr, err)
	}
	return db, nil
}

// ping connects to connURL and pings it within timeout, proving the server is
// up and accepts the URL's credentials.
func ping(ctx context.Context, connURL string, timeout time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	conn, err := pgx.Connect(ctx, connURL)
	if err != nil {
		return err
	}
	err = conn.Ping(ctx)
	return errors.Join(err, conn.Close(ctx))
}
