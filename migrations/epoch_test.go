package migrations_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxd/outboxd/internal/testdb"
)

// Epochs fence old leases, and claims commit without waiting for the WAL
// flush, so an epoch must never be handed out twice, even after a crash
// lost a claim: every lease's epoch exceeds the previous one and is at
// least the clock in microseconds (a claim lost in a crash had an earlier
// clock reading than any claim after recovery).
func TestEpochsGrowAndFollowTheClock(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.NewPool(t)
	exec(t, pool, `SELECT outbox.emit('orders', 'o-1', 'T', '{}')`)
	exec(t, pool, `SELECT outbox.discover()`)
	claim := func() int64 {
		t.Helper()
		var epoch int64
		// A negative TTL makes the lease claimable again at once.
		if err := pool.QueryRow(ctx, `SELECT epoch FROM outbox.claim(gen_random_uuid(), 'r', 'x', NULL, 1, interval '-1 second')`).
			Scan(&epoch); err != nil {
			t.Fatal(err)
		}
		return epoch
	}
	before := time.Now().Add(-time.Minute).UnixMicro()
	first, second := claim(), claim()
	if first < before {
		t.Fatalf("epoch %d is below the clock in microseconds (%d)", first, before)
	}
	if second <= first {
		t.Fatalf("epochs %d then %d: not increasing", first, second)
	}
}

// testContext bounds a test's database calls, so that a broken build fails
// fast instead of hanging until the test binary's timeout.
func testContext(t *testing.T) context.Context {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	t.Cleanup(cancel)
	return ctx
}

// setEpochAhead puts aggregate key's stored epoch an hour ahead of the clock
// (a lease given while the clock read later, then stepped back; or epochs
// given faster than microseconds pass) and returns it. Each lease after
// it must still get a larger epoch: only epoch + 1 makes it so.
func setEpochAhead(t *testing.T, pool *pgxpool.Pool, key string) int64 {
	t.Helper()
	var epoch int64
	if err := pool.QueryRow(testContext(t), `UPDATE outbox.delivery
		SET epoch = (extract(epoch FROM clock_timestamp()) * 1000000)::bigint + 3600000000
		WHERE aggregate_key = $1 RETURNING epoch`, key).Scan(&epoch); err != nil {
		t.Fatal(err)
	}
	return epoch
}

// handedOver acks ids as replica x, handing over to holder (with a window
// and credit when window > 0), and returns the epochs of the leases handed
// over.
func handedOver(t *testing.T, pool *pgxpool.Pool, ids []uuid.UUID, holder uuid.UUID, window int) []int64 {
	t.Helper()
	var windows, credits []int32
	if window > 0 {
		windows, credits = []int32{int32(window)}, []int32{int32(window)}
	}
	rows, err := pool.Query(testContext(t), `SELECT (a.handover).epoch
		FROM outbox.ack($1, 'x', ARRAY[$2::uuid], ARRAY[interval '30 seconds'], $3, $4) a
		WHERE a.status = 'handed_over'`, ids, holder, windows, credits)
	if err != nil {
		t.Fatal(err)
	}
	epochs, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil {
		t.Fatal(err)
	}
	return epochs
}

