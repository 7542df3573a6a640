package sink_test

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/outboxd/outboxd/relay"
	"github.com/outboxd/outboxd/relay/sink"
)

// Event ids are unique within a source only: every sink qualifies the id a
// broker or consumer deduplicates on with the source when it is not
// default, and leaves default's as the bare event id.

const sharedID = "0f8fad5b-d9cb-469f-a165-70867728950e"

// JetStream deduplicates on Nats-Msg-Id: the same event id from two
// sources is two messages, and each names its source.
func TestNATSMessageIDNamesTheSource(t *testing.T) {
	t.Parallel()
	e := newJSEnv(t)
	s := e.open(t, nil)
	publishInTwoSources(t, s)
	msgs := e.fetch(t, 2)
	for i, want := range []struct{ msgID, source string }{{sharedID, ""}, {"orders/" + sharedID, "orders"}} {
		h := msgs[i].Headers()
		if h.Get("Nats-Msg-Id") != want.msgID || h.Get(sink.HeaderEventID) != want.msgID || h.Get(sink.HeaderSource) != want.source {
			t.Errorf("message %d: Nats-Msg-Id %q, %s %q, %s %q; want %q, %q", i, h.Get("Nats-Msg-Id"),
				sink.HeaderEventID, h.Get(sink.HeaderEventID), sink.HeaderSource, h.Get(sink.HeaderSource), want.msgID, want.source)
		}
	}
}

func TestAMQPMessageIDNamesTheSource(t *testing.T) {
	t.Parallel()
	e := newRabbitEnv(t, "outbox.#")
	s := openSink(t, e.url(nil))
	publishInTwoSources(t, s)
	ds := e.get(t, 2)
	for i, want := range []struct{ msgID, source string }{{sharedID, ""}, {"orders/" + sharedID, "orders"}} {
		d := ds[i]
		src, _ := d.Headers[sink.HeaderSource].(string)
		if d.MessageId != want.msgID || d.Headers[sink.HeaderEventID] != want.msgID || src != want.source {
			t.Errorf("message %d: message-id %q, %s %#v, %s %q; want %q, %q", i, d.MessageId,
				sink.HeaderEventID, d.Headers[sink.HeaderEventID], sink.HeaderSource, src, want.msgID, want.source)
		}
	}
}

func TestKafkaEventIDHeaderNamesTheSource(t *testing.T) {
	t.Parallel()
	c := newKafka(t, "outbox.orders.eu")
	s := openSink(t, kafkaSinkURL(c, nil))
	publishInTwoSources(t, s)
	rs := consume(t, c, 2, "outbox.orders.eu")
	for i, want := range []struct{ msgID, source string }{{sharedID, ""}, {"orders/" + sharedID, "orders"}} {
		if got, src := header(rs[i], sink.HeaderEventID), header(rs[i], sink.HeaderSource); got != want.msgID || src != want.source {
			t.Errorf("record %d: %s %q, %s %q; want %q, %q", i, sink.HeaderEventID, got, sink.HeaderSource, src, want.msgID, want.source)
		}
	}
}

func TestRedisEventIDFieldNamesTheSource(t *testing.T) {
	t.Parallel()
	e := newRedisEnv(t)
	s := openSink(t, e.url(nil))
	publishInTwoSources(t, s)
	msgs := e.entries(t, e.prefix+".orders%2Eeu")
	if len(msgs) != 2 {
		t.Fatalf("stream holds %d entries, want 2", len(msgs))
	}
	for i, want := range []struct{ msgID, source string }{{sharedID, ""}, {"orders/" + sharedID, "orders"}} {
		v := msgs[i].Values
		src, _ := v[sink.RedisFieldSource].(string)
		if v[sink.RedisFieldEventID] != want.msgID || src != want.source {
			t.Errorf("entry %d: %s %#v, %s %q; want %q, %q", i, sink.RedisFieldEventID, v[sink.RedisFieldEventID], sink.RedisFieldSource, src, want.msgID, want.source)
		}
	}
}

// webhook-id is what Standard Webhooks receivers deduplicate on, and what
// the signature covers.
func TestWebhookIDNamesTheSource(t *testing.T) {
	t.Parallel()
	h := newHook(t)
	s := openSink(t, h.url(t, nil))
	publishInTwoSources(t, s)
	got := h.requests()
	if len(got) != 2 {
		t.Fatalf("%d requests, want 2", len(got))
	}
	for i, want := range []string{sharedID, "orders/" + sharedID} {
		if got[i].err != nil {
			t.Errorf("request %d: signature check: %v", i, got[i].err)
		}
		if id := got[i].header.Get(sink.HeaderWebhookID); id != want {
			t.Errorf("request %d: webhook-id %q, want %q", i, id, want)
		}
	}
}

// The CloudEvents id is the message id too: (source, id) must be unique,
// and ce_source names the stream, not the source database.
func TestCloudEventsIDNamesTheSource(t *testing.T) {
	t.Parallel()
	e := newJSEnv(t)
	s := e.open(t, map[string]string{"cloudevents": "binary"})
	publishInTwoSources(t, s)
	msgs := e.fetch(t, 2)
	for i, want := range []string{sharedID, "orders/" + sharedID} {
		if got := msgs[i].Headers().Get("ce-id"); got != want {
			t.Errorf("message %d: ce-id %q, want %q", i, got, want)
		}
	}
}

// publishInTwoSources publishes one event id twice through s: as source
// default's, then as source orders'.
func publishInTwoSources(t *testing.T, s relay.Sink) {
	t.Helper()
	orders := testEvent(sharedID)
	orders.Source = "orders"
	for _, ev := range []relay.Event{testEvent(sharedID), orders} {
		if err := s.Publish(t.Context(), ev); err != nil {
			t.Fatal(err)
		}
	}
}

// The stdout line (and the webhook body, the same JSON) keeps the event ID
// as it is and names a source other than default in its source field, so
// the pair identifies the event; default's line has no source field.
func TestStdoutLineNamesTheSource(t *testing.T) {
	t.Parallel()
	var out lockedBuffer
	s, err := sink.Open(t.Context(), "stdout://", sink.Options{Stdout: &out})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	publishInTwoSources(t, s)
	lines := strings.Split(strings.TrimSuffix(out.String(), "\n"), "\n")
	if len(lines) != 2 {
		t.Fatalf("got %d lines, want 2:\n%s", len(lines), out.String())
	}
	for i, want := range []string{"", "orders"} {
		var got map[string]any
		if err := json.Unmarshal([]byte(lines[i]), &got); err != nil {
			t.Fatal(err)
		}
		src, has := got["source"]
		if got["event_id"] != sharedID || has != (want != "") || (has && src != want) {
			t.Errorf("line %d: event_id %v, source %v (present: %v); want %q, %q", i, got["event_id"], src, has, sharedID, want)
		}
	}
}
