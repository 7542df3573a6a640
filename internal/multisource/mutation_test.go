package multisource_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/servertest"
	"github.com/outboxd/outboxd/internal/testdb"
)

// Tests written against mutants of this package's routing that its other
// tests let through: each holds one promise of the package documentation.

// hangGuard is how long a test waits for an answer that is sure to come
// before it fails naming what never came: a guard against hanging until
// go test's -timeout, not a timed assertion.
const hangGuard = 60 * time.Second

// await receives what from ch, failing the test if it has not come within
// hangGuard.
func await[T any](t *testing.T, ch <-chan T, what string) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(hangGuard):
		t.Fatalf("still waiting for %s after %v", what, hangGuard)
	}
	var zero T
	return zero
}

// ackAnswer is the answer of an Ack sent by ackAsync.
type ackAnswer struct {
	res *outboxv1.AckResponse
	err error
}

// ackAsync sends req to relay from a goroutine of its own, so that the test
// can act on the databases while the Ack waits on them, and returns the
// channel its answer comes on (buffered: the goroutine never blocks on a
// test that has already failed, and t.Context's end stops the call).
func ackAsync(t *testing.T, relay outboxv1.RelayServiceClient, req *outboxv1.AckRequest) <-chan ackAnswer {
	done := make(chan ackAnswer, 1)
	go func() {
		res, err := relay.Ack(t.Context(), req)
		done <- ackAnswer{res, err}
	}()
	return done
}

// lockTable locks table in mode in pool's database, in a transaction of its
// own, held until the test ends or release is called.
func lockTable(t *testing.T, pool *pgxpool.Pool, table, mode string) (release func()) {
	t.Helper()
	ctx := context.WithoutCancel(t.Context())
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "LOCK TABLE "+pgx.Identifier(strings.Split(table, ".")).Sanitize()+" IN "+mode+" MODE"); err != nil {
		tx.Rollback(ctx)
		t.Fatal(err)
	}
	release = func() { tx.Rollback(ctx) }
	t.Cleanup(release)
	return release
}

// waitingBackend waits until a backend of the database at url waits on a
// lock running a statement that holds text, and returns its pid.
func waitingBackend(t *testing.T, url, text string) int32 {
	t.Helper()
	admin := testdb.NewPoolURL(t, testdb.ServerURL())
	var pid int32
	waitFor(t, "a statement holding "+text+" to wait on a lock", func() bool {
		err := admin.QueryRow(t.Context(), `SELECT pid FROM pg_stat_activity
			WHERE datname = $1 AND wait_event_type = 'Lock' AND strpos(query, $2) > 0 LIMIT 1`, dbName(url), text).Scan(&pid)
		if err != nil && !errors.Is(err, pgx.ErrNoRows) {
			t.Fatal(err)
		}
		return err == nil
	})
	return pid
}

// TestAckOfAFailingSourceAnswersOnlyItsOwnRetry: one Ack request with a
// delivery of orders and one of default, where orders' database fails the
// ack statement (cancelled while it waits on a lock): default's ack lands
// (PUBLISHED) and orders' alone is answered RETRY naming orders, so one
// source failing holds up no other's acks. Kills a Router that fails the
// whole request on any engine's error.
func TestAckOfAFailingSourceAnswersOnlyItsOwnRetry(t *testing.T) {
	t.Parallel()
	r, _, ordersURL := twoSources(t, servertest.Options{})
	defID := emit(t, r.Pool, "sales_order", "1")
	ordersID := emit(t, r.Pools["orders"], "sales_order", "1")
	dd := recv(t, subscribe(t, r.Relay, "sales_order"))
	od := recv(t, subscribe(t, r.Relay, "orders/sales_order"))
	lockTable(t, r.Pools["orders"], "outbox.event", "EXCLUSIVE")

	done := ackAsync(t, r.Relay, &outboxv1.AckRequest{Acks: []*outboxv1.AckItem{
		{EventId: ordersID, LeaseToken: od.GetLeaseToken()}, {EventId: defID, LeaseToken: dd.GetLeaseToken()}}})
	pid := waitingBackend(t, ordersURL, "outbox.ack(")
	if _, err := r.Pool.Exec(t.Context(), `SELECT pg_cancel_backend($1)`, pid); err != nil {
		t.Fatal(err)
	}
	a := await(t, done, "the Ack's answer once orders' ack was cancelled")
	if a.err != nil {
		t.Fatalf("an Ack of both sources with orders' ack failing: %v; want default's acked and orders' to retry", a.err)
	}
	// Checked before indexing: a panic would end every test of the binary.
	results := a.res.GetResults()
	if len(results) != 2 {
		t.Fatalf("an Ack of 2 items answered %d results: %v", len(results), results)
	}
	if got := results[0]; got.GetStatus() != outboxv1.AckStatus_ACK_STATUS_RETRY || !strings.Contains(got.GetMessage(), `source "orders"`) {
		t.Errorf("orders' failed ack: %v %q; want RETRY naming orders", got.GetStatus(), got.GetMessage())
	}
	if got := results[1]; got.GetStatus() != outboxv1.AckStatus_ACK_STATUS_PUBLISHED {
		t.Errorf("default's ack with orders' failing: %v %q; want PUBLISHED", got.GetStatus(), got.GetMessage())
	}
	if !published(t, r.Pool, defID) {
		t.Error("default's event is not published after its ack")
	}
}

