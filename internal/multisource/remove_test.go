package multisource_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/app"
	"github.com/outboxd/outboxd/internal/multisource"
	"github.com/outboxd/outboxd/internal/servertest"
	"github.com/outboxd/outboxd/internal/store"
	"github.com/outboxd/outboxd/server"
)

func ackOne(t *testing.T, relay outboxv1.RelayServiceClient, d *outboxv1.SubscribeResponse) *outboxv1.AckResult {
	t.Helper()
	res, err := relay.Ack(t.Context(), &outboxv1.AckRequest{Acks: []*outboxv1.AckItem{{EventId: d.GetEvent().GetEventId(), LeaseToken: d.GetLeaseToken()}}})
	if err != nil {
		t.Fatalf("ack: %v", err)
	}
	return res.GetResults()[0]
}

// TestRemoveSourceDrainsAndSparesTheOthers: removing orders while a relay
// of orders holds a delivery and a relay of default holds another. Orders
// is retired first: a new Subscribe for it is refused NOT_FOUND naming it
// as removed, yet the delivery it holds can still be acked; its stream then
// ends UNAVAILABLE saying orders is being removed, and RemoveSource
// returns. From then on its tokens are refused naming it as removed
// (INVALID in an Ack, FAILED_PRECONDITION from Nack and ExtendLease).
// Default's engine was never touched: its lease acks, and its stream goes
// on delivering, its held event not again.
func TestRemoveSourceDrainsAndSparesTheOthers(t *testing.T) {
	t.Parallel()
	r, _, ordersURL := twoSources(t, servertest.Options{})
	emit(t, r.Pools["orders"], "sales_order", "1")
	emit(t, r.Pool, "billing", "1")
	ordersStream := subscribe(t, r.Relay, "orders/sales_order")
	held := recv(t, ordersStream)
	defaultStream := subscribe(t, r.Relay, "billing")
	heldDefault := recv(t, defaultStream)

	removed := make(chan error, 1)
	go func() { removed <- r.App.RemoveSource(context.Background(), "orders", 30*time.Second) }()

	waitFor(t, "a new Subscribe for orders refused NOT_FOUND", func() bool {
		ctx, cancel := context.WithCancel(t.Context())
		defer cancel()
		st, err := r.Relay.Subscribe(ctx, &outboxv1.SubscribeRequest{RelayId: "late", Streams: []string{"orders/sales_order"}, MaxInFlight: 1})
		if err == nil {
			_, err = st.Recv()
		}
		return status.Code(err) == codes.NotFound && strings.Contains(err.Error(), `source "orders" was removed`)
	})
	select {
	case err := <-removed:
		t.Fatalf("RemoveSource returned (%v) while orders' stream held an unacked delivery", err)
	default:
	}
	if got := ackOne(t, r.Relay, held); got.GetStatus() != outboxv1.AckStatus_ACK_STATUS_PUBLISHED {
		t.Errorf("ack of orders' delivery while orders drains: %v %s; want PUBLISHED", got.GetStatus(), got.GetMessage())
	}
	if _, err := ordersStream.Recv(); status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), `source "orders" is being removed`) {
		t.Errorf("orders' stream ended with %v; want UNAVAILABLE saying orders is being removed", err)
	}
	if err := <-removed; err != nil {
		t.Errorf("RemoveSource: %v", err)
	}

	// A listing over sources that was to go on in orders says it is gone.
	if _, err := r.Admin.ListEvents(t.Context(), &outboxv1.ListEventsRequest{PageToken: "orders:"}); status.Code(err) != codes.InvalidArgument ||
		!strings.Contains(err.Error(), `source "orders", which was removed`) {
		t.Errorf("ListEvents going on in removed orders: %v; want INVALID_ARGUMENT saying orders was removed", err)
	}
	if got := ackOne(t, r.Relay, held); got.GetStatus() != outboxv1.AckStatus_ACK_STATUS_INVALID || !strings.Contains(got.GetMessage(), "was removed") {
		t.Errorf("ack of orders' token after the removal: %v %q; want INVALID saying orders was removed", got.GetStatus(), got.GetMessage())
	}
	_, err := r.Relay.ExtendLease(t.Context(), &outboxv1.ExtendLeaseRequest{EventId: held.GetEvent().GetEventId(), LeaseToken: held.GetLeaseToken(), Ttl: durationpb.New(time.Minute)})
	if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "was removed") {
		t.Errorf("ExtendLease of orders' token after the removal: %v; want FAILED_PRECONDITION saying orders was removed", err)
	}

	if got := ackOne(t, r.Relay, heldDefault); got.GetStatus() != outboxv1.AckStatus_ACK_STATUS_PUBLISHED {
		t.Errorf("ack of default's lease taken before orders was removed: %v %s; want PUBLISHED", got.GetStatus(), got.GetMessage())
	}
	next := emit(t, r.Pool, "billing", "1")
	if d := recv(t, defaultStream); d.GetEvent().GetEventId() != next {
		t.Errorf("default's stream after orders' removal delivered %s; want %s (and %s never again)", d.GetEvent().GetEventId(), next, heldDefault.GetEvent().GetEventId())
	}
	if err := r.App.RemoveSource(t.Context(), multisource.Default, time.Second); err == nil {
		t.Error("RemoveSource(default) succeeded; want it refused")
	}

	// Added back, orders delivers again (its engine a new one, started
	// before it is published).
	if err := r.App.AddSource(t.Context(), app.Source{Name: "orders", Server: server.Config{
		Store: store.New(r.Pools["orders"]), DatabaseURL: ordersURL, Logger: servertest.Logger(t),
		PollInterval: 200 * time.Millisecond, ReconcileInterval: 200 * time.Millisecond,
	}}); err != nil {
		t.Fatal(err)
	}
	again := emit(t, r.Pools["orders"], "sales_order", "2")
	if d := recv(t, subscribe(t, r.Relay, "orders/sales_order")); d.GetEvent().GetEventId() != again {
		t.Errorf("orders added back delivered %s; want %s", d.GetEvent().GetEventId(), again)
	}
}

