package server_test

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/server"
)

// quiet discards the replica's logs: a fuzz target may not log through f
// while its inputs run.
func quiet(c *server.Config) { c.Logger = slog.New(slog.DiscardHandler) }

// clientCannotMarshal reports whether err is the gRPC client refusing to
// marshal a request because one of its strings is not UTF-8 (proto3 string
// fields must be): the one Internal a fuzzed request may get, and only when
// some input is indeed invalid UTF-8. Internal from the server is a bug.
func clientCannotMarshal(err error, inputs ...string) bool {
	if status.Code(err) != codes.Internal || !strings.Contains(status.Convert(err).Message(), "marshal") {
		return false
	}
	for _, s := range inputs {
		if !utf8.ValidString(s) {
			return true
		}
	}
	return false
}

// FuzzAck sends arbitrary ack items to a real server. Whatever a client
// sends, the server answers (a per-item status, or InvalidArgument for the
// request), never publishes an event without its genuine lease token, and
// keeps serving.
func FuzzAck(f *testing.F) {
	url := testdb.New(f)
	pool := testdb.NewPoolURL(f, url)
	r := startReplica(f, url, quiet)
	ids := emit(f, pool, "orders", "fuzz", 1)
	f.Add(ids[0].String(), "")
	f.Add(ids[0].String(), "v1.garbage")
	f.Add(ids[0].String(), strings.Repeat("A", 200))
	f.Add("not-a-uuid", "v1.AAAA.BBBB")
	f.Add("00000000-0000-0000-0000-000000000000", "\x00\xff")
	f.Fuzz(func(t *testing.T, eventID, token string) {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		res, err := r.Relay.Ack(ctx, &outboxv1.AckRequest{Acks: []*outboxv1.AckItem{{EventId: eventID, LeaseToken: token}}})
		if err != nil {
			switch {
			case status.Code(err) == codes.InvalidArgument:
			case clientCannotMarshal(err, eventID, token):
			default:
				t.Fatalf("Ack(%q, %q): %v", eventID, token, err)
			}
			return
		}
		if got := res.GetResults()[0].GetStatus(); got != outboxv1.AckStatus_ACK_STATUS_INVALID {
			t.Fatalf("Ack(%q, %q) = %v, want INVALID: no fuzzed token is genuine", eventID, token, got)
		}
		if publishedAt(t, pool, ids[0].String()) != nil {
			t.Fatal("a fuzzed ack published the event")
		}
	})
}

// FuzzSubscribeRequest sends arbitrary Subscribe requests: each is either
// refused with InvalidArgument (and field details) or NotFound, or it opens
// a working stream.
func FuzzSubscribeRequest(f *testing.F) {
	url := testdb.New(f)
	pool := testdb.NewPoolURL(f, url)
	r := startReplica(f, url, quiet)
	emit(f, pool, "orders", "fuzz", 1)
	f.Add("relay-1", "orders", uint32(1), int64(30))
	f.Add("", "", uint32(0), int64(-1))
	f.Add("r", "Orders,orders", uint32(1<<31), int64(1<<40))
	f.Add("r\n", "a..b,c", uint32(5), int64(0))
	f.Add("r", "0/x", uint32(1), int64(30)) // a source this server does not serve
	f.Fuzz(func(t *testing.T, relayID, streams string, maxInFlight uint32, ttlSeconds int64) {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		req := &outboxv1.SubscribeRequest{RelayId: relayID, MaxInFlight: maxInFlight, LeaseTtl: &durationpb.Duration{Seconds: ttlSeconds}}
		if streams != "" {
			req.Streams = strings.Split(streams, ",")
		}
		st, err := r.Relay.Subscribe(ctx, req)
		if err == nil {
			var md metadata.MD
			if md, err = st.Header(); err == nil && md == nil {
				_, err = st.Recv() // refused before headers: the status says why
			} else if err == nil && len(md.Get(server.SessionIDHeader)) != 1 {
				t.Fatalf("accepted stream without its session id header: %v", md)
			}
		}
		switch status.Code(err) {
		case codes.InvalidArgument:
			if len(status.Convert(err).Details()) == 0 {
				t.Fatalf("InvalidArgument without field details: %v", err)
			}
		case codes.NotFound: // a stream no event has used
		case codes.OK: // accepted: a working stream, closed by cancel
		case codes.Internal:
			if !clientCannotMarshal(err, append([]string{relayID}, req.Streams...)...) {
				t.Fatalf("Subscribe(%v): %v", req, err)
			}
		default:
			t.Fatalf("Subscribe(%v): %v", req, err)
		}
	})
}
