package sink_test

import (
	"context"
	"errors"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/outboxd/outboxd/relay"
	"github.com/outboxd/outboxd/relay/sink"
)

// waitClosed bounds a wait for ch with the 30 s hang guard.
func waitClosed(t *testing.T, what string, ch <-chan struct{}) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(30 * time.Second):
		t.Fatalf("hang guard: %s did not happen within 30s", what)
	}
}

// Close drains: a publish whose PubAck is still on its way when Close is
// called gets that ack and succeeds. A plain close drops the ack and fails
// a publish the stream stored, costing a redelivery (which Nats-Msg-Id
// then hides inside the window). The order is forced: the server's
// answers are held at a proxy until the client has begun to end the
// connection.
func TestNATSCloseLetsAnInFlightPublishGetItsAck(t *testing.T) {
	t.Parallel()
	e := newJSEnv(t)
	p, s := openThroughHoldProxy(t, e, nil)

	p.holdAtPub(1, `"seq":`)
	published := make(chan error, 1)
	go func() { published <- s.Publish(t.Context(), testEvent("e-in-flight")) }()
	waitClosed(t, "the publish going up", p.pubHeld)
	// JetStream acks from the stream's goroutine: wait for the PubAck to
	// be on its way before Close starts (a drain's flush could otherwise
	// be answered first).
	waitClosed(t, "the PubAck coming down", p.ansHeld)
	closed := make(chan error, 1)
	go func() { closed <- s.Close() }()
	waitClosed(t, "Close starting to end the connection", p.sawEnd)
	p.release()

	select {
	case err := <-published:
		if err != nil {
			t.Errorf("Publish in flight during Close = %v; want its PubAck, which the server sent", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("hang guard: Publish did not return within 30s")
	}
	select {
	case err := <-closed:
		if err != nil {
			t.Errorf("Close: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("hang guard: Close did not return within 30s")
	}
	e.fetch(t, 1)
}

// recreatedSmallBetween deletes e's stream under the sink s (opened
// through p), and has Publish of a 2 KiB event find it missing while the
// test creates it again, capturing the subjects but with a max_msg_size of
// 1 KiB, before the sink's answer (no responders) reaches it: the sink's
// ensureStream then finds the stream in place, and its second publish is
// refused as too large. It returns Publish's error.
func recreatedSmallBetween(t *testing.T, e *jsEnv, p *proxy, s interface {
	Publish(context.Context, relay.Event) error
}) error {
	t.Helper()
	e.deleteStream(t)
	// nats.go tries a publish answered "no responders" three times
	// (jetstream.DefaultPubRetryAttempts retries): the third answer is
	// held while the stream comes back.
	p.holdAtPub(1+jetstream.DefaultPubRetryAttempts, "NATS/1.0 503")
	published := make(chan error, 1)
	big := testEvent("e-big-after-recreate")
	big.Payload = []byte(`"` + strings.Repeat("x", 2048) + `"`)
	go func() { published <- s.Publish(t.Context(), big) }()
	waitClosed(t, "the last try of the publish going up", p.pubHeld)
	// Its "no responders" is on its way: the server handled it before the
	// stream comes back through another connection.
	waitClosed(t, "the last no-responders coming down", p.ansHeld)
	e.create(t, jetstream.StreamConfig{Subjects: []string{e.prefix + ".>"}, Storage: jetstream.FileStorage, Duplicates: 2 * time.Minute, MaxMsgSize: 1024})
	p.release()
	select {
	case err := <-published:
		return err
	case <-time.After(30 * time.Second):
		t.Fatal("hang guard: Publish did not return within 30s")
		return nil
	}
}

// openThroughHoldProxy opens a sink for e that reaches NATS through a
// proxy.
func openThroughHoldProxy(t *testing.T, e *jsEnv, params map[string]string) (*proxy, relay.Sink) {
	t.Helper()
	target, err := url.Parse(natsURL())
	if err != nil {
		t.Fatal(err)
	}
	p := newProxy(t, target.Host)
	u, err := url.Parse(e.url(params))
	if err != nil {
		t.Fatal(err)
	}
	u.Host = p.l.Addr().String()
	s, err := sink.Open(t.Context(), u.String(), sink.Options{})
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	t.Cleanup(func() {
		if err := s.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return p, s
}

// When the publish made after ensuring a deleted stream again fails, that
// failure is Publish's error, naming the stream (and nothing is stored):
// it is not taken for an ack.
func TestNATSPublishAfterEnsuringAgainFailsWithItsError(t *testing.T) {
	t.Parallel()
	e := newJSEnv(t)
	p, s := openThroughHoldProxy(t, e, nil)
	err := recreatedSmallBetween(t, e, p, s)
	if err == nil {
		t.Fatal("Publish succeeded though the stream refused the message as too large")
	}
	if msg := err.Error(); !strings.Contains(msg, "after ensuring JetStream stream "+strconv.Quote(e.stream)+" again") {
		t.Errorf("error %q does not say the publish after ensuring stream %s again failed", msg, e.stream)
	}
	if !errors.Is(err, jetstream.ErrStreamMessageExceedsMaximum) {
		t.Errorf("error %q does not wrap %v", err, jetstream.ErrStreamMessageExceedsMaximum)
	}
	if n := strings.Count(err.Error(), "nats sink:"); n != 1 {
		t.Errorf("error %q says %d times that it is the nats sink's; want the failure said once", err, n)
	}
	e.fetch(t, 0)
}

// A message over the stream's max_msg_size is refused for good (Publish
// parks it at once, see TestNATSStreamMaxMsgSizeIsPermanent), also when
// that refusal answers the publish made after ensuring a deleted stream
// again. (It used to return straight from Publish, past the checks that
// mark it permanent, so the event was retried until the server's max
// failures.)
func TestNATSMaxMsgSizeAfterEnsuringAgainIsPermanent(t *testing.T) {
	t.Parallel()
	e := newJSEnv(t)
	p, s := openThroughHoldProxy(t, e, nil)
	err := recreatedSmallBetween(t, e, p, s)
	if err == nil || !relay.IsPermanent(err) {
		t.Errorf("Publish refused by max_msg_size after ensuring the stream again = %v (permanent: %v), want a permanent error", err, relay.IsPermanent(err))
	}
}
