package sink_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/outboxd/outboxd/relay/sink"
)

// TestOpenRejectsBadURLs checks that configuration mistakes are reported
// before any connection attempt (port 1 would refuse one anyway), wrap
// ErrInvalidURL and name the URL.
func TestOpenRejectsBadURLs(t *testing.T) {
	t.Parallel()
	const h = "nats://127.0.0.1:1"
	cases := []struct{ url, want string }{
		{"", "missing scheme"},
		{"127.0.0.1:4222", "cannot parse"},
		{"nats://h:4222/%zz", "cannot parse"},
		{"mqtt://broker:1883", `unknown scheme "mqtt"`},
		{"stdout://somewhere", "no host or path"},
		{"stdout://?pretty=1", `unknown parameter "pretty"`},
		{"nats://", "want nats://host:port"},
		{"nats:127.0.0.1:4222", "want nats://host:port"},
		{h + "/path", "unexpected path"},
		{h + "?subjet=x.{stream}", `unknown parameter "subjet"`},
		{h + "?stream=A&stream=B", "given 2 times"},
		{h + "?subject=", "empty"},
		{h + "?subject=outbox..{stream}", "empty token"},
		{h + "?subject=outbox.{stream}.", "empty token"},
		{h + "?subject=outbox.{nope}", "placeholder"},
		{h + "?subject=outbox.key-{aggregate_key}", "placeholder"},
		{h + "?subject={stream}.x", "first token must be literal"},
		{h + "?subject=outbox.*", "wildcards"},
		{h + "?subject=outbox.>", "wildcards"},
		{h + "?subject=out%20box.{stream}", "printable ASCII"},
		{h + "?subject=$JS.{stream}", "reserved"},
		{h + "?subject=_INBOX.{stream}", "reserved"},
		{h + "?stream=a.b", "stream name"},
		{h + "?stream=", "stream name is empty"},
		{h + "?create=maybe", "create="},
		{h + "?duplicates=0s", "must be positive"},
		{h + "?duplicates=2", "duration"},
		{h + "?timeout=-1s", "must be positive"},
		{h + "?timeout=soon", "duration"},
		{"amqp://", "want amqp://"},
		{"amqp://127.0.0.1:1/", `missing parameter "exchange"`},
		{"amqp://127.0.0.1:1/?exchange=x&routing_kye=a", `unknown parameter "routing_kye"`},
		{"amqp://127.0.0.1:1/?exchange=x.{nope}", "exchange="},
		{"amqp://127.0.0.1:1/?exchange=x&routing_key=a..b", "routing_key="},
		{"amqp://127.0.0.1:1/?exchange=x&routing_key=a.k-{aggregate_key}", "placeholder"},
		{"amqp://127.0.0.1:1/?exchange=x&timeout=0s", "timeout="},
		{"amqp://127.0.0.1:1/?exchange=x&queue=q", "need declare=true"},
		{"amqp://127.0.0.1:1/?exchange=x&declare=yes", "declare="},
		{"amqp://127.0.0.1:1/?exchange=&declare=true", "named exchange"},
		{"amqp://127.0.0.1:1/?exchange=x.{stream}&declare=true", "named exchange"},
		{"amqp://127.0.0.1:1/?exchange=x&declare=true&binding_key=a", "binding_key= needs queue="},
		{"amqp://127.0.0.1:1/?exchange=x&declare=true&queue=amq.q", "reserved"},
		{"amqp://127.0.0.1:1/?exchange=x&declare=true&queue=q&binding_key=" + strings.Repeat("k", 256), "binding_key: at most 255 bytes"},
		{"amqp://127.0.0.1:1/?exchange=" + strings.Repeat("x", 256), "longer than 255 bytes"},
		{"amqps://127.0.0.1:1/?exchange=x&timeout=soon", "timeout="},
		{"redis://", "want redis://"},
		{"redis://127.0.0.1:1/0?stream=", "stream="},
		{"redis://127.0.0.1:1/0?stream=a.{nope}", "stream="},
		{"redis://127.0.0.1:1/0?maxlen=0", "maxlen="},
		{"redis://127.0.0.1:1/0?maxlen=~100", "maxlen="},
		{"redis://127.0.0.1:1/0?timeout=1", "timeout="},
		{"redis://127.0.0.1:1/0?max_len=1", `unknown parameter "max_len"`},
		{"redis://127.0.0.1:1/x", "invalid"},
		{"https://127.0.0.1:1/hook", `missing parameter "secret_file"`},
		{"https://127.0.0.1:1/hook?secret_file=", `missing parameter "secret_file"`},
		{"http://127.0.0.1:1/hook?token=abc", `unknown parameter "token"`},
		{"https://", "want https://"},
		{"kafka://", "want kafka://"},
		{"kafka://127.0.0.1", "want host:port"},
		{"kafka://127.0.0.1:1,b", "cannot parse"},
		{"kafka://127.0.0.1:1,:2", "want host:port"},
		{"kafka://127.0.0.1:1?timeout=500ms", "at least 1s"},
		{"kafka://127.0.0.1:1/x", "unexpected path"},
		{"kafka://127.0.0.1:1?topic=out%20box", "printable ASCII"},
		{"kafka://127.0.0.1:1?topic=a%2Bb.{stream}", "Kafka topic takes only"},
		{"kafka://127.0.0.1:1?topic=a.{nope}", "topic="},
		{"kafka://127.0.0.1:1?max_bytes=1", "max_bytes="},
		{"kafka://127.0.0.1:1?tls=maybe", "tls="},
		{"kafka://127.0.0.1:1?acks=1", `unknown parameter "acks"`},
		{"kafka://127.0.0.1:1?client_id=relay%201", "client_id="},
	}
	for _, c := range cases {
		s, err := sink.Open(context.Background(), c.url, sink.Options{})
		if err == nil {
			_ = s.Close()
			t.Errorf("Open(%q) succeeded, want an error", c.url)
			continue
		}
		if !errors.Is(err, sink.ErrInvalidURL) {
			t.Errorf("Open(%q) error %q does not wrap ErrInvalidURL", c.url, err)
		}
		if !strings.Contains(err.Error(), c.want) {
			t.Errorf("Open(%q) error %q, want it to mention %q", c.url, err, c.want)
		}
		if c.url != "" && !strings.Contains(err.Error(), strings.SplitN(c.url, "?", 2)[0]) {
			t.Errorf("Open(%q) error %q does not name the URL", c.url, err)
		}
	}
}

