package sink

import (
	"context"
	"fmt"
	"io"
	"strings"

	"github.com/cloudevents/sdk-go/v2/binding"
	"github.com/cloudevents/sdk-go/v2/binding/format"
	"github.com/cloudevents/sdk-go/v2/binding/spec"
	"github.com/cloudevents/sdk-go/v2/event"
	"github.com/cloudevents/sdk-go/v2/types"

	"github.com/outboxd/outboxd/relay"
)

// CloudEvents 1.0, opt-in per sink with the URL parameters
//
//	cloudevents  binary or structured (default: off, the sink's own format)
//	ce_source    the source attribute, a URI-reference in which {stream}
//	             is replaced by the event's stream; default
//	             DefaultCESource
//
// Each event maps to: id = event ID, source = ce_source, type = event
// type, subject = aggregate key, time = created_at, datacontenttype =
// application/json, data = payload, and the extensions outboxstream (the
// stream) and outboxrevision (the revision, as a decimal string: CloudEvents
// integers are 32-bit, revisions 64-bit). The producer's traceparent and
// tracestate headers, if any, become the distributed-tracing extension's
// attributes.
//
// Binary mode keeps the sink's message (payload as body, the Outbox-*
// headers and the event's own headers) and adds each attribute as a header
// under the protocol binding's prefix: Kafka "ce_", HTTP and NATS "ce-",
// AMQP "cloudEvents:". Structured mode sends the event as
// application/cloudevents+json (format.JSON) as the body, keeping the
// headers. Redis Streams and stdout have no CloudEvents binding and refuse
// the parameters.

// DefaultCESource is ce_source's default: a URI-reference naming outboxd
// and the event's stream, so that (source, id) is unique as CloudEvents
// requires.
const DefaultCESource = "/outboxd/{stream}"

// CloudEvents extension attribute names outboxd sets (lowercase
// alphanumerics, as CloudEvents 1.0 requires).
const (
	CEExtensionStream   = "outboxstream"
	CEExtensionRevision = "outboxrevision"
)

// Content types of the two modes.
const (
	ceJSONContentType       = "application/json"
	ceStructuredContentType = event.ApplicationCloudEventsJSON
)

type ceMode int

const (
	ceOff ceMode = iota
	ceBinary
	ceStructured
)

// ceParams are the URL parameters every CloudEvents-capable sink accepts
// besides its own.
var ceParams = []string{"cloudevents", "ce_source"}

// ceConfig is a sink's CloudEvents setting.
type ceConfig struct {
	mode   ceMode
	source string
	// prefix is the protocol binding's header prefix for binary mode.
	prefix string
}

// parseCE reads the cloudevents and ce_source parameters from p.
func parseCE(p map[string]string, display, prefix string) (ceConfig, error) {
	c := ceConfig{source: DefaultCESource, prefix: prefix}
	switch v, ok := p["cloudevents"]; {
	case !ok:
		if _, set := p["ce_source"]; set {
			return c, invalid(display, "ce_source without cloudevents=binary or cloudevents=structured")
		}
		return c, nil
	case v == "binary":
		c.mode = ceBinary
	case v == "structured":
		c.mode = ceStructured
	default:
		return c, invalid(display, "cloudevents=%q: want binary or structured", v)
	}
	if v, ok := p["ce_source"]; ok {
		c.source = v
	}
	// Check the source with a sample stream, so a bad one is a
	// configuration error at start and not a failure of every event.
	probe := event.New()
	probe.SetID("probe")
	probe.SetType("probe")
	probe.SetSource(strings.ReplaceAll(c.source, "{stream}", "stream"))
	if err := probe.Validate(); err != nil || c.source == "" {
		return c, invalid(display, "ce_source=%q: want a non-empty URI-reference: %v", c.source, err)
	}
	return c, nil
}

// on reports whether CloudEvents are enabled.
func (c ceConfig) on() bool { return c.mode != ceOff }

