// Package sink opens the relay's broker connections from a URL, so that
// `outboxd relay --sink URL` and tests pick a broker and its settings with
// one string instead of per-broker flags.
//
// Message IDs: event IDs are unique within one source database only, so
// what a broker or consumer deduplicates on is relay.Event.MessageID: the
// event ID for the source named default, "source/event ID" for any other.
// It is the Nats-Msg-Id, the AMQP message-id, the webhook-id, the
// CloudEvents id, the Outbox-Event-Id header and the Redis event_id field;
// an event of another source also carries an Outbox-Source header (Redis:
// a source field). A delivery of an operator's republish keeps it, but for
// the Nats-Msg-Id, which is relay.Event.DedupID (the message ID and the
// republish's action ID: JetStream would drop the republish inside its
// duplicate window), and says which republish made it: an
// Outbox-Republish-Action header (NATS, AMQP, Kafka), republish_action in
// the stdout line and webhook body, and a Redis republish_action field.
//
// Supported schemes:
//
//	stdout://                      one JSON line per event, for development
//	nats://host:port?params        NATS JetStream (see the nats section below)
//	amqp://user:pass@host:port/vhost?params
//	amqps://...                    RabbitMQ, AMQP 0-9-1 (TLS with amqps)
//	redis://[user:pass@]host:port/db?params
//	rediss://...                   Redis Streams (TLS with rediss)
//	https://host/path?params
//	http://...                     webhooks (Standard Webhooks signatures)
//	kafka://host:port[,host:port]?params
//	                               Kafka (idempotent producer, acks=all)
//
// NATS JetStream parameters (all optional):
//
//	subject     subject template, default "outbox.{stream}.{aggregate_key}";
//	            placeholders {stream}, {aggregate_key}, {event_type}, each a
//	            whole '.'-separated token, substituted with
//	            EscapeSubjectToken; the first token must be literal
//	stream      JetStream stream name, default "OUTBOX"
//	create      create the stream, or widen an existing one, at Open;
//	            default true. With true a stream deleted while the sink
//	            runs is created again, with the same config, by the next
//	            Publish, which then publishes once more. With false the
//	            stream must already exist, and a publish that finds it
//	            missing fails, saying so
//	duplicates  the duplicate window of a stream the sink creates, default
//	            2m; it must outlast the relay's retry of an event for
//	            Nats-Msg-Id deduplication to hide redeliveries. An existing
//	            stream's window is changed only when duplicates= is given,
//	            and kept otherwise (with a warning if it is under 2m)
//	timeout     bound on each publish (and on Open's stream calls), default
//	            10s
//
// AMQP (RabbitMQ) parameters:
//
//	exchange     required; exchange template ("exchange=" is the default
//	             exchange). Same syntax as the NATS subject, but the first
//	             token may be a placeholder. A literal exchange must exist
//	             at Open (checked with a passive declare) unless
//	             declare=true
//	declare      true: declare the exchange at Open, a durable topic
//	             exchange (opt in; default false, the sink then declares
//	             and binds nothing). Needs a literal, named exchange
//	queue        with declare=true: also declare this durable queue and
//	             bind it to the exchange, so that a first run works
//	             without another tool
//	binding_key  the queue's binding, default "outbox.#" (every message
//	             of the default routing key)
//	routing_key  routing key template, default
//	             "outbox.{stream}.{aggregate_key}"
//	timeout      bound on each publish and its confirm (and on Open's
//	             connect), default 10s
//	max_bytes    largest body, default 16777216 (RabbitMQ 4.x's
//	             max_message_size); a larger event fails permanently
//
// Each message is published mandatory and persistent, with message-id =
// the message ID, type = event type, timestamp = created_at, content type
// application/json, the event's headers and the Outbox-* headers the NATS
// sink sets. Publish returns nil only on the broker's publisher confirm
// without a basic.return: an event no queue is bound for is an error
// (retried, then parked), not a silent drop. RabbitMQ keeps no duplicate
// window: consumers deduplicate by message-id. Producer headers named CC or
// BCC (which RabbitMQ reads as extra routing keys) or starting with
// "Outbox-" are refused, permanently (relay.Permanent: the aggregate parks
// at once), as are templates that render over their name's length limit. A connection found closed is dialled again by the
// next publish.
//
// Redis Streams parameters (all optional):
//
//	stream   stream key template, default "outbox.{stream}"
//	maxlen   trim each stream to about this many entries (XADD MAXLEN ~);
//	         default no trimming
//	timeout  bound on each XADD and on Open's connect, default 10s
//
// Each entry has the fields event_id (the message ID), source (only for a
// source other than default), stream, key (the aggregate key),
// revision, type, created_at, payload and headers (the event's headers as
// a JSON object). Publish returns nil once Redis answered the XADD; the
// entry is then as durable as the server's appendonly/appendfsync and
// replication settings make it. Redis cannot deduplicate: a redelivered
// event is appended again, and consumers skip an event_id they have seen
// (see the README).
//
// Webhook parameters:
//
//	secret_file  required; a file holding the signing secret "whsec_" +
//	             base64 (at least 24 bytes), or several, one a line, to
//	             rotate: each request is signed with every one. Read at Open
//	timeout      bound on each POST, default 10s
//	query        the endpoint's own query string (URL-encoded), since the
//	             URL's query holds the sink's parameters
//	ca_file      https only: a PEM file of the CA certificates that verify
//	             the receiver, instead of the system's roots. Read at Open
//
// Each event is POSTed as the JSON object the stdout sink prints, with the
// Standard Webhooks headers webhook-id (the message ID), webhook-timestamp
// (Unix seconds at sending) and webhook-signature ("v1," + base64
// HMAC-SHA256 of "id.timestamp.body"). A 2xx answer acks. 408, 429 and 5xx
// are errors marked with the response's Retry-After (relay.RetryAfter), so
// the runner's nack asks the server to wait that long; any other 4xx (413
// too large included) is a permanent error (relay.Permanent) quoting the
// status and the start of the body, so the aggregate parks at once; a
// redirect (not followed) is an ordinary error, parked after the server's
// max failures. TLS verifies the receiver with the system's roots, as
// net/http's default transport does, or with ca_file's certificates.
//
// Kafka parameters (all optional):
//
//	topic      topic template, default "outbox.{stream}". Values are put
//	           in as they are, not escaped ('%' is not allowed in a topic);
//	           an event whose topic comes out invalid fails (and parks)
//	timeout    bound on each record, in flight included (and on Open's
//	           connect), default 10s, at least 1s
//	max_bytes  largest record batch, default 1000012 (Kafka's default
//	           message.max.bytes); raise it together with the topic's
//	           max.message.bytes for events over 1 MB. A record over it,
//	           or refused by the broker as too large, fails permanently
//	tls        true to connect with TLS (system roots), default false
//	client_id  the client.id brokers see, default "outboxd-relay"
//
// Each event is one record: key = aggregate key (so an aggregate keeps one
// partition, and its order), value = payload, headers Outbox-Event-Id,
// Outbox-Event-Type and the other Outbox-* headers beside the event's own.
// The producer is idempotent with acks=all: Publish returns nil once every
// in-sync replica has the record, and the client's own retries never
// duplicate or reorder it within the producer's session. A retry by the
// runner is a new record, so consumers still deduplicate by
// Outbox-Event-Id. SASL is not supported yet. The tests run against
// franz-go's in-process kfake cluster.
//
// CloudEvents 1.0 (Kafka, AMQP, NATS and webhook sinks; opt-in):
//
//	cloudevents  binary (attributes as headers under the protocol
//	             binding's prefix: Kafka ce_, HTTP and NATS ce-, AMQP
//	             cloudEvents:) or structured (the event as
//	             application/cloudevents+json); default off
//	ce_source    the source attribute, {stream} replaced by the event's
//	             stream; default "/outboxd/{stream}"
//
// id = the message ID, type = event type, subject = aggregate key, time =
// created_at, data = payload (application/json), extensions outboxstream
// and outboxrevision, and traceparent/tracestate from the event's headers.
// The sink's own headers (Outbox-*, the event's) are kept in both modes,
// except by webhooks, which have none: their event headers travel in the
// JSON body that the CloudEvent replaces, so only the attributes and the
// trace context (also as HTTP headers) are sent.
//
// Templates: placeholders {stream}, {aggregate_key}, {event_type}, each a
// whole '.'-separated token, are substituted with EscapeSubjectToken
// (except in Kafka topics, see above), so a value never adds a token or a
// wildcard and UnescapeSubjectToken gets it back.
//
// Unknown parameters are errors, so a misspelt one is not silently ignored.
package sink

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/url"
	"os"
	"slices"
	"sort"
	"strings"

	"github.com/outboxd/outboxd/relay"
)

