//go:build unix

package auth

import (
	"syscall"
	"testing"
)

// SIGHUP rereads the sources. The token is in an environment variable,
// which no file event can announce, so only the signal can explain the
// reload. Not parallel: t.Setenv, and a process-wide signal.
func TestReloadOnSIGHUP(t *testing.T) {
	const v = "OUTBOXD_TEST_HUP_TOKENS"
	t.Setenv(v, "h relay "+relaySecret)
	reloads := newReloadSignal()
	a, err := New(Config{EnvVar: v, Logger: testLogger(t), OnReload: reloads.hook})
	if err != nil {
		t.Fatal(err)
	}
	startWatch(t, a, reloads) // SIGHUP is handled from here on
	t.Setenv(v, "h relay "+billingSecret)
	if accepts(a, billingSecret) {
		t.Fatal("new token accepted before any reload")
	}
	if err := syscall.Kill(syscall.Getpid(), syscall.SIGHUP); err != nil {
		t.Fatal(err)
	}
	reloads.waitUntil(t, "the SIGHUP reload", func(error) bool { return accepts(a, billingSecret) })
	if accepts(a, relaySecret) {
		t.Fatal("old token still accepted after SIGHUP")
	}
}
