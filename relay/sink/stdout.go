package sink

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/url"
	"sync"
	"time"

	"github.com/outboxd/outboxd/relay"
)

// stdoutSink writes one JSON object per line. It exists for development: to
// watch what a relay would publish without running a broker. A successful
// write is its only "acknowledgement", so it is not durable.
type stdoutSink struct {
	// mu makes each line one uninterrupted write even though Publish is
	// called concurrently for different aggregates.
	mu     sync.Mutex
	w      io.Writer
	closed bool
}

// stdoutLine is the JSON shape of one event. Payload is json.RawMessage so
// consumers see the producer's JSON as JSON, not as base64 of its bytes.
type stdoutLine struct {
	EventID      string            `json:"event_id"`
	Stream       string            `json:"stream"`
	AggregateKey string            `json:"aggregate_key"`
	Revision     int64             `json:"revision"`
	EventType    string            `json:"event_type"`
	Payload      json.RawMessage   `json:"payload"`
	Headers      map[string]string `json:"headers"`
	CreatedAt    string            `json:"created_at"`
	Attempt      int               `json:"attempt"`
	Source       string            `json:"source,omitempty"`
	// RepublishAction names the operator's republish that made this copy
	// (relay.Event.RepublishAction); absent on every other.
	RepublishAction int64 `json:"republish_action,omitempty"`
}

func openStdout(_ context.Context, u *url.URL, display string, opts Options) (relay.Sink, error) {
	if u.Opaque != "" || u.Host != "" || (u.Path != "" && u.Path != "/") || u.User != nil {
		return nil, invalid(display, "stdout sink takes no host or path; use stdout://")
	}
	if _, err := params(u, display); err != nil {
		return nil, err
	}
	return &stdoutSink{w: opts.Stdout}, nil
}

// Publish encodes ev outside the lock, then writes the line in a single
// Write call under the lock and returns that write's error.
func (s *stdoutSink) Publish(ctx context.Context, ev relay.Event) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	line, err := encodeEvent(ev)
	if err != nil {
		return fmt.Errorf("stdout sink: %w", err)
	}

	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return errSinkClosed
	}
	if _, err := s.w.Write(line); err != nil {
		return fmt.Errorf("stdout sink: write: %w", err)
	}
	return nil
}

// encodeEvent is the event as one line of JSON (the stdoutLine shape, with
// a trailing newline): what the stdout sink writes and the webhook sink
// posts.
func encodeEvent(ev relay.Event) ([]byte, error) {
	headers := ev.Headers
	if headers == nil {
		headers = map[string]string{}
	}
	payload := json.RawMessage(ev.Payload)
	if len(payload) == 0 {
		payload = json.RawMessage("null")
	} else if !json.Valid(payload) {
		// Failing here keeps the valid-JSON promise; the event is retried
		// and then parked, which shows the bad producer.
		return nil, errors.New("payload is not valid JSON")
	}
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	// Keep '<', '>' and '&' readable; this output is for people.
	enc.SetEscapeHTML(false)
	// Encoding a RawMessage compacts it, so a multi-line payload still
	// yields one line; Encode appends the newline.
	if err := enc.Encode(stdoutLine{
		EventID:         ev.ID,
		Stream:          ev.Stream,
		AggregateKey:    ev.AggregateKey,
		Revision:        ev.Revision,
		EventType:       ev.Type,
		Payload:         payload,
		Headers:         headers,
		CreatedAt:       ev.CreatedAt.UTC().Format(time.RFC3339Nano),
		Attempt:         ev.Attempt,
		Source:          ev.Source,
		RepublishAction: ev.RepublishAction,
	}); err != nil {
		return nil, fmt.Errorf("encode: %w", err)
	}
	return buf.Bytes(), nil
}

// Close stops further publishes. It does not close the writer, which the
// sink does not own (it is usually the process's stdout).
func (s *stdoutSink) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closed = true
	return nil
}

// errSinkClosed is returned by Publish after Close, so a late publish fails
// loudly instead of writing to a released resource.
var errSinkClosed = errors.New("sink is closed")
