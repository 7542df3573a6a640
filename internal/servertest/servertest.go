// Package servertest runs an outboxd server replica on loopback for tests,
// as net/http/httptest does for HTTP handlers: the production gRPC server
// of internal/app on 127.0.0.1, a client connection to it, and a graceful
// shutdown when the test ends.
package servertest

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/app"
	"github.com/outboxd/outboxd/internal/auth"
	"github.com/outboxd/outboxd/internal/store"
	"github.com/outboxd/outboxd/server"
)

// Replica is one running server and a client connection to it.
type Replica struct {
	Server *server.Server
	// App is the composed replica (gRPC server, health, shutdown), the one
	// `outboxd serve` runs.
	App *app.Replica
	// Addr is the gRPC listen address.
	Addr  string
	Conn  *grpc.ClientConn
	Relay outboxv1.RelayServiceClient
	Admin outboxv1.AdminServiceClient
	// Pool is the replica's own database pool.
	Pool *pgxpool.Pool
	// Pools are the pools of Options.Sources, by name.
	Pools map[string]*pgxpool.Pool

	cancel    context.CancelFunc
	served    chan struct{}
	closeOnce sync.Once
}

// Options adjust a replica.
type Options struct {
	// Configure edits the server's Config after the test defaults are set:
	// logs to the test, 200 ms poll and reconcile intervals.
	Configure func(*server.Config)
	// Authenticator, when set, puts the production authentication
	// interceptors in front of every service.
	Authenticator *auth.Authenticator
	// ShutdownTimeout is how long shutting down waits for outstanding
	// deliveries. Default 5s.
	ShutdownTimeout time.Duration
	// ServerOptions are added to the production gRPC server options.
	ServerOptions []grpc.ServerOption
	// DialOptions are added to the client connection.
	DialOptions []grpc.DialOption
	// Sources are further source databases, by name, each served by an
	// engine of its own (app.Config.Sources) configured as the default one
	// (Configure applies to each).
	Sources map[string]string
	// ConfigurePool edits the default source's pool configuration after
	// store.ConfigurePool (a test may trace the replica's statements).
	ConfigurePool func(*pgxpool.Config)
}

// Start runs a replica against the database at url until t ends, built by
// internal/app as `outboxd serve` builds it: the same interceptors, limits,
// keepalive, health service and shutdown. It returns once the replica
// reports ready (health SERVING) and every source of opts is ready.
func Start(t testing.TB, url string, opts Options) *Replica {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	pool := newPool(t, ctx, url, opts.ConfigurePool)
	cfg := server.Config{
		Store:             store.New(pool),
		DatabaseURL:       url,
		Logger:            Logger(t),
		PollInterval:      200 * time.Millisecond,
		ReconcileInterval: 200 * time.Millisecond,
	}
	if opts.Configure != nil {
		opts.Configure(&cfg)
	}
	pools := map[string]*pgxpool.Pool{}
	var sources []app.Source
	for name, surl := range opts.Sources {
		sp := newPool(t, ctx, surl, nil)
		pools[name] = sp
		sc := server.Config{Store: store.New(sp), DatabaseURL: surl, Logger: cfg.Logger,
			PollInterval: cfg.PollInterval, ReconcileInterval: cfg.ReconcileInterval}
		if opts.Configure != nil {
			opts.Configure(&sc)
		}
		sources = append(sources, app.Source{Name: name, Server: sc})
	}
	rep, err := app.New(ctx, app.Config{
		Server:          cfg,
		Sources:         sources,
		Authenticator:   opts.Authenticator,
		HealthInterval:  time.Second,
		ShutdownTimeout: cmp.Or(opts.ShutdownTimeout, 5*time.Second),
		ServerOptions:   opts.ServerOptions,
	})
	if err != nil {
		pool.Close()
		for _, sp := range pools {
			sp.Close()
		}
		t.Fatal(err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	r := &Replica{Server: rep.Server, App: rep, Addr: lis.Addr().String(), Pool: pool, Pools: pools,
		cancel: cancel, served: make(chan struct{})}
	go func() { defer close(r.served); _ = rep.Serve(ctx, lis) }()
	dial := append([]grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}, opts.DialOptions...)
	if r.Conn, err = grpc.NewClient(r.Addr, dial...); err != nil {
		t.Fatal(err)
	}
	r.Relay, r.Admin = outboxv1.NewRelayServiceClient(r.Conn), outboxv1.NewAdminServiceClient(r.Conn)
	t.Cleanup(func() {
		r.Conn.Close()
		r.Close()
		checkNothingStranded(t, pool)
		pool.Close()
		for _, sp := range pools {
			checkNothingStranded(t, sp)
			sp.Close()
		}
	})
	select {
	case <-rep.Ready():
	case <-time.After(30 * time.Second): // a hang guard
		t.Fatalf("replica not ready after 30s: %s", rep.Readiness().Reason)
	}
	// The replica is ready once one source is; a test of several expects
	// each one's discovery to run (CI once saw default's engine become
	// ready after a test had written its first events). The readiness
	// names every source that is not.
	for deadline := time.Now().Add(30 * time.Second); rep.Readiness().Reason != ""; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) { // a hang guard
			t.Fatalf("not every source ready after 30s: %s", rep.Readiness().Reason)
		}
	}
	return r
}

