package app_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/contrib/instrumentation/google.golang.org/grpc/otelgrpc"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"google.golang.org/grpc"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/app"
	"github.com/outboxd/outboxd/internal/servertest"
	"github.com/outboxd/outboxd/internal/store"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/server"
)

// The production server makes a SERVER span per RPC, child of the caller's
// W3C trace context, and none for health checks.
func TestServerSpansPerRPC(t *testing.T) {
	url := testdb.New(t)
	pool, err := pgxpool.New(t.Context(), url)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	defer tp.Shutdown(context.Background())

	ctx := context.Background()
	rep, err := app.New(ctx, app.Config{
		Server:         server.Config{Store: store.New(pool), DatabaseURL: url, Logger: servertest.Logger(t)},
		TracerProvider: tp,
	})
	if err != nil {
		t.Fatal(err)
	}
	addr, stop := serveLoopback(t, ctx, rep)

	// The client sends its span's context as traceparent metadata.
	conn := dialPlain(t, addr, grpc.WithStatsHandler(otelgrpc.NewClientHandler(otelgrpc.WithTracerProvider(tp),
		otelgrpc.WithPropagators(propagation.TraceContext{}))))
	if _, err := healthpb.NewHealthClient(conn).Check(t.Context(), &healthpb.HealthCheckRequest{}); err != nil {
		t.Fatal(err)
	}
	if _, err := outboxv1.NewAdminServiceClient(conn).GetLag(t.Context(), &outboxv1.GetLagRequest{}); err != nil {
		t.Fatal(err)
	}

	// A server span ends after its response is sent; once Serve has
	// returned (a graceful stop waits for handlers) every one has ended.
	stop()

	byKind := map[trace.SpanKind]map[string]sdktrace.ReadOnlySpan{}
	for _, s := range rec.Ended() {
		if byKind[s.SpanKind()] == nil {
			byKind[s.SpanKind()] = map[string]sdktrace.ReadOnlySpan{}
		}
		byKind[s.SpanKind()][s.Name()] = s
	}
	const lag = "outbox.v1.AdminService/GetLag"
	srv, cli := byKind[trace.SpanKindServer][lag], byKind[trace.SpanKindClient][lag]
	if srv == nil || cli == nil {
		t.Fatalf("spans %v: want a server and a client span for %s", byKind, lag)
	}
	if srv.Parent().SpanID() != cli.SpanContext().SpanID() || srv.SpanContext().TraceID() != cli.SpanContext().TraceID() {
		t.Errorf("server span's parent %v, want the client's span %v", srv.Parent(), cli.SpanContext())
	}
	if h := byKind[trace.SpanKindServer]["grpc.health.v1.Health/Check"]; h != nil {
		t.Errorf("health check traced: %v", h.Name())
	}
}
