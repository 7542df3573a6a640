package auth

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"

	middleware "github.com/grpc-ecosystem/go-grpc-middleware/v2"
	grpcauth "github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/auth"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
)

// authorizationHeader is the metadata key carrying "Bearer <token>".
const authorizationHeader = "authorization"

var (
	relayPrefix  = "/" + outboxv1.RelayService_ServiceDesc.ServiceName + "/"
	adminPrefix  = "/" + outboxv1.AdminService_ServiceDesc.ServiceName + "/"
	healthPrefix = "/" + healthpb.Health_ServiceDesc.ServiceName + "/"
	// reflectionPrefix covers grpc.reflection.v1 and v1alpha.
	reflectionPrefix = "/grpc.reflection."
)

// access is what a method requires.
type access struct {
	public bool // no token needed; a token sent anyway is ignored
	role   Role // role needed; "" with public false means any valid token
	// viewer: RoleViewer suffices as well as role (a read-only method).
	viewer bool
}

// ReadOnlyAdminMethods are the AdminService methods that only read: a token
// with the viewer role may call them (as may admin). Every other
// AdminService method changes something and needs admin.
var ReadOnlyAdminMethods = []string{
	outboxv1.AdminService_GetLag_FullMethodName,
	outboxv1.AdminService_ListRelays_FullMethodName,
	outboxv1.AdminService_GetAggregate_FullMethodName,
	outboxv1.AdminService_ListEvents_FullMethodName,
	outboxv1.AdminService_ListAggregates_FullMethodName,
	outboxv1.AdminService_ListAttempts_FullMethodName,
	outboxv1.AdminService_ListOperatorActions_FullMethodName,
}

// allows reports whether p holds what need asks for.
func (need access) allows(p *Principal) bool {
	return need.role == "" || p.HasRole(need.role) || need.viewer && p.HasRole(RoleViewer)
}

// describe names the roles need accepts, for PermissionDenied messages.
func (need access) describe() string {
	if need.viewer {
		return string(need.role) + " or " + string(RoleViewer)
	}
	return string(need.role)
}

// Allows reports whether p may call the full gRPC method name under the
// same policy the interceptors apply (streams apart, which handlers check).
// The console uses it to show only the actions a session may take.
func (a *Authenticator) Allows(p *Principal, method string) bool {
	need := a.requirement(method)
	return need.public || need.allows(p)
}

// requirement is the method→role policy. A method of any other service
// needs admin: a service registered later is closed until someone decides
// who may call it, rather than open by omission.
func (a *Authenticator) requirement(method string) access {
	switch {
	case strings.HasPrefix(method, relayPrefix):
		return access{role: RoleRelay}
	case slices.Contains(ReadOnlyAdminMethods, method):
		return access{role: RoleAdmin, viewer: true}
	case strings.HasPrefix(method, adminPrefix):
		return access{role: RoleAdmin}
	case strings.HasPrefix(method, healthPrefix):
		// Load balancers and orchestrators probe health without credentials.
		return access{public: true}
	case strings.HasPrefix(method, reflectionPrefix):
		// Reflection reveals only the schema, which is public in the repo.
		return access{public: !a.cfg.ProtectReflection}
	default:
		return access{role: RoleAdmin}
	}
}

// AuthFunc is a go-grpc-middleware auth.AuthFunc that authenticates the
// bearer token and applies the method policy, putting the Principal in the
// returned context. The middleware's AuthFunc is not told the method, so it
// reads it with grpc.Method, which the server sets before any interceptor
// runs; without one it refuses, failing closed.
//
// Missing, malformed, unknown or revoked token: codes.Unauthenticated. A
// valid token without the role the method needs: codes.PermissionDenied,
// naming the token's name and the role, never the token.
func (a *Authenticator) AuthFunc(ctx context.Context) (context.Context, error) {
	method, ok := grpc.Method(ctx)
	if !ok {
		return nil, status.Error(codes.Internal, "auth: no method in context; AuthFunc must run inside a gRPC server interceptor")
	}
	need := a.requirement(method)
	if need.public {
		return ctx, nil
	}
	token, err := parseAuthorization(metadata.ValueFromIncomingContext(ctx, authorizationHeader))
	if err != nil {
		a.reject(ctx, method, "", err.Error())
		return nil, status.Error(codes.Unauthenticated, err.Error())
	}
	p, ok := a.authenticate(token)
	if !ok {
		a.reject(ctx, method, "", "unknown token")
		return nil, status.Error(codes.Unauthenticated, "unknown or revoked bearer token")
	}
	if !need.allows(p) {
		a.reject(ctx, method, p.Name, "missing role "+need.describe())
		return nil, status.Errorf(codes.PermissionDenied, "token %q lacks the %s role needed for %s", p.Name, need.describe(), method)
	}
	ctx = context.WithValue(ctx, tokenHashKey{}, sha256.Sum256([]byte(token)))
	return ContextWithPrincipal(ctx, p), nil
}

