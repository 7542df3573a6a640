package sink_test

import (
	"context"
	"crypto/rand"
	"errors"
	"log/slog"
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outboxd/outboxd/relay"
	"github.com/outboxd/outboxd/relay/sink"
)

// waitFor bounds every broker round trip in these tests; nothing sleeps.
const waitFor = 5 * time.Second

func natsURL() string {
	if v := os.Getenv("NATS_URL"); v != "" {
		return v
	}
	return "nats://127.0.0.1:4222"
}

// jsEnv is one test's private corner of the shared NATS server: its own
// stream name and subject prefix, and a client of its own to inspect them.
type jsEnv struct {
	nc     *nats.Conn
	js     jetstream.JetStream
	stream string
	prefix string
}

func newJSEnv(t *testing.T) *jsEnv {
	t.Helper()
	nc, err := nats.Connect(natsURL())
	if err != nil {
		t.Fatalf("connect to NATS at %s (start nats-server with -js, or set NATS_URL): %v", natsURL(), err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	name := strings.Map(func(r rune) rune {
		if r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' {
			return r
		}
		return '_'
	}, t.Name())
	suffix := rand.Text()[:10]
	e := &jsEnv{nc: nc, js: js, stream: "T_" + name + "_" + suffix, prefix: "t_" + strings.ToLower(name+"_"+suffix)}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), waitFor)
		defer cancel()
		if err := js.DeleteStream(ctx, e.stream); err != nil && !errors.Is(err, jetstream.ErrStreamNotFound) {
			t.Errorf("delete stream %s: %v", e.stream, err)
		}
	})
	return e
}

// url builds a nats:// sink URL for this env with the default subject
// layout under the env's prefix; params override or add to it.
func (e *jsEnv) url(params map[string]string) string {
	u, err := url.Parse(natsURL())
	if err != nil {
		panic(err)
	}
	q := url.Values{"stream": {e.stream}, "subject": {e.prefix + ".{stream}.{aggregate_key}"}}
	for k, v := range params {
		q.Set(k, v)
	}
	u.RawQuery = q.Encode()
	return u.String()
}

func (e *jsEnv) open(t *testing.T, params map[string]string) relay.Sink {
	t.Helper()
	return e.openLogged(t, params, nil)
}

