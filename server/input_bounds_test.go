package server_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/servertest"
	"github.com/outboxd/outboxd/internal/testdb"
)

// subscribeOutcome opens a Subscribe stream and says whether the server
// accepted it (nil, once its session id header came) or with which status
// it refused it. The stream ends when the call returns.
func subscribeOutcome(t *testing.T, r *replica, req *outboxv1.SubscribeRequest) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	return servertest.Subscribed(ctx, r.Relay, req)
}

// Every bound of a relay's input is exact, as documented: the longest
// relay_id, stream list, stream name and lease TTL a relay may ask for are
// accepted, one more is InvalidArgument naming the field, and so are
// control characters in a relay_id (which operators read in logs and
// ListRelays) and a malformed duration whose value would be in range. An
// Ack of MaxAckItems items is answered item by item.
func TestValidationRelayBoundsAreExact(t *testing.T) {
	t.Parallel()
	url := testdb.New(t)
	r := startReplica(t, url, nil)
	names := func(n int, prefix string) []string {
		s := make([]string, n)
		for i := range s {
			s[i] = fmt.Sprintf("%s%d", prefix, i)
		}
		return s
	}
	longStream := "s" + strings.Repeat("x", 127) // 128 characters: what a producer may emit
	for _, c := range []struct {
		name  string
		req   *outboxv1.SubscribeRequest
		code  codes.Code // OK: accepted; NotFound: valid but no such stream yet
		field string
	}{
		{"relay_id of 128", &outboxv1.SubscribeRequest{RelayId: strings.Repeat("r", 128)}, codes.OK, ""},
		{"relay_id of 129", &outboxv1.SubscribeRequest{RelayId: strings.Repeat("r", 129)}, codes.InvalidArgument, "relay_id"},
		{"relay_id of space and tilde", &outboxv1.SubscribeRequest{RelayId: " r~"}, codes.OK, ""},
		{"relay_id with a newline", &outboxv1.SubscribeRequest{RelayId: "r\nforged log line"}, codes.InvalidArgument, "relay_id"},
		{"relay_id with a tab", &outboxv1.SubscribeRequest{RelayId: "r\t"}, codes.InvalidArgument, "relay_id"},
		{"relay_id with 0x1f", &outboxv1.SubscribeRequest{RelayId: "r\x1f"}, codes.InvalidArgument, "relay_id"},
		{"64 streams", &outboxv1.SubscribeRequest{RelayId: "r", Streams: names(64, "s")}, codes.NotFound, ""},
		{"65 streams", &outboxv1.SubscribeRequest{RelayId: "r", Streams: names(65, "s")}, codes.InvalidArgument, "streams"},
		{"64 excluded streams", &outboxv1.SubscribeRequest{RelayId: "r", ExcludeStreams: names(64, "s")}, codes.OK, ""},
		{"65 excluded streams", &outboxv1.SubscribeRequest{RelayId: "r", ExcludeStreams: names(65, "s")}, codes.InvalidArgument, "exclude_streams"},
		{"stream name of 128", &outboxv1.SubscribeRequest{RelayId: "r", Streams: []string{longStream}}, codes.NotFound, ""},
		{"stream name of 129", &outboxv1.SubscribeRequest{RelayId: "r", Streams: []string{longStream + "x"}}, codes.InvalidArgument, "streams[0]"},
		{"lease_ttl at MinLeaseTTL", &outboxv1.SubscribeRequest{RelayId: "r", LeaseTtl: durationpb.New(time.Second)}, codes.OK, ""},
		{"lease_ttl below MinLeaseTTL", &outboxv1.SubscribeRequest{RelayId: "r", LeaseTtl: durationpb.New(time.Second - 1)}, codes.InvalidArgument, "lease_ttl"},
		{"lease_ttl at MaxLeaseTTL", &outboxv1.SubscribeRequest{RelayId: "r", LeaseTtl: durationpb.New(time.Hour)}, codes.OK, ""},
		{"lease_ttl above MaxLeaseTTL", &outboxv1.SubscribeRequest{RelayId: "r", LeaseTtl: durationpb.New(time.Hour + 1)}, codes.InvalidArgument, "lease_ttl"},
		// 2s-1ns and 2s, were they read as they are: nanos of another
		// sign than seconds, nanos out of range.
		{"lease_ttl with nanos of the wrong sign", &outboxv1.SubscribeRequest{RelayId: "r", LeaseTtl: &durationpb.Duration{Seconds: 2, Nanos: -1}}, codes.InvalidArgument, "lease_ttl"},
		{"lease_ttl with nanos out of range", &outboxv1.SubscribeRequest{RelayId: "r", LeaseTtl: &durationpb.Duration{Seconds: 1, Nanos: 1e9}}, codes.InvalidArgument, "lease_ttl"},
	} {
		c.req.MaxInFlight = 1
		err := subscribeOutcome(t, r, c.req)
		if status.Code(err) != c.code {
			t.Errorf("%s: %v, want %v", c.name, err, c.code)
			continue
		}
		if c.field != "" && !hasFieldViolation(err, c.field) {
			t.Errorf("%s: %v, want a violation of %s", c.name, err, c.field)
		}
	}

	// Every problem at once: each field at fault is named in the details,
	// and the message says how many more there are than the first.
	err := subscribeOutcome(t, r, &outboxv1.SubscribeRequest{RelayId: "", MaxInFlight: 0, Streams: []string{"Bad"}})
	for _, field := range []string{"relay_id", "streams[0]", "max_in_flight"} {
		if status.Code(err) != codes.InvalidArgument || !hasFieldViolation(err, field) {
			t.Errorf("Subscribe with three faults: %v, want InvalidArgument naming %s", err, field)
		}
	}
	if msg := status.Convert(err).Message(); !strings.Contains(msg, "(and 2 more)") {
		t.Errorf("Subscribe with three faults: message %q, want it to say (and 2 more)", msg)
	}

	items := make([]*outboxv1.AckItem, 1000)
	for i := range items {
		items[i] = &outboxv1.AckItem{EventId: uuid.NewString(), LeaseToken: "not-a-token"}
	}
	res, err := r.Relay.Ack(t.Context(), &outboxv1.AckRequest{Acks: items})
	if err != nil || len(res.GetResults()) != len(items) {
		t.Fatalf("Ack of 1000 items: %d results, %v; want one result per item", len(res.GetResults()), err)
	}
}

