package bench

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"os/exec"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/jackc/pgx/v5/stdlib" // the "pgx" database/sql driver migrations use

	"github.com/outboxd/outboxd/migrations"
)

// DatabasePrefix starts the name of every database the benchmark creates, so
// that leftovers of a run that was killed are easy to find and drop.
const DatabasePrefix = "outboxd_bench_"

// benchSchema holds the tables of the arms that do not go through outboxd:
// the ceilings' plain event table and the naive poller's textbook schema.
// It lives in the same database as the outbox schema, as docs/benchmark.md
// asks.
const benchSchema = `
CREATE SCHEMA bench;

-- ceiling-insert and ceiling-insert-mark: outbox.event's columns, its unique
-- constraint and a pending index, but no trigger, function or notification.
-- The revision comes from a sequence, so no per-aggregate work is done.
CREATE SEQUENCE bench.ceiling_revision;
CREATE TABLE bench.ceiling_event (
    event_id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    stream text NOT NULL,
    aggregate_key text NOT NULL,
    revision bigint NOT NULL DEFAULT nextval('bench.ceiling_revision'),
    event_type text NOT NULL,
    payload jsonb NOT NULL,
    headers jsonb NOT NULL DEFAULT '{}',
    created_at timestamptz NOT NULL DEFAULT now(),
    published_at timestamptz,
    UNIQUE (stream, aggregate_key, revision)
) WITH (fillfactor = 90);
CREATE INDEX ceiling_event_pending_idx ON bench.ceiling_event (stream, aggregate_key, revision)
    WHERE published_at IS NULL;

-- naive-poller: the textbook schema. The aggregate row is both the
-- producers' revision counter and the row the poller locks.
CREATE TABLE bench.naive_aggregate (
    aggregate_key text PRIMARY KEY,
    revision bigint NOT NULL DEFAULT 0 CHECK (revision >= 0)
);
CREATE TABLE bench.naive_event (
    event_id uuid PRIMARY KEY DEFAULT gen_random_uuid(),
    stream text NOT NULL,
    aggregate_key text NOT NULL REFERENCES bench.naive_aggregate (aggregate_key),
    revision bigint NOT NULL CHECK (revision > 0),
    event_type text NOT NULL,
    payload jsonb NOT NULL,
    headers jsonb NOT NULL DEFAULT '{}',
    created_at timestamptz NOT NULL DEFAULT now(),
    published_at timestamptz,
    CONSTRAINT naive_event_aggregate_revision_key UNIQUE (aggregate_key, revision)
);
CREATE INDEX naive_event_pending_idx ON bench.naive_event (aggregate_key, revision)
    WHERE published_at IS NULL;
`

// scratch owns the databases of one benchmark run on the server named by
// the admin URL: a template migrated once, and a fresh clone of it per arm,
// so that no arm sees another's rows, dead tuples or statistics. close drops
// them all, also after an error or an interrupt.
type scratch struct {
	adminURL string
	prefix   string
	template string
	log      *slog.Logger

	mu      sync.Mutex
	created []string
	n       int
}

// newPrefix returns a fresh name prefix for one run's databases.
func newPrefix() string {
	var suffix [4]byte
	_, _ = rand.Read(suffix[:]) // never fails (crypto/rand)
	return DatabasePrefix + hex.EncodeToString(suffix[:])
}

// newScratch creates and migrates the run's template database; every
// database it creates is named prefix_*. With a server binary, the schema is
// that binary's (`outboxd migrate`), so that comparing two builds compares
// their SQL too; without one, the migrations this module links.
func newScratch(ctx context.Context, adminURL, prefix, serverBinary string, log *slog.Logger) (_ *scratch, err error) {
	s := &scratch{adminURL: adminURL, prefix: prefix, log: log}
	s.template = s.prefix + "_template"
	if err := s.warnLeftovers(ctx); err != nil {
		return nil, err
	}
	// Set before the template's create: create records the database and
	// then reports an interrupt that came meanwhile, and the database it
	// recorded must be dropped all the same.
	defer func() {
		if err != nil {
			err = errors.Join(err, s.close(ctx))
		}
	}()
	if err := s.create(ctx, s.template, ""); err != nil {
		return nil, err
	}
	tmplURL, err := withDatabase(adminURL, s.template)
	if err != nil {
		return nil, err
	}
	db, err := sql.Open("pgx", tmplURL)
	if err != nil {
		return nil, err
	}
	defer db.Close()
	if serverBinary != "" {
		out, err := exec.CommandContext(ctx, serverBinary, "migrate", "--database-url", tmplURL).CombinedOutput()
		if err != nil {
			return nil, fmt.Errorf("bench: migrate the template database with %s: %w: %s", serverBinary, err, out)
		}
	} else if _, err := migrations.Up(ctx, db, nil); err != nil {
		return nil, fmt.Errorf("bench: migrate the template database: %w", err)
	}
	if _, err := db.ExecContext(ctx, benchSchema); err != nil {
		return nil, fmt.Errorf("bench: create the benchmark's own tables: %w", err)
	}
	// The peers' own schemas, made by their own tools: River's migrator and
	// the table Watermill's queue schema initialises.
	pool, err := pgxpool.New(ctx, tmplURL)
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	if err := migrateRiver(ctx, pool); err != nil {
		return nil, err
	}
	if err := createWatermillTable(ctx, pool); err != nil {
		return nil, err
	}
	return s, nil
}

