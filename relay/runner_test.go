package relay

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"net"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/outboxd/outboxd/client"
	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/limits"
	"github.com/outboxd/outboxd/internal/servertest"
)

// NewRunner refuses a Config the server would refuse or that makes no
// sense, naming every field at fault; AckBatchSize above the server's limit
// would otherwise get every full batch refused.
func TestNewRunnerValidatesConfig(t *testing.T) {
	t.Parallel()
	base := func() Config { return Config{Conn: &noConn{}, Publisher: newPublisher()} }
	for _, tc := range []struct {
		name string
		edit func(*Config)
		want []string // substrings of the error; none means valid
	}{
		{"defaults", func(*Config) {}, nil},
		{"largest ack batch", func(c *Config) { c.AckBatchSize = limits.MaxAckItems }, nil},
		{"ack batch over the server's limit", func(c *Config) { c.AckBatchSize = limits.MaxAckItems + 1 }, []string{"Config.AckBatchSize 1001", "1000"}},
		{"negative ack batch", func(c *Config) { c.AckBatchSize = -1 }, []string{"Config.AckBatchSize -1"}},
		{"missing conn and publisher", func(c *Config) { c.Conn, c.Publisher = nil, nil }, []string{"Config.Conn", "Config.Publisher"}},
		{"negatives", func(c *Config) {
			c.MaxInFlight, c.LeaseTTL, c.AckMaxDelay, c.AckRetryTimeout, c.DrainTimeout = -1, -1, -1, -1, -1
		}, []string{"Config.MaxInFlight", "Config.LeaseTTL", "Config.AckMaxDelay", "Config.AckRetryTimeout", "Config.DrainTimeout"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := base()
			tc.edit(&cfg)
			_, err := NewRunner(cfg)
			if len(tc.want) == 0 {
				if err != nil {
					t.Fatalf("NewRunner: %v", err)
				}
				return
			}
			if err == nil {
				t.Fatal("NewRunner accepted the config")
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not mention %q", err, w)
				}
			}
		})
	}
}

// The runner publishes and acks every event, the largest the producer
// contract allows included: a 3 MiB payload (the most
// outbox.settings.max_payload_bytes may be) with 60 KiB of headers, a long
// key and type. It fits in MaxDeliveryBytes, which the runner receives;
// gRPC's default would also do, but not a limit that forgot the payload can
// be raised above its 1 MiB default.
func TestRunnerPublishesTheLargestEvent(t *testing.T) {
	t.Parallel()
	e := newEnv(t, servertest.Options{})
	const maxPayload = 3 << 20
	if _, err := e.pool.Exec(context.Background(), `UPDATE outbox.settings SET max_payload_bytes = $1`, maxPayload); err != nil {
		t.Fatal(err)
	}
	ids := []string{e.emit(t, "orders", "a"), e.emit(t, "orders", "b")}
	// jsonb stores {"s": "..."}: 9 bytes around the string.
	payload := append(append([]byte(`{"s":"`), bytes.Repeat([]byte("x"), maxPayload-9)...), `"}`...)
	big, err := client.Emit(context.Background(), e.pool, client.Event{
		Stream: "orders", AggregateKey: strings.Repeat("k", 1000), Type: strings.Repeat("T", 250),
		Payload: payload, Headers: map[string]string{"h": strings.Repeat("v", 60<<10)},
	})
	if err != nil {
		t.Fatal(err)
	}
	ids = append(ids, big.ID.String())

	pub := newPublisher()
	start(t, Config{Conn: e.srv.Conn, Publisher: pub}, hooks{})
	e.waitPublished(t, ids...)
	for _, id := range ids {
		if n := pub.attemptsOf(id); n != 1 {
			t.Errorf("event %s published %d times, want 1", id, n)
		}
	}
	if limits.MaxDeliveryBytes < maxPayload+1<<20 {
		t.Errorf("MaxDeliveryBytes %d leaves under 1 MiB beside the largest payload", limits.MaxDeliveryBytes)
	}
}

// noConn is a connection that is never used.
type noConn struct{}

func (noConn) Invoke(context.Context, string, any, any, ...grpc.CallOption) error {
	return errors.New("noConn")
}

func (noConn) NewStream(context.Context, *grpc.StreamDesc, string, ...grpc.CallOption) (grpc.ClientStream, error) {
	return nil, errors.New("noConn")
}

// remaining prefers the server's stated duration and falls back to the
// expiry by the database's clock for servers that predate it.
func TestRemainingPrefersStatedDuration(t *testing.T) {
	t.Parallel()
	if got := remaining(durationpb.New(3*time.Second), nil); got != 3*time.Second {
		t.Errorf("stated 3s: got %v", got)
	}
	exp := time.Now().Add(time.Minute)
	if got := remaining(nil, timestamppb.New(exp)); got <= 50*time.Second || got > time.Minute {
		t.Errorf("expiry in 1m, nothing stated: got %v", got)
	}
}

// A stop while the runner is still connecting returns at once: the stream,
// which outlives Run's context while publishes drain, is not open yet. The
// "server" here accepts TCP connections and never answers, so gRPC stays
// connecting for its 20 s connect timeout.
func TestRunnerStopsWhileConnecting(t *testing.T) {
	t.Parallel()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	accepted := make(chan net.Conn, 10)
	go func() {
		for {
			c, err := lis.Accept()
			if err != nil {
				return
			}
			accepted <- c
		}
	}()
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	run := start(t, Config{Conn: conn, Publisher: newPublisher()}, hooks{})
	held := waitSignal(t, "the runner to connect", accepted)
	run.cancel()
	select {
	case err := <-run.done:
		run.done <- err
		if err != nil {
			t.Fatalf("Run: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Error("Run did not return within 5s of its context ending while connecting")
	}
	conn.Close()
	held.Close()
	lis.Close()
}

// A runner whose subscription the server accepted says so at Info, with the
// session id operators see in ListRelays: before any event exists, and so
// also after an outage's warnings, where a relay that only logs failures
// would leave its reader guessing. A runner that names no credit asks for
// DefaultMaxInFlight, well above what a steady pipeline holds, so that
// discovery finds relays with credit to dispatch to rather than leaving
// events to claims.
func TestRunnerLogsItsSubscription(t *testing.T) {
	t.Parallel()
	e := newEnv(t, servertest.Options{})
	log := newRecords(t)
	subscribed := log.watch(slog.LevelInfo, "subscribed")
	start(t, Config{Conn: e.dial(t), Publisher: newPublisher(), RelayID: "logged", Logger: slog.New(log)}, hooks{})
	waitSignal(t, "the runner to log its subscription", subscribed)
	session := log.attr(slog.LevelInfo, "subscribed", "session")
	relays, err := e.srv.Admin.ListRelays(t.Context(), &outboxv1.ListRelaysRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if len(relays.GetRelays()) != 1 || relays.GetRelays()[0].GetSessionId() != session {
		t.Fatalf("the runner logged session %q; ListRelays has %v", session, relays.GetRelays())
	}
	if got := relays.GetRelays()[0].GetMaxInFlight(); got != DefaultMaxInFlight {
		t.Errorf("the runner asked for %d credit, want DefaultMaxInFlight (%d)", got, DefaultMaxInFlight)
	}
}
