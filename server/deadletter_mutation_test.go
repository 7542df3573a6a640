package server_test

// The housekeeping sweep's tests of the dead-letter listing and the lag
// read: each holds a promise no other test held, and names the mutants of
// the sweep (sweep-house) it kills.

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/types/known/timestamppb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/server"
)

// An exact stream in an aggregate filter is that stream, not a prefix of
// others: "orders" lists and counts neither "orders.eu" nor "ordersx"
// (only "orders.*" would take them). Kills T01 (the exact stream matched
// with starts_with).
func TestAggregateFilterExactStreamIsNotAPrefix(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	emit(t, pool, "orders", "o-1", 1)
	emit(t, pool, "orders.eu", "eu-1", 1)
	emit(t, pool, "ordersx", "x-1", 1)
	for _, k := range []string{"o-1", "eu-1", "x-1"} {
		waitState(t, pool, k, "ready")
	}
	if keys, matched := listedAndMatched(t, ctx, r, &outboxv1.AggregateFilter{Stream: "orders"}); !slices.Equal(keys, []string{"orders/o-1"}) || matched != 1 {
		t.Fatalf("{stream: orders} lists %v and a bulk skip's dry run matches %d; want only orders/o-1, 1", keys, matched)
	}
}

// listedAndMatched is what an operator sees of filter f: the aggregates
// ListAggregates lists (stream/key, one page) and how many a bulk skip's
// dry run would act on.
func listedAndMatched(t *testing.T, ctx context.Context, r *replica, f *outboxv1.AggregateFilter) (keys []string, matched int64) {
	t.Helper()
	res, err := r.Admin.ListAggregates(ctx, &outboxv1.ListAggregatesRequest{Filter: f})
	if err != nil {
		t.Fatal(err)
	}
	for _, a := range res.GetAggregates() {
		keys = append(keys, a.GetStream()+"/"+a.GetAggregateKey())
	}
	dry, err := r.Admin.BulkSkip(ctx, &outboxv1.BulkSkipRequest{Filter: f, Reason: "r", DryRun: true})
	if err != nil {
		t.Fatal(err)
	}
	return keys, dry.GetMatched()
}

// An aggregate, or an event, that exists but has no attempt on record has
// an empty attempt history, not NotFound: only an event id that names no
// event is not found. Kills D16 (NotFound for any empty page, the
// aggregate's included).
func TestListAttemptsOfWorkNeverTriedIsAnEmptyPage(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	ids := emit(t, pool, "orders", "untried", 1)
	waitState(t, pool, "untried", "ready")
	for _, req := range []*outboxv1.ListAttemptsRequest{
		{Stream: "orders", AggregateKey: "untried"},
		{Stream: "orders", AggregateKey: "no-such-aggregate"},
		{EventId: ids[0].String()},
	} {
		res, err := r.Admin.ListAttempts(ctx, req)
		if err != nil || len(res.GetAttempts()) != 0 || res.GetNextPageToken() != "" {
			t.Errorf("ListAttempts{%v}: %v, %v; want an empty page", req, res, err)
		}
	}
}

