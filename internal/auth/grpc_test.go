package auth

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"io"
	"net"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/reflection"
	rpb "google.golang.org/grpc/reflection/grpc_reflection_v1"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/emptypb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
)

// The token file every gRPC test serves.
var testTokens = strings.Join([]string{
	"relayer relay " + relaySecret,
	"operator admin " + HashToken(adminSecret),
	"both admin,relay " + bothSecret,
	"billing relay " + billingSecret + " streams=billing.*",
	"watcher viewer " + viewerSecret,
}, "\n")

// fakeRelay answers with the caller's principal name, so tests see what the
// handler saw.
type fakeRelay struct {
	outboxv1.UnimplementedRelayServiceServer
}

func callerName(ctx context.Context) string {
	if p, ok := PrincipalFrom(ctx); ok {
		return p.Name
	}
	return "(none)"
}

func (fakeRelay) Ack(ctx context.Context, _ *outboxv1.AckRequest) (*outboxv1.AckResponse, error) {
	return &outboxv1.AckResponse{Results: []*outboxv1.AckResult{{Message: callerName(ctx)}}}, nil
}

func (fakeRelay) Subscribe(req *outboxv1.SubscribeRequest, stream outboxv1.RelayService_SubscribeServer) error {
	ctx := stream.Context()
	var err error
	if len(req.GetStreams()) == 0 {
		err = AuthorizeAllStreams(ctx)
	} else {
		err = AuthorizeStreams(ctx, req.GetStreams()...)
	}
	if err != nil {
		return err
	}
	return stream.Send(&outboxv1.SubscribeResponse{Event: &outboxv1.Event{Stream: callerName(ctx)}})
}

type fakeAdmin struct {
	outboxv1.UnimplementedAdminServiceServer
}

// The read-only methods answer with the caller's name, so a test sees that
// a call got past authorization to the handler, as whom.
func (fakeAdmin) GetLag(ctx context.Context, _ *outboxv1.GetLagRequest) (*outboxv1.GetLagResponse, error) {
	return &outboxv1.GetLagResponse{Streams: []*outboxv1.StreamLag{{Stream: callerName(ctx)}}}, nil
}

func (fakeAdmin) ListRelays(ctx context.Context, _ *outboxv1.ListRelaysRequest) (*outboxv1.ListRelaysResponse, error) {
	return &outboxv1.ListRelaysResponse{Relays: []*outboxv1.Relay{{RelayId: callerName(ctx)}}}, nil
}

func (fakeAdmin) GetAggregate(ctx context.Context, _ *outboxv1.GetAggregateRequest) (*outboxv1.GetAggregateResponse, error) {
	return &outboxv1.GetAggregateResponse{Aggregate: &outboxv1.Aggregate{Stream: callerName(ctx)}}, nil
}

func (fakeAdmin) ListEvents(ctx context.Context, _ *outboxv1.ListEventsRequest) (*outboxv1.ListEventsResponse, error) {
	return &outboxv1.ListEventsResponse{NextPageToken: callerName(ctx)}, nil
}

func (fakeAdmin) ListAggregates(ctx context.Context, _ *outboxv1.ListAggregatesRequest) (*outboxv1.ListAggregatesResponse, error) {
	return &outboxv1.ListAggregatesResponse{NextPageToken: callerName(ctx)}, nil
}

func (fakeAdmin) ListAttempts(ctx context.Context, _ *outboxv1.ListAttemptsRequest) (*outboxv1.ListAttemptsResponse, error) {
	return &outboxv1.ListAttemptsResponse{NextPageToken: callerName(ctx)}, nil
}

func (fakeAdmin) ListOperatorActions(ctx context.Context, _ *outboxv1.ListOperatorActionsRequest) (*outboxv1.ListOperatorActionsResponse, error) {
	return &outboxv1.ListOperatorActionsResponse{NextPageToken: callerName(ctx)}, nil
}

