package app_test

import (
	"net"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/app"
	"github.com/outboxd/outboxd/internal/servertest"
	"github.com/outboxd/outboxd/internal/testdb"
)

// A replica that is starting (no readiness check has passed yet) is not
// ready: Ready stays open, since callers (servertest, serve's startup)
// wait on it before announcing the replica, and the gRPC health service
// answers NOT_SERVING for the server and both services, since load
// balancers probe it to decide whether to send relays. The replica's gRPC
// server is served here without Serve, so no readiness check runs and it
// stays starting. (Kills the mutants that close Ready, or publish SERVING,
// on any readiness.)
func TestNotReadyWhileStarting(t *testing.T) {
	t.Parallel()
	rep, err := app.New(t.Context(), app.Config{Server: newSource(t, "default").Server})
	if err != nil {
		t.Fatal(err)
	}
	defer rep.Shutdown()
	select {
	case <-rep.Ready():
		t.Errorf("Ready closed while the replica reports %+v", rep.Readiness())
	default:
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() { _ = rep.GRPC.Serve(lis) }()
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	for _, svc := range []string{"", outboxv1.RelayService_ServiceDesc.ServiceName, outboxv1.AdminService_ServiceDesc.ServiceName} {
		res, err := healthpb.NewHealthClient(conn).Check(t.Context(), &healthpb.HealthCheckRequest{Service: svc}, grpc.WaitForReady(true))
		if err != nil || res.GetStatus() != healthpb.HealthCheckResponse_NOT_SERVING {
			t.Errorf("health of %q while starting: %v, %v; want NOT_SERVING", svc, res.GetStatus(), err)
		}
	}
}

// Once Shutdown has begun the replica stays not ready ("shutting down"),
// whatever is published after: a reload of the sources file (SIGHUP during
// a stop, `systemctl reload`) marks sources pending and republishes the
// readiness, and a serving source must not put the stopping replica back
// into its load balancer. (Kills the mutants that drop the stopping guard
// of setReadinessLocked, and that drop Shutdown's "shutting down"
// readiness, which left /readyz reporting ready through the shutdown.)
func TestShutdownReadinessIsNotUndone(t *testing.T) {
	t.Parallel()
	r := servertest.Start(t, testdb.New(t), servertest.Options{})
	waitReady(t, r)
	r.App.Shutdown()
	if err := r.App.SetSourcePending("orders", "connection refused"); err != nil {
		t.Fatal(err)
	}
	r.App.ClearSourcePending("orders")
	if rd := r.App.Readiness(); rd.Ready || rd.Reason != "shutting down" {
		t.Errorf("after Shutdown and a reload the replica reports ready=%v %q; want not ready, shutting down", rd.Ready, rd.Reason)
	}
}
