package migrations_test

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxd/outboxd/internal/testdb"
)

// The producer paths an event can take, each in the caller's transaction:
// a plain INSERT (client.Emit's statement; the insert trigger does the rest)
// and outbox.emit. Both leave the id and the revision to the trigger, so
// both take its common path.
var producerPaths = []struct {
	name string
	sql  string // $1 stream, $2 aggregate key; returns the revision
}{
	{"insert", `INSERT INTO outbox.event (stream, aggregate_key, event_type, payload)
		VALUES ($1, $2, 'T', '{}') RETURNING revision`},
	{"emit", `SELECT revision FROM outbox.emit($1, $2, 'T', '{}')`},
}

// The insert trigger's common path tests the stream without the regular
// expression the checks after it use; it must accept exactly what the
// expression accepts. PostgreSQL's own match of the expression is the
// oracle; a stream it refuses must fail with 22023 and write nothing.
func TestCommonPathAcceptsTheStreamsTheRegularExpressionDoes(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pool := testdb.NewPool(t)
	streams := []string{
		"a", "orders", "sales_order.v2-x", "z9", "a_", "a.", "a-",
		"a" + strings.Repeat("x", 127), "a" + strings.Repeat("x", 128),
		"", "A", "Orders", "oRders", "9x", "_a", ".a", "-a", "a b", " a", "a ",
		"a\tb", "a\nb", "a\n", "\na", "aé", "é", "ä1", "a/b", "a:b", "a$", "a~", "a*", "a[b]",
		"a\\", "a'b", "{a}", "`a`", "ａ", // the last a full-width a
	}
	for _, stream := range streams {
		var valid bool
		if err := pool.QueryRow(ctx, `SELECT $1 ~ '^[a-z][a-z0-9_.-]{0,127}$'`, stream).Scan(&valid); err != nil {
			t.Fatal(err)
		}
		for _, p := range producerPaths {
			var rev int64
			err := pool.QueryRow(ctx, p.sql, stream, "k").Scan(&rev)
			switch {
			case valid && err != nil:
				t.Errorf("%s: stream %q refused: %v", p.name, stream, err)
			case !valid && err == nil:
				t.Errorf("%s: malformed stream %q accepted (revision %d)", p.name, stream, rev)
			case !valid:
				wantSQLState(t, err, "22023")
			}
		}
	}
	if n := count(t, pool, `SELECT count(*) FROM outbox.event WHERE stream !~ '^[a-z][a-z0-9_.-]{0,127}$'`); n != 0 {
		t.Fatalf("%d events with a malformed stream", n)
	}
}

// produceBehind runs path's statement on a connection of its own in a
// transaction at isolation level iso, and returns once it waits for
// backend holder (pg_blocking_pids), with a channel that yields its
// revision or error and a function that ends its transaction (commit or
// roll back).
func produceBehind(t *testing.T, pool *pgxpool.Pool, holder int, iso pgx.TxIsoLevel, sql, stream, key string) (<-chan produced, func(commit bool)) {
	t.Helper()
	ctx := testContext(t)
	tx, err := pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: iso})
	if err != nil {
		t.Fatal(err)
	}
	// A failure before end is called must not leave the connection held:
	// the pool's clean-up waits for it.
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	pid := backendPID(t, tx)
	done := make(chan produced, 1)
	go func() {
		var p produced
		p.err = tx.QueryRow(ctx, sql, stream, key).Scan(&p.revision)
		done <- p
	}()
	waitUntilBlockedBy(t, pool, pid, holder)
	return done, func(commit bool) {
		if commit {
			if err := tx.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			return
		}
		_ = tx.Rollback(ctx)
	}
}

type produced struct {
	revision int64
	err      error
}

func awaitProduced(t *testing.T, done <-chan produced) produced {
	t.Helper()
	select {
	case p := <-done:
		return p
	case <-testContext(t).Done():
		t.Fatal("the waiting producer did not finish after the first one ended")
		return produced{}
	}
}

// Producers of one aggregate queue on its counter whichever path they take,
// and the revision a producer gets depends only on what the one ahead of
// it did: rolled back, the same revision again (no gap); committed, the
// next one; committed under a REPEATABLE READ producer's snapshot, a
// serialization failure (40001) to retry. The same holds for an aggregate
// whose counter the producer ahead is creating. Every pair of paths is
// forced into each interleaving with pg_blocking_pids.
func TestProducersQueueOnTheCounterAlikeOnEveryPath(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pool := testdb.NewPoolConfig(t, func(c *pgxpool.Config) { c.MaxConns = 6 })
	key := 0
	for _, ahead := range producerPaths {
		for _, behind := range producerPaths {
			for _, existing := range []bool{true, false} {
				for _, outcome := range []string{"rollback", "commit", "commit, repeatable read"} {
					name := fmt.Sprintf("%s behind %s, existing counter %v, %s", behind.name, ahead.name, existing, outcome)
					key++
					k := fmt.Sprint(key)
					var base int64
					if existing {
						exec(t, pool, fmt.Sprintf(`SELECT outbox.emit('orders', '%s', 'T', '{}')`, k))
						base = 1
					}
					first, err := pool.Begin(ctx)
					if err != nil {
						t.Fatal(err)
					}
					defer first.Rollback(ctx) //nolint:errcheck // ended below; a second end is a no-op
					var firstRev int64
					if err := first.QueryRow(ctx, ahead.sql, "orders", k).Scan(&firstRev); err != nil {
						t.Fatal(err)
					}
					if firstRev != base+1 {
						t.Fatalf("%s: the first producer got revision %d, want %d", name, firstRev, base+1)
					}
					iso := pgx.ReadCommitted
					if outcome == "commit, repeatable read" {
						iso = pgx.RepeatableRead
					}
					done, end := produceBehind(t, pool, backendPID(t, first), iso, behind.sql, "orders", k)
					if outcome == "rollback" {
						if err := first.Rollback(ctx); err != nil {
							t.Fatal(err)
						}
					} else if err := first.Commit(ctx); err != nil {
						t.Fatal(err)
					}
					got := awaitProduced(t, done)
					switch outcome {
					case "rollback":
						if got.err != nil || got.revision != base+1 {
							t.Errorf("%s: revision %d, %v; want %d (the rolled-back one's)", name, got.revision, got.err, base+1)
						}
					case "commit":
						if got.err != nil || got.revision != base+2 {
							t.Errorf("%s: revision %d, %v; want %d", name, got.revision, got.err, base+2)
						}
					default:
						wantSQLState(t, got.err, "40001")
					}
					end(got.err == nil)
					want := base + 1
					if outcome == "commit" {
						want = base + 2
					}
					if n := count(t, pool, fmt.Sprintf(`SELECT last_revision FROM outbox.aggregate WHERE aggregate_key = '%s'`, k)); n != want {
						t.Errorf("%s: counter at %d, want %d", name, n, want)
					}
					if n := count(t, pool, fmt.Sprintf(`SELECT count(*) FROM outbox.event WHERE aggregate_key = '%s' AND revision BETWEEN 1 AND %d`, k, want)); n != want {
						t.Errorf("%s: %d events for revisions 1..%d, want one each", name, n, want)
					}
				}
			}
		}
	}
}
