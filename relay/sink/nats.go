package sink

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outboxd/outboxd/relay"
)

// Defaults for the nats:// URL parameters; see the package comment.
const (
	DefaultNATSSubject    = "outbox.{stream}.{aggregate_key}"
	DefaultNATSStream     = "OUTBOX"
	DefaultNATSDuplicates = 2 * time.Minute
	DefaultNATSTimeout    = 10 * time.Second
)

// Headers the NATS sink sets on every message, so consumers can read the
// event's fields without parsing the subject or the payload.
const (
	HeaderEventID      = "Outbox-Event-Id"
	HeaderSource       = "Outbox-Source"
	HeaderStream       = "Outbox-Stream"
	HeaderAggregateKey = "Outbox-Aggregate-Key"
	HeaderRevision     = "Outbox-Revision"
	HeaderEventType    = "Outbox-Event-Type"
	HeaderCreatedAt    = "Outbox-Created-At"
	HeaderAttempt      = "Outbox-Attempt"
	// HeaderRepublishAction is set only on a delivery of a republish: the
	// operator action's id (relay.Event.RepublishAction).
	HeaderRepublishAction = "Outbox-Republish-Action"
)

// natsSink publishes to JetStream and reports success only on a PubAck.
type natsSink struct {
	// The URL's settings: subject template, stream, create, timeout, ...
	*natsConfig
	nc  *nats.Conn
	js  jetstream.JetStream
	log *slog.Logger

	// ensureSem (capacity 1) lets one Publish at a time run ensureStream
	// again after JetStream answered that no stream captures a subject
	// (the stream was deleted under the running relay).
	ensureSem chan struct{}
	// ensured counts those runs that succeeded: a Publish whose failure
	// began before one of them ended skips its own, so that publishes
	// failing together recreate the stream once.
	ensured atomic.Uint64

	closeOnce sync.Once
	closeErr  error
	// closed is closed by the connection's ClosedHandler, which runs once
	// the drain (or a plain close) has finished and the client's
	// goroutines are stopping; Close waits on it so it returns only then.
	closed chan struct{}
}

type natsConfig struct {
	server     string
	subject    *subjectTemplate
	stream     string
	create     bool
	duplicates time.Duration
	// duplicatesSet says the URL gave duplicates=: only then does the sink
	// change an existing stream's window.
	duplicatesSet bool
	timeout       time.Duration
	ce            ceConfig
}

// parseNATSURL validates everything in a nats:// URL before any network
// traffic, so configuration errors are never mistaken for outages.
func parseNATSURL(u *url.URL, display string) (*natsConfig, error) {
	if u.Opaque != "" || u.Host == "" {
		return nil, invalid(display, "want nats://host:port")
	}
	if u.Path != "" && u.Path != "/" {
		return nil, invalid(display, "unexpected path %q; want nats://host:port", u.Path)
	}
	if u.Fragment != "" {
		return nil, invalid(display, "unexpected fragment")
	}
	p, err := params(u, display, append([]string{"subject", "stream", "create", "duplicates", "timeout"}, ceParams...)...)
	if err != nil {
		return nil, err
	}
	cfg := &natsConfig{
		stream:     DefaultNATSStream,
		create:     true,
		duplicates: DefaultNATSDuplicates,
		timeout:    DefaultNATSTimeout,
	}
	if cfg.ce, err = parseCE(p, display, "ce-"); err != nil {
		return nil, err
	}
	subject := DefaultNATSSubject
	if v, ok := p["subject"]; ok {
		subject = v
	}
	if cfg.subject, err = parseSubjectTemplate(subject); err != nil {
		return nil, invalid(display, "%v", err)
	}
	if v, ok := p["stream"]; ok {
		cfg.stream = v
	}
	if err := checkStreamName(cfg.stream); err != nil {
		return nil, invalid(display, "%v", err)
	}
	if v, ok := p["create"]; ok {
		if cfg.create, err = strconv.ParseBool(v); err != nil {
			return nil, invalid(display, "create=%q: want true or false", v)
		}
	}
	if v, ok := p["duplicates"]; ok {
		if cfg.duplicates, err = positiveDuration(v); err != nil {
			return nil, invalid(display, "duplicates=%q: %v", v, err)
		}
		cfg.duplicatesSet = true
	}
	if v, ok := p["timeout"]; ok {
		if cfg.timeout, err = positiveDuration(v); err != nil {
			return nil, invalid(display, "timeout=%q: %v", v, err)
		}
	}
	server := *u
	server.RawQuery, server.Path, server.RawPath, server.ForceQuery = "", "", "", false
	cfg.server = server.String()
	return cfg, nil
}

