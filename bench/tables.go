package bench

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// TableStat is one of an arm's tables after the arm: the dead tuples the
// statistics count (pg_stat_user_tables.n_dead_tup) and its size with
// indexes and TOAST (pg_total_relation_size) before producers started and
// at the end.
type TableStat struct {
	Name        string `json:"name"`
	DeadTuples  int64  `json:"dead_tuples"`
	LiveTuples  int64  `json:"live_tuples"`
	StartBytes  int64  `json:"start_bytes"`
	EndBytes    int64  `json:"end_bytes"`
	GrowthBytes int64  `json:"growth_bytes"`
}

// tableSizes returns the size of every table matching cond, a condition on
// pg_stat_user_tables that the arm supplies (a constant, never user input).
func tableSizes(ctx context.Context, pool *pgxpool.Pool, cond string) (map[string]int64, error) {
	rows, err := pool.Query(ctx, `SELECT relid::regclass::text, pg_total_relation_size(relid)
		FROM pg_stat_user_tables WHERE `+cond)
	if err != nil {
		return nil, fmt.Errorf("bench: table sizes: %w", err)
	}
	sizes := map[string]int64{}
	var (
		name string
		size int64
	)
	_, err = pgx.ForEachRow(rows, []any{&name, &size}, func() error {
		sizes[name] = size
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("bench: table sizes: %w", err)
	}
	return sizes, nil
}

// tableStats reads the arm's tables once every other session of its
// database has ended, so that their dead tuples have reached the
// statistics.
func tableStats(ctx context.Context, dbURL, cond string, start map[string]int64) ([]TableStat, error) {
	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		return nil, fmt.Errorf("bench: table statistics: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	deadline := time.Now().Add(5 * time.Second)
	for {
		var others int
		if err := conn.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND pid <> pg_backend_pid()`).Scan(&others); err != nil {
			return nil, fmt.Errorf("bench: table statistics: %w", err)
		}
		if others == 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	rows, err := conn.Query(ctx, `SELECT relid::regclass::text, n_dead_tup, n_live_tup, pg_total_relation_size(relid)
		FROM pg_stat_user_tables WHERE `+cond+` ORDER BY 1`)
	if err != nil {
		return nil, fmt.Errorf("bench: table statistics: %w", err)
	}
	var (
		out []TableStat
		t   TableStat
	)
	_, err = pgx.ForEachRow(rows, []any{&t.Name, &t.DeadTuples, &t.LiveTuples, &t.EndBytes}, func() error {
		t.StartBytes = start[t.Name]
		t.GrowthBytes = t.EndBytes - t.StartBytes
		out = append(out, t)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("bench: table statistics: %w", err)
	}
	return out, nil
}

// xminHolder is a session that keeps a transaction id, and so the
// cluster's xmin horizon, from advancing: vacuum cannot remove any row
// version that became dead after it started.
type xminHolder struct {
	conn *pgx.Conn
	tx   pgx.Tx
}

// holdXmin opens the held-xmin workload's transaction: in another database
// of the cluster (the maintenance database the run connects to), a
// transaction that took an id, as a long write transaction does; or in the
// arm's database, a REPEATABLE READ transaction whose snapshot and id stay
// for its whole life.
func holdXmin(ctx context.Context, env *armEnv, holder string) (*xminHolder, error) {
	url, opts := env.cfg.DatabaseURL, pgx.TxOptions{}
	if holder == HolderSameDBRR {
		url, opts = env.dbURL, pgx.TxOptions{IsoLevel: pgx.RepeatableRead}
	}
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return nil, fmt.Errorf("bench: held-xmin %s: %w", holder, err)
	}
	tx, err := conn.BeginTx(ctx, opts)
	if err == nil {
		_, err = tx.Exec(ctx, `SELECT pg_current_xact_id()`)
	}
	if err != nil {
		conn.Close(context.WithoutCancel(ctx))
		return nil, fmt.Errorf("bench: held-xmin %s: %w", holder, err)
	}
	return &xminHolder{conn: conn, tx: tx}, nil
}

// release ends the transaction and the session.
func (h *xminHolder) release(ctx context.Context) {
	ctx = context.WithoutCancel(ctx)
	_ = h.tx.Rollback(ctx)
	_ = h.conn.Close(ctx)
}