// tokenHashKey carries the SHA-256 of the request's token, for the stream
// interceptor to recognise the token's revocation.
type tokenHashKey struct{}

// reject logs a refused request at debug level: refusals are normal noise
// from scanners, and the status code already reaches request logging.
func (a *Authenticator) reject(ctx context.Context, method, name, reason string) {
	addr := ""
	if pr, ok := peer.FromContext(ctx); ok && pr.Addr != nil {
		addr = pr.Addr.String()
	}
	a.log.DebugContext(ctx, "auth: request refused", "method", method, "peer", addr, "token_name", name, "reason", reason)
}

// UnaryServerInterceptor is go-grpc-middleware's auth interceptor running
// AuthFunc.
//
// The middleware lets a service bypass AuthFunc by implementing
// auth.ServiceAuthFuncOverride; no outboxd service may do so, or the policy
// above would not apply to it.
func (a *Authenticator) UnaryServerInterceptor() grpc.UnaryServerInterceptor {
	return grpcauth.UnaryServerInterceptor(a.AuthFunc)
}

// StreamServerInterceptor is the streaming counterpart of
// UnaryServerInterceptor; the handler's stream.Context() carries the
// Principal.
//
// A stream lives for hours, so checking its token once is not enough: when a
// reload removes the token (or changes its roles or streams), the stream's
// context is canceled and the call ends with codes.Unauthenticated, whatever
// the handler returns. A revoked relay thus stops receiving events at once.
func (a *Authenticator) StreamServerInterceptor() grpc.StreamServerInterceptor {
	authenticate := grpcauth.StreamServerInterceptor(a.AuthFunc)
	return func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
		return authenticate(srv, ss, info, func(srv any, ss grpc.ServerStream) error {
			p, ok := PrincipalFrom(ss.Context())
			hash, hashed := ss.Context().Value(tokenHashKey{}).([sha256.Size]byte)
			if !ok || !hashed {
				return handler(srv, ss) // a public method
			}
			ctx, cancel := context.WithCancelCause(ss.Context())
			defer cancel(nil)
			defer a.streams.add(a, hash, p, cancel)()
			wrapped := middleware.WrapServerStream(ss)
			wrapped.WrappedContext = ctx
			err := handler(srv, wrapped)
			if errors.Is(context.Cause(ctx), errRevoked) {
				return status.Errorf(codes.Unauthenticated, "token %q was revoked or its grant changed; stream closed", p.Name)
			}
			return err
		})
	}
}

var errRevoked = errors.New("auth: token revoked")

// openStreams tracks the streams in progress with the token each was
// authenticated with, so a reload can end those whose token is gone.
type openStreams struct {
	mu sync.Mutex
	m  map[*openStream]struct{}
}

type openStream struct {
	hash   [sha256.Size]byte
	p      *Principal
	cancel context.CancelCauseFunc
}

// add registers a stream and returns its unregistration. It checks the
// token against the current set after registering: a reload that stored a
// new set before the registration, and so did not see it, is caught here,
// and one that stores it after will see the registration.
func (o *openStreams) add(a *Authenticator, hash [sha256.Size]byte, p *Principal, cancel context.CancelCauseFunc) func() {
	s := &openStream{hash: hash, p: p, cancel: cancel}
	o.mu.Lock()
	if o.m == nil {
		o.m = map[*openStream]struct{}{}
	}
	o.m[s] = struct{}{}
	o.mu.Unlock()
	if !a.set.Load().grants(hash, p) {
		cancel(errRevoked)
	}
	return func() {
		o.mu.Lock()
		delete(o.m, s)
		o.mu.Unlock()
	}
}

// revoke cancels the streams whose token set no longer grants what they
// were admitted with. Called after every change of the set.
func (o *openStreams) revoke(set *tokenSet) int {
	o.mu.Lock()
	defer o.mu.Unlock()
	n := 0
	for s := range o.m {
		if !set.grants(s.hash, s.p) {
			s.cancel(errRevoked)
			delete(o.m, s)
			n++
		}
	}
	return n
}

var errNoToken = errors.New("missing bearer token; send the header authorization: Bearer <token>")

// parseAuthorization extracts the token from the authorization header's
// values: exactly one value, scheme "Bearer" in any case, one or more spaces,
// then an RFC 6750 token of at most MaxSecretLen bytes. Error messages never
// include the header's content.
func parseAuthorization(values []string) (string, error) {
	switch len(values) {
	case 0:
		return "", errNoToken
	case 1:
	default:
		// Which one would a proxy have checked? Refuse the ambiguity.
		return "", fmt.Errorf("%d authorization headers; send exactly one", len(values))
	}
	scheme, rest, ok := strings.Cut(values[0], " ")
	if !ok || !strings.EqualFold(scheme, "bearer") {
		return "", errors.New("authorization header is not of the form: Bearer <token>")
	}
	token := strings.TrimLeft(rest, " ")
	if token == "" {
		return "", errNoToken
	}
	if len(token) > MaxSecretLen || !validToken(token) {
		return "", errors.New("malformed bearer token")
	}
	return token, nil
}