func positiveDuration(v string) (time.Duration, error) {
	d, err := time.ParseDuration(v)
	if err != nil {
		return 0, errors.New("want a Go duration such as 2m or 500ms")
	}
	if d <= 0 {
		return 0, errors.New("must be positive")
	}
	return d, nil
}

// checkStreamName applies JetStream's rules for stream names (they appear
// as a token in API subjects and as a directory name on disk).
func checkStreamName(name string) error {
	if name == "" {
		return errors.New("stream name is empty")
	}
	for i := 0; i < len(name); i++ {
		c := name[i]
		if c <= ' ' || c >= 0x7F || strings.IndexByte(".*>/\\", c) >= 0 {
			return fmt.Errorf("stream name %q: only printable ASCII without '.', '*', '>', '/', '\\' is allowed", name)
		}
	}
	return nil
}

func openNATS(ctx context.Context, u *url.URL, display string, opts Options) (relay.Sink, error) {
	cfg, err := parseNATSURL(u, display)
	if err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("nats sink %q: %w", display, err)
	}
	log := opts.Logger.With("sink", "nats", "stream", cfg.stream)
	s := &natsSink{natsConfig: cfg, log: log, closed: make(chan struct{}), ensureSem: make(chan struct{}, 1)}
	var closedOnce sync.Once
	nc, err := nats.Connect(cfg.server,
		nats.Name("outboxd-relay"),
		// A relay outlives broker restarts: keep reconnecting, and let
		// publishes fail (and be retried with the same ID) meanwhile.
		nats.MaxReconnects(-1),
		nats.DrainTimeout(cfg.timeout),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			if err != nil {
				log.Warn("nats disconnected", "err", err)
			}
		}),
		nats.ReconnectHandler(func(c *nats.Conn) {
			log.Info("nats reconnected", "server", c.ConnectedUrlRedacted())
		}),
		nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
			log.Error("nats async error", "err", err)
		}),
		nats.ClosedHandler(func(*nats.Conn) {
			closedOnce.Do(func() { close(s.closed) })
		}),
	)
	if err != nil {
		return nil, fmt.Errorf("nats sink %q: connect: %w", display, err)
	}
	s.nc = nc
	fail := func(err error) (relay.Sink, error) {
		nc.Close()
		<-s.closed
		return nil, fmt.Errorf("nats sink %q: %w", display, err)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		return fail(err)
	}
	s.js = js
	setupCtx, cancel := context.WithTimeout(ctx, cfg.timeout)
	defer cancel()
	if err := ensureStream(setupCtx, js, cfg, log); err != nil {
		return fail(err)
	}
	log.Info("nats sink ready", "server", nc.ConnectedUrlRedacted(), "subject", cfg.subject.raw)
	return s, nil
}

