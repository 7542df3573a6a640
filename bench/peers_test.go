package bench

import (
	"testing"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxd/outboxd/internal/testdb"
)

// BENCHMARKS.md reports that the watermill arms lose events when their
// subscriber is closed while it is behind: watermill-sql's queue offsets
// adapter acks every row of the fetched batch, handed out or not, when the
// subscriber closes mid-batch. This pins that reading of the library: if it
// fails after an upgrade of watermill-sql, the loss is fixed upstream and
// BENCHMARKS.md should say so.
func TestWatermillCloseMidBatchDropsTheBatch(t *testing.T) {
	if testing.Short() {
		t.Skip("needs PostgreSQL")
	}
	t.Parallel()
	ctx := t.Context()
	pool, err := pgxpool.New(ctx, testdb.New(t))
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	if err := createWatermillTable(ctx, pool); err != nil {
		t.Fatal(err)
	}
	pub, err := wsql.NewPublisher(wsql.BeginnerFromPgx(pool), wsql.PublisherConfig{SchemaAdapter: watermillSchema}, nil)
	if err != nil {
		t.Fatal(err)
	}
	const published = 10
	for range published {
		if err := pub.Publish(watermillTopic, message.NewMessage(watermill.NewUUID(), []byte(`{}`))); err != nil {
			t.Fatal(err)
		}
	}
	sub, err := wsql.NewSubscriber(wsql.BeginnerFromPgx(pool),
		wsql.SubscriberConfig{SchemaAdapter: watermillSchema, OffsetsAdapter: watermillOffsets}, nil)
	if err != nil {
		t.Fatal(err)
	}
	msgs, err := sub.Subscribe(ctx, watermillTopic)
	if err != nil {
		t.Fatal(err)
	}
	(<-msgs).Ack() // the first message is handled
	<-msgs         // the second is handed out; the subscriber closes before its ack
	if err := sub.Close(); err != nil {
		t.Fatal(err)
	}
	var left int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM `+watermillTable).Scan(&left); err != nil {
		t.Fatal(err)
	}
	if left != 0 {
		t.Fatalf("%d of %d messages left after acking one and closing: watermill-sql no longer drops the rest of the batch; update BENCHMARKS.md", left, published)
	}
}
