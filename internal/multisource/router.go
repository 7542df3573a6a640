package multisource

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"sync/atomic"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/auth"
)

// Engine is the delivery engine of one source database.
type Engine struct {
	// Name is the source's name (ValidName).
	Name string
	// Relay and Admin are the engine's services, called without the gRPC
	// interceptors (the Router is what is registered behind them).
	Relay outboxv1.RelayServiceServer
	Admin outboxv1.AdminServiceServer
	// Readiness reports the source's latest readiness, for GetLag. Nil:
	// always ready.
	Readiness func() (ready bool, reason string)
}

func (e *Engine) ready() (bool, string) {
	if e.Readiness == nil {
		return true, ""
	}
	return e.Readiness()
}

// Router sends each RelayService and AdminService call to the engine of the
// source it names. See the package documentation.
//
// Its set of engines can change while it serves (Add, Retire, Remove): each
// call reads one immutable snapshot of the set (copy on write behind an
// atomic pointer), so calls in flight keep the engine they started with,
// and changing one source never touches another's engine.
type Router struct {
	cur atomic.Pointer[routes]
	mu  sync.Mutex // serialises changes: each copies cur and stores the copy
	// acksEnded is closed by EndAckStreams.
	acksEnded   chan struct{}
	endAcksOnce sync.Once
}

// EndAckStreams ends every AckStream stream, now and from now on, with
// UNAVAILABLE: call it once the engines have stopped (their relay streams
// ended), so that a graceful stop of the gRPC server does not wait for
// relays to close their ack streams.
func (r *Router) EndAckStreams() { r.endAcksOnce.Do(func() { close(r.acksEnded) }) }

// routes is one snapshot of a Router's engines.
type routes struct {
	engines map[string]*Engine
	names   []string // sorted
	// retiring are sources being removed (Retire): they take no new
	// Subscribe stream, but their leases can still be acked.
	retiring map[string]bool
	// removed are sources removed at run time (Remove), so that a call
	// naming one is told the source is gone rather than that it never
	// existed.
	removed map[string]bool
	// pending are sources configured but not added yet (their database did
	// not answer, say), with why (SetPending): GetLag names them as not
	// ready, as the replica's readiness does.
	pending map[string]string
}

func (rt *routes) clone() *routes {
	out := &routes{engines: make(map[string]*Engine, len(rt.engines)), names: slices.Clone(rt.names),
		retiring: make(map[string]bool), removed: make(map[string]bool), pending: make(map[string]string)}
	for k, v := range rt.pending {
		out.pending[k] = v
	}
	for k, v := range rt.engines {
		out.engines[k] = v
	}
	for k, v := range rt.retiring {
		out.retiring[k] = v
	}
	for k, v := range rt.removed {
		out.removed[k] = v
	}
	return out
}

// New returns a Router in front of engines, which must have valid, distinct
// names.
func New(engines []Engine) (*Router, error) {
	if len(engines) == 0 {
		return nil, errors.New("multisource: no source")
	}
	r := &Router{acksEnded: make(chan struct{})}
	r.cur.Store(&routes{engines: map[string]*Engine{}})
	for i := range engines {
		if err := r.Add(engines[i]); err != nil {
			return nil, err
		}
	}
	return r, nil
}

// Add publishes the engine of a source: calls naming it reach it from now
// on. Its engine must already run (Subscribe streams are served at once).
func (r *Router) Add(e Engine) error {
	if err := ValidName(e.Name); err != nil {
		return fmt.Errorf("multisource: %w", err)
	}
	if e.Relay == nil || e.Admin == nil {
		return fmt.Errorf("multisource: source %q: Relay and Admin are required", e.Name)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	rt := r.cur.Load()
	if rt.engines[e.Name] != nil {
		return fmt.Errorf("multisource: source %q given twice", e.Name)
	}
	next := rt.clone()
	next.engines[e.Name] = &e
	next.names = append(next.names, e.Name)
	slices.Sort(next.names)
	delete(next.removed, e.Name)
	delete(next.pending, e.Name)
	r.cur.Store(next)
	return nil
}

// SetPending records that the source name is configured but not served
// yet, and why, until Add adds it or ClearPending forgets it. A name that
// is not a source name, or of a source served now, is refused: calls for it
// would be answered UNAVAILABLE ("not added yet") forever, or the source
// reported not added while it is.
func (r *Router) SetPending(name, reason string) error {
	if err := ValidName(name); err != nil {
		return fmt.Errorf("multisource: %w", err)
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	rt := r.cur.Load()
	if rt.engines[name] != nil {
		return fmt.Errorf("multisource: source %q is served; it cannot be pending", name)
	}
	next := rt.clone()
	next.pending[name] = reason
	r.cur.Store(next)
	return nil
}

// Pending returns the sources configured but not added yet, with why (a
// copy).
func (r *Router) Pending() map[string]string {
	return maps.Clone(r.cur.Load().pending)
}

// ClearPending forgets a pending source (removed from the configuration
// before it could be added).
func (r *Router) ClearPending(name string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	next := r.cur.Load().clone()
	delete(next.pending, name)
	r.cur.Store(next)
}

// Retire is the first step of removing a source: from now on a Subscribe
// stream for it is refused with NOT_FOUND naming the source as removed,
// while Acks, Nacks, ExtendLease and the admin calls still reach its engine,
// so that the relays can ack what they hold while its engine drains (see
// server.Server.Stop). Remove then unpublishes it.
func (r *Router) Retire(name string) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	rt := r.cur.Load()
	if rt.engines[name] == nil {
		return fmt.Errorf("multisource: no source %q to remove", name)
	}
	if len(rt.engines)-len(rt.retiring) == 1 && !rt.retiring[name] {
		return fmt.Errorf("multisource: source %q is the last one; a server serves at least one source", name)
	}
	next := rt.clone()
	next.retiring[name] = true
	r.cur.Store(next)
	return nil
}

// Remove unpublishes a retired source: every call naming it is refused,
// saying the source was removed (Subscribe NOT_FOUND, an Ack of its lease
// ACK_STATUS_INVALID, Nack and ExtendLease FAILED_PRECONDITION). Its engine
// can then be stopped: no new call reaches it.
func (r *Router) Remove(name string) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	rt := r.cur.Load()
	if !rt.retiring[name] {
		return fmt.Errorf("multisource: source %q is not retired; Retire it first", name)
	}
	next := rt.clone()
	delete(next.engines, name)
	delete(next.retiring, name)
	next.names = slices.DeleteFunc(next.names, func(n string) bool { return n == name })
	next.removed[name] = true
	r.cur.Store(next)
	return nil
}

