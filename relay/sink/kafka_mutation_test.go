package sink_test

import (
	"strings"
	"testing"

	"github.com/outboxd/outboxd/relay"
)

// A topic that renders as "." or ".." (Kafka refuses both names, though
// their characters are allowed) fails permanently before it reaches the
// broker, like any other invalid topic.
func TestKafkaDotTopicsArePermanent(t *testing.T) {
	t.Parallel()
	c := newKafka(t, "outbox.orders.eu")
	s := openSink(t, kafkaSinkURL(c, map[string]string{"topic": "{stream}", "timeout": "1s"}))
	for _, stream := range []string{".", ".."} {
		ev := testEvent("e-dot")
		ev.Stream = stream
		if err := s.Publish(t.Context(), ev); err == nil || !relay.IsPermanent(err) || !strings.Contains(err.Error(), "not a valid Kafka topic") {
			t.Errorf("Publish to topic %q = %v (permanent: %v), want a permanent invalid-topic error", stream, err, relay.IsPermanent(err))
		}
	}
}
