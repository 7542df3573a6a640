package sink

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/outboxd/outboxd/relay"
)

// Defaults for the amqp:// URL parameters; see the package comment.
const (
	DefaultAMQPRoutingKey = "outbox.{stream}.{aggregate_key}"
	DefaultAMQPTimeout    = 10 * time.Second
	// DefaultAMQPMaxBytes is RabbitMQ 4.x's default max_message_size
	// (16 MiB; 3.x allowed 128 MiB): above outboxd's largest event, so
	// it only bites when the broker's limit is lowered and max_bytes with it.
	DefaultAMQPMaxBytes = 16 << 20
)

// maxAMQPName is the longest exchange name or routing key AMQP 0-9-1 can
// carry (a shortstr).
const maxAMQPName = 255

// amqpConfig is a validated amqp:// or amqps:// URL.
type amqpConfig struct {
	server   string // the URL without our query parameters
	exchange *subjectTemplate
	key      *subjectTemplate
	timeout  time.Duration
	maxBytes int
	ce       ceConfig
	// declare (opt in) declares the exchange, durable, at Open; with queue
	// set, a durable queue too, bound to it by binding.
	declare        bool
	queue, binding string
}

// DefaultAMQPBindingKey binds a declared queue to every message the sink
// publishes with the default routing key.
const DefaultAMQPBindingKey = "outbox.#"

func parseAMQPURL(u *url.URL, display string) (*amqpConfig, error) {
	if u.Opaque != "" || u.Host == "" {
		return nil, invalid(display, "want %s://user:password@host:port/vhost?exchange=...", u.Scheme)
	}
	if u.Fragment != "" {
		return nil, invalid(display, "unexpected fragment")
	}
	p, err := params(u, display, append([]string{"exchange", "routing_key", "timeout", "max_bytes", "declare", "queue", "binding_key"}, ceParams...)...)
	if err != nil {
		return nil, err
	}
	cfg := &amqpConfig{timeout: DefaultAMQPTimeout, maxBytes: DefaultAMQPMaxBytes}
	// The AMQP binding's prefix; in RabbitMQ's AMQP 0-9-1 headers table,
	// which stands for AMQP 1.0's application properties.
	if cfg.ce, err = parseCE(p, display, "cloudEvents:"); err != nil {
		return nil, err
	}
	ex, ok := p["exchange"]
	if !ok {
		// No default: an exchange that does not exist, or the default
		// exchange with no queue of that name, would fail (and park)
		// every event. exchange= (empty) names the default exchange.
		return nil, invalid(display, `missing parameter "exchange" (exchange= for the default exchange)`)
	}
	if cfg.exchange, err = parseTemplate(ex, templateRules{what: "exchange", allowEmpty: true, maxLen: maxAMQPName}); err != nil {
		return nil, invalid(display, "exchange=%q: %v", ex, err)
	}
	key := DefaultAMQPRoutingKey
	if v, ok := p["routing_key"]; ok {
		key = v
	}
	if cfg.key, err = parseTemplate(key, templateRules{what: "routing key", allowEmpty: true, maxLen: maxAMQPName}); err != nil {
		return nil, invalid(display, "routing_key=%q: %v", key, err)
	}
	if v, ok := p["timeout"]; ok {
		if cfg.timeout, err = positiveDuration(v); err != nil {
			return nil, invalid(display, "timeout=%q: %v", v, err)
		}
	}
	if v, ok := p["max_bytes"]; ok {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1024 {
			return nil, invalid(display, "max_bytes=%q: want a number of bytes, at least 1024 (match the broker's max_message_size)", v)
		}
		cfg.maxBytes = n
	}
	if err := parseAMQPDeclare(cfg, p, display); err != nil {
		return nil, err
	}
	server := *u
	server.RawQuery, server.ForceQuery = "", false
	if _, err := amqp.ParseURI(server.String()); err != nil {
		return nil, invalid(display, "%v", err)
	}
	cfg.server = server.String()
	return cfg, nil
}

// parseAMQPDeclare reads the opt-in declaration: declare=true, and queue=
// with binding_key=, which only make sense with it.
func parseAMQPDeclare(cfg *amqpConfig, p map[string]string, display string) error {
	if v, ok := p["declare"]; ok {
		var err error
		if cfg.declare, err = strconv.ParseBool(v); err != nil {
			return invalid(display, "declare=%q: want true or false", v)
		}
	}
	queue, hasQueue := p["queue"]
	binding, hasBinding := p["binding_key"]
	switch {
	case !cfg.declare && (hasQueue || hasBinding):
		return invalid(display, "queue= and binding_key= need declare=true")
	case !cfg.declare:
		return nil
	case !cfg.exchange.literal() || cfg.exchange.raw == "":
		return invalid(display, "declare=true needs a named exchange without placeholders (the default exchange cannot be declared)")
	case hasQueue && (queue == "" || len(queue) > maxAMQPName || strings.HasPrefix(queue, "amq.")):
		return invalid(display, "queue=%q: want a name of 1 to %d bytes, not starting with amq. (reserved)", queue, maxAMQPName)
	case hasBinding && !hasQueue:
		return invalid(display, "binding_key= needs queue=")
	case len(binding) > maxAMQPName:
		return invalid(display, "binding_key: at most %d bytes", maxAMQPName)
	}
	cfg.queue = queue
	cfg.binding = DefaultAMQPBindingKey
	if hasBinding {
		cfg.binding = binding
	}
	return nil
}

