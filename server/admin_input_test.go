package server_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/types/known/timestamppb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/testdb"
)

// Issue 24 item 5. Admin text that PostgreSQL cannot store as text (a NUL
// byte) or that exceeds its bound is InvalidArgument naming the field, over
// real gRPC, and the call writes nothing: no operator_action row, no skip,
// no accepted gap. (Invalid UTF-8 cannot be sent in a proto3 string over
// gRPC, so checkText's test of it guards callers that build requests some
// other way.)
func TestAdminTextInputIsValidatedBeforeAnyWrite(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	emit(t, pool, "orders", "o-1", 1)
	nul, long := "o-\x001", strings.Repeat("k", 1025)
	hourAgo := timestamppb.New(time.Now().Add(-time.Hour))

	for _, c := range []struct {
		name, field string
		call        func(key string) error
	}{
		{"GetAggregate", "aggregate_key", func(key string) error {
			_, err := r.Admin.GetAggregate(ctx, &outboxv1.GetAggregateRequest{Stream: "orders", AggregateKey: key})
			return err
		}},
		{"RetryAggregate", "aggregate_key", func(key string) error {
			_, err := r.Admin.RetryAggregate(ctx, &outboxv1.RetryAggregateRequest{Stream: "orders", AggregateKey: key})
			return err
		}},
		{"RetryAggregate accept_gap", "aggregate_key", func(key string) error {
			_, err := r.Admin.RetryAggregate(ctx, &outboxv1.RetryAggregateRequest{Stream: "orders", AggregateKey: key,
				AcceptGap: true, Reason: "r"})
			return err
		}},
		{"Republish", "aggregate_key", func(key string) error {
			_, err := r.Admin.Republish(ctx, &outboxv1.RepublishRequest{Stream: "orders", AggregateKey: key, FromRevision: 1, Reason: "r"})
			return err
		}},
		{"Republish range", "aggregate_key", func(key string) error {
			_, err := r.Admin.Republish(ctx, &outboxv1.RepublishRequest{Stream: "orders", AggregateKey: key,
				PublishedAfter: hourAgo, Reason: "r"})
			return err
		}},
		{"ListEvents", "aggregate_key", func(key string) error {
			_, err := r.Admin.ListEvents(ctx, &outboxv1.ListEventsRequest{Stream: "orders", AggregateKey: key})
			return err
		}},
		{"ListAttempts", "aggregate_key", func(key string) error {
			_, err := r.Admin.ListAttempts(ctx, &outboxv1.ListAttemptsRequest{Stream: "orders", AggregateKey: key})
			return err
		}},
		{"ListAggregates", "filter.error_contains", func(text string) error {
			_, err := r.Admin.ListAggregates(ctx, &outboxv1.ListAggregatesRequest{Filter: &outboxv1.AggregateFilter{ErrorContains: text}})
			return err
		}},
		{"BulkRetry", "filter.error_contains", func(text string) error {
			_, err := r.Admin.BulkRetry(ctx, &outboxv1.BulkRetryRequest{Filter: &outboxv1.AggregateFilter{ErrorContains: text}, Reason: "r"})
			return err
		}},
		{"BulkSkip", "filter.error_contains", func(text string) error {
			_, err := r.Admin.BulkSkip(ctx, &outboxv1.BulkSkipRequest{Filter: &outboxv1.AggregateFilter{ErrorContains: text}, Reason: "r"})
			return err
		}},
		{"BulkSkip reason", "reason", func(text string) error {
			_, err := r.Admin.BulkSkip(ctx, &outboxv1.BulkSkipRequest{Filter: &outboxv1.AggregateFilter{Stream: "orders"}, Reason: "r" + text})
			return err
		}},
		{"Republish reason", "reason", func(text string) error {
			_, err := r.Admin.Republish(ctx, &outboxv1.RepublishRequest{Stream: "orders", AggregateKey: "o-1", FromRevision: 1, Reason: "r" + text})
			return err
		}},
	} {
		for _, bad := range []string{nul, "\x00" + nul, long} { // a NUL inside, and first
			if c.field == "reason" && bad == long {
				bad = strings.Repeat("é", 1025) // the bound is in characters
			}
			err := c.call(bad)
			wantCode(t, err, codes.InvalidArgument, c.field)
			if strings.Contains(err.Error(), "database") {
				t.Errorf("%s(%.20q): %v blames the database", c.name, bad, err)
			}
		}
	}
	for _, table := range []string{"outbox.operator_action", "outbox.skipped_event", "outbox.accepted_gap", "outbox.republished"} {
		if n := countWhere(t, pool, table, "true"); n != 0 {
			t.Errorf("refused calls wrote %d rows to %s", n, table)
		}
	}
}
