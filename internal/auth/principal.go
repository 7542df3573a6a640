package auth

import (
	"context"
	"slices"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Principal is who a request authenticated as. It never holds the secret.
// One Principal is shared by every request made with its token, so callers
// must treat it as read-only.
type Principal struct {
	// Name identifies the token's holder; it is what audit records and logs
	// show as the actor.
	Name string
	// Roles are the roles granted, in a fixed order (relay, viewer, admin).
	Roles []Role
	// Streams are the stream patterns the token is limited to, sorted; '*'
	// matches any run of characters. Empty means every stream. A pattern
	// with a slash names a source too ("orders/billing.*", see ForSource).
	Streams []string
}

// HasRole reports whether p was granted r.
func (p *Principal) HasRole(r Role) bool { return slices.Contains(p.Roles, r) }

// AllStreams reports whether p may access every stream, present or future.
func (p *Principal) AllStreams() bool {
	return len(p.Streams) == 0 || slices.Contains(p.Streams, "*")
}

// AllowsStream reports whether p may access the named stream.
func (p *Principal) AllowsStream(stream string) bool {
	if len(p.Streams) == 0 {
		return true
	}
	for _, pat := range p.Streams {
		if globMatch(pat, stream) {
			return true
		}
	}
	return false
}

// DefaultSource is the name of the source database that --database-url
// names: a pattern without a source ("billing.*") is one of its streams.
const DefaultSource = "default"

// ForSource returns p as the engine of one source database sees it: the
// patterns that apply to that source's streams, written without the source
// ("orders/billing.*" becomes "billing.*" for source orders, "*/payments"
// becomes "payments" for every source, and a pattern without a source
// applies to DefaultSource alone), and false when p may access no stream of
// it. An unrestricted p (AllStreams, so also "*") is returned as it is.
// Engines match bare stream names, so a request reaches one only with the
// principal for its source: a token scoped to one source is refused on
// every other.
func (p *Principal) ForSource(source string) (*Principal, bool) {
	if p.AllStreams() {
		return p, true
	}
	var pats []string
	for _, pat := range p.Streams {
		src, stream, ok := strings.Cut(pat, "/")
		switch {
		case !ok && source == DefaultSource:
			pats = append(pats, pat)
		case ok && globMatch(src, source):
			pats = append(pats, stream)
		}
	}
	if len(pats) == 0 {
		return nil, false
	}
	slices.Sort(pats)
	return &Principal{Name: p.Name, Roles: p.Roles, Streams: slices.Compact(pats)}, true
}

// String returns the name: a Principal is safe to log.
func (p *Principal) String() string { return p.Name }

func (p *Principal) sameGrant(q *Principal) bool {
	return slices.Equal(p.Roles, q.Roles) && slices.Equal(p.Streams, q.Streams)
}

type principalKey struct{}

// ContextWithPrincipal returns ctx carrying p. The interceptors do this for
// every authenticated request; tests of handlers can use it directly.
func ContextWithPrincipal(ctx context.Context, p *Principal) context.Context {
	return context.WithValue(ctx, principalKey{}, p)
}

// PrincipalFrom returns the principal the request authenticated as. It
// returns false when auth is disabled (no interceptor installed) and for
// methods that need no token (health, reflection): callers treat both as
// allowed everything, which is what disabled auth means.
func PrincipalFrom(ctx context.Context) (*Principal, bool) {
	p, ok := ctx.Value(principalKey{}).(*Principal)
	return p, ok && p != nil
}

// AuthorizeStreams returns a PermissionDenied status unless the caller may
// access every listed stream. With no principal in ctx (auth disabled) it
// allows everything. Call it with the streams a Subscribe names and with the
// stream of each event an Ack, Nack or ExtendLease touches.
func AuthorizeStreams(ctx context.Context, streams ...string) error {
	p, ok := PrincipalFrom(ctx)
	if !ok {
		return nil
	}
	for _, s := range streams {
		if !p.AllowsStream(s) {
			return status.Errorf(codes.PermissionDenied, "token %q may not access stream %.140q; it is limited to %s",
				p.Name, s, strings.Join(p.Streams, ","))
		}
	}
	return nil
}

// AuthorizeAllStreams returns a PermissionDenied status unless the caller
// may access every stream, for requests that name none and so mean "all"
// (a Subscribe with an empty stream list). A token limited to some streams
// must name them: the server cannot widen or silently narrow the request.
func AuthorizeAllStreams(ctx context.Context) error {
	p, ok := PrincipalFrom(ctx)
	if !ok || p.AllStreams() {
		return nil
	}
	return status.Errorf(codes.PermissionDenied, "token %q is limited to streams %s; name the streams to access",
		p.Name, strings.Join(p.Streams, ","))
}