// warnLeftovers points at databases an earlier run could not drop (it was
// killed). They are not dropped here: another run may be using them.
func (s *scratch) warnLeftovers(ctx context.Context) error {
	conn, err := pgx.Connect(ctx, s.adminURL)
	if err != nil {
		return fmt.Errorf("bench: connect to %s: %w", redactURL(s.adminURL), err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	rows, err := conn.Query(ctx, `SELECT datname FROM pg_database WHERE datname LIKE $1 ORDER BY 1`, DatabasePrefix+"%")
	if err != nil {
		return fmt.Errorf("bench: list databases: %w", err)
	}
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return fmt.Errorf("bench: list databases: %w", err)
	}
	if len(names) > 0 {
		s.log.Warn("databases left by an earlier benchmark run that was killed; drop them with DROP DATABASE ... WITH (FORCE) once no run uses them",
			"databases", strings.Join(names, ","))
	}
	return nil
}

// clone creates a fresh database for one arm from the template and returns
// its name and URL.
func (s *scratch) clone(ctx context.Context, arm string) (name, dbURL string, err error) {
	s.mu.Lock()
	s.n++
	name = fmt.Sprintf("%s_%02d_%s", s.prefix, s.n, strings.ReplaceAll(arm, "-", "_"))
	s.mu.Unlock()
	if err := s.create(ctx, name, s.template); err != nil {
		return "", "", err
	}
	dbURL, err = withDatabase(s.adminURL, name)
	return name, dbURL, err
}

// create creates database name (from template, unless empty) and records
// it for close. The statement runs to its end even when ctx ends meanwhile:
// a CREATE DATABASE cancelled on the client may still complete on the
// server, after close's DROP DATABASE IF EXISTS found nothing, and leave
// the database behind (TestRunCancelledCleansUp caught it). ctx's end is
// reported once the database is recorded.
func (s *scratch) create(ctx context.Context, name, template string) error {
	runCtx := ctx
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
	defer cancel()
	conn, err := pgx.Connect(ctx, s.adminURL)
	if err != nil {
		return fmt.Errorf("bench: connect to %s: %w", redactURL(s.adminURL), err)
	}
	defer conn.Close(ctx)
	stmt := "CREATE DATABASE " + pgx.Identifier{name}.Sanitize()
	if template != "" {
		stmt += " TEMPLATE " + pgx.Identifier{template}.Sanitize()
	}
	for attempt := 0; ; attempt++ {
		_, err = conn.Exec(ctx, stmt)
		// A session that just closed on the template may not have ended on
		// the server yet (55006: source database is being accessed).
		var pgErr *pgconn.PgError
		if err == nil || attempt >= 50 || !errors.As(err, &pgErr) || pgErr.Code != "55006" {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	if err != nil {
		return fmt.Errorf("bench: create database %s (the role needs CREATEDB): %w", name, err)
	}
	s.mu.Lock()
	s.created = append(s.created, name)
	s.mu.Unlock()
	return runCtx.Err()
}

// drop removes one database, ending any session still connected to it.
func (s *scratch) drop(ctx context.Context, name string) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
	defer cancel()
	conn, err := pgx.Connect(ctx, s.adminURL)
	if err != nil {
		return fmt.Errorf("bench: drop database %s: %w", name, err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, "DROP DATABASE IF EXISTS "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)"); err != nil {
		return fmt.Errorf("bench: drop database %s: %w", name, err)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for i, n := range s.created {
		if n == name {
			s.created = append(s.created[:i], s.created[i+1:]...)
			break
		}
	}
	return nil
}

// close drops every database of the run, the template last. It works on a
// context of its own, so that an interrupted run still cleans up.
func (s *scratch) close(ctx context.Context) error {
	s.mu.Lock()
	names := append([]string(nil), s.created...)
	s.mu.Unlock()
	var errs []error
	for i := len(names) - 1; i >= 0; i-- {
		errs = append(errs, s.drop(ctx, names[i]))
	}
	return errors.Join(errs...)
}

// withDatabase returns connURL with its database replaced by name; it
// accepts both URLs and key=value connection strings.
func withDatabase(connURL, name string) (string, error) {
	if !strings.Contains(connURL, "://") {
		// In a key=value string the last setting of a key wins.
		return connURL + " dbname=" + name, nil
	}
	u, err := url.Parse(connURL)
	if err != nil {
		return "", fmt.Errorf("bench: database URL: %w", err)
	}
	u.Path = "/" + name
	u.RawPath = ""
	return u.String(), nil
}

// redactURL hides a password before a URL is printed.
func redactURL(connURL string) string {
	u, err := url.Parse(connURL)
	if err != nil || u.Scheme == "" {
		return "(connection string not shown)"
	}
	return u.Redacted()
}
