package server_test

import (
	"context"
	"fmt"
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