// declareOn declares the exchange (durable topic) and, when asked, a durable
// queue bound to it: opt in, so that a first run needs no other tool.
// Declaring what exists with the same arguments is a no-op; with others,
// RabbitMQ refuses (PRECONDITION_FAILED), and so does Open.
func (c *amqpConfig) declareOn(ch *amqp.Channel) error {
	if err := ch.ExchangeDeclare(c.exchange.raw, "topic", true, false, false, false, nil); err != nil {
		return fmt.Errorf("declare exchange %q: %w", c.exchange.raw, err)
	}
	if c.queue == "" {
		return nil
	}
	if _, err := ch.QueueDeclare(c.queue, true, false, false, false, nil); err != nil {
		return fmt.Errorf("declare queue %q: %w", c.queue, err)
	}
	if err := ch.QueueBind(c.queue, c.binding, c.exchange.raw, false, nil); err != nil {
		return fmt.Errorf("bind queue %q to exchange %q with %q: %w", c.queue, c.exchange.raw, c.binding, err)
	}
	return nil
}

// amqpSink publishes to RabbitMQ (AMQP 0-9-1) with publisher confirms.
//
// Each publish has a channel to itself, taken from a pool that grows with
// the relay's concurrency: with one message outstanding per channel, a
// basic.return (which RabbitMQ sends before the basic.ack of the same
// message, and the client hands over before it processes that ack) can
// only belong to that message, so an unroutable event is told apart from a
// routed one without correlating returns across publishes.
//
// The connection is dialled at Open and again by the first publish that
// finds it closed, so a broker restart costs the publishes that were under
// way (which fail, and are retried by the runner) and nothing else.
type amqpSink struct {
	cfg     *amqpConfig
	display string
	log     *slog.Logger

	mu     sync.Mutex
	conn   *amqpConn // nil or closed: dial on next use
	closed bool
}

// amqpConn is one connection and its idle channels.
type amqpConn struct {
	conn *amqp.Connection
	raw  net.Conn // to unblock a write the broker stopped reading
	idle []*amqpChannel
}

type amqpChannel struct {
	ch      *amqp.Channel
	owner   *amqpConn
	returns chan amqp.Return
}

func openAMQP(ctx context.Context, u *url.URL, display string, opts Options) (relay.Sink, error) {
	cfg, err := parseAMQPURL(u, display)
	if err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("amqp sink %q: %w", display, err)
	}
	s := &amqpSink{cfg: cfg, display: display, log: opts.Logger.With("sink", "amqp")}
	ctx, cancel := context.WithTimeout(ctx, cfg.timeout)
	defer cancel()
	c, err := s.channel(ctx)
	if err != nil {
		_ = s.Close()
		return nil, err
	}
	if cfg.declare {
		// A failed declare closes the channel.
		if err := cfg.declareOn(c.ch); err != nil {
			_ = s.Close()
			return nil, fmt.Errorf("amqp sink %q: %w", display, err)
		}
	}
	if cfg.exchange.literal() && cfg.exchange.raw != "" {
		// A missing exchange would fail every publish: say so now. The
		// passive declare closes the channel when it fails.
		if err := c.ch.ExchangeDeclarePassive(cfg.exchange.raw, "topic", true, false, false, false, nil); err != nil {
			_ = s.Close()
			return nil, fmt.Errorf("amqp sink %q: exchange %q: %w", display, cfg.exchange.raw, err)
		}
	}
	s.release(c, true)
	s.log.Info("amqp sink ready", "exchange", cfg.exchange.raw, "routing_key", cfg.key.raw, "declared", cfg.declare, "queue", cfg.queue)
	return s, nil
}

