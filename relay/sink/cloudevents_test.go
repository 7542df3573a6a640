package sink_test

import (
	"encoding/json"
	"errors"
	"net/http"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	cehttp "github.com/cloudevents/sdk-go/v2/protocol/http"

	"github.com/outboxd/outboxd/relay"
	"github.com/outboxd/outboxd/relay/sink"
)

// These tests publish testEvent through each sink with cloudevents=binary
// and cloudevents=structured, read the message back from the real broker
// (kfake for Kafka, an httptest receiver for webhooks), and compare its
// CloudEvents attributes with values written out here, independently of
// the mapping code.

const ceTime = "2025-03-04T05:06:07.123456789Z" // testEvent's CreatedAt

// ceAttrs are testEvent's CloudEvents attributes (datacontenttype aside,
// which binary mode carries as the protocol's content type), for a source.
func ceAttrs(id, source string) map[string]string {
	return map[string]string{
		"specversion":    "1.0",
		"id":             id,
		"source":         source,
		"type":           "OrderPlaced",
		"subject":        "order-42",
		"time":           ceTime,
		"outboxstream":   "orders.eu",
		"outboxrevision": "7",
		"traceparent":    "00-4bf92f3577b34da6-00f067aa0ba902b7-01",
	}
}

// checkBinary checks the headers under prefix (other headers ignored) and
// the content type and body of a binary-mode message.
func checkBinary(t *testing.T, what, prefix string, headers map[string]string, contentType string, body []byte, want map[string]string) {
	t.Helper()
	got := map[string]string{}
	for k, v := range headers {
		if len(k) > len(prefix) && strings.EqualFold(k[:len(prefix)], prefix) {
			got[strings.ToLower(k[len(prefix):])] = v
		}
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("%s: CloudEvents headers (%s*)\n got %v\nwant %v", what, prefix, got, want)
	}
	if contentType != "application/json" {
		t.Errorf("%s: content type %q, want application/json (datacontenttype)", what, contentType)
	}
	if string(body) != string(testEvent("").Payload) {
		t.Errorf("%s: body %s, want the payload", what, body)
	}
}

// checkStructured checks a structured-mode message: content type
// application/cloudevents+json and a JSON body holding every attribute and
// the payload as data.
func checkStructured(t *testing.T, what, contentType string, body []byte, want map[string]string) {
	t.Helper()
	if contentType != "application/cloudevents+json" {
		t.Errorf("%s: content type %q, want application/cloudevents+json", what, contentType)
	}
	var doc map[string]any
	if err := json.Unmarshal(body, &doc); err != nil {
		t.Fatalf("%s: body is not JSON: %v\n%s", what, err, body)
	}
	wantDoc := map[string]any{"datacontenttype": "application/json"}
	for k, v := range want {
		wantDoc[k] = v
	}
	var data any
	if err := json.Unmarshal(testEvent("").Payload, &data); err != nil {
		t.Fatal(err)
	}
	wantDoc["data"] = data
	if !reflect.DeepEqual(doc, wantDoc) {
		t.Errorf("%s: structured event\n got %v\nwant %v", what, doc, wantDoc)
	}
}

// publishBoth publishes the event e-bin through bin and e-str through str.
func publishBoth(t *testing.T, bin, str relay.Publisher) {
	t.Helper()
	if err := bin.Publish(t.Context(), testEvent("e-bin")); err != nil {
		t.Fatal(err)
	}
	if err := str.Publish(t.Context(), testEvent("e-str")); err != nil {
		t.Fatal(err)
	}
}

func TestCloudEventsKafka(t *testing.T) {
	t.Parallel()
	c := newKafka(t, "outbox.orders.eu")
	bin := openSink(t, kafkaSinkURL(c, map[string]string{"cloudevents": "binary"}))
	str := openSink(t, kafkaSinkURL(c, map[string]string{"cloudevents": "structured", "ce_source": "https://shop.example/{stream}"}))
	publishBoth(t, bin, str)
	for _, r := range consume(t, c, 2, "outbox.orders.eu") {
		h := map[string]string{}
		for _, x := range r.Headers {
			h[x.Key] = string(x.Value)
		}
		if h["Outbox-Event-Id"] == "" || h["X-Tenant"] != "acme" {
			t.Errorf("record %s lost the Outbox-* or the event's own headers: %v", h["Outbox-Event-Id"], h)
		}
		switch id := h["Outbox-Event-Id"]; id {
		case "e-bin":
			checkBinary(t, "kafka binary", "ce_", h, h["content-type"], r.Value, ceAttrs(id, "/outboxd/orders.eu"))
		case "e-str":
			checkStructured(t, "kafka structured", h["content-type"], r.Value, ceAttrs(id, "https://shop.example/orders.eu"))
		default:
			t.Errorf("unexpected record %q", id)
		}
	}
}

