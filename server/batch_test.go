package server_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/outboxd/outboxd/client"
	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/limits"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/server"
)

// recvMsg receives one message, whatever it carries, or fails the test
// after a generous bound (a hang guard, not a timing assertion).
func recvMsg(t *testing.T, st outboxv1.RelayService_SubscribeClient) *outboxv1.SubscribeResponse {
	t.Helper()
	type res struct {
		m   *outboxv1.SubscribeResponse
		err error
	}
	c := make(chan res, 1)
	go func() { m, err := st.Recv(); c <- res{m, err} }()
	select {
	case r := <-c:
		if r.err != nil {
			t.Fatalf("recv: %v", r.err)
		}
		return r.m
	case <-time.After(30 * time.Second):
		t.Fatal("no message within 30s")
		return nil
	}
}

// deliveriesOf is what one message carries, checking its form: a batch
// (deliveries, nothing else set, each a plain delivery) or one plain
// delivery.
func deliveriesOf(t *testing.T, m *outboxv1.SubscribeResponse) []*outboxv1.SubscribeResponse {
	t.Helper()
	ds := m.GetDeliveries()
	if len(ds) == 0 {
		if m.GetEvent() == nil || m.GetLeaseToken() == "" {
			t.Fatalf("a message with neither a delivery nor deliveries: %v", m)
		}
		return []*outboxv1.SubscribeResponse{m}
	}
	if m.GetEvent() != nil || m.GetLeaseToken() != "" || m.GetLeaseEpoch() != 0 || m.GetAttempt() != 0 ||
		m.GetLeaseExpiresAt() != nil || m.GetLeaseTtlRemaining() != nil {
		t.Fatalf("a batch with fields of its own set: %v", m)
	}
	if len(ds) == 1 {
		t.Fatalf("a batch of one delivery (a lone delivery goes in the plain form): %v", m)
	}
	for _, d := range ds {
		if d.GetEvent() == nil || d.GetLeaseToken() == "" || len(d.GetDeliveries()) > 0 {
			t.Fatalf("a batch holds a delivery that is not one: %v", d)
		}
	}
	return ds
}

// receiveN receives messages until they carried n deliveries, and returns
// the deliveries in order and how many deliveries each message carried.
func receiveN(t *testing.T, st outboxv1.RelayService_SubscribeClient, n int) (ds []*outboxv1.SubscribeResponse, perMsg []int) {
	t.Helper()
	for len(ds) < n {
		got := deliveriesOf(t, recvMsg(t, st))
		ds = append(ds, got...)
		perMsg = append(perMsg, len(got))
	}
	if len(ds) != n {
		t.Fatalf("received %d deliveries, want %d", len(ds), n)
	}
	return ds, perMsg
}

// A relay that sets accept_batches receives every delivery the session has
// ready at once in one message: the claim's, and the hand-overs of one ack
// batch. A relay that does not (every relay written before the field) gets
// exactly one delivery per message, in the plain form, as before.
func TestBatchedDeliveries(t *testing.T) {
	t.Parallel()
	for _, accept := range []bool{true, false} {
		t.Run(fmt.Sprintf("accept_batches=%v", accept), func(t *testing.T) {
			t.Parallel()
			url := testdb.New(t)
			pool := testdb.NewPoolURL(t, url)
			// One committer: the acks of one Ack call are one batch, so
			// their hand-overs reach the session at once.
			r := startReplica(t, url, func(c *server.Config) { c.AckCommitters = 1 })
			const aggregates = 5
			for i := range aggregates {
				emit(t, pool, "orders", fmt.Sprintf("k-%d", i), 2)
			}
			// All found before the relay subscribes, so that its first
			// claim leases every aggregate.
			waitDiscovered(t, pool, aggregates)
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 10, AcceptBatches: accept})

			want := []int{aggregates} // one message
			if !accept {
				want = []int{1, 1, 1, 1, 1}
			}
			for rev := int64(1); rev <= 2; rev++ {
				ds, perMsg := receiveN(t, st, aggregates)
				if fmt.Sprint(perMsg) != fmt.Sprint(want) {
					t.Fatalf("revision %d: deliveries per message %v, want %v", rev, perMsg, want)
				}
				seen := map[string]bool{}
				for _, d := range ds {
					ev := d.GetEvent()
					if ev.GetRevision() != rev || d.GetAttempt() != 1 || d.GetLeaseEpoch() == 0 || seen[ev.GetAggregateKey()] {
						t.Fatalf("revision %d: got %s rev %d attempt %d epoch %d", rev, ev.GetAggregateKey(), ev.GetRevision(), d.GetAttempt(), d.GetLeaseEpoch())
					}
					seen[ev.GetAggregateKey()] = true
				}
				// One Ack call for them all: each ack hands the session
				// its aggregate's next revision.
				ackPublished(t, r, ds...)
			}
			waitPending(t, pool, 0)
		})
	}
}