// TestSlowSourceHoldsUpNoOtherSourcesAck: the Router gives each source's
// engine its acks at once, so while orders' ack waits on its database (its
// event table locked against writers), default's ack of the same request,
// listed after it, lands. Kills a Router that calls the engines one after
// another.
func TestSlowSourceHoldsUpNoOtherSourcesAck(t *testing.T) {
	t.Parallel()
	r, _, _ := twoSources(t, servertest.Options{})
	defID := emit(t, r.Pool, "sales_order", "1")
	ordersID := emit(t, r.Pools["orders"], "sales_order", "1")
	dd := recv(t, subscribe(t, r.Relay, "sales_order"))
	od := recv(t, subscribe(t, r.Relay, "orders/sales_order"))
	release := lockTable(t, r.Pools["orders"], "outbox.event", "EXCLUSIVE")

	done := ackAsync(t, r.Relay, &outboxv1.AckRequest{Acks: []*outboxv1.AckItem{
		{EventId: ordersID, LeaseToken: od.GetLeaseToken()}, {EventId: defID, LeaseToken: dd.GetLeaseToken()}}})
	answered := func() {
		select {
		case a := <-done:
			t.Fatalf("the Ack was answered (%v, %v) while orders' event table was locked: orders' ack gave up (the engine's own limit), "+
				"so default's may have waited for it", a.res, a.err)
		default:
		}
	}
	waitFor(t, "default's ack to land while orders' waits", func() bool {
		answered()
		return published(t, r.Pool, defID)
	})
	answered()
	release()
	a := await(t, done, "the Ack's answer once orders' event table was unlocked")
	if a.err != nil {
		t.Fatal(a.err)
	}
	if n := len(a.res.GetResults()); n != 2 {
		t.Errorf("an Ack of 2 items answered %d results: %v", n, a.res.GetResults())
	}
	for i, x := range a.res.GetResults() {
		if x.GetStatus() != outboxv1.AckStatus_ACK_STATUS_PUBLISHED {
			t.Errorf("ack %d (%s): %v %s; want PUBLISHED", i, x.GetEventId(), x.GetStatus(), x.GetMessage())
		}
	}
}

// TestAckRefusedByOneSourceRefusesTheRequest: a token that may access
// default's streams and orders' billing.* acks a delivery of orders'
// sales_order together with one of default: orders' engine refuses the
// token for that event's stream, and so the request is refused
// (PERMISSION_DENIED), not answered RETRY for orders. Kills a Router that
// swallows an engine's PERMISSION_DENIED in a request of several sources.
func TestAckRefusedByOneSourceRefusesTheRequest(t *testing.T) {
	t.Parallel()
	const (
		allToken  = "all-relay-token-0123456789"
		partToken = "part-relay-token-0123456789"
	)
	r, dial := twoSourcesWithTokens(t, "all relay "+allToken+"\n"+
		"part relay "+partToken+" streams=default/*,orders/billing.*\n")
	all := outboxv1.NewRelayServiceClient(dial(allToken))
	defID := emit(t, r.Pool, "sales_order", "1")
	ordersID := emit(t, r.Pools["orders"], "sales_order", "1")
	dd := recv(t, subscribe(t, all, "sales_order"))
	od := recv(t, subscribe(t, all, "orders/sales_order"))

	_, err := outboxv1.NewRelayServiceClient(dial(partToken)).Ack(t.Context(), &outboxv1.AckRequest{Acks: []*outboxv1.AckItem{
		{EventId: ordersID, LeaseToken: od.GetLeaseToken()}, {EventId: defID, LeaseToken: dd.GetLeaseToken()}}})
	if status.Code(err) != codes.PermissionDenied {
		t.Errorf("an Ack of orders' sales_order by a token limited to orders/billing.*: %v; want PERMISSION_DENIED", err)
	}
	if published(t, r.Pools["orders"], ordersID) {
		t.Error("orders' event was published by a token orders refuses")
	}
}

