package multisource

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

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
type Router struct {
	engines map[string]*Engine
	names   []string // sorted
}

// New returns a Router in front of engines, which must have valid, distinct
// names.
func New(engines []Engine) (*Router, error) {
	if len(engines) == 0 {
		return nil, errors.New("multisource: no source")
	}
	r := &Router{engines: make(map[string]*Engine, len(engines))}
	for i := range engines {
		e := &engines[i]
		if err := ValidName(e.Name); err != nil {
			return nil, fmt.Errorf("multisource: %w", err)
		}
		if r.engines[e.Name] != nil {
			return nil, fmt.Errorf("multisource: source %q given twice", e.Name)
		}
		if e.Relay == nil || e.Admin == nil {
			return nil, fmt.Errorf("multisource: source %q: Relay and Admin are required", e.Name)
		}
		r.engines[e.Name] = e
		r.names = append(r.names, e.Name)
	}
	slices.Sort(r.names)
	return r, nil
}

// Register adds the routing RelayService and AdminService to g.
func (r *Router) Register(g grpc.ServiceRegistrar) {
	outboxv1.RegisterRelayServiceServer(g, &relayRouter{r: r})
	outboxv1.RegisterAdminServiceServer(g, &adminRouter{r: r})
}

// AdminServer returns the routing AdminService itself, for in-process
// callers that apply access rules themselves (see server.AdminServer).
func (r *Router) AdminServer() outboxv1.AdminServiceServer { return &adminRouter{r: r} }

// Names returns the sources' names, sorted.
func (r *Router) Names() []string { return slices.Clone(r.names) }

// engine returns the engine of source, or an error for the client that
// names the sources there are.
func (r *Router) engine(source, what string) (*Engine, error) {
	if e := r.engines[source]; e != nil {
		return e, nil
	}
	return nil, status.Errorf(codes.InvalidArgument, "%s: no source named %.40q; this server serves %s",
		what, source, strings.Join(r.names, ", "))
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