// ErrInvalidURL is wrapped by every error Open returns for a URL it cannot
// accept (unknown scheme, bad or unknown parameter, bad subject template),
// so a caller can tell a configuration mistake, which retrying will not
// fix, from a broker that is unreachable for now.
var ErrInvalidURL = errors.New("invalid sink URL")

// Options carries what a sink needs from its host process rather than from
// the URL: things that are objects, not strings.
type Options struct {
	// Logger receives connection and setup events. Nil discards them, so
	// libraries and tests need not configure logging.
	Logger *slog.Logger
	// Stdout is where the stdout sink writes. Nil means os.Stdout; tests set
	// it to capture output.
	Stdout io.Writer
}

// opener builds one kind of sink from a parsed URL. display is the URL with
// any password redacted, for messages.
type opener func(ctx context.Context, u *url.URL, display string, opts Options) (relay.Sink, error)

var openers = map[string]opener{
	"stdout": openStdout,
	"nats":   openNATS,
	"amqp":   openAMQP,
	"amqps":  openAMQP,
	"redis":  openRedis,
	"rediss": openRedis,
	"http":   openWebhook,
	"https":  openWebhook,
	"kafka":  openKafka,
}

// Open returns the sink named by rawURL's scheme, connected and ready to
// publish. Validation of the whole URL happens before any connection is
// made, so a configuration error is reported as such (wrapping
// ErrInvalidURL) and never as a connection failure. Errors name the URL,
// with any password redacted.
func Open(ctx context.Context, rawURL string, opts Options) (relay.Sink, error) {
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	if opts.Stdout == nil {
		opts.Stdout = os.Stdout
	}
	u, err := url.Parse(rawURL)
	if err != nil {
		// url.Error repeats the raw URL, password included; report only
		// the cause, with our own redacted copy of the URL.
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err
		}
		return nil, invalid(redactRaw(rawURL), "cannot parse (want scheme://...): %v", err)
	}
	display := rawURL
	if u.User != nil {
		display = redact(u)
	}
	if u.Scheme == "" {
		return nil, invalid(display, "missing scheme; want one of %s", schemes())
	}
	open, ok := openers[u.Scheme]
	if !ok {
		return nil, invalid(display, "unknown scheme %q; want one of %s", u.Scheme, schemes())
	}
	return open(ctx, u, display, opts)
}