// TestLagAsksEverySourceAtOnce: GetLag asks the sources' engines at once,
// so a source whose database is slow delays no other's answer: with the
// table every lag read reads locked in both databases, both engines' lag
// statements are seen waiting together. Kills a GetLag that asks the
// sources one after another.
func TestLagAsksEverySourceAtOnce(t *testing.T) {
	t.Parallel()
	r, def, orders := twoSources(t, servertest.Options{})
	releaseDef := lockTable(t, r.Pool, "outbox.delivered_count", "ACCESS EXCLUSIVE")
	releaseOrders := lockTable(t, r.Pools["orders"], "outbox.delivered_count", "ACCESS EXCLUSIVE")
	done := make(chan error, 1)
	go func() {
		_, err := r.Admin.GetLag(t.Context(), &outboxv1.GetLagRequest{})
		done <- err
	}()
	admin := testdb.NewPoolURL(t, testdb.ServerURL())
	waitFor(t, "both sources' lag statements to wait on the lock together", func() bool {
		var n int
		if err := admin.QueryRow(t.Context(), `SELECT count(DISTINCT datname) FROM pg_stat_activity
			WHERE datname = ANY ($1) AND wait_event_type = 'Lock' AND query LIKE '%outbox.pending_by_stream(%'`,
			[]string{dbName(def), dbName(orders)}).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n == 2
	})
	releaseDef()
	releaseOrders()
	if err := await(t, done, "GetLag's answer once the locks are gone"); err != nil {
		t.Fatalf("GetLag once the locks are gone: %v", err)
	}
}

// TestLagNamesAFailingSourceNotReady: a source whose lag read fails while
// its readiness check still passes (here its lag function is renamed away)
// is reported not ready, the error as the reason, and default's figures
// are reported. Kills a GetLag that reports such a source as ready.
func TestLagNamesAFailingSourceNotReady(t *testing.T) {
	t.Parallel()
	r, _, _ := twoSources(t, servertest.Options{})
	emit(t, r.Pool, "billing", "1")
	waitFor(t, "both sources ready", func() bool { return r.App.Readiness().Reason == "" })
	if _, err := r.Pools["orders"].Exec(t.Context(), `ALTER FUNCTION outbox.pending_by_stream(text[]) RENAME TO pending_by_stream_gone`); err != nil {
		t.Fatal(err)
	}
	lag, err := r.Admin.GetLag(t.Context(), &outboxv1.GetLagRequest{})
	if err != nil {
		t.Fatalf("GetLag with orders' lag read failing: %v", err)
	}
	health := map[string]*outboxv1.SourceHealth{}
	for _, s := range lag.GetSources() {
		health[s.GetName()] = s
	}
	if h := health["orders"]; h == nil || h.GetReady() || h.GetReason() == "" {
		t.Errorf("GetLag says orders is %v while its lag read fails; want not ready, with the reason", h)
	}
	if h := health["default"]; h == nil || !h.GetReady() {
		t.Errorf("GetLag says default is %v; want ready", h)
	}
	if s := lag.GetStreams(); len(s) != 1 || s[0].GetStream() != "billing" || s[0].GetSource() != "" {
		t.Errorf("GetLag streams %v; want default's billing alone", s)
	}
}

