package server_test

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/recovery"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/status"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/auth"
	"github.com/outboxd/outboxd/internal/servertest"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/server"
)

// itemOf is the ack item of delivery d.
func itemOf(d *outboxv1.SubscribeResponse) *outboxv1.AckItem {
	return &outboxv1.AckItem{EventId: d.GetEvent().GetEventId(), LeaseToken: d.GetLeaseToken()}
}

// openAckStream opens an AckStream through client.
func openAckStream(t *testing.T, ctx context.Context, client outboxv1.RelayServiceClient) outboxv1.RelayService_AckStreamClient {
	t.Helper()
	st, err := client.AckStream(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return st
}

// ackOn sends items as one request on st and returns the answer's statuses,
// failing the test unless the answer names the items' events in order.
func ackOn(t *testing.T, st outboxv1.RelayService_AckStreamClient, items ...*outboxv1.AckItem) []outboxv1.AckStatus {
	t.Helper()
	if err := st.Send(&outboxv1.AckStreamRequest{Acks: items}); err != nil {
		t.Fatal(err)
	}
	res, err := st.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if len(res.GetResults()) != len(items) {
		t.Fatalf("%d results for %d acks", len(res.GetResults()), len(items))
	}
	statuses := make([]outboxv1.AckStatus, len(items))
	for i, r := range res.GetResults() {
		if r.GetEventId() != items[i].GetEventId() {
			t.Fatalf("result %d is of event %s, want %s (request order)", i, r.GetEventId(), items[i].GetEventId())
		}
		statuses[i] = r.GetStatus()
	}
	return statuses
}

// streamEnds waits for st's next answer, which must be the end of the
// stream with code and a message holding want.
func streamEnds(t *testing.T, st outboxv1.RelayService_AckStreamClient, code codes.Code, want string) {
	t.Helper()
	_, err := st.Recv()
	if s := status.Convert(err); s.Code() != code || !strings.Contains(s.Message(), want) {
		t.Fatalf("the ack stream answered %v, want it ended with %v saying %q", err, code, want)
	}
}

// Each request on an AckStream is judged as an Ack of its items would be,
// item by item, and answered in request order on the same stream; a
// request an Ack call would refuse as a whole ends the stream with that
// status.
func TestAckStreamAnswersEachRequestAsAck(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	ids := append(emit(t, pool, "orders", "a", 1), emit(t, pool, "orders", "b", 1)...)
	sub := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 2})
	first, second := recv(t, sub), recv(t, sub)
	st := openAckStream(t, ctx, r.Relay)
	// The second event's id with the first one's token: forged.
	forged := &outboxv1.AckItem{EventId: second.GetEvent().GetEventId(), LeaseToken: first.GetLeaseToken()}
	got := ackOn(t, st, itemOf(first), forged)
	if got[0] != outboxv1.AckStatus_ACK_STATUS_PUBLISHED || got[1] != outboxv1.AckStatus_ACK_STATUS_INVALID {
		t.Fatalf("first request answered %v, want PUBLISHED, INVALID", got)
	}
	got = ackOn(t, st, itemOf(first), itemOf(second))
	if got[0] != outboxv1.AckStatus_ACK_STATUS_ALREADY_PUBLISHED || got[1] != outboxv1.AckStatus_ACK_STATUS_PUBLISHED {
		t.Fatalf("second request answered %v, want ALREADY_PUBLISHED, PUBLISHED", got)
	}
	for _, id := range ids {
		if publishedAt(t, pool, id.String()) == nil {
			t.Fatalf("event %s acked on the stream is not published", id)
		}
	}
	if err := st.Send(&outboxv1.AckStreamRequest{}); err != nil {
		t.Fatal(err)
	}
	streamEnds(t, st, codes.InvalidArgument, "acks")
}

