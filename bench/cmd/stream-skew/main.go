// Command stream-skew measures what ready work in a stream no relay takes
// costs the other streams: the latency of outbox.claim for a stream with
// nothing ready, and for one with one aggregate ready, and the time a real
// replica and relay (in this process, over loopback gRPC) take to deliver
// a batch of events of that stream; first on an empty database, then with
// -backlog ready aggregates in another stream ("cold") that nobody
// subscribes to. It prints both and their ratio.
//
//	go run ./cmd/stream-skew -database-url postgres://postgres@127.0.0.1:5432/postgres
//
// It creates its own database (dropped at the end) and migrates it.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log"
	"net"
	"net/url"
	"os"
	"slices"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/outboxd/outboxd/internal/app"
	"github.com/outboxd/outboxd/internal/store"
	"github.com/outboxd/outboxd/migrations"
	"github.com/outboxd/outboxd/relay"
	"github.com/outboxd/outboxd/server"
)

func main() {
	dbURL := flag.String("database-url", "postgres://postgres@127.0.0.1:5432/postgres", "a PostgreSQL server to create the scratch database on")
	backlog := flag.Int("backlog", 200_000, "ready aggregates in the stream nobody takes")
	events := flag.Int("events", 3000, "events of the live stream to deliver")
	aggregates := flag.Int("aggregates", 300, "aggregates the live events are spread over")
	claims := flag.Int("claims", 200, "claims timed per measurement")
	flag.Parse()
	if err := run(context.Background(), *dbURL, *backlog, *events, *aggregates, *claims); err != nil {
		log.Fatal(err)
	}
}

type figures struct {
	claimEmpty, claimOne time.Duration // medians
	deliver              time.Duration
}