// TestListRelaysNamesTheirSource: ListRelays writes a relay's streams and
// exclude_streams as the relay named them ("orders/sales_order"), so an
// operator can tell which source a relay serves; default's stay bare; and
// the replica is one id whatever the source. Kills a ListRelays that leaves
// an engine's bare names.
func TestListRelaysNamesTheirSource(t *testing.T) {
	t.Parallel()
	r, _, _ := twoSources(t, servertest.Options{})
	emit(t, r.Pools["orders"], "sales_order", "1") // a stream subscribed to must exist
	emit(t, r.Pool, "billing", "1")
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	for _, req := range []*outboxv1.SubscribeRequest{
		{RelayId: "orders-one", Streams: []string{"orders/sales_order"}, MaxInFlight: 1},
		{RelayId: "orders-all", Streams: []string{"orders/*"}, ExcludeStreams: []string{"orders/audit"}, MaxInFlight: 1},
		{RelayId: "default-one", Streams: []string{"billing"}, MaxInFlight: 1},
	} {
		if _, err := r.Relay.Subscribe(ctx, req); err != nil {
			t.Fatal(err)
		}
	}
	byID := map[string]*outboxv1.Relay{}
	waitFor(t, "the three relays listed", func() bool {
		res, err := r.Admin.ListRelays(t.Context(), &outboxv1.ListRelaysRequest{})
		if err != nil {
			t.Fatal(err)
		}
		clear(byID)
		for _, rl := range res.GetRelays() {
			byID[rl.GetRelayId()] = rl
		}
		return len(byID) == 3
	})
	for id, want := range map[string][2][]string{
		"orders-one":  {{"orders/sales_order"}, nil},
		"orders-all":  {nil, {"orders/audit"}},
		"default-one": {{"billing"}, nil},
	} {
		rl := byID[id]
		if !slices.Equal(rl.GetStreams(), want[0]) || !slices.Equal(rl.GetExcludeStreams(), want[1]) {
			t.Errorf("relay %s listed with streams %q, exclude %q; want %q, %q", id, rl.GetStreams(), rl.GetExcludeStreams(), want[0], want[1])
		}
	}
	// One process, one replica: its sources' engines share the id an
	// operator sees.
	if a, b := byID["orders-one"].GetReplicaId(), byID["default-one"].GetReplicaId(); a == "" || a != b {
		t.Errorf("relays of one replica's two sources listed on replicas %q and %q; want one", a, b)
	}
}

// TestPurgeRefusesATokenLimitedOnASourceBeforeAny: Purge without a stream by
// a token that may access every stream of default but only billing.* of
// orders is refused (PERMISSION_DENIED naming orders) before any source is
// purged: default's published events are all still there. Kills a Purge
// that skips the check of every source first, so default is purged before
// orders refuses.
func TestPurgeRefusesATokenLimitedOnASourceBeforeAny(t *testing.T) {
	t.Parallel()
	const (
		relayToken = "all-relay-token-0123456789"
		partToken  = "part-admin-token-0123456789"
	)
	r, dial := twoSourcesWithTokens(t, "relay relay "+relayToken+"\npart admin "+partToken+" streams=default/*,orders/billing.*\n")
	relay := outboxv1.NewRelayServiceClient(dial(relayToken))
	emit(t, r.Pool, "sales_order", "1")
	emit(t, r.Pools["orders"], "billing.x", "1")
	publishAll(t, relay, 1, "sales_order")
	publishAll(t, relay, 1, "orders/billing.x")

	_, err := purgeAll(t, outboxv1.NewAdminServiceClient(dial(partToken)), &outboxv1.PurgeRequest{})
	if status.Code(err) != codes.PermissionDenied || !strings.Contains(err.Error(), "source orders") {
		t.Errorf("Purge of every source by a token limited on orders: %v; want PERMISSION_DENIED naming orders", err)
	}
	if d, o := countPublished(t, r.Pool), countPublished(t, r.Pools["orders"]); d != 1 || o != 1 {
		t.Errorf("after a refused purge: %d/%d published left (default/orders); want 1/1", d, o)
	}
}

