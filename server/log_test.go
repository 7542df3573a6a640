package server_test

import (
	"log/slog"
	"testing"
)

// testLogger routes the server's logs to t.Log, so they show with the test
// that produced them (and only when it fails or -v is set).
func testLogger(t testing.TB) *slog.Logger {
	return slog.New(slog.NewTextHandler(tWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

type tWriter struct{ t testing.TB }

func (w tWriter) Write(p []byte) (int, error) {
	w.t.Helper()
	w.t.Log(string(p))
	return len(p), nil
}
