// Package filewatch rereads a configuration file on SIGHUP and whenever it
// changes: the one mechanism behind serve's token file and its --config
// file's source list.
//
// It watches the file's directory, not the file, because editors and
// Kubernetes replace a file by renaming another over it (a ConfigMap swaps
// a symlinked directory), which would end a watch on the file itself.
// Every event there arms a short timer; when it fires, the file is read and
// its content (a hash of it, or the error reading it) compared with what
// the last reread found, and only a change is reread and logged. Events of
// other files there are most of them: a log file next to the tokens, say,
// whose every line, were each burst logged as a change, would be a change
// again, forever. The first event of a burst arms the timer and later ones
// ride along: re-arming on every event would let a busy directory postpone
// the reread forever. Chmod alone never changes content (backup and
// indexing tools touch modes often) and is ignored. A SIGHUP always
// rereads.
//
// signal.Notify gives every channel registered for SIGHUP its own copy, so
// several watches each see every SIGHUP. A watch never unregisters its
// channel: with none left, SIGHUP would get its default action again and
// end the process, and a shutdown still running must survive one
// (`systemctl reload` during a stop). SIGHUPs after Watch returns are
// dropped.
package filewatch

import (
	"cmp"
	"context"
	"crypto/sha256"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"github.com/fsnotify/fsnotify"
)

// DefaultDebounce is how long a burst of file events settles before the
// reread.
const DefaultDebounce = 100 * time.Millisecond

// Config says what Watch watches.
type Config struct {
	// Path is the file; empty: SIGHUP only.
	Path string
	// What prefixes its log lines and errors ("auth").
	What string
	// Debounce: zero means DefaultDebounce.
	Debounce time.Duration
	// Logger receives the rereads' causes and watch errors. Nil discards.
	Logger *slog.Logger
}

// Watch calls reread once as soon as it watches (so that a change made
// before is not missed, and tests can wait for that first call), then on
// every SIGHUP and after every burst of changes to cfg.Path's directory
// that changed what reading cfg.Path finds, until ctx is done; it returns
// nil then, or an error if the directory cannot be watched.
func Watch(ctx context.Context, cfg Config, reread func()) error {
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)

	var events <-chan fsnotify.Event
	var watchErrs <-chan error
	if cfg.Path != "" {
		w, err := fsnotify.NewWatcher()
		if err != nil {
			return fmt.Errorf("%s: watch %s: %w", cfg.What, cfg.Path, err)
		}
		defer w.Close()
		dir := filepath.Dir(cfg.Path)
		if err := w.Add(dir); err != nil {
			return fmt.Errorf("%s: watch directory %s: %w", cfg.What, dir, err)
		}
		events, watchErrs = w.Events, w.Errors
	}
	// Taken before each reread: a change after it is seen as one by the
	// next comparison, at worst rereading content a reread already found.
	last := fingerprint(cfg.Path)
	reread()

	debounce := time.NewTimer(time.Hour)
	debounce.Stop()
	defer debounce.Stop()
	armed := false
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-hup:
			log.Info(cfg.What+": SIGHUP: rereading", "file", cfg.Path)
			last = fingerprint(cfg.Path)
			reread()
		case ev, ok := <-events:
			if !ok {
				events = nil
				continue
			}
			if ev.Op != fsnotify.Chmod && !armed {
				debounce.Reset(cmp.Or(cfg.Debounce, DefaultDebounce))
				armed = true
			}
		case err, ok := <-watchErrs:
			if !ok {
				watchErrs = nil
				continue
			}
			log.Warn(cfg.What+": watching the file", "file", cfg.Path, "err", err)
		case <-debounce.C:
			armed = false
			now := fingerprint(cfg.Path)
			if now == last {
				log.Debug(cfg.What+": directory changed, file unchanged: not rereading", "file", cfg.Path)
				continue
			}
			last = now
			log.Info(cfg.What+": file changed: rereading", "file", cfg.Path)
			reread()
		}
	}
}

// fingerprint is what reading path finds: a hash of its content, or the
// error (a file removed, then restored unchanged, is a change twice). Empty
// for no path.
func fingerprint(path string) string {
	if path == "" {
		return ""
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return "error: " + err.Error()
	}
	sum := sha256.Sum256(b)
	return string(sum[:])
}
