package multisource_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/auth"
	"github.com/outboxd/outboxd/internal/servertest"
	"github.com/outboxd/outboxd/internal/testdb"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// twoSources runs a replica with the sources default and orders, each a
// database of its own on the local cluster. The test databases are clones
// of one template, so orders is given a lease key of its own, as `outboxd
// migrate` gives every database.
func twoSources(t *testing.T, opts servertest.Options) (*servertest.Replica, string, string) {
	t.Helper()
	def, orders := testdb.New(t), testdb.New(t)
	if _, err := testdb.NewPoolURL(t, orders).Exec(t.Context(), `UPDATE outbox.lease_key
		SET key = decode(replace(gen_random_uuid()::text || gen_random_uuid()::text, '-', ''), 'hex')`); err != nil {
		t.Fatal(err)
	}
	opts.Sources = map[string]string{"orders": orders}
	return servertest.Start(t, def, opts), def, orders
}

func emit(t *testing.T, pool *pgxpool.Pool, stream, key string) string {
	t.Helper()
	var id string
	if err := pool.QueryRow(t.Context(), `SELECT event_id::text FROM outbox.emit($1, $2, 'T', '{}')`, stream, key).Scan(&id); err != nil {
		t.Fatal(err)
	}
	return id
}

func subscribe(t *testing.T, relay outboxv1.RelayServiceClient, streams ...string) outboxv1.RelayService_SubscribeClient {
	t.Helper()
	ctx, cancel := context.WithCancel(t.Context())
	t.Cleanup(cancel)
	st, err := relay.Subscribe(ctx, &outboxv1.SubscribeRequest{RelayId: "t", Streams: streams, MaxInFlight: 10})
	if err != nil {
		t.Fatal(err)
	}
	return st
}

func recv(t *testing.T, st outboxv1.RelayService_SubscribeClient) *outboxv1.SubscribeResponse {
	t.Helper()
	d, err := st.Recv()
	if err != nil {
		t.Fatalf("receiving a delivery: %v", err)
	}
	return d
}

func published(t *testing.T, pool *pgxpool.Pool, id string) bool {
	t.Helper()
	var ok bool
	if err := pool.QueryRow(t.Context(), `SELECT published_at IS NOT NULL FROM outbox.event WHERE event_id = $1`, id).Scan(&ok); err != nil {
		t.Fatal(err)
	}
	return ok
}

