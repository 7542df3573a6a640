package main

import (
	"context"
	"log/slog"
	"time"

	"github.com/outboxd/outboxd/internal/telemetry"
)

// tracingFlushTimeout bounds flushing the last spans on exit.
const tracingFlushTimeout = 5 * time.Second

// startTracing turns on OpenTelemetry tracing when the OTEL_* environment
// asks for it (see internal/telemetry) and returns what flushes it, to
// defer: on exit the spans still buffered are exported, for up to
// tracingFlushTimeout.
func startTracing(ctx context.Context, service string, log *slog.Logger) (stop func(), err error) {
	shutdown, err := telemetry.Setup(ctx, service, log)
	if err != nil {
		return nil, err
	}
	return func() {
		flushCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), tracingFlushTimeout)
		defer cancel()
		if err := shutdown(flushCtx); err != nil {
			log.Warn("tracing: spans lost on exit", "err", err)
		}
	}, nil
}
