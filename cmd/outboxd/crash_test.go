package main_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outboxd/outboxd/internal/testdb"
)

// Crash test: 20,000 events over 500 aggregates in the default source and
// 4,000 over 200 aggregates (the same stream and keys) in a second source
// b, both served by the same 2 `outboxd serve` processes; 4 `outboxd relay`
// processes relay default and 2 relay b/orders; relays and one server are
// killed with SIGKILL and restarted again and again while events flow in
// both. Each source's sink is a JetStream stream of its own with a 100ms
// duplicate window (the smallest JetStream allows), so it keeps nearly
// every copy a relay published. Per source, nothing may be lost, first
// deliveries of every aggregate must be in revision order, and every
// duplicate must be an exact copy.
func TestCrashKillsLoseNothing(t *testing.T) {
	if testing.Short() {
		t.Skip("crash test runs processes for a while")
	}
	t.Parallel()
	ctx := context.Background()
	const aggregates, perAggregate = 500, 40
	const bAggregates, bPerAggregate = 200, 20
	url, urlB := testdb.New(t), testdb.New(t)
	pool, poolB := testdb.NewPoolURL(t, url), testdb.NewPoolURL(t, urlB)
	// The test databases are clones of one template: b gets a lease key of
	// its own, as `outboxd migrate` gives every database, so a token of one
	// source cannot pass for the other's.
	if _, err := poolB.Exec(ctx, `UPDATE outbox.lease_key
		SET key = decode(replace(gen_random_uuid()::text || gen_random_uuid()::text, '-', ''), 'hex')`); err != nil {
		t.Fatal(err)
	}
	js, streamName, prefix := jetStreamSink(t, "CRASH")
	jsB, streamNameB, prefixB := jetStreamSink(t, "CRASHB")

	// Producers keep going during the chaos: half the events exist up front,
	// half are emitted while processes die.
	emitHalf := func(second int) {
		if err := emitRounds(pool, 1+second*perAggregate/2, (1+second)*perAggregate/2, aggregates); err != nil {
			t.Error(err)
		}
		if err := emitRounds(poolB, 1+second*bPerAggregate/2, (1+second)*bPerAggregate/2, bAggregates); err != nil {
			t.Error(err)
		}
	}
	emitHalf(0)

	addrs := []string{freeAddr(t), freeAddr(t)}
	serve := func(i int) *process {
		// Server 1 applies acks in three committers at once.
		return start(t, "serve", "--database-url", url, "--source", "b="+urlB, "--listen", addrs[i], "--lease-ttl", "2s", "--log-level", "warn", "--http-listen", "",
			"--ack-committers", strconv.Itoa(1+2*i))
	}
	sinkURL := fmt.Sprintf("%s?stream=%s&subject=%s.{stream}.{aggregate_key}&duplicates=100ms", natsURL(), streamName, prefix)
	sinkURLB := fmt.Sprintf("%s?stream=%s&subject=%s.{stream}.{aggregate_key}&duplicates=100ms", natsURL(), streamNameB, prefixB)
	// Relays 1, 3 and 5 take windows of 8 events per aggregate: windowed
	// and one-at-a-time sessions share both servers. Relays 4 and 5 relay
	// source b.
	relay := func(i int) *process {
		args := []string{"relay", "--server", addrs[i%2], "--sink", sinkURL, "--max-in-flight", "16",
			"--max-in-flight-per-aggregate", strconv.Itoa(1 + 7*(i%2)), "--relay-id", "r" + strconv.Itoa(i), "--log-level", "warn"}
		if i >= 4 {
			args[4] = sinkURLB
			args = append(args, "--streams", "b/orders")
		}
		return start(t, args...)
	}
	servers := []*process{serve(0), serve(1)}
	relays := []*process{relay(0), relay(1), relay(2), relay(3), relay(4), relay(5)}

	produced := make(chan struct{})
	go func() { defer close(produced); emitHalf(1) }()

	total, totalB := int64(aggregates*perAggregate), int64(bAggregates*bPerAggregate)
	kills := 0
	deadline := time.Now().Add(4 * time.Minute)
	for round := 0; ; round++ {
		var published, publishedB int64
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox.event WHERE published_at IS NOT NULL`).Scan(&published); err != nil {
			t.Fatal(err)
		}
		if err := poolB.QueryRow(ctx, `SELECT count(*) FROM outbox.event WHERE published_at IS NOT NULL`).Scan(&publishedB); err != nil {
			t.Fatal(err)
		}
		select {
		case <-produced:
			if published == total && publishedB == totalB {
				goto verify
			}
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("only %d of %d events of default and %d of %d of b published after the chaos", published, total, publishedB, totalB)
		}
		// Pace the chaos, then kill: a relay every round, server 1 every third.
		time.Sleep(400 * time.Millisecond)
		if round < 15 {
			i := rand.N(len(relays))
			relays[i].signal(os.Kill)
			relays[i] = relay(i)
			kills++
			if round%3 == 2 {
				servers[1].signal(os.Kill)
				servers[1] = serve(1)
				kills++
			}
		}
	}
verify:
	t.Logf("killed %d processes", kills)
	verifySink(t, js, streamName, total)
	verifySink(t, jsB, streamNameB, totalB)
}

// emitRounds emits rounds from..to of one event for each of aggregates
// aggregates (orders/a-1 ... a-N), round by round, in one statement.
func emitRounds(pool *pgxpool.Pool, from, to, aggregates int) error {
	_, err := pool.Exec(context.Background(), `SELECT outbox.emit('orders', 'a-' || a, 'Changed', jsonb_build_object('r', r))
		FROM generate_series($1::int, $2::int) r, generate_series(1, $3::int) a ORDER BY r, a`, from, to, aggregates)
	return err
}

// verifySink reads every message of a JetStream stream the relays published
// to and checks that it holds total distinct events, first copies in
// revision order per aggregate, and duplicates identical to their first copy.
func verifySink(t *testing.T, js jetstream.JetStream, streamName string, total int64) {
	t.Helper()
	ctx := context.Background()
	s, err := js.Stream(ctx, streamName)
	if err != nil {
		t.Fatal(err)
	}
	cons, err := s.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	stored := int(info.State.Msgs)
	first := map[string]string{} // event id -> payload of its first copy
	last := map[string]int{}
	reordered, duplicates, differing := 0, 0, 0
	for read := 0; read < stored; {
		batch, err := cons.Fetch(1000, jetstream.FetchMaxWait(10*time.Second))
		if err != nil {
			t.Fatal(err)
		}
		for msg := range batch.Messages() {
			read++
			h := msg.Headers()
			id := h.Get("Nats-Msg-Id")
			if p, ok := first[id]; ok {
				duplicates++
				if p != string(msg.Data()) {
					differing++
				}
				continue
			}
			first[id] = string(msg.Data())
			key := h.Get("Outbox-Aggregate-Key")
			rev, _ := strconv.Atoi(h.Get("Outbox-Revision"))
			if rev != last[key]+1 {
				reordered++
			}
			last[key] = rev
		}
		if err := batch.Error(); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("sink: %d messages, %d unique events, %d duplicates", stored, len(first), duplicates)
	if int64(len(first)) != total {
		t.Errorf("lost events: sink saw %d of %d", len(first), total)
	}
	if reordered != 0 {
		t.Errorf("%d first deliveries out of revision order", reordered)
	}
	if differing != 0 {
		t.Errorf("%d duplicates differ from their first copy", differing)
	}
}
