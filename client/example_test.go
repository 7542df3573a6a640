package client_test

import (
	"context"
	"encoding/json"
	"fmt"
	"log"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxd/outboxd/client"
)

// Emit records the event in the same transaction as the business change:
// both commit, or neither does.
func ExampleEmit() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, databaseURL)
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()

	tx, err := pool.Begin(ctx)
	if err != nil {
		log.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // no-op after Commit
	if _, err := tx.Exec(ctx, `UPDATE sales_order SET state = 'paid' WHERE order_id = 42`); err != nil {
		log.Fatal(err)
	}
	e, err := client.Emit(ctx, tx, client.Event{
		Stream:       "sales_order",
		AggregateKey: "42",
		Type:         "OrderPaid",
		Payload:      json.RawMessage(`{"order_id": 42}`),
		Headers:      map[string]string{"trace_id": "abc"},
	})
	if err != nil {
		log.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		log.Fatal(err)
	}
	// e.ID is the event's id (the broker's deduplication key); e.Revision
	// its place in sales_order 42's history.
	fmt.Println("order 42 paid; OrderPaid committed with it:", e.ID != uuid.Nil && e.Revision > 0)
	// Output: order 42 paid; OrderPaid committed with it: true
}
