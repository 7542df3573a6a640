// Package migrations holds outboxd's PostgreSQL schema as numbered SQL files,
// embedded in the binary, and applies them with goose.
//
// Migrating is idempotent and safe when several processes do it at once: a
// session-level advisory lock serialises them, so one applies the pending
// migrations and the others find nothing left to do.
package migrations

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"embed"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"sort"

	"github.com/pressly/goose/v3"
)

//go:embed *.sql
var files embed.FS

// versionTable records applied migrations. It lives in the outbox schema so
// that everything outboxd owns is in one place.
const versionTable = "outbox.goose_db_version"

// lockKey is the advisory lock that serialises concurrent migrators
// (hashtext('outboxd.migrate') would do as well; a constant is easier to find
// in pg_locks).
const lockKey int64 = 0x6f7574626f78 // "outbox"

// FS returns the embedded migration files.
func FS() fs.FS { return files }

// Hash identifies the schema the embedded migrations produce, for caching
// migrated template databases in tests.
func Hash() (string, error) {
	names, err := fs.Glob(files, "*.sql")
	if err != nil {
		return "", err
	}
	sort.Strings(names)
	h := sha256.New()
	for _, name := range names {
		body, err := files.ReadFile(name)
		if err != nil {
			return "", err
		}
		fmt.Fprintf(h, "%s\x00%d\x00", name, len(body))
		h.Write(body)
	}
	return hex.EncodeToString(h.Sum(nil)), nil
}

// Result reports what Up did.
type Result struct {
	// Applied lists the versions this call applied, in order.
	Applied []int64
	// Version is the schema version after the call.
	Version int64
}

// Up applies every pending migration. Concurrent callers serialise on an
// advisory lock; all but the first find nothing to do.
func Up(ctx context.Context, db *sql.DB, logger *slog.Logger) (Result, error) {
	var res Result
	err := withLock(ctx, db, func() error {
		p, err := newProvider(db, logger)
		if err != nil {
			return err
		}
		applied, err := p.Up(ctx)
		for _, r := range applied {
			if r.Error == nil {
				res.Applied = append(res.Applied, r.Source.Version)
			}
		}
		if err != nil {
			return fmt.Errorf("migrations: apply: %w", err)
		}
		res.Version, err = p.GetDBVersion(ctx)
		return err
	})
	return res, err
}

// MigrationStatus is one migration's state.
type MigrationStatus struct {
	Version int64
	Name    string
	Applied bool
}

// Status lists every embedded migration and whether it is applied.
func Status(ctx context.Context, db *sql.DB) ([]MigrationStatus, error) {
	if err := ensureSchema(ctx, db); err != nil {
		return nil, err
	}
	p, err := newProvider(db, nil)
	if err != nil {
		return nil, err
	}
	st, err := p.Status(ctx)
	if err != nil {
		return nil, fmt.Errorf("migrations: status: %w", err)
	}
	out := make([]MigrationStatus, 0, len(st))
	for _, s := range st {
		out = append(out, MigrationStatus{
			Version: s.Source.Version,
			Name:    s.Source.Path,
			Applied: s.State == goose.StateApplied,
		})
	}
	return out, nil
}

// Pending reports how many embedded migrations are not applied yet; the
// server refuses to serve (and health reports NOT_SERVING) while it is not 0.
// It only reads: a readiness probe must not create anything in the database
// it probes, so a missing version table means every migration is pending.
func Pending(ctx context.Context, db *sql.DB) (int, error) {
	var exists bool
	if err := db.QueryRowContext(ctx, `SELECT to_regclass($1) IS NOT NULL`, versionTable).Scan(&exists); err != nil {
		return 0, fmt.Errorf("migrations: %w", err)
	}
	applied := map[int64]bool{}
	if exists {
		rows, err := db.QueryContext(ctx, AppliedVersionsSQL)
		if err != nil {
			return 0, fmt.Errorf("migrations: %w", err)
		}
		defer rows.Close()
		for rows.Next() {
			var v int64
			var ok bool
			if err := rows.Scan(&v, &ok); err != nil {
				return 0, fmt.Errorf("migrations: %w", err)
			}
			applied[v] = ok
		}
		if err := rows.Err(); err != nil {
			return 0, fmt.Errorf("migrations: %w", err)
		}
	}
	return PendingOf(applied)
}

// AppliedVersionsSQL reads where each version stands, as rows of
// (version_id bigint, is_applied boolean): goose appends a row per apply and
// per rollback, and a version's latest row says. Without the version table
// (no migration ever applied) it fails with SQLSTATE 42P01.
const AppliedVersionsSQL = `SELECT DISTINCT ON (version_id) version_id, is_applied
	FROM ` + versionTable + ` ORDER BY version_id, id DESC`

// PendingOf counts the embedded migrations that applied (version ->
// applied, as AppliedVersionsSQL reads it) does not mark applied.
func PendingOf(applied map[int64]bool) (int, error) {
	names, err := fs.Glob(files, "*.sql")
	if err != nil {
		return 0, err
	}
	n := 0
	for _, name := range names {
		v, err := goose.NumericComponent(name)
		if err != nil {
			return 0, fmt.Errorf("migrations: %s: %w", name, err)
		}
		if !applied[v] {
			n++
		}
	}
	return n, nil
}

func newProvider(db *sql.DB, logger *slog.Logger) (*goose.Provider, error) {
	opts := []goose.ProviderOption{goose.WithTableName(versionTable), goose.WithDisableGlobalRegistry(true)}
	if logger != nil {
		opts = append(opts, goose.WithSlog(logger.With("component", "migrations")))
	}
	p, err := goose.NewProvider(goose.DialectPostgres, db, files, opts...)
	if err != nil {
		return nil, fmt.Errorf("migrations: %w", err)
	}
	return p, nil
}

// ensureSchema creates the schema that holds goose's version table. Under the
// migration lock it cannot race; Status calls it without the lock, so it
// tolerates a concurrent creator.
func ensureSchema(ctx context.Context, db *sql.DB) error {
	var exists bool
	if err := db.QueryRowContext(ctx,
		`SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = 'outbox')`).Scan(&exists); err != nil {
		return fmt.Errorf("migrations: %w", err)
	}
	if exists {
		return nil
	}
	if _, err := db.ExecContext(ctx, `CREATE SCHEMA IF NOT EXISTS outbox`); err != nil {
		return fmt.Errorf("migrations: create schema outbox: %w", err)
	}
	return nil
}

// withLock runs fn while holding the migration advisory lock on a dedicated
// connection, so two processes migrating at once apply each migration once.
func withLock(ctx context.Context, db *sql.DB, fn func() error) (err error) {
	conn, err := db.Conn(ctx)
	if err != nil {
		return fmt.Errorf("migrations: connect: %w", err)
	}
	defer conn.Close()
	if _, err := conn.ExecContext(ctx, `SELECT pg_advisory_lock($1)`, lockKey); err != nil {
		return fmt.Errorf("migrations: take lock: %w", err)
	}
	defer func() {
		// Unlock even if ctx is done; the lock would otherwise die with the
		// connection anyway.
		if _, uerr := conn.ExecContext(context.WithoutCancel(ctx), `SELECT pg_advisory_unlock($1)`, lockKey); uerr != nil {
			err = errors.Join(err, fmt.Errorf("migrations: release lock: %w", uerr))
		}
	}()
	if err := ensureSchema(ctx, db); err != nil {
		return err
	}
	return fn()
}
