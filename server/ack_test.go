package server_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"google.golang.org/protobuf/types/known/durationpb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/store"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/server"
)

// One ack the database refuses cannot fail its neighbours in a group
// commit: the batch is split until the bad item is alone, the others are
// published, and the bad one is answered ACK_STATUS_RETRY (nothing changed
// for it). The refusal is a trigger the test adds, standing in for anything
// that makes one row's update fail.
func TestOneFailingAckDoesNotFailItsBatch(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	var ids []uuid.UUID
	for i := range 5 {
		ids = append(ids, emit(t, pool, "orders", fmt.Sprintf("k-%d", i), 1)...)
	}
	bad := ids[2]
	if _, err := pool.Exec(ctx, fmt.Sprintf(`
		CREATE FUNCTION refuse_one() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN
			IF NEW.event_id = '%s' THEN RAISE EXCEPTION 'refused by the test' USING ERRCODE = 'check_violation'; END IF;
			RETURN NEW;
		END $$;
		CREATE TRIGGER refuse_one BEFORE UPDATE ON outbox.event FOR EACH ROW EXECUTE FUNCTION refuse_one();`, bad)); err != nil {
		t.Fatal(err)
	}
	r := startReplica(t, url, nil)
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 10})
	var ds []*outboxv1.SubscribeResponse
	for range ids {
		ds = append(ds, recv(t, st))
	}
	got := map[string]outboxv1.AckStatus{}
	for _, res := range ack(t, r, ds...) {
		got[res.GetEventId()] = res.GetStatus()
	}
	for _, id := range ids {
		want := outboxv1.AckStatus_ACK_STATUS_PUBLISHED
		if id == bad {
			want = outboxv1.AckStatus_ACK_STATUS_RETRY
		}
		if got[id.String()] != want {
			t.Errorf("ack of %s: %v, want %v", id, got[id.String()], want)
		}
		if published := publishedAt(t, pool, id.String()) != nil; published != (id != bad) {
			t.Errorf("event %s published = %v", id, published)
		}
	}
	// Once the cause is gone, the same ack goes through.
	if _, err := pool.Exec(ctx, `DROP TRIGGER refuse_one ON outbox.event`); err != nil {
		t.Fatal(err)
	}
	var badDelivery *outboxv1.SubscribeResponse
	for _, d := range ds {
		if d.GetEvent().GetEventId() == bad.String() {
			badDelivery = d
		}
	}
	ackPublished(t, r, badDelivery)
}

// A nack's retry_after beyond the backoff cap (a broker's Retry-After of
// hours) is honoured up to the cap, not refused: refusing would lose the
// failure's count.
func TestNackRetryAfterIsCapped(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, func(c *server.Config) { c.BackoffCap = time.Minute })
	emit(t, pool, "orders", "o-1", 1)
	d := recv(t, subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 1}))
	before := time.Now()
	res, err := r.Relay.Nack(ctx, &outboxv1.NackRequest{EventId: d.GetEvent().GetEventId(), LeaseToken: d.GetLeaseToken(),
		Error: "429", RetryAfter: durationpb.New(2 * time.Hour)})
	if err != nil {
		t.Fatalf("nack with a retry_after over the cap: %v", err)
	}
	if res.GetFailures() != 1 {
		t.Fatalf("failures %d, want 1", res.GetFailures())
	}
	wait := res.GetNextAttemptAt().AsTime().Sub(before)
	if wait < 50*time.Second || wait > 2*time.Minute {
		t.Fatalf("next attempt in %v, want the 1m cap", wait)
	}
}

// An event acked under two leases in one call (an expired lease's token
// and its redelivery's, say) has its acks queued in two committers when
// the tokens' shards differ, and each batch answers for it: the one that
// published it, and the other, which found it published. The call answers
// PUBLISHED, whichever part came back last: it did publish the event.
// Here the part queued first is the one that commits first (each batch
// is held as it begins, and the second part is queued only once the first
// one's batch has begun), so the part that found the event published is
// the last one the call reads.
func TestAnEventAckedUnderTwoLeasesInOneCallAnswersPublished(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	id := emit(t, pool, "orders", "a", 1)[0]
	r := startReplica(t, url, func(c *server.Config) {
		c.AckCommitters = 2
		c.AckLinger = -1
	})
	// Deliveries of the event under new leases (each session that ends
	// releases its lease) until two tokens queue in different committers.
	shards := map[int]string{}
	for len(shards) < 2 {
		sctx, end := context.WithCancel(ctx)
		st := subscribe(t, sctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 1, LeaseTtl: durationpb.New(time.Hour)})
		d := recv(t, st)
		if d.GetEvent().GetEventId() != id.String() {
			t.Fatalf("delivered %s, want %s", d.GetEvent().GetEventId(), id)
		}
		shard, err := r.Server.AckShard(d.GetLeaseToken())
		if err != nil {
			t.Fatal(err)
		}
		shards[shard] = d.GetLeaseToken()
		end()
		waitState(t, pool, "a", "ready")
	}
	first, second := shards[0], shards[1]

	// Batch n closes began[n] as it begins, then waits for gates[n].
	began := [2]chan struct{}{make(chan struct{}), make(chan struct{})}
	gates := [2]chan struct{}{make(chan struct{}), make(chan struct{})}
	var batches atomic.Int32
	r.Server.SetBeforeAckBatch(func() {
		n := int(batches.Add(1)) - 1
		close(began[n])
		<-gates[n]
	})
	t.Cleanup(func() {
		for _, g := range gates {
			select {
			case <-g:
			default:
				close(g)
			}
		}
	})
	var queued atomic.Int32
	r.Server.SetAfterAckQueued(func() {
		if queued.Add(1) == 1 {
			<-began[0] // the first part's batch began: it is batch 0
		}
	})
	committed := make(chan struct{}, 2)
	r.Server.SetAfterAck(func(res []store.AckResult, err error) ([]store.AckResult, error) {
		committed <- struct{}{}
		return res, err
	})
	answer := make(chan *outboxv1.AckResponse, 1)
	go func() {
		res, err := r.Relay.Ack(ctx, &outboxv1.AckRequest{Acks: []*outboxv1.AckItem{
			{EventId: id.String(), LeaseToken: first}, {EventId: id.String(), LeaseToken: second}}})
		if err != nil {
			t.Errorf("ack: %v", err)
		}
		answer <- res
	}()
	<-began[1]
	close(gates[0]) // the part queued first publishes the event
	<-committed
	close(gates[1]) // the other finds it published
	res := <-answer
	if res == nil {
		return
	}
	for _, r := range res.GetResults() {
		if r.GetStatus() != outboxv1.AckStatus_ACK_STATUS_PUBLISHED {
			t.Fatalf("an ack under two leases of an event it published answered %v %q, want PUBLISHED", r.GetStatus(), r.GetMessage())
		}
	}
	if publishedAt(t, pool, id.String()) == nil {
		t.Fatal("the event is not published")
	}
}
