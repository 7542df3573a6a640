package multisource_test

import (
	"errors"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/servertest"
	"github.com/outboxd/outboxd/internal/testdb"
)

// sharedID is an event id written to both sources: event ids are unique
// per source only.
const sharedID = "0f8fad5b-d9cb-469f-a165-70867728950e"

func emitID(t *testing.T, pool *pgxpool.Pool, stream, key, id string) {
	t.Helper()
	if _, err := pool.Exec(t.Context(), `SELECT outbox.emit($1, $2, 'T', '{}', event_id => $3)`, stream, key, id); err != nil {
		t.Fatal(err)
	}
}

func eventState(t *testing.T, pool *pgxpool.Pool, id string) string {
	t.Helper()
	var state string
	if err := pool.QueryRow(t.Context(), `SELECT CASE WHEN e.published_at IS NOT NULL THEN 'published'
		WHEN EXISTS (SELECT 1 FROM outbox.skipped_event s WHERE s.event_id = e.event_id) THEN 'skipped' ELSE 'pending' END
		FROM outbox.event e WHERE e.event_id = $1`, id).Scan(&state); err != nil {
		t.Fatal(err)
	}
	return state
}

// publishAll delivers and acks n events of the subscription's streams.
func publishAll(t *testing.T, relay outboxv1.RelayServiceClient, n int, streams ...string) {
	t.Helper()
	st := subscribe(t, relay, streams...)
	for range n {
		d := recv(t, st)
		res, err := relay.Ack(t.Context(), &outboxv1.AckRequest{Acks: []*outboxv1.AckItem{{EventId: d.GetEvent().GetEventId(), LeaseToken: d.GetLeaseToken()}}})
		if err != nil || res.GetResults()[0].GetStatus() != outboxv1.AckStatus_ACK_STATUS_PUBLISHED {
			t.Fatalf("ack of %s: %v, %v", d.GetEvent().GetEventId(), res, err)
		}
	}
}

// TestAdminByEventIDOfASource: an event id names an event of a source
// other than default as "source/event_id" (the sinks' message id), so
// SkipEvent, ListEvents and ListAttempts reach the right one of two events
// that share an id; answers name their source (Event.source, streams as
// "orders/..."), and default's are as a single source gives them.
func TestAdminByEventIDOfASource(t *testing.T) {
	t.Parallel()
	r, _, _ := twoSources(t, servertest.Options{})
	def, orders := r.Pool, r.Pools["orders"]
	emitID(t, def, "sales_order", "1", sharedID)
	emitID(t, orders, "sales_order", "1", sharedID)
	const ordersOnly = "7c9e6679-7425-40de-944b-e07fc1f90ae7"
	emitID(t, orders, "sales_order", "2", ordersOnly)

	list := func(id string) *outboxv1.EventInfo {
		t.Helper()
		res, err := r.Admin.ListEvents(t.Context(), &outboxv1.ListEventsRequest{EventId: id})
		if err != nil || len(res.GetEvents()) != 1 {
			t.Fatalf("ListEvents(%s) = %v, %v; want the event", id, res, err)
		}
		return res.GetEvents()[0]
	}
	if e := list("orders/" + sharedID).GetEvent(); e.GetEventId() != sharedID || e.GetSource() != "orders" || e.GetStream() != "sales_order" {
		t.Errorf("ListEvents(orders/%s) = %v; want orders' event naming its source", sharedID, e)
	}
	if e := list(sharedID).GetEvent(); e.GetSource() != "" {
		t.Errorf("ListEvents(%s) = %v; want default's, with no source", sharedID, e)
	}

	if _, err := r.Admin.SkipEvent(t.Context(), &outboxv1.SkipEventRequest{EventId: "orders/" + sharedID, Reason: "poison"}); err != nil {
		t.Fatal(err)
	}
	if d, o := eventState(t, def, sharedID), eventState(t, orders, sharedID); d != "pending" || o != "skipped" {
		t.Errorf("after skipping orders/%s: default's is %s, orders' %s; want pending, skipped", sharedID, d, o)
	}
	if st := list("orders/" + sharedID).GetState(); st != outboxv1.EventState_EVENT_STATE_SKIPPED {
		t.Errorf("orders' event listed %v after its skip", st)
	}

	// The record of the skip, and the aggregate, name orders' stream as
	// requests address it.
	acts, err := r.Admin.ListOperatorActions(t.Context(), &outboxv1.ListOperatorActionsRequest{Stream: "orders/sales_order"})
	if err != nil || len(acts.GetActions()) != 1 || acts.GetActions()[0].GetStream() != "orders/sales_order" {
		t.Errorf("ListOperatorActions(orders/sales_order) = %v, %v; want the skip, of stream orders/sales_order", acts, err)
	}
	for _, c := range []struct{ stream, want string }{{"orders/sales_order", "orders/sales_order"}, {"sales_order", "sales_order"}} {
		agg, err := r.Admin.GetAggregate(t.Context(), &outboxv1.GetAggregateRequest{Stream: c.stream, AggregateKey: "1"})
		if err != nil || agg.GetAggregate().GetStream() != c.want {
			t.Errorf("GetAggregate(%s) = %v, %v; want stream %s", c.stream, agg, err, c.want)
		}
	}
	if _, err := r.Admin.ListAttempts(t.Context(), &outboxv1.ListAttemptsRequest{EventId: "orders/" + sharedID}); err != nil {
		t.Errorf("ListAttempts(orders/...): %v", err)
	}

	for _, c := range []struct {
		name string
		call func() error
		want string
	}{
		{"skip of an unknown source", func() error {
			_, err := r.Admin.SkipEvent(t.Context(), &outboxv1.SkipEventRequest{EventId: "shipping/" + sharedID, Reason: "x"})
			return err
		}, `event_id: no source named "shipping"; this server serves default, orders`},
		{"event id and stream of two sources", func() error {
			_, err := r.Admin.ListEvents(t.Context(), &outboxv1.ListEventsRequest{EventId: "orders/" + sharedID, Stream: "sales_order"})
			return err
		}, `is of source "orders", but stream names source "default"`},
		{"skip of a bare id only orders has", func() error {
			_, err := r.Admin.SkipEvent(t.Context(), &outboxv1.SkipEventRequest{EventId: ordersOnly, Reason: "x"})
			return err
		}, "in source default; an event of another source (orders) is named SOURCE/EVENT_ID"},
		{"skip of orders' again", func() error {
			_, err := r.Admin.SkipEvent(t.Context(), &outboxv1.SkipEventRequest{EventId: "orders/" + sharedID, Reason: "x"})
			return err
		}, "already skipped"},
	} {
		err := c.call()
		if !strings.Contains(status.Convert(err).Message(), c.want) {
			t.Errorf("%s: %v; want an error saying %q", c.name, err, c.want)
		}
	}
	if d := eventState(t, def, sharedID); d != "pending" {
		t.Errorf("default's event is %s; nothing was to skip it", d)
	}
}

