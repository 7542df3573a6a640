package sink_test

import (
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/outboxd/outboxd/relay"
)

// A header name with ':' cannot be carried by NATS (the header block is
// "Name: value" lines: the name would be cut at the colon, and the event
// altered): refused permanently, and nothing is stored.
func TestNATSHeaderNameWithColonIsRefused(t *testing.T) {
	t.Parallel()
	e := newJSEnv(t)
	s := e.open(t, nil)
	ev := testEvent("e-colon")
	ev.Headers = map[string]string{"X:Tenant": "acme"}
	if err := s.Publish(t.Context(), ev); err == nil || !relay.IsPermanent(err) || !strings.Contains(err.Error(), "X:Tenant") {
		t.Errorf("Publish with header name %q = %v (permanent: %v), want a permanent error naming it", "X:Tenant", err, relay.IsPermanent(err))
	}
	info, err := e.js.Stream(t.Context(), e.stream)
	if err != nil {
		t.Fatal(err)
	}
	if n := info.CachedInfo().State.Msgs; n != 0 {
		t.Errorf("the refused publish stored %d messages", n)
	}
}

// An event of the default source carries no Outbox-Source header at all
// (not an empty one): consumers tell sources apart by its presence.
func TestNATSDefaultSourceHasNoSourceHeader(t *testing.T) {
	t.Parallel()
	e := newJSEnv(t)
	s := e.open(t, nil)
	if err := s.Publish(t.Context(), testEvent("e-default")); err != nil {
		t.Fatalf("Publish: %v", err)
	}
	h := e.fetch(t, 1)[0].Headers()
	for k, vs := range h {
		if strings.EqualFold(k, "Outbox-Source") {
			t.Errorf("default-source event carries header %s %q, want none", k, vs)
		}
	}
}

// A sink opened again with the duplicates= the stream already has finds
// nothing to change: it does not update the stream (an update needs
// permissions a relay may not have on a stream someone else edits).
func TestNATSSameExplicitDuplicatesDoesNotUpdate(t *testing.T) {
	t.Parallel()
	e := newJSEnv(t)
	e.open(t, map[string]string{"duplicates": "3m"})
	var log lockedBuffer
	s := e.openLogged(t, map[string]string{"duplicates": "3m"}, &log)
	if err := s.Publish(t.Context(), testEvent("e1")); err != nil {
		t.Fatalf("Publish: %v", err)
	}
	if got := e.duplicates(t); got != 3*time.Minute {
		t.Errorf("window = %s, want 3m", got)
	}
	if out := log.String(); strings.Contains(out, "updated JetStream stream") {
		t.Errorf("a sink whose duplicates= equals the stream's window updated it:\n%s", out)
	}
}

// The warning about a short duplicate window is for windows below the
// default: a stream with exactly the default window opens quietly.
func TestNATSDefaultDuplicateWindowDoesNotWarn(t *testing.T) {
	t.Parallel()
	e := newJSEnv(t)
	e.create(t, jetstream.StreamConfig{Subjects: []string{e.prefix + ".>"}, Storage: jetstream.FileStorage, Duplicates: 2 * time.Minute})
	var log lockedBuffer
	e.openLogged(t, nil, &log)
	if out := log.String(); strings.Contains(out, "level=WARN") {
		t.Errorf("a stream with the default 2m window drew a warning:\n%s", out)
	}
}
