package sink_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"testing"

	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/outboxd/outboxd/client"
	"github.com/outboxd/outboxd/internal/servertest"
	"github.com/outboxd/outboxd/relay"
	"github.com/outboxd/outboxd/relay/sink"
)

// These tests follow one trace end to end: a producer emits inside its
// span, the real runner publishes through a real sink, and the message the
// broker holds carries the context of the relay's publish span, which links
// back to the producer's.

// tracedRelay emits one event inside a producer span, relays it through s
// with a recording tracer, and returns the producer's span context and the
// relay's publish span once the event is published.
func tracedRelay(t *testing.T, sinkURL string, s relay.Publisher) (producer trace.SpanContext, publish sdktrace.ReadOnlySpan) {
	t.Helper()
	e := newRelayEnv(t, nil)
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })

	ctx, span := tp.Tracer("producer").Start(context.Background(), "place order")
	_, err := client.Emit(ctx, e.pool, client.Event{
		Stream: "orders", AggregateKey: "42", Type: "OrderPlaced", Payload: json.RawMessage(`{"n":1}`),
		Headers: map[string]string{"X-Tenant": "acme"},
	})
	span.End()
	if err != nil {
		t.Fatal(err)
	}
	r, err := relay.NewRunner(relay.Config{
		Conn: e.srv.Conn, Publisher: s, Logger: servertest.Logger(t),
		TracerProvider: tp, MessagingSystem: sink.MessagingSystem(sinkURL),
	})
	if err != nil {
		t.Fatal(err)
	}
	runCtx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(runCtx) }()
	e.waitPublished(t, 1)
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run: %v", err)
	}
	for _, s := range rec.Ended() {
		if s.SpanKind() == trace.SpanKindProducer {
			if publish != nil {
				t.Fatalf("more than one publish span: %v and %v", publish.Name(), s.Name())
			}
			publish = s
		}
	}
	if publish == nil {
		t.Fatal("no publish span recorded")
	}
	if l := publish.Links(); len(l) != 1 || !l[0].SpanContext.Equal(span.SpanContext().WithRemote(true)) {
		t.Errorf("publish span links %+v, want one to the producer's span %v", l, span.SpanContext())
	}
	return span.SpanContext(), publish
}

func traceparentOf(sc trace.SpanContext) string {
	return fmt.Sprintf("00-%s-%s-01", sc.TraceID(), sc.SpanID())
}

func TestTraceContextReachesNATSMessage(t *testing.T) {
	t.Parallel()
	js := newJSEnv(t)
	url := js.url(nil)
	_, publish := tracedRelay(t, url, js.open(t, nil))
	if got := spanAttr(publish, "messaging.system"); got != "nats" {
		t.Errorf("messaging.system %q, want nats", got)
	}
	msg := js.fetch(t, 1)[0]
	h := msg.Headers()
	if got, want := h.Get("traceparent"), traceparentOf(publish.SpanContext()); got != want {
		t.Errorf("message traceparent %q, want the publish span's %q (headers %v)", got, want, h)
	}
	if h.Get("X-Tenant") != "acme" {
		t.Errorf("message headers %v lost the producer's own", h)
	}
}

func TestTraceContextReachesStdoutLine(t *testing.T) {
	t.Parallel()
	var out traceOutput
	s, err := sink.Open(t.Context(), "stdout://", sink.Options{Stdout: &out})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	_, publish := tracedRelay(t, "stdout://", s)
	var line struct {
		Headers map[string]string `json:"headers"`
	}
	if err := json.Unmarshal(out.Bytes(), &line); err != nil {
		t.Fatalf("stdout line %q: %v", out.Bytes(), err)
	}
	if got, want := line.Headers["traceparent"], traceparentOf(publish.SpanContext()); got != want {
		t.Errorf("line's traceparent %q, want the publish span's %q", got, want)
	}
}

func spanAttr(s sdktrace.ReadOnlySpan, k string) string {
	for _, kv := range s.Attributes() {
		if string(kv.Key) == k {
			return kv.Value.Emit()
		}
	}
	return ""
}

// traceOutput is a bytes.Buffer safe for the sink's writes and the test's
// read.
type traceOutput struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *traceOutput) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *traceOutput) Bytes() []byte {
	b.mu.Lock()
	defer b.mu.Unlock()
	return bytes.Clone(b.b.Bytes())
}
