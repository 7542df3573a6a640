package multisource_test

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
)

// TestListSources: ListSources names the sources a token may subscribe to
// (an orders/* token only orders, a */sales_order one both), and a source
// stops being listed as soon as its removal starts (it takes no new
// Subscribe stream while it drains), not only once it is gone.
func TestListSources(t *testing.T) {
	t.Parallel()
	const (
		allToken    = "all-relay-token-0123456789"
		ordersToken = "orders-relay-token-0123456789"
		salesToken  = "sales-relay-token-0123456789"
		mixedToken  = "mixed-relay-token-0123456789"
	)
	r, dial := twoSourcesWithTokens(t, "all relay "+allToken+"\n"+
		"orders relay "+ordersToken+" streams=orders/*\n"+
		"sales relay "+salesToken+" streams=*/sales_order\n"+
		"mixed relay "+mixedToken+" streams=orders/*,payments\n")
	list := func(token string, streams ...string) []string {
		t.Helper()
		res, err := outboxv1.NewRelayServiceClient(dial(token)).ListSources(t.Context(), &outboxv1.ListSourcesRequest{Streams: streams})
		if err != nil {
			t.Fatalf("ListSources: %v", err)
		}
		return res.GetSources()
	}
	for _, c := range []struct {
		name, token string
		want        []string
	}{
		{"unrestricted", allToken, []string{"default", "orders"}},
		{"orders/*", ordersToken, []string{"orders"}},
		{"*/sales_order", salesToken, []string{"default", "orders"}},
	} {
		if got := list(c.token); !slices.Equal(got, c.want) {
			t.Errorf("ListSources with the %s token: %v; want %v", c.name, got, c.want)
		}
	}
	// With streams, a source is listed only where the token allows each of
	// them ("*": every stream), not merely some stream of it: a relay of
	// */audit with the orders/*,payments token is told of orders alone, one
	// of */* of orders alone, and one of */payments of both.
	for _, c := range []struct {
		name, token string
		streams     []string
		want        []string
	}{
		{"orders/*,payments for audit", mixedToken, []string{"audit"}, []string{"orders"}},
		{"orders/*,payments for *", mixedToken, []string{"*"}, []string{"orders"}},
		{"orders/*,payments for payments", mixedToken, []string{"payments"}, []string{"default", "orders"}},
		{"orders/*,payments for payments,audit", mixedToken, []string{"payments", "audit"}, []string{"orders"}},
		{"*/sales_order for *", salesToken, []string{"*"}, []string{}},
		{"*/sales_order for sales_order", salesToken, []string{"sales_order"}, []string{"default", "orders"}},
		{"unrestricted for *", allToken, []string{"*"}, []string{"default", "orders"}},
	} {
		if got := list(c.token, c.streams...); !slices.Equal(got, c.want) {
			t.Errorf("ListSources with the %s token: %v; want %v", c.name, got, c.want)
		}
	}
	_, err := outboxv1.NewRelayServiceClient(dial(allToken)).ListSources(t.Context(), &outboxv1.ListSourcesRequest{Streams: []string{"orders/x"}})
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "streams[0]") {
		t.Errorf("ListSources with streams [orders/x]: %v; want INVALID_ARGUMENT naming streams[0]", err)
	}

	// A stream of orders holding a delivery keeps orders draining (retired,
	// not yet removed) until it is acked.
	all := outboxv1.NewRelayServiceClient(dial(allToken))
	emit(t, r.Pools["orders"], "sales_order", "1")
	held := recv(t, subscribe(t, all, "orders/sales_order"))
	removed := make(chan error, 1)
	go func() { removed <- r.App.RemoveSource(context.Background(), "orders", 30*time.Second) }()
	waitFor(t, "orders to leave the list while it drains", func() bool { return slices.Equal(list(allToken), []string{"default"}) })
	select {
	case err := <-removed:
		t.Fatalf("RemoveSource returned (%v) while orders' stream held an unacked delivery", err)
	default:
	}
	if got := list(ordersToken); len(got) != 0 {
		t.Errorf("ListSources with the orders/* token while orders drains: %v; want none", got)
	}
	ackOne(t, all, held)
	if err := <-removed; err != nil {
		t.Fatal(err)
	}
	if got := list(allToken); !slices.Equal(got, []string{"default"}) {
		t.Errorf("ListSources after orders' removal: %v; want [default]", got)
	}
}
