package sink_test

import (
	"bufio"
	"cmp"
	"context"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/redis/go-redis/v9/maintnotifications"

	"github.com/outboxd/outboxd/relay/sink"
)

func redisURL() string {
	if v := os.Getenv("REDIS_URL"); v != "" {
		return v
	}
	return "redis://127.0.0.1:6379/0"
}

// redisEnv is one test's key prefix on the shared Redis server and a
// client to inspect it; its keys are deleted when the test ends.
type redisEnv struct {
	c      *redis.Client
	prefix string
}

func newRedisEnv(t *testing.T) *redisEnv {
	t.Helper()
	opts, err := redis.ParseURL(redisURL())
	if err != nil {
		t.Fatal(err)
	}
	opts.MaintNotificationsConfig = &maintnotifications.Config{Mode: maintnotifications.ModeDisabled}
	c := redis.NewClient(opts)
	if err := c.Ping(t.Context()).Err(); err != nil {
		c.Close()
		t.Fatalf("connect to Redis at %s (or set REDIS_URL): %v", redisURL(), err)
	}
	e := &redisEnv{c: c, prefix: "t.outbox." + strings.ToLower(rand.Text()[:10])}
	t.Cleanup(func() {
		ctx := context.Background()
		keys, _ := c.Keys(ctx, e.prefix+"*").Result()
		if len(keys) > 0 {
			c.Del(ctx, keys...)
		}
		c.Close()
	})
	return e
}

func (e *redisEnv) url(params map[string]string) string {
	u, err := url.Parse(redisURL())
	if err != nil {
		panic(err)
	}
	q := url.Values{"stream": {e.prefix + ".{stream}"}}
	for k, v := range params {
		q.Set(k, v)
	}
	u.RawQuery = q.Encode()
	return u.String()
}

func (e *redisEnv) entries(t *testing.T, key string) []redis.XMessage {
	t.Helper()
	msgs, err := e.c.XRange(t.Context(), key, "-", "+").Result()
	if err != nil {
		t.Fatal(err)
	}
	return msgs
}

func TestRedisPublishAddsEntry(t *testing.T) {
	t.Parallel()
	e := newRedisEnv(t)
	s := openSink(t, e.url(nil))
	ev := testEvent("0f8fad5b-d9cb-469f-a165-70867728950e")
	if err := s.Publish(t.Context(), ev); err != nil {
		t.Fatalf("Publish: %v", err)
	}
	msgs := e.entries(t, e.prefix+".orders%2Eeu")
	if len(msgs) != 1 {
		t.Fatalf("stream holds %d entries, want 1", len(msgs))
	}
	v := msgs[0].Values
	want := map[string]string{
		sink.RedisFieldEventID:   ev.ID,
		sink.RedisFieldStream:    "orders.eu",
		sink.RedisFieldKey:       "order-42",
		sink.RedisFieldRevision:  "7",
		sink.RedisFieldType:      "OrderPlaced",
		sink.RedisFieldCreatedAt: "2025-03-04T05:06:07.123456789Z",
		sink.RedisFieldPayload:   string(ev.Payload),
	}
	for k, w := range want {
		if v[k] != w {
			t.Errorf("field %s = %#v, want %q", k, v[k], w)
		}
	}
	var h map[string]string
	if err := json.Unmarshal([]byte(v[sink.RedisFieldHeaders].(string)), &h); err != nil || h["X-Tenant"] != "acme" || h["traceparent"] != ev.Headers["traceparent"] {
		t.Errorf("headers field %#v (%v)", v[sink.RedisFieldHeaders], err)
	}

	ev.Headers = nil
	ev.ID = "e2"
	if err := s.Publish(t.Context(), ev); err != nil {
		t.Fatal(err)
	}
	if got := e.entries(t, e.prefix+".orders%2Eeu")[1].Values[sink.RedisFieldHeaders]; got != "{}" {
		t.Errorf("headers of an event without headers = %#v, want {}", got)
	}
}

