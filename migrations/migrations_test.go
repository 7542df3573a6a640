package migrations_test

import (
	"context"
	"database/sql"
	"slices"
	"sync"
	"testing"

	_ "github.com/jackc/pgx/v5/stdlib"

	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/migrations"
)

// Two migrators racing on an empty database: one applies every migration,
// the other finds nothing to do, and both end at the same version.
func TestConcurrentUpAppliesOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.NewEmpty(t)

	const racers = 2
	var (
		wg      sync.WaitGroup
		start   = make(chan struct{})
		results [racers]migrations.Result
		errs    [racers]error
	)
	for i := range racers {
		db, err := sql.Open("pgx", url)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { db.Close() })
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			results[i], errs[i] = migrations.Up(ctx, db, nil)
		}()
	}
	close(start)
	wg.Wait()

	applied := 0
	for i := range racers {
		if errs[i] != nil {
			t.Fatalf("migrator %d: %v", i, errs[i])
		}
		if len(results[i].Applied) > 0 {
			applied++
		}
	}
	if applied != 1 {
		t.Fatalf("%d migrators applied migrations, want exactly 1: %+v", applied, results)
	}
	if results[0].Version != results[1].Version || results[0].Version == 0 {
		t.Fatalf("versions differ or are zero: %+v", results)
	}

	// Status agrees, and a third run is a no-op.
	db, err := sql.Open("pgx", url)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	st, err := migrations.Status(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.ContainsFunc(st, func(s migrations.MigrationStatus) bool { return s.Applied }) ||
		slices.ContainsFunc(st, func(s migrations.MigrationStatus) bool { return !s.Applied }) {
		t.Fatalf("status after up: %+v", st)
	}
	again, err := migrations.Up(ctx, db, nil)
	if err != nil || len(again.Applied) != 0 {
		t.Fatalf("third up: %+v, %v; want nothing applied", again, err)
	}
}

// Pending only reads: on an empty database it says every migration is
// pending and creates nothing (the readiness probe calls it), and after Up
// it says none.
func TestPendingOnlyReads(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, err := sql.Open("pgx", testdb.NewEmpty(t))
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	n, err := migrations.Pending(ctx, db)
	if err != nil || n == 0 {
		t.Fatalf("Pending on an empty database = %d, %v; want every migration", n, err)
	}
	var schemas int
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM pg_namespace WHERE nspname = 'outbox'`).Scan(&schemas); err != nil || schemas != 0 {
		t.Fatalf("Pending created the outbox schema (%d, %v)", schemas, err)
	}
	if _, err := migrations.Up(ctx, db, nil); err != nil {
		t.Fatal(err)
	}
	if n, err := migrations.Pending(ctx, db); err != nil || n != 0 {
		t.Fatalf("Pending after Up = %d, %v; want 0", n, err)
	}
}