// openLogged is open with the sink's log written to out as text (nil
// discards it).
func (e *jsEnv) openLogged(t *testing.T, params map[string]string, out *lockedBuffer) relay.Sink {
	t.Helper()
	var opts sink.Options
	if out != nil {
		opts.Logger = slog.New(slog.NewTextHandler(out, nil))
	}
	s, err := sink.Open(t.Context(), e.url(params), opts)
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

// fetch reads n messages from the start of the stream through a fresh
// consumer, and checks the stream holds exactly n.
func (e *jsEnv) fetch(t *testing.T, n int) []jetstream.Msg {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), waitFor)
	defer cancel()
	st, err := e.js.Stream(ctx, e.stream)
	if err != nil {
		t.Fatal(err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.State.Msgs != uint64(n) {
		t.Fatalf("stream %s holds %d messages, want %d", e.stream, info.State.Msgs, n)
	}
	cons, err := st.CreateConsumer(ctx, jetstream.ConsumerConfig{
		AckPolicy:         jetstream.AckNonePolicy,
		DeliverPolicy:     jetstream.DeliverAllPolicy,
		InactiveThreshold: time.Minute,
	})
	if err != nil {
		t.Fatal(err)
	}
	var msgs []jetstream.Msg
	for len(msgs) < n {
		batch, err := cons.Fetch(n-len(msgs), jetstream.FetchMaxWait(waitFor))
		if err != nil {
			t.Fatal(err)
		}
		got := 0
		for m := range batch.Messages() {
			msgs = append(msgs, m)
			got++
		}
		if err := batch.Error(); err != nil {
			t.Fatalf("fetch: %v", err)
		}
		if got == 0 {
			t.Fatalf("fetch returned no messages after %d of %d", len(msgs), n)
		}
	}
	return msgs
}

func testEvent(id string) relay.Event {
	return relay.Event{
		ID:           id,
		Stream:       "orders.eu",
		AggregateKey: "order-42",
		Revision:     7,
		Type:         "OrderPlaced",
		Payload:      []byte(`{"total":12.5,"items":["a","b"]}`),
		Headers:      map[string]string{"traceparent": "00-4bf92f3577b34da6-00f067aa0ba902b7-01", "X-Tenant": "acme"},
		CreatedAt:    time.Date(2025, 3, 4, 5, 6, 7, 123456789, time.UTC),
		Attempt:      1,
	}
}

func TestNATSPublishLandsWithBodyAndHeaders(t *testing.T) {
	t.Parallel()
	e := newJSEnv(t)
	s := e.open(t, nil)
	ev := testEvent("0f8fad5b-d9cb-469f-a165-70867728950e")
	ev.Attempt = 3
	// Outbox-Created-At is in UTC whatever the time's zone.
	ev.CreatedAt = ev.CreatedAt.In(time.FixedZone("CET", 3600))
	if err := s.Publish(t.Context(), ev); err != nil {
		t.Fatalf("Publish: %v", err)
	}

	m := e.fetch(t, 1)[0]
	if want := e.prefix + ".orders%2Eeu.order-42"; m.Subject() != want {
		t.Errorf("subject = %q, want %q", m.Subject(), want)
	}
	if string(m.Data()) != string(ev.Payload) {
		t.Errorf("body = %q, want %q", m.Data(), ev.Payload)
	}
	want := map[string]string{
		"Nats-Msg-Id":           ev.ID,
		sink.HeaderEventID:      ev.ID,
		sink.HeaderStream:       "orders.eu",
		sink.HeaderAggregateKey: "order-42",
		sink.HeaderRevision:     "7",
		sink.HeaderEventType:    "OrderPlaced",
		sink.HeaderCreatedAt:    "2025-03-04T05:06:07.123456789Z",
		sink.HeaderAttempt:      "3",
		"traceparent":           ev.Headers["traceparent"],
		"X-Tenant":              "acme",
	}
	h := m.Headers()
	for k, v := range want {
		if got := h.Get(k); got != v {
			t.Errorf("header %s = %q, want %q", k, got, v)
		}
	}
}

func TestNATSSameEventIDStoredOnce(t *testing.T) {
	t.Parallel()
	e := newJSEnv(t)
	s := e.open(t, nil)
	first := testEvent("7c9e6679-7425-40de-944b-e07fc1f90ae7")
	for attempt := 1; attempt <= 3; attempt++ {
		ev := first
		ev.Attempt = attempt
		if err := s.Publish(t.Context(), ev); err != nil {
			t.Fatalf("Publish attempt %d: %v", attempt, err)
		}
	}
	other := testEvent("a3bb189e-8bf9-3888-9912-ace4e6543002")
	other.Revision = 8
	if err := s.Publish(t.Context(), other); err != nil {
		t.Fatalf("Publish other: %v", err)
	}

	msgs := e.fetch(t, 2)
	if got := msgs[0].Headers().Get(sink.HeaderAttempt); got != "1" {
		t.Errorf("stored copy is from attempt %s, want the first", got)
	}
	if got := msgs[1].Headers().Get(sink.HeaderEventID); got != other.ID {
		t.Errorf("second message is %s, want %s", got, other.ID)
	}
}

// An operator's republish is stored again inside the duplicate window
// (its Nats-Msg-Id names the republish), while the republish's own retries
// are not; every copy keeps the event's id in Outbox-Event-Id, and a
// republished one says which republish made it.
func TestNATSRepublishStoredAgainInsideTheWindow(t *testing.T) {
	t.Parallel()
	e := newJSEnv(t)
	s := e.open(t, nil)
	first := testEvent("5d1b5c3e-8f7a-4f55-9c1e-2b0b6f4d7a10")
	publish := func(republish int64, attempt int) {
		t.Helper()
		ev := first
		ev.RepublishAction, ev.Attempt = republish, attempt
		if err := s.Publish(t.Context(), ev); err != nil {
			t.Fatalf("Publish (republish %d, attempt %d): %v", republish, attempt, err)
		}
	}
	publish(0, 1)
	publish(0, 2) // a retry of the first copy
	publish(41, 3)
	publish(41, 4) // a retry of the republish
	publish(42, 5) // another republish

	msgs := e.fetch(t, 3)
	for i, want := range []struct{ msgID, attempt, action string }{
		{first.ID, "1", ""},
		{first.ID + "/republish/41", "3", "41"},
		{first.ID + "/republish/42", "5", "42"},
	} {
		h := msgs[i].Headers()
		if h.Get("Nats-Msg-Id") != want.msgID || h.Get(sink.HeaderAttempt) != want.attempt ||
			h.Get(sink.HeaderRepublishAction) != want.action || h.Get(sink.HeaderEventID) != first.ID {
			t.Errorf("message %d: Nats-Msg-Id %q, attempt %q, republish action %q, event id %q; want %q, %q, %q, %q",
				i, h.Get("Nats-Msg-Id"), h.Get(sink.HeaderAttempt), h.Get(sink.HeaderRepublishAction), h.Get(sink.HeaderEventID),
				want.msgID, want.attempt, want.action, first.ID)
		}
	}
}

func TestNATSSubjectEscapingRoundTrips(t *testing.T) {
	t.Parallel()
	e := newJSEnv(t)
	s := e.open(t, map[string]string{"subject": e.prefix + ".{event_type}.{aggregate_key}"})
	keys := []string{"a.b", "x*y", "p>q", "has space", "100%", "%2E", "..", ">", "*", "", "tab\there", "ключ", "plain"}
	for i, k := range keys {
		ev := testEvent("id-" + strconv.Itoa(i))
		ev.AggregateKey = k
		ev.Type = "Type.With Dots"
		if err := s.Publish(t.Context(), ev); err != nil {
			t.Fatalf("Publish key %q: %v", k, err)
		}
	}

	for _, m := range e.fetch(t, len(keys)) {
		i, err := strconv.Atoi(strings.TrimPrefix(m.Headers().Get(sink.HeaderEventID), "id-"))
		if err != nil {
			t.Fatal(err)
		}
		tokens := strings.Split(m.Subject(), ".")
		if len(tokens) != 3 || tokens[0] != e.prefix {
			t.Errorf("key %q gave subject %q, want 3 tokens under %s", keys[i], m.Subject(), e.prefix)
			continue
		}
		for _, tok := range tokens {
			if tok == "" || strings.ContainsAny(tok, "*> \t\r\n") {
				t.Errorf("subject %q has invalid token %q", m.Subject(), tok)
			}
		}
		if got, err := sink.UnescapeSubjectToken(tokens[2]); err != nil || got != keys[i] {
			t.Errorf("key %q: token %q unescapes to %q, %v", keys[i], tokens[2], got, err)
		}
		if got, err := sink.UnescapeSubjectToken(tokens[1]); err != nil || got != "Type.With Dots" {
			t.Errorf("event type token %q unescapes to %q, %v", tokens[1], got, err)
		}
	}
}

func TestNATSCreateFalseMissingStream(t *testing.T) {
	t.Parallel()
	e := newJSEnv(t)
	s, err := sink.Open(t.Context(), e.url(map[string]string{"create": "false"}), sink.Options{})
	if err == nil {
		_ = s.Close()
		t.Fatal("Open with create=false against a missing stream succeeded")
	}
	if errors.Is(err, sink.ErrInvalidURL) {
		t.Errorf("missing stream reported as an invalid URL: %v", err)
	}
	if !strings.Contains(err.Error(), e.stream) || !strings.Contains(err.Error(), "does not exist") {
		t.Errorf("error %q does not say stream %s does not exist", err, e.stream)
	}
}

// A stream whose max_msg_size is below the server's max_payload refuses a
// large message on the server side; that too is permanent.
func TestNATSStreamMaxMsgSizeIsPermanent(t *testing.T) {
	t.Parallel()
	e := newJSEnv(t)
	e.create(t, jetstream.StreamConfig{Subjects: []string{e.prefix + ".>"}, Storage: jetstream.MemoryStorage, MaxMsgSize: 1024})
	s := e.open(t, map[string]string{"create": "false"})
	big := testEvent("e-big")
	big.Payload = []byte(`"` + strings.Repeat("x", 2048) + `"`)
	if err := s.Publish(t.Context(), big); err == nil || !relay.IsPermanent(err) || !strings.Contains(err.Error(), "max_msg_size") {
		t.Errorf("Publish over the stream's max_msg_size = %v (permanent: %v)", err, relay.IsPermanent(err))
	}
	if err := s.Publish(t.Context(), testEvent("e-small")); err != nil {
		t.Fatalf("Publish of a small event: %v", err)
	}
	e.fetch(t, 1)
}

func TestNATSCreateFalseUsesExistingStream(t *testing.T) {
	t.Parallel()
	e := newJSEnv(t)
	ctx, cancel := context.WithTimeout(t.Context(), waitFor)
	defer cancel()
	e.create(t, jetstream.StreamConfig{Subjects: []string{e.prefix + ".>"}, Storage: jetstream.MemoryStorage, MaxMsgs: 100})
	s := e.open(t, map[string]string{"create": "false"})
	if err := s.Publish(t.Context(), testEvent("e1")); err != nil {
		t.Fatalf("Publish: %v", err)
	}
	e.fetch(t, 1)

	info, err := e.js.Stream(ctx, e.stream)
	if err != nil {
		t.Fatal(err)
	}
	if c := info.CachedInfo().Config; c.Storage != jetstream.MemoryStorage || c.MaxMsgs != 100 || !slices.Equal(c.Subjects, []string{e.prefix + ".>"}) {
		t.Errorf("create=false changed the stream: %+v", c)
	}
}

func TestNATSCreateWidensExistingStream(t *testing.T) {
	t.Parallel()
	e := newJSEnv(t)
	ctx, cancel := context.WithTimeout(t.Context(), waitFor)
	defer cancel()
	other := e.prefix + "_other.x"
	e.create(t, jetstream.StreamConfig{Subjects: []string{other}, Storage: jetstream.FileStorage, MaxMsgs: 1000, Duplicates: time.Minute})
	s := e.open(t, map[string]string{"duplicates": "3m"})
	if err := s.Publish(t.Context(), testEvent("e1")); err != nil {
		t.Fatalf("Publish: %v", err)
	}
	st, err := e.js.Stream(ctx, e.stream)
	if err != nil {
		t.Fatal(err)
	}
	c := st.CachedInfo().Config
	if !slices.Equal(c.Subjects, []string{other, e.prefix + ".*.*"}) {
		t.Errorf("subjects = %v", c.Subjects)
	}
	if c.MaxMsgs != 1000 || c.Duplicates != 3*time.Minute {
		t.Errorf("MaxMsgs = %d, Duplicates = %s; want 1000 kept and 3m set", c.MaxMsgs, c.Duplicates)
	}

	// Opening again finds nothing to change.
	s2 := e.open(t, map[string]string{"duplicates": "3m"})
	if err := s2.Publish(t.Context(), testEvent("e2")); err != nil {
		t.Fatalf("Publish via second sink: %v", err)
	}
	e.fetch(t, 2)
}

// duplicates returns the duplicate window of e's stream.
func (e *jsEnv) duplicates(t *testing.T) time.Duration {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), waitFor)
	defer cancel()
	st, err := e.js.Stream(ctx, e.stream)
	if err != nil {
		t.Fatal(err)
	}
	return st.CachedInfo().Config.Duplicates
}