// Redact returns rawURL with any password (or NATS token) replaced by
// "xxxxx", for logs.
func Redact(rawURL string) string {
	u, err := url.Parse(rawURL)
	if err != nil {
		return redactRaw(rawURL)
	}
	return redact(u)
}

// invalid formats a configuration error that names the URL.
func invalid(display, format string, args ...any) error {
	return fmt.Errorf("%w %q: %s", ErrInvalidURL, display, fmt.Sprintf(format, args...))
}

func schemes() string {
	names := make([]string, 0, len(openers))
	for k := range openers {
		names = append(names, k+"://")
	}
	sort.Strings(names)
	return strings.Join(names, ", ")
}

// params reads a URL's query, rejecting repeated and unknown keys so that a
// typo or a conflicting value is reported rather than ignored.
func params(u *url.URL, display string, known ...string) (map[string]string, error) {
	q, err := url.ParseQuery(u.RawQuery)
	if err != nil {
		return nil, invalid(display, "bad query: %v", err)
	}
	out := make(map[string]string, len(q))
	for k, vs := range q {
		if !slices.Contains(known, k) {
			if slices.Contains(ceParams, k) {
				return nil, invalid(display, "parameter %q: this sink has no CloudEvents binding (kafka, amqp, nats and webhook sinks have)", k)
			}
			if len(known) == 0 {
				return nil, invalid(display, "unknown parameter %q; this sink takes none", k)
			}
			return nil, invalid(display, "unknown parameter %q; want one of %s", k, strings.Join(known, ", "))
		}
		if len(vs) != 1 {
			return nil, invalid(display, "parameter %q given %d times", k, len(vs))
		}
		out[k] = vs[0]
	}
	return out, nil
}

// redactRaw hides the userinfo of a URL that url.Parse rejected, so the
// error can still name it.
func redactRaw(raw string) string {
	i := strings.Index(raw, "://")
	if i < 0 {
		return raw
	}
	rest := raw[i+3:]
	end := strings.IndexAny(rest, "/?#")
	if end < 0 {
		end = len(rest)
	}
	at := strings.LastIndex(rest[:end], "@")
	if at < 0 {
		return raw
	}
	return raw[:i+3] + "xxxxx@" + rest[at+1:]
}

// redact returns u as text with its credentials hidden. A user name alone
// is hidden too: NATS reads nats://TOKEN@host as a token.
func redact(u *url.URL) string {
	c := *u
	if u.User != nil {
		if _, ok := u.User.Password(); ok {
			c.User = url.UserPassword(u.User.Username(), "xxxxx")
		} else {
			c.User = url.User("xxxxx")
		}
	}
	s := c.String()
	// url.URL.String drops the "//" of a URL without a host
	// ("stdout://" is "stdout:"): written back as the flag took it.
	if c.Host == "" && c.Opaque == "" && c.Scheme != "" && !strings.HasPrefix(s, c.Scheme+"://") {
		s = c.Scheme + "://" + strings.TrimPrefix(s, c.Scheme+":")
	}
	return s
}
