package console_test

import (
	"context"
	"strings"
	"testing"

	"google.golang.org/grpc/metadata"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
)

// A stream with nothing pending and no delivery in the last minute stays
// in the streams table and in the page script's data, with zeros, as it
// stays in the chart's legend.
func TestStreamsPageKeepsIdleStreams(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessOptions{})
	h.emit(t, "quiet", "q1", 1)
	h.emit(t, "busy", "b1", 1)
	ctx, cancel := context.WithCancel(metadata.AppendToOutgoingContext(t.Context(), "authorization", "Bearer "+relaySecret))
	defer cancel()
	sub, err := h.rep.Relay.Subscribe(ctx, &outboxv1.SubscribeRequest{RelayId: "acker", Streams: []string{"quiet"}, MaxInFlight: 1})
	if err != nil {
		t.Fatal(err)
	}
	d, err := sub.Recv()
	if err != nil {
		t.Fatal(err)
	}
	resp, err := h.rep.Relay.Ack(ctx, &outboxv1.AckRequest{Acks: []*outboxv1.AckItem{{EventId: d.GetEvent().GetEventId(), LeaseToken: d.GetLeaseToken()}}})
	if err != nil || resp.GetResults()[0].GetStatus() != outboxv1.AckStatus_ACK_STATUS_PUBLISHED {
		t.Fatalf("ack: %v, %v", resp, err)
	}
	// The delivery rate covers the last minute: clearing its counts stands
	// for that minute passing.
	if _, err := h.pool.Exec(t.Context(), `DELETE FROM outbox.delivered_count`); err != nil {
		t.Fatal(err)
	}

	b := h.browser(t)
	b.login(t, viewerSecret)
	if _, body := b.get(t, "/"); !strings.Contains(body, `>quiet</a>`) || !strings.Contains(body, `>busy</a>`) {
		t.Errorf("the streams table lacks the idle stream quiet (or busy):\n%s", body)
	}
	if _, body := b.get(t, "/api/lag"); !strings.Contains(body, `"quiet"`) {
		t.Errorf("the page script's data lacks the idle stream quiet:\n%s", body)
	}
}
