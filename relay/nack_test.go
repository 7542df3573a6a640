package relay

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/servertest"
	"github.com/outboxd/outboxd/server"
)

// A failed publish is nacked, and so counted towards parking, whatever
// the broker's error says: bytes that are not UTF-8 (which made the Nack
// request unmarshalable), a NUL (which PostgreSQL text cannot hold), or
// more text than the server stores.
func TestRunnerNacksWhateverThePublisherSays(t *testing.T) {
	t.Parallel()
	e := newEnv(t, servertest.Options{})
	e.emit(t, "orders", "a")
	pub := newPublisher()
	pub.fail = errors.New("broker: \x00\xff " + strings.Repeat("é", 5000))
	start(t, Config{Conn: e.srv.Conn, Publisher: pub}, hooks{})
	var a *outboxv1.Aggregate
	waitUntil(t, "the failure to be recorded", func() bool {
		a = e.aggregate(t, "orders", "a")
		return a.GetFailures() >= 1
	})
	if last := a.GetLastError(); !strings.HasPrefix(last, "broker: \\0\uFFFD éé") {
		t.Fatalf("recorded error %.40q", last)
	}
}

func TestNackText(t *testing.T) {
	t.Parallel()
	for _, in := range []string{"", "plain", "nul\x00", "bad\xffutf8", strings.Repeat("é", 3000), strings.Repeat("x", 5000)} {
		got := nackText(errors.New(in))
		if len(got) > maxNackText || !utf8.ValidString(got) || strings.ContainsRune(got, 0) {
			t.Errorf("nackText(%.20q) = %d bytes %.20q: want valid UTF-8 without NUL, at most %d bytes", in, len(got), got, maxNackText)
		}
		if len(in) <= maxNackText && utf8.ValidString(in) && !strings.ContainsRune(in, 0) && got != in {
			t.Errorf("nackText(%.20q) changed a fine text to %.20q", in, got)
		}
	}
}

// A publisher's RetryAfter reaches the server as the Nack's retry_after:
// the next attempt waits for it. One above the server's backoff cap is
// capped there, and the failure is counted.
func TestRunnerNackCarriesRetryAfter(t *testing.T) {
	t.Parallel()
	e := newEnv(t, servertest.Options{Configure: func(c *server.Config) {
		c.BackoffBase, c.BackoffCap = 10*time.Millisecond, time.Minute
	}})
	e.emit(t, "orders", "a")
	e.emit(t, "orders", "b")
	pub := &retryAfterPublisher{after: map[string]time.Duration{"a": 30 * time.Second, "b": time.Hour}}
	start(t, Config{Conn: e.srv.Conn, Publisher: pub}, hooks{})
	for _, key := range []string{"a", "b"} {
		var a *outboxv1.Aggregate
		waitUntil(t, key+"'s failure to be recorded", func() bool {
			a = e.aggregate(t, "orders", key)
			return a.GetFailures() >= 1
		})
		wait := time.Until(a.GetNextAttemptAt().AsTime())
		switch key {
		case "a":
			if wait < 20*time.Second || wait > 31*time.Second {
				t.Errorf("aggregate a: next attempt in %v, want the 30s RetryAfter", wait)
			}
		case "b":
			if wait < 50*time.Second || wait > 61*time.Second {
				t.Errorf("aggregate b: next attempt in %v, want the 1m backoff cap for a 1h RetryAfter", wait)
			}
		}
		if !strings.Contains(a.GetLastError(), "throttled") {
			t.Errorf("aggregate %s: last error %q", key, a.GetLastError())
		}
	}
}

type retryAfterPublisher struct{ after map[string]time.Duration }

func (p *retryAfterPublisher) Publish(_ context.Context, ev Event) error {
	return RetryAfter(errors.New("throttled"), p.after[ev.AggregateKey])
}

func TestRetryAfterOf(t *testing.T) {
	t.Parallel()
	base := errors.New("503")
	if d, ok := RetryAfterOf(fmt.Errorf("wrapped: %w", RetryAfter(base, time.Second))); !ok || d != time.Second {
		t.Errorf("RetryAfterOf through a wrap = %v, %v", d, ok)
	}
	if err := RetryAfter(base, time.Second); !errors.Is(err, base) || err.Error() != "503" {
		t.Errorf("RetryAfter changed the error: %v", err)
	}
	if RetryAfter(nil, time.Second) != nil || RetryAfter(base, 0) != base {
		t.Error("RetryAfter(nil) or with d <= 0 should return its error unchanged")
	}
	if _, ok := RetryAfterOf(base); ok {
		t.Error("RetryAfterOf of a plain error reports a delay")
	}
}

// A publish error marked Permanent parks its aggregate at the first
// failure, with the error in the reason, although the server would
// otherwise retry it MaxFailures times; an ordinary error on another
// aggregate is only counted.
func TestRunnerPermanentErrorParksAtOnce(t *testing.T) {
	t.Parallel()
	e := newEnv(t, servertest.Options{Configure: func(c *server.Config) { c.MaxFailures = 100 }})
	e.emit(t, "orders", "big")
	e.emit(t, "orders", "flaky")
	pub := &permanentPublisher{}
	start(t, Config{Conn: e.srv.Conn, Publisher: pub}, hooks{})
	var big, flaky *outboxv1.Aggregate
	waitUntil(t, "the permanent failure to park its aggregate", func() bool {
		big = e.aggregate(t, "orders", "big")
		flaky = e.aggregate(t, "orders", "flaky")
		return big.GetParkedAt() != nil && flaky.GetFailures() >= 1
	})
	if big.GetFailures() != 1 || !strings.Contains(big.GetParkedReason(), "event of 9 bytes exceeds") {
		t.Errorf("parked after %d failures with reason %q; want 1 and the publisher's error", big.GetFailures(), big.GetParkedReason())
	}
	if flaky.GetParkedAt() != nil {
		t.Errorf("an ordinary failure parked its aggregate after %d failures", flaky.GetFailures())
	}
	if !IsPermanent(fmt.Errorf("wrapped: %w", Permanent(errors.New("x")))) || IsPermanent(errors.New("x")) || Permanent(nil) != nil {
		t.Error("Permanent/IsPermanent do not round-trip through a wrap")
	}
}

type permanentPublisher struct{}

func (permanentPublisher) Publish(_ context.Context, ev Event) error {
	if ev.AggregateKey == "big" {
		return Permanent(errors.New("event of 9 bytes exceeds the broker's limit"))
	}
	return errors.New("broker unavailable")
}
