package server_test

import (
	"context"
	"testing"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/server"
)

// A page of ListAttempts that holds the last of them says so: no token to
// an empty page, as ListAggregates and ListEvents answer.
func TestListAttemptsLastPageHasNoToken(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, func(c *server.Config) { c.MaxFailures = 1 })
	keys := parkSome(t, ctx, r, pool, "orders", 1, "HTTP 503")
	all, err := r.Admin.ListAttempts(ctx, &outboxv1.ListAttemptsRequest{Stream: "orders", AggregateKey: keys[0]})
	if err != nil || len(all.GetAttempts()) == 0 {
		t.Fatalf("attempts of the parked aggregate: %v, %v", all, err)
	}
	n := len(all.GetAttempts())
	page, err := r.Admin.ListAttempts(ctx, &outboxv1.ListAttemptsRequest{Stream: "orders", AggregateKey: keys[0], PageSize: uint32(n)})
	if err != nil || len(page.GetAttempts()) != n || page.GetNextPageToken() != "" {
		t.Fatalf("all %d attempts in one page of %d: %v, %v; want them all and no next page", n, n, page, err)
	}
}
