package main_test

import (
	"context"
	"net/http"
	"os"
	"strings"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

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

	admin := testdb.NewPoolURL(t, testdb.ServerURL())
	name := dbName(orders)
	if _, err := admin.Exec(t.Context(), `ALTER DATABASE "`+name+`" ALLOW_CONNECTIONS false`); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_, _ = admin.Exec(context.Background(), `ALTER DATABASE "`+name+`" ALLOW_CONNECTIONS true`)
	})
	if _, err := admin.Exec(t.Context(), `SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1`, name); err != nil {
		t.Fatal(err)
	}
	eventually(t, "/readyz to name orders", func() bool {
		code, body := httpGet("http://" + httpAddr + "/readyz")
		return code == http.StatusOK && strings.Contains(body, "degraded: source orders:")
	})
	if code, out := runOutboxd(t, nil, "lag", "--server", grpcAddr); code != 0 || !strings.Contains(out, "source orders NOT READY") {
		t.Errorf("outboxd lag with orders down: exit %d; want it to say orders is not ready:\n%s", code, out)
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
