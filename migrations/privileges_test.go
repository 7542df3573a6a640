package migrations_test

import (
	"context"
	"fmt"
	"net/url"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/outboxd/outboxd/client"
	"github.com/outboxd/outboxd/internal/testdb"
)

// producerGrants are the privileges SECURITY.md and the README give a
// producer's role: the insert trigger runs with its owner's rights, so the
// role needs no access to the counters, the settings or the server's rows.
const producerGrants = `GRANT USAGE ON SCHEMA outbox TO %[1]s;
	GRANT INSERT, SELECT (event_id, revision) ON outbox.event TO %[1]s`

// A role with only the producer grants records events through every
// producer path (a plain INSERT, with RETURNING and ON CONFLICT DO NOTHING,
// client.Emit and its retry, outbox.emit), gets the trigger's checks, and
// can read, change or write nothing else of the outbox.
func TestProducerNeedsOnlyInsert(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dbURL := testdb.New(t)
	owner := testdb.NewPoolURL(t, dbURL)
	admin, err := pgx.Connect(ctx, testdb.ServerURL())
	if err != nil {
		t.Fatal(err)
	}
	role := "outboxd_producer_" + strings.ReplaceAll(uuid.NewString(), "-", "")[:12]
	if _, err := admin.Exec(ctx, "CREATE ROLE "+role+" LOGIN"); err != nil {
		t.Fatalf("create role (the test server's user must be allowed to): %v", err)
	}
	t.Cleanup(func() {
		// Before the database is dropped: a role with grants in it cannot go.
		ctx := context.Background()
		if _, err := owner.Exec(ctx, "REVOKE ALL ON ALL TABLES IN SCHEMA outbox FROM "+role+"; REVOKE ALL ON SCHEMA outbox FROM "+role); err != nil {
			t.Errorf("revoke: %v", err)
		}
		if _, err := admin.Exec(ctx, "DROP ROLE "+role); err != nil {
			t.Errorf("drop role: %v", err)
		}
		_ = admin.Close(ctx)
	})
	if _, err := owner.Exec(ctx, fmt.Sprintf(producerGrants, role)); err != nil {
		t.Fatal(err)
	}
	u, err := url.Parse(dbURL)
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.User(role)
	producer := testdb.NewPoolURL(t, u.String())

	must := func(sql string, args ...any) {
		t.Helper()
		if _, err := producer.Exec(ctx, sql, args...); err != nil {
			t.Fatalf("as the producer, %s: %v", sql, err)
		}
	}
	must(`INSERT INTO outbox.event (stream, aggregate_key, event_type, payload) VALUES ('orders', 'p', 'T', '{}')`)
	var rev int64
	if err := producer.QueryRow(ctx, `INSERT INTO outbox.event (stream, aggregate_key, event_type, payload)
		VALUES ('orders', 'p', 'T', '{}') RETURNING revision`).Scan(&rev); err != nil || rev != 2 {
		t.Fatalf("INSERT ... RETURNING as the producer: revision %d, %v", rev, err)
	}
	ev := client.Event{ID: uuid.New(), Stream: "orders", AggregateKey: "p", Type: "T", Payload: []byte(`{"a":1}`)}
	first, err := client.Emit(ctx, producer, ev)
	if err != nil || first.Revision != 3 {
		t.Fatalf("client.Emit as the producer: %+v, %v", first, err)
	}
	if again, err := client.Emit(ctx, producer, ev); err != nil || again != first {
		t.Fatalf("client.Emit retry as the producer: %+v, %v; want %+v", again, err, first)
	}
	must(`INSERT INTO outbox.event (event_id, stream, aggregate_key, event_type, payload)
		VALUES ($1, 'orders', 'p', 'T', '{"a":1}') ON CONFLICT DO NOTHING`, ev.ID)
	if err := producer.QueryRow(ctx, `SELECT revision FROM outbox.emit('orders', 'p', 'T', '{}')`).Scan(&rev); err != nil || rev != 4 {
		t.Fatalf("outbox.emit as the producer: revision %d, %v", rev, err)
	}
	_, err = producer.Exec(ctx, `INSERT INTO outbox.event (stream, aggregate_key, event_type, payload) VALUES ('Bad', 'p', 'T', '{}')`)
	wantSQLState(t, err, "22023")

	for _, sql := range []string{
		`SELECT payload FROM outbox.event`,
		`UPDATE outbox.event SET published_at = now()`,
		`DELETE FROM outbox.event`,
		`SELECT * FROM outbox.aggregate`,
		`UPDATE outbox.aggregate SET last_revision = 0`,
		`SELECT * FROM outbox.delivery`,
		`SELECT * FROM outbox.settings`,
		`SELECT * FROM outbox.lease_key`,
	} {
		_, err := producer.Exec(ctx, sql)
		wantSQLState(t, err, "42501") // permission denied
	}
	if n := count(t, owner, `SELECT count(*) FROM outbox.event`); n != 4 {
		t.Fatalf("%d events recorded, want 4", n)
	}
}
