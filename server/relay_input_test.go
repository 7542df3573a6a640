package server_test

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/server"
)

// One relay may hold MaxSubscriptionsPerRelay Subscribe streams on a
// replica, and not one more (ResourceExhausted); another relay is not
// limited by it.
func TestSubscriptionsPerRelayAreBounded(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	r := startReplica(t, url, func(c *server.Config) { c.MaxSubscriptionsPerRelay = 2 })
	open := func(relayID string) error {
		st, err := r.Relay.Subscribe(ctx, &outboxv1.SubscribeRequest{RelayId: relayID, MaxInFlight: 1})
		if err != nil {
			return err
		}
		// The session id header comes once the session is added; a
		// refusal ends the stream with its status instead.
		if h, err := st.Header(); err != nil || len(h.Get(server.SessionIDHeader)) == 0 {
			_, err = st.Recv()
			return fmt.Errorf("no session id header: %w", err)
		}
		return nil
	}
	for i := range 2 {
		if err := open("r"); err != nil {
			t.Fatalf("subscription %d of relay r: %v", i+1, err)
		}
	}
	if err := open("r"); status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("a third subscription of relay r: %v, want ResourceExhausted", err)
	}
	if err := open("s"); err != nil {
		t.Fatalf("the first subscription of relay s: %v", err)
	}
}

// A Subscribe refused for an unknown stream lists the known streams only as
// far as the caller's token may relay them: a token limited to billing.*
// learns nothing of sales_order.
func TestUnknownStreamErrorListsOnlyTheTokensStreams(t *testing.T) {
	t.Parallel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startAuthReplica(t, url)
	ctx := t.Context()
	billing := outboxv1.NewRelayServiceClient(dialAs(t, r, billingToken))
	refusal := func() string {
		t.Helper()
		st, err := billing.Subscribe(ctx, &outboxv1.SubscribeRequest{RelayId: "b", Streams: []string{"billing.invoce"}, MaxInFlight: 1})
		if err == nil {
			_, err = st.Recv()
		}
		wantCode(t, err, codes.NotFound, "")
		return status.Convert(err).Message()
	}
	emit(t, pool, "sales_order", "o-1", 1)
	if msg := refusal(); strings.Contains(msg, "sales_order") || !strings.Contains(msg, "no stream this token may relay has events yet") {
		t.Errorf("with only sales_order known: %q, want no stream named and that none of the token's has events", msg)
	}
	emit(t, pool, "billing.invoice", "i-1", 1)
	if msg := refusal(); strings.Contains(msg, "sales_order") || !strings.Contains(msg, "known streams: billing.invoice;") {
		t.Errorf("with billing.invoice and sales_order known: %q, want only billing.invoice listed", msg)
	}
}
