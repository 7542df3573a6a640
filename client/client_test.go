package client_test

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/outboxd/outboxd/client"
	"github.com/outboxd/outboxd/internal/testdb"
)

func TestEmitOnPoolConnAndTx(t *testing.T) {
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	ev := client.Event{Stream: "orders", AggregateKey: "1", Type: "T", Payload: []byte(`{"a":1}`), Headers: map[string]string{"h": "v"}}
	for i, q := range []client.Querier{pool, tx} {
		e, err := client.Emit(ctx, q, ev)
		if err != nil || e.Revision != int64(i+1) {
			t.Fatalf("emit %d: %+v, %v", i, e, err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if e, err := client.Emit(ctx, conn, ev); err != nil || e.Revision != 3 {
		t.Fatalf("emit on conn: %+v, %v", e, err)
	}
	var headers map[string]string
	if err := pool.QueryRow(ctx, `SELECT headers FROM outbox.event WHERE revision = 3`).Scan(&headers); err != nil || headers["h"] != "v" {
		t.Fatalf("headers %v, %v", headers, err)
	}
}

func TestEmitRefusesWhatItCanCheck(t *testing.T) {
	for _, ev := range []client.Event{
		{Stream: "orders", AggregateKey: "1", Type: "T"},
		{Stream: "orders", AggregateKey: "1", Type: "T", Payload: []byte(`{nope`)},
		{Stream: "orders", AggregateKey: "1", Type: "T", Payload: []byte(`{}`), Revision: -1},
	} {
		if _, err := client.Emit(context.Background(), nil, ev); !errors.Is(err, client.ErrInvalidEvent) {
			t.Errorf("Emit(%+v) = %v, want ErrInvalidEvent", ev, err)
		}
	}
}

func TestEmitCarriesTraceContext(t *testing.T) {
	ctx := context.Background()
	pool := testdb.NewPoolURL(t, testdb.New(t))
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(tracetest.NewSpanRecorder()))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	ts, err := trace.ParseTraceState("vendor=abc")
	if err != nil {
		t.Fatal(err)
	}
	// A remote parent with a tracestate, as an incoming request would give.
	parent := trace.NewSpanContext(trace.SpanContextConfig{
		TraceID: trace.TraceID{1, 2, 3}, SpanID: trace.SpanID{4, 5, 6}, TraceFlags: trace.FlagsSampled,
		TraceState: ts, Remote: true,
	})
	spanCtx, span := tp.Tracer("test").Start(trace.ContextWithRemoteSpanContext(ctx, parent), "place order")
	defer span.End()
	sc := span.SpanContext()
	wantParent := fmt.Sprintf("00-%s-%s-01", sc.TraceID(), sc.SpanID())

	headersOf := func(id uuid.UUID) map[string]string {
		t.Helper()
		var h map[string]string
		if err := pool.QueryRow(ctx, `SELECT headers FROM outbox.event WHERE event_id = $1`, id).Scan(&h); err != nil {
			t.Fatal(err)
		}
		return h
	}
	emit := func(ctx context.Context, key string, headers map[string]string) map[string]string {
		t.Helper()
		e, err := client.Emit(ctx, pool, client.Event{Stream: "orders", AggregateKey: key, Type: "T", Payload: []byte(`{}`), Headers: headers})
		if err != nil {
			t.Fatal(err)
		}
		return headersOf(e.ID)
	}

	mine := map[string]string{"h": "v"}
	got := emit(spanCtx, "1", mine)
	want := map[string]string{"h": "v", "traceparent": wantParent, "tracestate": "vendor=abc"}
	if !maps.Equal(got, want) {
		t.Errorf("with a span: headers %v, want %v", got, want)
	}
	if len(mine) != 1 {
		t.Errorf("Emit modified the caller's map: %v", mine)
	}
	// The caller's own trace context (either key, any case) is kept whole.
	for _, own := range []map[string]string{
		{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
		{"TraceState": "mine=1"},
	} {
		if got := emit(spanCtx, "2", own); !maps.Equal(got, own) {
			t.Errorf("caller's %v: headers %v, want them unchanged", own, got)
		}
	}
	// Without a span nothing is added.
	if got := emit(ctx, "3", nil); len(got) != 0 {
		t.Errorf("without a span: headers %v, want none", got)
	}
}

// An event with a fixed ID is recorded under that ID, and once: a producer
// that retries Emit, not knowing whether its first attempt committed, gets
// the recorded event back (same ID, same revision) and no second copy,
// and the retry consumes no revision. The same ID for a different event is
// refused.
func TestEmitWithAFixedIDRecordsTheEventOnce(t *testing.T) {
	ctx := context.Background()
	pool := testdb.NewPoolURL(t, testdb.New(t))
	id := uuid.New()
	ev := client.Event{ID: id, Stream: "orders", AggregateKey: "7", Type: "T", Payload: []byte(`{"n":1}`)}
	first, err := client.Emit(ctx, pool, ev)
	if err != nil || first.ID != id || first.Revision != 1 {
		t.Fatalf("first Emit: %+v, %v; want ID %s revision 1", first, err, id)
	}
	if again, err := client.Emit(ctx, pool, ev); err != nil || again != first {
		t.Fatalf("retried Emit: %+v, %v; want %+v", again, err, first)
	}
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox.event WHERE event_id = $1`, id).Scan(&n); err != nil || n != 1 {
		t.Fatalf("%d events recorded under the ID, %v; want 1", n, err)
	}
	next, err := client.Emit(ctx, pool, client.Event{Stream: "orders", AggregateKey: "7", Type: "T", Payload: []byte(`{}`)})
	if err != nil || next.Revision != 2 || next.ID == id {
		t.Fatalf("the next event of the aggregate: %+v, %v; want revision 2 and a new ID", next, err)
	}
	ev.Payload = []byte(`{"n":2}`)
	var pgErr *pgconn.PgError
	if _, err := client.Emit(ctx, pool, ev); !errors.As(err, &pgErr) || pgErr.Code != "23505" {
		t.Fatalf("the ID of a recorded event for another payload: %v, want SQLSTATE 23505", err)
	}
}
