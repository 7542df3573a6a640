package server_test

import (
	"context"
	"slices"
	"testing"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/testdb"
)

// GetLag's streams filter: a pattern reports the streams it matches and no
// other; a name reports that stream, with an entry of zeros if it has no
// events, so that a script finds every stream it named.
func TestGetLagStreamNamesAndPatterns(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	emit(t, pool, "billing.invoice", "i-1", 2)
	emit(t, pool, "billing.refund", "r-1", 1)
	emit(t, pool, "sales", "s-1", 1)
	lag := func(streams ...string) (names []string, total int64) {
		t.Helper()
		res, err := r.Admin.GetLag(ctx, &outboxv1.GetLagRequest{Streams: streams})
		if err != nil {
			t.Fatal(err)
		}
		for _, l := range res.GetStreams() {
			names = append(names, l.GetStream())
			if l.GetStream() == "quiet" && (l.GetPendingEvents() != 0 || l.GetPendingAggregates() != 0) {
				t.Errorf("quiet, which has no events: %v", l)
			}
		}
		slices.Sort(names)
		return names, res.GetTotal().GetPendingEvents()
	}
	if names, total := lag("billing.*"); !slices.Equal(names, []string{"billing.invoice", "billing.refund"}) || total != 3 {
		t.Errorf("GetLag{billing.*}: streams %v, pending %d; want billing.invoice and billing.refund, 3", names, total)
	}
	if names, total := lag("sales", "quiet"); !slices.Equal(names, []string{"quiet", "sales"}) || total != 1 {
		t.Errorf("GetLag{sales, quiet}: streams %v, pending %d; want quiet (zeros) and sales, 1", names, total)
	}
}
