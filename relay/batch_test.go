package relay

import (
	"context"
	"fmt"
	"testing"

	"github.com/outboxd/outboxd/internal/servertest"
)

// waitDiscovered waits until every event committed so far is in a
// delivery row, so that the runner's first claim leases them all.
func (e *env) waitDiscovered(t *testing.T) {
	t.Helper()
	waitUntil(t, "every event discovered", func() bool {
		var pending bool
		if err := e.pool.QueryRow(context.Background(),
			`SELECT EXISTS (SELECT 1 FROM outbox.events_since((SELECT snapshot FROM outbox.discovery)))`).Scan(&pending); err != nil {
			t.Fatal(err)
		}
		return !pending
	})
}

// The runner asks for batches and publishes every delivery of a batch once,
// with a window as without: deliveries claimed at once come in one message.
func TestRunnerTakesBatches(t *testing.T) {
	t.Parallel()
	for _, window := range []int{1, 4} {
		t.Run(fmt.Sprintf("window=%d", window), func(t *testing.T) {
			t.Parallel()
			e := newEnv(t, servertest.Options{})
			var ids []string
			for i := range 10 {
				for range window {
					ids = append(ids, e.emit(t, "orders", fmt.Sprintf("k-%d", i)))
				}
			}
			e.waitDiscovered(t)
			var stream streamLog
			pub := newPublisher()
			start(t, Config{Conn: e.dial(t, stream.option()), Publisher: pub, MaxInFlight: 64, MaxInFlightPerAggregate: window}, hooks{})
			e.waitPublished(t, ids...)
			for _, id := range ids {
				if n := pub.attemptsOf(id); n != 1 {
					t.Errorf("event %s published %d times, want 1", id, n)
				}
			}
			if accept := stream.accepts(); len(accept) == 0 || !accept[0] {
				t.Fatalf("Subscribe's accept_batches: %v", accept)
			}
			if perMsg := stream.perMessage(); len(perMsg) == 0 || perMsg[0] != len(ids) {
				t.Fatalf("deliveries per message %v: the first claim's %d did not come in one", perMsg, len(ids))
			}
		})
	}
}