// maxlen trims approximately: Redis drops whole nodes (100 entries by
// default), so the stream ends up at or a little over maxlen.
func TestRedisMaxLenTrims(t *testing.T) {
	t.Parallel()
	e := newRedisEnv(t)
	s := openSink(t, e.url(map[string]string{"maxlen": "10"}))
	for i := range 250 {
		if err := s.Publish(t.Context(), testEvent("e"+strconv.Itoa(i))); err != nil {
			t.Fatal(err)
		}
	}
	n, err := e.c.XLen(t.Context(), e.prefix+".orders%2Eeu").Result()
	if err != nil {
		t.Fatal(err)
	}
	if n < 10 || n > 150 {
		t.Errorf("stream holds %d entries after 250 adds with maxlen=10 (approximate)", n)
	}
}

// How many entries an approximate trim keeps depends on the server's node
// sizes (stream-node-max-entries, stream-node-max-bytes), so the count
// above cannot tell MAXLEN ~ from an exact MAXLEN, which costs Redis a node
// split per add. The command itself can: MONITOR, on a connection of its
// own, shows it.
func TestRedisMaxLenIsApproximate(t *testing.T) {
	t.Parallel()
	e := newRedisEnv(t)
	s := openSink(t, e.url(map[string]string{"maxlen": "1000"}))
	opts, err := redis.ParseURL(redisURL())
	if err != nil {
		t.Fatal(err)
	}
	conn, err := net.Dial("tcp", opts.Addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
	rd := bufio.NewReader(conn)
	command := func(cmd string) {
		t.Helper()
		if _, err := io.WriteString(conn, cmd+"\r\n"); err != nil {
			t.Fatal(err)
		}
		l, err := rd.ReadString('\n')
		if err != nil {
			t.Fatal(err)
		}
		if l != "+OK\r\n" {
			t.Skipf("%s refused: %q", strings.Fields(cmd)[0], l)
		}
	}
	if opts.Password != "" {
		command(fmt.Sprintf("AUTH %s %s", cmp.Or(opts.Username, "default"), opts.Password))
	}
	command("MONITOR")
	if err := s.Publish(t.Context(), testEvent("e1")); err != nil {
		t.Fatal(err)
	}
	key := strconv.Quote(e.prefix + ".orders%2Eeu")
	for {
		l, err := rd.ReadString('\n')
		if err != nil {
			t.Fatalf("MONITOR showed no XADD to %s: %v", key, err)
		}
		if !strings.Contains(strings.ToUpper(l), `"XADD" `) || !strings.Contains(l, key) {
			continue // another test's command
		}
		if !strings.Contains(strings.ToUpper(l), `"MAXLEN" "~" "1000"`) {
			t.Errorf("XADD sent as %.200s; want MAXLEN ~ 1000", l)
		}
		return
	}
}

func TestRedisPublishErrors(t *testing.T) {
	t.Parallel()
	e := newRedisEnv(t)
	s := openSink(t, e.url(map[string]string{"timeout": "2s"}))
	// A key of another type: Redis refuses the XADD (WRONGTYPE).
	if err := e.c.Set(t.Context(), e.prefix+".orders%2Eeu", "x", 0).Err(); err != nil {
		t.Fatal(err)
	}
	if err := s.Publish(t.Context(), testEvent("e1")); err == nil || !strings.Contains(err.Error(), "WRONGTYPE") {
		t.Errorf("Publish to a string key = %v, want WRONGTYPE", err)
	}
	// Refused by the sink, not by Redis: another stream, which takes
	// entries, gets none.
	noID := testEvent("")
	noID.Stream = "other"
	if err := s.Publish(t.Context(), noID); err == nil {
		t.Error("Publish without an event ID succeeded")
	}
	if n := len(e.entries(t, e.prefix+".other")); n != 0 {
		t.Errorf("Publish without an event ID added %d entries", n)
	}
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	if err := s.Publish(ctx, testEvent("e-cancelled")); err == nil {
		t.Error("Publish with a cancelled context succeeded")
	}
}

// Redis cannot tell a redelivery from a new event: both are appended. The
// consumer's check, shown in the README, is to claim the event ID with
// SET NX (with an expiry longer than outboxd's redelivery horizon) before
// acting, and skip it when the claim fails.
func TestRedisConsumerDeduplicatesByEventID(t *testing.T) {
	t.Parallel()
	e := newRedisEnv(t)
	s := openSink(t, e.url(nil))
	ev := testEvent("7c9e6679-7425-40de-944b-e07fc1f90ae7")
	for attempt := 1; attempt <= 2; attempt++ {
		ev.Attempt = attempt
		if err := s.Publish(t.Context(), ev); err != nil {
			t.Fatal(err)
		}
	}
	msgs := e.entries(t, e.prefix+".orders%2Eeu")
	if len(msgs) != 2 {
		t.Fatalf("stream holds %d entries, want both copies", len(msgs))
	}
	handled := 0
	for _, m := range msgs {
		id := m.Values[sink.RedisFieldEventID].(string)
		first, err := e.c.SetNX(t.Context(), e.prefix+".seen."+id, m.ID, 24*time.Hour).Result()
		if err != nil {
			t.Fatal(err)
		}
		if !first {
			continue // a redelivery: already handled
		}
		handled++
	}
	if handled != 1 {
		t.Errorf("consumer handled the event %d times, want 1", handled)
	}
}

func TestRedisOpenConnectFailure(t *testing.T) {
	t.Parallel()
	s, err := sink.Open(t.Context(), "redis://:s3cret@127.0.0.1:1/0?timeout=1s", sink.Options{})
	if err == nil {
		_ = s.Close()
		t.Fatal("Open against a closed port succeeded")
	}
	if strings.Contains(err.Error(), "s3cret") || !strings.Contains(err.Error(), "redis://") {
		t.Errorf("Open error %q: want the URL named, without its password", err)
	}
}

// throughProxy is e's sink URL with the server reached through a proxy
// the test controls.
func (e *redisEnv) throughProxy(t *testing.T, params map[string]string) (string, *proxy) {
	t.Helper()
	u, err := url.Parse(e.url(params))
	if err != nil {
		t.Fatal(err)
	}
	p := newProxy(t, u.Host)
	u.Host = p.l.Addr().String()
	return u.String(), p
}

// One Publish is one XADD. When the XADD is carried out but its answer is
// lost with the connection, the outcome is unknown to the sink: Publish
// fails, and the runner, not the client, sends the event again. A client
// retry would append the entry twice and report success.
func TestRedisPublishIsOneXADD(t *testing.T) {
	t.Parallel()
	e := newRedisEnv(t)
	u, p := e.throughProxy(t, nil)
	s := openSink(t, u)
	p.loseNextReply()
	if err := s.Publish(t.Context(), testEvent("e1")); err == nil {
		t.Error("Publish whose answer was lost succeeded")
	}
	if n := len(e.entries(t, e.prefix+".orders%2Eeu")); n != 1 {
		t.Errorf("stream holds %d entries after one Publish, want 1 (the XADD ran once)", n)
	}
}

// A Redis that stops answering fails the publish at the sink's timeout,
// not at the client's own read timeout (3s). The timeout also bounds Open's
// dial and PING through the proxy, so it leaves a loaded machine (-race,
// parallel tests) room for those: at 300ms Open failed once in CI.
func TestRedisPublishTimeout(t *testing.T) {
	t.Parallel()
	e := newRedisEnv(t)
	u, p := e.throughProxy(t, map[string]string{"timeout": "1s"})
	s := openSink(t, u)
	p.pause()
	start := time.Now()
	err := s.Publish(t.Context(), testEvent("e1"))
	d := time.Since(start)
	p.resume()
	if err == nil {
		t.Fatal("Publish to a stalled Redis succeeded")
	}
	if d > 2500*time.Millisecond {
		t.Errorf("Publish took %v with timeout=1s", d)
	}
}
