package relay

import (
	"context"
	"encoding/json"
	"testing"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/outboxd/outboxd/client"
	"github.com/outboxd/outboxd/internal/servertest"
)

// A span in Run's context (the service's own, say) is not the publish's
// parent: with no tracer provider installed, the no-op tracer would hand
// that span back as the publish span, and its context would replace the
// producer's in the headers the broker gets. The producer's trace context
// reaches the broker as it was stored.
//
// The runner's default is the process-wide provider (otel.GetTracerProvider),
// which is that no-op until something calls otel.SetTracerProvider. Rather
// than depend on no test or init in this binary ever doing so, the test
// pins the API's own no-op provider, which behaves as the unset default:
// it returns a span from the context it is given.
func TestPublishIgnoresTheSpanOfRunsContext(t *testing.T) {
	t.Parallel()
	e := newEnv(t, servertest.Options{})
	const tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
	if _, err := client.Emit(context.Background(), e.pool, client.Event{
		Stream: "orders", AggregateKey: "1", Type: "T", Payload: json.RawMessage(`{}`),
		Headers: map[string]string{"traceparent": tp, "tracestate": "a=b"},
	}); err != nil {
		t.Fatal(err)
	}
	pub := newPublisher()
	service := trace.NewSpanContext(trace.SpanContextConfig{
		TraceID: trace.TraceID{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16},
		SpanID:  trace.SpanID{1, 2, 3, 4, 5, 6, 7, 8}, TraceFlags: trace.FlagsSampled,
	})
	startCtx(t, trace.ContextWithSpanContext(context.Background(), service),
		Config{Conn: e.srv.Conn, Publisher: pub, TracerProvider: noop.NewTracerProvider()}, hooks{})
	got := waitSignal(t, "a publish", pub.started)
	if got.Headers["traceparent"] != tp || got.Headers["tracestate"] != "a=b" {
		t.Errorf("published with headers %v, want the producer's trace context %s untouched", got.Headers, tp)
	}
}

// With a tracer installed, the headers the broker gets carry the publish
// span's trace context, and none of the producer's: its tracestate
// belongs to its traceparent and must not ride along with the relay's.
func TestPublishDropsTheProducersTraceStateWithItsTraceParent(t *testing.T) {
	t.Parallel()
	e := newEnv(t, servertest.Options{})
	const tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
	if _, err := client.Emit(context.Background(), e.pool, client.Event{
		Stream: "orders", AggregateKey: "1", Type: "T", Payload: json.RawMessage(`{}`),
		Headers: map[string]string{"traceparent": tp, "tracestate": "producer=1", "X-Tenant": "acme"},
	}); err != nil {
		t.Fatal(err)
	}
	provider := sdktrace.NewTracerProvider()
	t.Cleanup(func() { _ = provider.Shutdown(context.Background()) })
	pub := newPublisher()
	start(t, Config{Conn: e.srv.Conn, Publisher: pub, TracerProvider: provider}, hooks{})
	got := waitSignal(t, "a publish", pub.started)
	if got.Headers["traceparent"] == tp || got.Headers["traceparent"] == "" {
		t.Fatalf("published traceparent %q, want the publish span's", got.Headers["traceparent"])
	}
	if ts, ok := got.Headers["tracestate"]; ok {
		t.Errorf("published tracestate %q beside the relay's traceparent, want the producer's dropped", ts)
	}
	if got.Headers["X-Tenant"] != "acme" {
		t.Errorf("published headers %v lost the producer's own", got.Headers)
	}
}

// The publish span links to the producer's whole creation context: its
// traceparent and its tracestate, whatever case the producer wrote the
// header names in; a tracestate without a traceparent is no context.
func TestCreationContextReadsTraceParentAndTraceState(t *testing.T) {
	t.Parallel()
	const tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
	sc := creationContext(map[string]string{"TraceParent": tp, "TRACESTATE": "producer=1", "X-Tenant": "acme"})
	if !sc.IsValid() || sc.TraceID().String() != "0af7651916cd43dd8448eb211c80319c" || sc.TraceState().String() != "producer=1" {
		t.Errorf("creation context %+v (trace state %q), want the producer's trace and its state producer=1", sc, sc.TraceState().String())
	}
	for _, h := range []map[string]string{nil, {"X-Tenant": "acme"}, {"tracestate": "producer=1"}} {
		if sc := creationContext(h); sc.IsValid() {
			t.Errorf("creation context of headers %v: %+v, want none", h, sc)
		}
	}
}
