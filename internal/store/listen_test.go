package store_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxd/outboxd/internal/store"
	"github.com/outboxd/outboxd/internal/testdb"
)

const testChannel = "store_listen_test"

// listener runs store.Listen on url in the background until the test ends,
// with ops, and feeds what it is notified of (payloads) to notices.
type listener struct {
	ready   chan struct{}
	notices chan string
	ended   chan error
}

func startListener(t *testing.T, ctx context.Context, url, name string, ops *store.ListenOps) *listener {
	t.Helper()
	l := &listener{ready: make(chan struct{}), notices: make(chan string, 16), ended: make(chan error, 1)}
	ctx, cancel := context.WithCancel(ctx)
	go func() {
		l.ended <- store.Listen(ctx, url, name, []string{testChannel},
			func() { close(l.ready) },
			func(_ *store.ListenConn, _ uint32, _, payload string) error {
				l.notices <- payload
				return nil
			}, ops)
	}()
	t.Cleanup(func() {
		cancel()
		<-l.ended
	})
	select {
	case <-l.ready:
	case err := <-l.ended:
		t.Fatalf("Listen ended before it listened: %v", err)
	case <-ctx.Done():
		t.Fatal("Listen never listened")
	}
	return l
}

// sleeperHeldBy says whether the connection named name holds the discovery
// sleeper's lock: proof that an op's statement ran on that connection.
func sleeperHeldBy(ctx context.Context, t *testing.T, pool *pgxpool.Pool, name string) bool {
	t.Helper()
	var held bool
	if err := pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
		WHERE a.application_name = $1 AND a.datname = current_database() AND l.locktype = 'advisory' AND l.granted)`,
		name).Scan(&held); err != nil {
		t.Fatal(err)
	}
	return held
}

// notify sends payload on the test channel, committed.
func notify(ctx context.Context, t *testing.T, pool *pgxpool.Pool, payload string) {
	t.Helper()
	if _, err := pool.Exec(ctx, `SELECT pg_notify($1, $2)`, testChannel, payload); err != nil {
		t.Fatal(err)
	}
}

// expect waits for the listener's next notice, which must be payload; why
// says what its absence would mean.
func (l *listener) expect(ctx context.Context, t *testing.T, payload, why string) {
	t.Helper()
	select {
	case p := <-l.notices:
		if p != payload {
			t.Fatalf("notified %q, want %q", p, payload)
		}
	case err := <-l.ended:
		l.ended <- err // for the cleanup
		t.Fatalf("Listen ended (%v): %s", err, why)
	case <-ctx.Done():
		t.Fatal(why)
	}
}

// sleepableDatabase is a fresh database whose settings let a replica sleep
// (producer_wakeups on), and a pool on it.
func sleepableDatabase(t *testing.T, ctx context.Context) (string, *pgxpool.Pool) {
	t.Helper()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	if _, err := pool.Exec(ctx, `UPDATE outbox.settings SET producer_wakeups = 'on'`); err != nil {
		t.Fatal(err)
	}
	return url, pool
}

// sendReportingNil sends an op that reports whether it was given no
// connection.
func sendReportingNil(ctx context.Context, ops *store.ListenOps) <-chan bool {
	isNil := make(chan bool, 1)
	ops.Send(ctx, func(_ context.Context, c *store.ListenConn) error {
		isNil <- c == nil
		return nil
	})
	return isNil
}

// answeredWithoutConnection fails the test unless the op behind isNil has
// run already, with no connection.
func answeredWithoutConnection(t *testing.T, isNil <-chan bool, which string) {
	t.Helper()
	select {
	case ok := <-isNil:
		if !ok {
			t.Fatalf("%s ran with a connection", which)
		}
	default:
		t.Fatalf("%s was not answered", which)
	}
}

// holdListener sends an op that holds the listener until release is
// closed, then runs a statement on the connection and returns its error;
// it returns once the op runs.
func holdListener(ctx context.Context, ops *store.ListenOps) (release chan struct{}) {
	running, release := make(chan struct{}), make(chan struct{})
	ops.Send(ctx, func(ctx context.Context, c *store.ListenConn) error {
		close(running)
		<-release
		_, err := c.MaySleep(ctx)
		return err
	})
	<-running
	return release
}

// An op interrupts the connection's wait for notifications and runs on
// that connection, although no notification comes: nothing is notified
// here, so without the interrupt the op would wait for ever.
func TestAListenOpInterruptsTheWait(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	url, pool := sleepableDatabase(t, ctx)
	var ops store.ListenOps
	startListener(t, ctx, url, "listen-op-test", &ops)
	type slept struct {
		ok  bool
		err error
	}
	done := make(chan slept, 1)
	ops.Send(ctx, func(ctx context.Context, c *store.ListenConn) error {
		ok, err := c.Sleep(ctx)
		done <- slept{ok, err}
		return nil
	})
	select {
	case r := <-done:
		if r.err != nil || !r.ok {
			t.Fatalf("Sleep on the LISTEN connection = %v, %v; want true, nil", r.ok, r.err)
		}
	case <-ctx.Done():
		t.Fatal("the op never ran: it did not interrupt the wait")
	}
	if !sleeperHeldBy(ctx, t, pool, "listen-op-test") {
		t.Fatal("the op's statement did not run on the LISTEN connection")
	}
}

// A notification that comes while an op runs waits in the connection and
// is delivered after it; the connection keeps listening after an op.
func TestANotificationDuringAnOpIsDeliveredAfterIt(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	var ops store.ListenOps
	l := startListener(t, ctx, url, "listen-notice-test", &ops)
	release := holdListener(ctx, &ops) // then a statement: the connection still answers
	notify(ctx, t, pool, "during")
	close(release)
	l.expect(ctx, t, "during", "the notification sent while the op ran never came")
	notify(ctx, t, pool, "after")
	l.expect(ctx, t, "after", "no notification came after the op: the connection stopped listening")
}

// Every op sent runs once: one sent while no Listen runs, and one queued as
// the connection fails, are told there is no connection (a nil
// ListenConn) rather than never answered.
func TestEveryListenOpIsAnswered(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	var ops store.ListenOps
	answeredWithoutConnection(t, sendReportingNil(ctx, &ops), "an op sent before any Listen")

	l := startListener(t, ctx, url, "listen-answer-test", &ops)
	release := holdListener(ctx, &ops) // then a statement, which fails: the backend is gone
	queued := sendReportingNil(ctx, &ops)
	if _, err := pool.Exec(ctx, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity
		WHERE application_name = 'listen-answer-test' AND datname = current_database()`); err != nil {
		t.Fatal(err)
	}
	close(release)
	select {
	case err := <-l.ended:
		l.ended <- err // for the cleanup
		if err == nil || errors.Is(err, context.Canceled) {
			t.Fatalf("Listen ended with %v, want the connection's failure", err)
		}
	case <-ctx.Done():
		t.Fatal("Listen went on after its connection was terminated")
	}
	answeredWithoutConnection(t, queued, "the op queued as the connection failed")
	answeredWithoutConnection(t, sendReportingNil(ctx, &ops), "an op sent after Listen ended")
}

