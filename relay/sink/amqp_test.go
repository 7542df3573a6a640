package sink_test

import (
	"context"
	"crypto/rand"
	"errors"
	"net/url"
	"os"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/outboxd/outboxd/relay"
	"github.com/outboxd/outboxd/relay/sink"
)

func amqpURL() string {
	if v := os.Getenv("AMQP_URL"); v != "" {
		return v
	}
	return "amqp://guest:guest@127.0.0.1:5672/"
}

// rabbitEnv is one test's exchange and queue on the shared RabbitMQ server,
// and a channel of its own to inspect them.
type rabbitEnv struct {
	ch       *amqp.Channel
	exchange string
	queue    string
}

// newRabbitEnv declares a topic exchange and a queue bound to it with
// binding, both deleted when the test ends.
func newRabbitEnv(t *testing.T, binding string) *rabbitEnv {
	t.Helper()
	conn, err := amqp.Dial(amqpURL())
	if err != nil {
		t.Fatalf("connect to RabbitMQ at %s (or set AMQP_URL): %v", amqpURL(), err)
	}
	t.Cleanup(func() { conn.Close() })
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	suffix := strings.ToLower(rand.Text()[:10])
	e := &rabbitEnv{ch: ch, exchange: "t.outbox.x." + suffix, queue: "t.outbox.q." + suffix}
	if err := ch.ExchangeDeclare(e.exchange, "topic", false, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ch.ExchangeDelete(e.exchange, false, false) })
	if _, err := ch.QueueDeclare(e.queue, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = ch.QueueDelete(e.queue, false, false, false) })
	if binding != "" {
		if err := ch.QueueBind(e.queue, binding, e.exchange, false, nil); err != nil {
			t.Fatal(err)
		}
	}
	return e
}

func (e *rabbitEnv) url(params map[string]string) string {
	return amqpSinkURL(amqpURL(), e.exchange, params)
}

func amqpSinkURL(server, exchange string, params map[string]string) string {
	u, err := url.Parse(server)
	if err != nil {
		panic(err)
	}
	q := url.Values{"exchange": {exchange}}
	for k, v := range params {
		q.Set(k, v)
	}
	u.RawQuery = q.Encode()
	return u.String()
}

