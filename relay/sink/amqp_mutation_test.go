package sink_test

import (
	"strings"
	"testing"

	"github.com/outboxd/outboxd/relay"
)

// max_bytes is the largest body accepted, not the first one refused: a
// body of exactly max_bytes is published and confirmed, one byte more is
// refused permanently.
func TestAMQPBodyOfExactlyMaxBytesIsPublished(t *testing.T) {
	t.Parallel()
	e := newRabbitEnv(t, "#")
	s := openSink(t, e.url(map[string]string{"max_bytes": "1024"}))
	fits := testEvent("e-fits")
	fits.Payload = []byte(`"` + strings.Repeat("x", 1022) + `"`)
	if err := s.Publish(t.Context(), fits); err != nil {
		t.Fatalf("Publish of a %d-byte body with max_bytes=1024: %v", len(fits.Payload), err)
	}
	over := testEvent("e-over")
	over.Payload = []byte(`"` + strings.Repeat("x", 1023) + `"`)
	if err := s.Publish(t.Context(), over); err == nil || !relay.IsPermanent(err) {
		t.Errorf("Publish of a %d-byte body with max_bytes=1024 = %v (permanent: %v), want a permanent error", len(over.Payload), err, relay.IsPermanent(err))
	}
	if d := e.get(t, 1)[0]; d.MessageId != "e-fits" || len(d.Body) != 1024 {
		t.Errorf("queue holds message %q of %d bytes, want e-fits of 1024", d.MessageId, len(d.Body))
	}
}

// The reserved prefix is refused however short the name: a header named
// just "Outbox-" is the sink's namespace too.
func TestAMQPBareOutboxPrefixHeaderIsRefused(t *testing.T) {
	t.Parallel()
	e := newRabbitEnv(t, "#")
	s := openSink(t, e.url(nil))
	ev := testEvent("e-bare-prefix")
	ev.Headers = map[string]string{"Outbox-": "v"}
	if err := s.Publish(t.Context(), ev); err == nil || !relay.IsPermanent(err) || !strings.Contains(err.Error(), "reserved prefix") {
		t.Errorf("Publish with header %q = %v (permanent: %v), want a permanent reserved-prefix error", "Outbox-", err, relay.IsPermanent(err))
	}
	e.get(t, 0)
}
