package sink_test

import (
	"context"
	"errors"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/outboxd/outboxd/relay"
	"github.com/outboxd/outboxd/relay/sink"
)

// No Kafka server runs on these machines: the tests use franz-go's
// in-process Kafka (kfake), which speaks the real protocol on loopback,
// with three partitions per topic so that keying matters.
func newKafka(t *testing.T, topics ...string) *kfake.Cluster {
	t.Helper()
	c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(3, topics...))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	return c
}

func kafkaSinkURL(c *kfake.Cluster, params map[string]string) string {
	q := url.Values{}
	for k, v := range params {
		q.Set(k, v)
	}
	return "kafka://" + strings.Join(c.ListenAddrs(), ",") + "?" + q.Encode()
}

// consume reads n records from the topics, from the start.
func consume(t *testing.T, c *kfake.Cluster, n int, topics ...string) []*kgo.Record {
	t.Helper()
	cl, err := kgo.NewClient(kgo.SeedBrokers(c.ListenAddrs()...), kgo.ConsumeTopics(topics...),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	var out []*kgo.Record
	for len(out) < n {
		f := cl.PollFetches(ctx)
		if err := ctx.Err(); err != nil {
			t.Fatalf("read %d of %d records: %v", len(out), n, err)
		}
		f.EachError(func(topic string, p int32, err error) { t.Fatalf("fetch %s/%d: %v", topic, p, err) })
		out = append(out, f.Records()...)
	}
	if len(out) != n {
		t.Fatalf("read %d records, want %d", len(out), n)
	}
	return out
}

func header(r *kgo.Record, k string) string {
	for _, h := range r.Headers {
		if h.Key == k {
			return string(h.Value)
		}
	}
	return ""
}

func TestKafkaRecordKeyHeadersAndTopic(t *testing.T) {
	t.Parallel()
	c := newKafka(t, "outbox.orders.eu")
	s := openSink(t, kafkaSinkURL(c, nil))
	ev := testEvent("0f8fad5b-d9cb-469f-a165-70867728950e")
	ev.RepublishAction = 9
	if err := s.Publish(t.Context(), ev); err != nil {
		t.Fatalf("Publish: %v", err)
	}
	r := consume(t, c, 1, "outbox.orders.eu")[0]
	if string(r.Key) != "order-42" || string(r.Value) != string(ev.Payload) {
		t.Errorf("record key %q value %q", r.Key, r.Value)
	}
	want := map[string]string{
		sink.HeaderEventID:         ev.ID,
		sink.HeaderEventType:       "OrderPlaced",
		sink.HeaderStream:          "orders.eu",
		sink.HeaderAggregateKey:    "order-42",
		sink.HeaderRevision:        "7",
		sink.HeaderCreatedAt:       "2025-03-04T05:06:07.123456789Z",
		sink.HeaderAttempt:         "1",
		sink.HeaderRepublishAction: "9",
		"X-Tenant":                 "acme",
	}
	for k, v := range want {
		if got := header(r, k); got != v {
			t.Errorf("header %s = %q, want %q", k, got, v)
		}
	}
}

// One aggregate's records share a partition, in order; several aggregates
// spread over the partitions.
func TestKafkaAggregateKeepsPartitionAndOrder(t *testing.T) {
	t.Parallel()
	c := newKafka(t, "t.orders")
	s := openSink(t, kafkaSinkURL(c, map[string]string{"topic": "t.{event_type}"}))
	keys := []string{"a", "b", "c", "d", "e", "f", "g", "h"}
	for rev := 1; rev <= 5; rev++ {
		for _, k := range keys {
			ev := testEvent(k + "-" + strconv.Itoa(rev))
			ev.Type, ev.AggregateKey, ev.Revision = "orders", k, int64(rev)
			if err := s.Publish(t.Context(), ev); err != nil {
				t.Fatal(err)
			}
		}
	}
	partition := map[string]int32{}
	last := map[string]int{}
	parts := map[int32]bool{}
	for _, r := range consume(t, c, len(keys)*5, "t.orders") {
		k := string(r.Key)
		if p, ok := partition[k]; ok && p != r.Partition {
			t.Errorf("aggregate %s in partitions %d and %d", k, p, r.Partition)
		}
		partition[k] = r.Partition
		parts[r.Partition] = true
		rev, _ := strconv.Atoi(header(r, sink.HeaderRevision))
		if rev < last[k] {
			t.Errorf("aggregate %s: revision %d after %d within its partition", k, rev, last[k])
		}
		last[k] = rev
	}
	if len(parts) < 2 {
		t.Errorf("8 aggregates all in one partition of 3")
	}
}

// The sink's promise rests on the producer being idempotent with
// acks=all: the cluster sees every produce request ask for all in-sync
// replicas (acks -1), and every batch carry a producer ID and sequence
// numbers (the broker's duplicate check), after an InitProducerID.
func TestKafkaProducerIsIdempotentWithAcksAll(t *testing.T) {
	t.Parallel()
	c := newKafka(t, "outbox.orders.eu")
	var (
		mu       sync.Mutex
		inits    int
		produces []*kmsg.ProduceRequest
	)
	// Observers: not handled, so the cluster answers as usual.
	c.ControlKey(int16(kmsg.InitProducerID), func(kmsg.Request) (kmsg.Response, error, bool) {
		mu.Lock()
		inits++
		mu.Unlock()
		return nil, nil, false
	})
	c.ControlKey(int16(kmsg.Produce), func(req kmsg.Request) (kmsg.Response, error, bool) {
		mu.Lock()
		produces = append(produces, req.(*kmsg.ProduceRequest))
		mu.Unlock()
		return nil, nil, false
	})
	s := openSink(t, kafkaSinkURL(c, nil))
	for i := range 3 {
		if err := s.Publish(t.Context(), testEvent("e-"+strconv.Itoa(i))); err != nil {
			t.Fatal(err)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if inits == 0 {
		t.Error("no InitProducerID request: the producer is not idempotent")
	}
	if len(produces) == 0 {
		t.Fatal("no produce request seen")
	}
	batches := 0
	for _, req := range produces {
		if req.Acks != -1 {
			t.Errorf("produce request with acks %d, want -1 (all in-sync replicas)", req.Acks)
		}
		for _, tp := range req.Topics {
			for _, p := range tp.Partitions {
				var b kmsg.RecordBatch
				if err := b.ReadFrom(p.Records); err != nil {
					t.Fatalf("decode record batch: %v", err)
				}
				batches++
				if b.ProducerID < 0 || b.FirstSequence < 0 {
					t.Errorf("record batch with producer ID %d, sequence %d: not an idempotent write", b.ProducerID, b.FirstSequence)
				}
			}
		}
	}
	if batches == 0 {
		t.Error("no record batch seen")
	}
}

func TestKafkaPublishErrors(t *testing.T) {
	t.Parallel()
	c := newKafka(t, "outbox.orders.order-42")
	s := openSink(t, kafkaSinkURL(c, map[string]string{"topic": "outbox.{stream}.{aggregate_key}", "timeout": "1s", "max_bytes": "2048"}))

	ev := testEvent("e-bad-topic")
	ev.Stream, ev.AggregateKey = "orders", "has space"
	if err := s.Publish(t.Context(), ev); err == nil || !strings.Contains(err.Error(), "not a valid Kafka topic") || !relay.IsPermanent(err) {
		t.Errorf("Publish to an invalid topic = %v", err)
	}
	ev = testEvent("e-missing-topic")
	ev.Stream, ev.AggregateKey = "orders", "nosuch"
	if err := s.Publish(t.Context(), ev); err == nil || relay.IsPermanent(err) {
		t.Errorf("Publish to a topic that does not exist = %v; want an error worth retrying (the topic may be created)", err)
	}
	ev = testEvent("e-large")
	ev.Stream = "orders"
	ev.Payload = []byte(`"` + strings.Repeat("x", 4096) + `"`)
	if err := s.Publish(t.Context(), ev); err == nil || !strings.Contains(err.Error(), "max_bytes") || !relay.IsPermanent(err) {
		t.Errorf("Publish of a record over max_bytes = %v (permanent: %v)", err, relay.IsPermanent(err))
	}
	ev = testEvent("e-reserved")
	ev.Headers = map[string]string{"Outbox-Event-Id": "spoof"}
	if err := s.Publish(t.Context(), ev); err == nil || !relay.IsPermanent(err) {
		t.Errorf("Publish with an Outbox- header = %v (permanent: %v), want a permanent error", err, relay.IsPermanent(err))
	}
}

func TestKafkaOpenConnectFailure(t *testing.T) {
	t.Parallel()
	s, err := sink.Open(t.Context(), "kafka://127.0.0.1:1?timeout=1s", sink.Options{})
	if err == nil {
		_ = s.Close()
		t.Fatal("Open against a closed port succeeded")
	}
	if errors.Is(err, sink.ErrInvalidURL) || !strings.Contains(err.Error(), "kafka://127.0.0.1:1") {
		t.Errorf("Open error %q: want a connection error naming the URL", err)
	}
}
