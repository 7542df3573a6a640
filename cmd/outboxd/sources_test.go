package main_test

import (
	"context"
	"fmt"
	"net/http"
	"os"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/encoding/protojson"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/testdb"
)

// dbName is the database name of a test database's URL.
func dbName(url string) string {
	name := url[strings.LastIndex(url, "/")+1:]
	if i := strings.IndexByte(name, '?'); i >= 0 {
		name = name[:i]
	}
	return name
}

// The README's two-source setup as processes: `outboxd migrate` migrates
// both sources, `outboxd serve --source` serves both (the second from
// $OUTBOXD_SOURCE), a relay subscribed to orders/sales_order gets orders'
// event saying its source, and with the orders database refusing
// connections /readyz stays 200 and names orders as degraded.
func TestMigrateAndServeTwoSources(t *testing.T) {
	t.Parallel()
	def, orders := testdb.NewEmpty(t), testdb.NewEmpty(t)
	code, out := runOutboxd(t, nil, "migrate", "--database-url", def, "--source", "orders="+orders)
	if code != 0 || !strings.Contains(out, "source default: applied [") || !strings.Contains(out, "source orders: applied [") {
		t.Fatalf("migrate of two sources: exit %d\n%s", code, out)
	}
	if code, out := runOutboxd(t, nil, "migrate", "status", "--database-url", def, "--source", "orders="+orders); code != 0 || strings.Contains(out, "pending") {
		t.Fatalf("migrate status of two sources: exit %d\n%s", code, out)
	}

	grpcAddr, httpAddr := freeAddr(t), freeAddr(t)
	p := startEnv(t, []string{"OUTBOXD_SOURCE=orders=" + orders}, "serve", "--database-url", def,
		"--listen", grpcAddr, "--http-listen", httpAddr, "--health-interval", "200ms")
	defer p.signal(os.Interrupt)
	eventually(t, "/readyz 200", func() bool { code, _ := httpGet("http://" + httpAddr + "/readyz"); return code == http.StatusOK })

	pool := testdb.NewPoolURL(t, orders)
	var id string
	if err := pool.QueryRow(t.Context(), `SELECT event_id::text FROM outbox.emit('sales_order', '1', 'T', '{}')`).Scan(&id); err != nil {
		t.Fatal(err)
	}
	conn, err := grpc.NewClient(grpcAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	st, err := outboxv1.NewRelayServiceClient(conn).Subscribe(ctx, &outboxv1.SubscribeRequest{
		RelayId: "t", Streams: []string{"orders/sales_order"}, MaxInFlight: 1})
	if err != nil {
		t.Fatal(err)
	}
	d, err := st.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if d.GetEvent().GetEventId() != id || d.GetEvent().GetSource() != "orders" {
		t.Errorf("delivered %s of source %q; want %s of orders", d.GetEvent().GetEventId(), d.GetEvent().GetSource(), id)
	}
	cancel()
	pool.Close()
	if code, out := runOutboxd(t, nil, "lag", "--server", grpcAddr); code != 0 || !strings.Contains(out, "orders/sales_order") {
		t.Errorf("outboxd lag of two sources: exit %d; want a row orders/sales_order:\n%s", code, out)
	}
	if code, out := runOutboxd(t, nil, "lag", "--server", grpcAddr, "--fail-if-older-than", "1h"); code != 0 {
		t.Errorf("outboxd lag --fail-if-older-than 1h with both sources up: exit %d, want 0:\n%s", code, out)
	}

	admin := testdb.NewPoolURL(t, testdb.ServerURL())
	name := dbName(orders)
	testdb.RefuseConnections(t, admin, name)
	eventually(t, "/readyz to name orders", func() bool {
		testdb.TerminateBackends(t, admin, name) // one that slipped in
		code, body := httpGet("http://" + httpAddr + "/readyz")
		return code == http.StatusOK && strings.Contains(body, "degraded: source orders:")
	})
	if code, out := runOutboxd(t, nil, "lag", "--server", grpcAddr); code != 0 ||
		!strings.Contains(out, "source orders NOT READY") || !strings.Contains(out, "its lag could not be read") {
		t.Errorf("outboxd lag with orders down: exit %d; want it to say orders is not ready and left out:\n%s", code, out)
	}
	if code, out := runOutboxd(t, nil, "lag", "--json", "--server", grpcAddr); code != 0 || !strings.Contains(out, `"lag_unknown":true`) {
		t.Errorf("outboxd lag --json with orders down: exit %d; want orders marked lag_unknown:\n%s", code, out)
	}
	if code, out := runOutboxd(t, nil, "relays", "--server", grpcAddr); code != 0 ||
		!strings.Contains(out, "warning: source orders left out, its relays are not listed") {
		t.Errorf("outboxd relays with orders down: exit %d; want a warning naming orders:\n%s", code, out)
	}
	// The cron check cannot pass while orders' pending event is in no
	// total: it exits 1 naming the source, not 0 on default's figures.
	code, out = runOutboxd(t, nil, "lag", "--server", grpcAddr, "--fail-if-older-than", "1h")
	if code != 1 || !strings.Contains(out, "the lag of source orders could not be read") {
		t.Errorf("outboxd lag --fail-if-older-than 1h with orders down: exit %d; want 1 naming orders:\n%s", code, out)
	}
}

// Bad --source values stop the command with exit code 2, naming the value
// and never repeating a password.
func TestSourceFlagRejects(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--source", "orders"}, "want NAME=URL"},
		// An empty URL is a valid libpq connection string (the local
		// defaults): it must not quietly open some other database as orders.
		{[]string{"--source", "orders="}, "want NAME=URL"},
		{[]string{"--source", "Orders=postgres://u:hunter2@127.0.0.1:1/x"}, "source name"},
		{[]string{"--source", "orders=postgres://127.0.0.1:1/a", "--source", "orders=postgres://127.0.0.1:1/b"}, "given twice"},
		{[]string{"--database-url", "postgres://127.0.0.1:1/a", "--source", "default=postgres://127.0.0.1:1/b"}, "already --database-url"},
	} {
		code, out := runOutboxd(t, nil, append([]string{"migrate"}, tc.args...)...)
		if code != 2 || !strings.Contains(out, tc.want) || strings.Contains(out, "hunter2") {
			t.Errorf("migrate %v: exit %d, %q; want 2 saying %q, without the password", tc.args, code, out, tc.want)
		}
	}
}