// TestStreamsOfTwoSources: the same stream name in two source databases is
// two streams; a Subscribe stream takes one source's; each delivery says
// its source and its token binds to it, so one Ack batch with deliveries of
// both sources, sent to another replica, marks each event in its own
// database; and a token moved to the other source's prefix is refused.
func TestStreamsOfTwoSources(t *testing.T) {
	t.Parallel()
	a, def, orders := twoSources(t, servertest.Options{})
	b := servertest.Start(t, def, servertest.Options{Sources: map[string]string{"orders": orders}})
	defPool, ordersPool := a.Pool, a.Pools["orders"]
	defID := emit(t, defPool, "sales_order", "1")
	ordersID := emit(t, ordersPool, "sales_order", "1")
	ordersID2 := emit(t, ordersPool, "sales_order", "2")

	dd := recv(t, subscribe(t, a.Relay, "sales_order"))
	ost := subscribe(t, a.Relay, "orders/sales_order")
	od, od2 := recv(t, ost), recv(t, ost)
	if od.GetEvent().GetEventId() != ordersID {
		od, od2 = od2, od
	}
	if dd.GetEvent().GetEventId() != defID || dd.GetEvent().GetSource() != "" {
		t.Errorf("bare stream delivered %s of source %q; want %s of default (source empty)", dd.GetEvent().GetEventId(), dd.GetEvent().GetSource(), defID)
	}
	if od.GetEvent().GetEventId() != ordersID || od.GetEvent().GetSource() != "orders" || od.GetEvent().GetStream() != "sales_order" {
		t.Errorf("orders/sales_order delivered %s of source %q stream %q; want %s of orders, stream sales_order",
			od.GetEvent().GetEventId(), od.GetEvent().GetSource(), od.GetEvent().GetStream(), ordersID)
	}
	if !strings.HasPrefix(od.GetLeaseToken(), "orders.") || strings.Contains(dd.GetLeaseToken(), ".") {
		t.Errorf("tokens %q (orders) and %q (default): want orders' prefixed, default's as a single-source server makes it", od.GetLeaseToken(), dd.GetLeaseToken())
	}

	// The orders token under default's spelling: default's engine cannot
	// verify it (another database's key), so nothing changes.
	moved, err := b.Relay.Ack(t.Context(), &outboxv1.AckRequest{Acks: []*outboxv1.AckItem{
		{EventId: ordersID, LeaseToken: strings.TrimPrefix(od.GetLeaseToken(), "orders.")}}})
	if err != nil {
		t.Fatal(err)
	}
	if st := moved.GetResults()[0].GetStatus(); st != outboxv1.AckStatus_ACK_STATUS_INVALID {
		t.Errorf("orders' token without its source: %v; want INVALID", st)
	}

	res, err := b.Relay.Ack(t.Context(), &outboxv1.AckRequest{Acks: []*outboxv1.AckItem{
		{EventId: ordersID, LeaseToken: od.GetLeaseToken()},
		{EventId: defID, LeaseToken: dd.GetLeaseToken()},
		{EventId: ordersID2, LeaseToken: od2.GetLeaseToken()},
	}})
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range res.GetResults() {
		if r.GetStatus() != outboxv1.AckStatus_ACK_STATUS_PUBLISHED {
			t.Errorf("ack %d (%s): %v %s; want PUBLISHED", i, r.GetEventId(), r.GetStatus(), r.GetMessage())
		}
	}
	for i, want := range []string{ordersID, defID, ordersID2} {
		if got := res.GetResults()[i].GetEventId(); got != want {
			t.Errorf("result %d is of %s; want %s (request order)", i, got, want)
		}
	}
	if !published(t, ordersPool, ordersID) || !published(t, ordersPool, ordersID2) || !published(t, defPool, defID) {
		t.Error("an acked event is not published in its own database")
	}

	// Admin calls go to the source their stream names: aggregate 2 exists
	// in orders only.
	if _, err := b.Admin.GetAggregate(t.Context(), &outboxv1.GetAggregateRequest{Stream: "orders/sales_order", AggregateKey: "2"}); err != nil {
		t.Errorf("GetAggregate orders/sales_order 2: %v", err)
	}
	if _, err := b.Admin.GetAggregate(t.Context(), &outboxv1.GetAggregateRequest{Stream: "sales_order", AggregateKey: "2"}); status.Code(err) != codes.NotFound {
		t.Errorf("GetAggregate sales_order 2 (of default): %v; want NOT_FOUND", err)
	}
}

// TestSubscriptionsNameOneSource: a subscription that spans sources, or
// names a source the server does not serve, is refused with
// INVALID_ARGUMENT naming the field, in the message and in its details; "orders/*" takes every stream of
// orders and nothing of default.
func TestSubscriptionsNameOneSource(t *testing.T) {
	t.Parallel()
	r, _, _ := twoSources(t, servertest.Options{})
	for _, tc := range []struct {
		streams, exclude []string
		want             string
	}{
		{[]string{"*/payments"}, nil, "streams[0]"},
		{[]string{"orders/a", "b"}, nil, "streams[1]"},
		{[]string{"orders/a"}, []string{"b"}, "exclude_streams[0]"},
		{[]string{"orders/*", "orders/a"}, nil, "streams[0]"},
		{[]string{"shipping/a"}, nil, "no source named"},
	} {
		st, err := r.Relay.Subscribe(t.Context(), &outboxv1.SubscribeRequest{RelayId: "t", Streams: tc.streams,
			ExcludeStreams: tc.exclude, MaxInFlight: 1})
		if err == nil {
			_, err = st.Recv()
		}
		if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Subscribe(%v, exclude %v): %v; want INVALID_ARGUMENT naming %s", tc.streams, tc.exclude, err, tc.want)
		}
		if len(status.Convert(err).Details()) == 0 {
			t.Errorf("Subscribe(%v, exclude %v): %v; want the field in BadRequest details", tc.streams, tc.exclude, err)
		}
	}

	emit(t, r.Pool, "billing", "1")
	id := emit(t, r.Pools["orders"], "billing", "1")
	d := recv(t, subscribe(t, r.Relay, "orders/*"))
	if d.GetEvent().GetEventId() != id || d.GetEvent().GetSource() != "orders" {
		t.Errorf("orders/* delivered %s of %q; want %s of orders", d.GetEvent().GetEventId(), d.GetEvent().GetSource(), id)
	}
}

