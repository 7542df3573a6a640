package relay

import (
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/servertest"
)

// An Ack that fails as unavailable (a network blip) is sent again and
// lands, within AckRetryTimeout, rather than being given up at once: an ack
// given up costs a redelivery of an event the broker already has.
func TestAckRetriesATransientFailureBeforeGivingUp(t *testing.T) {
	t.Parallel()
	e := newEnv(t, servertest.Options{})
	id := e.emit(t, "orders", "a")
	var calls atomic.Int32
	blip := withAckFault(func(r *outboxv1.AckRequest, send func(*outboxv1.AckRequest) (*outboxv1.AckResponse, error)) (*outboxv1.AckResponse, error) {
		if calls.Add(1) == 1 {
			return nil, status.Error(codes.Unavailable, "injected: connection reset")
		}
		return send(r)
	})
	givenUp := make(chan int, 10)
	// An hour-long lease: only the retried ack can publish the event within
	// the test.
	start(t, Config{Conn: e.dial(t, blip...), Publisher: newPublisher(), LeaseTTL: time.Hour, AckRetryTimeout: time.Minute},
		hooks{ackGivenUp: func(k int) { givenUp <- k }})
	waitUntil(t, "the event to be published", func() bool {
		select {
		case k := <-givenUp:
			t.Fatalf("%d acks given up after one unavailable answer, want the ack sent again", k)
		default:
		}
		return e.published(t, id)
	})
	if n := calls.Load(); n != 2 {
		t.Fatalf("%d Ack requests, want 2 (one failed, one retried)", n)
	}
}
