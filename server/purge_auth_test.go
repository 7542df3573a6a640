package server_test

import (
	"context"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/testdb"
)

// Issue 24 item 10. An admin token limited to billing.* purges the
// published events of the stream it names and nothing else: not those of a
// stream outside its limit, and not those of another stream it may access
// but did not name. Counted in the table, not read off the answer.
func TestStreamLimitedPurgeDeletesOnlyItsStream(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startAuthReplica(t, url)
	const each = 3
	streams := []string{"billing.invoice", "billing.refund", "sales_order"}
	for _, st := range streams {
		emit(t, pool, st, "a-1", each)
	}
	// Publish them all through an unrestricted relay.
	relayConn := dialAs(t, r, relayToken)
	relays := outboxv1.NewRelayServiceClient(relayConn)
	sub, err := relays.Subscribe(ctx, &outboxv1.SubscribeRequest{RelayId: "all", MaxInFlight: 8, LeaseTtl: durationpb.New(time.Hour)})
	if err != nil {
		t.Fatal(err)
	}
	for range len(streams) * each {
		d := recv(t, sub)
		res, err := relays.Ack(ctx, &outboxv1.AckRequest{Acks: []*outboxv1.AckItem{{EventId: d.GetEvent().GetEventId(), LeaseToken: d.GetLeaseToken()}}})
		if err != nil || res.GetResults()[0].GetStatus() != outboxv1.AckStatus_ACK_STATUS_PUBLISHED {
			t.Fatalf("ack: %v, %v", res, err)
		}
	}
	published := func(stream string) int64 {
		return countWhere(t, pool, "outbox.event", "published_at IS NOT NULL AND stream = '"+stream+"'")
	}
	for _, st := range streams {
		if n := published(st); n != each {
			t.Fatalf("%s: %d published, want %d", st, n, each)
		}
	}

	limited := outboxv1.NewAdminServiceClient(dialAs(t, r, billingOps))
	purge := func(req *outboxv1.PurgeRequest) (deleted int64, err error) {
		req.PublishedBefore = timestamppb.New(time.Now().Add(time.Hour))
		st, err := limited.Purge(ctx, req)
		for err == nil {
			var res *outboxv1.PurgeResponse
			if res, err = st.Recv(); err == nil && res.GetDone() {
				return res.GetDeleted(), nil
			}
		}
		return 0, err
	}
	for _, req := range []*outboxv1.PurgeRequest{{}, {Stream: "sales_order"}, {Stream: "sales_order", DryRun: true}} {
		if _, err := purge(req); status.Code(err) != codes.PermissionDenied {
			t.Errorf("Purge{%q} with the billing.* token: %v, want PermissionDenied", req.GetStream(), err)
		}
	}
	// Small batches, so the purge pages through the other streams' rows too.
	deleted, err := purge(&outboxv1.PurgeRequest{Stream: "billing.invoice", BatchSize: 2})
	if err != nil || deleted != each {
		t.Fatalf("Purge{billing.invoice}: deleted %d, %v; want %d", deleted, err, each)
	}
	for st, want := range map[string]int64{"billing.invoice": 0, "billing.refund": each, "sales_order": each} {
		if n := countWhere(t, pool, "outbox.event", "stream = '"+st+"'"); n != want {
			t.Errorf("after the billing.invoice purge, %s has %d events, want %d", st, n, want)
		}
	}
}
