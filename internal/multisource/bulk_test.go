package multisource

import (
	"context"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
)

// sourceAdmin is an engine's AdminService that only knows its source's
// name; the bulk calls below answer through bulkEach's call, the seam every
// engine call of a bulk action over sources goes through.
type sourceAdmin struct {
	outboxv1.UnimplementedAdminServiceServer
	name string
}

// TestBulkRefusedWhileActing: no real engine refuses a request with
// INVALID_ARGUMENT when acting after accepting its dry run (validation
// does not depend on dry_run), so bulkEach is driven through its call
// seam: when orders refuses the action after default acted, the error
// names orders and says default acted, as for any other code; a refusal
// in the dry run is the engine's error as it is (the request, refused
// alike by every source).
func TestBulkRefusedWhileActing(t *testing.T) {
	t.Parallel()
	rt := &routes{engines: map[string]*Engine{}, names: []string{Default, "orders"}}
	for _, n := range rt.names {
		rt.engines[n] = &Engine{Name: n, Admin: sourceAdmin{name: n}}
	}
	refuse := status.Error(codes.InvalidArgument, "invalid request: filter: refused")
	bulk := func(refuseDry bool) (*outboxv1.BulkSkipResponse, error) {
		call := func(a outboxv1.AdminServiceServer, _ context.Context, req *outboxv1.BulkSkipRequest) (*outboxv1.BulkSkipResponse, error) {
			if a.(sourceAdmin).name == "orders" && req.GetDryRun() == refuseDry {
				return nil, refuse
			}
			return &outboxv1.BulkSkipResponse{Matched: 1}, nil
		}
		return bulkEach(t.Context(), rt, &outboxv1.BulkSkipRequest{Reason: "x"}, call, addSkip)
	}
	_, err := bulk(false)
	if msg := status.Convert(err).Message(); status.Code(err) != codes.InvalidArgument ||
		!strings.Contains(msg, "source orders: invalid request: filter: refused") || !strings.Contains(msg, "source default acted") {
		t.Errorf("orders refusing while acting: %v; want INVALID_ARGUMENT naming orders and that default acted", err)
	}
	if _, err := bulk(true); err != refuse {
		t.Errorf("orders refusing the dry run: %v; want its error as it is", err)
	}
}
