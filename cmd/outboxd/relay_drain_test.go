package main

import (
	"context"
	"log/slog"
	"slices"
	"sync"
	"testing"
	"testing/synctest"
	"time"
)

// heldLines records each log line's message; the line named hold waits in
// Handle until release is closed, as a slow goroutine would.
type heldLines struct {
	hold    string
	release chan struct{}

	mu    sync.Mutex
	lines []string
}

func (h *heldLines) Enabled(context.Context, slog.Level) bool { return true }
func (h *heldLines) WithAttrs([]slog.Attr) slog.Handler       { return h }
func (h *heldLines) WithGroup(string) slog.Handler            { return h }
func (h *heldLines) Handle(_ context.Context, r slog.Record) error {
	if r.Message == h.hold {
		<-h.release
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	h.lines = append(h.lines, r.Message)
	return nil
}

func (h *heldLines) seen() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Clone(h.lines)
}

// At a signal the relay says the drain started and, when its work is over,
// that it stopped, in that order and both of them, however late the goroutine
// that says the first runs: CI once saw "relay stopped" alone, the process
// having exited before that goroutine wrote its line. synctest.Wait returns
// only when every goroutine is blocked, so the stopping line is held for
// certain while finished runs.
func TestRelaySaysStoppedOnlyAfterSayingStopping(t *testing.T) {
	t.Parallel()
	const stopping, stopped = "relay stopping: publishes under way may finish and be acked", "relay stopped"
	synctest.Test(t, func(t *testing.T) {
		h := &heldLines{hold: stopping, release: make(chan struct{})}
		ctx, signal := context.WithCancel(t.Context())
		finished := announceDrain(ctx, slog.New(h), time.Second)
		signal()
		returned := make(chan struct{})
		go func() {
			defer close(returned)
			finished(nil)
		}()
		synctest.Wait()
		if got := h.seen(); len(got) != 0 {
			t.Fatalf("while the stopping line was still being written, the relay logged %q", got)
		}
		select {
		case <-returned:
			t.Fatal("finished returned before the stopping line was written: the process could exit without it")
		default:
		}
		close(h.release)
		<-returned
		if got, want := h.seen(), []string{stopping, stopped}; !slices.Equal(got, want) {
			t.Fatalf("logged %q, want %q", got, want)
		}
	})
}

// Work that ends by itself (an error, no signal) says neither line.
func TestRelayWithoutSignalSaysNoDrain(t *testing.T) {
	t.Parallel()
	h := &heldLines{release: make(chan struct{})}
	finished := announceDrain(t.Context(), slog.New(h), time.Second)
	finished(context.Canceled)
	if got := h.seen(); len(got) != 0 {
		t.Fatalf("logged %q without a signal", got)
	}
}