// A relay started without duplicates= keeps the window of an existing
// stream: one rolled out with the README's plain URL must not shrink a
// window widened with duplicates=1h back to the default.
func TestNATSExistingStreamKeepsDuplicateWindow(t *testing.T) {
	t.Parallel()
	e := newJSEnv(t)
	e.open(t, map[string]string{"duplicates": "1h"})
	if got := e.duplicates(t); got != time.Hour {
		t.Fatalf("stream created with duplicates=1h has a window of %s", got)
	}
	var log lockedBuffer
	s := e.openLogged(t, nil, &log)
	if err := s.Publish(t.Context(), testEvent("e1")); err != nil {
		t.Fatalf("Publish: %v", err)
	}
	if got := e.duplicates(t); got != time.Hour {
		t.Errorf("after a sink without duplicates= opened the stream its window is %s, want 1h kept", got)
	}
	if strings.Contains(log.String(), "updated JetStream stream") {
		t.Errorf("a sink without duplicates= updated the stream:\n%s", log.String())
	}
}

// A window below the default is kept too, with a warning that says what
// it costs and which parameter widens it.
func TestNATSExistingShortDuplicateWindowWarns(t *testing.T) {
	t.Parallel()
	e := newJSEnv(t)
	e.create(t, jetstream.StreamConfig{Subjects: []string{e.prefix + ".>"}, Storage: jetstream.FileStorage, Duplicates: 30 * time.Second})
	var log lockedBuffer
	e.openLogged(t, nil, &log)
	if got := e.duplicates(t); got != 30*time.Second {
		t.Errorf("window = %s, want 30s kept", got)
	}
	out := log.String()
	if !strings.Contains(out, "level=WARN") || !strings.Contains(out, "stored twice") || !strings.Contains(out, "duplicates=") {
		t.Errorf("no warning about the short window naming duplicates=:\n%s", out)
	}
}