// Register adds the routing RelayService and AdminService to g.
func (r *Router) Register(g grpc.ServiceRegistrar) {
	outboxv1.RegisterRelayServiceServer(g, &relayRouter{r: r})
	outboxv1.RegisterAdminServiceServer(g, &adminRouter{r: r})
}

// AdminServer returns the routing AdminService itself, for in-process
// callers that apply access rules themselves (see server.AdminServer).
func (r *Router) AdminServer() outboxv1.AdminServiceServer { return &adminRouter{r: r} }

// Names returns the sources' names, sorted (retiring ones included).
func (r *Router) Names() []string { return slices.Clone(r.cur.Load().names) }

// routes returns the current snapshot of the engines.
func (r *Router) routes() *routes { return r.cur.Load() }

// engine returns the engine of source for a caller, or an error naming the
// field what (in the message and in BadRequest details, as the engines'
// own validation does) and the sources the server serves, only those the
// caller's token may see (servedTo); it is built only on the way out.
func (rt *routes) engine(ctx context.Context, source, what string) (*Engine, error) {
	if e := rt.engines[source]; e != nil {
		return e, nil
	}
	if rt.removed[source] {
		return nil, removedError(source, what, servedTo(ctx, rt.names))
	}
	if _, ok := rt.pending[source]; ok {
		return nil, status.Error(codes.Unavailable, what+": "+pendingMessage(source))
	}
	return nil, invalid(what, "no source named %.40q; this server serves %s", source, servedTo(ctx, rt.names))
}

// servedTo names, for an error message, the sources of names the caller's
// token may see (all of them without auth), so that a token limited to
// some sources learns nothing of the others.
func servedTo(ctx context.Context, names []string) string {
	vis := make([]string, 0, len(names))
	for _, n := range names {
		if _, err := forSource(ctx, n); err == nil {
			vis = append(vis, n)
		}
	}
	switch {
	case len(vis) == len(names):
		return strings.Join(names, ", ")
	case len(vis) == 0:
		return "no source this token may access"
	}
	return strings.Join(vis, ", ") + " to this token"
}

// subscribable is engine for a new Subscribe stream: a retiring source
// takes none.
func (rt *routes) subscribable(ctx context.Context, source string) (*Engine, error) {
	if rt.retiring[source] {
		return nil, removedError(source, "streams", servedTo(ctx, rt.live()))
	}
	return rt.engine(ctx, source, "streams")
}

// live is names without the retiring sources.
func (rt *routes) live() []string {
	return slices.DeleteFunc(slices.Clone(rt.names), func(n string) bool { return rt.retiring[n] })
}

// removedError is NOT_FOUND for a source removed from this server at run
// time (its configuration reloaded without it). Relays retry NOT_FOUND
// quietly, so one left running picks the source up again if it comes back.
func removedError(source, what, served string) error {
	return status.Errorf(codes.NotFound, "%s: source %.40q was removed from this server's configuration; it serves %s",
		what, source, served)
}

// pendingMessage says why a source that is configured but not added yet
// (its database did not answer; see Router.SetPending) is refused: for
// now, so the caller retries. Why it was not added is for the operator
// (readiness), not for callers.
func pendingMessage(source string) string {
	return fmt.Sprintf("source %.40q is configured on this server but not served yet (its database does not answer, or is not migrated); retry later", source)
}

// removedMessage says why a lease token of a removed source is refused.
func removedMessage(source string) string {
	return fmt.Sprintf("lease_token is bound to source %.40q, which was removed from this server's configuration; its lease is gone and nothing changed", source)
}

// forSource returns ctx as the engine of source must see it: with the
// caller's principal projected onto that source (auth.Principal.ForSource),
// or PermissionDenied when the token may access no stream of it. Without a
// principal (auth off) ctx is returned as it is.
func forSource(ctx context.Context, source string) (context.Context, error) {
	p, ok := auth.PrincipalFrom(ctx)
	if !ok {
		return ctx, nil
	}
	q, ok := p.ForSource(source)
	if !ok {
		return nil, status.Errorf(codes.PermissionDenied, "token %q may not access any stream of source %q; it is limited to %s",
			p.Name, source, strings.Join(p.Streams, ","))
	}
	if q == p {
		return ctx, nil
	}
	return auth.ContextWithPrincipal(ctx, q), nil
}

// invalid is an InvalidArgument status naming one field, as the engines'
// own validation reports it.
func invalid(field, format string, args ...any) error {
	desc := fmt.Sprintf(format, args...)
	msg := "invalid request: " + field + ": " + desc
	st, err := status.New(codes.InvalidArgument, msg).WithDetails(&errdetails.BadRequest{
		FieldViolations: []*errdetails.BadRequest_FieldViolation{{Field: field, Description: desc}},
	})
	if err != nil {
		return status.Error(codes.InvalidArgument, msg)
	}
	return st.Err()
}
