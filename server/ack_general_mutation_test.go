package server_test

import (
	"context"
	"testing"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/testdb"
)

// Tests added by the mutation sweep of outbox.ack's per-item answers, for
// what the gRPC Ack makes of them.

// An ack with a genuine token of an event that is gone (published, then
// purged) answers NOT_FOUND, saying so: not LEASE_LOST, which tells the
// relay an operator skipped the event, nor ALREADY_PUBLISHED, which the
// database can no longer tell. Kills not_found mapped to another status.
func TestAnAckOfAPurgedEventAnswersNotFound(t *testing.T) {
	t.Parallel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	emit(t, pool, "orders", "o-1", 1)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{Streams: []string{"orders"}, MaxInFlight: 1})
	d := recv(t, st)
	ackPublished(t, r, d)
	if _, err := pool.Exec(ctx, `DELETE FROM outbox.event WHERE event_id = $1`, d.GetEvent().GetEventId()); err != nil {
		t.Fatal(err)
	}
	res := ack(t, r, d)
	if len(res) != 1 || res[0].GetStatus() != outboxv1.AckStatus_ACK_STATUS_NOT_FOUND ||
		res[0].GetEventId() != d.GetEvent().GetEventId() || res[0].GetMessage() == "" {
		t.Fatalf("ack of a purged event answered %v, want NOT_FOUND for %s with a message", res, d.GetEvent().GetEventId())
	}
}
