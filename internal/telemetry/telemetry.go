// Package telemetry turns on OpenTelemetry tracing for outboxd's long-running
// commands (serve, dev, relay) from the standard OTEL_* environment
// variables, and leaves it off when they ask for nothing.
//
// Tracing is on when OTEL_TRACES_EXPORTER names an exporter other than
// "none", or, with OTEL_TRACES_EXPORTER unset, when
// OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set
// (then the exporter is OTLP). OTEL_SDK_DISABLED=true turns it off whatever
// else is set. Off, nothing is installed: OpenTelemetry's global tracer
// provider stays the no-op one, so the spans of the gRPC server and the
// relay cost a no-op call each.
//
// Unlike the SDK's specification, which makes "otlp" the default exporter,
// an unset environment exports nothing: a service started without any
// tracing configuration should not try to reach a collector on localhost.
//
// The exporter is chosen by go.opentelemetry.io/contrib/exporters/autoexport
// (otlp over http/protobuf or grpc per OTEL_EXPORTER_OTLP_PROTOCOL, or
// console), and configures itself from the OTLP variables (endpoint,
// headers, TLS, timeout). The SDK reads OTEL_TRACES_SAMPLER(_ARG) and
// OTEL_BSP_*; the resource takes OTEL_SERVICE_NAME and
// OTEL_RESOURCE_ATTRIBUTES over the command's default service name.
//
// The console exporter writes its spans to standard error, not to standard
// output as autoexport's does: standard output carries a command's own
// output, and for `relay --sink stdout://` that is the events, which spans
// interleaved there would corrupt.
package telemetry

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"strings"

	"go.opentelemetry.io/contrib/exporters/autoexport"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/stdout/stdouttrace"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/sdk/resource"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
)

// Enabled reports whether getenv's OTEL_* variables ask for tracing (see
// the package comment).
func Enabled(getenv func(string) string) bool {
	if off, _ := strconv.ParseBool(strings.TrimSpace(getenv("OTEL_SDK_DISABLED"))); off {
		return false
	}
	if exp := strings.TrimSpace(getenv("OTEL_TRACES_EXPORTER")); exp != "" {
		return exp != "none"
	}
	return getenv("OTEL_EXPORTER_OTLP_ENDPOINT") != "" || getenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") != ""
}

// Setup installs a tracer provider exporting as the environment says, as
// OpenTelemetry's global one, with the W3C trace context and baggage
// propagators, and returns the function that flushes and stops it, to call
// on exit. serviceName is service.name unless OTEL_SERVICE_NAME or
// OTEL_RESOURCE_ATTRIBUTES say otherwise. When tracing is off (Enabled is
// false) it installs nothing and the returned function does nothing.
// Export failures are logged to log as warnings.
func Setup(ctx context.Context, serviceName string, log *slog.Logger) (shutdown func(context.Context) error, err error) {
	if !Enabled(os.Getenv) {
		return func(context.Context) error { return nil }, nil
	}
	var exp sdktrace.SpanExporter
	if exporterName() == "console" {
		// Not autoexport's console exporter, which writes to standard
		// output (see the package comment).
		exp, err = stdouttrace.New(stdouttrace.WithWriter(os.Stderr))
	} else {
		exp, err = autoexport.NewSpanExporter(ctx)
	}
	if err != nil {
		return nil, fmt.Errorf("opentelemetry: trace exporter from OTEL_TRACES_EXPORTER=%q: %w", os.Getenv("OTEL_TRACES_EXPORTER"), err)
	}
	// Later options win: the environment overrides the default name.
	res, err := resource.New(ctx,
		resource.WithAttributes(attribute.String("service.name", serviceName)),
		resource.WithTelemetrySDK(),
		resource.WithFromEnv(),
	)
	if err != nil {
		_ = exp.Shutdown(ctx)
		return nil, fmt.Errorf("opentelemetry: resource from OTEL_RESOURCE_ATTRIBUTES: %w", err)
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(exp), sdktrace.WithResource(res))
	otel.SetErrorHandler(otel.ErrorHandlerFunc(func(err error) {
		log.Warn("opentelemetry", "err", err)
	}))
	otel.SetTracerProvider(tp)
	otel.SetTextMapPropagator(propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{}))
	log.Info("tracing on", "exporter", exporterName(), "service", serviceName)
	return func(ctx context.Context) error {
		if err := tp.Shutdown(ctx); err != nil {
			return fmt.Errorf("opentelemetry: flushing spans: %w", err)
		}
		return nil
	}, nil
}

func exporterName() string {
	if e := os.Getenv("OTEL_TRACES_EXPORTER"); e != "" {
		return e
	}
	return "otlp"
}
