package server_test

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/store"
	"github.com/outboxd/outboxd/server"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// replica is one running outboxd server on loopback.
type replica struct {
	srv    *server.Server
	conn   *grpc.ClientConn
	relay  outboxv1.RelayServiceClient
	admin  outboxv1.AdminServiceClient
	cancel context.CancelFunc
	addr   string
}

// startReplica runs a server on a loopback port against the database at url
// and returns a client connection to it; everything stops when t ends.
func startReplica(t testing.TB, url string, configure func(*server.Config)) *replica {
	t.Helper()
	return startReplicaWith(t, url, configure, nil)
}

// startReplicaWith is startReplica with extra gRPC server options and client
// dial options (interceptors, credentials).
func startReplicaWith(t testing.TB, url string, configure func(*server.Config), serverOpts []grpc.ServerOption, dialOpts ...grpc.DialOption) *replica {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	pool, err := pgxpool.New(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	cfg := server.Config{
		Store:             store.New(pool),
		DatabaseURL:       url,
		Logger:            testLogger(t),
		PollInterval:      200 * time.Millisecond,
		ReconcileInterval: 200 * time.Millisecond,
	}
	if configure != nil {
		configure(&cfg)
	}
	srv, err := server.New(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer(serverOpts...)
	srv.Register(g)
	healthpb.RegisterHealthServer(g, health.NewServer())
	runDone := make(chan struct{})
	go func() { defer close(runDone); _ = srv.Run(ctx) }()
	serveDone := make(chan struct{})
	go func() { defer close(serveDone); _ = g.Serve(lis) }()
	r := &replica{srv: srv, addr: lis.Addr().String(), cancel: cancel}
	conn, err := grpc.NewClient(r.addr, append([]grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}, dialOpts...)...)
	if err != nil {
		t.Fatal(err)
	}
	r.conn, r.relay, r.admin = conn, outboxv1.NewRelayServiceClient(conn), outboxv1.NewAdminServiceClient(conn)
	t.Cleanup(func() {
		conn.Close()
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
