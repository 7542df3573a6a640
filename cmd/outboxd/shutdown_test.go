package main_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	neturl "net/url"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/testdb"
)

// subscribeNoRead opens a Subscribe stream to addr (waiting for the server
// to listen) and never reads it; it returns once the server has accepted the
// subscription.
func subscribeNoRead(t *testing.T, ctx context.Context, addr string, maxInFlight uint32) {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	callCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	st, err := outboxv1.NewRelayServiceClient(conn).Subscribe(ctx, &outboxv1.SubscribeRequest{
		RelayId: "never-reads", MaxInFlight: maxInFlight,
	}, grpc.WaitForReady(true))
	if err != nil {
		t.Fatal(err)
	}
	headers := make(chan error, 1)
	go func() { _, err := st.Header(); headers <- err }()
	select {
	case err := <-headers:
		if err != nil {
			t.Fatal(err)
		}
	case <-callCtx.Done():
		t.Fatal("subscription not accepted within 30s")
	}
}

func leasedCount(t *testing.T, pool *pgxpool.Pool) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM outbox.delivery WHERE state = 'leased'`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// SIGTERM with one idle relay connected and nothing in flight: the process
// exits at once, not after --shutdown-timeout.
func TestServeExitsOnSIGTERMWithIdleRelay(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	url := testdb.New(t)
	addr := freeAddr(t)
	p := start(t, "serve", "--database-url", url, "--listen", addr, "--http-listen", "", "--shutdown-timeout", "1m")
	subscribeNoRead(t, ctx, addr, 10)
	code, took, ok := p.signalWithin(syscall.SIGTERM, 2*time.Minute)
	if !ok {
		t.Fatalf("serve had not exited %v after SIGTERM", took)
	}
	if code != 0 {
		t.Errorf("serve exited %d after SIGTERM, want 0", code)
	}
	// Far below the one-minute timeout the old loop always ran out.
	if took > 10*time.Second {
		t.Errorf("serve took %v to exit with nothing in flight", took)
	}
}

// SIGTERM while a relay that stopped reading holds 40 events of 900 KB (its
// HTTP/2 window full, the server blocked in Send): the process exits within
// --shutdown-timeout plus a small margin, and the relay's leases are
// released, not left to their TTL.
func TestServeExitsOnSIGTERMWithStalledRelay(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	const n = 40
	if _, err := pool.Exec(ctx, `SELECT outbox.emit('orders', 'big-' || a, 'Big', jsonb_build_object('pad', repeat('x', 900000)))
		FROM generate_series(1, $1::int) a`, n); err != nil {
		t.Fatal(err)
	}
	addr := freeAddr(t)
	const timeout = 2 * time.Second
	p := start(t, "serve", "--database-url", url, "--listen", addr, "--http-listen", "",
		"--shutdown-timeout", timeout.String(), "--lease-ttl", "1h")
	subscribeNoRead(t, ctx, addr, n)
	for deadline := time.Now().Add(30 * time.Second); leasedCount(t, pool) < n; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d events leased to the stalled relay after 30s", leasedCount(t, pool), n)
		}
	}
	code, took, ok := p.signalWithin(syscall.SIGTERM, time.Minute)
	if !ok {
		t.Fatalf("serve had not exited %v after SIGTERM with a stalled relay", took)
	}
	if code != 0 {
		t.Errorf("serve exited %d, want 0", code)
	}
	// Timeout, Stop's 1 s grace, then closing connections and releasing.
	if took > timeout+6*time.Second {
		t.Errorf("serve took %v to exit with --shutdown-timeout %v", took, timeout)
	}
	if held := leasedCount(t, pool); held != 0 {
		t.Errorf("%d leases (1 h TTL) still held after serve exited", held)
	}
}

// Ctrl-C (SIGINT) is a requested stop like SIGTERM: `outboxd dev` (what
// `make dev` runs) and serve exit 0 after their graceful shutdown, so that
// make and shells report no failure.
// SIGHUP (what systemctl reload sends) leaves a serve without tokens
// running: it has nothing to reload, and must not take the signal's default,
// an exit. SIGHUP goes first, then SIGINT; a process the SIGHUP killed exits
// by that signal, one that ignored it exits 0 from the SIGINT's drain.
func TestServeWithoutTokensSurvivesSIGHUP(t *testing.T) {
	t.Parallel()
	url := testdb.New(t)
	addr := freeAddr(t)
	p := start(t, "serve", "--database-url", url, "--listen", addr, "--http-listen", "")
	subscribeNoRead(t, t.Context(), addr, 10)
	if err := p.cmd.Process.Signal(syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	code, took, ok := p.signalWithin(syscall.SIGINT, time.Minute)
	if !ok {
		t.Fatalf("serve had not exited %v after SIGHUP and SIGINT", took)
	}
	if code != 0 {
		t.Fatalf("serve exited %d after SIGHUP then SIGINT (%v), want 0: SIGHUP ended it", code, p.cmd.ProcessState)
	}
}

func TestDevAndServeExitZeroOnSIGINT(t *testing.T) {
	t.Parallel()
	for _, command := range []string{"dev", "serve"} {
		t.Run(command, func(t *testing.T) {
			t.Parallel()
			url := testdb.New(t)
			addr := freeAddr(t)
			p := start(t, command, "--database-url", url, "--listen", addr, "--http-listen", "")
			subscribeNoRead(t, t.Context(), addr, 10)
			code, took, ok := p.signalWithin(syscall.SIGINT, time.Minute)
			if !ok {
				t.Fatalf("%s had not exited %v after SIGINT", command, took)
			}
			if code != 0 {
				t.Errorf("%s exited %d after SIGINT, want 0", command, code)
			}
		})
	}
}

// A relay that gets SIGHUP (its terminal closed, or a SIGHUP sent to every
// outboxd process after editing tokens) drains and exits 0 as on SIGTERM,
// releasing its leases: the signal's default, an exit on the spot, dropped
// the publishes under way unacked. Its deliveries are held by a sink that
// never answers, so the relay is mid-publish when the signal comes.
func TestRelayDrainsOnSIGHUP(t *testing.T) {
	t.Parallel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	addr := freeAddr(t)
	hook := stalledWebhook(t)
	start(t, "serve", "--database-url", url, "--listen", addr, "--http-listen", "")
	if _, err := pool.Exec(t.Context(), `SELECT outbox.emit('sales_order', 'o-' || a, 'T', '{}') FROM generate_series(1, 3) a`); err != nil {
		t.Fatal(err)
	}
	relay := start(t, "relay", "--server", addr, "--sink", hook.url, "--drain-timeout", "1s")
	hook.waitRequests(t, 3)
	code, took, ok := relay.signalWithin(syscall.SIGHUP, time.Minute)
	if !ok {
		t.Fatalf("relay had not exited %v after SIGHUP", took)
	}
	if code != 0 {
		t.Fatalf("relay exited %d after SIGHUP (%v), want 0 after its drain", code, relay.cmd.ProcessState)
	}
	eventually(t, "the relay's leases released", func() bool { return leasedCount(t, pool) == 0 })
}

// stalledHook is a webhook endpoint that answers no request until the
// client gives up or the test ends.
type stalledHook struct {
	url      string
	requests chan struct{}
}

func stalledWebhook(t *testing.T) *stalledHook {
	t.Helper()
	secretFile, _ := webhookSecrets(t, 1)
	h := &stalledHook{requests: make(chan struct{}, 64)}
	release := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h.requests <- struct{}{}
		select {
		case <-r.Context().Done():
		case <-release:
		}
	}))
	t.Cleanup(func() { close(release); srv.Close() })
	h.url = srv.URL + "/hook?secret_file=" + neturl.QueryEscape(secretFile)
	return h
}

// waitRequests waits until n requests have reached the endpoint.
func (h *stalledHook) waitRequests(t *testing.T, n int) {
	t.Helper()
	for i := range n {
		select {
		case <-h.requests:
		case <-time.After(time.Minute):
			t.Fatalf("the webhook got %d requests within a minute, want %d", i, n)
		}
	}
}
