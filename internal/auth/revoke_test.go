package auth

import (
	"context"
	"crypto/sha256"
	"errors"
	"net"
	"strings"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
)

// liveRelay keeps each Subscribe stream open, sending one message at once
// and one more per value on pings[relay_id], until the context ends, as
// the real server's session does.
type liveRelay struct {
	outboxv1.UnimplementedRelayServiceServer
	pings map[string]chan struct{}
}

func (l liveRelay) Subscribe(req *outboxv1.SubscribeRequest, stream outboxv1.RelayService_SubscribeServer) error {
	ctx := stream.Context()
	for {
		if err := stream.Send(&outboxv1.SubscribeResponse{}); err != nil {
			return err
		}
		select {
		case <-ctx.Done():
			return status.FromContextError(ctx.Err()).Err()
		case <-l.pings[req.GetRelayId()]:
		}
	}
}

func TestReloadClosesStreamsOfRevokedTokens(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	a, err := New(Config{File: writeFile(t, dir, "tokens",
		"a relay "+relaySecret+"\nb relay "+billingSecret+" streams=billing.*\n"), Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	relay := liveRelay{pings: map[string]chan struct{}{"a": make(chan struct{}), "b": make(chan struct{})}}
	open := serveLive(t, a, relay)
	streamA, streamB := open("a", relaySecret), open("b", billingSecret)

	// a's token is removed; b's is untouched, and a second secret for b is
	// added (rotation), which must not disturb b's stream.
	writeFile(t, dir, "tokens", "b relay "+billingSecret+" streams=billing.*\nb relay "+bothSecret+" streams=billing.*\n")
	if err := a.Reload(); err != nil {
		t.Fatal(err)
	}
	wantRevoked(t, streamA, "a")
	relay.wantOpen(t, "b", streamB)

	// Narrowing b's streams closes its stream too: it was admitted under the
	// wider grant.
	writeFile(t, dir, "tokens", "b relay "+billingSecret+" streams=billing.invoice\n")
	if err := a.Reload(); err != nil {
		t.Fatal(err)
	}
	if _, err := streamB.Recv(); status.Code(err) != codes.Unauthenticated {
		t.Fatalf("stream after its grant changed: %v", err)
	}
	a.streams.mu.Lock()
	n := len(a.streams.m)
	a.streams.mu.Unlock()
	if n != 0 {
		t.Errorf("%d streams still registered", n)
	}
}

// A stream admitted under a set that a reload replaced before the stream
// registered is still caught.
func TestStreamRegisteredAfterRevocation(t *testing.T) {
	t.Parallel()
	a := newFromText(t, "a relay "+relaySecret, nil)
	gone := sha256.Sum256([]byte(billingSecret)) // not in the set
	ctx, cancel := context.WithCancelCause(context.Background())
	defer cancel(nil)
	a.streams.add(a, gone, &Principal{Name: "x", Roles: []Role{RoleRelay}}, cancel)()
	if !errors.Is(context.Cause(ctx), errRevoked) {
		t.Fatalf("cause %v, want errRevoked", context.Cause(ctx))
	}
	ctx2, cancel2 := context.WithCancelCause(context.Background())
	defer cancel2(nil)
	p, _ := a.authenticate(relaySecret)
	unregister := a.streams.add(a, sha256.Sum256([]byte(relaySecret)), p, cancel2)
	if ctx2.Err() != nil {
		t.Fatal("a valid stream was canceled")
	}
	unregister()
	if len(a.streams.m) != 0 {
		t.Fatal("unregister left the stream registered")
	}
}

// serveLive serves liveRelay, guarded by a's stream interceptor, and
// returns a function opening a Subscribe stream as relay id with token; the
// stream has received its first message when it returns.
func serveLive(t *testing.T, a *Authenticator, relay liveRelay) func(id, token string) outboxv1.RelayService_SubscribeClient {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := grpc.NewServer(grpc.ChainStreamInterceptor(a.StreamServerInterceptor()))
	outboxv1.RegisterRelayServiceServer(s, relay)
	done := make(chan struct{})
	go func() { defer close(done); _ = s.Serve(lis) }()
	t.Cleanup(func() { s.Stop(); <-done })
	return func(id, token string) outboxv1.RelayService_SubscribeClient {
		t.Helper()
		st, err := outboxv1.NewRelayServiceClient(dial(t, lis.Addr().String(), token)).
			Subscribe(testCtx(t), &outboxv1.SubscribeRequest{RelayId: id, Streams: []string{"billing.x"}})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := st.Recv(); err != nil {
			t.Fatalf("stream %s: %v", id, err)
		}
		return st
	}
}

// wantRevoked waits for st to end as the stream of name's revoked token.
func wantRevoked(t *testing.T, st outboxv1.RelayService_SubscribeClient, name string) {
	t.Helper()
	_, err := st.Recv()
	if s := status.Convert(err); s.Code() != codes.Unauthenticated || !strings.Contains(s.Message(), `token "`+name+`" was revoked`) {
		t.Fatalf("stream of %q's revoked token: %v, want Unauthenticated naming it", name, err)
	}
}

// wantOpen checks that relay id's stream st is still open: the relay sends
// it one more message, and it arrives.
func (l liveRelay) wantOpen(t *testing.T, id string, st outboxv1.RelayService_SubscribeClient) {
	t.Helper()
	l.pings[id] <- struct{}{}
	if _, err := st.Recv(); err != nil {
		t.Fatalf("stream %s, of a token still valid, was closed: %v", id, err)
	}
}

// Rotation ends with the old line removed while the name lives on under the
// new secret. The streams opened with the old secret must close then: the
// secret is revoked, whatever name still holds a valid one. Streams of the
// new secret stay open.
func TestRemovingTheOldSecretOfARotatedNameClosesItsStreams(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	a, err := New(Config{File: writeFile(t, dir, "tokens",
		"b relay "+billingSecret+" streams=billing.*\nb relay "+bothSecret+" streams=billing.*\n"), Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	relay := liveRelay{pings: map[string]chan struct{}{"old": make(chan struct{}), "new": make(chan struct{})}}
	open := serveLive(t, a, relay)
	oldStream, newStream := open("old", billingSecret), open("new", bothSecret)

	writeFile(t, dir, "tokens", "b relay "+bothSecret+" streams=billing.*\n")
	if err := a.Reload(); err != nil {
		t.Fatal(err)
	}
	wantRevoked(t, oldStream, "b")
	relay.wantOpen(t, "new", newStream)
}

// A stream acts, and is audited, as the name its token had when it opened.
// When a reload gives the same secret (with the same grant) to another name,
// the stream's identity is gone, and so is the stream.
func TestGivingASecretToAnotherNameClosesItsStreams(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	a, err := New(Config{File: writeFile(t, dir, "tokens", "a relay "+relaySecret+"\n"), Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	stream := serveLive(t, a, liveRelay{})("a", relaySecret)

	writeFile(t, dir, "tokens", "c relay "+relaySecret+"\n")
	if err := a.Reload(); err != nil {
		t.Fatal(err)
	}
	if _, err := stream.Recv(); status.Code(err) != codes.Unauthenticated {
		t.Fatalf("stream opened as \"a\" after its secret moved to \"c\": %v, want Unauthenticated", err)
	}
}