// An explicit duplicates= changes an existing stream's window, and the log
// says from what to what.
func TestNATSExplicitDuplicatesChangesExistingWindow(t *testing.T) {
	t.Parallel()
	e := newJSEnv(t)
	e.create(t, jetstream.StreamConfig{Subjects: []string{e.prefix + ".>"}, Storage: jetstream.FileStorage, Duplicates: time.Hour})
	var log lockedBuffer
	e.openLogged(t, map[string]string{"duplicates": "5m"}, &log)
	if got := e.duplicates(t); got != 5*time.Minute {
		t.Errorf("window = %s, want 5m set by duplicates=5m", got)
	}
	if out := log.String(); !strings.Contains(out, "duplicates=5m0s") || !strings.Contains(out, "previous_duplicates=1h0m0s") {
		t.Errorf("the update's log does not give the old and new windows:\n%s", out)
	}
}

func TestNATSPublishErrors(t *testing.T) {
	t.Parallel()
	e := newJSEnv(t)
	s := e.open(t, nil)

	for _, name := range []string{"X Tenant", "X-Ключ", "X-Tab\there"} {
		bad := testEvent("e-bad-name")
		bad.Headers = map[string]string{name: "v"}
		if err := s.Publish(t.Context(), bad); err == nil || !relay.IsPermanent(err) {
			t.Errorf("Publish with header name %q = %v (permanent: %v), want a permanent error", name, err, relay.IsPermanent(err))
		}
	}
	reserved := testEvent("e-reserved")
	reserved.Headers = map[string]string{"Nats-Rollup": "all"}
	if err := s.Publish(t.Context(), reserved); err == nil || !strings.Contains(err.Error(), "reserved") || !relay.IsPermanent(err) {
		t.Errorf("Publish with a Nats- header = %v (permanent: %v), want a permanent reserved-prefix error", err, relay.IsPermanent(err))
	}
	spoof := testEvent("e-spoof")
	spoof.Headers = map[string]string{"outbox-event-id": "other"}
	if err := s.Publish(t.Context(), spoof); err == nil || !relay.IsPermanent(err) {
		t.Errorf("Publish with an Outbox- header = %v (permanent: %v), want a permanent error", err, relay.IsPermanent(err))
	}
	if err := s.Publish(t.Context(), testEvent("")); err == nil {
		t.Error("Publish without an event ID succeeded")
	}
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if err := s.Publish(ctx, testEvent("e-cancelled")); !errors.Is(err, context.Canceled) {
		t.Errorf("Publish with a cancelled context = %v, want context.Canceled", err)
	}
	// Over the server's max_payload (1 MB by default; outboxd allows up
	// to 3 MiB): parked at once, not retried.
	big := testEvent("e-big")
	big.Payload = []byte(`"` + strings.Repeat("x", int(e.nc.MaxPayload())) + `"`)
	if err := s.Publish(t.Context(), big); err == nil || !relay.IsPermanent(err) || !strings.Contains(err.Error(), "max_payload") {
		t.Errorf("Publish over max_payload = %v (permanent: %v)", err, relay.IsPermanent(err))
	}

	info, err := e.js.Stream(t.Context(), e.stream)
	if err != nil {
		t.Fatal(err)
	}
	if n := info.CachedInfo().State.Msgs; n != 0 {
		t.Errorf("failed publishes stored %d messages", n)
	}
}