// ensureStream makes sure the JetStream stream exists and captures the
// template's subjects. With create it creates the stream (with the duplicate
// window of the URL, or the default), or widens an existing one: it adds the
// template's subjects if they are not covered, and changes the duplicate
// window only when the URL sets duplicates= explicitly, so that a relay
// started without it keeps a window someone widened. Other settings
// (retention, limits, replicas) belong to whoever operates the stream and
// are kept. Without create it only checks that the stream exists, so a relay
// with restricted permissions can run against a stream managed elsewhere.
func ensureStream(ctx context.Context, js jetstream.JetStream, cfg *natsConfig, log *slog.Logger) error {
	filter := cfg.subject.filter()
	for attempt := 0; ; attempt++ {
		st, err := js.Stream(ctx, cfg.stream)
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			if !cfg.create {
				return fmt.Errorf("JetStream stream %q does not exist and create=false: create it with subjects covering %q, or set create=true", cfg.stream, filter)
			}
			_, err = js.CreateStream(ctx, jetstream.StreamConfig{
				Name:        cfg.stream,
				Description: "outboxd relay events",
				Subjects:    []string{filter},
				Storage:     jetstream.FileStorage,
				Duplicates:  cfg.duplicates,
			})
			if errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) && attempt == 0 {
				// Another relay created it with a different config between
				// our lookup and create: go round and widen it instead.
				continue
			}
			if err != nil {
				return fmt.Errorf("create JetStream stream %q: %w", cfg.stream, err)
			}
			log.Info("created JetStream stream", "subjects", filter, "duplicates", cfg.duplicates)
			return nil
		}
		if err != nil {
			return fmt.Errorf("look up JetStream stream %q: %w", cfg.stream, err)
		}

		sc := st.CachedInfo().Config
		covered := slices.ContainsFunc(sc.Subjects, func(s string) bool { return subjectSubsetOf(filter, s) })
		if sc.Storage != jetstream.FileStorage {
			log.Warn("JetStream stream does not use file storage; acknowledged events may be lost if the server restarts", "storage", sc.Storage.String())
		}
		if !cfg.create {
			if !covered {
				log.Warn("JetStream stream's subjects do not obviously cover the subject template; publishes outside them will fail",
					"subjects", sc.Subjects, "template_subjects", filter)
			}
			return nil
		}
		changed := false
		if !covered {
			sc.Subjects = append(sc.Subjects, filter)
			changed = true
		}
		was := sc.Duplicates
		switch {
		case cfg.duplicatesSet && sc.Duplicates != cfg.duplicates:
			sc.Duplicates = cfg.duplicates
			changed = true
		case !cfg.duplicatesSet && sc.Duplicates < DefaultNATSDuplicates:
			log.Warn("JetStream stream's duplicate window is below the default and is kept: redeliveries after that window are stored twice; set duplicates= in the sink URL to widen it",
				"duplicates", sc.Duplicates, "default", DefaultNATSDuplicates)
		}
		if !changed {
			return nil
		}
		if _, err := js.UpdateStream(ctx, sc); err != nil {
			return fmt.Errorf("update JetStream stream %q (subjects %v, duplicates %s): %w", cfg.stream, sc.Subjects, sc.Duplicates, err)
		}
		if sc.Duplicates != was {
			log.Info("updated JetStream stream", "subjects", sc.Subjects, "duplicates", sc.Duplicates, "previous_duplicates", was)
		} else {
			log.Info("updated JetStream stream", "subjects", sc.Subjects, "duplicates", sc.Duplicates)
		}
		return nil
	}
}

