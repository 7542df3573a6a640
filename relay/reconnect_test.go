package relay

import (
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/outboxd/outboxd/internal/servertest"
)

// records is a slog handler that keeps every record, for tests that count
// what the runner logs or wait for it to say something, and passes each on
// to the test's own logger (servertest.Logger), so that the runner's logs
// still show with the test's output.
type records struct {
	*recordLog
	next slog.Handler
}

type recordLog struct {
	mu      sync.Mutex
	recs    []slog.Record
	watches []recordWatch
}

// recordWatch is one watch: records at level whose message contains msg
// are sent on c.
type recordWatch struct {
	level slog.Level
	msg   string
	c     chan string
}

func newRecords(t testing.TB) records {
	return records{recordLog: &recordLog{}, next: servertest.Logger(t).Handler()}
}

// watch returns a channel that receives the message of each record at
// level whose message contains msg, logged after the call (so: call it
// before start). It keeps the first few; a test waits for one.
func (h records) watch(level slog.Level, msg string) <-chan string {
	c := make(chan string, 10)
	h.mu.Lock()
	defer h.mu.Unlock()
	h.watches = append(h.watches, recordWatch{level, msg, c})
	return c
}

func (h records) Enabled(context.Context, slog.Level) bool { return true }
func (h records) Handle(ctx context.Context, r slog.Record) error {
	h.mu.Lock()
	h.recs = append(h.recs, r.Clone())
	for _, w := range h.watches {
		if r.Level == w.level && strings.Contains(r.Message, w.msg) {
			select {
			case w.c <- r.Message:
			default: // full: the test has what it waits for
			}
		}
	}
	h.mu.Unlock()
	if !h.next.Enabled(ctx, r.Level) {
		return nil
	}
	return h.next.Handle(ctx, r)
}
func (h records) WithAttrs(as []slog.Attr) slog.Handler {
	return records{h.recordLog, h.next.WithAttrs(as)}
}
func (h records) WithGroup(g string) slog.Handler { return records{h.recordLog, h.next.WithGroup(g)} }

// attr returns the value of key in the first record at level whose
// message contains msg ("" if none).
func (h records) attr(level slog.Level, msg, key string) string {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, r := range h.recs {
		if r.Level != level || !strings.Contains(r.Message, msg) {
			continue
		}
		var v string
		r.Attrs(func(a slog.Attr) bool {
			if a.Key == key {
				v = a.Value.String()
				return false
			}
			return true
		})
		return v
	}
	return ""
}

// count returns how many records at level have a message containing msg.
func (h records) count(level slog.Level, msg string) (n int, first string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, r := range h.recs {
		if r.Level == level && strings.Contains(r.Message, msg) {
			if n == 0 {
				first = r.Message
			}
			n++
		}
	}
	return n, first
}

// A relay subscribed to a stream no event has used (a typo) retries with a
// growing backoff, says once as a warning what is wrong, naming the streams
// that exist, and then warns again only every quietInterval, by the
// runner's clock, logging the repeats in between at debug level. The clock
// is the test's: each reconnect moves it 10 s on, so 100 reconnects span
// 1,000 s without the test waiting for them.
func TestUnknownStreamIsSaidOnceThenQuietly(t *testing.T) {
	t.Parallel()
	e := newEnv(t, servertest.Options{})
	e.emit(t, "orders", "o-1")
	const attempts = 100
	const step = 10 * time.Second
	var (
		mu    sync.Mutex
		clock = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
		waits []time.Duration
	)
	done := make(chan struct{})
	h := hooks{
		now: func() time.Time { mu.Lock(); defer mu.Unlock(); return clock },
		reconnecting: func(_ error, wait time.Duration) {
			mu.Lock()
			defer mu.Unlock()
			clock = clock.Add(step)
			waits = append(waits, wait)
			if len(waits) == attempts {
				close(done)
			}
		},
	}
	log := newRecords(t)
	const base, limit = time.Millisecond, 4 * time.Millisecond
	run := start(t, Config{
		Conn: e.dial(t), Publisher: newPublisher(), Streams: []string{"ordres"},
		ReconnectBase: base, ReconnectCap: limit, Logger: slog.New(log),
	}, h)
	waitSignal(t, "100 reconnects", done)
	if err := run.stop(t); err != nil {
		t.Fatal(err)
	}
	// At 0, 300, 600 and 900 s of the test's clock.
	warned, first := log.count(slog.LevelWarn, "subscription refused")
	if want := 4; warned != want {
		t.Errorf("%d warnings over %d reconnects spanning %v, want %d (one, then one every %v)", warned, attempts, attempts*step, want, quietInterval)
	}
	if !strings.Contains(first, `"ordres"`) || !strings.Contains(first, "known streams: orders") {
		t.Errorf("the warning does not say what is wrong: %q", first)
	}
	if quiet, _ := log.count(slog.LevelDebug, "stream failed again"); quiet < attempts-warned {
		t.Errorf("%d repeats logged at debug level, want at least %d", quiet, attempts-warned)
	}
	mu.Lock()
	defer mu.Unlock()
	if waits[0] > base*3/2 {
		t.Errorf("first wait %v, want about %v", waits[0], base)
	}
	grew := false
	for _, w := range waits {
		if w > limit*3/2 {
			t.Fatalf("wait %v beyond the cap %v and its jitter", w, limit)
		}
		grew = grew || w >= limit/2
	}
	if !grew {
		t.Errorf("the wait never grew towards the cap %v: %v", limit, waits)
	}
}