// create creates e's stream (cfg's name is e's) before the sink opens it.
func (e *jsEnv) create(t *testing.T, cfg jetstream.StreamConfig) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), waitFor)
	defer cancel()
	cfg.Name = e.stream
	if _, err := e.js.CreateStream(ctx, cfg); err != nil {
		t.Fatal(err)
	}
}

// createOther creates another stream than e's, capturing subject, and
// deletes it when the test ends; it returns its name.
func (e *jsEnv) createOther(t *testing.T, subject string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), waitFor)
	defer cancel()
	other := e.stream + "_OTHER"
	if _, err := e.js.CreateStream(ctx, jetstream.StreamConfig{Name: other, Subjects: []string{subject}}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), waitFor)
		defer cancel()
		if err := e.js.DeleteStream(ctx, other); err != nil {
			t.Errorf("delete stream %s: %v", other, err)
		}
	})
	return other
}

// createElsewhere creates e's stream as if managed elsewhere: under e's
// name, capturing none of the subjects the sink's template makes.
func (e *jsEnv) createElsewhere(t *testing.T, ctx context.Context) {
	t.Helper()
	if _, err := e.js.CreateStream(ctx, jetstream.StreamConfig{Name: e.stream, Subjects: []string{e.prefix + "_elsewhere.>"}}); err != nil {
		t.Fatal(err)
	}
}