// TestTokenOfAnUnknownSource: a lease token bound to a source this replica
// does not serve is refused clearly, and nothing changes.
func TestTokenOfAnUnknownSource(t *testing.T) {
	t.Parallel()
	r, id, d, foreign := leasedWithShippingToken(t)

	got, nackErr, extendErr := leaseCallsWith(t, r, id, foreign)
	if got.GetStatus() != outboxv1.AckStatus_ACK_STATUS_INVALID || !strings.Contains(got.GetMessage(), `source "shipping"`) {
		t.Errorf("Ack with a token of source shipping: %v %q; want INVALID naming the source", got.GetStatus(), got.GetMessage())
	}
	if status.Code(nackErr) != codes.FailedPrecondition || !strings.Contains(nackErr.Error(), `source "shipping"`) {
		t.Errorf("Nack with a token of source shipping: %v; want FAILED_PRECONDITION naming the source", nackErr)
	}
	if status.Code(extendErr) != codes.FailedPrecondition {
		t.Errorf("ExtendLease with a token of source shipping: %v; want FAILED_PRECONDITION", extendErr)
	}
	if published(t, r.Pools["orders"], id) {
		t.Error("an ack with a token of an unknown source published the event")
	}
	// The genuine token still works, for Nack and ExtendLease too.
	if _, err := r.Relay.ExtendLease(t.Context(), &outboxv1.ExtendLeaseRequest{EventId: id, LeaseToken: d.GetLeaseToken(), Ttl: durationpb.New(time.Minute)}); err != nil {
		t.Errorf("ExtendLease with orders' token: %v", err)
	}
	if _, err := r.Relay.Nack(t.Context(), &outboxv1.NackRequest{EventId: id, LeaseToken: d.GetLeaseToken(), Error: "broker down"}); err != nil {
		t.Errorf("Nack with orders' token: %v", err)
	}
}

// leasedWithShippingToken runs two sources, leases an event of orders and
// returns it with its delivery and its lease token rebound to source
// shipping, which the replica does not serve.
func leasedWithShippingToken(t *testing.T) (r *servertest.Replica, id string, d *outboxv1.SubscribeResponse, token string) {
	t.Helper()
	r, _, _ = twoSources(t, servertest.Options{})
	id = emit(t, r.Pools["orders"], "sales_order", "1")
	d = recv(t, subscribe(t, r.Relay, "orders/sales_order"))
	return r, id, d, "shipping." + strings.TrimPrefix(d.GetLeaseToken(), "orders.")
}

// leaseCallsWith acks, nacks and extends the lease of event id with token,
// and returns the ack's result and the Nack's and ExtendLease's errors.
func leaseCallsWith(t *testing.T, r *servertest.Replica, id, token string) (ack *outboxv1.AckResult, nackErr, extendErr error) {
	t.Helper()
	res, err := r.Relay.Ack(t.Context(), &outboxv1.AckRequest{Acks: []*outboxv1.AckItem{{EventId: id, LeaseToken: token}}})
	if err != nil {
		t.Fatal(err)
	}
	_, nackErr = r.Relay.Nack(t.Context(), &outboxv1.NackRequest{EventId: id, LeaseToken: token, Error: "x"})
	_, extendErr = r.Relay.ExtendLease(t.Context(), &outboxv1.ExtendLeaseRequest{EventId: id, LeaseToken: token, Ttl: durationpb.New(time.Minute)})
	return res.GetResults()[0], nackErr, extendErr
}

