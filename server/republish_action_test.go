package server_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/protobuf/types/known/durationpb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/testdb"
)

// republishAction returns the id of the newest republish of stream/key.
func republishAction(t *testing.T, pool *pgxpool.Pool, stream, key string) int64 {
	t.Helper()
	var id int64
	if err := pool.QueryRow(context.Background(), `
		SELECT action_id FROM outbox.republished WHERE stream = $1 AND aggregate_key = $2
		ORDER BY action_id DESC LIMIT 1`, stream, key).Scan(&id); err != nil {
		t.Fatal(err)
	}
	return id
}

// republish republishes stream/key from revision from and returns the
// action's id.
func republish(t *testing.T, r *replica, pool *pgxpool.Pool, stream, key string, from int64) int64 {
	t.Helper()
	res, err := r.Admin.Republish(context.Background(), &outboxv1.RepublishRequest{
		Stream: stream, AggregateKey: key, FromRevision: from, Reason: "consumer lost its data"})
	if err != nil || res.GetAggregates() != 1 {
		t.Fatalf("republish %s/%s from %d: %v, %v", stream, key, from, res, err)
	}
	return republishAction(t, pool, stream, key)
}

// wantDelivery checks a delivery's aggregate, revision and the republish it
// names (0: none).
func wantDelivery(t *testing.T, d *outboxv1.SubscribeResponse, key string, rev, action int64) {
	t.Helper()
	if d.GetEvent().GetAggregateKey() != key || d.GetEvent().GetRevision() != rev || d.GetRepublishActionId() != action {
		t.Fatalf("delivery %s revision %d republish_action_id %d, want %s revision %d republish_action_id %d",
			d.GetEvent().GetAggregateKey(), d.GetEvent().GetRevision(), d.GetRepublishActionId(), key, rev, action)
	}
}

// recvByKey receives n deliveries and returns them by aggregate key.
func recvByKey(t *testing.T, st outboxv1.RelayService_SubscribeClient, n int) map[string]*outboxv1.SubscribeResponse {
	t.Helper()
	got := make(map[string]*outboxv1.SubscribeResponse, n)
	for range n {
		d := recv(t, st)
		got[d.GetEvent().GetAggregateKey()] = d
	}
	if len(got) != n {
		t.Fatalf("%d deliveries came for %d aggregates", n, len(got))
	}
	return got
}

// Every delivery an operator's republish makes names that republish
// (SubscribeResponse.republish_action_id), however the lease was made: a
// claim, a claim after the lease was released, a hand-over by a batch of
// acks, by a lone ack, and by acks of a window. A retry under the same
// republish names the same action, a later republish its own, and every
// other delivery none: a relay publishing to a broker that deduplicates by
// message id (JetStream) stores the republish again, but not its retries.
func TestRepublishedDeliveriesNameTheirRepublish(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	emit(t, pool, "orders", "ra", 3)
	emit(t, pool, "orders", "rb", 3)
	req := func() *outboxv1.SubscribeRequest {
		return &outboxv1.SubscribeRequest{RelayId: "republish", MaxInFlight: 2, LeaseTtl: durationpb.New(time.Hour)}
	}
	first, stopFirst := context.WithCancel(ctx)
	st := subscribe(t, first, r, req())
	// First copies, by claims and by hand-overs of acks in pairs (the
	// batch statement): none names a republish.
	for rev := int64(1); rev <= 3; rev++ {
		got := recvByKey(t, st, 2)
		wantDelivery(t, got["ra"], "ra", rev, 0)
		wantDelivery(t, got["rb"], "rb", rev, 0)
		ackPublished(t, r, got["ra"], got["rb"])
	}

	actionA := republish(t, r, pool, "orders", "ra", 2)
	actionB := republish(t, r, pool, "orders", "rb", 2)
	if actionA == actionB {
		t.Fatalf("two republishes recorded as one action %d", actionA)
	}
	// Claimed: each names its own republish.
	got := recvByKey(t, st, 2)
	wantDelivery(t, got["ra"], "ra", 2, actionA)
	wantDelivery(t, got["rb"], "rb", 2, actionB)
	firstAttempt := got["ra"].GetAttempt()

	// The stream ends, its leases are released, and another claims them
	// again: a retry of the same republish names the same action.
	stopFirst()
	st = subscribe(t, ctx, r, req())
	got = recvByKey(t, st, 2)
	wantDelivery(t, got["ra"], "ra", 2, actionA)
	wantDelivery(t, got["rb"], "rb", 2, actionB)
	if got["ra"].GetAttempt() <= firstAttempt {
		t.Fatalf("the retry is attempt %d, the first delivery of the republish was %d", got["ra"].GetAttempt(), firstAttempt)
	}

	// Handed over by a batch of acks.
	ackPublished(t, r, got["ra"], got["rb"])
	got = recvByKey(t, st, 2)
	wantDelivery(t, got["ra"], "ra", 3, actionA)
	wantDelivery(t, got["rb"], "rb", 3, actionB)
	ackPublished(t, r, got["ra"], got["rb"])

	// A later republish names its own action, handed over by a lone ack
	// (the one-row statement) too.
	againA := republish(t, r, pool, "orders", "ra", 2)
	if againA == actionA {
		t.Fatalf("the second republish of ra has the first one's id %d", againA)
	}
	d := recv(t, st)
	wantDelivery(t, d, "ra", 2, againA)
	ackPublished(t, r, d)
	d = recv(t, st)
	wantDelivery(t, d, "ra", 3, againA)
	ackPublished(t, r, d)

	// Past the republished revisions, a new event is a first copy again.
	emit(t, pool, "orders", "ra", 1)
	d = recv(t, st)
	wantDelivery(t, d, "ra", 4, 0)
	ackPublished(t, r, d)
}

// A window's deliveries of a republish name it: the claim's window and the
// hand-over its acks make (the ack's general statement).
func TestRepublishedWindowNamesItsRepublish(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	emit(t, pool, "orders", "rw", 3)
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{RelayId: "window", MaxInFlight: 2,
		MaxInFlightPerAggregate: 2, LeaseTtl: durationpb.New(time.Hour)})
	for rev := int64(1); rev <= 3; rev++ {
		d := recv(t, st)
		wantDelivery(t, d, "rw", rev, 0)
		ackPublished(t, r, d)
	}

	action := republish(t, r, pool, "orders", "rw", 1)
	one, two := recv(t, st), recv(t, st)
	wantDelivery(t, one, "rw", 1, action)
	wantDelivery(t, two, "rw", 2, action)
	if one.GetLeaseEpoch() != two.GetLeaseEpoch() {
		t.Fatalf("revisions 1 and 2 came in leases %d and %d, not one window", one.GetLeaseEpoch(), two.GetLeaseEpoch())
	}
	ackPublished(t, r, one, two)
	d := recv(t, st)
	wantDelivery(t, d, "rw", 3, action)
	ackPublished(t, r, d)
}
