package multisource

import (
	"context"
	"fmt"
	"sync"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/auth"
	"github.com/outboxd/outboxd/internal/limits"
	"github.com/outboxd/outboxd/server"
)

// relayRouter implements outbox.v1.RelayService in front of the engines.
type relayRouter struct {
	outboxv1.UnimplementedRelayServiceServer
	r *Router
}

// subscription is what a SubscribeRequest's names resolve to: one source,
// and its streams without the source.
type subscription struct {
	source          string
	streams, except []string
}

// resolveSubscription finds the one source a subscription names and strips
// it from the names. "source/*" in streams means every stream of source (an
// engine's empty stream list) and must be that source's only entry there.
// A name whose source part holds '*' would span sources, and so would names
// of two sources: both are refused, naming the field.
func (r *Router) resolveSubscription(req *outboxv1.SubscribeRequest) (subscription, error) {
	sub := subscription{source: ""}
	wildcard := -1
	take := func(field string, i int, name string) (string, error) {
		f := fmt.Sprintf("%s[%d]", field, i)
		src, stream := SplitStream(name)
		switch {
		case containsStar(src):
			return "", invalid(f, "%.140q spans sources: a Subscribe stream serves one source; open one per source (outboxd relay --route does)", name)
		case sub.source != "" && src != sub.source:
			return "", invalid(f, "%.140q is of source %q, but the subscription already names source %q: a Subscribe stream serves one source; open one per source", name, src, sub.source)
		}
		sub.source = src
		return stream, nil
	}
	for i, name := range req.GetStreams() {
		stream, err := take("streams", i, name)
		if err != nil {
			return sub, err
		}
		if stream == "*" {
			wildcard = i
			continue
		}
		sub.streams = append(sub.streams, stream)
	}
	if wildcard >= 0 && len(req.GetStreams()) > 1 {
		return sub, invalid(fmt.Sprintf("streams[%d]", wildcard), "%.140q (every stream of the source) must be the only entry of streams", req.GetStreams()[wildcard])
	}
	for i, name := range req.GetExcludeStreams() {
		stream, err := take("exclude_streams", i, name)
		if err != nil {
			return sub, err
		}
		sub.except = append(sub.except, stream)
	}
	if sub.source == "" {
		sub.source = Default
	}
	return sub, nil
}

func containsStar(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] == '*' {
			return true
		}
	}
	return false
}

func (rr *relayRouter) Subscribe(req *outboxv1.SubscribeRequest, stream outboxv1.RelayService_SubscribeServer) error {
	sub, err := rr.r.resolveSubscription(req)
	if err != nil {
		return err
	}
	e, err := rr.r.routes().subscribable(stream.Context(), sub.source)
	if err != nil {
		return err
	}
	ctx, err := forSource(stream.Context(), sub.source)
	if err != nil {
		return err
	}
	inner := proto.CloneOf(req)
	inner.Streams, inner.ExcludeStreams = sub.streams, sub.except
	err = e.Relay.Subscribe(inner, &sourceStream{RelayService_SubscribeServer: stream, ctx: ctx, source: sub.source})
	if status.Code(err) == codes.Unavailable {
		if rt := rr.r.routes(); rt.retiring[sub.source] || rt.removed[sub.source] {
			// Its engine stopped because the source is being removed, not
			// because the server is: the relay reconnects and is told so.
			return status.Errorf(codes.Unavailable, "source %q is being removed from this server's configuration; its stream ended", sub.source)
		}
	}
	return err
}

// sourceStream is a Subscribe stream as an engine sees it: the caller's
// principal projected onto the source, and every delivery bound to the
// source on its way out (Event.source, the token's prefix). Default's
// deliveries go out unchanged.
//
// It rewrites SubscribeResponse.event and lease_token, one delivery per
// message: a field that carries further deliveries in one message must be
// rewritten here too.
type sourceStream struct {
	outboxv1.RelayService_SubscribeServer
	ctx    context.Context
	source string
}

func (s *sourceStream) Context() context.Context { return s.ctx }