// A source configured but not served yet (its database did not answer
// when serve started or reloaded: app.Replica.SetSourcePending) is refused
// as unavailable for now, which relays retry, not as unknown: a Subscribe
// for it is UNAVAILABLE, an Ack of its token RETRY (another replica may
// serve it already), Nack and ExtendLease UNAVAILABLE. Once it is no longer
// configured, it is unknown again.
func TestAPendingSourceIsUnavailableNotUnknown(t *testing.T) {
	t.Parallel()
	r, id, _, pendingToken := leasedWithShippingToken(t)
	if err := r.App.SetSourcePending("shipping", "connection refused"); err != nil {
		t.Fatal(err)
	}

	subscribeErr := func() error {
		ctx, cancel := context.WithCancel(t.Context())
		defer cancel()
		st, err := r.Relay.Subscribe(ctx, &outboxv1.SubscribeRequest{RelayId: "t", Streams: []string{"shipping/sales_order"}, MaxInFlight: 1})
		if err == nil {
			_, err = st.Recv()
		}
		return err
	}
	const pending = `source "shipping" is configured on this server but not served yet`
	if err := subscribeErr(); status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), pending) {
		t.Errorf("Subscribe to pending shipping: %v; want UNAVAILABLE saying it is not served yet", err)
	}
	got, nackErr, extendErr := leaseCallsWith(t, r, id, pendingToken)
	if got.GetStatus() != outboxv1.AckStatus_ACK_STATUS_RETRY || !strings.Contains(got.GetMessage(), pending) {
		t.Errorf("Ack with a token of pending shipping: %v %q; want RETRY saying it is not served yet", got.GetStatus(), got.GetMessage())
	}
	if status.Code(nackErr) != codes.Unavailable || !strings.Contains(nackErr.Error(), pending) {
		t.Errorf("Nack with a token of pending shipping: %v; want UNAVAILABLE", nackErr)
	}
	if status.Code(extendErr) != codes.Unavailable {
		t.Errorf("ExtendLease with a token of pending shipping: %v; want UNAVAILABLE", extendErr)
	}
	if published(t, r.Pools["orders"], id) {
		t.Error("an ack with a token of a pending source published the event")
	}

	r.App.ClearSourcePending("shipping")
	if err := subscribeErr(); status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), `no source named "shipping"`) {
		t.Errorf("Subscribe to shipping, no longer configured: %v; want INVALID_ARGUMENT naming no such source", err)
	}
}

// dbName is the database name of a test database URL.
func dbName(url string) string {
	name := url[strings.LastIndex(url, "/")+1:]
	if i := strings.IndexByte(name, '?'); i >= 0 {
		name = name[:i]
	}
	return name
}

// refuseConnections makes the database at url refuse connections and ends
// the ones open, so that its source is down as if its server were (see
// testdb.RefuseConnections); it returns the admin pool, for
// testdb.TerminateBackends in a wait, and the function that lets
// connections in again.
func refuseConnections(t *testing.T, url string) (admin *pgxpool.Pool, allow func()) {
	t.Helper()
	admin = testdb.NewPoolURL(t, testdb.ServerURL())
	return admin, testdb.RefuseConnections(t, admin, dbName(url))
}

