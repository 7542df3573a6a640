package auth

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/outboxd/outboxd/internal/filewatch"
)

// DefaultEnvVar is the environment variable conventionally holding tokens.
const DefaultEnvVar = "OUTBOXD_TOKENS"

// DefaultDebounce is how long Watch lets a burst of file events settle.
const DefaultDebounce = filewatch.DefaultDebounce

// Config configures an Authenticator.
type Config struct {
	// File is a token file in the format of the package doc. Optional when
	// EnvVar holds the tokens.
	File string
	// EnvVar names an environment variable holding entries in the same
	// format, separated by newlines or ';'. Empty means no such source. It is
	// read again at each reload, although a process's environment does not
	// change from outside, so that a reload always sees both sources.
	EnvVar string
	// ProtectReflection makes the reflection service need a valid token (of
	// any role). By default it needs none, like health.
	ProtectReflection bool
	// Logger receives reloads (counts and names, never a secret) and, at
	// debug level, rejected requests. Nil discards.
	Logger *slog.Logger
	// OnReload, when set, is called after every reload attempt, whether by
	// Reload, a file change or SIGHUP, with its result: a hook for metrics,
	// and for tests to wait on instead of sleeping. It must not block.
	OnReload func(error)
	// Debounce is how long Watch waits after a file event before reloading,
	// so that the rest of a burst (an editor's truncate-then-write) is read
	// in the same reload. Zero means DefaultDebounce.
	Debounce time.Duration
}

// Authenticator checks bearer tokens against a token set that can be
// replaced while the server runs. Lookups are lock-free: the set is an
// immutable value behind an atomic pointer, swapped whole on reload.
type Authenticator struct {
	cfg     Config
	log     *slog.Logger
	set     atomic.Pointer[tokenSet]
	reload  sync.Mutex // serialises reloads, so the newest content wins
	streams openStreams
}

// tokenSet is one loaded generation of tokens.
type tokenSet struct {
	digest  [sha256.Size]byte // of the raw sources; unchanged content is not reparsed
	entries []entry
}

// New loads the tokens from cfg's sources. It fails when none are
// configured or none are found: a server started with auth on and no tokens
// would refuse everyone, which is always a mistake at startup.
func New(cfg Config) (*Authenticator, error) {
	if cfg.File == "" && cfg.EnvVar == "" {
		return nil, errors.New("auth: Config.File or Config.EnvVar must name a token source")
	}
	if cfg.Debounce <= 0 {
		cfg.Debounce = DefaultDebounce
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	a := &Authenticator{cfg: cfg, log: log}
	set, err := a.load()
	if err != nil {
		return nil, err
	}
	if len(set.entries) == 0 {
		return nil, fmt.Errorf("auth: no tokens found in %s", a.sourceNames())
	}
	a.set.Store(set)
	a.log.Info("auth: tokens loaded", "tokens", len(set.entries), "names", names(set), "sources", a.sourceNames())
	return a, nil
}

func (a *Authenticator) sourceNames() string {
	switch {
	case a.cfg.File == "":
		return "$" + a.cfg.EnvVar
	case a.cfg.EnvVar == "":
		return a.cfg.File
	default:
		return a.cfg.File + " or $" + a.cfg.EnvVar
	}
}

// load reads and parses every source. Errors name the file and line.
func (a *Authenticator) load() (*tokenSet, error) {
	var file, env string
	if a.cfg.File != "" {
		b, err := readLimited(a.cfg.File)
		if err != nil {
			return nil, fmt.Errorf("auth: token file: %w", err)
		}
		file = string(b)
	}
	if a.cfg.EnvVar != "" {
		env = os.Getenv(a.cfg.EnvVar)
	}
	h := sha256.New()
	fmt.Fprintf(h, "%d:%s%d:%s", len(file), file, len(env), env)
	var digest [sha256.Size]byte
	h.Sum(digest[:0])
	if cur := a.set.Load(); cur != nil && cur.digest == digest {
		return cur, nil
	}

	p := newParser()
	if a.cfg.File != "" {
		p.parse(file, a.cfg.File, false)
	}
	if env != "" {
		p.parse(env, "$"+a.cfg.EnvVar, true)
	}
	if err := p.err(); err != nil {
		return nil, fmt.Errorf("auth: invalid tokens:\n%w", err)
	}
	return &tokenSet{digest: digest, entries: p.entries}, nil
}

func readLimited(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, maxSourceBytes+1))
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if len(b) > maxSourceBytes {
		return nil, fmt.Errorf("%s: larger than %d bytes", path, maxSourceBytes)
	}
	return b, nil
}

