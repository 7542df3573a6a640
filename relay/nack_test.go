package relay

import (
	"errors"
	"strings"
	"testing"
	"unicode/utf8"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/servertest"
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
