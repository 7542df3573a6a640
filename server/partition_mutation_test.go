package server_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/outboxd/outboxd/internal/testdb"
)

// A replica whose turn may have taken partitions it did not hear about (the
// statement committed, its answer was lost) counts as possibly owning
// some: once its last session ends it still sends a turn, which gives
// everything the table records as its own back at once, instead of
// leaving the partitions owned by a replica that believes it owns none
// until its membership expires (a mutation sweep found this untested).
func TestReplicaGivesBackPartitionsItDidNotHearAboutWhenItsSessionsEnd(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	a := startOwner(t, url, "a", time.Hour, nil)
	var turns atomic.Int32
	a.Server.SetOwnershipHooks(func(wants bool) error {
		switch {
		case turns.Add(1) == 1:
			if _, err := pool.Exec(ctx, `SELECT outbox.own_partitions('a', $1, true, interval '1 hour')`, a.Server.Instance()); err != nil {
				t.Error(err)
			}
			return errors.New("injected: the answer was lost")
		case wants:
			// No turn hears of the partitions while the session lasts.
			return errors.New("injected: the database did not answer")
		}
		return nil
	}, nil)
	end := openSession(t, a, "ra")
	waitOwners(t, pool, map[string]int{"a": 256})
	if got := a.Server.OwnedPartitions(); len(got) != 0 {
		t.Fatalf("a believes it owns %d partitions after its turn failed", len(got))
	}
	end()
	waitOwners(t, pool, map[string]int{"": 256}, a)
}
