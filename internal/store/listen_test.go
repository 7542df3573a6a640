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

// An op interrupts the connection's wait for notifications and runs on
// that connection, although no notification comes: nothing is notified
// here, so without the interrupt the op would wait for ever.
func TestAListenOpInterruptsTheWait(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	if _, err := pool.Exec(ctx, `UPDATE outbox.settings SET producer_wakeups = 'on'`); err != nil {
		t.Fatal(err)
	}
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
	running, release := make(chan struct{}), make(chan struct{})
	ops.Send(ctx, func(ctx context.Context, c *store.ListenConn) error {
		close(running)
		<-release
		_, err := c.MaySleep(ctx) // the connection still answers
		return err
	})
	<-running
	if _, err := pool.Exec(ctx, `SELECT pg_notify($1, 'during')`, testChannel); err != nil {
		t.Fatal(err)
	}
	close(release)
	select {
	case p := <-l.notices:
		if p != "during" {
			t.Fatalf("notified %q, want %q", p, "during")
		}
	case err := <-l.ended:
		t.Fatalf("Listen ended: %v", err)
	case <-ctx.Done():
		t.Fatal("the notification sent while the op ran never came")
	}
	if _, err := pool.Exec(ctx, `SELECT pg_notify($1, 'after')`, testChannel); err != nil {
		t.Fatal(err)
	}
	select {
	case p := <-l.notices:
		if p != "after" {
			t.Fatalf("notified %q, want %q", p, "after")
		}
	case <-ctx.Done():
		t.Fatal("no notification came after the op: the connection stopped listening")
	}
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
	before := make(chan bool, 1)
	ops.Send(ctx, func(_ context.Context, c *store.ListenConn) error {
		before <- c == nil
		return nil
	})
	select {
	case isNil := <-before:
		if !isNil {
			t.Fatal("an op sent before any Listen ran with a connection")
		}
	default:
		t.Fatal("an op sent while no Listen runs was not answered at once")
	}

	l := startListener(t, ctx, url, "listen-answer-test", &ops)
	running, release := make(chan struct{}), make(chan struct{})
	ops.Send(ctx, func(ctx context.Context, c *store.ListenConn) error {
		close(running)
		<-release
		_, err := c.MaySleep(ctx) // fails: the backend is gone
		return err
	})
	<-running
	queued := make(chan bool, 1)
	ops.Send(ctx, func(_ context.Context, c *store.ListenConn) error {
		queued <- c == nil
		return nil
	})
	if _, err := pool.Exec(ctx, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity
		WHERE application_name = 'listen-answer-test' AND datname = current_database()`); err != nil {
		t.Fatal(err)
	}
	close(release)
	select {
	case err := <-l.ended:
		if err == nil || errors.Is(err, context.Canceled) {
			t.Fatalf("Listen ended with %v, want the connection's failure", err)
		}
		l.ended <- err // for the cleanup
	case <-ctx.Done():
		t.Fatal("Listen went on after its connection was terminated")
	}
	select {
	case isNil := <-queued:
		if !isNil {
			t.Fatal("the op queued as the connection failed ran with a connection")
		}
	default:
		t.Fatal("the op queued as the connection failed was never answered")
	}
	after := make(chan bool, 1)
	ops.Send(ctx, func(_ context.Context, c *store.ListenConn) error {
		after <- c == nil
		return nil
	})
	select {
	case isNil := <-after:
		if !isNil {
			t.Fatal("an op sent after Listen ended ran with a connection")
		}
	default:
		t.Fatal("an op sent after Listen ended was not answered at once")
	}
}
