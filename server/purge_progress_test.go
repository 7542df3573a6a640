package server_test

import (
	"context"
	"errors"
	"io"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/testdb"
)

// A purge's progress counts down: after each batch, remaining is the
// first report's estimate less what has been deleted, so an operator
// watching a long purge sees it advance; the last report is done with
// nothing remaining.
func TestPurgeProgressCountsDown(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	emit(t, pool, "orders", "o-1", 6)
	publishSome(t, ctx, r, "orders", 6)
	st, err := r.Admin.Purge(ctx, &outboxv1.PurgeRequest{PublishedBefore: timestamppb.New(time.Now().Add(time.Hour)), BatchSize: 2})
	if err != nil {
		t.Fatal(err)
	}
	var msgs []*outboxv1.PurgeResponse
	for {
		m, err := st.Recv()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		msgs = append(msgs, m)
	}
	if len(msgs) < 3 || msgs[0].GetRemaining() != 6 || msgs[0].GetDeleted() != 0 {
		t.Fatalf("purge of 6 in batches of 2: %v; want the estimate of 6 first, then a report per batch", msgs)
	}
	for i, m := range msgs[1:] {
		if want := 6 - m.GetDeleted(); m.GetRemaining() != want {
			t.Errorf("report %d: %d deleted, %d remaining; want %d remaining", i+1, m.GetDeleted(), m.GetRemaining(), want)
		}
	}
	if last := msgs[len(msgs)-1]; !last.GetDone() || last.GetDeleted() != 6 || last.GetRemaining() != 0 {
		t.Fatalf("last report %v, want done with 6 deleted and none remaining", last)
	}
}