// Every place that gives a new lease (a claim's lease_heads, a discovery
// round's dispatch, and an ack's hand-over on its one-row path, its batch
// path and its windowed path) raises the epoch past the stored one when
// that is at or ahead of the clock, so an epoch is never given twice and a
// stale token's nack is refused. (The clock alone would not do: it is an
// hour behind here.)
func TestEveryNewLeaseRaisesAnEpochAheadOfTheClock(t *testing.T) {
	t.Parallel()
	type site struct {
		name  string
		lease func(t *testing.T, pool *pgxpool.Pool) (ahead, got int64)
	}
	sites := []site{
		{"claim (lease_heads)", func(t *testing.T, pool *pgxpool.Pool) (int64, int64) {
			// The first lease expires at once, so the same event is leased
			// again, as after a relay vanished.
			id, _ := expiredLease(t, pool, "a", 1)
			ahead := setEpochAhead(t, pool, "a")
			var again uuid.UUID
			var got int64
			if err := pool.QueryRow(testContext(t), `SELECT event_id, epoch FROM outbox.claim(gen_random_uuid(), 'r', 'x', NULL, 1, interval '30 seconds')`).
				Scan(&again, &got); err != nil {
				t.Fatal(err)
			}
			if again != id {
				t.Fatalf("re-claimed %s, want the expired lease's event %s", again, id)
			}
			// The expired lease's token (the epoch stored before the new
			// lease) no longer names the lease.
			if n := count(t, pool, fmt.Sprintf(`SELECT count(*) FROM outbox.nack('%s', %d, 'stale', NULL, interval '1 second', interval '1 minute', 10)`, id, ahead)); n != 0 {
				t.Fatal("a stale token's nack was accepted: the new lease repeated its epoch")
			}
			return ahead, got
		}},
		{"dispatch (discover_apply)", func(t *testing.T, pool *pgxpool.Pool) (int64, int64) {
			emitN(t, pool, "a", 1)
			discover(t, pool)
			claimRevisions(t, pool)
			ackEvents(t, pool, "revision = 1") // idle now
			ahead := setEpochAhead(t, pool, "a")
			emitN(t, pool, "a", 1)
			h := uuid.New()
			got, err := dispatchRound(testContext(t), pool, h, false)
			if err != nil {
				t.Fatal(err)
			}
			if _, ok := got["a"]; !ok {
				t.Fatalf("the round dispatched %v, want aggregate a", got)
			}
			return ahead, count(t, pool, `SELECT epoch FROM outbox.delivery WHERE aggregate_key = 'a'`)
		}},
		{"ack hand-over, one-row path", func(t *testing.T, pool *pgxpool.Pool) (int64, int64) {
			h := uuid.New()
			emitN(t, pool, "a", 2)
			discover(t, pool)
			id := claimOne(t, pool, h, 1)
			ahead := setEpochAhead(t, pool, "a")
			got := handedOver(t, pool, []uuid.UUID{id}, h, 0)
			if len(got) != 1 {
				t.Fatalf("handed over %v, want one lease", got)
			}
			return ahead, got[0]
		}},
		{"ack hand-over, batch path", func(t *testing.T, pool *pgxpool.Pool) (int64, int64) {
			h := uuid.New()
			emitN(t, pool, "a", 2)
			discover(t, pool)
			id := claimOne(t, pool, h, 1)
			ahead := setEpochAhead(t, pool, "a")
			// An id that names no event sends the ack down the batch path.
			got := handedOver(t, pool, []uuid.UUID{id, uuid.New()}, h, 0)
			if len(got) != 1 {
				t.Fatalf("handed over %v, want one lease", got)
			}
			return ahead, got[0]
		}},
		{"ack hand-over, windowed path", func(t *testing.T, pool *pgxpool.Pool) (int64, int64) {
			h := uuid.New()
			emitN(t, pool, "a", 4)
			discover(t, pool)
			ls := claimWindow(t, pool, h, 1, 2, 2)
			if len(ls) != 2 {
				t.Fatalf("claimed %v, want revisions 1 and 2", ls)
			}
			ahead := setEpochAhead(t, pool, "a")
			// Both acked: the lease ends, and a new one covers 3 and 4.
			got := handedOver(t, pool, []uuid.UUID{ls[0].id, ls[1].id}, h, 2)
			if len(got) != 2 || got[0] != got[1] {
				t.Fatalf("handed over epochs %v, want one new lease of two revisions", got)
			}
			return ahead, got[0]
		}},
	}
	for _, s := range sites {
		t.Run(s.name, func(t *testing.T) {
			t.Parallel()
			pool := testdb.NewPool(t)
			ahead, got := s.lease(t, pool)
			if got != ahead+1 {
				t.Fatalf("new lease's epoch %d, want %d (the stored %d + 1, the clock being behind)", got, ahead+1, ahead)
			}
		})
	}
}
