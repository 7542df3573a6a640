package main

import (
	"context"
	"database/sql"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"

	_ "github.com/jackc/pgx/v5/stdlib" // database/sql driver for migrations
	"github.com/spf13/cobra"

	"github.com/outboxd/outboxd/internal/connstring"
	"github.com/outboxd/outboxd/internal/devdb"
	"github.com/outboxd/outboxd/migrations"
)

// globalFlags are shared by every subcommand.
type globalFlags struct {
	databaseURL string
	logFormat   string
	logLevel    string
}

func rootCommand() *cobra.Command {
	var g globalFlags
	root := &cobra.Command{
		Use:           "outboxd",
		Short:         "Transactional outbox delivery: lease, stream, ack-gated publish",
		SilenceUsage:  true,
		SilenceErrors: true,
		// Configuration file and OUTBOXD_* environment for serve and relay.
		PersistentPreRunE: applyConfig,
	}
	addVersion(root)
	addConfigFlag(root)
	root.PersistentFlags().StringVar(&g.databaseURL, "database-url", "",
		"PostgreSQL URL (default: $DATABASE_URL, else "+devdb.LocalURL+")")
	root.PersistentFlags().StringVar(&g.logFormat, "log-format", "text", "log format: text or json")
	root.PersistentFlags().StringVar(&g.logLevel, "log-level", "info", "log level: debug, info, warn, error")
	root.AddCommand(serveCommand(&g), devCommand(&g), relayCommand(&g), migrateCommand(&g), rescanCommand(&g),
		lagCommand(), relaysCommand(), aggregateCommand(), eventsCommand(),
		retryCommand(), skipCommand(), purgeCommand(), benchCommand(),
		aggregatesCommand(), attemptsCommand(), bulkRetryCommand(), bulkSkipCommand(), republishCommand(),
		actionsCommand())
	return root
}

// dbURL resolves the database URL: flag, then $DATABASE_URL, then the local
// default.
func (g *globalFlags) dbURL() string {
	if g.databaseURL != "" {
		return g.databaseURL
	}
	if u := os.Getenv(devdb.EnvVar); u != "" {
		return u
	}
	return devdb.LocalURL
}

func (g *globalFlags) logger(w io.Writer) (*slog.Logger, error) {
	var level slog.Level
	if err := level.UnmarshalText([]byte(g.logLevel)); err != nil {
		return nil, fmt.Errorf("--log-level %q: want debug, info, warn or error", g.logLevel)
	}
	opts := &slog.HandlerOptions{Level: level}
	switch strings.ToLower(g.logFormat) {
	case "text":
		return slog.New(slog.NewTextHandler(w, opts)), nil
	case "json":
		return slog.New(slog.NewJSONHandler(w, opts)), nil
	default:
		return nil, fmt.Errorf("--log-format %q: want text or json", g.logFormat)
	}
}

func migrateCommand(g *globalFlags) *cobra.Command {
	var specs []string
	cmd := &cobra.Command{
		Use:   "migrate",
		Short: "Apply pending schema migrations to every source (idempotent; safe to run concurrently)",
		Long: `migrate applies pending schema migrations to the default source (--database-url)
and to each --source NAME=URL, in turn; to migrate one source, give only it.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			log, err := g.logger(os.Stderr)
			if err != nil {
				return err
			}
			all, err := g.sources(specs)
			if err != nil {
				return err
			}
			return migrateSources(cmd.Context(), all, log, func(format string, args ...any) {
				fmt.Fprintf(cmd.OutOrStdout(), format, args...)
			})
		},
	}
	addSourceFlag(cmd.PersistentFlags(), &specs)
	cmd.AddCommand(&cobra.Command{
		Use:   "status",
		Short: "List migrations and whether each is applied, for every source",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			all, err := g.sources(specs)
			if err != nil {
				return err
			}
			pending := 0
			for _, src := range all {
				if len(all) > 1 {
					fmt.Fprintf(cmd.OutOrStdout(), "source %s:\n", src.name)
				}
				if err := withSQL(cmd.Context(), src.url, func(db *sql.DB) error {
					st, err := migrations.Status(cmd.Context(), db)
					if err != nil {
						return err
					}
					for _, s := range st {
						state := "applied"
						if !s.Applied {
							state = "pending"
							pending++
						}
						fmt.Fprintf(cmd.OutOrStdout(), "%5d  %-8s %s\n", s.Version, state, s.Name)
					}
					return nil
				}); err != nil {
					return fmt.Errorf("%s%w", src.label(all), err)
				}
			}
			if pending > 0 {
				return fmt.Errorf("%d migration(s) pending; run `outboxd migrate`", pending)
			}
			return nil
		},
	})
	return cmd
}

func withSQL(ctx context.Context, url string, fn func(*sql.DB) error) error {
	db, err := sql.Open("pgx", withoutPoolParams(url))
	if err != nil {
		return fmt.Errorf("database: %w", err)
	}
	defer db.Close()
	if err := db.PingContext(ctx); err != nil {
		return fmt.Errorf("database %s: %w", connstring.Redact(url), err)
	}
	return fn(db)
}
