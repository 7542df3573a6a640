package store

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/outboxd/outboxd/internal/testdb"
)

// The wake-up sweep's test of Listen's promise that every op sent runs
// (listen.go): an op that came as the connection failed, taken by the wait
// that failed, runs with a nil ListenConn before Listen returns, rather
// than with nobody to run it (the deferred stop answers only the ops still
// queued). In package store, to queue the op behind the wait under way
// without interrupting it (Send would): then nothing but the connection's
// failure ends the wait, and the op is certain to come with it. (Kills
// L07.)
func TestAnOpThatCameAsTheConnectionFailedRunsWithoutIt(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	const name = "listen-failed-op-test"
	var ops ListenOps
	ready, ended := make(chan struct{}), make(chan error, 1)
	lctx, lcancel := context.WithCancel(ctx)
	go func() {
		ended <- Listen(lctx, url, name, []string{"store_listen_mutation_test"},
			func() { close(ready) },
			func(*ListenConn, uint32, string, string) error { return nil }, &ops)
	}()
	var endErr error
	gotEnd := false
	defer func() {
		lcancel()
		if !gotEnd {
			<-ended
		}
	}()
	select {
	case <-ready:
	case endErr = <-ended:
		gotEnd = true
		t.Fatalf("Listen ended before it listened: %v", endErr)
	}
	ran := make(chan bool, 1)
	op := func(_ context.Context, c *ListenConn) error {
		ran <- c == nil
		return nil
	}
	// Queue op once the wait for notifications is under way (it set its
	// interrupt), as Send would but for the interrupt.
	for queued := false; !queued; {
		ops.mu.Lock()
		if ops.interrupt != nil {
			ops.queue = append(ops.queue, op)
			queued = true
		}
		ops.mu.Unlock()
		if !queued {
			select {
			case <-ctx.Done():
				t.Fatal("Listen never waited for notifications")
			case <-time.After(time.Millisecond):
			}
		}
	}
	if _, err := pool.Exec(ctx, `SELECT pg_terminate_backend(pid) FROM pg_stat_activity
		WHERE application_name = $1 AND datname = current_database()`, name); err != nil {
		t.Fatal(err)
	}
	select {
	case endErr = <-ended:
		gotEnd = true
	case <-ctx.Done():
		t.Fatal("Listen went on after its connection was terminated")
	}
	if endErr == nil {
		t.Fatal("Listen ended without an error after its connection was terminated")
	}
	select {
	case isNil := <-ran:
		if !isNil {
			t.Fatal("the op that came as the connection failed ran with the failed connection")
		}
	default:
		t.Fatal("the op that came as the connection failed was never run: Listen returned without answering it")
	}
}

// An error the notified callback returns ends the connection: Listen
// returns it (the waker's settingsChanged relies on this to give the
// sleeper's lock back when it cannot tell whether it still may sleep: the
// connection closes, and the lock goes with its session). (Kills L14.)
func TestAnErrorOfTheNotifiedCallbackEndsListen(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	const channel = "store_listen_mutation_test"
	errNotified := errors.New("the callback failed")
	var ops ListenOps
	ready, ended := make(chan struct{}), make(chan error, 1)
	lctx, lcancel := context.WithCancel(ctx)
	defer lcancel()
	go func() {
		ended <- Listen(lctx, url, "listen-callback-error-test", []string{channel},
			func() { close(ready) },
			func(_ *ListenConn, _ uint32, _, payload string) error {
				if payload == "fail" {
					return errNotified
				}
				return nil
			}, &ops)
	}()
	select {
	case <-ready:
	case err := <-ended:
		t.Fatalf("Listen ended before it listened: %v", err)
	}
	if _, err := pool.Exec(ctx, `SELECT pg_notify($1, 'fail')`, channel); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-ended:
		if !errors.Is(err, errNotified) {
			t.Fatalf("Listen ended with %v, want the callback's error", err)
		}
	case <-ctx.Done():
		lcancel()
		<-ended
		t.Fatal("Listen went on after its notified callback failed")
	}
}
