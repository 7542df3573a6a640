package migrations_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/outboxd/outboxd/internal/testdb"
)

// A waiting replica's registration is consumed by the first producer that
// finds it: one NOTIFY per registration, not one per event, and none while
// nobody waits.
func TestRegistrationIsConsumedByOneNotify(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	listener, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer listener.Close(ctx)
	if _, err := listener.Exec(ctx, "LISTEN outbox_wakeup"); err != nil {
		t.Fatal(err)
	}
	// notifications counts the wake-ups committed so far: notifications are
	// delivered in commit order, so everything before a sentinel notified
	// now has arrived once the sentinel has.
	notifications := func() int {
		exec(t, pool, `SELECT pg_notify('outbox_wakeup', 'sentinel')`)
		n := 0
		for {
			wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
			msg, err := listener.WaitForNotification(wctx)
			cancel()
			if err != nil {
				t.Fatal(err)
			}
			if msg.Payload == "sentinel" {
				return n
			}
			n++
		}
	}
	emitOne := func() {
		exec(t, pool, `SELECT outbox.emit('orders', 'o-1', 'T', '{}')`)
	}

	emitOne()
	if n := notifications(); n != 0 {
		t.Fatalf("%d notifications with nobody waiting", n)
	}
	exec(t, pool, `INSERT INTO outbox.listener VALUES ('replica-a', now() + interval '10 seconds'),
	                                              ('replica-b', now() + interval '10 seconds')`)
	for range 5 {
		emitOne()
	}
	if n := notifications(); n != 1 {
		t.Fatalf("%d notifications for 5 events and two registrations, want 1", n)
	}
	if n := count(t, pool, `SELECT count(*) FROM outbox.listener`); n != 0 {
		t.Fatalf("%d registrations left", n)
	}
	// A lapsed registration is cleared without a notification.
	exec(t, pool, `INSERT INTO outbox.listener VALUES ('replica-a', now() - interval '1 second')`)
	emitOne()
	if n := notifications(); n != 0 {
		t.Fatalf("%d notifications for a lapsed registration", n)
	}
}
