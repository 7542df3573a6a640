package sink

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/outboxd/outboxd/relay"
)

// Defaults for the kafka:// URL parameters; see the package comment.
const (
	DefaultKafkaTopic   = "outbox.{stream}"
	DefaultKafkaTimeout = 10 * time.Second
	// DefaultKafkaMaxBytes is Kafka's own default largest record batch
	// (the broker's message.max.bytes, and franz-go's
	// ProducerBatchMaxBytes): about 1 MB.
	DefaultKafkaMaxBytes = 1000012
)

// maxKafkaTopic is the longest topic name Kafka accepts.
const maxKafkaTopic = 249

type kafkaConfig struct {
	brokers  []string
	topic    *subjectTemplate
	timeout  time.Duration
	maxBytes int32
	tls      bool
	clientID string
	ce       ceConfig
}

func parseKafkaURL(u *url.URL, display string) (*kafkaConfig, error) {
	if u.Opaque != "" || u.Host == "" {
		return nil, invalid(display, "want kafka://host:port[,host:port...]?topic=...")
	}
	if u.User != nil {
		return nil, invalid(display, "SASL credentials are not supported yet")
	}
	if u.Path != "" && u.Path != "/" {
		return nil, invalid(display, "unexpected path %q; want kafka://host:port", u.Path)
	}
	if u.Fragment != "" {
		return nil, invalid(display, "unexpected fragment")
	}
	p, err := params(u, display, append([]string{"topic", "timeout", "max_bytes", "tls", "client_id"}, ceParams...)...)
	if err != nil {
		return nil, err
	}
	cfg := &kafkaConfig{timeout: DefaultKafkaTimeout, maxBytes: DefaultKafkaMaxBytes, clientID: "outboxd-relay"}
	if cfg.ce, err = parseCE(p, display, "ce_"); err != nil {
		return nil, err
	}
	for _, b := range strings.Split(u.Host, ",") {
		if host, port, err := net.SplitHostPort(b); err != nil || host == "" || port == "" {
			return nil, invalid(display, "broker %q: want host:port", b)
		}
		cfg.brokers = append(cfg.brokers, b)
	}
	topic := DefaultKafkaTopic
	if v, ok := p["topic"]; ok {
		topic = v
	}
	if cfg.topic, err = parseTemplate(topic, templateRules{what: "topic", raw: true, maxLen: maxKafkaTopic}); err != nil {
		return nil, invalid(display, "topic=%q: %v", topic, err)
	}
	for _, tok := range cfg.topic.tokens {
		if tok.ph == "" && !validKafkaTopicChars(tok.literal) {
			return nil, invalid(display, "topic=%q: %q: a Kafka topic takes only ASCII letters, digits, '.', '_' and '-'", topic, tok.literal)
		}
	}
	if v, ok := p["timeout"]; ok {
		if cfg.timeout, err = positiveDuration(v); err != nil {
			return nil, invalid(display, "timeout=%q: %v", v, err)
		}
		if cfg.timeout < time.Second {
			// franz-go's least record delivery timeout.
			return nil, invalid(display, "timeout=%q: must be at least 1s", v)
		}
	}
	if v, ok := p["max_bytes"]; ok {
		n, err := strconv.ParseInt(v, 10, 32)
		if err != nil || n < 1024 {
			return nil, invalid(display, "max_bytes=%q: want a number of bytes, at least 1024 (match the topic's max.message.bytes)", v)
		}
		cfg.maxBytes = int32(n)
	}
	if v, ok := p["tls"]; ok {
		if cfg.tls, err = strconv.ParseBool(v); err != nil {
			return nil, invalid(display, "tls=%q: want true or false", v)
		}
	}
	if v, ok := p["client_id"]; ok {
		if v == "" || !validKafkaTopicChars(v) {
			return nil, invalid(display, "client_id=%q: want ASCII letters, digits, '.', '_' and '-'", v)
		}
		cfg.clientID = v
	}
	return cfg, nil
}

func validKafkaTopicChars(s string) bool {
	for i := 0; i < len(s); i++ {
		c := s[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '_' || c == '-') {
			return false
		}
	}
	return true
}

// kafkaSink produces each event as one record with an idempotent producer
// and acks=all.
type kafkaSink struct {
	cl        *kgo.Client
	cfg       *kafkaConfig
	closeOnce sync.Once
}

func openKafka(ctx context.Context, u *url.URL, display string, opts Options) (relay.Sink, error) {
	cfg, err := parseKafkaURL(u, display)
	if err != nil {
		return nil, err
	}
	kopts := []kgo.Opt{
		kgo.SeedBrokers(cfg.brokers...),
		kgo.ClientID(cfg.clientID),
		// Both are franz-go's defaults; stated because the sink's promise
		// rests on them: a record is acked once every in-sync replica has
		// it, and the client's own retries never write it twice or out of
		// order within the producer's session.
		kgo.RequiredAcks(kgo.AllISRAcks()),
		kgo.ProducerBatchMaxBytes(cfg.maxBytes),
		// Bound each record, in flight included: a ProduceSync whose
		// context ends while the record is in flight waits for it.
		kgo.RecordDeliveryTimeout(cfg.timeout),
		kgo.ProduceRequestTimeout(cfg.timeout),
		kgo.DialTimeout(cfg.timeout),
		kgo.WithLogger(kgoLogger{opts.Logger.With("sink", "kafka")}),
	}
	if cfg.tls {
		kopts = append(kopts, kgo.DialTLSConfig(&tls.Config{MinVersion: tls.VersionTLS12}))
	}
	cl, err := kgo.NewClient(kopts...)
	if err != nil {
		return nil, invalid(display, "%v", err)
	}
	pctx, cancel := context.WithTimeout(ctx, cfg.timeout)
	defer cancel()
	if err := cl.Ping(pctx); err != nil {
		cl.Close()
		return nil, fmt.Errorf("kafka sink %q: connect: %w", display, err)
	}
	opts.Logger.Info("kafka sink ready", "sink", "kafka", "brokers", cfg.brokers, "topic", cfg.topic.raw)
	return &kafkaSink{cl: cl, cfg: cfg}, nil
}