// While a replica shuts down, its relay streams wait for their outstanding
// deliveries' acks, and those acks land on an AckStream as by Ack calls
// (an ack refused there would hold the shutdown to its deadline and have
// the event delivered again). Then the replica ends the stream with
// UNAVAILABLE rather than wait for the relay to close it: the gRPC
// server's graceful stop would wait for it, and then close the connections
// (which ends it with a transport error, not this one).
func TestAckStreamTakesAcksWhileTheReplicaStops(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	ids := emit(t, pool, "orders", "a", 1)
	sub := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 1})
	d := recv(t, sub)
	st := openAckStream(t, ctx, r.Relay)
	go r.Close()
	health := healthpb.NewHealthClient(r.Conn)
	waitFor(t, func() int32 {
		res, err := health.Check(ctx, &healthpb.HealthCheckRequest{})
		return b2i(err == nil && res.GetStatus() == healthpb.HealthCheckResponse_NOT_SERVING)
	})
	if got := ackOn(t, st, itemOf(d)); got[0] != outboxv1.AckStatus_ACK_STATUS_PUBLISHED {
		t.Fatalf("the outstanding delivery's ack during the shutdown answered %v", got)
	}
	if publishedAt(t, pool, ids[0].String()) == nil {
		t.Fatal("the event acked during the shutdown is not published")
	}
	streamEnds(t, st, codes.Unavailable, "takes no more acks")
}

// The AckStream of a token the authenticator revokes ends (UNAUTHENTICATED)
// at once, as its Subscribe streams do, although the relay keeps it open:
// a long-lived stream must not keep acking with a token that is gone.
func TestAckStreamOfARevokedTokenEnds(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	file := filepath.Join(t.TempDir(), "tokens")
	if err := os.WriteFile(file, []byte("relay relay "+relayToken+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	a, err := auth.New(auth.Config{File: file})
	if err != nil {
		t.Fatal(err)
	}
	r := servertest.Start(t, url, servertest.Options{Authenticator: a})
	relay := outboxv1.NewRelayServiceClient(dialAs(t, r, relayToken))
	emit(t, pool, "orders", "a", 1)
	sub, err := relay.Subscribe(ctx, &outboxv1.SubscribeRequest{RelayId: "r", MaxInFlight: 1})
	if err != nil {
		t.Fatal(err)
	}
	d := recv(t, sub)
	st := openAckStream(t, ctx, relay)
	if got := ackOn(t, st, itemOf(d)); got[0] != outboxv1.AckStatus_ACK_STATUS_PUBLISHED {
		t.Fatalf("ack answered %v", got)
	}
	if err := os.WriteFile(file, []byte("other relay "+billingToken+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := a.Reload(); err != nil {
		t.Fatal(err)
	}
	streamEnds(t, st, codes.Unauthenticated, "revoked")
}

// panickyAcks serves AckStream with an ack that panics.
type panickyAcks struct {
	outboxv1.UnimplementedRelayServiceServer
}

func (panickyAcks) AckStream(stream outboxv1.RelayService_AckStreamServer) error {
	return server.ServeAckStream(stream, nil, func(context.Context, *outboxv1.AckRequest) (*outboxv1.AckResponse, error) {
		panic("test panic in an ack")
	})
}

// A panic while a request on an AckStream is answered (on the goroutine
// ServeAckStream reads the stream with) reaches the server's recovery as
// one in an Ack call does: the stream ends with INTERNAL, and the process
// goes on (a panic left on that goroutine would end it).
func TestAPanicInAnAckStreamReachesRecovery(t *testing.T) {
	t.Parallel()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	// As internal/app's recovery answers: INTERNAL.
	recovered := recovery.WithRecoveryHandler(func(p any) error { return status.Errorf(codes.Internal, "%v", p) })
	g := grpc.NewServer(grpc.ChainStreamInterceptor(recovery.StreamServerInterceptor(recovered)))
	outboxv1.RegisterRelayServiceServer(g, panickyAcks{})
	go func() { _ = g.Serve(lis) }()
	t.Cleanup(g.Stop)
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	st := openAckStream(t, ctx, outboxv1.NewRelayServiceClient(conn))
	if err := st.Send(&outboxv1.AckStreamRequest{Acks: []*outboxv1.AckItem{{EventId: "x", LeaseToken: "y"}}}); err != nil {
		t.Fatal(err)
	}
	streamEnds(t, st, codes.Internal, "test panic in an ack")
}