// Publish sends ev and returns nil only once JetStream has acknowledged
// storing it. The event's message id (relay.Event.DedupID: the event ID,
// qualified by its source outside default, and by the republish for a
// delivery an operator's republish made) is the Nats-Msg-Id, so a
// redelivery inside the stream's duplicate window is acknowledged as a duplicate without being
// stored twice; that counts as success, since the first copy is stored.
// A republish is stored again, however soon after the first copy.
//
// When no stream captures the subject (the stream was deleted while the
// relay runs), Publish with create=true runs ensureStream again, which
// recreates the stream as Open would, and publishes once more; with
// create=false it fails, saying the stream is missing.
func (s *natsSink) Publish(ctx context.Context, ev relay.Event) error {
	if ev.ID == "" {
		return errors.New("nats sink: event has no ID, which JetStream deduplication needs")
	}
	subj, err := s.subject.render(ev)
	if err != nil {
		return fmt.Errorf("nats sink: %w", err)
	}
	m, err := s.ce.message(ev)
	if err != nil {
		return fmt.Errorf("nats sink: %w", err)
	}
	msg := &nats.Msg{Subject: subj, Data: m.body, Header: make(nats.Header, len(ev.Headers)+len(m.headers)+9)}
	for k, v := range ev.Headers {
		if err := checkProducerHeader(k); err != nil {
			return relay.Permanent(fmt.Errorf("nats sink: %w", err))
		}
		if err := s.ce.checkHeader(k); err != nil {
			return fmt.Errorf("nats sink: %w", err)
		}
		msg.Header.Set(k, v)
	}
	if s.ce.on() {
		// The NATS binding: content-type header, attributes as ce-*.
		msg.Header.Set("content-type", m.contentType)
		for k, v := range m.headers {
			msg.Header.Set(k, v)
		}
	}
	msg.Header.Set(HeaderEventID, ev.MessageID())
	if ev.Source != "" {
		msg.Header.Set(HeaderSource, ev.Source)
	}
	msg.Header.Set(HeaderStream, ev.Stream)
	msg.Header.Set(HeaderAggregateKey, ev.AggregateKey)
	msg.Header.Set(HeaderRevision, strconv.FormatInt(ev.Revision, 10))
	msg.Header.Set(HeaderEventType, ev.Type)
	msg.Header.Set(HeaderCreatedAt, ev.CreatedAt.UTC().Format(time.RFC3339Nano))
	msg.Header.Set(HeaderAttempt, strconv.Itoa(ev.Attempt))
	if ev.RepublishAction != 0 {
		msg.Header.Set(HeaderRepublishAction, strconv.FormatInt(ev.RepublishAction, 10))
	}

	ctx, cancel := context.WithTimeout(ctx, s.timeout)
	defer cancel()
	opts := []jetstream.PublishOpt{
		jetstream.WithMsgID(ev.DedupID()),
		// Fail rather than report success if the subject is captured by
		// a stream other than the configured one.
		jetstream.WithExpectStream(s.stream),
	}
	ensured := s.ensured.Load()
	ack, err := s.js.PublishMsg(ctx, msg, opts...)
	var again string // says that the publish followed ensuring the stream again
	if errors.Is(err, jetstream.ErrNoStreamResponse) {
		// No stream captures subj: nats.go has already retried for
		// a leadership change.
		if err := s.ensureNoStream(ctx, subj, ensured, err); err != nil {
			return err
		}
		// Judged below as the first publish is: a message the stream
		// refuses is refused for good after ensuring it as before.
		ack, err = s.js.PublishMsg(ctx, msg, opts...)
		again = fmt.Sprintf(" after ensuring JetStream stream %q again", s.stream)
	}
	if errors.Is(err, nats.ErrMaxPayload) {
		// The server's max_payload counts headers and body; the same
		// message never fits, so park it now rather than retry it.
		return relay.Permanent(fmt.Errorf("nats sink: message of %d bytes (body and headers) over the server's max_payload of %d bytes%s: %w",
			natsMsgSize(msg), s.nc.MaxPayload(), again, err))
	}
	if errors.Is(err, jetstream.ErrStreamMessageExceedsMaximum) {
		// The stream's own max_msg_size, below the server's max_payload.
		return relay.Permanent(fmt.Errorf("nats sink: message of %d bytes over stream %s's max_msg_size%s: %w",
			natsMsgSize(msg), s.stream, again, err))
	}
	if err != nil {
		return fmt.Errorf("nats sink: publish to %q%s: %w", subj, again, err)
	}
	if ack.Duplicate {
		s.log.Debug("duplicate publish dropped by JetStream", "message_id", ev.DedupID(), "seq", ack.Sequence)
	}
	return nil
}

// ensureNoStream follows a publish to subj that JetStream answered with
// pubErr, no responders: no stream captures subj. With create it runs
// ensureStream again (unless another Publish did so since ensured was read
// before the failed publish) and returns nil, for the caller to publish
// once more; without create it reports the stream missing. Either way a
// returned error names the stream.
func (s *natsSink) ensureNoStream(ctx context.Context, subj string, ensured uint64, pubErr error) error {
	if !s.create {
		return s.noStreamError(ctx, subj, pubErr)
	}
	if err := s.ensureAgain(ctx, subj, ensured); err != nil {
		return fmt.Errorf("nats sink: publish to %q: %w; ensuring JetStream stream %q again (create=true) failed: %w", subj, pubErr, s.stream, err)
	}
	return nil
}

