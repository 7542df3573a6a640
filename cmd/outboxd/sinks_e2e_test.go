package main_test

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/outboxd/outboxd/internal/testdb"
)

// Every sink end to end through the binaries: `outboxd serve` and `outboxd
// relay --sink URL` as processes against the real broker (kfake, in this
// test process, for Kafka; an httptest receiver for webhooks). Half the
// events exist before the relay starts; the relay is SIGKILLed once some
// are published, the other half is emitted, and a new relay finishes.
// Nothing may be lost, each aggregate's first copies must be in revision
// order, and every duplicate must equal its first copy. One helper,
// relayKilledMidStream, runs the scenario; each sink supplies only its URL
// and a reader of what its broker holds.

const (
	e2eAggregates = 40
	e2eRevisions  = 10 // per aggregate, half before the kill, half after
)

// brokerMsg is one message as its broker holds it.
type brokerMsg struct {
	id   string // the event id
	key  string // the aggregate key
	rev  int
	body string
}

// relayKilledMidStream runs the scenario against sinkURL; read returns
// every message the broker holds once all events are published, in the
// broker's order for each aggregate.
func relayKilledMidStream(t *testing.T, sinkURL string, read func(t *testing.T, total int) []brokerMsg) {
	t.Helper()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	addr := freeAddr(t)
	half := e2eRevisions / 2
	if err := emitRounds(pool, 1, half, e2eAggregates); err != nil {
		t.Fatal(err)
	}
	start(t, "serve", "--database-url", url, "--listen", addr, "--http-listen", "", "--log-level", "warn")
	relay := func() *process {
		return start(t, "relay", "--server", addr, "--sink", sinkURL, "--max-in-flight", "8", "--log-level", "warn")
	}
	first := relay()
	waitPublished(t, pool, 20)
	first.signal(os.Kill)
	var atKill int64
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM outbox.event WHERE published_at IS NOT NULL`).Scan(&atKill); err != nil {
		t.Fatal(err)
	}
	t.Logf("relay killed with %d of %d events published", atKill, e2eAggregates*half)
	if err := emitRounds(pool, half+1, e2eRevisions, e2eAggregates); err != nil {
		t.Fatal(err)
	}
	relay()
	total := e2eAggregates * e2eRevisions
	waitPublished(t, pool, int64(total))
	verifyBroker(t, read(t, total), total)
}

// verifyBroker checks msgs hold total distinct events, first copies of
// each aggregate in revision order 1..n, and duplicates equal to their
// first copy.
func verifyBroker(t *testing.T, msgs []brokerMsg, total int) {
	t.Helper()
	first := map[string]string{}
	last := map[string]int{}
	duplicates := 0
	for _, m := range msgs {
		if b, ok := first[m.id]; ok {
			duplicates++
			if b != m.body {
				t.Errorf("duplicate of %s differs: %q, first %q", m.id, m.body, b)
			}
			continue
		}
		first[m.id] = m.body
		if m.rev != last[m.key]+1 {
			t.Errorf("%s: first copy of revision %d after %d", m.key, m.rev, last[m.key])
		}
		last[m.key] = m.rev
	}
	t.Logf("broker: %d messages, %d events, %d duplicates", len(msgs), len(first), duplicates)
	if len(first) != total {
		t.Errorf("broker holds %d of %d events", len(first), total)
	}
}

// unique names this test's broker objects.
func unique(kind string) string {
	return fmt.Sprintf("e2e_%s_%d", kind, time.Now().UnixNano())
}

func TestRelayKilledMidStreamNATS(t *testing.T) {
	t.Parallel()
	js, streamName, prefix := jetStreamSink(t, "KILL")
	sinkURL := fmt.Sprintf("%s?stream=%s&subject=%s.{stream}.{aggregate_key}", natsURL(), streamName, prefix)
	relayKilledMidStream(t, sinkURL, func(t *testing.T, total int) []brokerMsg {
		ctx := t.Context()
		s, err := js.Stream(ctx, streamName)
		if err != nil {
			t.Fatal(err)
		}
		info, err := s.Info(ctx)
		if err != nil {
			t.Fatal(err)
		}
		cons, err := s.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{})
		if err != nil {
			t.Fatal(err)
		}
		var out []brokerMsg
		for len(out) < int(info.State.Msgs) {
			batch, err := cons.Fetch(int(info.State.Msgs)-len(out), jetstream.FetchMaxWait(10*time.Second))
			if err != nil {
				t.Fatal(err)
			}
			n := len(out)
			for m := range batch.Messages() {
				h := m.Headers()
				rev, _ := strconv.Atoi(h.Get("Outbox-Revision"))
				out = append(out, brokerMsg{id: h.Get("Nats-Msg-Id"), key: h.Get("Outbox-Aggregate-Key"), rev: rev, body: string(m.Data())})
			}
			if batch.Error() != nil || len(out) == n {
				t.Fatalf("read %d of %d messages: %v", len(out), info.State.Msgs, batch.Error())
			}
		}
		return out
	})
}

func TestRelayKilledMidStreamRabbitMQ(t *testing.T) {
	t.Parallel()
	server := envOr("AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
	conn, err := amqp.Dial(server)
	if err != nil {
		t.Fatalf("connect to RabbitMQ at %s (or set AMQP_URL): %v", server, err)
	}
	t.Cleanup(func() { conn.Close() })
	ch, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	name := unique("amqp")
	if err := ch.ExchangeDeclare(name, "topic", false, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ch.ExchangeDelete(name, false, false) })
	if _, err := ch.QueueDeclare(name, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = ch.QueueDelete(name, false, false, false) })
	if err := ch.QueueBind(name, "#", name, false, nil); err != nil {
		t.Fatal(err)
	}
	u, _ := url.Parse(server)
	u.RawQuery = url.Values{"exchange": {name}}.Encode()
	relayKilledMidStream(t, u.String(), func(t *testing.T, total int) []brokerMsg {
		// Every acked event was confirmed, so it is in the queue by now.
		var out []brokerMsg
		for {
			d, ok, err := ch.Get(name, true)
			if err != nil {
				t.Fatal(err)
			}
			if !ok {
				return out
			}
			rev, _ := strconv.Atoi(fmt.Sprint(d.Headers["Outbox-Revision"]))
			out = append(out, brokerMsg{id: d.MessageId, key: fmt.Sprint(d.Headers["Outbox-Aggregate-Key"]), rev: rev, body: string(d.Body)})
		}
	})
}

func TestRelayKilledMidStreamRedis(t *testing.T) {
	t.Parallel()
	server := envOr("REDIS_URL", "redis://127.0.0.1:6379/0")
	opts, err := redis.ParseURL(server)
	if err != nil {
		t.Fatal(err)
	}
	c := redis.NewClient(opts)
	t.Cleanup(func() { c.Close() })
	prefix := unique("redis")
	key := prefix + ".orders"
	t.Cleanup(func() { c.Del(context.Background(), key) })
	relayKilledMidStream(t, server+"?stream="+prefix+".{stream}", func(t *testing.T, total int) []brokerMsg {
		entries, err := c.XRange(t.Context(), key, "-", "+").Result()
		if err != nil {
			t.Fatal(err)
		}
		out := make([]brokerMsg, 0, len(entries))
		for _, e := range entries {
			rev, _ := strconv.Atoi(fmt.Sprint(e.Values["revision"]))
			out = append(out, brokerMsg{id: fmt.Sprint(e.Values["event_id"]), key: fmt.Sprint(e.Values["key"]), rev: rev, body: fmt.Sprint(e.Values["payload"])})
		}
		return out
	})
}

// Kafka through kfake in this process, with CloudEvents in binary mode:
// the record keeps the Outbox-* headers and carries ce_id too.
func TestRelayKilledMidStreamKafka(t *testing.T) {
	t.Parallel()
	topic := unique("kafka")
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(3, topic))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	sinkURL := "kafka://" + strings.Join(c.ListenAddrs(), ",") + "?cloudevents=binary&topic=" + topic
	relayKilledMidStream(t, sinkURL, func(t *testing.T, total int) []brokerMsg {
		cl, err := kgo.NewClient(kgo.SeedBrokers(c.ListenAddrs()...), kgo.ConsumeTopics(topic),
			kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
		if err != nil {
			t.Fatal(err)
		}
		defer cl.Close()
		// Every acked record is on every replica, so reading until each
		// partition's high watermark sees them all.
		ends := map[int32]int64{}
		adm, err := kgo.NewClient(kgo.SeedBrokers(c.ListenAddrs()...))
		if err != nil {
			t.Fatal(err)
		}
		defer adm.Close()
		for p := range int32(3) {
			ends[p] = highWatermark(t, adm, topic, p)
		}
		ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
		defer cancel()
		read := map[int32]int64{}
		var out []brokerMsg
		for done := false; !done; {
			f := cl.PollFetches(ctx)
			if ctx.Err() != nil {
				t.Fatalf("read %d records: %v", len(out), ctx.Err())
			}
			f.EachError(func(tp string, p int32, err error) { t.Fatalf("fetch %s/%d: %v", tp, p, err) })
			for _, r := range f.Records() {
				h := map[string]string{}
				for _, x := range r.Headers {
					h[x.Key] = string(x.Value)
				}
				if h["ce_id"] != h["Outbox-Event-Id"] || h["ce_subject"] != string(r.Key) {
					t.Errorf("record %s: ce_id %q, ce_subject %q", h["Outbox-Event-Id"], h["ce_id"], h["ce_subject"])
				}
				rev, _ := strconv.Atoi(h["Outbox-Revision"])
				out = append(out, brokerMsg{id: h["Outbox-Event-Id"], key: string(r.Key), rev: rev, body: string(r.Value)})
				read[r.Partition] = r.Offset + 1
			}
			done = true
			for p, end := range ends {
				if read[p] < end {
					done = false
				}
			}
		}
		return out
	})
}

// highWatermark asks the cluster for a partition's end offset.
func highWatermark(t *testing.T, cl *kgo.Client, topic string, partition int32) int64 {
	t.Helper()
	req := kmsg.NewPtrListOffsetsRequest()
	rt := kmsg.NewListOffsetsRequestTopic()
	rt.Topic = topic
	rp := kmsg.NewListOffsetsRequestTopicPartition()
	rp.Partition, rp.Timestamp = partition, -1 // -1: the latest offset
	rt.Partitions = append(rt.Partitions, rp)
	req.Topics = append(req.Topics, rt)
	resp, err := req.RequestWith(t.Context(), cl)
	if err != nil {
		t.Fatal(err)
	}
	p := resp.Topics[0].Partitions[0]
	if p.ErrorCode != 0 {
		t.Fatalf("list offsets of %s/%d: error code %d", topic, partition, p.ErrorCode)
	}
	return p.Offset
}

// Webhooks over https to an httptest receiver in this process, which
// records each accepted POST in arrival order; the relay trusts the
// receiver's test CA through ca_file.
func TestRelayKilledMidStreamWebhook(t *testing.T) {
	t.Parallel()
	key := make([]byte, 32)
	_, _ = rand.Read(key)
	secret := filepath.Join(t.TempDir(), "whsec")
	if err := os.WriteFile(secret, []byte("whsec_"+base64.StdEncoding.EncodeToString(key)+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	var (
		mu  sync.Mutex
		got []brokerMsg
	)
	srv := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		var ev struct {
			EventID      string          `json:"event_id"`
			AggregateKey string          `json:"aggregate_key"`
			Revision     int             `json:"revision"`
			Payload      json.RawMessage `json:"payload"`
		}
		if err := json.Unmarshal(body, &ev); err != nil || ev.EventID != r.Header.Get("webhook-id") {
			http.Error(w, "bad event", http.StatusBadRequest)
			return
		}
		mu.Lock()
		got = append(got, brokerMsg{id: ev.EventID, key: ev.AggregateKey, rev: ev.Revision, body: string(ev.Payload)})
		mu.Unlock()
		w.WriteHeader(http.StatusNoContent)
	}))
	t.Cleanup(srv.Close)
	ca := filepath.Join(t.TempDir(), "ca.pem")
	if err := os.WriteFile(ca, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw}), 0o600); err != nil {
		t.Fatal(err)
	}
	relayKilledMidStream(t, srv.URL+"/hook?secret_file="+url.QueryEscape(secret)+"&ca_file="+url.QueryEscape(ca), func(t *testing.T, total int) []brokerMsg {
		mu.Lock()
		defer mu.Unlock()
		return append([]brokerMsg(nil), got...)
	})
}

// `outboxd relay --route` serves two sinks from one process: billing to
// one Redis stream family, every other stream to another (the server
// excludes billing from the catch-all). Each event lands in its route's
// sink only.
func TestRelayRoutesByStream(t *testing.T) {
	t.Parallel()
	server := envOr("REDIS_URL", "redis://127.0.0.1:6379/0")
	opts, err := redis.ParseURL(server)
	if err != nil {
		t.Fatal(err)
	}
	c := redis.NewClient(opts)
	t.Cleanup(func() { c.Close() })
	a, b := unique("route_a"), unique("route_b")
	streams := []string{"billing", "orders", "shipping"}
	t.Cleanup(func() {
		for _, s := range streams {
			c.Del(context.Background(), a+"."+s, b+"."+s)
		}
	})
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	const perStream = 30
	if _, err := pool.Exec(context.Background(), `SELECT outbox.emit(s, 'k-' || (i % 5), 'Changed', jsonb_build_object('i', i))
		FROM unnest($1::text[]) s, generate_series(1, $2::int) i ORDER BY i, s`, streams, perStream); err != nil {
		t.Fatal(err)
	}
	addr := freeAddr(t)
	start(t, "serve", "--database-url", url, "--listen", addr, "--http-listen", "", "--log-level", "warn")
	start(t, "relay", "--server", addr, "--log-level", "warn", "--max-in-flight", "4",
		"--route", "billing="+server+"?stream="+a+".{stream}",
		"--route", "*="+server+"?stream="+b+".{stream}")
	waitPublished(t, pool, int64(perStream*len(streams)))
	for _, s := range streams {
		want := map[string]int64{a: 0, b: perStream}
		if s == "billing" {
			want = map[string]int64{a: perStream, b: 0}
		}
		for prefix, n := range want {
			if got := c.XLen(t.Context(), prefix+"."+s).Val(); got != n {
				t.Errorf("%s.%s holds %d entries, want %d", prefix, s, got, n)
			}
		}
	}
}

// Each --route has its own Subscribe stream and credit: a billing webhook
// that never answers holds --max-in-flight billing events and nothing
// else, and every other stream keeps flowing to its own sink.
func TestRelayRouteStalledSinkHoldsOnlyItsStreams(t *testing.T) {
	t.Parallel()
	server := envOr("REDIS_URL", "redis://127.0.0.1:6379/0")
	opts, err := redis.ParseURL(server)
	if err != nil {
		t.Fatal(err)
	}
	c := redis.NewClient(opts)
	t.Cleanup(func() { c.Close() })
	prefix := unique("route_stall")
	streams := []string{"orders", "shipping"}
	t.Cleanup(func() {
		for _, s := range streams {
			c.Del(context.Background(), prefix+"."+s)
		}
	})
	key := make([]byte, 32)
	_, _ = rand.Read(key)
	secret := filepath.Join(t.TempDir(), "whsec")
	if err := os.WriteFile(secret, []byte("whsec_"+base64.StdEncoding.EncodeToString(key)+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	var (
		mu      sync.Mutex
		waiting int
	)
	release := make(chan struct{})
	firstPost := make(chan struct{})
	stalled := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		waiting++
		if waiting == 1 {
			close(firstPost)
		}
		mu.Unlock()
		select {
		case <-release:
		case <-r.Context().Done():
		}
		http.Error(w, "stalled", http.StatusServiceUnavailable)
	}))
	t.Cleanup(stalled.Close)
	t.Cleanup(func() { close(release) })

	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	const perStream = 30
	// billing first in every round, so a shared credit would be spent on it.
	if _, err := pool.Exec(context.Background(), `SELECT outbox.emit(s, 'k-' || i, 'Changed', jsonb_build_object('i', i))
		FROM generate_series(1, $2::int) i, unnest($1::text[]) WITH ORDINALITY u(s, o) ORDER BY i, o`,
		append([]string{"billing"}, streams...), perStream); err != nil {
		t.Fatal(err)
	}
	addr := freeAddr(t)
	start(t, "serve", "--database-url", url, "--listen", addr, "--http-listen", "", "--log-level", "warn")
	start(t, "relay", "--server", addr, "--log-level", "warn", "--max-in-flight", "2",
		"--route", "billing="+stalled.URL+"/hook?timeout=5m&secret_file="+secret,
		"--route", "*="+server+"?stream="+prefix+".{stream}")
	waitPublished(t, pool, int64(perStream*len(streams)))
	// The billing route may connect after the others are done (the relay
	// can start before the server listens): wait until it holds a POST.
	select {
	case <-firstPost:
	case <-time.After(30 * time.Second):
		t.Fatal("the billing route never posted to its webhook")
	}
	for _, s := range streams {
		if got := c.XLen(t.Context(), prefix+"."+s).Val(); got != perStream {
			t.Errorf("%s.%s holds %d entries, want %d", prefix, s, got, perStream)
		}
	}
	var billing int64
	if err := pool.QueryRow(context.Background(), `SELECT count(*) FROM outbox.event WHERE stream = 'billing' AND published_at IS NOT NULL`).Scan(&billing); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if billing != 0 || waiting == 0 || waiting > 2 {
		t.Errorf("billing: %d published, %d POSTs waiting; want none published and at most --max-in-flight (2) waiting", billing, waiting)
	}
}