// event maps ev to a CloudEvent. Its errors are permanent: the same event
// never maps differently.
func (c ceConfig) event(ev relay.Event) (*event.Event, error) {
	e := event.New(event.CloudEventsVersionV1)
	e.SetID(ev.MessageID())
	e.SetSource(strings.ReplaceAll(c.source, "{stream}", ev.Stream))
	e.SetType(ev.Type)
	e.SetSubject(ev.AggregateKey)
	e.SetTime(ev.CreatedAt)
	e.SetExtension(CEExtensionStream, ev.Stream)
	e.SetExtension(CEExtensionRevision, fmt.Sprint(ev.Revision))
	for _, h := range []string{"traceparent", "tracestate"} {
		if v, ok := lookupFold(ev.Headers, h); ok {
			e.SetExtension(h, v)
		}
	}
	// The payload is JSON text already: set it as is, not re-encoded.
	e.DataEncoded = ev.Payload
	e.SetDataContentType(ceJSONContentType)
	if err := e.Validate(); err != nil {
		return nil, relay.Permanent(fmt.Errorf("not a valid CloudEvent: %w", err))
	}
	return &e, nil
}

// structured returns ev as a CloudEvents JSON document
// (application/cloudevents+json).
func (c ceConfig) structured(ev relay.Event) ([]byte, error) {
	e, err := c.event(ev)
	if err != nil {
		return nil, err
	}
	b, err := format.JSON.Marshal(e)
	if err != nil {
		return nil, relay.Permanent(fmt.Errorf("encode CloudEvent: %w", err))
	}
	return b, nil
}

// binaryHeaders returns ev's CloudEvents attributes as headers under the
// binding's prefix, through the SDK's binding visitor so that each value
// is in its canonical string form (types.Format: times RFC 3339 in UTC,
// URIs as text). datacontenttype is not among them: the protocol's own
// content type carries it, as every binding says.
func (c ceConfig) binaryHeaders(ev relay.Event) (map[string]string, error) {
	e, err := c.event(ev)
	if err != nil {
		return nil, err
	}
	w := &ceHeaderWriter{prefix: c.prefix, out: map[string]string{}}
	if err := binding.ToMessage(e).ReadBinary(context.Background(), w); err != nil {
		return nil, relay.Permanent(fmt.Errorf("encode CloudEvent attributes: %w", err))
	}
	return w.out, nil
}

// checkHeader refuses, in binary mode, a producer header that the binding
// would read as a CloudEvents attribute, so the event fails visibly rather
// than carry two values for one attribute.
func (c ceConfig) checkHeader(name string) error {
	if c.mode != ceBinary || len(name) < len(c.prefix) || !strings.EqualFold(name[:len(c.prefix)], c.prefix) {
		return nil
	}
	return relay.Permanent(fmt.Errorf("header name %q uses the CloudEvents prefix %q", name, c.prefix))
}

// ceHeaderWriter is a binding.BinaryWriter collecting attributes as
// prefixed headers.
type ceHeaderWriter struct {
	prefix string
	out    map[string]string
}

func (w *ceHeaderWriter) Start(context.Context) error { return nil }
func (w *ceHeaderWriter) End(context.Context) error   { return nil }
func (w *ceHeaderWriter) SetData(io.Reader) error     { return nil }

func (w *ceHeaderWriter) SetAttribute(a spec.Attribute, value any) error {
	if a.Kind() == spec.DataContentType {
		return nil
	}
	return w.SetExtension(a.Name(), value)
}

func (w *ceHeaderWriter) SetExtension(name string, value any) error {
	if value == nil {
		return nil
	}
	s, err := types.Format(value)
	if err != nil {
		return err
	}
	w.out[w.prefix+name] = s
	return nil
}

// lookupFold finds a header by name, ignoring case.
func lookupFold(h map[string]string, name string) (string, bool) {
	for k, v := range h {
		if strings.EqualFold(k, name) {
			return v, true
		}
	}
	return "", false
}

// ceMessage is what a sink sends for one event: its body, content type and
// the CloudEvents headers to add (binary mode only).
type ceMessage struct {
	body        []byte
	contentType string
	headers     map[string]string
}

// message returns the body, content type and extra headers of ev in the
// configured mode; with CloudEvents off, the payload as application/json.
func (c ceConfig) message(ev relay.Event) (ceMessage, error) {
	switch c.mode {
	case ceBinary:
		h, err := c.binaryHeaders(ev)
		return ceMessage{body: ev.Payload, contentType: ceJSONContentType, headers: h}, err
	case ceStructured:
		b, err := c.structured(ev)
		return ceMessage{body: b, contentType: ceStructuredContentType}, err
	default:
		return ceMessage{body: ev.Payload, contentType: ceJSONContentType}, nil
	}
}
