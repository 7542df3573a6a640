package main_test

import (
	"net/http"
	"os"
	"strings"
	"testing"

	"github.com/outboxd/outboxd/internal/testdb"
)

// `outboxd dev --source orders=URL` migrates the orders database (empty
// here) beside the default one and serves it: an event emitted there shows
// in `outboxd lag` as orders/sales_order, and /readyz is 200 without
// "degraded".
func TestDevServesASource(t *testing.T) {
	t.Parallel()
	def, orders := testdb.New(t), testdb.NewEmpty(t)
	grpcAddr, httpAddr := freeAddr(t), freeAddr(t)
	p := start(t, "dev", "--database-url", def, "--source", "orders="+orders, "--listen", grpcAddr, "--http-listen", httpAddr,
		"--health-interval", "200ms")
	defer p.signal(os.Interrupt)
	eventually(t, "/readyz 200", func() bool { code, _ := httpGet("http://" + httpAddr + "/readyz"); return code == http.StatusOK })
	if _, err := testdb.NewPoolURL(t, orders).Exec(t.Context(), `SELECT outbox.emit('sales_order', '1', 'T', '{}')`); err != nil {
		t.Fatalf("emit into orders (migrated by dev?): %v", err)
	}
	eventually(t, "outboxd lag to show orders/sales_order", func() bool {
		code, out := runOutboxd(t, nil, "lag", "--server", grpcAddr)
		return code == 0 && strings.Contains(out, "orders/sales_order")
	})
	if code, body := httpGet("http://" + httpAddr + "/readyz"); code != http.StatusOK || strings.Contains(body, "degraded") {
		t.Errorf("/readyz: %d %s; want 200 with every source ready", code, body)
	}
	// It says where the database came from: the flag, not $DATABASE_URL.
	if !p.hasOutput("using PostgreSQL from --database-url") {
		t.Error("dev --database-url did not say it uses the flag's database")
	}
}
