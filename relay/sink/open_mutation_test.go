package sink_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/outboxd/outboxd/relay/sink"
)

// A name of exactly the length limit is valid: these URLs pass validation
// and fail only at connecting (nothing listens on port 1), not as invalid.
func TestOpenAcceptsNamesOfExactlyTheLimit(t *testing.T) {
	t.Parallel()
	for _, u := range []string{
		"amqp://127.0.0.1:1/?timeout=1s&exchange=" + strings.Repeat("x", 255),
		"amqp://127.0.0.1:1/?timeout=1s&exchange=x&routing_key=" + strings.Repeat("k", 255),
		"nats://127.0.0.1:1?timeout=1s&subject=" + strings.Repeat("s", 2048),
	} {
		s, err := sink.Open(context.Background(), u, sink.Options{})
		if err == nil {
			_ = s.Close()
			t.Errorf("Open(%.60q...) succeeded against port 1", u)
			continue
		}
		if errors.Is(err, sink.ErrInvalidURL) {
			t.Errorf("Open(%.60q...) = %v; a name of exactly the limit is valid", u, err)
		}
	}
}
