package migrations_test

import (
	"context"
	"database/sql"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	_ "github.com/jackc/pgx/v5/stdlib"

	"github.com/outboxd/outboxd/internal/devdb"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/migrations"
)

// listenForDiscover returns a connection of its own that LISTENs on
// outbox_discover, as a replica's listener does.
func listenForDiscover(t *testing.T, pool *pgxpool.Pool) *pgxpool.Conn {
	t.Helper()
	ctx := testContext(t)
	c, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Conn().Close(context.Background()); c.Release() })
	if _, err := c.Exec(ctx, `LISTEN outbox_discover`); err != nil {
		t.Fatal(err)
	}
	return c
}

// nextDiscoverNotice returns the payload of the next notice on listener's
// outbox_discover. Notices of committed transactions arrive in commit order,
// so a test proves a producer did not notify by sending a sentinel after
// its commit and seeing the sentinel come first.
func nextDiscoverNotice(t *testing.T, listener *pgxpool.Conn) string {
	t.Helper()
	n, err := listener.Conn().WaitForNotification(testContext(t))
	if err != nil {
		t.Fatal(err)
	}
	return n.Payload
}

func sendSentinel(t *testing.T, pool *pgxpool.Pool) {
	t.Helper()
	exec(t, pool, `SELECT pg_notify('outbox_discover', 'sentinel')`)
}

func trySleep(t *testing.T, c *pgxpool.Conn) bool {
	t.Helper()
	var ok bool
	if err := c.QueryRow(testContext(t), `SELECT outbox.discovery_sleep()`).Scan(&ok); err != nil {
		t.Fatal(err)
	}
	return ok
}

// While a replica sleeps (holds outbox.discovery_sleep's lock), every way a
// producer records a new event notifies outbox_discover at commit: the
// trigger's common path (a plain INSERT, outbox.emit) and its checked path
// (headers, a producer's own id, its own revision). Once the replica wakes
// (outbox.discovery_wake), none does.
func TestProducersNotifyOnlyWhileAReplicaSleeps(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pool := testdb.NewPool(t)
	sleeper := listenForDiscover(t, pool)

	paths := []struct{ name, sql string }{
		{"insert", `INSERT INTO outbox.event (stream, aggregate_key, event_type, payload) VALUES ('s', 'a', 'T', '{}')`},
		{"emit", `SELECT outbox.emit('s', 'b', 'T', '{}')`},
		{"headers", `INSERT INTO outbox.event (stream, aggregate_key, event_type, payload, headers)
			VALUES ('s', 'c', 'T', '{}', '{"h": "v"}')`},
		{"own id", `INSERT INTO outbox.event (event_id, stream, aggregate_key, event_type, payload)
			VALUES (gen_random_uuid(), 's', 'd', 'T', '{}')`},
		{"own revision", `INSERT INTO outbox.event (stream, aggregate_key, revision, event_type, payload)
			VALUES ('s', 'e', 7, 'T', '{}')`},
	}
	if !trySleep(t, sleeper) {
		t.Fatal("discovery_sleep() = false on a database where nobody sleeps")
	}
	for _, p := range paths {
		exec(t, pool, p.sql)
		if got := nextDiscoverNotice(t, sleeper); got != "" {
			t.Errorf("%s while a replica sleeps: next notice %q, want the producer's", p.name, got)
		}
	}

	var woke bool
	if err := sleeper.QueryRow(ctx, `SELECT outbox.discovery_wake()`).Scan(&woke); err != nil || !woke {
		t.Fatalf("discovery_wake() = %v, %v; want true from the sleeper", woke, err)
	}
	for _, p := range paths {
		exec(t, pool, strings.Replace(p.sql, "7", "8", 1))
		sendSentinel(t, pool)
		if got := nextDiscoverNotice(t, sleeper); got != "sentinel" {
			t.Errorf("%s with nobody asleep: next notice %q, want only the sentinel", p.name, got)
		}
	}
}

// The lock that makes sleeping race-free: a producer that inserted before a
// replica tried to sleep holds the key shared to its commit, so the replica
// cannot fall asleep (and then miss the event, which notified nobody) until
// the event is committed, when its check after the lock sees it, at every
// isolation level a producer may use (locks are not bound to snapshots).
// Only one replica sleeps at a time.
func TestAnOpenProducerKeepsReplicasFromSleeping(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pool := testdb.NewPool(t)
	sleeper := listenForDiscover(t, pool)
	other := listenForDiscover(t, pool)

	for _, iso := range []pgx.TxIsoLevel{pgx.ReadCommitted, pgx.RepeatableRead, pgx.Serializable} {
		tx, err := pool.BeginTx(ctx, pgx.TxOptions{IsoLevel: iso})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, `INSERT INTO outbox.event (stream, aggregate_key, event_type, payload) VALUES ('s', 'a', 'T', '{}')`); err != nil {
			t.Fatal(err)
		}
		if trySleep(t, sleeper) {
			_ = tx.Rollback(ctx)
			t.Fatalf("%s: a replica fell asleep while a producer's insert was uncommitted: that event would notify nobody", iso)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		if !trySleep(t, sleeper) {
			t.Fatalf("%s: discovery_sleep() = false once the producer committed", iso)
		}
		if trySleep(t, other) {
			t.Errorf("%s: a second replica fell asleep beside the first", iso)
		}
		if _, err := sleeper.Exec(ctx, `SELECT outbox.discovery_wake()`); err != nil {
			t.Fatal(err)
		}
	}
}