// TestRouterKeepsOneSource: the last source cannot be retired, and a name
// is refused twice.
func TestRouterKeepsOneSource(t *testing.T) {
	t.Parallel()
	engine := func(name string) multisource.Engine {
		return multisource.Engine{Name: name, Relay: outboxv1.UnimplementedRelayServiceServer{}, Admin: outboxv1.UnimplementedAdminServiceServer{}}
	}
	r, err := multisource.New([]multisource.Engine{engine("a")})
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Add(engine("a")); err == nil {
		t.Error("Add of a served name succeeded")
	}
	if err := r.Retire("a"); err == nil {
		t.Error("Retire of the last source succeeded")
	}
	if err := r.Add(engine("b")); err != nil {
		t.Fatal(err)
	}
	if err := r.Retire("a"); err != nil {
		t.Fatal(err)
	}
	if err := r.Retire("b"); err == nil {
		t.Error("Retire of the last source not retiring succeeded")
	}
	if err := r.Remove("a"); err != nil {
		t.Fatal(err)
	}
	if got := r.Names(); len(got) != 1 || got[0] != "b" {
		t.Errorf("Names after removing a: %v; want [b]", got)
	}
}

// SetPending refuses what could never be added (a name no configuration
// accepts) and a source served now (it would be reported not added while
// it is), and takes a valid name that is not served.
func TestSetPendingRefusesABadOrServedName(t *testing.T) {
	t.Parallel()
	r, err := multisource.New([]multisource.Engine{{Name: "a", Relay: outboxv1.UnimplementedRelayServiceServer{}, Admin: outboxv1.UnimplementedAdminServiceServer{}}})
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"", "Orders", "a/b", "*"} {
		if err := r.SetPending(name, "down"); err == nil {
			t.Errorf("SetPending(%q) succeeded; want a refusal of the name", name)
		}
	}
	if err := r.SetPending("a", "down"); err == nil || !strings.Contains(err.Error(), `"a" is served`) {
		t.Errorf("SetPending of the served source a: %v; want it refused as served", err)
	}
	if err := r.SetPending("b", "down"); err != nil {
		t.Fatal(err)
	}
	if got := r.Pending(); len(got) != 1 || got["b"] != "down" {
		t.Errorf("pending %v; want only b (down)", got)
	}
}