func newPool(t testing.TB, ctx context.Context, url string, configure func(*pgxpool.Config)) *pgxpool.Pool {
	t.Helper()
	poolCfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	store.ConfigurePool(poolCfg)
	if configure != nil {
		configure(poolCfg)
	}
	pool, err := pgxpool.NewWithConfig(ctx, poolCfg)
	if err != nil {
		t.Fatal(err)
	}
	return pool
}

// Close shuts the replica down as SIGTERM does `outboxd serve` (see
// app.Replica.Shutdown) and returns when it has. Later calls do nothing.
func (r *Replica) Close() {
	r.closeOnce.Do(func() {
		r.cancel()
		<-r.served
	})
}

// Logger routes logs to t.Log, so they show with the test that produced
// them (and only when it fails or -v is set). A fuzz target must not log
// through its *testing.F while inputs run: give it a discarding logger.
func Logger(t testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

type testWriter struct{ t testing.TB }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Helper()
	w.t.Log(strings.TrimSuffix(string(p), "\n"))
	return len(p), nil
}

// checkNothingStranded fails t if any pending event is stranded (see
// outbox.stranded): whatever a test did, delivery must never leave an event
// that no rule will deliver. Tests that strand one on purpose do it on the
// SQL level, without a replica.
func checkNothingStranded(t testing.TB, pool *pgxpool.Pool) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var stranded int64
	err := pool.QueryRow(ctx, `SELECT coalesce(sum(events), 0)::bigint FROM outbox.stranded(NULL)`).Scan(&stranded)
	if err != nil {
		t.Errorf("servertest: counting stranded events: %v", err)
		return
	}
	if stranded != 0 {
		t.Errorf("servertest: %d stranded events when the test ended: pending, and no rule will deliver them", stranded)
	}
}

// Subscribed opens a Subscribe stream with req on ctx and returns nil once
// the server has accepted it (its session id header came), or the status
// that refused it. An accepted stream stays open until ctx ends.
func Subscribed(ctx context.Context, relay outboxv1.RelayServiceClient, req *outboxv1.SubscribeRequest) error {
	st, err := relay.Subscribe(ctx, req)
	if err != nil {
		return err
	}
	if h, err := st.Header(); err == nil && len(h.Get(server.SessionIDHeader)) == 1 {
		return nil
	}
	// A refusal ends the stream with its status instead.
	if _, err = st.Recv(); err == nil {
		return fmt.Errorf("servertest: Subscribe(%v): a message before the session id header", req)
	}
	return err
}