// TestNATSPublishOutsideStreamFails checks that, with a stream managed
// elsewhere that does not capture the template's subjects, Publish returns
// an error instead of nil: nothing acknowledged the message.
func TestNATSPublishOutsideStreamFails(t *testing.T) {
	t.Parallel()
	e := newJSEnv(t)
	ctx, cancel := context.WithTimeout(t.Context(), waitFor)
	defer cancel()
	e.createElsewhere(t, ctx)
	s := e.open(t, map[string]string{"create": "false", "timeout": "2s"})
	err := s.Publish(t.Context(), testEvent("e1"))
	if err == nil {
		t.Fatal("Publish to a subject no stream captures succeeded")
	}
	if !strings.Contains(err.Error(), strconv.Quote(e.stream)) || !strings.Contains(err.Error(), "does not capture") {
		t.Errorf("error %q does not say stream %s does not capture the subject", err, e.stream)
	}
}

// deleteStream deletes e's stream through the JetStream API, as an
// operator might under a running relay.
func (e *jsEnv) deleteStream(t *testing.T) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), waitFor)
	defer cancel()
	if err := e.js.DeleteStream(ctx, e.stream); err != nil {
		t.Fatal(err)
	}
}

// A stream deleted under a running sink is recreated, with the same
// config, by the next Publish, which then succeeds: the events are not
// parked until the relay restarts.
func TestNATSRecreatesDeletedStream(t *testing.T) {
	t.Parallel()
	e := newJSEnv(t)
	var log lockedBuffer
	s := e.openLogged(t, map[string]string{"duplicates": "90s"}, &log)
	if err := s.Publish(t.Context(), testEvent("e1")); err != nil {
		t.Fatalf("Publish: %v", err)
	}
	e.deleteStream(t)

	if err := s.Publish(t.Context(), testEvent("e2")); err != nil {
		t.Fatalf("Publish after the stream was deleted: %v", err)
	}
	if got := e.fetch(t, 1)[0].Headers().Get(sink.HeaderEventID); got != "e2" {
		t.Errorf("recreated stream holds %s, want e2", got)
	}
	ctx, cancel := context.WithTimeout(t.Context(), waitFor)
	defer cancel()
	st, err := e.js.Stream(ctx, e.stream)
	if err != nil {
		t.Fatal(err)
	}
	if sc := st.CachedInfo().Config; sc.Storage != jetstream.FileStorage || sc.Duplicates != 90*time.Second || !slices.Equal(sc.Subjects, []string{e.prefix + ".*.*"}) {
		t.Errorf("recreated stream has storage %s, duplicates %s, subjects %v; want the config of Open: file, 90s, [%s.*.*]",
			sc.Storage, sc.Duplicates, sc.Subjects, e.prefix)
	}
	if out := log.String(); !strings.Contains(out, "level=WARN") || !strings.Contains(out, "ensuring the stream again") {
		t.Errorf("no warning that the stream was missing:\n%s", out)
	}
}

