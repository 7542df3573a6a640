package sink_test

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/outboxd/outboxd/relay/sink"
)

// A copy an operator's republish made says so where consumers read the
// event's fields: the stdout line and webhook body (the same JSON) in
// republish_action, a Redis entry in its republish_action field. A first
// copy has neither. (NATS, AMQP and Kafka: Outbox-Republish-Action, in
// their own tests.)
const republishedID = "9b2f3c1a-6d4e-4f8b-a1c2-3d4e5f6a7b8c"

func TestStdoutLineNamesTheRepublish(t *testing.T) {
	t.Parallel()
	var out lockedBuffer
	s, err := sink.Open(t.Context(), "stdout://", sink.Options{Stdout: &out})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })
	first, again := testEvent(republishedID), testEvent(republishedID)
	again.RepublishAction = 41
	if err := s.Publish(t.Context(), first); err != nil {
		t.Fatal(err)
	}
	if err := s.Publish(t.Context(), again); err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSuffix(out.String(), "\n"), "\n")
	if len(lines) != 2 {
		t.Fatalf("got %d lines, want 2:\n%s", len(lines), out.String())
	}
	for i, want := range []any{nil, float64(41)} {
		var got map[string]any
		if err := json.Unmarshal([]byte(lines[i]), &got); err != nil {
			t.Fatal(err)
		}
		if got["event_id"] != republishedID || got["republish_action"] != want {
			t.Errorf("line %d: event_id %v, republish_action %v; want %q, %v", i, got["event_id"], got["republish_action"], republishedID, want)
		}
	}
}

func TestRedisEntryNamesTheRepublish(t *testing.T) {
	t.Parallel()
	e := newRedisEnv(t)
	s := openSink(t, e.url(nil))
	first, again := testEvent(republishedID), testEvent(republishedID)
	again.RepublishAction = 41
	if err := s.Publish(t.Context(), first); err != nil {
		t.Fatal(err)
	}
	if err := s.Publish(t.Context(), again); err != nil {
		t.Fatal(err)
	}
	msgs := e.entries(t, e.prefix+".orders%2Eeu")
	if len(msgs) != 2 {
		t.Fatalf("stream holds %d entries, want 2", len(msgs))
	}
	for i, want := range []string{"", "41"} {
		v := msgs[i].Values
		got, _ := v[sink.RedisFieldRepublishAction].(string)
		if v[sink.RedisFieldEventID] != republishedID || got != want {
			t.Errorf("entry %d: %s %#v, %s %q; want %q, %q", i, sink.RedisFieldEventID, v[sink.RedisFieldEventID],
				sink.RedisFieldRepublishAction, got, republishedID, want)
		}
	}
}