// Ops run in the order they were sent, which is what lets a sender go on
// without waiting for its op (the discovery loop's give-back of the
// sleeper's lock comes before its next try to sleep): a Sleep and then a
// Wake queued behind a busy listener leave the lock given back.
func TestListenOpsRunInTheOrderSent(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	url, pool := sleepableDatabase(t, ctx)
	var ops store.ListenOps
	startListener(t, ctx, url, "listen-order-test", &ops)
	release := holdListener(ctx, &ops)
	ran := make(chan string, 2)
	ops.Send(ctx, func(ctx context.Context, c *store.ListenConn) error {
		ok, err := c.Sleep(ctx)
		if err == nil && !ok {
			err = errors.New("the sleeper's lock was not taken")
		}
		ran <- "sleep"
		return err
	})
	ops.Send(ctx, func(ctx context.Context, c *store.ListenConn) error {
		ran <- "wake"
		return c.Wake(ctx)
	})
	close(release)
	for _, want := range []string{"sleep", "wake"} {
		select {
		case got := <-ran:
			if got != want {
				t.Fatalf("the %s op ran first; want the order sent (sleep, then wake)", got)
			}
		case <-ctx.Done():
			t.Fatal("the queued ops never ran")
		}
	}
	// The wake op's statement has run once a later op runs.
	holdListener(ctx, &ops) <- struct{}{}
	if sleeperHeldBy(ctx, t, pool, "listen-order-test") {
		t.Fatal("the sleeper's lock is held after Sleep and then Wake")
	}
}
