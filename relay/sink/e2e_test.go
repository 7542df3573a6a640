package sink_test

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/twmb/franz-go/pkg/kfake"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/outboxd/outboxd/client"
	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/servertest"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/relay"
	"github.com/outboxd/outboxd/relay/sink"
	"github.com/outboxd/outboxd/server"
)

// These tests run a sink under the real relay.Runner against a real server
// replica (internal/servertest) on a test database, as `outboxd relay`
// does, and read what reached the real broker.

// relayEnv is a database, a replica serving it, and a runner publishing
// through a sink until the test ends.
type relayEnv struct {
	pool *pgxpool.Pool
	srv  *servertest.Replica
}

func newRelayEnv(t *testing.T, configure func(*server.Config)) *relayEnv {
	t.Helper()
	url := testdb.New(t)
	return &relayEnv{
		pool: testdb.NewPoolURL(t, url),
		srv:  servertest.Start(t, url, servertest.Options{Configure: configure}),
	}
}

// run relays through s until the test ends.
func (e *relayEnv) run(t *testing.T, s relay.Publisher) {
	t.Helper()
	r, err := relay.NewRunner(relay.Config{Conn: e.srv.Conn, Publisher: s, MaxInFlight: 16, Logger: servertest.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
}

// emit commits revisions 1..revs of each aggregate in keys, interleaved.
func (e *relayEnv) emit(t *testing.T, stream string, keys []string, revs int) {
	t.Helper()
	for r := 1; r <= revs; r++ {
		for _, k := range keys {
			if _, err := client.Emit(context.Background(), e.pool, client.Event{
				Stream: stream, AggregateKey: k, Type: "Changed", Payload: json.RawMessage(`{"r":` + strconv.Itoa(r) + `}`),
				Headers: map[string]string{"X-Tenant": "acme"},
			}); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// waitPublished waits until n events are marked published.
func (e *relayEnv) waitPublished(t *testing.T, n int) {
	t.Helper()
	waitUntil(t, fmt.Sprintf("%d events published", n), func() bool {
		var got int
		if err := e.pool.QueryRow(context.Background(), `SELECT count(*) FROM outbox.event WHERE published_at IS NOT NULL`).Scan(&got); err != nil {
			t.Fatal(err)
		}
		return got >= n
	})
}

// waitParked waits until the aggregate is parked and returns it.
func (e *relayEnv) waitParked(t *testing.T, stream, key string) *outboxv1.Aggregate {
	t.Helper()
	var agg *outboxv1.Aggregate
	waitUntil(t, "aggregate "+key+" parked", func() bool {
		res, err := e.srv.Admin.GetAggregate(context.Background(), &outboxv1.GetAggregateRequest{Stream: stream, AggregateKey: key})
		if err != nil {
			return false
		}
		agg = res.GetAggregate()
		return agg.GetParkedAt() != nil
	})
	return agg
}

func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("not reached within 30s: %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// checkOrder checks that each aggregate's revisions arrive as 1..revs, each
// once, and that the event ID (the broker's dedup key) is unique.
func checkOrder(t *testing.T, keys []string, revs int, got []struct {
	key, id string
	rev     int64
}) {
	t.Helper()
	if len(got) != len(keys)*revs {
		t.Errorf("broker holds %d messages, want %d", len(got), len(keys)*revs)
	}
	last := map[string]int64{}
	ids := map[string]bool{}
	for _, m := range got {
		if m.rev != last[m.key]+1 {
			t.Errorf("aggregate %s: revision %d after %d", m.key, m.rev, last[m.key])
		}
		last[m.key] = m.rev
		if ids[m.id] || m.id == "" {
			t.Errorf("event id %q repeated or empty", m.id)
		}
		ids[m.id] = true
	}
}

// Events emitted in SQL reach RabbitMQ through the runner, each aggregate
// in revision order, and are marked published; an aggregate whose events
// are unroutable is parked with the broker's reason instead of being
// dropped.
func TestAMQPThroughRunner(t *testing.T) {
	t.Parallel()
	rabbit := newRabbitEnv(t, "outbox.orders.*")
	e := newRelayEnv(t, func(c *server.Config) {
		c.BackoffBase, c.BackoffCap, c.MaxFailures = 10*time.Millisecond, 50*time.Millisecond, 3
	})
	keys := []string{"a", "b", "c", "d", "e", "f", "g", "h"}
	e.emit(t, "orders", keys, 5)
	e.emit(t, "lost", []string{"x"}, 1) // no binding routes outbox.lost.*
	e.run(t, openSink(t, rabbit.url(nil)))
	e.waitPublished(t, len(keys)*5)

	var got []struct {
		key, id string
		rev     int64
	}
	for _, d := range rabbit.get(t, len(keys)*5) {
		rev, _ := strconv.ParseInt(d.Headers[sink.HeaderRevision].(string), 10, 64)
		key, _ := d.Headers[sink.HeaderAggregateKey].(string)
		if d.Headers["X-Tenant"] != "acme" || d.RoutingKey != "outbox.orders."+key {
			t.Errorf("message %s: routing key %q, headers %v", d.MessageId, d.RoutingKey, d.Headers)
		}
		got = append(got, struct {
			key, id string
			rev     int64
		}{key, d.MessageId, rev})
	}
	checkOrder(t, keys, 5, got)

	agg := e.waitParked(t, "lost", "x")
	if want := "unroutable"; !strings.Contains(agg.GetLastError(), want) {
		t.Errorf("parked aggregate's error %q does not say %q", agg.GetLastError(), want)
	}
}

// Events reach Redis Streams through the runner, each aggregate in
// revision order; entries carry the event's fields.
func TestRedisThroughRunner(t *testing.T) {
	t.Parallel()
	rd := newRedisEnv(t)
	e := newRelayEnv(t, nil)
	keys := []string{"a", "b", "c", "d", "e", "f"}
	e.emit(t, "orders", keys, 5)
	e.run(t, openSink(t, rd.url(nil)))
	e.waitPublished(t, len(keys)*5)

	var got []struct {
		key, id string
		rev     int64
	}
	for _, m := range rd.entries(t, rd.prefix+".orders") {
		rev, _ := strconv.ParseInt(m.Values[sink.RedisFieldRevision].(string), 10, 64)
		got = append(got, struct {
			key, id string
			rev     int64
		}{m.Values[sink.RedisFieldKey].(string), m.Values[sink.RedisFieldEventID].(string), rev})
	}
	checkOrder(t, keys, 5, got)
}

// Signed webhooks through the runner: each aggregate's events arrive in
// revision order with valid signatures, and an aggregate the receiver
// refuses (422) is parked with the status and the receiver's words.
func TestWebhookThroughRunner(t *testing.T) {
	t.Parallel()
	h := newHook(t)
	h.mu.Lock()
	h.answer = func(w http.ResponseWriter, _ *http.Request, body []byte) bool {
		if !strings.Contains(string(body), `"aggregate_key":"bad"`) {
			return false
		}
		w.WriteHeader(http.StatusUnprocessableEntity)
		_, _ = io.WriteString(w, "schema v1 expected")
		return true
	}
	h.mu.Unlock()
	e := newRelayEnv(t, func(c *server.Config) {
		c.BackoffBase, c.BackoffCap, c.MaxFailures = 10*time.Millisecond, 50*time.Millisecond, 3
	})
	keys := []string{"a", "b", "c", "d", "e", "f"}
	e.emit(t, "orders", keys, 4)
	e.emit(t, "orders", []string{"bad"}, 1)
	e.run(t, openSink(t, h.url(t, nil)))
	e.waitPublished(t, len(keys)*4)

	var got []struct {
		key, id string
		rev     int64
	}
	for _, r := range h.requests() {
		if r.err != nil {
			t.Errorf("signature check: %v", r.err)
		}
		var b struct {
			EventID      string `json:"event_id"`
			AggregateKey string `json:"aggregate_key"`
			Revision     int64  `json:"revision"`
		}
		if err := json.Unmarshal(r.body, &b); err != nil {
			t.Fatal(err)
		}
		if b.EventID != r.header.Get("webhook-id") {
			t.Errorf("webhook-id %q for event %s", r.header.Get("webhook-id"), b.EventID)
		}
		got = append(got, struct {
			key, id string
			rev     int64
		}{b.AggregateKey, b.EventID, b.Revision})
	}
	checkOrder(t, keys, 4, got)

	agg := e.waitParked(t, "orders", "bad")
	for _, want := range []string{"422", "schema v1 expected"} {
		if !strings.Contains(agg.GetLastError(), want) {
			t.Errorf("parked aggregate's error %q does not mention %q", agg.GetLastError(), want)
		}
	}
}

// Events reach Kafka (kfake, in process: no Kafka server runs on these
// machines) through the runner; each aggregate stays in one partition, in
// revision order.
func TestKafkaThroughRunner(t *testing.T) {
	t.Parallel()
	c := newKafka(t, "outbox.orders")
	e := newRelayEnv(t, nil)
	keys := []string{"a", "b", "c", "d", "e", "f"}
	e.emit(t, "orders", keys, 5)
	e.run(t, openSink(t, kafkaSinkURL(c, nil)))
	e.waitPublished(t, len(keys)*5)

	var got []struct {
		key, id string
		rev     int64
	}
	partition := map[string]int32{}
	for _, r := range consume(t, c, len(keys)*5, "outbox.orders") {
		k := string(r.Key)
		if p, ok := partition[k]; ok && p != r.Partition {
			t.Errorf("aggregate %s in partitions %d and %d", k, p, r.Partition)
		}
		partition[k] = r.Partition
		rev, _ := strconv.ParseInt(header(r, sink.HeaderRevision), 10, 64)
		got = append(got, struct {
			key, id string
			rev     int64
		}{k, header(r, sink.HeaderEventID), rev})
	}
	// Records of different partitions interleave arbitrarily; order is
	// per aggregate, which checkOrder checks.
	checkOrder(t, keys, 5, got)
}

// A relay cut off mid-stream (its connection to the server dropped, as
// when the process is killed) and a second relay taking over: nothing is
// lost, and each aggregate's first copies reach RabbitMQ in revision
// order. Copies after the first (the cut relay's publishes whose acks
// were lost) may repeat an event; consumers drop them by message-id.
func TestAMQPRelayCutMidStream(t *testing.T) {
	t.Parallel()
	rabbit := newRabbitEnv(t, "outbox.orders.*")
	e := newRelayEnv(t, nil)
	keys := []string{"a", "b", "c", "d", "e", "f", "g", "h", "i", "j"}
	const revs = 20
	e.emit(t, "orders", keys, revs)
	s := openSink(t, rabbit.url(nil))

	// The first relay has a connection of its own, closed under it once
	// some events are published.
	conn, err := grpc.NewClient(e.srv.Addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	r1, err := relay.NewRunner(relay.Config{Conn: conn, Publisher: s, MaxInFlight: 4, DrainTimeout: 100 * time.Millisecond, Logger: servertest.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = r1.Run(ctx) }()
	e.waitPublished(t, 40)
	conn.Close()
	cancel()
	<-done

	e.run(t, s)
	e.waitPublished(t, len(keys)*revs)

	first := map[string]bool{}
	var got []struct {
		key, id string
		rev     int64
	}
	n := 0
	for {
		d, ok, err := rabbit.ch.Get(rabbit.queue, true)
		if err != nil {
			t.Fatal(err)
		}
		if !ok {
			break
		}
		n++
		if first[d.MessageId] {
			continue // a later copy
		}
		first[d.MessageId] = true
		rev, _ := strconv.ParseInt(d.Headers[sink.HeaderRevision].(string), 10, 64)
		got = append(got, struct {
			key, id string
			rev     int64
		}{d.Headers[sink.HeaderAggregateKey].(string), d.MessageId, rev})
	}
	t.Logf("%d messages for %d events", n, len(keys)*revs)
	checkOrder(t, keys, revs, got)
}

// An event over the broker's largest message parks its aggregate at once
// (a permanent nack, not --max-failures retries), with the sizes in the
// reason, while other aggregates go on. Kafka's broker (kfake, with
// message.max.bytes lowered to 4 KiB) refuses the record; the sink's own
// max_bytes is left at its default, so the refusal is the broker's.
func TestKafkaTooLargeEventParksThroughRunner(t *testing.T) {
	t.Parallel()
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(3, "outbox.orders"),
		kfake.BrokerConfigs(map[string]string{"message.max.bytes": "4096"}))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	e := newRelayEnv(t, func(c *server.Config) {
		// Only a permanent nack can park it within the test's wait.
		c.BackoffBase, c.BackoffCap, c.MaxFailures = time.Second, 5*time.Second, 100
	})
	keys := []string{"a", "b", "c"}
	e.emit(t, "orders", keys, 2)
	for rev := 1; rev <= 2; rev++ {
		if _, err := client.Emit(context.Background(), e.pool, client.Event{
			Stream: "orders", AggregateKey: "big", Type: "Changed",
			Payload: json.RawMessage(`"` + incompressible(8192) + `"`),
		}); err != nil {
			t.Fatal(err)
		}
	}
	e.run(t, openSink(t, kafkaSinkURL(c, nil)))
	e.waitPublished(t, len(keys)*2)

	agg := e.waitParked(t, "orders", "big")
	if agg.GetFailures() != 1 || agg.GetDeliveredRevision() != 0 {
		t.Errorf("parked after %d failures with revision %d delivered; want 1 failure and nothing delivered", agg.GetFailures(), agg.GetDeliveredRevision())
	}
	reason := agg.GetLastError() + " " + agg.GetParkedReason()
	for _, want := range []string{"max_bytes", "MESSAGE_TOO_LARGE", "uncompressed_bytes="} {
		if !strings.Contains(reason, want) {
			t.Errorf("parked aggregate's reason %q does not mention %q", reason, want)
		}
	}
	for _, r := range consume(t, c, len(keys)*2, "outbox.orders") {
		if string(r.Key) == "big" {
			t.Errorf("the too-large event reached the topic")
		}
	}
}

// incompressible returns n bytes of random base32 text, so that the
// Kafka client's compression cannot shrink a record under a limit.
func incompressible(n int) string {
	var b strings.Builder
	for b.Len() < n {
		b.WriteString(rand.Text())
	}
	return b.String()[:n]
}