func TestCloudEventsAMQP(t *testing.T) {
	t.Parallel()
	e := newRabbitEnv(t, "#")
	bin := openSink(t, e.url(map[string]string{"cloudevents": "binary"}))
	str := openSink(t, e.url(map[string]string{"cloudevents": "structured"}))
	publishBoth(t, bin, str)
	for _, d := range e.get(t, 2) {
		h := map[string]string{}
		for k, v := range d.Headers {
			s, _ := v.(string)
			h[k] = s
		}
		if h["X-Tenant"] != "acme" {
			t.Errorf("message %s lost the event's own headers: %v", d.MessageId, h)
		}
		switch d.MessageId {
		case "e-bin":
			checkBinary(t, "amqp binary", "cloudEvents:", h, d.ContentType, d.Body, ceAttrs(d.MessageId, "/outboxd/orders.eu"))
		case "e-str":
			checkStructured(t, "amqp structured", d.ContentType, d.Body, ceAttrs(d.MessageId, "/outboxd/orders.eu"))
		default:
			t.Errorf("unexpected message %q", d.MessageId)
		}
	}
}

func TestCloudEventsNATS(t *testing.T) {
	t.Parallel()
	e := newJSEnv(t)
	bin := e.open(t, map[string]string{"cloudevents": "binary"})
	str := e.open(t, map[string]string{"cloudevents": "structured"})
	publishBoth(t, bin, str)
	for _, m := range e.fetch(t, 2) {
		h := map[string]string{}
		for k, vs := range m.Headers() {
			h[k] = vs[0]
		}
		if h["X-Tenant"] != "acme" || h["Nats-Msg-Id"] == "" {
			t.Errorf("message lost the event's own or the dedup headers: %v", h)
		}
		switch id := h["Outbox-Event-Id"]; id {
		case "e-bin":
			checkBinary(t, "nats binary", "ce-", h, h["content-type"], m.Data(), ceAttrs(id, "/outboxd/orders.eu"))
		case "e-str":
			checkStructured(t, "nats structured", h["content-type"], m.Data(), ceAttrs(id, "/outboxd/orders.eu"))
		default:
			t.Errorf("unexpected message %q", id)
		}
	}
}

// The webhook receiver also decodes each request with the CloudEvents SDK's
// HTTP binding, as a CloudEvents-aware receiver would; the Standard
// Webhooks signature covers the body in both modes.
func TestCloudEventsWebhook(t *testing.T) {
	t.Parallel()
	h := newHook(t)
	var (
		mu  sync.Mutex
		got []http.Header
		bod [][]byte
	)
	h.answer = func(w http.ResponseWriter, r *http.Request, body []byte) bool {
		if err := verifyStandardWebhook(h.secret, r.Header, body, time.Now()); err != nil {
			http.Error(w, err.Error(), http.StatusUnauthorized)
			return true
		}
		mu.Lock()
		got, bod = append(got, r.Header.Clone()), append(bod, body)
		mu.Unlock()
		w.WriteHeader(http.StatusNoContent)
		return true
	}
	bin := openSink(t, h.url(t, map[string]string{"cloudevents": "binary"}))
	str := openSink(t, h.url(t, map[string]string{"cloudevents": "structured"}))
	publishBoth(t, bin, str)
	mu.Lock()
	defer mu.Unlock()
	if len(got) != 2 {
		t.Fatalf("receiver got %d requests, want 2", len(got))
	}
	for i, header := range got {
		hd := map[string]string{}
		for k, vs := range header {
			hd[k] = vs[0]
		}
		r, err := http.NewRequest(http.MethodPost, "/", strings.NewReader(string(bod[i])))
		if err != nil {
			t.Fatal(err)
		}
		r.Header = header
		id := r.Header.Get("webhook-id")
		switch id {
		case "e-bin":
			checkBinary(t, "webhook binary", "ce-", hd, r.Header.Get("Content-Type"), bod[i], ceAttrs(id, "/outboxd/orders.eu"))
		case "e-str":
			checkStructured(t, "webhook structured", r.Header.Get("Content-Type"), bod[i], ceAttrs(id, "/outboxd/orders.eu"))
		default:
			t.Errorf("unexpected request %q", id)
		}
		if r.Header.Get("traceparent") == "" {
			t.Errorf("%s: the W3C traceparent header was not forwarded", id)
		}
		// As the README says: the event's other headers are not sent.
		if v := r.Header.Get("X-Tenant"); v != "" || strings.Contains(string(bod[i]), "X-Tenant") {
			t.Errorf("%s: the producer header X-Tenant was sent (header %q)", id, v)
		}
		// The SDK's HTTP binding reads it back as the same event.
		ce, err := cehttp.NewEventFromHTTPRequest(r)
		if err != nil {
			t.Errorf("%s: the CloudEvents SDK cannot read the request: %v", id, err)
			continue
		}
		if ce.ID() != id || ce.Subject() != "order-42" || ce.Type() != "OrderPlaced" || string(ce.Data()) != string(testEvent("").Payload) {
			t.Errorf("%s: the SDK read %v", id, ce)
		}
	}
}