// Send names the source in every delivery of d and binds its token to it,
// whether d is one delivery or a batch of them (SubscribeResponse.deliveries,
// for a relay that accepts batches).
func (s *sourceStream) Send(d *outboxv1.SubscribeResponse) error {
	if s.source != Default {
		s.bind(d)
		for _, b := range d.Deliveries {
			s.bind(b)
		}
	}
	return s.RelayService_SubscribeServer.Send(d)
}

func (s *sourceStream) bind(d *outboxv1.SubscribeResponse) {
	if d.Event != nil {
		d.Event.Source = s.source
	}
	if d.LeaseToken != "" {
		d.LeaseToken = wrapToken(s.source, d.LeaseToken)
	}
}

// Ack splits the acks by their tokens' sources and gives each engine its
// own, at once. An ack whose token names a source this server does not
// serve gets ACK_STATUS_INVALID. When every ack is of one source the
// engine's answer is returned as it is, errors included; otherwise an
// engine that fails (its database down) fails only its own acks, each
// answered ACK_STATUS_RETRY, so one source down holds up no other's acks.
// A token that may not access one of the sources refuses the whole request
// (PermissionDenied) before any engine is called; one an engine refuses
// for an event's stream refuses the request too, though the other sources'
// acks may have landed (acks are idempotent: sent again, they answer
// ALREADY_PUBLISHED).
func (rr *relayRouter) Ack(ctx context.Context, req *outboxv1.AckRequest) (*outboxv1.AckResponse, error) {
	rt := rr.r.routes()
	items := req.GetAcks()
	// Refused here, in the engines' words, rather than handed to an
	// engine with the caller's token unnarrowed to its source.
	if len(items) == 0 || len(items) > limits.MaxAckItems {
		return nil, invalid("acks", "must hold 1 to %d items, got %d", limits.MaxAckItems, len(items))
	}
	results := make([]*outboxv1.AckResult, len(items))
	type part struct {
		e       *Engine
		ctx     context.Context
		index   []int
		req     *outboxv1.AckRequest
		res     *outboxv1.AckResponse
		err     error
		changed bool
	}
	parts := make(map[string]*part)
	var order []*part
	for i, it := range items {
		src, token := unwrapToken(it.GetLeaseToken())
		p := parts[src]
		if p == nil {
			e := rt.engines[src]
			if _, pending := rt.pending[src]; e == nil && pending {
				// Served by the replica that leased it; this one may
				// serve it soon, and another replica now.
				results[i] = &outboxv1.AckResult{EventId: it.GetEventId(), Status: outboxv1.AckStatus_ACK_STATUS_RETRY,
					Message: "lease_token: " + pendingMessage(src)}
				continue
			}
			if e == nil {
				results[i] = &outboxv1.AckResult{EventId: it.GetEventId(), Status: outboxv1.AckStatus_ACK_STATUS_INVALID,
					Message: rt.unknownTokenSource(src)}
				continue
			}
			sctx, err := forSource(ctx, src)
			if err != nil {
				return nil, err
			}
			p = &part{e: e, ctx: sctx, req: &outboxv1.AckRequest{}}
			parts[src] = p
			order = append(order, p)
		}
		p.index = append(p.index, i)
		if token != it.GetLeaseToken() {
			p.changed = true
			it = &outboxv1.AckItem{EventId: it.GetEventId(), LeaseToken: token}
		}
		p.req.Acks = append(p.req.Acks, it)
	}
	if len(order) == 1 && len(order[0].index) == len(items) {
		p := order[0]
		if !p.changed {
			return p.e.Relay.Ack(p.ctx, req)
		}
		return p.e.Relay.Ack(p.ctx, p.req)
	}
	var wg sync.WaitGroup
	for _, p := range order {
		wg.Go(func() { p.res, p.err = p.e.Relay.Ack(p.ctx, p.req) })
	}
	wg.Wait()
	for _, p := range order {
		if c := status.Code(p.err); c == codes.PermissionDenied || c == codes.Unauthenticated || (p.err != nil && ctx.Err() != nil) {
			return nil, p.err
		}
	}
	for _, p := range order {
		for k, i := range p.index {
			switch {
			case p.err != nil:
				results[i] = &outboxv1.AckResult{EventId: items[i].GetEventId(), Status: outboxv1.AckStatus_ACK_STATUS_RETRY,
					Message: fmt.Sprintf("source %q: %s", p.e.Name, status.Convert(p.err).Message())}
			case k < len(p.res.GetResults()):
				results[i] = p.res.GetResults()[k]
			default:
				results[i] = &outboxv1.AckResult{EventId: items[i].GetEventId(), Status: outboxv1.AckStatus_ACK_STATUS_RETRY,
					Message: fmt.Sprintf("source %q gave no result for this ack", p.e.Name)}
			}
		}
	}
	return &outboxv1.AckResponse{Results: results}, nil
}

