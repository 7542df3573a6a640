package main_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/outboxd/outboxd/internal/devdb"
	"github.com/outboxd/outboxd/internal/testdb"
)

// eventually polls cond until it holds (a hang guard of one minute, not a
// timing assertion).
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within a minute", what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func httpGet(url string) (int, string) {
	resp, err := http.Get(url)
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(body)
}

// gRPC health and /readyz follow the database: NOT_SERVING while the
// PostgreSQL server is stopped, SERVING again once it is back. The test runs
// its own throwaway cluster, because it stops it.
func TestHealthFollowsDatabase(t *testing.T) {
	if testing.Short() {
		t.Skip("starts and stops a PostgreSQL cluster")
	}
	t.Parallel()
	ctx := context.Background()
	db, err := devdb.StartThrowaway(ctx, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close(context.Background()) })
	if out, err := exec.Command(binary, "migrate", "--database-url", db.URL).CombinedOutput(); err != nil {
		t.Fatalf("migrate: %v\n%s", err, out)
	}
	addr, httpAddr := freeAddr(t), freeAddr(t)
	start(t, "serve", "--database-url", db.URL, "--listen", addr, "--http-listen", httpAddr, "--health-interval", "100ms")

	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	health := healthpb.NewHealthClient(conn)
	status := func() healthpb.HealthCheckResponse_ServingStatus {
		cctx, cancel := context.WithTimeout(ctx, time.Second)
		defer cancel()
		res, err := health.Check(cctx, &healthpb.HealthCheckRequest{Service: "outbox.v1.RelayService"})
		if err != nil {
			return healthpb.HealthCheckResponse_UNKNOWN
		}
		return res.GetStatus()
	}
	ready := func() int { code, _ := httpGet("http://" + httpAddr + "/readyz"); return code }

	eventually(t, "SERVING at start", func() bool { return status() == healthpb.HealthCheckResponse_SERVING })
	if code := ready(); code != http.StatusOK {
		t.Fatalf("/readyz %d while serving", code)
	}
	if code, body := httpGet("http://" + httpAddr + "/metrics"); code != http.StatusOK ||
		!strings.Contains(body, "outboxd_lag_scrape_success 1") || !strings.Contains(body, "grpc_server_handled_total") {
		t.Fatalf("/metrics %d:\n%.2000s", code, body)
	}

	// The console, open on loopback without tokens.
	if code, body := httpGet("http://" + httpAddr + "/"); code != http.StatusOK || !strings.Contains(body, "no login (loopback)") {
		t.Fatalf("console at / %d:\n%.2000s", code, body)
	}
	// Its chart: serve samples lag for it, over the last hour.
	eventually(t, "a lag sample for the console's chart", func() bool {
		var lag struct {
			History   []json.RawMessage `json:"history"`
			IntervalS float64           `json:"interval_s"`
			WindowS   float64           `json:"window_s"`
		}
		code, body := httpGet("http://" + httpAddr + "/api/lag")
		if code != http.StatusOK || json.Unmarshal([]byte(body), &lag) != nil {
			t.Fatalf("/api/lag %d:\n%.2000s", code, body)
		}
		if lag.WindowS != 3600 || lag.IntervalS != 10 {
			t.Fatalf("/api/lag: the chart covers %vs sampled every %vs, want an hour every 10s", lag.WindowS, lag.IntervalS)
		}
		return len(lag.History) > 0
	})

	if err := db.StopServer(ctx); err != nil {
		t.Fatal(err)
	}
	eventually(t, "NOT_SERVING with PostgreSQL stopped", func() bool { return status() == healthpb.HealthCheckResponse_NOT_SERVING })
	// The reason depends on which check met the stopped server first (the
	// ping, or the schema version query on a connection being terminated).
	if code, body := httpGet("http://" + httpAddr + "/readyz"); code != http.StatusServiceUnavailable || !strings.HasPrefix(body, "not ready: ") {
		t.Fatalf("/readyz %d %q with PostgreSQL stopped", code, body)
	}
	if code, _ := httpGet("http://" + httpAddr + "/healthz"); code != http.StatusOK {
		t.Fatalf("/healthz %d: the process is alive whatever the database does", code)
	}

	if err := db.StartServer(ctx); err != nil {
		t.Fatal(err)
	}
	eventually(t, "SERVING after PostgreSQL restarted", func() bool { return status() == healthpb.HealthCheckResponse_SERVING })
	eventually(t, "/readyz 200 after PostgreSQL restarted", func() bool { return ready() == http.StatusOK })
}

// SIGTERM under load: serve exits 0 after letting outstanding acks land and
// giving back its leases; nothing is lost, and a replacement drains the
// rest.
func TestSIGTERMUnderLoadLosesNothing(t *testing.T) {
	if testing.Short() {
		t.Skip("runs processes under load")
	}
	t.Parallel()
	ctx := context.Background()
	const aggregates, perAggregate = 100, 30
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	js, streamName, prefix := jetStreamSink(t, "SIGTERM")
	if err := emitRounds(pool, 1, perAggregate/2, aggregates); err != nil {
		t.Fatal(err)
	}
	addr := freeAddr(t)
	serve := func() *process {
		return start(t, "serve", "--database-url", url, "--listen", addr, "--http-listen", "",
			"--shutdown-timeout", "10s", "--log-level", "warn")
	}
	first := serve()
	sinkURL := fmt.Sprintf("%s?stream=%s&subject=%s.{stream}.{aggregate_key}&duplicates=100ms", natsURL(), streamName, prefix)
	for i := range 2 {
		start(t, "relay", "--server", addr, "--sink", sinkURL, "--max-in-flight", "32", "--relay-id", fmt.Sprint("r", i), "--log-level", "warn")
	}
	produced := make(chan error, 1)
	go func() { produced <- emitRounds(pool, perAggregate/2+1, perAggregate, aggregates) }()

	waitPublished(t, pool, aggregates*perAggregate/4)
	if code := first.signal(syscall.SIGTERM); code != 0 {
		t.Fatalf("serve exited %d on SIGTERM, want 0", code)
	}
	var held, sessions int
	if err := pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM outbox.delivery WHERE holder IS NOT NULL),
	                                     (SELECT count(*) FROM outbox.relay_session)`).Scan(&held, &sessions); err != nil {
		t.Fatal(err)
	}
	if held != 0 || sessions != 0 {
		t.Fatalf("after a graceful stop %d leases are held and %d relay sessions recorded, want none", held, sessions)
	}
	if err := <-produced; err != nil {
		t.Fatal(err)
	}

	// The relays reconnect to the replacement and finish the work.
	serve()
	waitPublished(t, pool, aggregates*perAggregate)
	verifySink(t, js, streamName, aggregates*perAggregate)
}