// channel returns an idle confirm-mode channel, dialling the connection if
// it is missing or closed.
func (s *amqpSink) channel(ctx context.Context) (*amqpChannel, error) {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil, errors.New("amqp sink: closed")
	}
	if s.conn != nil && s.conn.conn.IsClosed() {
		s.log.Warn("amqp connection closed; reconnecting")
		s.conn = nil
	}
	if s.conn == nil {
		c, err := s.dial(ctx)
		if err != nil {
			s.mu.Unlock()
			return nil, err
		}
		s.conn = c
	}
	c := s.conn
	for len(c.idle) > 0 {
		ch := c.idle[len(c.idle)-1]
		c.idle = c.idle[:len(c.idle)-1]
		if !ch.ch.IsClosed() {
			s.mu.Unlock()
			return ch, nil
		}
	}
	s.mu.Unlock()

	ch, err := c.conn.Channel()
	if err != nil {
		return nil, fmt.Errorf("amqp sink: open channel: %w", err)
	}
	if err := ch.Confirm(false); err != nil {
		_ = ch.Close()
		return nil, fmt.Errorf("amqp sink: enable publisher confirms: %w", err)
	}
	// One message is outstanding per channel, so one return at most is
	// pending; the buffer keeps the client's reader from ever blocking.
	returns := ch.NotifyReturn(make(chan amqp.Return, 1))
	return &amqpChannel{ch: ch, owner: c, returns: returns}, nil
}

// dial connects, bounded by ctx. s.mu is held.
func (s *amqpSink) dial(ctx context.Context) (*amqpConn, error) {
	c := &amqpConn{}
	var d net.Dialer
	conn, err := amqp.DialConfig(s.cfg.server, amqp.Config{
		Heartbeat: 10 * time.Second,
		Locale:    "en_US",
		Properties: amqp.Table{
			"connection_name": "outboxd-relay",
			"product":         "outboxd",
		},
		Dial: func(network, addr string) (net.Conn, error) {
			raw, err := d.DialContext(ctx, network, addr)
			if err != nil {
				return nil, err
			}
			// The handshake is bounded by ctx too; the client clears the
			// deadline once it is done.
			if dl, ok := ctx.Deadline(); ok {
				_ = raw.SetDeadline(dl)
			}
			c.raw = raw
			return raw, nil
		},
	})
	if err != nil {
		return nil, fmt.Errorf("amqp sink %q: connect: %w", s.display, err)
	}
	c.conn = conn
	s.log.Info("amqp connected", "server", redact(mustParse(s.cfg.server)))
	return c, nil
}

func mustParse(raw string) *url.URL {
	u, err := url.Parse(raw)
	if err != nil {
		return &url.URL{}
	}
	return u
}

// release returns a channel to its connection's pool, or closes it when it
// is not fit for reuse (or the sink or its connection is gone).
func (s *amqpSink) release(c *amqpChannel, ok bool) {
	s.mu.Lock()
	if ok && !s.closed && s.conn == c.owner && !c.ch.IsClosed() {
		c.owner.idle = append(c.owner.idle, c)
		s.mu.Unlock()
		return
	}
	s.mu.Unlock()
	// channel.close waits for the broker's close-ok, which a stalled
	// broker never sends: close in the background (closing the
	// connection ends the wait) so that Publish keeps its timeout.
	go func() { _ = c.ch.Close() }()
}