// purgeAll runs a Purge and returns its messages.
func purgeAll(t *testing.T, admin outboxv1.AdminServiceClient, req *outboxv1.PurgeRequest) ([]*outboxv1.PurgeResponse, error) {
	t.Helper()
	req.PublishedBefore = timestamppb.New(time.Now().Add(time.Hour))
	st, err := admin.Purge(t.Context(), req)
	if err != nil {
		return nil, err
	}
	var out []*outboxv1.PurgeResponse
	for {
		m, err := st.Recv()
		if errors.Is(err, io.EOF) {
			return out, nil
		}
		if err != nil {
			return out, err
		}
		out = append(out, m)
	}
}

func countPublished(t *testing.T, pool *pgxpool.Pool) int64 {
	t.Helper()
	var n int64
	if err := pool.QueryRow(t.Context(), `SELECT count(*) FROM outbox.event WHERE published_at IS NOT NULL`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// TestPurgeAndSkipAcrossSources: Purge without a stream purges every source
// the token may purge, reporting each source and the sum; a token scoped
// to orders purges orders alone that way, and is refused default's stream
// and default's events (Purge, SkipEvent), with nothing deleted or
// skipped there. Counted in the tables.
func TestPurgeAndSkipAcrossSources(t *testing.T) {
	t.Parallel()
	const (
		relayToken  = "all-relay-token-0123456789"
		adminToken  = "all-admin-token-0123456789"
		ordersAdmin = "orders-admin-token-0123456789"
	)
	r, dial := twoSourcesWithTokens(t, "relay relay "+relayToken+"\nops admin "+adminToken+"\n"+
		"orders-ops admin "+ordersAdmin+" streams=orders/*\n")
	def, orders := r.Pool, r.Pools["orders"]
	relay := outboxv1.NewRelayServiceClient(dial(relayToken))
	for _, k := range []string{"1", "2"} {
		emit(t, def, "sales_order", k)
	}
	for _, k := range []string{"1", "2", "3"} {
		emit(t, orders, "sales_order", k)
	}
	publishAll(t, relay, 2, "sales_order")
	publishAll(t, relay, 3, "orders/sales_order")
	pendingDef := emit(t, def, "sales_order", "9")

	scoped := outboxv1.NewAdminServiceClient(dial(ordersAdmin))
	// Refused on default: its stream, its event.
	if _, err := purgeAll(t, scoped, &outboxv1.PurgeRequest{Stream: "sales_order"}); status.Code(err) != codes.PermissionDenied {
		t.Errorf("orders-scoped Purge of default's sales_order: %v; want PERMISSION_DENIED", err)
	}
	if _, err := scoped.SkipEvent(t.Context(), &outboxv1.SkipEventRequest{EventId: pendingDef, Reason: "x"}); status.Code(err) != codes.PermissionDenied {
		t.Errorf("orders-scoped SkipEvent of default's event: %v; want PERMISSION_DENIED", err)
	}
	if s := eventState(t, def, pendingDef); s != "pending" {
		t.Errorf("default's event is %s after a refused skip", s)
	}

	// Without a stream: orders alone, as a dry run first.
	msgs, err := purgeAll(t, scoped, &outboxv1.PurgeRequest{DryRun: true})
	if err != nil {
		t.Fatal(err)
	}
	final := msgs[len(msgs)-1]
	if !final.GetDone() || final.GetDeleted() != 3 || len(final.GetSources()) != 1 || final.GetSources()[0].GetSource() != "orders" {
		t.Errorf("orders-scoped dry run: final %v; want 3 of orders alone", final)
	}
	if d, o := countPublished(t, def), countPublished(t, orders); d != 2 || o != 3 {
		t.Fatalf("a dry run deleted: %d/%d published left, want 2/3", d, o)
	}
	if _, err := purgeAll(t, scoped, &outboxv1.PurgeRequest{}); err != nil {
		t.Fatal(err)
	}
	if d, o := countPublished(t, def), countPublished(t, orders); d != 2 || o != 0 {
		t.Errorf("after the orders-scoped purge: %d/%d published left (default/orders), want 2/0", d, o)
	}

	// An unrestricted token purges both, each reported apart.
	emit(t, orders, "sales_order", "4")
	publishAll(t, relay, 1, "orders/sales_order")
	msgs, err = purgeAll(t, outboxv1.NewAdminServiceClient(dial(adminToken)), &outboxv1.PurgeRequest{})
	if err != nil {
		t.Fatal(err)
	}
	final = msgs[len(msgs)-1]
	perSource := map[string]int64{}
	for _, s := range final.GetSources() {
		perSource[s.GetSource()] = s.GetDeleted()
	}
	if !final.GetDone() || final.GetSource() != "" || final.GetDeleted() != 3 || perSource[""] != 2 || perSource["orders"] != 1 || len(perSource) != 2 {
		t.Errorf("purge of both sources: final %v; want 3 deleted, 2 of default and 1 of orders", final)
	}
	for _, m := range msgs[:len(msgs)-1] {
		if m.GetDone() {
			t.Errorf("progress message %v is done before the end", m)
		}
	}
	if d, o := countPublished(t, def), countPublished(t, orders); d != 0 || o != 0 {
		t.Errorf("after the full purge: %d/%d published left, want none", d, o)
	}
	if s := eventState(t, def, pendingDef); s != "pending" {
		t.Errorf("the pending event is %s after purges", s)
	}
}

// TestPurgeFailingOnASourceSaysWhatTheSourcesBeforeItDid: a purge over
// every source that fails on one (its database refuses connections) names
// it, and says what the sources purged before it deleted (they stay
// purged), so the operator knows where the purge stopped.
func TestPurgeFailingOnASourceSaysWhatTheSourcesBeforeItDid(t *testing.T) {
	t.Parallel()
	r, _, ordersURL := twoSources(t, servertest.Options{})
	def := r.Pool
	for _, k := range []string{"1", "2"} {
		emit(t, def, "sales_order", k)
	}
	publishAll(t, r.Relay, 2, "sales_order")

	orders := testdb.NewPoolURL(t, ordersURL)
	var dbname string
	if err := orders.QueryRow(t.Context(), `SELECT current_database()`).Scan(&dbname); err != nil {
		t.Fatal(err)
	}
	orders.Close()
	admin := testdb.NewPoolURL(t, testdb.ServerURL())
	allow := testdb.RefuseConnections(t, admin, dbname)
	defer allow()
	testdb.TerminateBackends(t, admin, dbname)

	_, err := purgeAll(t, r.Admin, &outboxv1.PurgeRequest{})
	msg := status.Convert(err).Message()
	if err == nil || !strings.HasPrefix(msg, "source orders: ") || !strings.Contains(msg, "purged before it: source default, 2 deleted)") {
		t.Errorf("purge of both sources with orders down: %v; want it to name orders and say default's 2 were deleted", err)
	}
	if n := countPublished(t, def); n != 0 {
		t.Errorf("default keeps %d published events after its part of the purge; want 0", n)
	}
}
