package client_test

import (
	"context"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5"

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
