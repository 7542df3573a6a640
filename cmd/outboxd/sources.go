package main

import (
	"context"
	"database/sql"
	"fmt"
	"log/slog"
	"os"
	"strings"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/spf13/pflag"

	"github.com/outboxd/outboxd/internal/devdb"
	"github.com/outboxd/outboxd/internal/multisource"
	"github.com/outboxd/outboxd/internal/store"
	"github.com/outboxd/outboxd/migrations"
)

// sourceHelp documents --source on every command that takes it.
const sourceHelp = `NAME=URL, repeatable: a further source database, whose streams are addressed NAME/STREAM (bare names are the source "default", --database-url); NAME is 1 to 32 of a-z 0-9 _, starting with a letter. With --source, there is a default source only if --database-url or $DATABASE_URL is given`

// source is one source database a command works on.
type source struct {
	name, url string
}

// addSourceFlag registers --source on fs.
func addSourceFlag(fs *pflag.FlagSet, specs *[]string) {
	fs.StringArrayVar(specs, "source", nil, sourceHelp)
}

// sources resolves the source databases of a command: the default one
// (--database-url, $DATABASE_URL, or, when no --source is given, the local
// default) and each --source NAME=URL. Every problem is a usage error that
// names the flag at fault, with any password hidden.
func (g *globalFlags) sources(specs []string) ([]source, error) {
	var out []source
	explicit := g.databaseURL
	if explicit == "" {
		explicit = os.Getenv(devdb.EnvVar)
	}
	switch {
	case explicit != "":
		out = append(out, source{multisource.Default, explicit})
	case len(specs) == 0:
		out = append(out, source{multisource.Default, devdb.LocalURL})
	}
	seen := map[string]bool{}
	if len(out) > 0 {
		seen[multisource.Default] = true
	}
	named, err := parseSourceSpecs(specs, seen)
	return append(out, named...), err
}

// parseSourceSpecs parses --source NAME=URL entries, none of whose names
// may be in seen (the sources there are already); it adds theirs.
func parseSourceSpecs(specs []string, seen map[string]bool) ([]source, error) {
	var out []source
	for _, spec := range specs {
		name, url, ok := strings.Cut(spec, "=")
		if !ok || url == "" {
			return nil, usageError("--source %q: want NAME=URL", redactURL(spec))
		}
		if err := multisource.ValidName(name); err != nil {
			return nil, usageError("--source %s: %v", redactURL(spec), err)
		}
		if seen[name] {
			if name == multisource.Default {
				return nil, usageError("--source %s: the source default is already --database-url (or $DATABASE_URL); give it once", name)
			}
			return nil, usageError("--source %s: given twice", name)
		}
		seen[name] = true
		out = append(out, source{name, url})
	}
	return out, nil
}

// label names the source in messages about it, when there are several.
func (s source) label(all []source) string {
	if len(all) == 1 {
		return ""
	}
	return "source " + s.name + ": "
}

// openSource opens a source's pool of at most maxConns connections, and
// checks that it answers and that its schema is current.
func openSource(ctx context.Context, s source, all []source, maxConns int32) (*pgxpool.Pool, error) {
	fail := func(err error) error { return fmt.Errorf("%s%w", s.label(all), err) }
	poolCfg, err := pgxpool.ParseConfig(s.url)
	if err != nil {
		if s.name == multisource.Default {
			return nil, fail(fmt.Errorf("--database-url: %w", err))
		}
		return nil, fail(fmt.Errorf("--source %s: %w", s.name, err))
	}
	poolCfg.MaxConns = maxConns
	store.ConfigurePool(poolCfg)
	pool, err := pgxpool.NewWithConfig(ctx, poolCfg)
	if err != nil {
		return nil, fail(fmt.Errorf("database: %w", err))
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, fail(fmt.Errorf("database %s: %w", redactURL(s.url), err))
	}
	if err := withSQL(ctx, s.url, func(db *sql.DB) error {
		n, err := migrations.Pending(ctx, db)
		if err == nil && n > 0 {
			err = fmt.Errorf("%d schema migration(s) pending; run `outboxd migrate` first", n)
		}
		return err
	}); err != nil {
		pool.Close()
		return nil, fail(err)
	}
	return pool, nil
}

// migrateSources applies pending migrations to every source in turn,
// printing one line per source (prefixed with its name when there are
// several). It stops at the first failure, which names its source.
func migrateSources(ctx context.Context, all []source, log *slog.Logger, out func(format string, args ...any)) error {
	for _, s := range all {
		err := withSQL(ctx, s.url, func(db *sql.DB) error {
			res, err := migrations.Up(ctx, db, log.With("source", s.name))
			if err != nil {
				return err
			}
			if len(res.Applied) == 0 {
				out("%sschema is up to date at version %d\n", s.label(all), res.Version)
			} else {
				out("%sapplied %v; schema is at version %d\n", s.label(all), res.Applied, res.Version)
			}
			return nil
		})
		if err != nil {
			return fmt.Errorf("%s%w", s.label(all), err)
		}
	}
	return nil
}
