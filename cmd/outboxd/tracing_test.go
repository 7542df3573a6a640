package main_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/protobuf/proto"

	"github.com/outboxd/outboxd/internal/testdb"
)

// collector is an OTLP/HTTP trace receiver: the spans exported to it, by
// service name.
type collector struct {
	mu    sync.Mutex
	spans map[string][]*tracepb.Span
}

func newCollector(t *testing.T) (*collector, string) {
	t.Helper()
	c := &collector{spans: map[string][]*tracepb.Span{}}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(r.Body)
		var req coltracepb.ExportTraceServiceRequest
		if err == nil {
			err = proto.Unmarshal(body, &req)
		}
		if r.URL.Path != "/v1/traces" || err != nil {
			t.Errorf("collector: %s %s: %v", r.Method, r.URL.Path, err)
			http.Error(w, "bad export", http.StatusBadRequest)
			return
		}
		c.mu.Lock()
		for _, rs := range req.GetResourceSpans() {
			var service string
			for _, kv := range rs.GetResource().GetAttributes() {
				if kv.GetKey() == "service.name" {
					service = kv.GetValue().GetStringValue()
				}
			}
			for _, ss := range rs.GetScopeSpans() {
				c.spans[service] = append(c.spans[service], ss.GetSpans()...)
			}
		}
		c.mu.Unlock()
		out, _ := proto.Marshal(&coltracepb.ExportTraceServiceResponse{})
		w.Header().Set("Content-Type", "application/x-protobuf")
		_, _ = w.Write(out)
	}))
	t.Cleanup(srv.Close)
	return c, srv.URL
}

func (c *collector) of(service string) []*tracepb.Span {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.spans[service]
}

// `outboxd serve` and `outboxd relay` export spans over OTLP as the
// standard OTEL_* variables say, and flush them when SIGTERM stops them:
// the server's gRPC spans, and the relay's publish span, linked to the
// producer's trace context stored with the event, whose own context
// reaches the NATS message.
func TestServeAndRelayExportTraces(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	addr := freeAddr(t)
	js, streamName, prefix := jetStreamSink(t, "TRACE")
	col, endpoint := newCollector(t)
	// The default batch delay (5 s) outlasts the test: spans arrive only
	// because the processes flush on exit.
	env := []string{"OTEL_EXPORTER_OTLP_ENDPOINT=" + endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf"}

	const producerTrace, producerSpan = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
	if _, err := pool.Exec(ctx, `SELECT outbox.emit('sales_order', '42', 'OrderPaid', '{}', $1::jsonb)`,
		fmt.Sprintf(`{"traceparent": "00-%s-%s-01"}`, producerTrace, producerSpan)); err != nil {
		t.Fatal(err)
	}
	serve := startEnv(t, env, "serve", "--database-url", url, "--listen", addr, "--http-listen", "")
	rel := startEnv(t, env, "relay", "--server", addr,
		"--sink", fmt.Sprintf("%s?stream=%s&subject=%s.{stream}.{aggregate_key}", natsURL(), streamName, prefix))
	waitPublished(t, pool, 1)
	if code := rel.signal(syscall.SIGTERM); code != 0 {
		t.Fatalf("relay exited with %d", code)
	}
	if code := serve.signal(syscall.SIGTERM); code != 0 {
		t.Fatalf("serve exited with %d", code)
	}

	var send *tracepb.Span
	for _, s := range col.of("outboxd-relay") {
		if s.GetKind() == tracepb.Span_SPAN_KIND_PRODUCER {
			send = s
		}
	}
	if send == nil {
		t.Fatalf("no producer span exported by the relay (got %d relay spans)", len(col.of("outboxd-relay")))
	}
	if send.GetName() != "send sales_order" || len(send.GetParentSpanId()) != 0 {
		t.Errorf("publish span %q with parent %x, want a root span named %q", send.GetName(), send.GetParentSpanId(), "send sales_order")
	}
	if l := send.GetLinks(); len(l) != 1 || fmt.Sprintf("%x", l[0].GetTraceId()) != producerTrace || fmt.Sprintf("%x", l[0].GetSpanId()) != producerSpan {
		t.Errorf("publish span links %v, want one to the producer's %s/%s", l, producerTrace, producerSpan)
	}

	cons, err := js.OrderedConsumer(ctx, streamName, jetstream.OrderedConsumerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	msg, err := cons.Next(jetstream.FetchMaxWait(10 * time.Second))
	if err != nil {
		t.Fatal(err)
	}
	if got, want := msg.Headers().Get("traceparent"), fmt.Sprintf("00-%x-%x-01", send.GetTraceId(), send.GetSpanId()); got != want {
		t.Errorf("NATS message traceparent %q, want the publish span's %q", got, want)
	}

	server := map[string]tracepb.Span_SpanKind{}
	for _, s := range col.of("outboxd") {
		server[s.GetName()] = s.GetKind()
	}
	for _, name := range []string{"outbox.v1.RelayService/Subscribe", "outbox.v1.RelayService/AckStream"} {
		if server[name] != tracepb.Span_SPAN_KIND_SERVER {
			t.Errorf("no server span %s exported by serve (got %v)", name, server)
		}
	}
}

// With the console exporter, spans go to standard error: `relay --sink
// stdout://` keeps standard output for its events, one JSON object per
// line, which spans interleaved there would corrupt.
func TestConsoleSpansStayOffTheStdoutSink(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	addr := freeAddr(t)
	start(t, "serve", "--database-url", url, "--listen", addr, "--http-listen", "")
	if _, err := pool.Exec(ctx, `SELECT outbox.emit('sales_order', 'o-' || a, 'OrderPaid', '{}') FROM generate_series(1, 3) a`); err != nil {
		t.Fatal(err)
	}
	relayCmd := exec.Command(binary, "relay", "--server", addr, "--sink", "stdout://", "--streams", "sales_order")
	relayCmd.Env = append(os.Environ(), "OTEL_TRACES_EXPORTER=console", "OTEL_BSP_SCHEDULE_DELAY=50")
	var stdout, stderr bytes.Buffer
	relayCmd.Stdout, relayCmd.Stderr = &stdout, &stderr
	if err := relayCmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- relayCmd.Wait() }()
	t.Cleanup(func() {
		_ = relayCmd.Process.Kill()
	})
	waitPublished(t, pool, 3)
	// SIGTERM flushes the spans still buffered before the process exits.
	_ = relayCmd.Process.Signal(syscall.SIGTERM)
	select {
	case err := <-exited:
		if err != nil {
			t.Fatalf("relay: %v\n%s", err, stderr.String())
		}
	case <-time.After(time.Minute):
		t.Fatal("relay had not exited a minute after SIGTERM")
	}
	lines := strings.Split(strings.TrimSpace(stdout.String()), "\n")
	if len(lines) != 3 {
		t.Errorf("stdout holds %d lines, want the 3 events:\n%s", len(lines), stdout.String())
	}
	for _, line := range lines {
		var ev struct {
			EventID string `json:"event_id"`
		}
		if err := json.Unmarshal([]byte(line), &ev); err != nil || ev.EventID == "" {
			t.Errorf("stdout line is not an event: %q", line)
		}
	}
	if !strings.Contains(stderr.String(), `"SpanContext"`) {
		t.Errorf("no span on stderr:\n%s", stderr.String())
	}
}