// Admin input at its documented bounds: an aggregate key of 1024 bytes and
// a stream name of 128 characters, which producers may emit, can be looked
// up; a stream pattern is a valid name followed by ".*" (or "*"), anything
// else is InvalidArgument naming the field, and "billing.*" means the
// streams under "billing.", not every stream whose name starts with
// "billing". A bulk filter that sets any one field is accepted. Text that
// is not UTF-8 is refused as the caller's fault even from an in-process
// caller, which no proto decoding screened.
func TestValidationAdminBoundsAreExact(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	longStream, longKey := "s"+strings.Repeat("x", 127), strings.Repeat("k", 1024)
	emit(t, pool, longStream, longKey, 1)
	emit(t, pool, "billing.invoice", "i-1", 1)
	emit(t, pool, "billing_old", "b-1", 1)
	waitState(t, pool, "i-1", "ready") // ListAggregates lists discovered aggregates
	waitState(t, pool, "b-1", "ready")

	agg, err := r.Admin.GetAggregate(ctx, &outboxv1.GetAggregateRequest{Stream: longStream, AggregateKey: longKey})
	if err != nil || agg.GetAggregate().GetAggregateKey() != longKey {
		t.Fatalf("GetAggregate of a 128-character stream and a 1024-byte key: %v", err)
	}
	if _, err := r.Admin.ListAttempts(ctx, &outboxv1.ListAttemptsRequest{Stream: longStream, AggregateKey: longKey}); err != nil {
		t.Fatalf("ListAttempts of a 128-character stream and a 1024-byte key: %v", err)
	}

	lag, err := r.Admin.GetLag(ctx, &outboxv1.GetLagRequest{Streams: []string{"billing.*"}})
	if err != nil {
		t.Fatal(err)
	}
	var streams []string
	for _, l := range lag.GetStreams() {
		streams = append(streams, l.GetStream())
	}
	if !slices.Equal(streams, []string{"billing.invoice"}) {
		t.Errorf("GetLag{billing.*}: %v, want [billing.invoice] (not billing_old)", streams)
	}
	list, err := r.Admin.ListAggregates(ctx, &outboxv1.ListAggregatesRequest{Filter: &outboxv1.AggregateFilter{Stream: "billing.*"}})
	if err != nil {
		t.Fatal(err)
	}
	var keys []string
	for _, a := range list.GetAggregates() {
		keys = append(keys, a.GetStream()+"/"+a.GetAggregateKey())
	}
	if !slices.Equal(keys, []string{"billing.invoice/i-1"}) {
		t.Errorf("ListAggregates{billing.*}: %v, want [billing.invoice/i-1] (not billing_old)", keys)
	}

	// "*" is every stream, in a listing as in GetLag.
	waitState(t, pool, longKey, "ready")
	if all, err := r.Admin.ListAggregates(ctx, &outboxv1.ListAggregatesRequest{Filter: &outboxv1.AggregateFilter{Stream: "*"}}); err != nil || len(all.GetAggregates()) != 3 {
		t.Errorf("ListAggregates{*}: %v, %v; want the 3 aggregates of every stream", all.GetAggregates(), err)
	}
	if all, err := r.Admin.GetLag(ctx, &outboxv1.GetLagRequest{Streams: []string{"*"}}); err != nil || len(all.GetStreams()) != 3 {
		t.Errorf("GetLag{*}: %v, %v; want the 3 streams", all.GetStreams(), err)
	}

	for _, bad := range []string{"Billing.*", ".*", "*.*", "billing..*x", "billing.*.*"} {
		_, err := r.Admin.GetLag(ctx, &outboxv1.GetLagRequest{Streams: []string{bad}})
		wantCode(t, err, codes.InvalidArgument, "streams[0]")
		_, err = r.Admin.ListAggregates(ctx, &outboxv1.ListAggregatesRequest{Filter: &outboxv1.AggregateFilter{Stream: bad}})
		wantCode(t, err, codes.InvalidArgument, "filter.stream")
	}

	// A bulk filter that sets any one field is not empty: each alone is
	// accepted (here in dry runs), only a filter that sets none is refused.
	for _, f := range []*outboxv1.AggregateFilter{
		{Stream: "*"}, {StalledOnly: true}, {ErrorContains: "503"}, {PendingBefore: timestamppb.Now()},
		{States: []outboxv1.AggregateState{outboxv1.AggregateState_AGGREGATE_STATE_PARKED}},
	} {
		if _, err := r.Admin.BulkRetry(ctx, &outboxv1.BulkRetryRequest{Filter: f, DryRun: true}); err != nil {
			t.Errorf("BulkRetry{%v} dry run: %v", f, err)
		}
		if _, err := r.Admin.BulkSkip(ctx, &outboxv1.BulkSkipRequest{Filter: f, Reason: "r", DryRun: true}); err != nil {
			t.Errorf("BulkSkip{%v} dry run: %v", f, err)
		}
	}

	inproc := r.Server.AdminServer()
	_, err = inproc.GetAggregate(ctx, &outboxv1.GetAggregateRequest{Stream: "billing.invoice", AggregateKey: "i-\xff"})
	wantCode(t, err, codes.InvalidArgument, "aggregate_key")
	_, err = inproc.ListAggregates(ctx, &outboxv1.ListAggregatesRequest{Filter: &outboxv1.AggregateFilter{ErrorContains: "\xfe"}})
	wantCode(t, err, codes.InvalidArgument, "filter.error_contains")
}
