package filewatch_test

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/outboxd/outboxd/internal/filewatch"
)

// watch runs Watch on path until the test ends. Every reread sends on the
// returned channel, which is unbuffered: Watch cannot go on (nor reread
// again) until the test has received, so the test sees each reread as it
// happens and in order. It returns once the first reread (the one Watch
// makes as soon as it watches) has been received, and a stop function that
// cancels the watch and reports a reread made after the ones received.
func watch(t *testing.T, path string) (rereads <-chan struct{}, stop func() (extra bool)) {
	t.Helper()
	return watchLogged(t, path, nil)
}

// watchLogged is watch with Watch's log lines going to log.
func watchLogged(t *testing.T, path string, log *slog.Logger) (rereads <-chan struct{}, stop func() (extra bool)) {
	t.Helper()
	calls := make(chan struct{})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- filewatch.Watch(ctx, filewatch.Config{Path: path, What: "test", Debounce: 10 * time.Millisecond, Logger: log},
			func() { calls <- struct{}{} })
	}()
	finished := false
	stop = func() bool {
		if finished {
			return false
		}
		finished = true
		cancel()
		extra := false
		for {
			select {
			case <-calls:
				extra = true // let Watch reach ctx.Done and return
			case err := <-done:
				if err != nil {
					t.Errorf("Watch: %v", err)
				}
				return extra
			}
		}
	}
	t.Cleanup(func() { stop() })
	select {
	case <-calls:
	case err := <-done:
		t.Fatalf("Watch returned before its first reread: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("Watch made no first reread")
	}
	return calls, stop
}

// moveIn writes content to a file in another directory and renames it over
// path: the way a file is replaced by a deployment tool or by Kubernetes (a
// ConfigMap's new version is written beside, then swapped in). The watched
// directory sees a single event, a create, and no write at all.
func moveIn(t *testing.T, path, content string) {
	t.Helper()
	src := filepath.Join(t.TempDir(), "staged")
	if err := os.WriteFile(src, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(src, path); err != nil {
		t.Fatal(err)
	}
}

func waitReread(t *testing.T, rereads <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-rereads:
	case <-time.After(10 * time.Second):
		t.Fatalf("no reread after %s", what)
	}
}

// A file replaced by a rename from another directory is reread, although
// nothing was written in the watched directory: the token file and the
// sources file are rotated this way in production, so a watcher that
// reacts only to writes would keep serving revoked tokens. (Kills the
// mutant that arms the reread on Write events only.)
func TestFileRenamedInFromElsewhereIsReread(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "tokens")
	if err := os.WriteFile(path, []byte("old"), 0o600); err != nil {
		t.Fatal(err)
	}
	rereads, _ := watch(t, path)
	moveIn(t, path, "new")
	waitReread(t, rereads, "the file was renamed in")
}

// One change is reread once, not twice: each reread of the token file
// runs OnReload and logs, and each reread of the sources file compares the
// source list again. The change is a single event (a rename from another
// directory), so after its reread nothing is pending: Watch must go back
// to waiting and, once cancelled, return without another reread. (Kills
// the mutant that rereads twice when the debounce timer fires.)
func TestOneChangeIsRereadOnce(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "sources")
	rereads, stop := watch(t, path)
	moveIn(t, path, "a")
	waitReread(t, rereads, "the file was created")
	if stop() {
		t.Error("one change was reread more than once")
	}
}

// Changes to other files in the watched directory are not rereads: with
// the server's log written next to its token file, each reread's log line
// was a change in the directory, which was reread and logged again, every
// debounce interval, forever. Only a change of the file's content is
// reread; the watch still sees one after the others. (Kills the mutant that
// rereads after every burst of events, as before.)
func TestOtherFilesInTheDirectoryAreNotReread(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	path := filepath.Join(dir, "tokens")
	if err := os.WriteFile(path, []byte("a"), 0o600); err != nil {
		t.Fatal(err)
	}
	skipped := make(chan struct{}, 16)
	log := slog.New(skipHandler{skipped})
	rereads, stop := watchLogged(t, path, log)
	logFile := filepath.Join(dir, "serve.log")
	for i := range 3 {
		if err := os.WriteFile(logFile, []byte(strings.Repeat("line\n", i+1)), 0o600); err != nil {
			t.Fatal(err)
		}
		select {
		case <-skipped:
		case <-rereads:
			t.Fatalf("write %d to another file in the directory was reread as a change", i+1)
		case <-time.After(10 * time.Second):
			t.Fatalf("write %d to another file in the directory: neither reread nor passed over", i+1)
		}
	}
	moveIn(t, path, "b")
	waitReread(t, rereads, "the file changed after the other file's writes")
	// The change is now what the last reread found: another file's write
	// after it is passed over again.
	drain(skipped)
	if err := os.WriteFile(logFile, []byte("more\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	select {
	case <-skipped:
	case <-rereads:
		t.Fatal("another file's write after a change was reread as a change")
	case <-time.After(10 * time.Second):
		t.Fatal("another file's write after a change: neither reread nor passed over")
	}
	if stop() {
		t.Error("one change was reread more than once")
	}
}

func drain(c <-chan struct{}) {
	for {
		select {
		case <-c:
		default:
			return
		}
	}
}

// skipHandler signals each log record of a burst passed over unchanged.
type skipHandler struct{ skipped chan<- struct{} }

func (skipHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h skipHandler) Handle(_ context.Context, r slog.Record) error {
	if strings.Contains(r.Message, "file unchanged") {
		h.skipped <- struct{}{}
	}
	return nil
}
func (h skipHandler) WithAttrs([]slog.Attr) slog.Handler { return h }
func (h skipHandler) WithGroup(string) slog.Handler      { return h }