// ensureAgain runs ensureStream, one caller at a time, unless a run that
// began after ensured was read has succeeded.
func (s *natsSink) ensureAgain(ctx context.Context, subj string, ensured uint64) error {
	select {
	case s.ensureSem <- struct{}{}:
	case <-ctx.Done():
		return fmt.Errorf("waiting for another publish ensuring it: %w", ctx.Err())
	}
	defer func() { <-s.ensureSem }()
	if s.ensured.Load() != ensured {
		return nil
	}
	s.log.Warn("no JetStream stream captures the subject (stream deleted?); ensuring the stream again, as at startup", "subject", subj)
	if err := ensureStream(ctx, s.js, s.natsConfig, s.log); err != nil {
		return err
	}
	s.ensured.Add(1)
	return nil
}

// noStreamError says, for create=false, why no stream captured subj:
// whether the stream is missing or does not capture it, as far as a lookup
// tells.
func (s *natsSink) noStreamError(ctx context.Context, subj string, pubErr error) error {
	st, err := s.js.Stream(ctx, s.stream)
	switch {
	case errors.Is(err, jetstream.ErrStreamNotFound):
		return fmt.Errorf("nats sink: publish to %q: %w: JetStream stream %q is missing, and with create=false the relay does not recreate it (create it, or set create=true)", subj, pubErr, s.stream)
	case err != nil:
		return fmt.Errorf("nats sink: publish to %q: %w: JetStream stream %q is missing or does not capture the subject (looking it up: %v); with create=false the relay does not recreate it", subj, pubErr, s.stream, err)
	}
	subjects := st.CachedInfo().Config.Subjects
	if !slices.ContainsFunc(subjects, func(f string) bool { return subjectSubsetOf(subj, f) }) {
		return fmt.Errorf("nats sink: publish to %q: %w: JetStream stream %q does not capture the subject (its subjects: %v), and with create=false the relay does not widen it", subj, pubErr, s.stream, subjects)
	}
	return fmt.Errorf("nats sink: publish to %q: %w: JetStream stream %q captures the subject but did not answer", subj, pubErr, s.stream)
}

// checkProducerHeader rejects producer header names that NATS cannot carry,
// and the reserved prefixes: "Nats-" headers are instructions to the server
// (Nats-Rollup can purge a subject, Nats-Msg-Id would defeat
// deduplication), and "Outbox-" names are the sink's own. Rejecting makes
// the event fail visibly instead of being altered; Publish marks the
// refusal permanent (an event's headers never change), so the aggregate
// parks at once with it as the reason.
func checkProducerHeader(k string) error {
	if k == "" {
		return errors.New("empty header name")
	}
	for i := 0; i < len(k); i++ {
		if c := k[i]; c <= ' ' || c >= 0x7F || c == ':' {
			return fmt.Errorf("header name %q: only printable ASCII without ':' is allowed", k)
		}
	}
	for _, p := range []string{"nats-", "outbox-"} {
		if len(k) >= len(p) && strings.EqualFold(k[:len(p)], p) {
			return fmt.Errorf("header name %q uses the reserved prefix %q", k, k[:len(p)])
		}
	}
	return nil
}

// Close drains the connection, letting publishes already sent get their
// acks, and returns once the connection is closed. It is safe to call more
// than once.
func (s *natsSink) Close() error {
	s.closeOnce.Do(func() {
		if err := s.nc.Drain(); err != nil {
			// Drain refuses a closed or reconnecting connection; close it
			// outright so Close still releases everything.
			s.nc.Close()
			if !errors.Is(err, nats.ErrConnectionClosed) {
				s.closeErr = fmt.Errorf("nats sink: drain: %w", err)
			}
		}
		<-s.closed
	})
	return s.closeErr
}

// natsMsgSize approximates what nats.go counts against max_payload: the
// body and the encoded header block.
func natsMsgSize(m *nats.Msg) int {
	n := len(m.Data) + len("NATS/1.0\r\n\r\n")
	for k, vs := range m.Header {
		for _, v := range vs {
			n += len(k) + len(": ") + len(v) + len("\r\n")
		}
	}
	return n
}