// A bulk action's audit record shows its whole filter: the states by name,
// pending_before and stalled_only, as well as the stream and the error
// text. Kills D26 (states dropped), D27 (pending_before dropped) and D28
// (stalled_only dropped).
func TestBulkActionRecordsItsWholeFilter(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	before := time.Date(2026, 1, 2, 3, 4, 5, 123456000, time.UTC)
	filter := &outboxv1.AggregateFilter{Stream: "orders", ErrorContains: "503", StalledOnly: true,
		States:        []outboxv1.AggregateState{outboxv1.AggregateState_AGGREGATE_STATE_PARKED, outboxv1.AggregateState_AGGREGATE_STATE_BACKOFF},
		PendingBefore: timestamppb.New(before)}
	if _, err := r.Admin.BulkRetry(ctx, &outboxv1.BulkRetryRequest{Filter: filter, Reason: "retry", Actor: "alice"}); err != nil {
		t.Fatal(err)
	}
	if _, err := r.Admin.BulkSkip(ctx, &outboxv1.BulkSkipRequest{Filter: filter, Reason: "skip", Actor: "bob"}); err != nil {
		t.Fatal(err)
	}
	if n := countWhere(t, pool, "outbox.operator_action", `action IN ('bulk_retry', 'bulk_skip')
		AND request->'filter'->'states' = '["parked", "backoff"]'::jsonb
		AND (request->'filter'->>'pending_before')::timestamptz = '2026-01-02 03:04:05.123456+00'
		AND request->'filter'->'stalled_only' = 'true'::jsonb
		AND request->'filter'->>'stream' = 'orders' AND request->'filter'->>'error_contains' = '503'`); n != 2 {
		var recs []string
		rows, err := pool.Query(ctx, `SELECT request::text FROM outbox.operator_action ORDER BY action_id`)
		if err != nil {
			t.Fatal(err)
		}
		for rows.Next() {
			var s string
			if err := rows.Scan(&s); err != nil {
				t.Fatal(err)
			}
			recs = append(recs, s)
		}
		t.Fatalf("%d of the 2 bulk actions record the whole filter; records: %v", n, recs)
	}
}

// GetLag's connected relays are the sessions refreshed within three
// refresh intervals, like ListRelays': with a refresh every minute, a row
// seen 2 minutes ago counts and one seen 4 minutes ago does not. Both are
// the replica's own, which its clean-up never deletes, so the count does
// not depend on when its first clean-up runs. Kills S02 (the lag read
// given one refresh interval), L03 (the interval literal in milliseconds)
// and L04 (no age limit).
func TestGetLagCountsRelaysSeenWithinThreeRefreshes(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, func(c *server.Config) {
		c.ReplicaID = "me"
		c.SessionRefreshInterval = time.Minute
	})
	if _, err := pool.Exec(ctx, `INSERT INTO outbox.relay_session
		    (session_id, relay_id, peer, replica_id, streams, max_in_flight, connected_at, seen_at)
		VALUES (gen_random_uuid(), 'late', 'p', 'me', '{}', 1, now(), clock_timestamp() - interval '2 minutes'),
		       (gen_random_uuid(), 'gone', 'p', 'me', '{}', 1, now(), clock_timestamp() - interval '4 minutes')`); err != nil {
		t.Fatal(err)
	}
	lag, err := r.Admin.GetLag(ctx, &outboxv1.GetLagRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if n := lag.GetConnectedRelays(); n != 1 {
		t.Fatalf("GetLag counts %d connected relays, want 1 (late, seen 2 minutes ago; not gone, seen 4 minutes ago)", n)
	}
}

// A GetLag pattern that matches no stream reports no stream: its filter is
// an empty list, which is not "every stream". Kills L09 (an empty filter
// read as none).
func TestGetLagPatternMatchingNoStreamReportsNone(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	emit(t, pool, "orders", "o-1", 1)
	waitState(t, pool, "o-1", "ready")
	lag, err := r.Admin.GetLag(ctx, &outboxv1.GetLagRequest{Streams: []string{"nosuch.*"}})
	if err != nil {
		t.Fatal(err)
	}
	if len(lag.GetStreams()) != 0 || lag.GetTotal().GetPendingEvents() != 0 {
		t.Fatalf("GetLag{nosuch.*}: %v; want no stream and nothing pending", lag)
	}
}

