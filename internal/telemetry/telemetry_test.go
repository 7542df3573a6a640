package telemetry_test

import (
	"context"
	"log/slog"
	"os"
	"strings"
	"testing"

	"go.opentelemetry.io/otel"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/outboxd/outboxd/internal/telemetry"
)

func TestEnabled(t *testing.T) {
	for _, tc := range []struct {
		env  map[string]string
		want bool
	}{
		{nil, false},
		{map[string]string{"OTEL_SERVICE_NAME": "x", "OTEL_TRACES_SAMPLER": "always_on"}, false},
		{map[string]string{"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, true},
		{map[string]string{"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, true},
		{map[string]string{"OTEL_TRACES_EXPORTER": "console"}, true},
		{map[string]string{"OTEL_TRACES_EXPORTER": "otlp"}, true},
		{map[string]string{"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, false},
		{map[string]string{"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, false},
		{map[string]string{"OTEL_SDK_DISABLED": "false", "OTEL_TRACES_EXPORTER": "otlp"}, true},
		// Values as a shell or a manifest may pad them.
		{map[string]string{"OTEL_SDK_DISABLED": " true ", "OTEL_TRACES_EXPORTER": "otlp"}, false},
		{map[string]string{"OTEL_TRACES_EXPORTER": " none ", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, false},
	} {
		if got := telemetry.Enabled(func(k string) string { return tc.env[k] }); got != tc.want {
			t.Errorf("Enabled(%v) = %v, want %v", tc.env, got, tc.want)
		}
	}
}

// Setup installs nothing when the environment asks for no tracing, and
// the console exporter writes its spans to standard error, never to
// standard output, which carries a command's own output (the events of
// `relay --sink stdout://`).
func TestSetupConsoleWritesToStandardError(t *testing.T) {
	for _, k := range []string{"OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"} {
		t.Setenv(k, "")
	}
	ctx := context.Background()
	log := slog.New(slog.DiscardHandler)
	shutdown, err := telemetry.Setup(ctx, "test", log)
	if err != nil {
		t.Fatal(err)
	}
	if err := shutdown(ctx); err != nil {
		t.Fatal(err)
	}
	if _, ok := otel.GetTracerProvider().(*sdktrace.TracerProvider); ok {
		t.Fatal("Setup installed a tracer provider with no tracing asked for")
	}

	t.Setenv("OTEL_TRACES_EXPORTER", "console")
	stdout, stderr := tempFile(t), tempFile(t)
	origOut, origErr := os.Stdout, os.Stderr
	os.Stdout, os.Stderr = stdout, stderr
	shutdown, err = telemetry.Setup(ctx, "test", log)
	os.Stdout, os.Stderr = origOut, origErr
	if err != nil {
		t.Fatal(err)
	}
	_, span := otel.Tracer("telemetry_test").Start(ctx, "a-span-to-export")
	span.End()
	if err := shutdown(ctx); err != nil {
		t.Fatal(err)
	}
	out, errOut := readFile(t, stdout), readFile(t, stderr)
	if out != "" {
		t.Errorf("the console exporter wrote to standard output: %q", out)
	}
	if !strings.Contains(errOut, "a-span-to-export") {
		t.Errorf("standard error does not carry the span: %q", errOut)
	}
}

func tempFile(t *testing.T) *os.File {
	t.Helper()
	f, err := os.CreateTemp(t.TempDir(), "out")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	return f
}

func readFile(t *testing.T, f *os.File) string {
	t.Helper()
	b, err := os.ReadFile(f.Name())
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}
