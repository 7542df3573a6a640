package relay

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/outboxd/outboxd/internal/auth"
	"github.com/outboxd/outboxd/internal/servertest"
)

const (
	relayToken   = "relay-token-0123456789abcdef"
	adminToken   = "admin-token-0123456789abcdef"
	unknownToken = "unknown-token-0123456789abcd"
)

// newAuthEnv runs a replica behind the auth interceptors with a relay token
// and an admin-only token.
func newAuthEnv(t *testing.T) *env {
	t.Helper()
	file := filepath.Join(t.TempDir(), "tokens")
	if err := os.WriteFile(file, []byte("relay relay "+relayToken+"\nops admin "+adminToken+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	a, err := auth.New(auth.Config{File: file})
	if err != nil {
		t.Fatal(err)
	}
	return newEnv(t, servertest.Options{ServerOptions: []grpc.ServerOption{
		grpc.ChainUnaryInterceptor(a.UnaryServerInterceptor()),
		grpc.ChainStreamInterceptor(a.StreamServerInterceptor()),
	}})
}

// dialWithTokens connects presenting the relay token, except on the unary
// method named by method (and for Ack, its AckStream), which presents token
// instead: the server's own authentication then refuses that RPC alone
// while the Subscribe stream goes on.
func (e *env) dialWithTokens(t *testing.T, method, token string) *grpc.ClientConn {
	t.Helper()
	bearer := func(ctx context.Context, tok string) context.Context {
		return metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+tok)
	}
	return e.dial(t,
		grpc.WithChainUnaryInterceptor(func(ctx context.Context, m string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
			tok := relayToken
			if strings.HasSuffix(m, "/"+method) {
				tok = token
			}
			return invoker(bearer(ctx, tok), m, req, reply, cc, opts...)
		}),
		grpc.WithChainStreamInterceptor(func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, m string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
			tok := relayToken
			if strings.HasSuffix(m, "/"+method+"Stream") {
				tok = token // acks go on an AckStream
			}
			return streamer(bearer(ctx, tok), desc, cc, m, opts...)
		}),
	)
}

// When the server refuses the relay's credentials on Ack, Nack or
// ExtendLease (a revoked or re-scoped token), Run returns an error naming
// the RPC and the code instead of retrying forever with no other ack sent.
func TestRunnerStopsWhenCredentialsAreRefused(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		method string
		token  string
		code   codes.Code
	}{
		{"Ack", unknownToken, codes.Unauthenticated},
		{"Ack", adminToken, codes.PermissionDenied},
		{"Nack", unknownToken, codes.Unauthenticated},
		{"Nack", adminToken, codes.PermissionDenied},
		{"ExtendLease", unknownToken, codes.Unauthenticated},
		{"ExtendLease", adminToken, codes.PermissionDenied},
	} {
		t.Run(tc.method+"/"+tc.code.String(), func(t *testing.T) {
			t.Parallel()
			e := newAuthEnv(t)
			ids := []string{e.emit(t, "orders", "a"), e.emit(t, "orders", "b")}
			pub := newPublisher()
			cfg := Config{Conn: e.dialWithTokens(t, tc.method, tc.token), Publisher: pub}
			switch tc.method {
			case "Nack":
				pub.fail = errors.New("broker says no")
			case "ExtendLease":
				pub.block = make(chan struct{}) // never released: the publish outlives its lease
				cfg.LeaseTTL = time.Second
			}
			run := start(t, cfg, hooks{})
			err := waitSignal(t, "Run to return after "+tc.method+" was refused", run.done)
			run.done <- err // for the cleanup
			if status.Code(err) != tc.code || !strings.Contains(err.Error(), tc.method+" refused") {
				t.Fatalf("Run returned %v, want %s naming %s", err, tc.code, tc.method)
			}
			for _, id := range ids {
				if e.published(t, id) {
					t.Errorf("event %s marked published though every ack was refused", id)
				}
			}
		})
	}
}

// Subscribe refused for the relay's credentials ends Run too, as before.
func TestRunnerStopsWhenSubscribeIsRefused(t *testing.T) {
	t.Parallel()
	e := newAuthEnv(t)
	run := start(t, Config{Conn: e.dialWithTokens(t, "none", relayToken), Publisher: newPublisher(), Streams: []string{"Bad Name"}}, hooks{})
	err := waitSignal(t, "Run to return", run.done)
	run.done <- err
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "Subscribe refused") {
		t.Fatalf("Run returned %v, want InvalidArgument naming Subscribe", err)
	}
}
