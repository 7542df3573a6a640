package server_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/outboxd/outboxd/client"
	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/server"
)

// Invariant 8: a missing revision holds the aggregate and is reported, never
// skipped; inserting it releases the aggregate.
func TestGapHoldsAggregateUntilMissingRevisionArrives(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute) // every emit and wait is bounded
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	emitAt(t, pool, "orders", "g", 1)
	emitAt(t, pool, "orders", "g", 3)
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 4})
	d := recv(t, st)
	if d.GetEvent().GetRevision() != 1 {
		t.Fatalf("first delivery revision %d", d.GetEvent().GetRevision())
	}
	ack(t, r, d)
	// The claim after the ack finds revision 2 missing and holds the aggregate.
	waitState(t, pool, "g", "gap")
	var gapRev int64
	if err := pool.QueryRow(ctx, `SELECT gap_revision FROM outbox.delivery WHERE aggregate_key = 'g'`).Scan(&gapRev); err != nil || gapRev != 2 {
		t.Fatalf("gap_revision %d, %v; want 2", gapRev, err)
	}
	id2 := emitAt(t, pool, "orders", "g", 2)
	if d := recv(t, st); d.GetEvent().GetEventId() != id2 {
		t.Fatalf("after filling the gap got revision %d", d.GetEvent().GetRevision())
	} else {
		ack(t, r, d)
	}
	if d := recv(t, st); d.GetEvent().GetRevision() != 3 {
		t.Fatalf("then revision %d, want 3", d.GetEvent().GetRevision())
	}
}

// A producer transaction held open on one aggregate delays neither other
// aggregates nor the ack of that aggregate's earlier revision.
func TestOpenProducerTransactionBlocksNothingElse(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute) // every emit and wait is bounded
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	ids := emit(t, pool, "orders", "busy", 1)
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 4})
	first := recv(t, st)
	if first.GetEvent().GetEventId() != ids[0].String() {
		t.Fatal("unexpected first delivery")
	}

	// A producer of "busy" holds its order lock in an open transaction.
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // committed below
	if _, err := client.Emit(ctx, tx, client.Event{Stream: "orders", AggregateKey: "busy", Type: "T", Payload: []byte(`{}`)}); err != nil {
		t.Fatal(err)
	}
	// The ack of busy's revision 1 completes (bounded, so a block fails).
	ackCtx, ackCancel := context.WithTimeout(ctx, 10*time.Second)
	res, err := r.Relay.Ack(ackCtx, &outboxv1.AckRequest{Acks: []*outboxv1.AckItem{{EventId: first.GetEvent().GetEventId(), LeaseToken: first.GetLeaseToken()}}})
	ackCancel()
	if err != nil || res.GetResults()[0].GetStatus() != outboxv1.AckStatus_ACK_STATUS_PUBLISHED {
		t.Fatalf("ack while a producer holds the aggregate: %v %v", res, err)
	}
	// Another aggregate is delivered meanwhile.
	other := emit(t, pool, "orders", "free", 1)
	if d := recv(t, st); d.GetEvent().GetEventId() != other[0].String() {
		t.Fatalf("got %s, want the other aggregate's event", d.GetEvent().GetAggregateKey())
	}
	// And once the producer commits, its event follows.
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if d := recv(t, st); d.GetEvent().GetAggregateKey() != "busy" || d.GetEvent().GetRevision() != 2 {
		t.Fatalf("after commit got %v", d.GetEvent())
	}
}

// A replica whose sessions never poll and whose own discovery never runs
// again still delivers a new event after its LISTEN connection is killed:
// the listener reconnects, and the other replica's discovery round wakes it
// through NOTIFY outbox_wakeup.
func TestListenerReconnects(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute) // every emit and wait is bounded
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	deaf := startReplica(t, url, func(c *server.Config) {
		c.ReplicaID = "deaf"
		c.PollInterval = time.Hour
		// One round at start, then none within the test.
		c.DiscoveryInterval, c.DiscoveryIdleInterval = time.Hour, time.Hour
	})
	startReplica(t, url, func(c *server.Config) { c.ReplicaID = "discoverer" })
	st := subscribe(t, ctx, deaf, &outboxv1.SubscribeRequest{MaxInFlight: 4, LeaseTtl: durationpb.New(time.Hour)})
	ids := emit(t, pool, "orders", "seed", 1)
	if d := recv(t, st); d.GetEvent().GetEventId() != ids[0].String() {
		t.Fatalf("got %v", d.GetEvent())
	}

	old := terminateListener(ctx, t, pool, "deaf")
	// Listening again (LISTEN is the connection's first statement, so a
	// query from it means the channels are registered).
	waitFor(t, func() int32 { return listenersListening(ctx, pool, "deaf", old) })
	ids = emit(t, pool, "orders", "after", 1)
	if d := recv(t, st); d.GetEvent().GetEventId() != ids[0].String() {
		t.Fatalf("got %v", d.GetEvent())
	}
}

// eventually calls f every 10ms until it says done, and fails the test with
// f's account of where things stand when 30s pass first: a guard against
// a hang, never a timing assertion.
func eventually(t *testing.T, f func() (done bool, last string)) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		done, last := f()
		if done {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal(last + " (within 30s)")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// waitFor polls f until it returns non-zero (bounded).
func waitFor(t *testing.T, f func() int32) (v int32) {
	t.Helper()
	eventually(t, func() (bool, string) {
		v = f()
		return v != 0, "condition not reached"
	})
	return v
}

func waitState(t *testing.T, pool *pgxpool.Pool, key, want string) {
	t.Helper()
	waitFor(t, func() int32 {
		var st string
		_ = pool.QueryRow(context.Background(), `SELECT state FROM outbox.delivery WHERE aggregate_key = $1`, key).Scan(&st)
		if st == want {
			return 1
		}
		return 0
	})
}