// Flag values the server or the relay would refuse (or that would make a
// loop spin) stop serve, dev and relay at start with a usage error (exit
// 2) naming the flag, before any database or server is dialled: they were
// refused with the library's Config field names and exit 1, or accepted.
func TestOutOfRangeFlagsRejected(t *testing.T) {
	t.Parallel()
	noDB := []string{"--database-url", "postgres://127.0.0.1:1/x"}
	noServer := []string{"--server", "127.0.0.1:1", "--sink", "stdout://"}
	for _, c := range []struct {
		args []string
		want string
	}{
		{append([]string{"serve", "--idle-checks-per-second", "0"}, noDB...), "--idle-checks-per-second 0: want 1 or more"},
		{append([]string{"serve", "--idle-checks-per-second", "-5"}, noDB...), "--idle-checks-per-second -5: want 1 or more"},
		{append([]string{"serve", "--lease-ttl", "-5s"}, noDB...), "--lease-ttl -5s: want 1s to 1h"},
		{append([]string{"serve", "--lease-ttl", "0s"}, noDB...), "--lease-ttl 0s: want 1s to 1h"},
		{append([]string{"serve", "--lease-ttl", "2h"}, noDB...), "--lease-ttl 2h0m0s: want 1s to 1h"},
		{append([]string{"serve", "--max-failures", "-1"}, noDB...), "--max-failures -1: want 1 or more"},
		{append([]string{"serve", "--max-deliveries", "1"}, noDB...), "--max-deliveries 1: want 2 or more"},
		{append([]string{"serve", "--backoff-base", "2m", "--backoff-cap", "1m"}, noDB...), "--backoff-cap 1m0s: want at least --backoff-base (2m0s)"},
		{append([]string{"serve", "--poll-interval", "0s"}, noDB...), "--poll-interval 0s: want more than 0"},
		{append([]string{"serve", "--max-db-conns", "0"}, noDB...), "--max-db-conns 0: want 1 or more"},
		{append([]string{"serve", "--health-interval", "0s"}, noDB...), "--health-interval 0s: want more than 0"},
		{append([]string{"serve", "--ack-committers", "0"}, noDB...), "--ack-committers 0: want 1 or more"},
		{append([]string{"serve", "--max-subscriptions-per-relay", "0"}, noDB...), "--max-subscriptions-per-relay 0: want 1 or more"},
		{append([]string{"serve", "--discovery-max-events", "-1"}, noDB...), "--discovery-max-events -1: want 0 (no limit) or more"},
		{append([]string{"serve", "--shutdown-timeout", "0s"}, noDB...), "--shutdown-timeout 0s: want more than 0"},
		{append([]string{"serve", "--partition-ttl", "500ms"}, noDB...), "--partition-ttl 500ms: want 1s or more"},
		{append([]string{"serve", "--stranded-audit-interval", "0s"}, noDB...), "--stranded-audit-interval 0s: want more than 0"},
		{append([]string{"dev", "--max-db-conns", "0"}, noDB...), "--max-db-conns 0: want 1 or more"},
		{append([]string{"relay", "--max-in-flight", "0"}, noServer...), "--max-in-flight 0: want 1 or more"},
		{append([]string{"relay", "--max-in-flight-per-aggregate", "5000"}, noServer...), "--max-in-flight-per-aggregate 5000: want 1 to --max-in-flight (256)"},
		{append([]string{"relay", "--drain-timeout", "-1s"}, noServer...), "--drain-timeout -1s: want 0 or more"},
		{[]string{"relay", "--server", "127.0.0.1:1"}, "--sink (or --route) is required"},
	} {
		code, out := runOutboxd(t, nil, c.args...)
		if code != 2 || !strings.Contains(out, c.want) || strings.Contains(out, "Config.") {
			t.Errorf("outboxd %v: exit %d, %q; want 2 saying %q", c.args, code, out, c.want)
		}
	}
}

