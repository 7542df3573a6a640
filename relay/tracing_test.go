package relay

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/outboxd/outboxd/client"
	"github.com/outboxd/outboxd/internal/servertest"
	"github.com/outboxd/outboxd/server"
)

// flakyPublisher fails the first attempt at each event and records the
// events it accepted.
type flakyPublisher struct {
	mu       sync.Mutex
	attempts map[string]int
	accepted map[string]Event
}

var errBrokerDown = errors.New("broker down")

func (p *flakyPublisher) Publish(_ context.Context, ev Event) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.attempts[ev.ID]++
	if p.attempts[ev.ID] == 1 {
		return errBrokerDown
	}
	p.accepted[ev.ID] = ev
	return nil
}

// TestPublishSpanLinksToProducerAndTravels emits one event inside a
// producer's span and one without, through a real server, and checks each
// publish attempt's span: a PRODUCER root span with the messaging
// attributes, linked to the producer's span, Error on the failed attempt;
// and the context of the successful attempt's span in the headers the
// publisher got, the stored event left as the producer wrote it.
func TestPublishSpanLinksToProducerAndTravels(t *testing.T) {
	e := newEnv(t, servertest.Options{Configure: func(c *server.Config) {
		c.BackoffBase, c.BackoffCap = time.Millisecond, time.Millisecond
	}})
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })

	producerCtx, producer := tp.Tracer("producer").Start(context.Background(), "place order")
	traced, err := client.Emit(producerCtx, e.pool, client.Event{
		Stream: "orders", AggregateKey: "1", Type: "OrderPlaced", Payload: json.RawMessage(`{}`),
		Headers: map[string]string{"X-Tenant": "acme"},
	})
	producer.End()
	if err != nil {
		t.Fatal(err)
	}
	untraced := e.emit(t, "orders", "2")

	pub := &flakyPublisher{attempts: map[string]int{}, accepted: map[string]Event{}}
	start(t, Config{Conn: e.srv.Conn, Publisher: pub, TracerProvider: tp, MessagingSystem: "test-broker"}, hooks{})
	e.waitPublished(t, traced.ID.String(), untraced)

	// Two attempts per event, each its own span: the first failed.
	spans := map[string][]sdktrace.ReadOnlySpan{}
	for _, s := range rec.Ended() {
		if s.SpanKind() != trace.SpanKindProducer {
			continue
		}
		id := attrOf(s, "messaging.message.id").AsString()
		spans[id] = append(spans[id], s)
	}
	for _, id := range []string{traced.ID.String(), untraced} {
		got := spans[id]
		if len(got) != 2 {
			t.Fatalf("event %s: %d publish spans, want 2 (a failed attempt and a successful one)", id, len(got))
		}
		failed, ok := got[0], got[1]
		for i, s := range got {
			if s.Parent().IsValid() {
				t.Errorf("event %s attempt %d: span has parent %v, want a root span", id, i+1, s.Parent())
			}
			if s.Name() != "send orders" {
				t.Errorf("span name %q, want %q", s.Name(), "send orders")
			}
			for k, want := range map[string]any{
				"messaging.system": "test-broker", "messaging.operation.type": "send",
				"messaging.destination.name": "orders", "outbox.attempt": int64(i + 1),
			} {
				if v := attrOf(s, attribute.Key(k)).AsInterface(); v != want {
					t.Errorf("event %s attempt %d: %s = %v, want %v", id, i+1, k, v, want)
				}
			}
		}
		if failed.Status().Code != codes.Error || failed.Status().Description != errBrokerDown.Error() {
			t.Errorf("failed attempt's status %+v, want Error %q", failed.Status(), errBrokerDown)
		}
		if ok.Status().Code == codes.Error {
			t.Errorf("successful attempt's status %+v", ok.Status())
		}
		// The headers the broker got carry the successful attempt's span.
		pub.mu.Lock()
		headers := pub.accepted[id].Headers
		pub.mu.Unlock()
		sc := ok.SpanContext()
		if want := fmt.Sprintf("00-%s-%s-01", sc.TraceID(), sc.SpanID()); headers["traceparent"] != want {
			t.Errorf("event %s: published traceparent %q, want the publish span's %q", id, headers["traceparent"], want)
		}
	}

	// The traced event's spans link to the producer's span; the other's
	// link to nothing.
	for _, s := range spans[traced.ID.String()] {
		if l := s.Links(); len(l) != 1 || l[0].SpanContext.SpanID() != producer.SpanContext().SpanID() ||
			l[0].SpanContext.TraceID() != producer.SpanContext().TraceID() {
			t.Errorf("traced event's span links %+v, want one to the producer's span %v", l, producer.SpanContext())
		}
	}
	for _, s := range spans[untraced] {
		if len(s.Links()) != 0 {
			t.Errorf("untraced event's span links %+v, want none", s.Links())
		}
	}
	pub.mu.Lock()
	if h := pub.accepted[traced.ID.String()].Headers; h["X-Tenant"] != "acme" {
		t.Errorf("published headers %v lost the producer's own", h)
	}
	pub.mu.Unlock()
	var stored map[string]string
	if err := e.pool.QueryRow(context.Background(), `SELECT headers FROM outbox.event WHERE event_id = $1`, traced.ID).Scan(&stored); err != nil {
		t.Fatal(err)
	}
	psc := producer.SpanContext()
	if want := fmt.Sprintf("00-%s-%s-01", psc.TraceID(), psc.SpanID()); stored["traceparent"] != want {
		t.Errorf("stored traceparent %q, want the producer's %q", stored["traceparent"], want)
	}
}

// TestPublishWithoutTracerLeavesHeaders checks the default: no tracer
// provider installed, the producer's trace context reaches the broker as it
// was stored.
func TestPublishWithoutTracerLeavesHeaders(t *testing.T) {
	e := newEnv(t, servertest.Options{})
	const tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
	ev, err := client.Emit(context.Background(), e.pool, client.Event{
		Stream: "orders", AggregateKey: "1", Type: "T", Payload: json.RawMessage(`{}`),
		Headers: map[string]string{"traceparent": tp, "tracestate": "a=b"},
	})
	if err != nil {
		t.Fatal(err)
	}
	pub := newPublisher()
	start(t, Config{Conn: e.srv.Conn, Publisher: pub}, hooks{})
	got := waitSignal(t, "a publish", pub.started)
	if got.ID != ev.ID.String() || got.Headers["traceparent"] != tp || got.Headers["tracestate"] != "a=b" {
		t.Errorf("published %s with headers %v, want %s with the stored trace context", got.ID, got.Headers, ev.ID)
	}
}

func attrOf(s sdktrace.ReadOnlySpan, k attribute.Key) attribute.Value {
	for _, kv := range s.Attributes() {
		if kv.Key == k {
			return kv.Value
		}
	}
	return attribute.Value{}
}
