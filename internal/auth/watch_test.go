package auth

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// reloadSignal is an OnReload hook that records each result; tests wait on
// it instead of sleeping.
type reloadSignal chan error

func newReloadSignal() reloadSignal { return make(reloadSignal, 256) }

func (r reloadSignal) hook(err error) {
	select {
	case r <- err:
	default: // a full buffer already guarantees the waiter wakes
	}
}

// waitUntil waits for reloads until cond holds, failing after a deadline.
// cond is checked before each wait, so a reload that happened before the
// call is not missed.
func (r reloadSignal) waitUntil(t *testing.T, what string, cond func(err error) bool) {
	t.Helper()
	deadline := time.After(10 * time.Second)
	var last error
	for {
		select {
		case last = <-r:
			if cond(last) {
				return
			}
		case <-deadline:
			t.Fatalf("timed out waiting for %s (last reload: %v)", what, last)
		}
	}
}

func accepts(a *Authenticator, secret string) bool {
	_, ok := a.authenticate(secret)
	return ok
}

// startWatch runs Watch until the test ends and returns once the watch is in
// place (its first reload has happened).
func startWatch(t *testing.T, a *Authenticator, reloads reloadSignal) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Watch(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Watch: %v", err)
		}
	})
	select {
	case <-reloads:
	case err := <-done:
		t.Fatalf("Watch returned early: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("Watch did not start")
	}
}