// An aggregate whose only pending event was skipped has no pending work,
// though its delivery row keeps pending_since until its next claim (none
// comes here: no relay is connected): ListAggregates does not list it and
// a bulk filter does not match it. Kills T07 (the skipped events not left
// out of the pending test).
func TestAggregateWhoseOnlyPendingEventIsSkippedIsNotListed(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	ids := emit(t, pool, "orders", "skipped", 1)
	emit(t, pool, "orders", "pending", 1)
	waitState(t, pool, "skipped", "ready")
	waitState(t, pool, "pending", "ready")
	if _, err := r.Admin.SkipEvent(ctx, &outboxv1.SkipEventRequest{EventId: ids[0].String(), Reason: "poison"}); err != nil {
		t.Fatal(err)
	}
	if n := countWhere(t, pool, "outbox.delivery", "aggregate_key = 'skipped' AND pending_since IS NOT NULL"); n != 1 {
		t.Fatalf("the scene: the skipped aggregate's delivery row has pending_since set in %d rows, want 1", n)
	}
	if keys, matched := listedAndMatched(t, ctx, r, &outboxv1.AggregateFilter{Stream: "orders"}); !slices.Equal(keys, []string{"orders/pending"}) || matched != 1 {
		t.Fatalf("{stream: orders} lists %v and a bulk skip's dry run matches %d; want only orders/pending (skipped has nothing pending), 1", keys, matched)
	}
}

// A bulk action's walk resumes after the last aggregate of a page, by its
// stream and key both: a page that ends in another stream than it began
// in does not bring that stream's aggregates round again. Each aggregate
// has two pending events, so one acted on still matches; with pages of 2
// over alpha/k1, beta/k1 and beta/k2 the skip skips one event of each.
// Kills D25 (the walk resumed from the page's first stream).
func TestBulkWalkResumesAfterThePagesLastStreamAndKey(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	r.Server.SetBulkPage(2, nil)
	emit(t, pool, "alpha", "k1", 2)
	emit(t, pool, "beta", "k1", 2)
	emit(t, pool, "beta", "k2", 2)
	if n := countWhere(t, pool, "outbox.event", "true"); n != 6 {
		t.Fatalf("%d events", n)
	}
	waitFor(t, func() int32 { return b2i(countWhere(t, pool, "outbox.delivery", "state = 'ready'") == 3) })
	res, err := r.Admin.BulkSkip(ctx, &outboxv1.BulkSkipRequest{Filter: &outboxv1.AggregateFilter{Stream: "*"}, Reason: "r"})
	if err != nil {
		t.Fatal(err)
	}
	if res.GetSkipped() != 3 || res.GetMatched() != 3 {
		t.Errorf("bulk skip over 3 aggregates in pages of 2: %v; want 3 matched and 3 skipped", res)
	}
	if n := countWhere(t, pool, "outbox.skipped_event s JOIN outbox.event e USING (event_id)", "e.revision = 1"); n != 3 {
		t.Errorf("%d first events skipped, want 3", n)
	}
	if n := countWhere(t, pool, "outbox.skipped_event", "true"); n != 3 {
		t.Errorf("%d events skipped in all, want 3 (one per aggregate)", n)
	}
}

// ListAggregates lists the oldest pending first, whatever the streams and
// keys: aggregates emitted in the order zeta/zz, alpha/zz, zeta/aa come in
// that order, in one page and in pages of one. Kills T04 (ordered by
// stream and key first).
func TestListAggregatesOldestPendingFirstAcrossStreamsAndKeys(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	want := []string{"zeta/zz", "alpha/zz", "zeta/aa"}
	for _, sk := range want {
		stream, key, _ := strings.Cut(sk, "/")
		emit(t, pool, stream, key, 1)
	}
	waitFor(t, func() int32 { return b2i(countWhere(t, pool, "outbox.delivery", "state = 'ready'") == 3) })
	for _, size := range []uint32{0, 1} {
		var got []string
		tok := ""
		for range 10 {
			res, err := r.Admin.ListAggregates(ctx, &outboxv1.ListAggregatesRequest{PageSize: size, PageToken: tok})
			if err != nil {
				t.Fatal(err)
			}
			for _, a := range res.GetAggregates() {
				got = append(got, a.GetStream()+"/"+a.GetAggregateKey())
			}
			if tok = res.GetNextPageToken(); tok == "" {
				break
			}
		}
		if !slices.Equal(got, want) {
			t.Errorf("ListAggregates in pages of %d: %v, want oldest pending first: %v", size, got, want)
		}
	}
}

