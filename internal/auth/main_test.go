package auth

import (
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// Secrets used across the tests; each is a valid plaintext token.
const (
	relaySecret   = "relay-secret-0123456789"
	adminSecret   = "admin-secret-0123456789"
	bothSecret    = "both-secret-0123456789ab"
	billingSecret = "billing-secret-0123456789"
	viewerSecret  = "viewer-secret-0123456789"
)

// testLogger routes a component's logs to t.Log.
func testLogger(t testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(tWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

type tWriter struct{ t testing.TB }

func (w tWriter) Write(p []byte) (int, error) {
	w.t.Helper()
	w.t.Log(strings.TrimSuffix(string(p), "\n"))
	return len(p), nil
}

// writeFile writes content to dir/name by writing a temporary file and
// renaming it over the target, as editors and Kubernetes do.
func writeFile(t testing.TB, dir, name, content string) string {
	t.Helper()
	path := filepath.Join(dir, name)
	tmp, err := os.CreateTemp(dir, ".tmp-"+name+"-*")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tmp.WriteString(content); err != nil {
		t.Fatal(err)
	}
	if err := tmp.Close(); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		t.Fatal(err)
	}
	return path
}

// newFromText returns an Authenticator over a token file holding content.
func newFromText(t testing.TB, content string, mod func(*Config)) *Authenticator {
	t.Helper()
	cfg := Config{File: writeFile(t, t.TempDir(), "tokens", content), Logger: testLogger(t)}
	if mod != nil {
		mod(&cfg)
	}
	a, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return a
}