// Rotation without restart: the file changes under a running server, by
// rename (editors, Kubernetes) and by rewriting in place.
func TestRotationByFileChange(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	reloads := newReloadSignal()
	file := writeFile(t, dir, "tokens", "r relay "+relaySecret+"\n")
	a, err := New(Config{File: file, Logger: testLogger(t), OnReload: reloads.hook, Debounce: 10 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	addr := serve(t, a)
	startWatch(t, a, reloads)
	check(t, dial(t, addr, relaySecret), callAck, codes.OK, "r", "")

	// Replace by rename: the new secret works, the old one is refused.
	writeFile(t, dir, "tokens", "r relay "+billingSecret+"\n")
	reloads.waitUntil(t, "the renamed file", func(error) bool { return accepts(a, billingSecret) })
	if accepts(a, relaySecret) {
		t.Fatal("old token still accepted after rotation")
	}
	check(t, dial(t, addr, relaySecret), callAck, codes.Unauthenticated, "", "")
	check(t, dial(t, addr, billingSecret), callAck, codes.OK, "r", "")

	// Rewrite in place.
	if err := os.WriteFile(file, []byte("r relay "+bothSecret+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	reloads.waitUntil(t, "the rewritten file", func(error) bool { return accepts(a, bothSecret) })
	if accepts(a, billingSecret) {
		t.Fatal("old token still accepted after rotation")
	}

	// A broken file keeps the previous tokens.
	writeFile(t, dir, "tokens", "r rley "+adminSecret+"\n")
	reloads.waitUntil(t, "a failed reload", func(err error) bool { return err != nil })
	if !accepts(a, bothSecret) || accepts(a, adminSecret) {
		t.Fatal("a failed reload changed the token set")
	}

	// Emptying the file revokes everything.
	writeFile(t, dir, "tokens", "# all revoked\n")
	reloads.waitUntil(t, "the emptied file", func(error) bool { return !accepts(a, bothSecret) })
	check(t, dial(t, addr, bothSecret), callAck, codes.Unauthenticated, "", "")
}

func TestReload(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	file := writeFile(t, dir, "tokens", "r relay "+relaySecret+"\n")
	var results []error
	a, err := New(Config{File: file, Logger: testLogger(t), OnReload: func(err error) { results = append(results, err) }})
	if err != nil {
		t.Fatal(err)
	}

	// Unchanged content: nothing is rebuilt.
	before := a.set.Load()
	if err := a.Reload(); err != nil {
		t.Fatal(err)
	}
	if a.set.Load() != before {
		t.Error("reloading unchanged content replaced the set")
	}

	// A missing file is an error; the previous tokens stay.
	if err := os.Remove(file); err != nil {
		t.Fatal(err)
	}
	err = a.Reload()
	if err == nil || !strings.Contains(err.Error(), file) {
		t.Errorf("reload of a missing file: %v", err)
	}
	if !accepts(a, relaySecret) {
		t.Error("failed reload dropped the tokens")
	}

	// A bad file: the error names the line and hides the secret.
	writeFile(t, dir, "tokens", "r relay "+relaySecret+"\n\nx relay "+adminSecret+" streams=Bad\n")
	err = a.Reload()
	if err == nil || !strings.Contains(err.Error(), file+`:3: streams: pattern 1 "Bad"`) || strings.Contains(err.Error(), adminSecret) {
		t.Errorf("reload of an invalid file: %v", err)
	}

	writeFile(t, dir, "tokens", "r relay "+billingSecret+"\n")
	if err := a.Reload(); err != nil {
		t.Fatal(err)
	}
	if accepts(a, relaySecret) || !accepts(a, billingSecret) {
		t.Error("reload did not replace the tokens")
	}
	if len(results) != 4 || results[0] != nil || results[1] == nil || results[2] == nil || results[3] != nil {
		t.Errorf("OnReload saw %v, want [nil, error, error, nil]", results)
	}
}

func TestNew(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	for _, tc := range []struct {
		name string
		cfg  Config
		want string
	}{
		{"no source", Config{}, "Config.File or Config.EnvVar"},
		{"missing file", Config{File: filepath.Join(dir, "nope")}, "auth: token file: open " + filepath.Join(dir, "nope")},
		{"empty file", Config{File: writeFile(t, dir, "empty", "# nothing yet\n")}, "auth: no tokens found in " + filepath.Join(dir, "empty")},
		{"empty file and variable", Config{File: filepath.Join(dir, "empty"), EnvVar: "OUTBOXD_TEST_UNSET_VARIABLE"},
			"no tokens found in " + filepath.Join(dir, "empty") + " or $OUTBOXD_TEST_UNSET_VARIABLE"},
		{"invalid", Config{File: writeFile(t, dir, "bad", "a relay short\n")}, "auth: invalid tokens:\n" + filepath.Join(dir, "bad") + ":1: secret: is 5 bytes"},
		{"too large", Config{File: writeFile(t, dir, "large", strings.Repeat("#", maxSourceBytes+1))}, "larger than 1048576 bytes"},
	} {
		_, err := New(tc.cfg)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: New: %v, want an error containing %q", tc.name, err, tc.want)
		}
	}
}

// Not parallel: t.Setenv.
func TestEnvSource(t *testing.T) {
	const v = "OUTBOXD_TEST_TOKENS"
	t.Setenv(v, "e relay "+relaySecret+"; f admin "+adminSecret)
	dir := t.TempDir()
	a, err := New(Config{File: writeFile(t, dir, "tokens", "g relay "+bothSecret), EnvVar: v, Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range []string{relaySecret, adminSecret, bothSecret} {
		if !accepts(a, s) {
			t.Errorf("token %s refused", s)
		}
	}
	// A secret in both sources is a duplicate.
	t.Setenv(v, "e relay "+bothSecret)
	err = a.Reload()
	if err == nil || !strings.Contains(err.Error(), "$"+v+" entry 1: secret: same secret as "+filepath.Join(dir, "tokens")+":1") {
		t.Errorf("duplicate across sources: %v", err)
	}
	t.Setenv(v, "")
	if err := a.Reload(); err != nil {
		t.Fatal(err)
	}
	if accepts(a, relaySecret) || !accepts(a, bothSecret) {
		t.Error("emptied variable not applied")
	}
	// Only the variable.
	t.Setenv(v, "only relay "+billingSecret)
	b, err := New(Config{EnvVar: v})
	if err != nil {
		t.Fatal(err)
	}
	if p, ok := b.authenticate(billingSecret); !ok || p.Name != "only" {
		t.Errorf("env-only source: %v %v", p, ok)
	}
}

func TestWatchFailsWithoutDirectory(t *testing.T) {
	t.Parallel()
	dir := filepath.Join(t.TempDir(), "sub")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	a, err := New(Config{File: writeFile(t, dir, "tokens", "r relay "+relaySecret)})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.RemoveAll(dir); err != nil {
		t.Fatal(err)
	}
	err = a.Watch(t.Context())
	if err == nil || !strings.Contains(err.Error(), "auth: watch directory "+dir) {
		t.Fatalf("Watch: %v", err)
	}
}

// A request already past the interceptor is not cut off by a reload, but
// the next one is checked against the new set.
func TestRevocationAppliesToNextRequest(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	a, err := New(Config{File: writeFile(t, dir, "tokens", "r relay "+relaySecret)})
	if err != nil {
		t.Fatal(err)
	}
	addr := serve(t, a)
	conn := dial(t, addr, relaySecret)
	check(t, conn, callAck, codes.OK, "r", "")
	writeFile(t, dir, "tokens", "s relay "+billingSecret)
	if err := a.Reload(); err != nil {
		t.Fatal(err)
	}
	_, err = callAck.do(testCtx(t), conn)
	if status.Code(err) != codes.Unauthenticated {
		t.Fatalf("revoked token on an open connection: %v", err)
	}
}

// Another file in the directory changing all the time must not postpone the
// reload of the token file forever.
func TestBusyDirectoryDoesNotStarveReload(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	reloads := newReloadSignal()
	a, err := New(Config{File: writeFile(t, dir, "tokens", "r relay "+relaySecret), OnReload: reloads.hook, Debounce: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	startWatch(t, a, reloads)

	stop := make(chan struct{})
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		noisy := filepath.Join(dir, "noisy.log")
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			// Far more often than the debounce interval.
			_ = os.WriteFile(noisy, []byte(strings.Repeat("x", i%100)), 0o600)
			time.Sleep(time.Millisecond)
		}
	}()
	defer func() { close(stop); <-stopped }()

	writeFile(t, dir, "tokens", "r relay "+billingSecret)
	reloads.waitUntil(t, "the token file despite the noise", func(error) bool { return accepts(a, billingSecret) })
}