// Publish produces ev to its topic, keyed by the aggregate key so that one
// aggregate's events share a partition (and its order), and returns nil
// once every in-sync replica has the record (acks=all).
func (s *kafkaSink) Publish(ctx context.Context, ev relay.Event) error {
	if ev.ID == "" {
		return errors.New("kafka sink: event has no ID")
	}
	topic, err := s.cfg.topic.render(ev)
	if err != nil {
		return fmt.Errorf("kafka sink: %w", err)
	}
	if topic == "" || topic == "." || topic == ".." || !validKafkaTopicChars(topic) {
		return relay.Permanent(fmt.Errorf("kafka sink: topic %q is not a valid Kafka topic name (only ASCII letters, digits, '.', '_', '-')", topic))
	}
	m, err := s.cfg.ce.message(ev)
	if err != nil {
		return fmt.Errorf("kafka sink: %w", err)
	}
	rec := &kgo.Record{
		Topic:   topic,
		Key:     []byte(ev.AggregateKey),
		Value:   m.body,
		Headers: make([]kgo.RecordHeader, 0, len(ev.Headers)+len(m.headers)+8),
		// Timestamp is left to the client (the produce time): created_at
		// can be days old for an event that was parked, and a topic's
		// time-based retention would delete such a record at once. It is
		// in the Outbox-Created-At header.
	}
	for k, v := range ev.Headers {
		if len(k) >= 7 && strings.EqualFold(k[:7], "outbox-") {
			// An event's headers never change: park it now.
			return relay.Permanent(fmt.Errorf("kafka sink: header name %q uses the reserved prefix %q", k, k[:7]))
		}
		if err := s.cfg.ce.checkHeader(k); err != nil {
			return fmt.Errorf("kafka sink: %w", err)
		}
		rec.Headers = append(rec.Headers, kgo.RecordHeader{Key: k, Value: []byte(v)})
	}
	rec.Headers = append(rec.Headers,
		kgo.RecordHeader{Key: HeaderEventID, Value: []byte(ev.MessageID())},
		kgo.RecordHeader{Key: HeaderEventType, Value: []byte(ev.Type)},
		kgo.RecordHeader{Key: HeaderStream, Value: []byte(ev.Stream)},
		kgo.RecordHeader{Key: HeaderAggregateKey, Value: []byte(ev.AggregateKey)},
		kgo.RecordHeader{Key: HeaderRevision, Value: []byte(strconv.FormatInt(ev.Revision, 10))},
		kgo.RecordHeader{Key: HeaderCreatedAt, Value: []byte(ev.CreatedAt.UTC().Format(time.RFC3339Nano))},
		kgo.RecordHeader{Key: HeaderAttempt, Value: []byte(strconv.Itoa(ev.Attempt))},
	)
	if ev.Source != "" {
		rec.Headers = append(rec.Headers, kgo.RecordHeader{Key: HeaderSource, Value: []byte(ev.Source)})
	}
	if ev.RepublishAction != 0 {
		rec.Headers = append(rec.Headers,
			kgo.RecordHeader{Key: HeaderRepublishAction, Value: []byte(strconv.FormatInt(ev.RepublishAction, 10))})
	}
	if s.cfg.ce.on() {
		// The Kafka binding: content-type header, attributes as ce_*.
		rec.Headers = append(rec.Headers, kgo.RecordHeader{Key: "content-type", Value: []byte(m.contentType)})
		for _, k := range slices.Sorted(maps.Keys(m.headers)) {
			rec.Headers = append(rec.Headers, kgo.RecordHeader{Key: k, Value: []byte(m.headers[k])})
		}
	}
	ctx, cancel := context.WithTimeout(ctx, s.cfg.timeout)
	defer cancel()
	if err := s.cl.ProduceSync(ctx, rec).FirstErr(); err != nil {
		if errors.Is(err, kerr.MessageTooLarge) {
			// Refused by the client (over ProducerBatchMaxBytes) or by the
			// broker (over message.max.bytes): the same record always is.
			return relay.Permanent(fmt.Errorf("kafka sink: produce to %q: record over max_bytes=%d (raise it with the topic's max.message.bytes): %w", topic, s.cfg.maxBytes, err))
		}
		return fmt.Errorf("kafka sink: produce to %q: %w", topic, err)
	}
	return nil
}

// Close flushes nothing (every Publish waited for its record) and closes
// the client.
func (s *kafkaSink) Close() error {
	s.closeOnce.Do(s.cl.Close)
	return nil
}

// kgoLogger sends franz-go's warnings and errors to the sink's logger.
type kgoLogger struct{ log *slog.Logger }

func (l kgoLogger) Level() kgo.LogLevel { return kgo.LogLevelWarn }

func (l kgoLogger) Log(level kgo.LogLevel, msg string, keyvals ...any) {
	switch level {
	case kgo.LogLevelError:
		l.log.Error(msg, keyvals...)
	case kgo.LogLevelWarn:
		l.log.Warn(msg, keyvals...)
	default:
		l.log.Debug(msg, keyvals...)
	}
}