// AckStream answers each request as Ack would, routed the same way, until
// EndAckStreams (see server.ServeAckStream).
func (rr *relayRouter) AckStream(stream outboxv1.RelayService_AckStreamServer) error {
	return server.ServeAckStream(stream, rr.r.acksEnded, rr.Ack)
}

func (rt *routes) unknownTokenSource(src string) string {
	if rt.removed[src] {
		return removedMessage(src)
	}
	names := rt.names
	return fmt.Sprintf("lease_token is bound to source %.40q, which this replica does not serve (it serves %v): are all replicas given the same --source list?; nothing changed",
		src, names)
}

// leaseCall resolves a Nack's or ExtendLease's token to its engine, with
// the context that engine must see and the engine's own token.
func (rr *relayRouter) leaseCall(ctx context.Context, token string) (*Engine, context.Context, string, error) {
	src, inner := unwrapToken(token)
	rt := rr.r.routes()
	e := rt.engines[src]
	if _, pending := rt.pending[src]; e == nil && pending {
		return nil, nil, "", status.Error(codes.Unavailable, "lease_token: "+pendingMessage(src))
	}
	if e == nil {
		return nil, nil, "", status.Error(codes.FailedPrecondition, rt.unknownTokenSource(src))
	}
	sctx, err := forSource(ctx, src)
	if err != nil {
		return nil, nil, "", err
	}
	return e, sctx, inner, nil
}

// Nack goes to the engine of the token's source. A token of a source this
// replica does not serve is FAILED_PRECONDITION: nothing changed.
func (rr *relayRouter) Nack(ctx context.Context, req *outboxv1.NackRequest) (*outboxv1.NackResponse, error) {
	e, sctx, token, err := rr.leaseCall(ctx, req.GetLeaseToken())
	if err != nil {
		return nil, err
	}
	if token != req.GetLeaseToken() {
		req = proto.CloneOf(req)
		req.LeaseToken = token
	}
	return e.Relay.Nack(sctx, req)
}

// ExtendLease goes to the engine of the token's source, as Nack does.
func (rr *relayRouter) ExtendLease(ctx context.Context, req *outboxv1.ExtendLeaseRequest) (*outboxv1.ExtendLeaseResponse, error) {
	e, sctx, token, err := rr.leaseCall(ctx, req.GetLeaseToken())
	if err != nil {
		return nil, err
	}
	if token != req.GetLeaseToken() {
		req = proto.CloneOf(req)
		req.LeaseToken = token
	}
	return e.Relay.ExtendLease(sctx, req)
}

// ListSources names the live sources (not those being removed) the
// caller's token may subscribe to: those auth.Principal.ForSource grants
// any stream of, and with streams set those where it grants each of them
// ("*": every stream of the source), as server.SourceListed decides. The
// engines are not asked: which sources a replica serves is the Router's to
// say, and a source whose database is down is still served (its Subscribe
// streams wait for it).
func (rr *relayRouter) ListSources(ctx context.Context, req *outboxv1.ListSourcesRequest) (*outboxv1.ListSourcesResponse, error) {
	if err := server.CheckListSources(req); err != nil {
		return nil, err
	}
	p, restricted := auth.PrincipalFrom(ctx)
	out := &outboxv1.ListSourcesResponse{Sources: []string{}}
	for _, name := range rr.r.routes().live() {
		if restricted && !server.SourceListed(p, name, req.GetStreams()) {
			continue
		}
		out.Sources = append(out.Sources, name)
	}
	return out, nil
}
