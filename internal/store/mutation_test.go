package store_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/outboxd/outboxd/internal/store"
	"github.com/outboxd/outboxd/internal/testdb"
)

// Tests written against mutants of the store that its other tests and the
// server's let through: each holds one promise of the store's API.

// A discovery round whose answer is lost after it was sent (here its
// context is cancelled while the round waits on a lock, which makes pgx
// close the connection under it) may have committed: Discover says so by
// wrapping ErrAnswerLost, which makes the sessions that lent it credit
// sweep for leases they never heard of. Kills a roundError that wraps
// ErrAnswerLost for no error.
func TestDiscoverAnswerLostOnceSent(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	st := store.New(pool)
	if _, err := pool.Exec(t.Context(), `SELECT outbox.emit('orders', 'o', 'T', '{}')`); err != nil {
		t.Fatal(err)
	}
	// Every round reads the event table: locked, the round waits.
	tx, err := pool.Begin(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(context.WithoutCancel(t.Context()))
	if _, err := tx.Exec(t.Context(), `LOCK TABLE outbox.event IN ACCESS EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	pids := make(chan uint32, 1)
	done := make(chan error, 1)
	offer := []store.Offer{{Holder: uuid.New(), RelayID: "r", TTL: time.Minute, Credit: 1}}
	go func() {
		_, err := st.Discover(ctx, "replica", 100, 0, offer, func(pid uint32) { pids <- pid })
		done <- err
	}()
	pid := <-pids
	deadline := time.Now().Add(60 * time.Second) // a hang guard, not a timed assertion
	for {
		var waiting bool
		if err := pool.QueryRow(t.Context(), `SELECT EXISTS (SELECT FROM pg_stat_activity WHERE pid = $1 AND wait_event_type = 'Lock')`,
			int64(pid)).Scan(&waiting); err != nil {
			t.Fatal(err)
		}
		if waiting {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the round's backend never waited on the event table's lock")
		}
		time.Sleep(20 * time.Millisecond)
	}
	cancel()
	if err := <-done; !errors.Is(err, store.ErrAnswerLost) {
		t.Errorf("a round cut off after it was sent: %v; want ErrAnswerLost", err)
	}
}

// A discovery round never sent (its context cancelled before the
// statement went out) surely did not commit: Discover's error wraps no
// ErrAnswerLost, so no session sweeps for nothing. Kills a roundError that
// takes every error but PostgreSQL's as a lost answer.
func TestDiscoverNotSentLosesNoAnswer(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	st := store.New(pool)
	if _, err := pool.Exec(t.Context(), `SELECT outbox.emit('orders', 'o', 'T', '{}')`); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	offer := []store.Offer{{Holder: uuid.New(), RelayID: "r", TTL: time.Minute, Credit: 1}}
	_, err := st.Discover(ctx, "replica", 100, 0, offer, func(uint32) { cancel() })
	if err == nil || errors.Is(err, store.ErrAnswerLost) {
		t.Errorf("a round cancelled before it was sent: %v; want an error that is not ErrAnswerLost", err)
	}
	d, err := st.Discover(t.Context(), "replica", 100, 0, offer, nil)
	if err != nil || len(d.Dispatched) != 1 {
		t.Errorf("the round after: %+v, %v; want its one event dispatched (the cancelled round did nothing)", d, err)
	}
}
