package server_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/google/uuid"
	"google.golang.org/protobuf/types/known/durationpb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
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