// Publish sends ev with mandatory routing and persistent delivery, and
// returns nil only once RabbitMQ has confirmed it (basic.ack) without
// returning it as unroutable. For a durable queue RabbitMQ confirms a
// persistent message once it is written to disk (or, for quorum queues,
// to a majority of replicas).
func (s *amqpSink) Publish(ctx context.Context, ev relay.Event) error {
	if ev.ID == "" {
		return errors.New("amqp sink: event has no ID, which message-id needs")
	}
	exchange, err := s.cfg.exchange.render(ev)
	if err != nil {
		return fmt.Errorf("amqp sink: %w", err)
	}
	key, err := s.cfg.key.render(ev)
	if err != nil {
		return fmt.Errorf("amqp sink: %w", err)
	}
	m, err := s.cfg.ce.message(ev)
	if err != nil {
		return fmt.Errorf("amqp sink: %w", err)
	}
	headers := make(amqp.Table, len(ev.Headers)+len(m.headers)+7)
	for k, v := range ev.Headers {
		if err := checkAMQPHeader(k); err != nil {
			// An event's headers never change: park it now.
			return relay.Permanent(fmt.Errorf("amqp sink: %w", err))
		}
		if err := s.cfg.ce.checkHeader(k); err != nil {
			return fmt.Errorf("amqp sink: %w", err)
		}
		headers[k] = v
	}
	for k, v := range m.headers {
		headers[k] = v
	}
	headers[HeaderEventID] = ev.MessageID()
	if ev.Source != "" {
		headers[HeaderSource] = ev.Source
	}
	headers[HeaderStream] = ev.Stream
	headers[HeaderAggregateKey] = ev.AggregateKey
	headers[HeaderRevision] = strconv.FormatInt(ev.Revision, 10)
	headers[HeaderEventType] = ev.Type
	headers[HeaderCreatedAt] = ev.CreatedAt.UTC().Format(time.RFC3339Nano)
	headers[HeaderAttempt] = strconv.Itoa(ev.Attempt)
	if ev.RepublishAction != 0 {
		headers[HeaderRepublishAction] = strconv.FormatInt(ev.RepublishAction, 10)
	}
	msg := amqp.Publishing{
		Headers:      headers,
		ContentType:  m.contentType,
		DeliveryMode: amqp.Persistent,
		MessageId:    ev.MessageID(),
		Timestamp:    ev.CreatedAt,
		Type:         ev.Type,
		AppId:        "outboxd",
		Body:         m.body,
	}

	if len(msg.Body) > s.cfg.maxBytes {
		// RabbitMQ would close the channel with PRECONDITION_FAILED for
		// every attempt; refuse it here, for good.
		return relay.Permanent(fmt.Errorf("amqp sink: body of %d bytes over max_bytes=%d (the broker's max_message_size)", len(msg.Body), s.cfg.maxBytes))
	}
	ctx, cancel := context.WithTimeout(ctx, s.cfg.timeout)
	defer cancel()
	c, err := s.channel(ctx)
	if err != nil {
		return err
	}
	where := fmt.Sprintf("exchange %q routing key %q", exchange, key)

	// The client's writes do not watch ctx: a broker that stops reading
	// (a resource alarm blocks publishing connections) would hold this
	// publish forever. Closing the socket ends the write, and with it the
	// connection, which the next publish dials again.
	stopWatch := context.AfterFunc(ctx, func() {
		if c.owner.raw != nil {
			_ = c.owner.raw.Close()
		}
	})
	dc, err := c.ch.PublishWithDeferredConfirmWithContext(ctx, exchange, key, true, false, msg)
	if !stopWatch() {
		s.release(c, false)
		return fmt.Errorf("amqp sink: publish to %s: no progress within %s: %w", where, s.cfg.timeout, context.Cause(ctx))
	}
	if err != nil {
		s.release(c, false)
		return fmt.Errorf("amqp sink: publish to %s: %w", where, err)
	}
	acked, err := dc.WaitContext(ctx)
	if err != nil {
		// The outcome is unknown: the message may yet be confirmed. The
		// channel is dropped so a late confirm or return cannot be taken
		// for a later message's.
		s.release(c, false)
		return fmt.Errorf("amqp sink: publish to %s: no publisher confirm within %s: %w", where, s.cfg.timeout, err)
	}
	if !acked {
		// Read before the release, whose Close runs in the background: read
		// after it, a basic.nack sometimes looked like a closed channel. A
		// channel that does close is marked closed before its confirms are
		// let go, so this sees it.
		closed := c.ch.IsClosed()
		s.release(c, false)
		if closed {
			return fmt.Errorf("amqp sink: publish to %s: channel closed before the confirm (broker restart, or the exchange does not exist)", where)
		}
		return fmt.Errorf("amqp sink: publish to %s: broker nacked the message (basic.nack)", where)
	}
	select {
	case r := <-c.returns:
		s.release(c, true)
		return fmt.Errorf("amqp sink: publish to %s: returned unroutable (%d %s): no queue is bound for it", where, r.ReplyCode, r.ReplyText)
	default:
	}
	s.release(c, true)
	return nil
}

// checkAMQPHeader rejects producer header names the sink must not pass
// through: the "Outbox-" names are the sink's own, and RabbitMQ reads the
// CC and BCC headers as extra routing keys (sender-selected distribution),
// so a producer header would silently send the event elsewhere. AMQP field
// names are at most 255 bytes.
func checkAMQPHeader(k string) error {
	switch {
	case k == "":
		return errors.New("empty header name")
	case len(k) > maxAMQPName:
		return fmt.Errorf("header name %.32q... is %d bytes, over AMQP's %d", k, len(k), maxAMQPName)
	case strings.EqualFold(k, "CC") || strings.EqualFold(k, "BCC"):
		return fmt.Errorf("header name %q is read by RabbitMQ as routing keys", k)
	case len(k) >= 7 && strings.EqualFold(k[:7], "outbox-"):
		return fmt.Errorf("header name %q uses the reserved prefix %q", k, k[:7])
	}
	return nil
}

// Close closes the connection; publishes under way fail. It is safe to
// call more than once.
func (s *amqpSink) Close() error {
	s.mu.Lock()
	c := s.conn
	s.conn, s.closed = nil, true
	s.mu.Unlock()
	if c == nil || c.conn.IsClosed() {
		return nil
	}
	// A connection the broker or the network just dropped may not know it
	// yet: closing it then fails with ErrClosed or net.ErrClosed, and
	// there is nothing left to release.
	if err := c.conn.CloseDeadline(time.Now().Add(s.cfg.timeout)); err != nil && !errors.Is(err, amqp.ErrClosed) && !errors.Is(err, net.ErrClosed) {
		return fmt.Errorf("amqp sink: close: %w", err)
	}
	return nil
}
