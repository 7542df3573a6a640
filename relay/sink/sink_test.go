package sink_test

import (
	"testing"

	"github.com/outboxd/outboxd/relay/sink"
)

// Redact writes a sink URL back as the flag gave it, a password hidden:
// "stdout://" stays "stdout://" (url.URL.String would drop the slashes).
func TestRedactKeepsTheURLsShape(t *testing.T) {
	for in, want := range map[string]string{
		"stdout://":                       "stdout://",
		"stdout://?format=json":           "stdout://?format=json",
		"nats://127.0.0.1:4222":           "nats://127.0.0.1:4222",
		"amqp://guest:secret@host:5672/v": "amqp://guest:xxxxx@host:5672/v",
	} {
		if got := sink.Redact(in); got != want {
			t.Errorf("Redact(%q) = %q, want %q", in, got, want)
		}
	}
}