func names(set *tokenSet) []string {
	var out []string
	seen := map[string]bool{}
	for _, e := range set.entries {
		if !seen[e.principal.Name] {
			seen[e.principal.Name] = true
			out = append(out, e.principal.Name)
		}
	}
	return out
}

// Reload rereads the sources and, if they parse, replaces the token set:
// tokens removed stop working for the next request, new ones start working.
// Unary calls already admitted finish; streams opened with a token that is
// gone, or whose roles or streams changed, are closed (see
// StreamServerInterceptor). On error the previous set stays in force and the
// error, which names the file and line but never a secret, is logged and
// returned.
//
// An empty but valid source is accepted at reload, unlike at New: emptying
// the file is how an operator revokes every token at once.
func (a *Authenticator) Reload() error {
	a.reload.Lock()
	defer a.reload.Unlock()
	prev := a.set.Load()
	set, err := a.load()
	switch {
	case err != nil:
		a.log.Error("auth: reload failed; keeping the previous tokens", "err", err)
	case set != prev:
		a.set.Store(set)
		if n := a.streams.revoke(set); n > 0 {
			a.log.Info("auth: closed streams whose token was revoked", "streams", n)
		}
		if len(set.entries) == 0 {
			a.log.Warn("auth: tokens reloaded: none left; every authenticated request will be refused", "sources", a.sourceNames())
		} else {
			a.log.Info("auth: tokens reloaded", "tokens", len(set.entries), "names", names(set))
		}
	}
	if a.cfg.OnReload != nil {
		a.cfg.OnReload(err)
	}
	return err
}

// Watch reloads on SIGHUP and whenever the token file's directory changes
// (see filewatch: one reload right away, then on each), until ctx is done;
// it returns nil then, or an error if the file cannot be watched.
func (a *Authenticator) Watch(ctx context.Context) error {
	return filewatch.Watch(ctx, filewatch.Config{Path: a.cfg.File, What: "auth", Debounce: a.cfg.Debounce, Logger: a.log},
		func() { _ = a.Reload() })
}

// grants reports whether the set still holds the token with hash under the
// same name, roles and streams as p. Not constant-time: both sides are the
// server's own data.
func (set *tokenSet) grants(hash [sha256.Size]byte, p *Principal) bool {
	for _, e := range set.entries {
		if e.hash == hash && e.principal.Name == p.Name && e.principal.sameGrant(p) {
			return true
		}
	}
	return false
}

// Lookup returns the principal whose secret is token, checked as a gRPC
// call's bearer token is (constant time, the current set). The console uses
// it at login and on every request, so a revoked token ends its sessions.
func (a *Authenticator) Lookup(token string) (*Principal, bool) {
	if !validToken(token) || len(token) > MaxSecretLen {
		return nil, false
	}
	return a.authenticate(token)
}

// authenticate returns the principal whose secret is token. The token is
// hashed and compared with every entry's hash in constant time, without
// stopping at a match: the time taken reveals neither which entry matched
// nor how much of a secret was right, whatever the lengths involved.
func (a *Authenticator) authenticate(token string) (*Principal, bool) {
	set := a.set.Load()
	sum := sha256.Sum256([]byte(token))
	var found *Principal
	for i := range set.entries {
		if subtle.ConstantTimeCompare(sum[:], set.entries[i].hash[:]) == 1 {
			found = set.entries[i].principal
		}
	}
	return found, found != nil
}