func run(ctx context.Context, adminURL string, backlog, events, aggregates, claims int) error {
	u, err := url.Parse(adminURL)
	if err != nil {
		return err
	}
	name := fmt.Sprintf("outboxd_skew_%d", os.Getpid())
	admin, err := pgx.Connect(ctx, adminURL)
	if err != nil {
		return err
	}
	defer admin.Close(ctx)
	if _, err := admin.Exec(ctx, "CREATE DATABASE "+name); err != nil {
		return err
	}
	defer func() {
		if _, err := admin.Exec(context.Background(), "DROP DATABASE "+name+" WITH (FORCE)"); err != nil {
			log.Printf("drop %s: %v", name, err)
		}
	}()
	u.Path = "/" + name
	dbURL := u.String()
	pool, err := pgxpool.New(ctx, dbURL)
	if err != nil {
		return err
	}
	defer pool.Close()
	db := stdlib.OpenDBFromPool(pool)
	if _, err := migrations.Up(ctx, db, nil); err != nil {
		return err
	}
	_ = db.Close()

	// A round not counted: the connections' plans and the server's first
	// start are paid for before either measurement.
	if _, err := measure(ctx, pool, dbURL, events/10, aggregates/10, claims/4, 2); err != nil {
		return err
	}
	before, err := measure(ctx, pool, dbURL, events, aggregates, claims, 0)
	if err != nil {
		return err
	}
	fmt.Printf("without backlog: claim (nothing ready) %v, claim (one ready) %v, %d events delivered in %v\n",
		before.claimEmpty, before.claimOne, events, before.deliver.Round(time.Millisecond))

	start := time.Now()
	if _, err := pool.Exec(ctx, `
		INSERT INTO outbox.event (stream, aggregate_key, revision, event_type, payload)
		SELECT 'cold', 'k' || g, 1, 'seeded', '{}' FROM generate_series(1, $1) g`, backlog); err != nil {
		return err
	}
	if _, err := pool.Exec(ctx, `SELECT outbox.discover()`); err != nil {
		return err
	}
	if _, err := pool.Exec(ctx, `VACUUM ANALYZE outbox.delivery`); err != nil {
		return err
	}
	var ready int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox.delivery WHERE stream = 'cold' AND state = 'ready'`).Scan(&ready); err != nil {
		return err
	}
	fmt.Printf("seeded %d ready aggregates in stream cold in %v\n", ready, time.Since(start).Round(time.Millisecond))

	after, err := measure(ctx, pool, dbURL, events, aggregates, claims, 1)
	if err != nil {
		return err
	}
	fmt.Printf("with backlog:    claim (nothing ready) %v, claim (one ready) %v, %d events delivered in %v\n",
		after.claimEmpty, after.claimOne, events, after.deliver.Round(time.Millisecond))
	fmt.Printf("ratio with/without: claim (nothing ready) %.2f, claim (one ready) %.2f, delivery %.2f\n",
		ratio(after.claimEmpty, before.claimEmpty), ratio(after.claimOne, before.claimOne), ratio(after.deliver, before.deliver))
	return nil
}

func ratio(a, b time.Duration) float64 { return float64(a) / float64(b) }

// measure times claims for stream live, then delivers events of it through
// a replica and a relay. round keeps aggregate keys apart between calls.
func measure(ctx context.Context, pool *pgxpool.Pool, dbURL string, events, aggregates, claims, round int) (figures, error) {
	var f figures
	holder := uuid.New()
	claim := func() (time.Duration, error) {
		start := time.Now()
		rows, err := pool.Query(ctx, `SELECT event_id FROM outbox.claim($1, 'skew', 'skew', '{live}', 64, '30 seconds')`, holder)
		if err != nil {
			return 0, err
		}
		rows.Close()
		return time.Since(start), rows.Err()
	}
	var empty, one []time.Duration
	for i := range claims {
		d, err := claim()
		if err != nil {
			return f, err
		}
		empty = append(empty, d)
		// One ready aggregate of live, claimed, then given back and
		// published out of the way.
		if _, err := pool.Exec(ctx, `INSERT INTO outbox.event (stream, aggregate_key, revision, event_type, payload)
			VALUES ('live', $1, 1, 'probe', '{}')`, fmt.Sprintf("probe-%d-%d", round, i)); err != nil {
			return f, err
		}
		if _, err := pool.Exec(ctx, `SELECT outbox.discover()`); err != nil {
			return f, err
		}
		d, err = claim()
		if err != nil {
			return f, err
		}
		one = append(one, d)
		if _, err := pool.Exec(ctx, `SELECT count(*) FROM outbox.ack((SELECT array_agg(leased_event_id) FROM outbox.delivery WHERE holder = $1), 'skew')`, holder); err != nil {
			return f, err
		}
	}
	f.claimEmpty, f.claimOne = median(empty), median(one)

	d, err := deliver(ctx, pool, dbURL, events, aggregates, round)
	f.deliver = d
	return f, err
}

func median(ds []time.Duration) time.Duration {
	slices.Sort(ds)
	return ds[len(ds)/2].Round(time.Microsecond)
}

type counter struct {
	n    atomic.Int64
	want int64
	done chan struct{}
}

func (c *counter) Publish(_ context.Context, ev relay.Event) error {
	if ev.Stream == "live" && c.n.Add(1) == c.want {
		close(c.done)
	}
	return nil
}

// deliver commits events of stream live (aggregates aggregates, in
// revision order) in one transaction and times their delivery through a
// replica and one relay subscribed to live alone.
func deliver(ctx context.Context, pool *pgxpool.Pool, dbURL string, events, aggregates, round int) (time.Duration, error) {
	rep, err := app.New(ctx, app.Config{Server: server.Config{Store: store.New(pool), DatabaseURL: dbURL}})
	if err != nil {
		return 0, err
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	serveCtx, stop := context.WithCancel(ctx)
	served := make(chan error, 1)
	go func() { served <- rep.Serve(serveCtx, lis) }()
	defer func() {
		stop()
		<-served
	}()
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return 0, err
	}
	defer conn.Close()
	c := &counter{want: int64(events), done: make(chan struct{})}
	runner, err := relay.NewRunner(relay.Config{Conn: conn, Publisher: c, RelayID: "skew", Streams: []string{"live"}, MaxInFlight: 64})
	if err != nil {
		return 0, err
	}
	runCtx, stopRelay := context.WithCancel(ctx)
	ran := make(chan error, 1)
	go func() { ran <- runner.Run(runCtx) }()
	defer func() {
		stopRelay()
		<-ran
	}()
	// Let the relay subscribe and settle before the clock starts.
	time.Sleep(500 * time.Millisecond)

	start := time.Now()
	if _, err := pool.Exec(ctx, `
		INSERT INTO outbox.event (stream, aggregate_key, revision, event_type, payload)
		SELECT 'live', 'a' || $3::int || '-' || (g % $2), g / $2 + 1, 'live', '{}'
		FROM generate_series(0, $1 - 1) g ORDER BY g % $2, g / $2`, events, aggregates, round); err != nil {
		return 0, err
	}
	select {
	case <-c.done:
		return time.Since(start), nil
	case <-time.After(5 * time.Minute):
		return 0, errors.New("delivery did not finish in 5 minutes")
	case err := <-ran:
		return 0, fmt.Errorf("relay stopped: %w", err)
	}
}