// Sinks without a CloudEvents binding, and bad values, are refused at
// Open as configuration errors.
func TestCloudEventsOpenErrors(t *testing.T) {
	t.Parallel()
	for _, c := range []struct{ url, want string }{
		{"redis://127.0.0.1:1/0?cloudevents=binary", "no CloudEvents binding"},
		{"stdout://?cloudevents=structured", "no CloudEvents binding"},
		{"kafka://127.0.0.1:1?cloudevents=json", `cloudevents="json": want binary or structured`},
		{"kafka://127.0.0.1:1?ce_source=/x", "ce_source without cloudevents"},
		{"kafka://127.0.0.1:1?cloudevents=binary&ce_source=", "ce_source"},
		{"kafka://127.0.0.1:1?cloudevents=binary&ce_source=%25zz%20bad", "ce_source"},
	} {
		s, err := sink.Open(t.Context(), c.url, sink.Options{})
		if err == nil {
			s.Close()
			t.Errorf("Open(%s) succeeded", c.url)
			continue
		}
		if !errors.Is(err, sink.ErrInvalidURL) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("Open(%s) = %v, want it to mention %q", c.url, err, c.want)
		}
	}
}

// In binary mode a producer header under the binding's prefix would give
// the message a second value for a CloudEvents attribute, and an event
// without a type is no CloudEvent: both are refused for good (the event
// never changes), and nothing reaches the broker.
func TestCloudEventsRefusalsArePermanent(t *testing.T) {
	t.Parallel()
	untyped := testEvent("e-untyped")
	untyped.Type = ""
	check := func(what string, s relay.Publisher, prefix string) {
		t.Helper()
		spoof := testEvent("e-spoof")
		spoof.Headers = map[string]string{strings.ToUpper(prefix) + "id": "other"}
		if err := s.Publish(t.Context(), spoof); err == nil || !relay.IsPermanent(err) || !strings.Contains(err.Error(), "CloudEvents prefix") {
			t.Errorf("%s: Publish with header %sid = %v (permanent: %v), want a permanent CloudEvents-prefix error", what, prefix, err, relay.IsPermanent(err))
		}
		if err := s.Publish(t.Context(), untyped); err == nil || !relay.IsPermanent(err) {
			t.Errorf("%s: Publish of an event without a type = %v (permanent: %v), want a permanent error", what, err, relay.IsPermanent(err))
		}
	}

	js := newJSEnv(t)
	check("nats", js.open(t, map[string]string{"cloudevents": "binary"}), "ce-")
	js.fetch(t, 0)

	rabbit := newRabbitEnv(t, "#")
	check("amqp", openSink(t, rabbit.url(map[string]string{"cloudevents": "binary"})), "cloudEvents:")
	rabbit.get(t, 0)

	c := newKafka(t, "outbox.orders.eu")
	check("kafka", openSink(t, kafkaSinkURL(c, map[string]string{"cloudevents": "binary"})), "ce_")
}