// readOnlyCalls calls each read-only AdminService method and returns the
// caller name the fake answered with.
var readOnlyCalls = map[string]func(context.Context, outboxv1.AdminServiceClient) (string, error){
	outboxv1.AdminService_GetLag_FullMethodName: func(ctx context.Context, c outboxv1.AdminServiceClient) (string, error) {
		r, err := c.GetLag(ctx, &outboxv1.GetLagRequest{})
		if len(r.GetStreams()) == 0 {
			return "", err
		}
		return r.GetStreams()[0].GetStream(), err
	},
	outboxv1.AdminService_ListRelays_FullMethodName: func(ctx context.Context, c outboxv1.AdminServiceClient) (string, error) {
		r, err := c.ListRelays(ctx, &outboxv1.ListRelaysRequest{})
		if len(r.GetRelays()) == 0 {
			return "", err
		}
		return r.GetRelays()[0].GetRelayId(), err
	},
	outboxv1.AdminService_GetAggregate_FullMethodName: func(ctx context.Context, c outboxv1.AdminServiceClient) (string, error) {
		r, err := c.GetAggregate(ctx, &outboxv1.GetAggregateRequest{})
		return r.GetAggregate().GetStream(), err
	},
	outboxv1.AdminService_ListEvents_FullMethodName: func(ctx context.Context, c outboxv1.AdminServiceClient) (string, error) {
		r, err := c.ListEvents(ctx, &outboxv1.ListEventsRequest{})
		return r.GetNextPageToken(), err
	},
	outboxv1.AdminService_ListAggregates_FullMethodName: func(ctx context.Context, c outboxv1.AdminServiceClient) (string, error) {
		r, err := c.ListAggregates(ctx, &outboxv1.ListAggregatesRequest{})
		return r.GetNextPageToken(), err
	},
	outboxv1.AdminService_ListAttempts_FullMethodName: func(ctx context.Context, c outboxv1.AdminServiceClient) (string, error) {
		r, err := c.ListAttempts(ctx, &outboxv1.ListAttemptsRequest{})
		return r.GetNextPageToken(), err
	},
	outboxv1.AdminService_ListOperatorActions_FullMethodName: func(ctx context.Context, c outboxv1.AdminServiceClient) (string, error) {
		r, err := c.ListOperatorActions(ctx, &outboxv1.ListOperatorActionsRequest{})
		return r.GetNextPageToken(), err
	},
}

func (fakeAdmin) Purge(_ *outboxv1.PurgeRequest, stream outboxv1.AdminService_PurgeServer) error {
	return stream.Send(&outboxv1.PurgeResponse{Done: true})
}

// otherService is a service the policy does not know.
var otherService = grpc.ServiceDesc{
	ServiceName: "test.Other",
	HandlerType: (*any)(nil),
	Methods: []grpc.MethodDesc{{
		MethodName: "Ping",
		Handler: func(srv any, ctx context.Context, dec func(any) error, icpt grpc.UnaryServerInterceptor) (any, error) {
			in := new(emptypb.Empty)
			if err := dec(in); err != nil {
				return nil, err
			}
			h := func(context.Context, any) (any, error) { return &emptypb.Empty{}, nil }
			return icpt(ctx, in, &grpc.UnaryServerInfo{Server: srv, FullMethod: "/test.Other/Ping"}, h)
		},
	}},
}

// serve starts a gRPC server on loopback guarded by a, with the outboxd
// services (fakes), health, reflection and an unknown service.
func serve(t *testing.T, a *Authenticator) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := grpc.NewServer(
		grpc.ChainUnaryInterceptor(a.UnaryServerInterceptor()),
		grpc.ChainStreamInterceptor(a.StreamServerInterceptor()),
	)
	outboxv1.RegisterRelayServiceServer(s, fakeRelay{})
	outboxv1.RegisterAdminServiceServer(s, fakeAdmin{})
	healthpb.RegisterHealthServer(s, health.NewServer())
	reflection.Register(s)
	s.RegisterService(&otherService, struct{}{})
	done := make(chan struct{})
	go func() { defer close(done); _ = s.Serve(lis) }()
	t.Cleanup(func() { s.Stop(); <-done })
	return lis.Addr().String()
}