// With --source and neither --database-url nor $DATABASE_URL there is no
// default source: `outboxd migrate --source orders=URL` migrates orders
// alone (and does not touch the local default database).
func TestMigrateOneSource(t *testing.T) {
	t.Parallel()
	orders := testdb.NewEmpty(t)
	code, out := runOutboxd(t, []string{"DATABASE_URL="}, "migrate", "--source", "orders="+orders)
	if code != 0 || strings.Count(out, "schema is at version") != 1 || strings.Contains(out, "default") {
		t.Fatalf("migrate --source orders alone: exit %d; want orders migrated, nothing else:\n%s", code, out)
	}
}

// `outboxd relay --route` over two sources: one --route naming a stream of
// default and one of orders opens a subscription per source sharing its
// sink, and orders/* takes the rest of orders. The same event id in both
// sources reaches JetStream twice, as default's bare id and as
// orders/<id>, not as one message and a dropped duplicate.
func TestRelayRoutesOverTwoSources(t *testing.T) {
	t.Parallel()
	def, orders := testdb.New(t), testdb.New(t)
	defPool, ordersPool := testdb.NewPoolURL(t, def), testdb.NewPoolURL(t, orders)
	const shared = "0f8fad5b-d9cb-469f-a165-70867728950e"
	for _, emit := range []struct {
		pool   *pgxpool.Pool
		stream string
		id     string
	}{{defPool, "sales_order", shared}, {ordersPool, "sales_order", shared}, {ordersPool, "audit", "7c9e6679-7425-40de-944b-e07fc1f90ae7"}} {
		if _, err := emit.pool.Exec(t.Context(), `SELECT outbox.emit($1, 'k', 'T', '{}', event_id => $2)`, emit.stream, emit.id); err != nil {
			t.Fatal(err)
		}
	}
	js, streamName, prefix := jetStreamSink(t, "SRC")
	addr := freeAddr(t)
	start(t, "serve", "--database-url", def, "--source", "orders="+orders, "--listen", addr, "--http-listen", "")
	sinkURL := func(sub string) string {
		return fmt.Sprintf("%s?stream=%s&subject=%s.%s.{stream}", natsURL(), streamName, prefix, sub)
	}
	relay := start(t, "relay", "--server", addr, "--relay-id", "r",
		"--route", "sales_order,orders/sales_order="+sinkURL("sales"),
		"--route", "orders/*="+sinkURL("rest"))
	defer relay.signal(os.Interrupt)
	// A relay whose subscription is refused exits: fail then, not after
	// waitPublished's two minutes.
	eventually(t, "all three events published", func() bool {
		select {
		case <-relay.done:
			t.Fatalf("relay exited with %d before publishing everything", relay.cmd.ProcessState.ExitCode())
		default:
		}
		var d, o int
		_ = defPool.QueryRow(t.Context(), `SELECT count(*) FROM outbox.event WHERE published_at IS NOT NULL`).Scan(&d)
		_ = ordersPool.QueryRow(t.Context(), `SELECT count(*) FROM outbox.event WHERE published_at IS NOT NULL`).Scan(&o)
		return d == 1 && o == 2
	})

	s, err := js.Stream(t.Context(), streamName)
	if err != nil {
		t.Fatal(err)
	}
	cons, err := s.OrderedConsumer(t.Context(), jetstream.OrderedConsumerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	batch, err := cons.Fetch(3, jetstream.FetchMaxWait(10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]string{} // Nats-Msg-Id -> subject
	for msg := range batch.Messages() {
		got[msg.Headers().Get("Nats-Msg-Id")] = msg.Subject()
	}
	want := map[string]string{
		shared:             prefix + ".sales.sales_order",
		"orders/" + shared: prefix + ".sales.sales_order",
		"orders/7c9e6679-7425-40de-944b-e07fc1f90ae7": prefix + ".rest.audit",
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("JetStream holds (Nats-Msg-Id -> subject) %v; want %v", got, want)
	}
	code, out := runOutboxd(t, nil, "relays", "--server", addr, "--json")
	for _, id := range []string{`"r/sales_order"`, `"r/orders/sales_order"`, `"r/orders/*"`} {
		if code != 0 || !strings.Contains(out, id) {
			t.Errorf("outboxd relays: exit %d; want relay %s among:\n%s", code, id, out)
		}
	}
	// orders/* is a catch-all of orders alone: its row says which source
	// (streams empty would otherwise read as every stream of every source).
	var listed outboxv1.ListRelaysResponse
	if err := protojson.Unmarshal([]byte(out), &listed); err != nil {
		t.Fatalf("relays --json: %v\n%s", err, out)
	}
	for _, rl := range listed.GetRelays() {
		want := map[string]string{"r/sales_order": "", "r/orders/sales_order": "orders", "r/orders/*": "orders"}[rl.GetRelayId()]
		if rl.GetSource() != want {
			t.Errorf("relays --json: relay %s has source %q, want %q", rl.GetRelayId(), rl.GetSource(), want)
		}
	}
	_, out = runOutboxd(t, nil, "relays", "--server", addr)
	if !strings.Contains(out, "orders/* but orders/sales_order") {
		t.Errorf("outboxd relays does not show r/orders/*'s streams as orders/* but orders/sales_order:\n%s", out)
	}
}

// Bad source names in --route and --streams stop outboxd relay at start
// with exit code 2 (usage), naming the name at fault, before any dial.
func TestRelayRejectsBadSourceNames(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--route", "Orders/sales_order=stdout://"}, `"Orders/sales_order": source name "Orders": want 1 to 32 lower-case letters`},
		{[]string{"--route", "or*/payments=stdout://"}, `"or*/payments": a source pattern is * alone`},
		{[]string{"--route", "*/payments=stdout://", "--sources-interval", "0s"}, "--sources-interval 0s: want more than 0"},
		{[]string{"--streams", "or-ders/x", "--sink", "stdout://"}, `--streams: "or-ders/x": source name "or-ders"`},
		{[]string{"--streams", "a,orders/b", "--exclude-streams", "c", "--sink", "stdout://"}, "--exclude-streams cannot go with them"},
	} {
		code, out := runOutboxd(t, nil, append([]string{"relay", "--server", "127.0.0.1:1"}, c.args...)...)
		if code != 2 || !strings.Contains(out, c.want) {
			t.Errorf("outboxd relay %q: exit %d\n%s\nwant exit 2 saying %q", c.args, code, out, c.want)
		}
	}
}
