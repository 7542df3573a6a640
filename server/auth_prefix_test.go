package server_test

import (
	"os"
	"path/filepath"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/auth"
	"github.com/outboxd/outboxd/internal/servertest"
	"github.com/outboxd/outboxd/internal/testdb"
)

// A stream filter's pattern is authorized as the pattern, not as its
// prefix: "billing." is a stream name of its own, and a token limited to
// that one stream may not reach every stream under "billing." through the
// pattern "billing.*", in a listing or a bulk action.
func TestExactStreamTokenDoesNotCoverItsPattern(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	const dotOps = "dot-ops-token-0123456789abcd"
	file := filepath.Join(t.TempDir(), "tokens")
	if err := os.WriteFile(file, []byte("dot-ops  admin  "+dotOps+"  streams=billing.\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	a, err := auth.New(auth.Config{File: file})
	if err != nil {
		t.Fatal(err)
	}
	r := servertest.Start(t, url, servertest.Options{Authenticator: a})
	emit(t, pool, "billing.", "own", 1)
	emit(t, pool, "billing.invoice", "i-1", 1)
	limited := outboxv1.NewAdminServiceClient(dialAs(t, r, dotOps))
	if _, err := limited.ListAggregates(ctx, &outboxv1.ListAggregatesRequest{Filter: &outboxv1.AggregateFilter{Stream: "billing."}}); err != nil {
		t.Fatalf("ListAggregates{billing.} with a token for billing.: %v", err)
	}
	_, err = limited.ListAggregates(ctx, &outboxv1.ListAggregatesRequest{Filter: &outboxv1.AggregateFilter{Stream: "billing.*"}})
	if status.Code(err) != codes.PermissionDenied {
		t.Errorf("ListAggregates{billing.*} with a token for billing. alone: %v, want PermissionDenied", err)
	}
	_, err = limited.BulkSkip(ctx, &outboxv1.BulkSkipRequest{Filter: &outboxv1.AggregateFilter{Stream: "billing.*"}, Reason: "r"})
	if status.Code(err) != codes.PermissionDenied {
		t.Errorf("BulkSkip{billing.*} with a token for billing. alone: %v, want PermissionDenied", err)
	}
	if n := countWhere(t, pool, "outbox.skipped_event", "true"); n != 0 {
		t.Fatalf("a refused bulk skip skipped %d events", n)
	}
}
