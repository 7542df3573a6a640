package sink_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/outboxd/outboxd/relay"
	"github.com/outboxd/outboxd/relay/sink"
)

// lockedBuffer lets the test read what the sink wrote without racing it.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

func TestStdoutOneJSONLinePerEvent(t *testing.T) {
	t.Parallel()
	var out lockedBuffer
	s, err := sink.Open(context.Background(), "stdout://", sink.Options{Stdout: &out})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close() })

	created := time.Date(2025, 3, 4, 5, 6, 7, 123456789, time.FixedZone("X", 3600))
	const n = 20
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			err := s.Publish(context.Background(), relay.Event{
				ID:           fmt.Sprintf("id-%02d", i),
				Stream:       "orders",
				AggregateKey: fmt.Sprintf("order-%d", i),
				Revision:     int64(i),
				Type:         "OrderPlaced",
				// Multi-line, with characters HTML escaping would mangle.
				Payload:   []byte(fmt.Sprintf("{\n  \"n\": %d,\n  \"html\": \"<a&b>\"\n}", i)),
				Headers:   map[string]string{"traceparent": "00-abc"},
				CreatedAt: created,
				Attempt:   1,
			})
			if err != nil {
				t.Errorf("Publish %d: %v", i, err)
			}
		})
	}
	wg.Wait()

	text := out.String()
	if !strings.HasSuffix(text, "\n") {
		t.Fatalf("output does not end with a newline: %q", text)
	}
	lines := strings.Split(strings.TrimSuffix(text, "\n"), "\n")
	if len(lines) != n {
		t.Fatalf("got %d lines, want %d:\n%s", len(lines), n, text)
	}
	seen := map[string]bool{}
	for _, line := range lines {
		var got struct {
			EventID      string            `json:"event_id"`
			Stream       string            `json:"stream"`
			AggregateKey string            `json:"aggregate_key"`
			Revision     int64             `json:"revision"`
			EventType    string            `json:"event_type"`
			Payload      json.RawMessage   `json:"payload"`
			Headers      map[string]string `json:"headers"`
			CreatedAt    string            `json:"created_at"`
			Attempt      int               `json:"attempt"`
		}
		dec := json.NewDecoder(strings.NewReader(line))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&got); err != nil {
			t.Fatalf("line %q: %v", line, err)
		}
		seen[got.EventID] = true
		var payload struct {
			N    int    `json:"n"`
			HTML string `json:"html"`
		}
		if len(got.Payload) == 0 || got.Payload[0] != '{' {
			t.Errorf("payload is not a raw JSON object: %s", got.Payload)
		}
		if err := json.Unmarshal(got.Payload, &payload); err != nil {
			t.Errorf("payload %s: %v", got.Payload, err)
		}
		if want := fmt.Sprintf("id-%02d", payload.N); got.EventID != want || got.Revision != int64(payload.N) ||
			got.AggregateKey != fmt.Sprintf("order-%d", payload.N) {
			t.Errorf("line %q mixes events", line)
		}
		if !strings.Contains(line, `"<a&b>"`) {
			t.Errorf("line %q HTML-escaped the payload", line)
		}
		if got.Stream != "orders" || got.EventType != "OrderPlaced" || got.Attempt != 1 || got.Headers["traceparent"] != "00-abc" {
			t.Errorf("line %q: wrong fields", line)
		}
		if got.CreatedAt != "2025-03-04T04:06:07.123456789Z" {
			t.Errorf("created_at = %q", got.CreatedAt)
		}
	}
	if len(seen) != n {
		t.Errorf("saw %d distinct events, want %d", len(seen), n)
	}
}

type failingWriter struct{}

var errDiskFull = errors.New("disk full")

func (failingWriter) Write([]byte) (int, error) { return 0, errDiskFull }

func TestStdoutErrors(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	ev := relay.Event{ID: "e1", Stream: "s", AggregateKey: "k", Type: "T", Payload: []byte(`{}`), Attempt: 1}

	s, err := sink.Open(ctx, "stdout://", sink.Options{Stdout: failingWriter{}})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Publish(ctx, ev); !errors.Is(err, errDiskFull) {
		t.Errorf("Publish to a failing writer = %v, want %v", err, errDiskFull)
	}

	var out lockedBuffer
	s, err = sink.Open(ctx, "stdout:", sink.Options{Stdout: &out})
	if err != nil {
		t.Fatal(err)
	}
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	if err := s.Publish(cancelled, ev); !errors.Is(err, context.Canceled) {
		t.Errorf("Publish with a cancelled context = %v, want context.Canceled", err)
	}
	bad := ev
	bad.Payload = []byte(`{"unterminated"`)
	if err := s.Publish(ctx, bad); err == nil {
		t.Error("Publish of a non-JSON payload succeeded")
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	if err := s.Publish(ctx, ev); err == nil {
		t.Error("Publish after Close succeeded")
	}
	if out.String() != "" {
		t.Errorf("failed publishes wrote %q", out.String())
	}
}
