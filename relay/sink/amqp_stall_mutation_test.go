package sink_test

import (
	"context"
	"errors"
	"net/url"
	"strings"
	"testing"
)

// A broker that stops reading (a resource alarm blocks publishing
// connections) leaves the client's write blocked: Publish ends it at the
// timeout by closing the socket, and says so, with the deadline as the
// cause, rather than reporting whatever the cut write returned. The cut
// message never reaches the queue: it was never whole at the broker.
func TestAMQPStalledWriteFailsAtTheTimeout(t *testing.T) {
	t.Parallel()
	e := newRabbitEnv(t, "#")
	target, err := url.Parse(amqpURL())
	if err != nil {
		t.Fatal(err)
	}
	p := newProxy(t, target.Host)
	through := *target
	through.Host = p.l.Addr().String()
	s := openSink(t, amqpSinkURL(through.String(), e.exchange, map[string]string{"timeout": "500ms"}))

	p.stallUp()
	// Far more than the client's send buffer (at most 4 MiB here) and the
	// proxy's 128 KiB receive buffer hold: the write blocks.
	big := testEvent("e-stalled")
	big.Payload = []byte(`"` + strings.Repeat("x", 15<<20) + `"`)
	err = s.Publish(t.Context(), big)
	if err == nil || !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "no progress") {
		t.Errorf("Publish whose write the broker stopped reading = %v; want a no-progress error caused by the deadline", err)
	}
	p.release()
	e.get(t, 0)
}