// outbox.settings.producer_wakeups: 'off' keeps every replica awake, 'on'
// lets one sleep, and 'auto' (the default) does where the cluster refuses
// prepared transactions, as the shared test cluster does.
func TestProducerWakeupsSetting(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	sleeper := listenForDiscover(t, pool)
	var maxPrepared int
	if err := pool.QueryRow(testContext(t), `SELECT current_setting('max_prepared_transactions')::integer`).Scan(&maxPrepared); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		setting string
		want    bool
	}{{"off", false}, {"on", true}, {"auto", maxPrepared == 0}} {
		exec(t, pool, `UPDATE outbox.settings SET producer_wakeups = '`+c.setting+`'`)
		if got := trySleep(t, sleeper); got != c.want {
			t.Errorf("producer_wakeups %s: discovery_sleep() = %v, want %v", c.setting, got, c.want)
		}
		exec(t, pool, `SELECT outbox.discovery_wake()`) // from another session: a no-op
		if _, err := sleeper.Exec(testContext(t), `SELECT outbox.discovery_wake()`); err != nil {
			t.Fatal(err)
		}
	}
	_, err := pool.Exec(testContext(t), `UPDATE outbox.settings SET producer_wakeups = 'sometimes'`)
	wantSQLState(t, err, "23514")
}

// Two-phase commit: PostgreSQL refuses PREPARE TRANSACTION in a transaction
// that ran NOTIFY, so a producer that prepares must never meet a sleeping
// replica. In a cluster that allows prepared transactions the default
// ('auto') keeps replicas awake, and a producer prepares and commits its
// event; 'on' there is the operator's choice, and its cost is stated here:
// PREPARE fails while a replica sleeps.
func TestPreparedProducersAndSleepingReplicas(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a PostgreSQL cluster of its own")
	}
	t.Parallel()
	ctx := testContext(t)
	pool := migratedThrowaway(t, "max_prepared_transactions = 4")
	sleeper := listenForDiscover(t, pool)

	prepare := func(gid string) error {
		c, err := pool.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Release()
		if _, err := c.Exec(ctx, `BEGIN`); err != nil {
			t.Fatal(err)
		}
		if _, err := c.Exec(ctx, `INSERT INTO outbox.event (stream, aggregate_key, event_type, payload) VALUES ('s', 'a', 'T', '{}')`); err != nil {
			t.Fatal(err)
		}
		_, err = c.Exec(ctx, `PREPARE TRANSACTION '`+gid+`'`)
		if err != nil {
			_, _ = c.Exec(ctx, `ROLLBACK`)
		}
		return err
	}

	if trySleep(t, sleeper) {
		t.Fatal("producer_wakeups auto: a replica fell asleep in a cluster that allows prepared transactions")
	}
	if err := prepare("auto"); err != nil {
		t.Fatalf("PREPARE under producer_wakeups auto: %v", err)
	}
	exec(t, pool, `COMMIT PREPARED 'auto'`)
	var events int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox.event`).Scan(&events); err != nil || events != 1 {
		t.Fatalf("events after COMMIT PREPARED: %d, %v; want 1", events, err)
	}

	exec(t, pool, `UPDATE outbox.settings SET producer_wakeups = 'on'`)
	if !trySleep(t, sleeper) {
		t.Fatal("producer_wakeups on: discovery_sleep() = false")
	}
	err := prepare("on")
	wantSQLState(t, err, "0A000")
	if err != nil && !strings.Contains(err.Error(), "NOTIFY") {
		t.Errorf("PREPARE while a replica sleeps: %v, want PostgreSQL's refusal after NOTIFY", err)
	}
}

// migratedThrowaway starts a PostgreSQL cluster of the test's own (with
// settings, postgresql.conf lines), migrates its postgres database and
// returns a pool on it. The cluster is stopped and removed at cleanup.
func migratedThrowaway(t *testing.T, settings ...string) *pgxpool.Pool {
	t.Helper()
	ctx := testContext(t)
	cluster, err := devdb.StartThrowaway(ctx, nil, settings...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cluster.Close(context.Background()) })
	db, err := sql.Open("pgx", cluster.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	if _, err := migrations.Up(ctx, db, nil); err != nil {
		t.Fatal(err)
	}
	return testdb.NewPoolURL(t, cluster.URL)
}
