package server_test

// Tests written against mutants of ListOperatorActions and of the record
// bulk actions leave (server/actions.go, server/deadletter.go) that the other
// tests let through.

import (
	"context"
	"slices"
	"testing"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/testdb"
)

// A stream-limited token whose actions are further back than ListOperatorActions
// reads in one call (ten reads of a page and one) gets a shorter page, an empty
// one here, with a token that continues the listing: its action is found on a
// later page, not lost behind an empty last page.
func TestLimitedTokenSparseActionsPageOnWithAToken(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startAuthReplica(t, url)
	bill := emit(t, pool, "billing.invoice", "i-1", 1)
	orders := emit(t, pool, "sales_order", "o-1", 25)
	full := outboxv1.NewAdminServiceClient(dialAs(t, r, adminToken))
	limited := outboxv1.NewAdminServiceClient(dialAs(t, r, billingOps))
	// Oldest first: the billing skip, then 25 of sales_order (newest last),
	// more than ten reads of two actions each pass over.
	if _, err := full.SkipEvent(ctx, &outboxv1.SkipEventRequest{EventId: bill[0].String(), Reason: "r"}); err != nil {
		t.Fatal(err)
	}
	for i := len(orders) - 1; i >= 0; i-- {
		if _, err := full.SkipEvent(ctx, &outboxv1.SkipEventRequest{EventId: orders[i].String(), Reason: "r"}); err != nil {
			t.Fatal(err)
		}
	}
	var found []*outboxv1.OperatorAction
	tok, calls := "", 0
	for {
		res, err := limited.ListOperatorActions(ctx, &outboxv1.ListOperatorActionsRequest{PageSize: 1, PageToken: tok})
		if err != nil {
			t.Fatal(err)
		}
		calls++
		found = append(found, res.GetActions()...)
		if tok = res.GetNextPageToken(); tok == "" || calls > 30 {
			break
		}
	}
	if len(found) != 1 || found[0].GetStream() != "billing.invoice" {
		t.Fatalf("billing.* paging through 26 actions, page size 1, in %d calls: %v; want the billing skip", calls, found)
	}
	if calls < 2 {
		t.Fatalf("the billing skip came in %d call; want a first call that stops after ten reads with a token", calls)
	}
}

// A bulk action records the stream pattern its filter named, which decides
// who sees it: a token limited to billing.* that bulk-skips billing.* finds
// its action, under that pattern, in an unfiltered listing, with the counts
// of what it changed; a listing by stream finds it by the aggregates it
// changed.
func TestBulkActionIsRecordedUnderItsFilterPattern(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startAuthReplica(t, url)
	emit(t, pool, "billing.invoice", "i-1", 2)
	waitState(t, pool, "i-1", "ready")
	limited := outboxv1.NewAdminServiceClient(dialAs(t, r, billingOps))
	res, err := limited.BulkSkip(ctx, &outboxv1.BulkSkipRequest{Filter: &outboxv1.AggregateFilter{Stream: "billing.*"}, Reason: "r"})
	if err != nil || res.GetSkipped() != 1 {
		t.Fatalf("bulk skip of billing.*: %v, %v; want 1 skipped", res, err)
	}
	if _, err := limited.BulkRetry(ctx, &outboxv1.BulkRetryRequest{Filter: &outboxv1.AggregateFilter{Stream: "billing.*"}}); err != nil {
		t.Fatal(err)
	}
	acts, err := limited.ListOperatorActions(ctx, &outboxv1.ListOperatorActionsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, a := range acts.GetActions() {
		got = append(got, a.GetAction()+" "+a.GetStream())
	}
	if want := []string{"bulk_retry billing.*", "bulk_skip billing.*"}; !slices.Equal(got, want) {
		t.Fatalf("billing.* lists its own bulk actions as %q; want %q", got, want)
	}
	// The record counts what the skip changed: one aggregate, one event.
	if sk := acts.GetActions()[1]; sk.GetAggregates() != 1 || sk.GetEvents() != 1 || sk.GetFinishedAt() == nil {
		t.Fatalf("bulk skip recorded as %v; want 1 aggregate, 1 event, finished", sk)
	} // Listed by a stream it changed an aggregate of, though it named a
	// pattern; the bulk retry, which changed nothing, is not.
	acts, err = limited.ListOperatorActions(ctx, &outboxv1.ListOperatorActionsRequest{Stream: "billing.invoice"})
	if err != nil || len(acts.GetActions()) != 1 || acts.GetActions()[0].GetAction() != "bulk_skip" {
		t.Fatalf("actions of stream billing.invoice: %v, %v; want the bulk skip of billing.* that skipped its event", acts.GetActions(), err)
	}
}
