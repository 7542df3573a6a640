package migrations_test

import (
	"context"
	"fmt"
	"testing"
	"time"
)

// A prepared transaction holds the xmin horizon back until it is committed
// or rolled back, whoever is connected: xmin_horizon_holders names it by
// its gid, database and owner, says since when it was prepared, and counts
// its age from its transaction id, never below 0 (the caller's view of the
// newest id may predate it). The shared test cluster runs with
// max_prepared_transactions = 0, so this runs on a cluster of its own.
func TestXminHorizonHoldersNameAPreparedTransaction(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a PostgreSQL cluster of its own")
	}
	t.Parallel()
	ctx := testContext(t)
	pool := migratedThrowaway(t, "max_prepared_transactions = 2")
	// Prepared by a role of its own, so that the database and the owner
	// have different names.
	const owner = "outboxd_preparer"
	if _, err := pool.Exec(ctx, `CREATE ROLE `+owner); err != nil {
		t.Fatal(err)
	}
	var database string
	if err := pool.QueryRow(ctx, `SELECT current_database()`).Scan(&database); err != nil {
		t.Fatal(err)
	}

	// The reader's view of the newest transaction id is fixed before the
	// prepared transaction takes its id.
	reader, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = reader.Rollback(ctx) }()
	if _, err := reader.Exec(ctx, `SELECT age('3'::xid)`); err != nil {
		t.Fatal(err)
	}

	// age() counts from the newest id as of the reader's first call: an id
	// taken since makes the prepared transaction's own id newer than that.
	if _, err := pool.Exec(ctx, `SELECT txid_current()`); err != nil {
		t.Fatal(err)
	}
	const gid = "outboxd-test-holds-the-horizon"
	before := time.Now()
	prepare, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := prepare.Exec(ctx, `BEGIN; SET LOCAL ROLE `+owner+`; SELECT txid_current(); PREPARE TRANSACTION '`+gid+`'`); err != nil {
		prepare.Release()
		t.Fatal(err)
	}
	prepare.Release()
	t.Cleanup(func() { _, _ = pool.Exec(context.Background(), `ROLLBACK PREPARED '`+gid+`'`) })
	after := time.Now()

	want := fmt.Sprintf("prepared transaction %s (database %s, owner %s)", gid, database, owner)
	var listed, age int64
	var since *time.Time
	if err := reader.QueryRow(ctx, `SELECT count(*), min(age), min(since) FROM outbox.xmin_horizon_holders() WHERE holder = $1`, want).
		Scan(&listed, &age, &since); err != nil {
		t.Fatal(err)
	}
	if listed != 1 {
		t.Fatalf("%q listed %d times, want once", want, listed)
	}
	if age != 0 {
		t.Fatalf("the prepared transaction, newer than the reader's view, has age %d; want 0, never below", age)
	}
	if since == nil || since.Before(before.Add(-time.Second)) || since.After(after.Add(time.Second)) {
		t.Fatalf("since %v, want when it was prepared (between %v and %v)", since, before, after)
	}
	if err := reader.Rollback(ctx); err != nil {
		t.Fatal(err)
	}

	// Each transaction id taken since it was prepared adds to its age.
	for range 5 {
		if _, err := pool.Exec(ctx, `SELECT txid_current()`); err != nil {
			t.Fatal(err)
		}
	}
	if err := pool.QueryRow(ctx, `SELECT min(age) FROM outbox.xmin_horizon_holders() WHERE holder = $1`, want).Scan(&age); err != nil {
		t.Fatal(err)
	}
	if age < 5 {
		t.Fatalf("the prepared transaction's age is %d after five transaction ids were taken since; want at least 5", age)
	}
}