// With a window, a batch carries an aggregate's events in revision order
// under one lease epoch, exactly as they would come one per message; a
// lone delivery (a window sliding by one) goes in the plain form.
func TestBatchedWindow(t *testing.T) {
	t.Parallel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, func(c *server.Config) { c.AckCommitters = 1 })
	ids := emit(t, pool, "orders", "w", 6)
	waitDiscovered(t, pool, 1)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 3, MaxInFlightPerAggregate: 3, AcceptBatches: true})

	var epoch int64
	check := func(when string, ds []*outboxv1.SubscribeResponse, from int) {
		t.Helper()
		for i, d := range ds {
			if d.GetEvent().GetEventId() != ids[from+i].String() || d.GetEvent().GetRevision() != int64(from+i+1) {
				t.Fatalf("%s: delivery %d is revision %d, want %d", when, i, d.GetEvent().GetRevision(), from+i+1)
			}
			if epoch == 0 {
				epoch = d.GetLeaseEpoch()
			}
			if d.GetLeaseEpoch() != epoch {
				t.Fatalf("%s: revision %d under epoch %d, want the window's %d", when, d.GetEvent().GetRevision(), d.GetLeaseEpoch(), epoch)
			}
		}
	}
	first, perMsg := receiveN(t, st, 3)
	if fmt.Sprint(perMsg) != "[3]" {
		t.Fatalf("the claimed window came in messages of %v, want one of 3", perMsg)
	}
	check("the claimed window", first, 0)

	ack(t, r, first[0])
	slid, perMsg := receiveN(t, st, 1)
	if fmt.Sprint(perMsg) != "[1]" {
		t.Fatalf("the window slid by one in messages of %v", perMsg)
	}
	check("slid by one", slid, 3)

	// Two acks in one call slide it by two: one message.
	ack(t, r, first[1], first[2])
	slid2, perMsg := receiveN(t, st, 2)
	if fmt.Sprint(perMsg) != "[2]" {
		t.Fatalf("the window slid by two in messages of %v, want one of 2", perMsg)
	}
	check("slid by two", slid2, 4)
	ack(t, r, slid[0], slid2[0], slid2[1])
	waitPending(t, pool, 0)
}

// A batch never grows past maxBatchBytes (1 MiB): ten deliveries of half a
// MiB each, which in one message would be larger than a relay receives
// (4 MiB, gRPC's default), come in several, each within the limit.
func TestBatchesAreBounded(t *testing.T) {
	t.Parallel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	const n = 10
	payload := []byte(`{"s":"` + strings.Repeat("x", 500<<10) + `"}`)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	for i := range n {
		if _, err := client.Emit(ctx, pool, client.Event{Stream: "orders", AggregateKey: fmt.Sprintf("k-%d", i), Type: "T", Payload: payload}); err != nil {
			t.Fatal(err)
		}
	}
	waitDiscovered(t, pool, n)
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: n, AcceptBatches: true})
	var got, batched int
	for got < n {
		m := recvMsg(t, st)
		if size := proto.Size(m); size > limits.MaxDeliveryBytes {
			t.Fatalf("a message of %d bytes", size)
		}
		ds := deliveriesOf(t, m)
		if len(ds) > 1 {
			batched++
		}
		got += len(ds)
	}
	if batched == 0 {
		t.Fatal("no two half-MiB deliveries shared a message")
	}
}

// An event too large for any message is parked, not sent, in a batch as
// one by one: of a window claimed at once, the event before it still
// reaches the relay (and its ack lands), the ones after it are not sent,
// and the stream goes on.
func TestBatchedWindowParksUndeliverable(t *testing.T) {
	t.Parallel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	ids := emit(t, pool, "orders", "p", 3)
	testdb.RewriteEvents(t, pool, `UPDATE outbox.event SET payload = jsonb_build_object('x', repeat('a', 5 << 20)) WHERE event_id = $1`, ids[1])
	r := startReplica(t, url, nil)
	waitDiscovered(t, pool, 1)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 3, MaxInFlightPerAggregate: 3, AcceptBatches: true})
	first, _ := receiveN(t, st, 1)
	if first[0].GetEvent().GetEventId() != ids[0].String() {
		t.Fatalf("first delivery is revision %d, want 1", first[0].GetEvent().GetRevision())
	}
	waitState(t, pool, "p", "parked")
	// Nothing of p's window after the parked event: the next delivery is
	// another aggregate's.
	next := emit(t, pool, "orders", "q", 1)[0]
	if ds, _ := receiveN(t, st, 1); ds[0].GetEvent().GetEventId() != next.String() {
		t.Fatalf("got %s revision %d, want q's event", ds[0].GetEvent().GetAggregateKey(), ds[0].GetEvent().GetRevision())
	}
	ackPublished(t, r, first[0])
}