// waitFor polls cond until it holds (a hang guard, not a timed assertion).
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("still waiting for %s after 60s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestSourceDownDeliversTheOthers: with the orders database refusing
// connections, the replica stays ready (naming orders as not ready),
// GetLag reports default's streams and says orders is down, and default's
// events are delivered and acked; orders' event, committed before, waits
// and is delivered once its database is back.
func TestSourceDownDeliversTheOthers(t *testing.T) {
	t.Parallel()
	r, _, ordersURL := twoSources(t, servertest.Options{})
	waiting := emit(t, r.Pools["orders"], "sales_order", "1")
	admin, allow := refuseConnections(t, ordersURL)
	waitFor(t, "the replica to report orders not ready", func() bool {
		testdb.TerminateBackends(t, admin, dbName(ordersURL)) // one that slipped in
		rd := r.App.Readiness()
		return strings.Contains(rd.Reason, "source orders")
	})
	if rd := r.App.Readiness(); !rd.Ready {
		t.Errorf("one source down made the replica not ready: %q", rd.Reason)
	}

	lag, err := r.Admin.GetLag(t.Context(), &outboxv1.GetLagRequest{})
	if err != nil {
		t.Fatalf("GetLag with orders down: %v", err)
	}
	health := map[string]*outboxv1.SourceHealth{}
	for _, s := range lag.GetSources() {
		health[s.GetName()] = s
	}
	if h := health["orders"]; h == nil || h.GetReady() || h.GetReason() == "" {
		t.Errorf("GetLag says orders is %v; want not ready, with a reason", h)
	}
	if h := health["default"]; h == nil || !h.GetReady() {
		t.Errorf("GetLag says default is %v; want ready", h)
	}

	id := emit(t, r.Pool, "sales_order", "2")
	d := recv(t, subscribe(t, r.Relay, "sales_order"))
	if d.GetEvent().GetEventId() != id {
		t.Fatalf("default delivered %s; want %s", d.GetEvent().GetEventId(), id)
	}
	res, err := r.Relay.Ack(t.Context(), &outboxv1.AckRequest{Acks: []*outboxv1.AckItem{{EventId: id, LeaseToken: d.GetLeaseToken()}}})
	if err != nil || res.GetResults()[0].GetStatus() != outboxv1.AckStatus_ACK_STATUS_PUBLISHED {
		t.Fatalf("acking default's event with orders down: %v, %v", res, err)
	}

	allow()
	waitFor(t, "the replica to report orders ready", func() bool { return r.App.Readiness().Reason == "" })
	var od *outboxv1.SubscribeResponse
	waitFor(t, "a subscription to orders", func() bool {
		ctx, cancel := context.WithCancel(t.Context())
		st, err := r.Relay.Subscribe(ctx, &outboxv1.SubscribeRequest{RelayId: "t", Streams: []string{"orders/sales_order"}, MaxInFlight: 1})
		if err == nil {
			if od, err = st.Recv(); err == nil {
				t.Cleanup(cancel)
				return true
			}
		}
		cancel()
		return false
	})
	if od.GetEvent().GetEventId() != waiting {
		t.Errorf("orders delivered %s once back; want %s, committed while it was up", od.GetEvent().GetEventId(), waiting)
	}
	res, err = r.Relay.Ack(t.Context(), &outboxv1.AckRequest{Acks: []*outboxv1.AckItem{{EventId: waiting, LeaseToken: od.GetLeaseToken()}}})
	if err != nil || res.GetResults()[0].GetStatus() != outboxv1.AckStatus_ACK_STATUS_PUBLISHED {
		t.Fatalf("acking orders' event once back: %v, %v", res, err)
	}
}

// TestTokenScopedToOneSource: a token scoped "orders/*" relays orders'
// streams and is refused on default's, for Subscribe and for an Ack of a
// default delivery; a viewer scoped "orders/*" sees only orders' lag.
func TestTokenScopedToOneSource(t *testing.T) {
	t.Parallel()
	const (
		allToken    = "all-relay-token-0123456789"
		ordersToken = "orders-relay-token-0123456789"
		viewerToken = "orders-viewer-token-0123456789"
	)
	r, dial := twoSourcesWithTokens(t, "all relay "+allToken+"\n"+
		"orders relay "+ordersToken+" streams=orders/*\n"+
		"viewer viewer "+viewerToken+" streams=orders/*\n")
	all := outboxv1.NewRelayServiceClient(dial(allToken))
	scoped := outboxv1.NewRelayServiceClient(dial(ordersToken))

	defID := emit(t, r.Pool, "sales_order", "1")
	ordersID := emit(t, r.Pools["orders"], "sales_order", "1")
	for _, streams := range [][]string{{"sales_order"}, {"default/sales_order"}, nil} {
		st, err := scoped.Subscribe(t.Context(), &outboxv1.SubscribeRequest{RelayId: "t", Streams: streams, MaxInFlight: 1})
		if err == nil {
			_, err = st.Recv()
		}
		if status.Code(err) != codes.PermissionDenied {
			t.Errorf("orders/* token subscribing to %v: %v; want PERMISSION_DENIED", streams, err)
		}
	}
	// A source that does not exist: the error names the sources the token
	// may see, not the others.
	st, err := scoped.Subscribe(t.Context(), &outboxv1.SubscribeRequest{RelayId: "t", Streams: []string{"nosuch/x"}, MaxInFlight: 1})
	if err == nil {
		_, err = st.Recv()
	}
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "serves orders to this token") || strings.Contains(err.Error(), "default") {
		t.Errorf("orders/* token subscribing to nosuch/x: %v; want INVALID_ARGUMENT naming orders only", err)
	}
	od := recv(t, subscribe(t, scoped, "orders/sales_order"))
	if od.GetEvent().GetEventId() != ordersID {
		t.Errorf("orders/* token got %s; want %s", od.GetEvent().GetEventId(), ordersID)
	}
	dd := recv(t, subscribe(t, all, "sales_order"))
	_, err = scoped.Ack(t.Context(), &outboxv1.AckRequest{Acks: []*outboxv1.AckItem{
		{EventId: ordersID, LeaseToken: od.GetLeaseToken()}, {EventId: defID, LeaseToken: dd.GetLeaseToken()}}})
	if status.Code(err) != codes.PermissionDenied {
		t.Errorf("orders/* token acking a default delivery: %v; want PERMISSION_DENIED", err)
	}
	if published(t, r.Pool, defID) || published(t, r.Pools["orders"], ordersID) {
		t.Error("a refused Ack changed something")
	}
	res, err := scoped.Ack(t.Context(), &outboxv1.AckRequest{Acks: []*outboxv1.AckItem{{EventId: ordersID, LeaseToken: od.GetLeaseToken()}}})
	if err != nil || res.GetResults()[0].GetStatus() != outboxv1.AckStatus_ACK_STATUS_PUBLISHED {
		t.Errorf("orders/* token acking its own delivery: %v, %v", res, err)
	}
	if res, err := all.Ack(t.Context(), &outboxv1.AckRequest{Acks: []*outboxv1.AckItem{{EventId: defID, LeaseToken: dd.GetLeaseToken()}}}); err != nil ||
		res.GetResults()[0].GetStatus() != outboxv1.AckStatus_ACK_STATUS_PUBLISHED {
		t.Errorf("unrestricted token acking default's delivery: %v, %v", res, err)
	}

	lag, err := outboxv1.NewAdminServiceClient(dial(viewerToken)).GetLag(t.Context(), &outboxv1.GetLagRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if len(lag.GetStreams()) != 1 || lag.GetStreams()[0].GetSource() != "orders" || len(lag.GetSources()) != 1 {
		t.Errorf("orders/* viewer sees lag %v, sources %v; want orders' one stream only", lag.GetStreams(), lag.GetSources())
	}
}

// TestBatchedDeliveriesNameTheirSource: to a relay that accepts batches, a
// source's deliveries go several to a message (SubscribeResponse.deliveries);
// each of them says its source and carries a token bound to it, so their
// acks mark the events in that source's database.
func TestBatchedDeliveriesNameTheirSource(t *testing.T) {
	t.Parallel()
	r, _, _ := twoSources(t, servertest.Options{})
	ordersPool := r.Pools["orders"]
	ids := map[string]bool{}
	for _, key := range []string{"1", "2", "3"} {
		ids[emit(t, ordersPool, "sales_order", key)] = true
	}
	// Ready before anyone subscribes, so the first claim leases all three
	// and the session sends them in one message.
	waitFor(t, "discovery to make the three aggregates ready", func() bool {
		var n int
		if err := ordersPool.QueryRow(t.Context(), `SELECT count(*) FROM outbox.delivery WHERE state = 'ready'`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n == 3
	})
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	st, err := r.Relay.Subscribe(ctx, &outboxv1.SubscribeRequest{
		RelayId: "t", Streams: []string{"orders/sales_order"}, MaxInFlight: 10, AcceptBatches: true})
	if err != nil {
		t.Fatal(err)
	}
	msg := recv(t, st)
	if len(msg.GetDeliveries()) != 3 {
		t.Fatalf("first message carries %d batched deliveries (event %q); want all 3 in one", len(msg.GetDeliveries()), msg.GetEvent().GetEventId())
	}
	var acks []*outboxv1.AckItem
	for _, d := range msg.GetDeliveries() {
		if d.GetEvent().GetSource() != "orders" || !strings.HasPrefix(d.GetLeaseToken(), "orders.") {
			t.Errorf("batched delivery %s: source %q, token %q; want source orders and a token bound to it",
				d.GetEvent().GetEventId(), d.GetEvent().GetSource(), d.GetLeaseToken())
		}
		acks = append(acks, &outboxv1.AckItem{EventId: d.GetEvent().GetEventId(), LeaseToken: d.GetLeaseToken()})
	}
	res, err := r.Relay.Ack(t.Context(), &outboxv1.AckRequest{Acks: acks})
	if err != nil {
		t.Fatal(err)
	}
	for _, x := range res.GetResults() {
		if x.GetStatus() != outboxv1.AckStatus_ACK_STATUS_PUBLISHED {
			t.Errorf("ack of %s: %v %s; want PUBLISHED", x.GetEventId(), x.GetStatus(), x.GetMessage())
		}
	}
	for id := range ids {
		if !published(t, ordersPool, id) {
			t.Errorf("event %s of orders is not published after its ack", id)
		}
	}
}

// twoSourcesWithTokens is twoSources behind the tokens of a token file
// (auth's format), and dial connects to it with one of them.
func twoSourcesWithTokens(t *testing.T, tokens string) (*servertest.Replica, func(token string) *grpc.ClientConn) {
	t.Helper()
	file := filepath.Join(t.TempDir(), "tokens")
	if err := os.WriteFile(file, []byte(tokens), 0o600); err != nil {
		t.Fatal(err)
	}
	a, err := auth.New(auth.Config{File: file, Logger: servertest.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	r, _, _ := twoSources(t, servertest.Options{Authenticator: a})
	dial := func(token string) *grpc.ClientConn {
		conn, err := grpc.NewClient(r.Addr, grpc.WithTransportCredentials(insecure.NewCredentials()), auth.WithBearerToken(token, true))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Close() })
		return conn
	}
	return r, dial
}

// TestStrandedAuditedAtOfSources: the stranded counts of several sources
// are as old as the oldest source's audit, and unknown (unset) while one
// source has none: here default's first audit is held by a lock on a table
// only it reads.
func TestStrandedAuditedAtOfSources(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	r, def, _ := twoSources(t, servertest.Options{})
	own := func(name string) *outboxv1.GetLagResponse {
		t.Helper()
		lag, err := r.App.Source(name).AdminServer().GetLag(ctx, &outboxv1.GetLagRequest{})
		if err != nil {
			t.Fatal(err)
		}
		return lag
	}
	waitFor(t, "orders' first stranded audit", func() bool { return own("orders").GetStrandedAuditedAt() != nil })
	ordersAt := own("orders").GetStrandedAuditedAt().AsTime()

	tx, err := testdb.NewPoolURL(t, def).Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `LOCK TABLE outbox.late_event IN ACCESS EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	lag, err := r.Admin.GetLag(ctx, &outboxv1.GetLagRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if at := lag.GetStrandedAuditedAt(); at != nil {
		t.Fatalf("stranded counts as of %v while default's only audit is blocked; want unset", at.AsTime())
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "default's first stranded audit", func() bool { return own("default").GetStrandedAuditedAt() != nil })
	if defaultAt := own("default").GetStrandedAuditedAt().AsTime(); !defaultAt.After(ordersAt) {
		t.Fatalf("default audited at %v, not after orders (%v): the test cannot tell the oldest", defaultAt, ordersAt)
	}
	lag, err = r.Admin.GetLag(ctx, &outboxv1.GetLagRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if at := lag.GetStrandedAuditedAt(); at == nil || !at.AsTime().Equal(ordersAt) {
		t.Fatalf("stranded counts of both sources as of %v, want the oldest audit's %v", at.AsTime(), ordersAt)
	}
}

// TestXminHorizonOfSources: GetLag over several sources names the oldest
// xmin horizon hold among theirs, and whose cluster it is.
func TestXminHorizonOfSources(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	r, _, orders := twoSources(t, servertest.Options{})
	const n = 300
	testdb.HoldXminHorizon(t, ctx, orders, "report-"+uuid.NewString()[:8], false, n)
	lag, err := r.Admin.GetLag(ctx, &outboxv1.GetLagRequest{})
	if err != nil {
		t.Fatal(err)
	}
	// Both sources are databases of one cluster: either may name it.
	if h := lag.GetXminHorizon(); h.GetAgeTransactions() < n || h.GetHolder() == "" ||
		(h.GetSource() != "default" && h.GetSource() != "orders") {
		t.Fatalf("xmin_horizon %v while a snapshot is held %d transactions back; want it with its source", h, n)
	}
}

// An Ack of no items, or of more than one request may carry, is refused
// by the router itself (INVALID_ARGUMENT, in the engines' words), not
// handed to an engine with the caller's token unnarrowed to its source.
func TestAckOutsideItsItemLimitIsRefusedByTheRouter(t *testing.T) {
	t.Parallel()
	r, _, _ := twoSources(t, servertest.Options{})
	for _, n := range []int{0, 1001} {
		acks := make([]*outboxv1.AckItem, n)
		for i := range acks {
			acks[i] = &outboxv1.AckItem{EventId: sharedID, LeaseToken: "orders:x"}
		}
		_, err := r.Relay.Ack(t.Context(), &outboxv1.AckRequest{Acks: acks})
		want := fmt.Sprintf("invalid request: acks: must hold 1 to 1000 items, got %d", n)
		if status.Code(err) != codes.InvalidArgument || status.Convert(err).Message() != want {
			t.Errorf("Ack of %d items: %v; want INVALID_ARGUMENT %q", n, err, want)
		}
	}
}