// dial connects without transport security, sending token if it is set.
func dial(t *testing.T, addr, token string) *grpc.ClientConn {
	t.Helper()
	opts := []grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}
	if token != "" {
		opts = append(opts, WithBearerToken(token, true))
	}
	conn, err := grpc.NewClient(addr, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

func testCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// A call made in the test matrix: it returns the principal name the handler
// saw, or "" for handlers that do not report it, and the call's error.
type call struct {
	name string
	do   func(ctx context.Context, conn *grpc.ClientConn) (string, error)
}

var (
	callAck = call{"Ack (unary)", func(ctx context.Context, conn *grpc.ClientConn) (string, error) {
		r, err := outboxv1.NewRelayServiceClient(conn).Ack(ctx, &outboxv1.AckRequest{})
		if err != nil {
			return "", err
		}
		return r.GetResults()[0].GetMessage(), nil
	}}
	callSubscribe = subscribeCall()
	callGetLag    = call{"GetLag (unary)", func(ctx context.Context, conn *grpc.ClientConn) (string, error) {
		_, err := outboxv1.NewAdminServiceClient(conn).GetLag(ctx, &outboxv1.GetLagRequest{})
		return "", err
	}}
	callPurge = call{"Purge (stream)", func(ctx context.Context, conn *grpc.ClientConn) (string, error) {
		st, err := outboxv1.NewAdminServiceClient(conn).Purge(ctx, &outboxv1.PurgeRequest{})
		if err != nil {
			return "", err
		}
		_, err = st.Recv()
		return "", err
	}}
	callHealth = call{"Health.Check", func(ctx context.Context, conn *grpc.ClientConn) (string, error) {
		_, err := healthpb.NewHealthClient(conn).Check(ctx, &healthpb.HealthCheckRequest{})
		return "", err
	}}
	callReflection = call{"reflection", func(ctx context.Context, conn *grpc.ClientConn) (string, error) {
		st, err := rpb.NewServerReflectionClient(conn).ServerReflectionInfo(ctx)
		if err != nil {
			return "", err
		}
		// A server that refuses the stream may do so before this Send, which
		// then fails with io.EOF; the refusal itself comes from Recv.
		err = st.Send(&rpb.ServerReflectionRequest{MessageRequest: &rpb.ServerReflectionRequest_ListServices{}})
		if err != nil && err != io.EOF {
			return "", err
		}
		_, err = st.Recv()
		_ = st.CloseSend()
		return "", err
	}}
	callOther = call{"unknown service", func(ctx context.Context, conn *grpc.ClientConn) (string, error) {
		return "", conn.Invoke(ctx, "/test.Other/Ping", &emptypb.Empty{}, &emptypb.Empty{})
	}}
)

func subscribeCall(streams ...string) call {
	return call{"Subscribe" + strings.Join(streams, ","), func(ctx context.Context, conn *grpc.ClientConn) (string, error) {
		st, err := outboxv1.NewRelayServiceClient(conn).Subscribe(ctx, &outboxv1.SubscribeRequest{Streams: streams})
		if err != nil {
			return "", err
		}
		r, err := st.Recv()
		if err != nil {
			return "", err
		}
		if _, err := st.Recv(); err != io.EOF {
			return "", err
		}
		return r.GetEvent().GetStream(), nil
	}}
}

// check runs c and checks its status code; for OK with a named caller, that
// the handler saw that principal.
func check(t *testing.T, conn *grpc.ClientConn, c call, want codes.Code, wantName string, secret string) {
	t.Helper()
	name, err := c.do(testCtx(t), conn)
	if got := status.Code(err); got != want {
		t.Errorf("%s: code %v (%v), want %v", c.name, got, err, want)
		return
	}
	if err != nil && secret != "" && strings.Contains(err.Error(), secret) {
		t.Errorf("%s: error reveals the token: %v", c.name, err)
	}
	// Only Ack and Subscribe report the principal ("(none)" without one).
	if err == nil && wantName != "" && name != "" && name != wantName {
		t.Errorf("%s: handler saw principal %q, want %q", c.name, name, wantName)
	}
}

func TestPolicyOverGRPC(t *testing.T) {
	t.Parallel()
	addr := serve(t, newFromText(t, testTokens, nil))
	const (
		ok     = codes.OK
		unauth = codes.Unauthenticated
		denied = codes.PermissionDenied
	)
	for _, tc := range []struct {
		token string
		name  string // principal the handlers should see
		want  map[*call]codes.Code
	}{
		{"", "", map[*call]codes.Code{&callAck: unauth, &callSubscribe: unauth, &callGetLag: unauth, &callPurge: unauth, &callHealth: ok, &callReflection: ok, &callOther: unauth}},
		{"wrong-token-0123456789", "", map[*call]codes.Code{&callAck: unauth, &callSubscribe: unauth, &callGetLag: unauth, &callPurge: unauth, &callHealth: ok, &callReflection: ok, &callOther: unauth}},
		{relaySecret, "relayer", map[*call]codes.Code{&callAck: ok, &callSubscribe: ok, &callGetLag: denied, &callPurge: denied, &callHealth: ok, &callReflection: ok, &callOther: denied}},
		{adminSecret, "operator", map[*call]codes.Code{&callAck: denied, &callSubscribe: denied, &callGetLag: ok, &callPurge: ok, &callHealth: ok, &callReflection: ok, &callOther: ok}},
		{bothSecret, "both", map[*call]codes.Code{&callAck: ok, &callSubscribe: ok, &callGetLag: ok, &callPurge: ok, &callHealth: ok, &callReflection: ok, &callOther: ok}},
		// Subscribing to every stream is more than billing.* grants.
		{billingSecret, "billing", map[*call]codes.Code{&callAck: ok, &callSubscribe: denied, &callGetLag: denied, &callPurge: denied, &callHealth: ok, &callReflection: ok, &callOther: denied}},
	} {
		conn := dial(t, addr, tc.token)
		for c, want := range tc.want {
			check(t, conn, *c, want, tc.name, tc.token)
		}
	}
}

// A viewer token reads (every read-only AdminService method reaches its
// handler, which answers OK with the name of the caller it saw) and may do
// nothing else: no action, no purge, no relay call, no unknown service.
func TestViewerRole(t *testing.T) {
	t.Parallel()
	a := newFromText(t, testTokens, nil)
	addr := serve(t, a)
	conn := dial(t, addr, viewerSecret)
	check(t, conn, callGetLag, codes.OK, "watcher", viewerSecret)
	admin := outboxv1.NewAdminServiceClient(conn)
	for _, method := range ReadOnlyAdminMethods {
		call, ok := readOnlyCalls[method]
		if !ok {
			t.Errorf("read-only method %s has no call in readOnlyCalls (and no answer in fakeAdmin)", method)
			continue
		}
		if name, err := call(testCtx(t), admin); err != nil || name != "watcher" {
			t.Errorf("viewer calling %s: answered for %q, %v; want OK for \"watcher\"", method, name, err)
		}
	}
	for _, method := range []string{
		outboxv1.AdminService_RetryAggregate_FullMethodName, outboxv1.AdminService_SkipEvent_FullMethodName,
		outboxv1.AdminService_BulkRetry_FullMethodName, outboxv1.AdminService_BulkSkip_FullMethodName,
		outboxv1.AdminService_Republish_FullMethodName,
	} {
		err := conn.Invoke(testCtx(t), method, &emptypb.Empty{}, &emptypb.Empty{})
		if st := status.Convert(err); st.Code() != codes.PermissionDenied || !strings.Contains(st.Message(), `token "watcher" lacks the admin role`) {
			t.Errorf("viewer calling %s: %v, want PermissionDenied naming the admin role", method, err)
		}
	}
	for _, c := range []call{callPurge, callAck, callSubscribe, callOther} {
		check(t, conn, c, codes.PermissionDenied, "", viewerSecret)
	}
	p, ok := a.Lookup(viewerSecret)
	if !ok || p.Name != "watcher" || !slices.Equal(p.Roles, []Role{RoleViewer}) {
		t.Fatalf("Lookup(viewer) = %+v, %v", p, ok)
	}
	if !a.Allows(p, outboxv1.AdminService_ListEvents_FullMethodName) || a.Allows(p, outboxv1.AdminService_SkipEvent_FullMethodName) {
		t.Error("Allows disagrees with the interceptor's policy for a viewer")
	}
	if _, ok := a.Lookup("not a token"); ok {
		t.Error("Lookup accepted a malformed token")
	}
	// The relay-only token is told which roles would do.
	_, err := callGetLag.do(testCtx(t), dial(t, addr, relaySecret))
	if want := `token "relayer" lacks the admin or viewer role needed for /outbox.v1.AdminService/GetLag`; status.Convert(err).Message() != want {
		t.Errorf("got %v, want %q", err, want)
	}
}

// Lookup (the console's login) refuses what a gRPC call's authorization
// header may not carry, even when the file holds the token's hash: a
// token longer than MaxSecretLen, or with a character outside RFC 6750's.
// A hashed line is the only way such a token can be in the set.
func TestLookupRefusesWhatTheInterceptorRefuses(t *testing.T) {
	t.Parallel()
	long, spaced, longest := strings.Repeat("a", MaxSecretLen+1), "not a token 0123456789", strings.Repeat("b", MaxSecretLen)
	a := newFromText(t, "long relay "+HashToken(long)+"\nspaced relay "+HashToken(spaced)+"\nlongest relay "+HashToken(longest), nil)
	for _, token := range []string{long, spaced} {
		if p, ok := a.Lookup(token); ok {
			t.Errorf("Lookup accepted a token of %d bytes as %q", len(token), p.Name)
		}
	}
	if p, ok := a.Lookup(longest); !ok || p.Name != "longest" {
		t.Errorf("Lookup of a token of MaxSecretLen bytes = %v, %v; want \"longest\"", p, ok)
	}
	// The interceptor agrees.
	addr := serve(t, a)
	check(t, dial(t, addr, long), callAck, codes.Unauthenticated, "", "")
	check(t, dial(t, addr, longest), callAck, codes.OK, "longest", "")
}

// A token authenticates only by its whole SHA-256: a hashed line whose
// digest differs from the token's in the first or the last byte alone does
// not let the token in, through Lookup or the interceptor.
func TestTokenMustMatchItsWholeDigest(t *testing.T) {
	t.Parallel()
	const token = "near-miss-token-0123456789"
	first, last := sha256.Sum256([]byte(token)), sha256.Sum256([]byte(token))
	first[0] ^= 1
	last[len(last)-1] ^= 1
	a := newFromText(t, "first relay sha256:"+hex.EncodeToString(first[:])+"\nlast relay sha256:"+hex.EncodeToString(last[:]), nil)
	if p, ok := a.Lookup(token); ok {
		t.Errorf("Lookup accepted a token whose digest differs from %q's in one byte", p.Name)
	}
	check(t, dial(t, serve(t, a), token), callAck, codes.Unauthenticated, "", "")
}

func TestPermissionDeniedNamesRole(t *testing.T) {
	t.Parallel()
	addr := serve(t, newFromText(t, testTokens, nil))
	_, err := callPurge.do(testCtx(t), dial(t, addr, relaySecret))
	if st := status.Convert(err); st.Code() != codes.PermissionDenied ||
		st.Message() != `token "relayer" lacks the admin role needed for /outbox.v1.AdminService/Purge` {
		t.Errorf("got %v", err)
	}
	_, err = callSubscribe.do(testCtx(t), dial(t, addr, adminSecret))
	if st := status.Convert(err); st.Code() != codes.PermissionDenied || !strings.Contains(st.Message(), "lacks the relay role") {
		t.Errorf("got %v", err)
	}
}

func TestStreamAllowList(t *testing.T) {
	t.Parallel()
	addr := serve(t, newFromText(t, testTokens, nil))
	billing := dial(t, addr, billingSecret)
	check(t, billing, subscribeCall("billing.invoice"), codes.OK, "billing", "")
	check(t, billing, subscribeCall("billing.invoice", "billing.refund"), codes.OK, "billing", "")
	check(t, billing, subscribeCall("sales_order"), codes.PermissionDenied, "", billingSecret)
	check(t, billing, subscribeCall("billing.invoice", "sales_order"), codes.PermissionDenied, "", billingSecret)
	check(t, billing, subscribeCall("billing"), codes.PermissionDenied, "", billingSecret)
	_, err := subscribeCall("sales_order").do(testCtx(t), billing)
	if want := `token "billing" may not access stream "sales_order"; it is limited to billing.*`; status.Convert(err).Message() != want {
		t.Errorf("got %v, want message %q", err, want)
	}
	// An unrestricted token may subscribe to anything, or to everything.
	relayer := dial(t, addr, relaySecret)
	check(t, relayer, subscribeCall("sales_order"), codes.OK, "relayer", "")
	check(t, relayer, subscribeCall(), codes.OK, "relayer", "")
}

func TestProtectReflection(t *testing.T) {
	t.Parallel()
	addr := serve(t, newFromText(t, testTokens, func(c *Config) { c.ProtectReflection = true }))
	check(t, dial(t, addr, ""), callReflection, codes.Unauthenticated, "", "")
	check(t, dial(t, addr, relaySecret), callReflection, codes.OK, "", "")
	check(t, dial(t, addr, adminSecret), callReflection, codes.OK, "", "")
	check(t, dial(t, addr, ""), callHealth, codes.OK, "", "")
}

// Headers a well-behaved client would never send, sent raw.
func TestMalformedAuthorizationOverGRPC(t *testing.T) {
	t.Parallel()
	addr := serve(t, newFromText(t, testTokens, nil))
	conn := dial(t, addr, "")
	for _, tc := range []struct {
		name   string
		values []string
		want   codes.Code
	}{
		{"basic scheme", []string{"Basic " + relaySecret}, codes.Unauthenticated},
		{"no scheme", []string{relaySecret}, codes.Unauthenticated},
		{"two headers, both valid", []string{"Bearer " + relaySecret, "Bearer " + bothSecret}, codes.Unauthenticated},
		{"lower-case scheme, two spaces", []string{"bearer  " + relaySecret}, codes.OK},
		{"trailing garbage", []string{"Bearer " + relaySecret + " x"}, codes.Unauthenticated},
		{"revoked-looking prefix", []string{"Bearer " + relaySecret[:len(relaySecret)-1]}, codes.Unauthenticated},
	} {
		md := metadata.MD{}
		for _, v := range tc.values {
			md.Append("authorization", v)
		}
		ctx := metadata.NewOutgoingContext(testCtx(t), md)
		_, err := outboxv1.NewRelayServiceClient(conn).Ack(ctx, &outboxv1.AckRequest{})
		if got := status.Code(err); got != tc.want {
			t.Errorf("%s: got %v (%v), want %v", tc.name, got, err, tc.want)
		}
		if err != nil && strings.Contains(err.Error(), relaySecret[:10]) {
			t.Errorf("%s: error echoes the header: %v", tc.name, err)
		}
	}
}

// Outside a gRPC server AuthFunc cannot know the method and must refuse.
func TestAuthFuncFailsClosedWithoutMethod(t *testing.T) {
	t.Parallel()
	a := newFromText(t, testTokens, nil)
	ctx := metadata.NewIncomingContext(t.Context(), metadata.Pairs("authorization", "Bearer "+bothSecret))
	if _, err := a.AuthFunc(ctx); status.Code(err) != codes.Internal {
		t.Fatalf("got %v, want Internal", err)
	}
}

func TestRequirement(t *testing.T) {
	t.Parallel()
	open := newFromText(t, testTokens, nil)
	closed := newFromText(t, testTokens, func(c *Config) { c.ProtectReflection = true })
	for _, tc := range []struct {
		method       string
		open, closed access
	}{
		{outboxv1.RelayService_Ack_FullMethodName, access{role: RoleRelay}, access{role: RoleRelay}},
		{outboxv1.RelayService_Subscribe_FullMethodName, access{role: RoleRelay}, access{role: RoleRelay}},
		{outboxv1.RelayService_ListSources_FullMethodName, access{role: RoleRelay}, access{role: RoleRelay}},
		{outboxv1.AdminService_Purge_FullMethodName, access{role: RoleAdmin}, access{role: RoleAdmin}},
		{outboxv1.AdminService_GetLag_FullMethodName, access{role: RoleAdmin, viewer: true}, access{role: RoleAdmin, viewer: true}},
		{outboxv1.AdminService_ListAttempts_FullMethodName, access{role: RoleAdmin, viewer: true}, access{role: RoleAdmin, viewer: true}},
		{outboxv1.AdminService_SkipEvent_FullMethodName, access{role: RoleAdmin}, access{role: RoleAdmin}},
		{outboxv1.AdminService_BulkSkip_FullMethodName, access{role: RoleAdmin}, access{role: RoleAdmin}},
		{healthpb.Health_Watch_FullMethodName, access{public: true}, access{public: true}},
		{"/grpc.reflection.v1.ServerReflection/ServerReflectionInfo", access{public: true}, access{}},
		{"/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", access{public: true}, access{}},
		{"/outbox.v1.RelayServiceX/Ack", access{role: RoleAdmin}, access{role: RoleAdmin}},
		{"/outbox.v2.RelayService/Ack", access{role: RoleAdmin}, access{role: RoleAdmin}},
		{"", access{role: RoleAdmin}, access{role: RoleAdmin}},
	} {
		if got := open.requirement(tc.method); got != tc.open {
			t.Errorf("requirement(%q) = %+v, want %+v", tc.method, got, tc.open)
		}
		if got := closed.requirement(tc.method); got != tc.closed {
			t.Errorf("with ProtectReflection: requirement(%q) = %+v, want %+v", tc.method, got, tc.closed)
		}
	}
}

// A token meant for TLS must not be sent over plaintext.
func TestBearerTokenRequiresTransportSecurity(t *testing.T) {
	t.Parallel()
	addr := serve(t, newFromText(t, testTokens, nil))
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()), WithBearerToken(relaySecret, false))
	if err == nil {
		defer conn.Close()
		_, err = callAck.do(testCtx(t), conn)
	}
	if err == nil || !strings.Contains(err.Error(), "transport") {
		t.Fatalf("token sent over plaintext: err = %v", err)
	}
}
