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

// These tests hold discovery's promise (no committed event is missed, each
// is found once) where a mutation sweep of the discovery functions found it
// unheld; each names the change it rules out. Races are forced with locks
// held open and pg_blocking_pids, never sleeps.

// rescan runs outbox.rescan_discovery() on conn, for runBehind.
func rescan(ctx context.Context, conn *pgxpool.Conn) error {
	_, err := conn.Exec(ctx, `SELECT * FROM outbox.rescan_discovery()`)
	return err
}

// holdDiscoveryTurn opens a transaction that holds the discovery lock, as a
// round in progress does, and returns it with its backend's pid.
func holdDiscoveryTurn(t *testing.T, pool *pgxpool.Pool) (pgx.Tx, int) {
	t.Helper()
	ctx := testContext(t)
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock(7954802400917419382)`); err != nil {
		t.Fatal(err)
	}
	return tx, backendPID(t, tx)
}

// A re-scan takes discovery's turn: while a round holds it, the re-scan
// waits, so that it never stores its snapshot beside (or under) one a round
// is storing. Kills: rescan_discovery without its pg_advisory_xact_lock.
func TestARescanWaitsForARoundsTurn(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPoolConfig(t, func(c *pgxpool.Config) { c.MaxConns = 6 })
	emitN(t, pool, "a", 1)
	turn, pid := holdDiscoveryTurn(t, pool)
	done := runBehind(t, pool, pid, rescan)
	select {
	case err := <-done:
		t.Fatalf("the re-scan ran while a round held discovery's turn (err %v)", err)
	default:
	}
	if err := turn.Commit(testContext(t)); err != nil {
		t.Fatal(err)
	}
	await(t, done)
	if got := claimRevisions(t, pool); got["a"] != 1 {
		t.Fatalf("claim after the re-scan = %v, want a at revision 1", got)
	}
}

// As a round does (TestDiscoveryWaitsForAnAckInItsTransaction), a re-scan
// locks the delivery rows of what it found and decides after the locks: an
// ack still in its transaction ends a's lease with nothing to follow (idle)
// while revision 2 commits; the re-scan must wait for the ack and then wake
// a. Deciding on what it read before (leased: work in hand) would leave
// revision 2 behind an idle aggregate for good. Kills: rescan_discovery
// without its outbox.lock_deliveries.
func TestARescanWaitsForAnAckInItsTransaction(t *testing.T) {
	t.Parallel()
	pool, ack, ackPID := ackOpenWhileRevision2Commits(t)
	done := runBehind(t, pool, ackPID, rescan)
	if err := ack.Commit(testContext(t)); err != nil {
		t.Fatal(err)
	}
	await(t, done)

	if got := claimRevisions(t, pool); got["a"] != 2 {
		t.Fatalf("claim after the re-scan = %v, want a at revision 2", got)
	}
	if n := strandedEvents(t, pool); n != 0 {
		t.Fatalf("%d stranded events", n)
	}
}

// A re-scan wakes an aggregate held at a gap once the missing revision is
// pending, as a round does: otherwise a gap filled before the re-scan (whose
// snapshot then covers it, so no round finds it again) would hold the
// aggregate for good. Kills: rescan_discovery waking only idle rows.
func TestARescanWakesAnAggregateHeldAtAGap(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	exec(t, pool, `SELECT outbox.emit('orders', 'g', 'T', '{}', revision => 1)`)
	discover(t, pool)
	if got := claimRevisions(t, pool); got["g"] != 1 {
		t.Fatalf("claim = %v, want g revision 1", got)
	}
	ackEvents(t, pool, `aggregate_key = 'g' AND revision = 1`)
	exec(t, pool, `SELECT outbox.emit('orders', 'g', 'T', '{}', revision => 3)`)
	discover(t, pool)
	if got := claimRevisions(t, pool); len(got) != 0 {
		t.Fatalf("claim across g's gap = %v, want nothing", got)
	}
	if st := count(t, pool, `SELECT count(*) FROM outbox.delivery WHERE aggregate_key = 'g' AND state = 'gap'`); st != 1 {
		t.Fatal("g is not held at its gap")
	}

	// Revision 2 fills the gap; the re-scan, not a round, finds it.
	exec(t, pool, `SELECT outbox.emit('orders', 'g', 'T', '{}', revision => 2)`)
	exec(t, pool, `SELECT * FROM outbox.rescan_discovery()`)
	if n := discover(t, pool); n != 0 {
		t.Fatalf("a round after the re-scan found %d events, want none (the re-scan's snapshot covers them)", n)
	}
	if got := claimRevisions(t, pool); got["g"] != 2 {
		t.Fatalf("claim after the re-scan = %v, want g revision 2", got)
	}
}

// A re-scan that made rows ready says so, as a round does, with one NOTIFY
// outbox_wakeup, so that idle sessions of every replica claim at once; one
// that made nothing ready is silent. Kills: rescan_discovery without its
// pg_notify.
func TestARescanThatMadeRowsReadyWakesTheSessions(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pool := testdb.NewPool(t)
	next := listenWakeups(t, pool)
	sentinel := func() { exec(t, pool, `SELECT pg_notify('outbox_wakeup', 'sentinel')`) }

	emitN(t, pool, "a", 1)
	var woken int64
	if err := pool.QueryRow(ctx, `SELECT aggregates FROM outbox.rescan_discovery()`).Scan(&woken); err != nil || woken != 1 {
		t.Fatalf("re-scan made %d rows ready (err %v), want 1", woken, err)
	}
	sentinel()
	if got := next(); got != "" {
		t.Fatalf("after a re-scan that made a row ready, next outbox_wakeup notice %q, want the re-scan's", got)
	}
	if got := next(); got != "sentinel" {
		t.Fatalf("next notice %q, want the sentinel", got)
	}
	exec(t, pool, `SELECT * FROM outbox.rescan_discovery()`)
	sentinel()
	if got := next(); got != "sentinel" {
		t.Fatalf("after a re-scan that made nothing ready, next notice %q, want only the sentinel", got)
	}
}

// Rounds take turns: a scan while another round holds discovery's turn
// returns nothing (the round that holds it finds the events), and a whole
// round then reports nothing and stores nothing, rather than failing at its
// apply. Kills: discover_scan without its pg_try_advisory_xact_lock.
func TestARoundWhileAnotherHoldsTheTurnFindsNothing(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pool := testdb.NewPool(t)
	emitN(t, pool, "a", 1)
	var stored string
	if err := pool.QueryRow(ctx, `SELECT snapshot::text FROM outbox.discovery`).Scan(&stored); err != nil {
		t.Fatal(err)
	}
	turn, _ := holdDiscoveryTurn(t, pool)
	if n := count(t, pool, `SELECT count(*) FROM outbox.discover_scan()`); n != 0 {
		t.Fatalf("a scan while another round holds the turn returned %d rows, want none", n)
	}
	var events, woken int64
	if err := pool.QueryRow(ctx, `SELECT events, aggregates FROM outbox.discover()`).Scan(&events, &woken); err != nil {
		t.Fatalf("a round while another holds the turn: %v", err)
	}
	if events != 0 || woken != 0 {
		t.Fatalf("a round while another holds the turn found %d events and woke %d rows, want none", events, woken)
	}
	var now string
	if err := pool.QueryRow(ctx, `SELECT snapshot::text FROM outbox.discovery`).Scan(&now); err != nil {
		t.Fatal(err)
	}
	if now != stored {
		t.Fatalf("the stored snapshot moved from %s to %s while another round held the turn", stored, now)
	}
	if err := turn.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if n := discover(t, pool); n != 1 {
		t.Fatalf("the round after the turn was given back found %d events, want 1", n)
	}
}

// The apply writes exactly what the scan's snapshot N shows: a producer
// whose transaction was running at N and commits between the scan and the
// apply (whose statements see it committed) is left to the next round,
// which finds it from N's running list. Applied early, its event would be
// found by two rounds. Kills: discover_apply without
// pg_visible_in_snapshot.
func TestTheApplyTakesOnlyWhatTheScansSnapshotShows(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pool := testdb.NewPool(t)
	producer, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = producer.Rollback(ctx) }()
	if _, err := producer.Exec(ctx, `SELECT outbox.emit('orders', 'late', 'T', '{}')`); err != nil {
		t.Fatal(err)
	}
	emitN(t, pool, "early", 1)

	err = pgx.BeginFunc(ctx, pool, func(round pgx.Tx) error {
		var prev, next string
		var n int64
		if err := round.QueryRow(ctx, `SELECT min(prev_snapshot), min(snapshot), min(events) FROM outbox.discover_scan()`).
			Scan(&prev, &next, &n); err != nil {
			return err
		}
		if n != 1 {
			t.Errorf("the scan found %d events, want the committed one", n)
		}
		if err := producer.Commit(ctx); err != nil {
			return err
		}
		_, err := round.Exec(ctx, `SELECT * FROM outbox.discover_apply($1, $2)`, prev, next)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if n := count(t, pool, `SELECT count(*) FROM outbox.delivery WHERE aggregate_key = 'late'`); n != 0 {
		t.Fatalf("the round applied an event its scan's snapshot did not show (%d delivery rows of it)", n)
	}
	if n := discover(t, pool); n != 1 {
		t.Fatalf("the next round found %d events, want the late commit's 1", n)
	}
	if n := discover(t, pool); n != 0 {
		t.Fatalf("a third round found %d events, want none", n)
	}
	if got := claimRevisions(t, pool); len(got) != 2 {
		t.Fatalf("claimed %v, want both aggregates", got)
	}
}

// A round that takes a backlog in parts stores N cut at the first xid it
// leaves out, with xmin the lower of N's and that xid: when every
// transaction below the cut has ended (N's xmin above it, as on a quiet
// cluster), the cut is "bound:bound:", not "xmin(N):bound:", which is no
// snapshot at all (xmin above xmax) and fails every round from then on,
// so that nothing more is ever found. Quiet is the whole cluster's state
// (PostgreSQL's xmin is every database's), so the test runs on a cluster of
// its own with autovacuum off, where nothing else runs: its first scan is
// of a quiet cluster, and a stored cut must show it (its xmin at its xmax).
// Kills: the cut snapshot's xmin without least(.., bound).
func TestACutOfAQuietClusterIsASnapshot(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a PostgreSQL cluster of its own")
	}
	t.Parallel()
	ctx := testContext(t)
	pool := migratedThrowaway(t, "autovacuum = off")
	emitN(t, pool, "first", 1)
	emitN(t, pool, "second", 1)
	var stored string
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		var prev, next string
		if err := tx.QueryRow(ctx, `SELECT min(prev_snapshot), min(snapshot) FROM outbox.discover_scan(NULL, 1)`).Scan(&prev, &next); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `SELECT * FROM outbox.discover_apply($1, $2)`, prev, next); err != nil {
			return err
		}
		return tx.QueryRow(ctx, `SELECT snapshot::text FROM outbox.discovery`).Scan(&stored)
	})
	if err != nil {
		t.Fatalf("a round cut after one transaction failed: %v", err)
	}
	if parts := strings.Split(stored, ":"); len(parts) != 3 || parts[0] != parts[1] {
		var running string
		_ = pool.QueryRow(ctx, `SELECT coalesce(string_agg(format('%s xid %s xmin %s: %s', backend_type, backend_xid, backend_xmin, query), '; '), 'none')
			FROM pg_stat_activity WHERE pid <> pg_backend_pid() AND (backend_xid IS NOT NULL OR backend_xmin IS NOT NULL)`).Scan(&running)
		t.Fatalf("stored cut %q; on a quiet cluster want xmin at xmax (bound:bound:). Holding xids or snapshots: %s", stored, running)
	}
	// The second transaction is left for the next round, which works.
	if n := discover(t, pool); n != 1 {
		t.Fatalf("the round after the cut found %d events, want the second transaction's 1", n)
	}
}

// listenWakeups returns a connection of its own that LISTENs on
// outbox_wakeup, as a replica's listener does, and a function returning the
// payload of its next notice.
func listenWakeups(t *testing.T, pool *pgxpool.Pool) func() string {
	t.Helper()
	ctx := testContext(t)
	listener, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { listener.Conn().Close(context.Background()); listener.Release() })
	if _, err := listener.Exec(ctx, `LISTEN outbox_wakeup`); err != nil {
		t.Fatal(err)
	}
	return func() string {
		t.Helper()
		n, err := listener.Conn().WaitForNotification(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return n.Payload
	}
}

// A round that made rows ready tells every replica's idle sessions with one
// NOTIFY outbox_wakeup (they claim at once, not at their next poll); a round
// that made none ready (it found only aggregates with work in hand) is
// silent. Notices of committed transactions arrive in commit order, so a
// sentinel sent after the round says whether the round sent one. Kills:
// discover_apply's pg_notify skipped.
func TestARoundThatMadeRowsReadyWakesEveryReplica(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	next := listenWakeups(t, pool)
	sentinel := func() { exec(t, pool, `SELECT pg_notify('outbox_wakeup', 'sentinel')`) }

	emitN(t, pool, "a", 1)
	if n := count(t, pool, `SELECT aggregates FROM outbox.discover()`); n != 1 {
		t.Fatalf("the round made %d rows ready, want 1", n)
	}
	sentinel()
	if got := next(); got != "" {
		t.Fatalf("after a round that made a row ready, next outbox_wakeup notice %q, want the round's", got)
	}
	if got := next(); got != "sentinel" {
		t.Fatalf("next notice %q, want the sentinel", got)
	}

	// a is ready (work in hand): its next revision makes nothing ready.
	emitN(t, pool, "a", 1)
	if n := count(t, pool, `SELECT aggregates FROM outbox.discover()`); n != 0 {
		t.Fatalf("the round made %d rows ready, want none (a was ready)", n)
	}
	sentinel()
	if got := next(); got != "sentinel" {
		t.Fatalf("after a round that made nothing ready, next notice %q, want only the sentinel", got)
	}
}

// As TestDiscoveryStoppedLeavesARescanThatCommittedMeanwhile, for a stop
// on this cluster's own counter (set back: the stored snapshot's xmax ahead
// of it), where a re-scan stores a fresh snapshot under the same system
// identifier: discovery_stopped, held between its read and its write,
// must not record the stop against the re-scanned state, or discovery
// would stay stopped after the re-scan meant to resume it. Kills:
// discovery_stopped's UPDATE without its snapshot condition.
func TestDiscoveryStoppedLeavesARescanOfThisClusterThatCommittedMeanwhile(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	stored := counter(t, pool) + 1_000_000_000
	exec(t, pool, fmt.Sprintf(`UPDATE outbox.discovery SET snapshot = '%[1]d:%[1]d:'`, stored))
	stoppedCheckRacingARescan(t, pool, `snapshot = pg_current_snapshot(), advanced_at = now()`)
	emitN(t, pool, "after", 1)
	if n := discover(t, pool); n != 1 {
		t.Fatalf("the round after the re-scan found %d events, want 1", n)
	}
}
