package main

import (
	"fmt"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/spf13/cobra"

	"github.com/outboxd/outboxd/internal/connstring"
	"github.com/outboxd/outboxd/internal/store"
)

func rescanCommand(g *globalFlags) *cobra.Command {
	return &cobra.Command{
		Use:   "rescan",
		Short: "Rebuild discovery's state from the events and resume a stopped discovery",
		Long: `rescan finds every pending event that delivery does not know of yet, makes
its aggregate deliverable, stores a fresh discovery snapshot of this
PostgreSQL cluster and lets discovery resume (outbox.rescan_discovery()).

Discovery finds new events by the ids of the transactions that wrote them,
which mean something only within one cluster. A database restored from a
dump into another cluster (or moved with pg_upgrade, or whose transaction
counter was set back) stops discovery: /readyz answers 503 and outboxd lag
says DISCOVERY STOPPED with the reason. Run rescan once then; replicas pick
up again within a second or so, without a restart.

It is safe to run at any time, while producers write and relays deliver:
nothing is delivered twice or out of order, and an event committed while it
runs is found by the next round. It reads the whole event table, and after a
restore rewrites the stored transaction id of each copied event once (a
non-HOT update of those rows), so run it as the schema's owner, like migrate.
If it fails with a deadlock (40P01) against an ack, run it again.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			cfg, err := pgxpool.ParseConfig(g.dbURL())
			if err != nil {
				return fmt.Errorf("--database-url: %w", err)
			}
			store.ConfigurePool(cfg)
			cfg.MaxConns = 1
			pool, err := pgxpool.NewWithConfig(ctx, cfg)
			if err != nil {
				return fmt.Errorf("database %s: %w", connstring.Redact(g.dbURL()), err)
			}
			defer pool.Close()
			// Named, with what to run: a wrong URL or a database never
			// migrated is not the stopped discovery this command is for.
			db := connstring.Redact(g.dbURL())
			if err := pool.Ping(ctx); err != nil {
				return fmt.Errorf("database %s: %w", db, err)
			}
			if err := requireMigrated(ctx, g.dbURL()); err != nil {
				return fmt.Errorf("database %s: %w", db, err)
			}
			st := store.New(pool)
			stopped, err := st.DiscoveryStopped(ctx)
			if err != nil {
				return fmt.Errorf("database %s: %w", db, err)
			}
			r, err := st.RescanDiscovery(ctx)
			if err != nil {
				return fmt.Errorf("database %s: %w", db, err)
			}
			out := cmd.OutOrStdout()
			if stopped != "" {
				fmt.Fprintf(out, "discovery was stopped: %s\n", stopped)
			}
			_, err = fmt.Fprintf(out, "rescanned: %d pending events, %d aggregates made deliverable, %d copied events re-stamped; discovery is running\n",
				r.Events, r.Aggregates, r.Restamped)
			return err
		},
	}
}