func TestOpenRedactsCredentials(t *testing.T) {
	t.Parallel()
	for _, u := range []string{
		"nats://alice:s3cret@127.0.0.1:1?bogus=1",
		"nats://s3cret@127.0.0.1:1?bogus=1",   // a NATS token
		"nats://alice:s3cret@127.0.0.1:1",     // connection refused
		"nats://alice:s3cret@127.0.0.1:1/%zz", // unparseable
		"nats://s3cret@127.0.0.1:1/%zz",
		"amqp://alice:s3cret@127.0.0.1:1/?bogus=1",
		"amqp://alice:s3cret@127.0.0.1:1/?exchange=x", // connection refused
		"redis://alice:s3cret@127.0.0.1:1/0?bogus=1",
		"redis://alice:s3cret@127.0.0.1:1/x",
		"https://alice:s3cret@127.0.0.1:1/hook?secret_file=/x",
		"kafka://alice:s3cret@127.0.0.1:1",
	} {
		s, err := sink.Open(context.Background(), u, sink.Options{})
		if err == nil {
			_ = s.Close()
			t.Fatalf("Open(%q) succeeded", u)
		}
		if strings.Contains(err.Error(), "s3cret") {
			t.Errorf("Open(%q) error leaks the secret: %v", u, err)
		}
	}
}

func TestOpenConnectFailureIsNotInvalidURL(t *testing.T) {
	t.Parallel()
	for _, u := range []string{"nats://127.0.0.1:1", "amqp://127.0.0.1:1/?exchange=x"} {
		_, err := sink.Open(context.Background(), u, sink.Options{})
		if err == nil {
			t.Fatalf("Open(%q) against a closed port succeeded", u)
		}
		if errors.Is(err, sink.ErrInvalidURL) {
			t.Errorf("connection failure %q wraps ErrInvalidURL", err)
		}
		if !strings.Contains(err.Error(), strings.SplitN(u, "?", 2)[0]) {
			t.Errorf("error %q does not name the URL", err)
		}
	}
}

// The publish spans' messaging.system uses the OpenTelemetry conventions'
// names where they have one (rabbitmq for AMQP), whatever the scheme's case.
func TestMessagingSystem(t *testing.T) {
	t.Parallel()
	for u, want := range map[string]string{
		"amqp://h:5672/?exchange=x":  "rabbitmq",
		"amqps://h:5671/?exchange=x": "rabbitmq",
		"AMQP://h:5672/?exchange=x":  "rabbitmq",
		"nats://h:4222":              "nats",
		"kafka://h:9092":             "kafka",
		"rediss://h:6380/0":          "redis",
		"https://h/hook":             "webhook",
		"stdout://":                  "stdout",
		"mqtt://h:1883":              "",
		"%zz://unparseable":          "",
	} {
		if got := sink.MessagingSystem(u); got != want {
			t.Errorf("MessagingSystem(%q) = %q, want %q", u, got, want)
		}
	}
}

// A URL that url.Parse refuses is still redacted before a log or an error
// names it: everything between the scheme and the last '@' of the
// authority (a password may hold an '@'), which ends at the first '/', '?'
// or '#', or with the URL.
func TestRedactHidesTheCredentialsOfAnUnparseableURL(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ raw, want string }{
		{"nats://alice:s3@cret@127.0.0.1:1/%zz", "nats://xxxxx@127.0.0.1:1/%zz"},
		{"nats://s3cret@127.0.0.%zz:1", "nats://xxxxx@127.0.0.%zz:1"},
		{"nats://s3cret@127.0.0.%zz:1#a@b", "nats://xxxxx@127.0.0.%zz:1#a@b"},
		{"nats://127.0.0.%zz:1/a@b", "nats://127.0.0.%zz:1/a@b"},
	} {
		if got := sink.Redact(tc.raw); got != tc.want {
			t.Errorf("Redact(%q) = %q, want %q", tc.raw, got, tc.want)
		}
	}
}