// TestListingPageOverSourcesHoldsAtMostPageSize: a page that one source
// ends early goes on into the next only for what is left of page_size:
// with default's one event and orders' three, pages of 2 hold at most 2,
// every event once. Kills a listing that asks the next source for a whole
// page.
func TestListingPageOverSourcesHoldsAtMostPageSize(t *testing.T) {
	t.Parallel()
	r, _, _ := twoSources(t, servertest.Options{})
	want := []string{"|" + emit(t, r.Pool, "sales_order", "1")}
	for i := range 3 {
		want = append(want, "orders|"+emit(t, r.Pools["orders"], "sales_order", fmt.Sprint(i)))
	}
	got, _ := pageAll(t, func(token string) ([]string, string, error) {
		res, err := r.Admin.ListEvents(t.Context(), &outboxv1.ListEventsRequest{PageSize: 2, PageToken: token})
		return eventNames(res), res.GetNextPageToken(), err
	})
	onceEach(t, "ListEvents without a stream by pages of 2", got, want)
}

// TestPatternWithoutASourceIsRefusedOnAnotherSource: a pattern without a
// source ("streams=sales_order") covers default's stream alone, not the
// stream of that name in another source, for relay and admin RPCs alike:
// the token may not subscribe to orders/sales_order, ack, nack or extend a
// genuine lease of it, read its aggregate, skip its event or purge it, and
// nothing changes. On default's sales_order it is served.
func TestPatternWithoutASourceIsRefusedOnAnotherSource(t *testing.T) {
	t.Parallel()
	const (
		allToken   = "all-token-0123456789abcdef"
		salesToken = "sales-token-0123456789abcdef"
	)
	r, dial := twoSourcesWithTokens(t, "all admin,relay "+allToken+"\n"+
		"sales admin,relay "+salesToken+" streams=sales_order\n")
	all := outboxv1.NewRelayServiceClient(dial(allToken))
	sales, salesAdmin := outboxv1.NewRelayServiceClient(dial(salesToken)), outboxv1.NewAdminServiceClient(dial(salesToken))
	emit(t, r.Pool, "sales_order", "1")
	id := emit(t, r.Pools["orders"], "sales_order", "1")
	item := &outboxv1.AckItem{EventId: id, LeaseToken: recv(t, subscribe(t, all, "orders/sales_order")).GetLeaseToken()}
	denied := func(what string, err error) {
		t.Helper()
		if status.Code(err) != codes.PermissionDenied {
			t.Errorf("sales_order token: %s: %v; want PERMISSION_DENIED", what, err)
		}
	}

	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	denied("Subscribe to orders/sales_order", servertest.Subscribed(ctx, sales,
		&outboxv1.SubscribeRequest{RelayId: "t", Streams: []string{"orders/sales_order"}, MaxInFlight: 1}))
	cancel()
	_, err := sales.Ack(t.Context(), &outboxv1.AckRequest{Acks: []*outboxv1.AckItem{item}})
	denied("Ack of an orders/sales_order lease", err)
	_, err = sales.Nack(t.Context(), &outboxv1.NackRequest{EventId: id, LeaseToken: item.LeaseToken, Error: "x"})
	denied("Nack of an orders/sales_order lease", err)
	_, err = sales.ExtendLease(t.Context(), &outboxv1.ExtendLeaseRequest{EventId: id, LeaseToken: item.LeaseToken, Ttl: durationpb.New(time.Minute)})
	denied("ExtendLease of an orders/sales_order lease", err)
	_, err = salesAdmin.GetAggregate(t.Context(), &outboxv1.GetAggregateRequest{Stream: "orders/sales_order", AggregateKey: "1"})
	denied("GetAggregate of orders/sales_order", err)
	_, err = salesAdmin.SkipEvent(t.Context(), &outboxv1.SkipEventRequest{EventId: "orders/" + id, Reason: "x"})
	denied("SkipEvent of an orders/sales_order event", err)
	_, err = purgeAll(t, salesAdmin, &outboxv1.PurgeRequest{Stream: "orders/sales_order", DryRun: true})
	denied("Purge of orders/sales_order", err)
	if _, err := salesAdmin.GetAggregate(t.Context(), &outboxv1.GetAggregateRequest{Stream: "sales_order", AggregateKey: "1"}); err != nil {
		t.Errorf("sales_order token: GetAggregate of default's sales_order: %v", err)
	}

	// The lease is intact: its holder acks it.
	res, err := all.Ack(t.Context(), &outboxv1.AckRequest{Acks: []*outboxv1.AckItem{item}})
	if err != nil || res.GetResults()[0].GetStatus() != outboxv1.AckStatus_ACK_STATUS_PUBLISHED {
		t.Errorf("the holder's own ack after the refusals: %v, %v", res, err)
	}
}