// Publishes that find the stream deleted at the same time recreate it
// once, not once each, and all succeed.
func TestNATSConcurrentPublishesRecreateOnce(t *testing.T) {
	t.Parallel()
	e := newJSEnv(t)
	var log lockedBuffer
	s := e.openLogged(t, nil, &log)
	e.deleteStream(t)

	const n = 8
	errs := make(chan error, n)
	for i := range n {
		go func() { errs <- s.Publish(t.Context(), testEvent("e"+strconv.Itoa(i))) }()
	}
	for range n {
		if err := <-errs; err != nil {
			t.Errorf("Publish: %v", err)
		}
	}
	e.fetch(t, n)
	if got := strings.Count(log.String(), "ensuring the stream again"); got != 1 {
		t.Errorf("%d publishes ran ensureStream %d times, want once:\n%s", n, got, log.String())
	}
}

// When recreating the deleted stream fails (here another stream holds
// subjects that overlap the template's), Publish fails with the reason,
// naming the stream.
func TestNATSRecreateFailureReported(t *testing.T) {
	t.Parallel()
	e := newJSEnv(t)
	s := e.open(t, nil)
	e.deleteStream(t)
	e.createOther(t, e.prefix+".x.y")

	err := s.Publish(t.Context(), testEvent("e1"))
	if err == nil {
		t.Fatal("Publish succeeded though the stream could not be recreated")
	}
	if msg := err.Error(); !strings.Contains(msg, "ensuring JetStream stream "+strconv.Quote(e.stream)+" again (create=true) failed") || !strings.Contains(msg, "create JetStream stream") {
		t.Errorf("error %q does not report the failed recreation of stream %s", msg, e.stream)
	}
	if !errors.Is(err, jetstream.ErrNoStreamResponse) {
		t.Errorf("error %q does not wrap JetStream's %v", err, jetstream.ErrNoStreamResponse)
	}
}

