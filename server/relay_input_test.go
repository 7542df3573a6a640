package server_test

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/auth"
	"github.com/outboxd/outboxd/internal/servertest"
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
		return servertest.Subscribed(ctx, r.Relay, &outboxv1.SubscribeRequest{RelayId: relayID, MaxInFlight: 1})
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

// The Subscribe limit counts a token's streams, whatever relay_id each
// names: a token holding MaxSubscriptionsPerRelay streams is refused one
// more under a new relay_id (ResourceExhausted), and another token is not
// limited by it.
func TestSubscriptionLimitIsPerTokenNotPerRelayID(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	url := testdb.New(t)
	const otherToken = "other-relay-token-0123456789"
	file := filepath.Join(t.TempDir(), "tokens")
	if err := os.WriteFile(file, []byte("relay relay "+relayToken+"\nother relay "+otherToken+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	a, err := auth.New(auth.Config{File: file})
	if err != nil {
		t.Fatal(err)
	}
	r := servertest.Start(t, url, servertest.Options{Authenticator: a, Configure: func(c *server.Config) { c.MaxSubscriptionsPerRelay = 2 }})
	open := func(token, relayID string) error {
		return servertest.Subscribed(ctx, outboxv1.NewRelayServiceClient(dialAs(t, r, token)), &outboxv1.SubscribeRequest{RelayId: relayID, MaxInFlight: 1})
	}
	for _, id := range []string{"a", "b"} {
		if err := open(relayToken, id); err != nil {
			t.Fatalf("subscription %s of the relay token: %v", id, err)
		}
	}
	if err := open(relayToken, "c"); status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("a third subscription of the relay token, as relay c: %v, want ResourceExhausted", err)
	}
	if err := open(otherToken, "a"); err != nil {
		t.Fatalf("the first subscription of the other token: %v", err)
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

// A permanent nack parks the aggregate at once, whatever MaxFailures and
// the nack's retry_after say, with the relay's error in the parked reason.
func TestPermanentNackParksAtOnce(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, func(c *server.Config) { c.MaxFailures = 10 })
	emit(t, pool, "orders", "big", 2)
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 1, LeaseTtl: durationpb.New(time.Hour)})
	d := recv(t, st)
	res, err := r.Relay.Nack(ctx, &outboxv1.NackRequest{EventId: d.GetEvent().GetEventId(), LeaseToken: d.GetLeaseToken(),
		Error: "message too large for the broker", Permanent: true, RetryAfter: durationpb.New(time.Second)})
	if err != nil {
		t.Fatal(err)
	}
	if !res.GetParked() || res.GetFailures() != 1 || res.GetNextAttemptAt() != nil {
		t.Fatalf("permanent nack: %v, want parked after 1 failure with no next attempt", res)
	}
	agg, err := r.Admin.GetAggregate(ctx, &outboxv1.GetAggregateRequest{Stream: "orders", AggregateKey: "big"})
	if err != nil {
		t.Fatal(err)
	}
	if a := agg.GetAggregate(); a.GetState() != outboxv1.AggregateState_AGGREGATE_STATE_PARKED ||
		!strings.Contains(a.GetParkedReason(), "message too large for the broker") {
		t.Fatalf("aggregate after a permanent nack: %v, want parked with the relay's error in its reason", a)
	}
}
