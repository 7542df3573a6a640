package server_test

// Tests written against mutants of the Purge handler (server/admin.go) that
// the other tests let through.

import (
	"context"
	"errors"
	"io"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/testdb"
)

// purgeErr runs a purge to its end and returns its error (nil when done).
func purgeErr(t *testing.T, r *replica, req *outboxv1.PurgeRequest) error {
	t.Helper()
	st, err := r.Admin.Purge(t.Context(), req)
	if err != nil {
		return err
	}
	for {
		if _, err := st.Recv(); err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		}
	}
}

// A purge's stream is validated like every other stream a request names: a
// name no stream can have is refused as invalid, not answered with nothing
// deleted.
func TestPurgeRefusesAnInvalidStreamName(t *testing.T) {
	t.Parallel()
	url := testdb.New(t)
	r := startReplica(t, url, nil)
	before := timestamppb.New(time.Now().Add(time.Hour))
	for _, s := range []string{"Bad Stream", "orders;", strings.Repeat("s", 1000)} {
		wantCode(t, purgeErr(t, r, &outboxv1.PurgeRequest{Stream: s, PublishedBefore: before}), codes.InvalidArgument, "stream")
	}
}

// A purge the database fails answers as every admin call's database failure
// does, UNAVAILABLE ("database unavailable; retry"), not with the
// database's own error text: here a trigger refuses the DELETE.
func TestPurgeFailingInTheDatabaseAnswersUnavailable(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	emit(t, pool, "orders", "o-1", 2)
	publishSome(t, ctx, r, "orders", 2)
	if _, err := pool.Exec(ctx, `
		CREATE FUNCTION public.refuse_delete() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN RAISE EXCEPTION 'secret internal detail'; END $$;
		CREATE TRIGGER refuse_delete BEFORE DELETE ON outbox.event FOR EACH STATEMENT EXECUTE FUNCTION public.refuse_delete()`); err != nil {
		t.Fatal(err)
	}
	err := purgeErr(t, r, &outboxv1.PurgeRequest{PublishedBefore: timestamppb.New(time.Now().Add(time.Hour))})
	if status.Code(err) != codes.Unavailable || strings.Contains(err.Error(), "secret") {
		t.Fatalf("purge refused by the database: %v; want UNAVAILABLE without the database's message", err)
	}
}