// TestLagHidesPendingSourcesFromATokenScopedElsewhere: GetLag names a
// source configured but not added yet only to a token that may see it; a
// token scoped "orders/*" learns nothing of source shipping, as it learns
// nothing of default.
func TestLagHidesPendingSourcesFromATokenScopedElsewhere(t *testing.T) {
	t.Parallel()
	const (
		allToken    = "all-viewer-token-0123456789"
		ordersToken = "orders-viewer-token-0123456789"
	)
	r, dial := twoSourcesWithTokens(t, "all viewer "+allToken+"\n"+
		"orders viewer "+ordersToken+" streams=orders/*\n")
	if err := r.App.SetSourcePending("shipping", "connection refused"); err != nil {
		t.Fatal(err)
	}
	sources := func(token string) []string {
		t.Helper()
		lag, err := outboxv1.NewAdminServiceClient(dial(token)).GetLag(t.Context(), &outboxv1.GetLagRequest{})
		if err != nil {
			t.Fatalf("GetLag: %v", err)
		}
		var names []string
		for _, s := range lag.GetSources() {
			names = append(names, s.GetName())
		}
		return names
	}
	if got := sources(allToken); !slices.Contains(got, "shipping") {
		t.Errorf("GetLag with an unrestricted token names sources %v; want shipping among them", got)
	}
	if got := sources(ordersToken); !slices.Equal(got, []string{"orders"}) {
		t.Errorf("GetLag with an orders/* token names sources %v; want [orders]", got)
	}
}

// TestATokenOfNoServedSourceIsRefusedOverEverySource: a token that may
// access no stream of any source this server serves ("shipping/*") is
// refused (PERMISSION_DENIED) by the calls over every source, GetLag,
// ListRelays and a Purge without a stream, rather than answered empty.
func TestATokenOfNoServedSourceIsRefusedOverEverySource(t *testing.T) {
	t.Parallel()
	const shippingToken = "shipping-admin-token-0123456789"
	_, dial := twoSourcesWithTokens(t, "shipping admin "+shippingToken+" streams=shipping/*\n")
	admin := outboxv1.NewAdminServiceClient(dial(shippingToken))
	_, err := admin.GetLag(t.Context(), &outboxv1.GetLagRequest{})
	if status.Code(err) != codes.PermissionDenied {
		t.Errorf("GetLag: %v; want PERMISSION_DENIED", err)
	}
	_, err = admin.ListRelays(t.Context(), &outboxv1.ListRelaysRequest{})
	if status.Code(err) != codes.PermissionDenied {
		t.Errorf("ListRelays: %v; want PERMISSION_DENIED", err)
	}
	_, err = purgeAll(t, admin, &outboxv1.PurgeRequest{DryRun: true})
	if status.Code(err) != codes.PermissionDenied {
		t.Errorf("Purge without a stream: %v; want PERMISSION_DENIED", err)
	}
}

// TestLagNamingAStreamASourceRefusesIsRefused: GetLag naming a stream the
// token may not see is refused (PERMISSION_DENIED), also when it names it
// through "*/": a token of default's sales_order and orders' billing asking
// for */sales_order is refused, not answered with default's figures and
// orders reported not ready.
func TestLagNamingAStreamASourceRefusesIsRefused(t *testing.T) {
	t.Parallel()
	const mixedToken = "mixed-viewer-token-0123456789"
	_, dial := twoSourcesWithTokens(t, "mixed viewer "+mixedToken+" streams=sales_order,orders/billing\n")
	viewer := outboxv1.NewAdminServiceClient(dial(mixedToken))
	if _, err := viewer.GetLag(t.Context(), &outboxv1.GetLagRequest{Streams: []string{"sales_order", "orders/billing"}}); err != nil {
		t.Fatalf("GetLag of the token's own streams: %v", err)
	}
	lag, err := viewer.GetLag(t.Context(), &outboxv1.GetLagRequest{Streams: []string{"*/sales_order"}})
	if status.Code(err) != codes.PermissionDenied {
		t.Errorf("GetLag of */sales_order: %v, sources %v; want PERMISSION_DENIED", err, lag.GetSources())
	}
}
