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

// counter returns this cluster's next transaction id.
func counter(t *testing.T, pool *pgxpool.Pool) int64 {
	t.Helper()
	return count(t, pool, `SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint`)
}

// burnXids commits transactions until the cluster's counter reaches
// target, as a busy cluster would.
func burnXids(t *testing.T, pool *pgxpool.Pool, target int64) {
	t.Helper()
	exec(t, pool, fmt.Sprintf(`DO $$ BEGIN
		SET LOCAL synchronous_commit = off;
		WHILE pg_current_xact_id()::text::bigint < %d LOOP
			COMMIT;
			SET LOCAL synchronous_commit = off;
		END LOOP;
	END $$`, target))
}

// copyEvent writes an event row as pg_restore --disable-triggers does (a
// plain restore creates the triggers after the data), with the transaction
// id it had in the cluster it was dumped from.
func copyEvent(t *testing.T, pool *pgxpool.Pool, key string, revision, xid int64) {
	t.Helper()
	err := pgx.BeginFunc(testContext(t), pool, func(tx pgx.Tx) error {
		_, err := tx.Exec(testContext(t), fmt.Sprintf(`
			ALTER TABLE outbox.event DISABLE TRIGGER USER;
			INSERT INTO outbox.event (event_id, stream, aggregate_key, revision, event_type, payload, xid)
			VALUES (gen_random_uuid(), 'orders', '%[1]s', %[2]d, 'T', '{}', '%[3]d');
			ALTER TABLE outbox.event ENABLE TRIGGER USER;
			INSERT INTO outbox.aggregate (stream, aggregate_key, last_revision) VALUES ('orders', '%[1]s', %[2]d)
			ON CONFLICT (stream, aggregate_key) DO UPDATE SET last_revision = excluded.last_revision`, key, revision, xid))
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
}

func discoverErr(t *testing.T, pool *pgxpool.Pool) error {
	t.Helper()
	_, err := pool.Exec(testContext(t), `SELECT * FROM outbox.discover()`)
	return err
}

func discoveryStopped(t *testing.T, pool *pgxpool.Pool) string {
	t.Helper()
	var reason *string
	if err := pool.QueryRow(testContext(t), `SELECT outbox.discovery_stopped()`).Scan(&reason); err != nil {
		t.Fatal(err)
	}
	if reason == nil {
		return ""
	}
	return *reason
}

// drain claims and acks until nothing is pending, and fails if any event is
// delivered twice or before a lower revision of its aggregate.
func drain(t *testing.T, pool *pgxpool.Pool) map[string][]int64 {
	t.Helper()
	delivered := map[string][]int64{}
	for range 50 {
		got := claimRevisions(t, pool)
		if len(got) == 0 {
			break
		}
		for key, rev := range got {
			if prev := delivered[key]; len(prev) > 0 && prev[len(prev)-1] >= rev {
				t.Fatalf("%s revision %d delivered after %v", key, rev, prev)
			}
			delivered[key] = append(delivered[key], rev)
			ackEvents(t, pool, fmt.Sprintf(`aggregate_key = '%s' AND revision = %d`, key, rev))
		}
	}
	if n := count(t, pool, `SELECT count(*) FROM outbox.event WHERE published_at IS NULL`); n != 0 {
		t.Fatalf("%d events still pending after draining (delivered %v)", n, delivered)
	}
	return delivered
}

// A database restored from a dump into another cluster carries a discovery
// snapshot whose transaction ids are not this cluster's, and events copied
// with the old cluster's ids. Discovery stops, and stays stopped after the
// counter passes the stored snapshot (when the ids would look plausible and
// a round would silently skip what was written meanwhile), until an
// operator re-scans; the re-scan, run while a producer is still in its
// transaction, finds every pending event, and everything is then delivered
// once, in revision order, with nothing re-found, stranded or late.
func TestRestoredIntoAnotherClusterDiscoveryStopsUntilRescan(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pool := testdb.NewPoolConfig(t, func(c *pgxpool.Config) { c.MaxConns = 6 })

	// Before the dump: one aggregate delivered, one pending and known.
	emitN(t, pool, "delivered", 1)
	discover(t, pool)
	claimRevisions(t, pool)
	ackEvents(t, pool, `aggregate_key = 'delivered'`)
	emitN(t, pool, "held", 1)
	discover(t, pool)

	// The restore: the old cluster's discovery state (its xmax ahead of
	// this counter) and events it had not discovered yet.
	stored := counter(t, pool) + 3000
	copyEvent(t, pool, "copied", 1, stored+1000)    // a new aggregate
	copyEvent(t, pool, "held", 2, stored+1500)      // the next revision of a ready one
	copyEvent(t, pool, "delivered", 2, stored+1200) // the next revision of an idle one
	copyEvent(t, pool, "far", 1, stored+10_000_000) // an id this cluster reaches only much later
	exec(t, pool, fmt.Sprintf(`UPDATE outbox.discovery SET snapshot = '%[1]d:%[1]d:', system_identifier = 42`, stored))

	err := discoverErr(t, pool)
	wantSQLState(t, err, "XX001")
	if !strings.Contains(err.Error(), "another PostgreSQL cluster") {
		t.Fatalf("discovery's error does not name the cause: %v", err)
	}

	// Producers go on meanwhile, and the counter passes the stored xmax
	// before anything records the stop (no replica was running, say): the
	// cluster's identity still stops the round.
	emitN(t, pool, "during", 1)
	burnXids(t, pool, stored+2000)
	err = discoverErr(t, pool)
	wantSQLState(t, err, "XX001")
	if !strings.Contains(err.Error(), "another PostgreSQL cluster") {
		t.Fatalf("discovery's error does not name the cause: %v", err)
	}
	if r := discoveryStopped(t, pool); !strings.Contains(r, "another PostgreSQL cluster") || !strings.Contains(r, "outboxd rescan") {
		t.Fatalf("discovery_stopped() = %q, want the cause and the fix", r)
	}

	// The re-scan, with a producer still in its transaction.
	producer, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer producer.Rollback(ctx)
	if _, err := producer.Exec(ctx, `SELECT outbox.emit('orders', 'straddle', 'T', '{}')`); err != nil {
		t.Fatal(err)
	}
	var events, aggregates, restamped int64
	if err := pool.QueryRow(ctx, `SELECT * FROM outbox.rescan_discovery()`).Scan(&events, &aggregates, &restamped); err != nil {
		t.Fatal(err)
	}
	// Pending: held 1 and 2, delivered 2, copied 1, far 1, during 1.
	// Delivery rows made ready: delivered (idle), copied, far, during (held
	// is ready already). Re-stamped: far, whose id this cluster has not
	// reached.
	if events != 6 || aggregates != 4 || restamped != 1 {
		t.Fatalf("rescan = %d events, %d aggregates, %d re-stamped; want 6, 4, 1", events, aggregates, restamped)
	}
	if r := discoveryStopped(t, pool); r != "" {
		t.Fatalf("still stopped after the re-scan: %s", r)
	}
	if n := discover(t, pool); n != 0 {
		t.Fatalf("the first round after the re-scan found %d events, want 0 (nothing new; copies are not found again)", n)
	}
	if err := producer.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	emitN(t, pool, "after", 1)
	if n := discover(t, pool); n != 2 {
		t.Fatalf("round after the re-scan found %d events, want 2 (straddle and after)", n)
	}

	delivered := drain(t, pool)
	want := map[string][]int64{"held": {1, 2}, "delivered": {2}, "copied": {1}, "far": {1}, "during": {1}, "straddle": {1}, "after": {1}}
	if fmt.Sprint(delivered) != fmt.Sprint(want) {
		t.Fatalf("delivered %v, want %v", delivered, want)
	}
	if n := strandedEvents(t, pool); n != 0 {
		t.Fatalf("%d stranded events", n)
	}
	if n := count(t, pool, `SELECT count(*) FROM outbox.late_event`); n != 0 {
		t.Fatalf("%d late events", n)
	}
}

// A transaction counter set back in the same cluster (pg_resetwal) stops
// discovery as well, and the first to notice records it: once the counter
// passes the stored xmax again, discovery still refuses to resume silently,
// and the events written in between are delivered after a re-scan.
func TestCounterSetBackStopsDiscoveryForGood(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	emitN(t, pool, "before", 1)
	discover(t, pool)
	// Far enough ahead that tests running beside this one cannot make the
	// counter pass it.
	stored := counter(t, pool) + 1_000_000_000
	exec(t, pool, fmt.Sprintf(`UPDATE outbox.discovery SET snapshot = '%[1]d:%[1]d:'`, stored))

	err := discoverErr(t, pool)
	wantSQLState(t, err, "XX001")
	if !strings.Contains(err.Error(), "transaction counter") {
		t.Fatalf("discovery's error does not name the cause: %v", err)
	}
	emitN(t, pool, "during", 1) // an id below the stored xmax: no round would find it
	if r := discoveryStopped(t, pool); !strings.Contains(r, "transaction counter") {
		t.Fatalf("discovery_stopped() = %q", r)
	}
	// The counter passes the stored xmax, as it would after a billion
	// transactions: the snapshot is moved below it instead.
	exec(t, pool, `UPDATE outbox.discovery SET snapshot = pg_current_snapshot()`)
	wantSQLState(t, discoverErr(t, pool), "XX001")
	if r := discoveryStopped(t, pool); !strings.Contains(r, "transaction counter") {
		t.Fatalf("discovery_stopped() after the counter passed = %q, want it still stopped", r)
	}

	exec(t, pool, `SELECT * FROM outbox.rescan_discovery()`)
	delivered := drain(t, pool)
	if fmt.Sprint(delivered) != fmt.Sprint(map[string][]int64{"before": {1}, "during": {1}}) {
		t.Fatalf("delivered %v, want before and during", delivered)
	}
}

// discovery_stopped records a stop only against the state it computed the
// reason from: a re-scan that commits between its read and its write has
// stored a fresh snapshot of this cluster, and discovery must stay running.
// The test holds discovery_stopped between the two with a SHARE lock on
// outbox.discovery (its read passes, its UPDATE waits; pg_blocking_pids says
// when), stores what a re-scan stores from the lock's holder, and lets it go
// on.
func TestDiscoveryStoppedLeavesARescanThatCommittedMeanwhile(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	exec(t, pool, `UPDATE outbox.discovery SET system_identifier = 42`) // restored from another cluster
	stoppedCheckRacingARescan(t, pool,
		`snapshot = pg_current_snapshot(), advanced_at = now(), system_identifier = outbox.cluster_system_identifier()`)
}

// stoppedCheckRacingARescan runs discovery_stopped while a re-scan (a
// transaction holding outbox.discovery in SHARE mode) stores what
// rescanSet sets, between the check's read and its write (pg_blocking_pids
// says when the check waits), and fails unless discovery is running after
// both and no stop was recorded against the re-scanned state.
func stoppedCheckRacingARescan(t *testing.T, pool *pgxpool.Pool, rescanSet string) {
	t.Helper()
	ctx := testContext(t)
	rescan, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = rescan.Rollback(context.WithoutCancel(ctx)) }()
	rescanPID := backendPID(t, rescan)
	if _, err := rescan.Exec(ctx, `LOCK TABLE outbox.discovery IN SHARE MODE`); err != nil {
		t.Fatal(err)
	}
	checker, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer checker.Release()
	checkerPID := backendPID(t, checker)
	done := make(chan error, 1)
	go func() {
		var reason *string
		done <- checker.QueryRow(ctx, `SELECT outbox.discovery_stopped()`).Scan(&reason)
	}()
	waitUntilBlockedBy(t, pool, checkerPID, rescanPID)
	if _, err := rescan.Exec(ctx, `UPDATE outbox.discovery SET `+rescanSet); err != nil {
		t.Fatal(err)
	}
	if err := rescan.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-ctx.Done():
		t.Fatal("discovery_stopped never finished")
	}
	if got := discoveryStopped(t, pool); got != "" {
		t.Fatalf("discovery stopped after a re-scan committed: %s", got)
	}
	if n := count(t, pool, `SELECT count(*) FROM outbox.discovery WHERE stopped_reason IS NOT NULL`); n != 0 {
		t.Fatal("a stop was recorded against the re-scanned state")
	}
}
