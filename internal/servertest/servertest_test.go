package servertest_test

import (
	"context"
	"strings"
	"testing"

	"go.uber.org/goleak"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/servertest"
	"github.com/outboxd/outboxd/internal/testdb"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// A test replica is the production server: it refuses a request over the
// listener's size limit before decoding it, reports SERVING once ready,
// and NOT_SERVING (then closes) when it shuts down.
func TestReplicaRunsTheProductionServer(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	r := servertest.Start(t, testdb.New(t), servertest.Options{})
	big := &outboxv1.AckRequest{Acks: []*outboxv1.AckItem{{EventId: "x", LeaseToken: strings.Repeat("A", 2<<20)}}}
	if _, err := r.Relay.Ack(ctx, big); status.Code(err) != codes.ResourceExhausted {
		t.Fatalf("2 MiB Ack: %v, want ResourceExhausted (the production receive limit)", err)
	}
	health := healthpb.NewHealthClient(r.Conn)
	res, err := health.Check(ctx, &healthpb.HealthCheckRequest{Service: outboxv1.RelayService_ServiceDesc.ServiceName})
	if err != nil || res.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("health of a ready replica: %v, %v", res, err)
	}
	watch, err := health.Watch(ctx, &healthpb.HealthCheckRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if res, err := watch.Recv(); err != nil || res.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("health watch: %v, %v", res, err)
	}
	go r.Close()
	for {
		res, err := watch.Recv()
		if err != nil {
			t.Fatalf("replica closed without reporting NOT_SERVING: %v", err)
		}
		if res.GetStatus() == healthpb.HealthCheckResponse_NOT_SERVING {
			break
		}
	}
}