func openSink(t *testing.T, rawURL string) relay.Sink {
	t.Helper()
	s, err := sink.Open(t.Context(), rawURL, sink.Options{})
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	t.Cleanup(func() {
		if err := s.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return s
}

// get reads exactly n messages from the queue, and checks none is left.
func (e *rabbitEnv) get(t *testing.T, n int) []amqp.Delivery {
	t.Helper()
	var out []amqp.Delivery
	for range n {
		d, ok, err := e.ch.Get(e.queue, true)
		if err != nil {
			t.Fatal(err)
		}
		if !ok {
			t.Fatalf("queue %s holds %d messages, want %d", e.queue, len(out), n)
		}
		out = append(out, d)
	}
	if _, ok, err := e.ch.Get(e.queue, true); err != nil || ok {
		t.Fatalf("queue %s holds more than %d messages (err %v)", e.queue, n, err)
	}
	return out
}

func TestAMQPPublishLandsWithPropertiesAndHeaders(t *testing.T) {
	t.Parallel()
	e := newRabbitEnv(t, "outbox.#")
	s := openSink(t, e.url(nil))
	ev := testEvent("0f8fad5b-d9cb-469f-a165-70867728950e")
	ev.Attempt = 2
	// A republished copy: RabbitMQ keeps no duplicate window, so its
	// message-id stays the event's, and a header names the republish.
	ev.RepublishAction = 9
	if err := s.Publish(t.Context(), ev); err != nil {
		t.Fatalf("Publish: %v", err)
	}

	d := e.get(t, 1)[0]
	if d.Exchange != e.exchange || d.RoutingKey != "outbox.orders%2Eeu.order-42" {
		t.Errorf("exchange %q routing key %q, want %q and the default template", d.Exchange, d.RoutingKey, e.exchange)
	}
	if string(d.Body) != string(ev.Payload) {
		t.Errorf("body = %q, want %q", d.Body, ev.Payload)
	}
	if d.MessageId != ev.ID || d.DeliveryMode != amqp.Persistent || d.ContentType != "application/json" || d.Type != "OrderPlaced" {
		t.Errorf("message-id %q delivery-mode %d content-type %q type %q", d.MessageId, d.DeliveryMode, d.ContentType, d.Type)
	}
	if !d.Timestamp.Equal(ev.CreatedAt.Truncate(time.Second)) {
		t.Errorf("timestamp %v, want %v", d.Timestamp, ev.CreatedAt)
	}
	want := map[string]string{
		sink.HeaderEventID:         ev.ID,
		sink.HeaderStream:          "orders.eu",
		sink.HeaderAggregateKey:    "order-42",
		sink.HeaderRevision:        "7",
		sink.HeaderEventType:       "OrderPlaced",
		sink.HeaderCreatedAt:       "2025-03-04T05:06:07.123456789Z",
		sink.HeaderAttempt:         "2",
		sink.HeaderRepublishAction: "9",
		"traceparent":              ev.Headers["traceparent"],
		"X-Tenant":                 "acme",
	}
	for k, v := range want {
		if got, _ := d.Headers[k].(string); got != v {
			t.Errorf("header %s = %#v, want %q", k, d.Headers[k], v)
		}
	}
}

// An event no queue is bound for comes back as a basic.return before its
// confirm: that is an error, and nothing was stored.
func TestAMQPUnroutableIsAnError(t *testing.T) {
	t.Parallel()
	e := newRabbitEnv(t, "elsewhere.#")
	s := openSink(t, e.url(nil))
	err := s.Publish(t.Context(), testEvent("e-unroutable"))
	if err == nil || !strings.Contains(err.Error(), "unroutable") || !strings.Contains(err.Error(), "NO_ROUTE") {
		t.Fatalf("Publish of an unroutable event = %v, want an unroutable error", err)
	}
	e.get(t, 0)

	// The channel stays usable: a routable event on the same sink lands,
	// and no stale return is taken for it.
	if err := e.ch.QueueBind(e.queue, "outbox.#", e.exchange, false, nil); err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		if err := s.Publish(t.Context(), testEvent("e-ok-"+string(rune('a'+i)))); err != nil {
			t.Fatalf("Publish after an unroutable one: %v", err)
		}
	}
	e.get(t, 3)
}

// Exchange and routing key come from templates: here one exchange per
// stream, and the event type and aggregate key as routing-key words.
func TestAMQPTemplatesRouteByEvent(t *testing.T) {
	t.Parallel()
	e := newRabbitEnv(t, "Order%20Placed.*")
	// e.exchange is "t.outbox.x.SUFFIX": the template renders it for
	// stream SUFFIX.
	stream := e.exchange[strings.LastIndexByte(e.exchange, '.')+1:]
	s := openSink(t, amqpSinkURL(amqpURL(), "t.outbox.x.{stream}", map[string]string{"routing_key": "{event_type}.{aggregate_key}"}))
	keys := []string{"a.b", "k*", "#", "ключ"}
	for _, k := range keys {
		ev := testEvent("id-" + k)
		ev.Stream, ev.Type, ev.AggregateKey = stream, "Order Placed", k
		if err := s.Publish(t.Context(), ev); err != nil {
			t.Fatalf("Publish key %q: %v", k, err)
		}
	}
	for i, d := range e.get(t, len(keys)) {
		tok := strings.SplitN(d.RoutingKey, ".", 2)
		if len(tok) != 2 {
			t.Fatalf("routing key %q", d.RoutingKey)
		}
		if got, err := sink.UnescapeSubjectToken(tok[1]); err != nil || got != keys[i] {
			t.Errorf("routing key %q: key word unescapes to %q, %v; want %q", d.RoutingKey, got, err, keys[i])
		}
	}

	// A stream whose exchange does not exist: the broker closes the
	// channel; the publish fails and the next one gets a fresh channel.
	ev := testEvent("id-missing")
	ev.Stream = "nosuchstream"
	if err := s.Publish(t.Context(), ev); err == nil {
		t.Fatal("Publish to a missing exchange succeeded")
	}
	ev = testEvent("id-after")
	ev.Stream, ev.Type = stream, "Order Placed"
	if err := s.Publish(t.Context(), ev); err != nil {
		t.Fatalf("Publish after a channel error: %v", err)
	}
	e.get(t, 1)
}

func TestAMQPOpenChecksExchange(t *testing.T) {
	t.Parallel()
	missing := "t.outbox.missing." + strings.ToLower(rand.Text()[:10])
	s, err := sink.Open(t.Context(), amqpSinkURL(amqpURL(), missing, nil), sink.Options{})
	if err == nil {
		_ = s.Close()
		t.Fatal("Open with a missing exchange succeeded")
	}
	if errors.Is(err, sink.ErrInvalidURL) || !strings.Contains(err.Error(), missing) || !strings.Contains(err.Error(), "NOT_FOUND") {
		t.Errorf("Open with a missing exchange: %v", err)
	}
	if strings.Contains(err.Error(), "guest:guest") {
		t.Errorf("error shows the password: %v", err)
	}

	bad := strings.Replace(amqpURL(), "guest:guest", "guest:wrong", 1)
	if s, err := sink.Open(t.Context(), amqpSinkURL(bad, "amq.topic", nil), sink.Options{}); err == nil {
		_ = s.Close()
		t.Error("Open with a wrong password succeeded")
	} else if strings.Contains(err.Error(), "wrong") {
		t.Errorf("error shows the password: %v", err)
	}
}

func TestAMQPPublishErrors(t *testing.T) {
	t.Parallel()
	e := newRabbitEnv(t, "#")
	s := openSink(t, e.url(nil))
	for name, h := range map[string]map[string]string{
		"CC":     {"CC": "other.key"},
		"BCC":    {"bcc": "other.key"},
		"Outbox": {"outbox-event-id": "spoof"},
		"long":   {strings.Repeat("h", 256): "v"},
	} {
		ev := testEvent("e-" + name)
		ev.Headers = h
		if err := s.Publish(t.Context(), ev); err == nil || !relay.IsPermanent(err) {
			t.Errorf("Publish with header %s = %v (permanent: %v), want a permanent error", name, err, relay.IsPermanent(err))
		}
	}
	// A routing key over AMQP's 255 bytes never fits: permanent too.
	long := testEvent("e-long-key")
	long.AggregateKey = strings.Repeat("k", 300)
	if err := s.Publish(t.Context(), long); err == nil || !relay.IsPermanent(err) || !strings.Contains(err.Error(), "routing key") {
		t.Errorf("Publish with a 300-byte routing key = %v (permanent: %v), want a permanent error", err, relay.IsPermanent(err))
	}
	if err := s.Publish(t.Context(), testEvent("")); err == nil {
		t.Error("Publish without an event ID succeeded")
	}
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if err := s.Publish(ctx, testEvent("e-cancelled")); !errors.Is(err, context.Canceled) {
		t.Errorf("Publish with a cancelled context = %v, want context.Canceled", err)
	}
	small := openSink(t, e.url(map[string]string{"max_bytes": "1024"}))
	big := testEvent("e-big")
	big.Payload = []byte(`"` + strings.Repeat("x", 1100) + `"`)
	if err := small.Publish(t.Context(), big); err == nil || !relay.IsPermanent(err) || !strings.Contains(err.Error(), "max_bytes=1024") {
		t.Errorf("Publish over max_bytes = %v (permanent: %v), want a permanent error naming max_bytes", err, relay.IsPermanent(err))
	}
	e.get(t, 0)
}

// openProxiedSink opens an AMQP sink for e's exchange that reaches
// RabbitMQ through a proxy the test can pause or cut, with the sink's
// publish timeout.
func openProxiedSink(t *testing.T, e *rabbitEnv, timeout string) (*proxy, relay.Sink) {
	t.Helper()
	target, err := url.Parse(amqpURL())
	if err != nil {
		t.Fatal(err)
	}
	p := newProxy(t, target.Host)
	through := *target
	through.Host = p.l.Addr().String()
	return p, openSink(t, amqpSinkURL(through.String(), e.exchange, map[string]string{"timeout": timeout}))
}

// A connection cut between publishes is dialled again by the next one.
func TestAMQPReconnectsAfterConnectionLoss(t *testing.T) {
	t.Parallel()
	e := newRabbitEnv(t, "#")
	p, s := openProxiedSink(t, e, "2s")
	if err := s.Publish(t.Context(), testEvent("e1")); err != nil {
		t.Fatal(err)
	}
	p.cut()
	// The first publish after the cut may find the connection not yet
	// known to be closed, and fail; the runner would retry it. Within a
	// few attempts one must land.
	var landed bool
	for range 5 {
		if err := s.Publish(t.Context(), testEvent("e2")); err == nil {
			landed = true
			break
		}
	}
	if !landed {
		t.Fatal("no publish landed after the connection was cut")
	}
	if got := len(e.get(t, 2)); got != 2 {
		t.Fatalf("%d messages", got)
	}
}

// A broker that stops answering fails the publish at the timeout, with an
// error (the outcome is unknown, so it must not count as success).
func TestAMQPPublishTimeout(t *testing.T) {
	t.Parallel()
	e := newRabbitEnv(t, "#")
	p, s := openProxiedSink(t, e, "300ms")
	p.pause()
	start := time.Now()
	err := s.Publish(t.Context(), testEvent("e1"))
	if err == nil || !strings.Contains(err.Error(), "confirm") {
		t.Fatalf("Publish to a stalled broker = %v, want a confirm timeout", err)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Errorf("Publish took %v with timeout=300ms", d)
	}
	p.resume()
	if err := s.Publish(t.Context(), testEvent("e2")); err != nil {
		t.Fatalf("Publish after the stall: %v", err)
	}
	// The stalled publish did reach the broker: its outcome was unknown,
	// not failed, which is why the relay retries with the same ID.
	e.get(t, 2)
}

// With declare=true and queue=, Open declares a durable exchange and a
// durable queue bound to it, so a first run needs no other tool: the queue
// receives what the sink publishes. Without declare, the same URL's missing
// exchange fails Open.
func TestAMQPDeclaresExchangeAndQueueWhenAsked(t *testing.T) {
	t.Parallel()
	conn, err := amqp.Dial(amqpURL())
	if err != nil {
		t.Fatalf("connect to RabbitMQ at %s (or set AMQP_URL): %v", amqpURL(), err)
	}
	t.Cleanup(func() { conn.Close() })
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	suffix := strings.ToLower(rand.Text()[:10])
	e := &rabbitEnv{ch: ch, exchange: "t.outbox.declared.x." + suffix, queue: "t.outbox.declared.q." + suffix}
	t.Cleanup(func() {
		_, _ = ch.QueueDelete(e.queue, false, false, false)
		_ = ch.ExchangeDelete(e.exchange, false, false)
	})
	if _, err := sink.Open(t.Context(), e.url(nil), sink.Options{}); err == nil || !strings.Contains(err.Error(), "NOT_FOUND") {
		t.Fatalf("Open without declare and no exchange: %v, want the exchange's NOT_FOUND", err)
	}
	s := openSink(t, e.url(map[string]string{"declare": "true", "queue": e.queue}))
	ev := testEvent("6f1c3e2a-8c0e-4b5a-9d7e-2a4b6c8d0e1f")
	if err := s.Publish(t.Context(), ev); err != nil {
		t.Fatalf("Publish: %v", err)
	}
	if d := e.get(t, 1)[0]; d.MessageId != ev.ID || d.Exchange != e.exchange {
		t.Errorf("queue got message-id %q from exchange %q, want %q from %q", d.MessageId, d.Exchange, ev.ID, e.exchange)
	}
	// Durable both, so they outlive a broker restart: RabbitMQ refuses to
	// declare them again as not durable (and closes the channel).
	for what, redeclare := range map[string]func(*amqp.Channel) error{
		"queue": func(c *amqp.Channel) error {
			_, err := c.QueueDeclare(e.queue, false, false, false, false, nil)
			return err
		},
		"exchange": func(c *amqp.Channel) error {
			return c.ExchangeDeclare(e.exchange, "topic", false, false, false, false, nil)
		},
	} {
		c, err := conn.Channel()
		if err != nil {
			t.Fatal(err)
		}
		if err := redeclare(c); err == nil || !strings.Contains(err.Error(), "durable") {
			t.Errorf("the declared %s redeclared as not durable: %v, want PRECONDITION_FAILED for durable", what, err)
		}
	}
	// A second Open declares the same again: a no-op.
	openSink(t, e.url(map[string]string{"declare": "true", "queue": e.queue}))
}

// A queue that refuses the message (here: full, with overflow
// reject-publish) makes RabbitMQ answer basic.nack instead of basic.ack:
// the message was not taken, so Publish must fail, and not permanently
// (the queue drains).
func TestAMQPNackIsAnError(t *testing.T) {
	t.Parallel()
	e := newRabbitEnv(t, "")
	full := e.queue + ".full"
	if _, err := e.ch.QueueDeclare(full, false, false, false, false, amqp.Table{
		"x-max-length": int32(1),
		"x-overflow":   "reject-publish",
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = e.ch.QueueDelete(full, false, false, false) })
	if err := e.ch.QueueBind(full, "outbox.#", e.exchange, false, nil); err != nil {
		t.Fatal(err)
	}
	s := openSink(t, e.url(nil))
	if err := s.Publish(t.Context(), testEvent("e-fits")); err != nil {
		t.Fatalf("Publish to a queue with room: %v", err)
	}
	err := s.Publish(t.Context(), testEvent("e-refused"))
	if err == nil || !strings.Contains(err.Error(), "nack") || relay.IsPermanent(err) {
		t.Fatalf("Publish to a full reject-publish queue = %v (permanent: %v), want a basic.nack error worth retrying", err, relay.IsPermanent(err))
	}
	e.queue = full
	if d := e.get(t, 1)[0]; d.MessageId != "e-fits" {
		t.Errorf("queue holds %q, want only e-fits", d.MessageId)
	}
}

// A publish whose confirm timed out may still be answered: here the broker
// returns it as unroutable once the stalled connection resumes. That late
// basic.return must not be taken for the next publish's, which is
// routable and lands: a routable event reported unroutable would be
// retried and, in the end, parked.
func TestAMQPLateReturnIsNotTakenForTheNextPublish(t *testing.T) {
	t.Parallel()
	e := newRabbitEnv(t, "outbox.orders%2Eeu.#")
	p, s := openProxiedSink(t, e, "1s")
	unroutable := testEvent("e-unroutable")
	unroutable.Stream = "nowhere"
	p.pause()
	if err := s.Publish(t.Context(), unroutable); err == nil || !strings.Contains(err.Error(), "confirm") {
		t.Fatalf("Publish to a stalled broker = %v, want a confirm timeout", err)
	}
	p.resume()
	if err := s.Publish(t.Context(), testEvent("e-routable")); err != nil {
		t.Fatalf("Publish of a routable event after a timed-out unroutable one: %v", err)
	}
	if d := e.get(t, 1)[0]; d.MessageId != "e-routable" {
		t.Errorf("queue holds %q, want e-routable", d.MessageId)
	}
}
