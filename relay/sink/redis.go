package sink

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/maintnotifications"

	"github.com/outboxd/outboxd/relay"
)

// Defaults for the redis:// URL parameters; see the package comment.
const (
	DefaultRedisStream  = "outbox.{stream}"
	DefaultRedisTimeout = 10 * time.Second
)

// Fields of each Redis stream entry the sink adds.
const (
	RedisFieldEventID   = "event_id"
	RedisFieldSource    = "source"
	RedisFieldStream    = "stream"
	RedisFieldKey       = "key"
	RedisFieldRevision  = "revision"
	RedisFieldType      = "type"
	RedisFieldCreatedAt = "created_at"
	RedisFieldPayload   = "payload"
	RedisFieldHeaders   = "headers"
	// RedisFieldRepublishAction is set only on an entry of an operator's
	// republish: its action id (relay.Event.RepublishAction).
	RedisFieldRepublishAction = "republish_action"
)

// maxRedisKey bounds a rendered stream key. Redis accepts far longer keys;
// this only stops a runaway aggregate key from making huge ones.
const maxRedisKey = 2048

type redisConfig struct {
	opts    *redis.Options
	stream  *subjectTemplate
	maxLen  int64
	timeout time.Duration
}

func parseRedisURL(u *url.URL, display string) (*redisConfig, error) {
	if u.Opaque != "" || u.Host == "" {
		return nil, invalid(display, "want %s://host:port/db?stream=...", u.Scheme)
	}
	if u.Fragment != "" {
		return nil, invalid(display, "unexpected fragment")
	}
	p, err := params(u, display, "stream", "maxlen", "timeout")
	if err != nil {
		return nil, err
	}
	cfg := &redisConfig{timeout: DefaultRedisTimeout}
	stream := DefaultRedisStream
	if v, ok := p["stream"]; ok {
		stream = v
	}
	if cfg.stream, err = parseTemplate(stream, templateRules{what: "stream key", maxLen: maxRedisKey}); err != nil {
		return nil, invalid(display, "stream=%q: %v", stream, err)
	}
	if v, ok := p["maxlen"]; ok {
		if cfg.maxLen, err = strconv.ParseInt(v, 10, 64); err != nil || cfg.maxLen <= 0 {
			return nil, invalid(display, "maxlen=%q: want a positive number of entries", v)
		}
	}
	if v, ok := p["timeout"]; ok {
		if cfg.timeout, err = positiveDuration(v); err != nil {
			return nil, invalid(display, "timeout=%q: %v", v, err)
		}
	}
	server := *u
	server.RawQuery, server.ForceQuery = "", false
	if cfg.opts, err = redis.ParseURL(server.String()); err != nil {
		// go-redis's messages do not repeat the password.
		return nil, invalid(display, "%v", err)
	}
	o := cfg.opts
	o.ClientName = "outboxd-relay"
	o.DialTimeout = cfg.timeout
	// Publish's context (bounded by timeout) bounds each XADD.
	o.ContextTimeoutEnabled = true
	// One Publish is one XADD: a retry inside the client could add the
	// entry twice without the runner knowing; the runner retries instead.
	o.MaxRetries = -1
	// RESP2 and no maintenance notifications: nothing the sink uses, and
	// no background goroutines beyond the pool's.
	o.Protocol = 2
	o.MaintNotificationsConfig = &maintnotifications.Config{Mode: maintnotifications.ModeDisabled}
	return cfg, nil
}

// redisSink appends each event to a Redis stream with XADD.
type redisSink struct {
	c   *redis.Client
	cfg *redisConfig
}

func openRedis(ctx context.Context, u *url.URL, display string, opts Options) (relay.Sink, error) {
	cfg, err := parseRedisURL(u, display)
	if err != nil {
		return nil, err
	}
	c := redis.NewClient(cfg.opts)
	ctx, cancel := context.WithTimeout(ctx, cfg.timeout)
	defer cancel()
	if err := c.Ping(ctx).Err(); err != nil {
		_ = c.Close()
		return nil, fmt.Errorf("redis sink %q: connect: %w", display, err)
	}
	opts.Logger.Info("redis sink ready", "sink", "redis", "stream", cfg.stream.raw, "maxlen", cfg.maxLen)
	return &redisSink{c: c, cfg: cfg}, nil
}

// Publish appends ev to its stream and returns nil once Redis has
// answered the XADD: the entry is in the server's memory, and as durable
// as the server's persistence (appendonly, appendfsync) and replication
// make it. Redis keeps no record of event IDs, so a redelivered event is
// appended again: consumers deduplicate by the event_id field.
func (s *redisSink) Publish(ctx context.Context, ev relay.Event) error {
	if ev.ID == "" {
		return errors.New("redis sink: event has no ID, which consumers deduplicate by")
	}
	key, err := s.cfg.stream.render(ev)
	if err != nil {
		return fmt.Errorf("redis sink: %w", err)
	}
	headers := ev.Headers
	if headers == nil {
		headers = map[string]string{}
	}
	h, err := json.Marshal(headers)
	if err != nil {
		return fmt.Errorf("redis sink: headers: %w", err)
	}
	values := []any{
		RedisFieldEventID, ev.MessageID(),
		RedisFieldStream, ev.Stream,
		RedisFieldKey, ev.AggregateKey,
		RedisFieldRevision, strconv.FormatInt(ev.Revision, 10),
		RedisFieldType, ev.Type,
		RedisFieldCreatedAt, ev.CreatedAt.UTC().Format(time.RFC3339Nano),
		RedisFieldPayload, ev.Payload,
		RedisFieldHeaders, h,
	}
	if ev.Source != "" {
		values = append(values, RedisFieldSource, ev.Source)
	}
	if ev.RepublishAction != 0 {
		values = append(values, RedisFieldRepublishAction, strconv.FormatInt(ev.RepublishAction, 10))
	}
	args := &redis.XAddArgs{Stream: key, Values: values}
	if s.cfg.maxLen > 0 {
		args.MaxLen, args.Approx = s.cfg.maxLen, true
	}
	ctx, cancel := context.WithTimeout(ctx, s.cfg.timeout)
	defer cancel()
	if err := s.c.XAdd(ctx, args).Err(); err != nil {
		return fmt.Errorf("redis sink: XADD to %q: %w", key, err)
	}
	return nil
}

// Close closes the client's connections.
func (s *redisSink) Close() error {
	if err := s.c.Close(); err != nil && !errors.Is(err, redis.ErrClosed) {
		return fmt.Errorf("redis sink: close: %w", err)
	}
	return nil
}
