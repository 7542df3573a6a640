package relay

import (
	"context"
	"strings"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"
)

// Tracing. Every publish runs in an OpenTelemetry span of kind PRODUCER,
// following the messaging semantic conventions for a "send" operation:
// messaging.system (Config.MessagingSystem), messaging.destination.name
// (the event's outbox stream: the broker's subject or topic is rendered
// inside the sink, from its template), messaging.message.id (the event
// id), and outbox.aggregate_key, outbox.revision, outbox.event_type and
// outbox.attempt. A failed publish sets the span's status to Error with
// the error recorded, and error.type.
//
// The span is the root of a trace of its own and LINKS to the context the
// producer stored in the event's headers (client.Emit's traceparent and
// tracestate) instead of being its child. The conventions ask for exactly
// this when a message carries a creation context of its own ("the 'Send'
// span SHOULD link to the custom creation context"), and here a parent
// would also mislead: the publish happens in the relay, later, once per
// attempt, after the producer's operation has ended, and no more belongs
// inside its trace than a consumer's processing does.
//
// The relay's span context then travels with the message: the sink gets a
// copy of the event's headers whose traceparent and tracestate are the
// publish span's, so a consumer's span parents on (or links to) the send
// that delivered the message, and through its link reaches the producer.
// With no tracer provider installed (the default) the span is a no-op,
// invalid, and the headers pass through untouched, the producer's context
// included.

// instrumentationName names the relay's tracer.
const instrumentationName = "github.com/outboxd/outboxd/relay"

// traceContextKeys are the W3C trace context headers (lower case, as the
// propagator writes them).
var traceContextKeys = []string{"traceparent", "tracestate"}

// tracedPublisher wraps a Publisher in a producer span per publish.
type tracedPublisher struct {
	next   Publisher
	tracer trace.Tracer
	system string
}

// newTracedPublisher wraps cfg.Publisher; it is the runner's publisher.
func newTracedPublisher(cfg Config) Publisher {
	tp := cfg.TracerProvider
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	return &tracedPublisher{
		next:   cfg.Publisher,
		tracer: tp.Tracer(instrumentationName),
		system: cfg.MessagingSystem,
	}
}

func (p *tracedPublisher) Publish(ctx context.Context, ev Event) error {
	attrs := []attribute.KeyValue{
		semconv.MessagingOperationTypeSend,
		semconv.MessagingOperationName("send"),
		semconv.MessagingDestinationName(ev.Stream),
		semconv.MessagingMessageID(ev.ID),
		semconv.MessagingMessageBodySize(len(ev.Payload)),
		attribute.String("outbox.aggregate_key", ev.AggregateKey),
		attribute.Int64("outbox.revision", ev.Revision),
		attribute.String("outbox.event_type", ev.Type),
		attribute.Int("outbox.attempt", ev.Attempt),
	}
	if p.system != "" {
		attrs = append(attrs, semconv.MessagingSystemKey.String(p.system))
	}
	opts := []trace.SpanStartOption{
		trace.WithSpanKind(trace.SpanKindProducer), trace.WithNewRoot(), trace.WithAttributes(attrs...),
	}
	if created := creationContext(ev.Headers); created.IsValid() {
		opts = append(opts, trace.WithLinks(trace.Link{SpanContext: created}))
	}
	// Whatever span Run's context carries is not the publish's parent (and
	// a no-op tracer would hand it back as the publish span).
	ctx = trace.ContextWithSpanContext(ctx, trace.SpanContext{})
	ctx, span := p.tracer.Start(ctx, "send "+ev.Stream, opts...)
	defer span.End()
	if span.SpanContext().IsValid() {
		ev.Headers = withTraceContext(ctx, ev.Headers)
	}
	err := p.next.Publish(ctx, ev)
	if err != nil {
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
		span.SetAttributes(semconv.ErrorType(err))
	}
	return err
}

// creationContext is the trace context the producer stored in headers, if
// any: an invalid SpanContext when there is none or it does not parse.
func creationContext(h map[string]string) trace.SpanContext {
	// Most events carry no trace context: found nothing, allocated nothing
	// (a carrier per publish was a few per cent of a relay's CPU).
	var carrier propagation.MapCarrier
	for k, v := range h {
		for _, tk := range traceContextKeys {
			if strings.EqualFold(k, tk) {
				if carrier == nil {
					carrier = make(propagation.MapCarrier, len(traceContextKeys))
				}
				carrier[tk] = v
			}
		}
	}
	if carrier["traceparent"] == "" {
		return trace.SpanContext{}
	}
	return trace.SpanContextFromContext(propagation.TraceContext{}.Extract(context.Background(), carrier))
}

// withTraceContext returns a copy of h in which ctx's span context replaces
// any trace context headers: the producer's tracestate must not outlive its
// traceparent. h itself is shared with the runner and never written.
func withTraceContext(ctx context.Context, h map[string]string) map[string]string {
	out := make(map[string]string, len(h)+len(traceContextKeys))
	for k, v := range h {
		if !strings.EqualFold(k, traceContextKeys[0]) && !strings.EqualFold(k, traceContextKeys[1]) {
			out[k] = v
		}
	}
	propagation.TraceContext{}.Inject(ctx, propagation.MapCarrier(out))
	return out
}