// A bulk action whose audit record cannot be finished answers an error,
// though the action itself did its work: the operator learns that the
// record says less than was done. The test's database refuses every
// update of outbox.operator_action (a trigger of its own). Kills D29
// (FinishAction's error dropped).
func TestBulkActionWhoseRecordCannotBeFinishedFails(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	if _, err := pool.Exec(ctx, `
		CREATE FUNCTION public.refuse_finish() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN RAISE EXCEPTION 'the test refuses to finish an action'; END $$;
		CREATE TRIGGER refuse_finish BEFORE UPDATE ON outbox.operator_action
		    FOR EACH ROW EXECUTE FUNCTION public.refuse_finish()`); err != nil {
		t.Fatal(err)
	}
	f := &outboxv1.AggregateFilter{Stream: "orders"}
	_, err := r.Admin.BulkSkip(ctx, &outboxv1.BulkSkipRequest{Filter: f, Reason: "r"})
	wantCode(t, err, codes.Unavailable, "")
	_, err = r.Admin.BulkRetry(ctx, &outboxv1.BulkRetryRequest{Filter: f})
	wantCode(t, err, codes.Unavailable, "")
	if n := countWhere(t, pool, "outbox.operator_action", "finished_at IS NULL"); n != 2 {
		t.Fatalf("%d unfinished actions on record, want the 2 started", n)
	}
}

// GetLag gives each stream its own idle relays: a relay connected for
// beta alone, idle while beta's work waits, is beta's and not alpha's,
// though alpha comes first. Kills L08 (every stream given the first
// stream's idle relays).
func TestGetLagIdleRelaysArePerStream(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	setting(t, pool, "idle_relay_after = '1 millisecond'")
	emit(t, pool, "alpha", "a", 1)
	emit(t, pool, "beta", "b", 1)
	waitState(t, pool, "a", "ready")
	waitState(t, pool, "b", "ready")
	// Another replica's relay, as that replica records it: connected a
	// while ago, refreshed now, holding nothing.
	if _, err := pool.Exec(ctx, `
		INSERT INTO outbox.relay_session (session_id, relay_id, peer, replica_id, streams, max_in_flight, in_flight, connected_at, seen_at)
		VALUES (gen_random_uuid(), 'beta-only', '10.0.0.1:1', 'other-replica', '{beta}', 8, 0, now() - interval '1 hour', clock_timestamp())`); err != nil {
		t.Fatal(err)
	}
	lag, err := r.Admin.GetLag(ctx, &outboxv1.GetLagRequest{})
	if err != nil {
		t.Fatal(err)
	}
	idle := map[string]int64{}
	for _, l := range lag.GetStreams() {
		idle[l.GetStream()] = l.GetIdleRelays()
	}
	if len(idle) != 2 || idle["alpha"] != 0 || idle["beta"] != 1 {
		t.Fatalf("idle relays by stream: %v; want alpha 0, beta 1", idle)
	}
}

// GetLag reports its streams in name order, the quiet ones (nothing
// pending, nothing delivered in the last minute) among the others: aaa,
// all delivered and its delivery counts gone, comes before zzz, which has
// an event pending. Kills L02 (the quiet streams appended unsorted).
func TestGetLagListsStreamsInNameOrder(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	emit(t, pool, "aaa", "a", 1)
	publishSome(t, ctx, r, "aaa", 1)
	if _, err := pool.Exec(ctx, `DELETE FROM outbox.delivered_count`); err != nil {
		t.Fatal(err)
	}
	emit(t, pool, "zzz", "z", 1)
	waitState(t, pool, "z", "ready")
	lag, err := r.Admin.GetLag(ctx, &outboxv1.GetLagRequest{})
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, l := range lag.GetStreams() {
		names = append(names, l.GetStream())
	}
	if !slices.Equal(names, []string{"aaa", "zzz"}) {
		t.Fatalf("GetLag streams %v, want [aaa zzz]", names)
	}
}