// With create=false the sink does not recreate a deleted stream, and the
// error says which stream is missing and why it stays so.
func TestNATSCreateFalseDeletedStreamNamed(t *testing.T) {
	t.Parallel()
	e := newJSEnv(t)
	ctx, cancel := context.WithTimeout(t.Context(), waitFor)
	defer cancel()
	e.create(t, jetstream.StreamConfig{Subjects: []string{e.prefix + ".>"}})
	s := e.open(t, map[string]string{"create": "false"})
	e.deleteStream(t)

	err := s.Publish(t.Context(), testEvent("e1"))
	if err == nil {
		t.Fatal("Publish with create=false to a deleted stream succeeded")
	}
	if msg := err.Error(); !strings.Contains(msg, strconv.Quote(e.stream)) || !strings.Contains(msg, "missing") || !strings.Contains(msg, "create=false") {
		t.Errorf("error %q does not say stream %s is missing and not recreated with create=false", msg, e.stream)
	}
	if !errors.Is(err, jetstream.ErrNoStreamResponse) {
		t.Errorf("error %q does not wrap JetStream's %v", err, jetstream.ErrNoStreamResponse)
	}
	if relay.IsPermanent(err) {
		t.Errorf("error %q is permanent; the stream may be created again", err)
	}
	if _, err := e.js.Stream(ctx, e.stream); !errors.Is(err, jetstream.ErrStreamNotFound) {
		t.Errorf("with create=false the stream was looked up as %v, want it still missing", err)
	}
}

func TestNATSCloseIsIdempotent(t *testing.T) {
	t.Parallel()
	e := newJSEnv(t)
	s, err := sink.Open(t.Context(), e.url(nil), sink.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Publish(t.Context(), testEvent("e1")); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatalf("Close: %v", err)
	}
	if err := s.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
	if err := s.Publish(t.Context(), testEvent("e2")); err == nil {
		t.Error("Publish after Close succeeded")
	}
}

// A stream the sink creates keeps what it acknowledges on disk (file
// storage: a PubAck then survives a server restart) and deduplicates
// Nats-Msg-Id over the duplicates window: 2m by default, or the URL's.
func TestNATSCreatesFileStreamWithDuplicateWindow(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		params map[string]string
		want   time.Duration
	}{
		{nil, 2 * time.Minute},
		{map[string]string{"duplicates": "90s"}, 90 * time.Second},
	} {
		e := newJSEnv(t)
		e.open(t, c.params)
		ctx, cancel := context.WithTimeout(t.Context(), waitFor)
		st, err := e.js.Stream(ctx, e.stream)
		cancel()
		if err != nil {
			t.Fatalf("the sink did not create stream %s: %v", e.stream, err)
		}
		sc := st.CachedInfo().Config
		if sc.Storage != jetstream.FileStorage || sc.Duplicates != c.want || !slices.Equal(sc.Subjects, []string{e.prefix + ".*.*"}) {
			t.Errorf("params %v: created stream with storage %s, duplicates %s, subjects %v; want file, %s, [%s.*.*]",
				c.params, sc.Storage, sc.Duplicates, sc.Subjects, c.want, e.prefix)
		}
	}
}

// A PubAck from a stream other than the configured one is not the
// acknowledgement the sink promises (that stream may keep nothing for
// long, or be deleted): Publish fails, and the other stream stores
// nothing.
func TestNATSPublishCapturedByAnotherStreamFails(t *testing.T) {
	t.Parallel()
	e := newJSEnv(t)
	ctx, cancel := context.WithTimeout(t.Context(), waitFor)
	defer cancel()
	e.createElsewhere(t, ctx)
	other := e.createOther(t, e.prefix+".>")
	s := e.open(t, map[string]string{"create": "false"})
	if err := s.Publish(t.Context(), testEvent("e1")); err == nil {
		t.Fatalf("Publish acknowledged by stream %s, not the configured %s, succeeded", other, e.stream)
	}
	st, err := e.js.Stream(ctx, other)
	if err != nil {
		t.Fatal(err)
	}
	if n := st.CachedInfo().State.Msgs; n != 0 {
		t.Errorf("stream %s stored %d messages", other, n)
	}
}
