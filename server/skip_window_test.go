package server_test

import (
	"context"
	"slices"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/durationpb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/testdb"
)

// Issue 24 item 11. Skipping an event that is not the head of a leased
// window, but inside it, ends the lease at once (as SkipEvent documents),
// not at its expiry an hour later: when SkipEvent answers, the aggregate is
// no longer leased under the window's epoch; an ack of a revision after the
// skipped one, with the window's token, is LEASE_LOST; and the aggregate is
// offered again from its head under a higher epoch, without the skipped
// revision.
func TestSkipInsideLeasedWindowEndsTheLease(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	ids := emit(t, pool, "orders", "w", 5)
	waitDiscovered(t, pool, 1)
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 4, MaxInFlightPerAggregate: 4, LeaseTtl: durationpb.New(time.Hour)})
	_, next := receive(t, st)
	window := make([]*outboxv1.SubscribeResponse, 4)
	for i := range window {
		window[i] = next()
		if window[i].GetEvent().GetRevision() != int64(i+1) || window[i].GetLeaseEpoch() != window[0].GetLeaseEpoch() {
			t.Fatalf("window delivery %d: revision %d epoch %d", i, window[i].GetEvent().GetRevision(), window[i].GetLeaseEpoch())
		}
	}
	epoch := window[0].GetLeaseEpoch()

	if _, err := r.Admin.SkipEvent(ctx, &outboxv1.SkipEventRequest{EventId: ids[2].String(), Reason: "poison", Actor: "ops"}); err != nil {
		t.Fatal(err)
	}
	var state string
	var stillHeld bool
	if err := pool.QueryRow(ctx, `SELECT state, state = 'leased' AND epoch = $1 FROM outbox.delivery WHERE aggregate_key = 'w'`, epoch).
		Scan(&state, &stillHeld); err != nil {
		t.Fatal(err)
	}
	if stillHeld {
		t.Fatalf("after skipping revision 3 the window's lease (epoch %d) still holds the aggregate", epoch)
	}
	if res := ack(t, r, window[3]); res[0].GetStatus() != outboxv1.AckStatus_ACK_STATUS_LEASE_LOST {
		t.Errorf("ack of revision 4 under the ended window: %v, want LEASE_LOST", res[0].GetStatus())
	}
	if publishedAt(t, pool, ids[3].String()) != nil {
		t.Error("revision 4 was published by the ended window's token")
	}
	// Offered again from the head, under a higher epoch: a window of 1 and
	// 2 (it stops before the skipped revision), then, once they are acked,
	// 4 and 5.
	var got []int64
	for _, want := range [][]int64{{1, 2}, {4, 5}} {
		var ds []*outboxv1.SubscribeResponse
		for range want {
			d := next()
			if d.GetLeaseEpoch() <= epoch {
				t.Fatalf("revision %d offered again under epoch %d, not above the ended window's %d", d.GetEvent().GetRevision(), d.GetLeaseEpoch(), epoch)
			}
			ds = append(ds, d)
			got = append(got, d.GetEvent().GetRevision())
		}
		ackPublished(t, r, ds...)
	}
	if want := []int64{1, 2, 4, 5}; !slices.Equal(got, want) {
		t.Fatalf("after the skip got revisions %v, want %v", got, want)
	}
}
