// Package servertest runs an outboxd server replica on loopback for tests,
// as net/http/httptest does for HTTP handlers: a real gRPC server on
// 127.0.0.1, a client connection to it, and cleanup when the test ends.
package servertest

import (
	"context"
	"log/slog"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/store"
	"github.com/outboxd/outboxd/server"
)

// Replica is one running server and a client connection to it.
type Replica struct {
	Server *server.Server
	// Addr is the gRPC listen address.
	Addr  string
	Conn  *grpc.ClientConn
	Relay outboxv1.RelayServiceClient
	Admin outboxv1.AdminServiceClient
	// Pool is the replica's own database pool.
	Pool *pgxpool.Pool
}

// Options adjust a replica.
type Options struct {
	// Configure edits the server's Config after the test defaults are set:
	// logs to the test, 200 ms poll and reconcile intervals.
	Configure func(*server.Config)
	// ServerOptions are added to grpc.NewServer (interceptors, credentials).
	ServerOptions []grpc.ServerOption
	// DialOptions are added to the client connection.
	DialOptions []grpc.DialOption
}

// Start runs a replica against the database at url until t ends. The gRPC
// server also serves the health service, always SERVING.
func Start(t testing.TB, url string, opts Options) *Replica {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	poolCfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	store.ConfigurePool(poolCfg)
	pool, err := pgxpool.NewWithConfig(ctx, poolCfg)
	if err != nil {
		t.Fatal(err)
	}
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
	srv, err := server.New(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer(opts.ServerOptions...)
	srv.Register(g)
	healthpb.RegisterHealthServer(g, health.NewServer())
	runDone, serveDone := make(chan struct{}), make(chan struct{})
	go func() { defer close(runDone); _ = srv.Run(ctx) }()
	go func() { defer close(serveDone); _ = g.Serve(lis) }()
	r := &Replica{Server: srv, Addr: lis.Addr().String(), Pool: pool}
	dial := append([]grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}, opts.DialOptions...)
	if r.Conn, err = grpc.NewClient(r.Addr, dial...); err != nil {
		t.Fatal(err)
	}
	r.Relay, r.Admin = outboxv1.NewRelayServiceClient(r.Conn), outboxv1.NewAdminServiceClient(r.Conn)
	t.Cleanup(func() {
		r.Conn.Close()
		stopCtx, stopCancel := context.WithTimeout(context.Background(), 5*time.Second)
		srv.Stop(stopCtx)
		stopCancel()
		g.Stop()
		<-serveDone
		cancel()
		<-runDone
		pool.Close()
	})
	return r
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
