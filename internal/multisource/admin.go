package multisource

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/durationpb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/auth"
)

// adminRouter implements outbox.v1.AdminService in front of the engines.
type adminRouter struct {
	outboxv1.UnimplementedAdminServiceServer
	r *Router
}

// GetLag asks every source the caller may see at once (those the request's
// streams name, when it names any: "orders/billing.*", "*/payments", bare
// names for default) and reports each stream under its source, the total
// over the sources that answered, and each source's health: a source that
// cannot answer is left out of the figures and named in sources with the
// reason, so one source down hides nothing of the others; so is a source
// configured but not added yet (Router.SetPending). When no source
// answers, the call fails as a single source's does.
func (a *adminRouter) GetLag(ctx context.Context, req *outboxv1.GetLagRequest) (*outboxv1.GetLagResponse, error) {
	type part struct {
		e   *Engine
		ctx context.Context
		req *outboxv1.GetLagRequest
		res *outboxv1.GetLagResponse
		err error
		// named are the streams the request named in this source itself,
		// not through a * source.
		named map[string]bool
	}
	var parts []*part
	rt := a.r.routes()
	vis, err := visibleSources(ctx, rt)
	for _, v := range vis {
		sub := &outboxv1.GetLagRequest{}
		named := map[string]bool{}
		for _, pat := range req.GetStreams() {
			src, stream := SplitStream(pat)
			if src == "*" || src == v.name {
				sub.Streams = append(sub.Streams, stream)
			}
			if src == v.name {
				named[stream] = true
			}
		}
		if len(req.GetStreams()) > 0 && len(sub.Streams) == 0 {
			continue
		}
		parts = append(parts, &part{e: v.e, ctx: v.ctx, req: sub, named: named})
	}
	if len(parts) == 0 {
		if len(req.GetStreams()) > 0 {
			return nil, invalid("streams", "name no source the caller may see (this server serves %s)", servedTo(ctx, rt.names))
		}
		return nil, err
	}
	var wg sync.WaitGroup
	for _, p := range parts {
		wg.Go(func() { p.res, p.err = p.e.Admin.GetLag(p.ctx, p.req) })
	}
	wg.Wait()
	// A stream reached through a * source ("*/orders") is eventless in
	// the sources that lack it, which says nothing of a mistyped name
	// while another source has it: only a name no source has had, or one
	// named in its own source, keeps never_had_events.
	hadEvents := map[string]bool{}
	for _, p := range parts {
		for _, s := range p.res.GetStreams() {
			if !s.GetNeverHadEvents() {
				hadEvents[s.GetStream()] = true
			}
		}
	}
	out := &outboxv1.GetLagResponse{Total: &outboxv1.StreamLag{}}
	var firstErr error
	var stopped []string
	answered := 0
	unaudited := false
	for _, p := range parts {
		ready, reason := p.e.ready()
		if p.err != nil {
			if refusal(ctx, p.err) {
				return nil, p.err
			}
			if ready {
				reason = status.Convert(p.err).Message()
			}
			ready = false
			firstErr = cmpErr(firstErr, p.err)
		}
		out.Sources = append(out.Sources, &outboxv1.SourceHealth{Name: p.e.Name, Ready: ready, Reason: reason, LagUnknown: p.err != nil})
		if p.err != nil {
			continue
		}
		answered++
		for _, s := range p.res.GetStreams() {
			if p.e.Name != Default {
				s.Source = p.e.Name
			}
			if s.GetNeverHadEvents() && !p.named[s.GetStream()] && hadEvents[s.GetStream()] {
				s.NeverHadEvents = false
			}
			out.Streams = append(out.Streams, s)
		}
		addLag(out.Total, p.res.GetTotal())
		out.ConnectedRelays += p.res.GetConnectedRelays()
		// The stranded counts are as old as the oldest source's audit, and
		// unknown while any source has none.
		switch at := p.res.GetStrandedAuditedAt(); {
		case at == nil:
			unaudited = true
		case out.StrandedAuditedAt == nil || at.AsTime().Before(out.StrandedAuditedAt.AsTime()):
			out.StrandedAuditedAt = at
		}
		// One horizon per cluster: the oldest hold among the sources'.
		if h := p.res.GetXminHorizon(); h != nil && h.GetAgeTransactions() > out.GetXminHorizon().GetAgeTransactions() {
			out.XminHorizon = proto.CloneOf(h)
			if len(parts) > 1 {
				out.XminHorizon.Source = p.e.Name
			}
		}
		if d := p.res.GetDiscoveryStopped(); d != "" {
			stopped = append(stopped, fmt.Sprintf("source %s: %s", p.e.Name, d))
		}
	}
	if answered == 0 {
		return nil, firstErr
	}
	// Sources configured but not added yet have no engine to ask: named
	// with why, as /readyz names them, where the caller may see them and
	// the request takes them.
	for _, name := range slices.Sorted(maps.Keys(rt.pending)) {
		if _, err := forSource(ctx, name); err != nil || rt.engines[name] != nil || !takesSource(req.GetStreams(), name) {
			continue
		}
		out.Sources = append(out.Sources, &outboxv1.SourceHealth{Name: name, Reason: "not added yet: " + rt.pending[name], LagUnknown: true})
	}
	if unaudited {
		out.StrandedAuditedAt = nil
	}
	if len(parts) == 1 {
		out.DiscoveryStopped = parts[0].res.GetDiscoveryStopped()
	} else {
		out.DiscoveryStopped = strings.Join(stopped, "; ")
	}
	return out, nil
}

// takesSource says whether a GetLag of stream patterns (none: every
// stream of every source) covers the source name.
func takesSource(patterns []string, name string) bool {
	for _, pat := range patterns {
		if src, _ := SplitStream(pat); src == "*" || src == name {
			return true
		}
	}
	return len(patterns) == 0
}

func cmpErr(a, b error) error {
	if a != nil {
		return a
	}
	return b
}

// addLag adds one source's total to the sum over sources: counts and rates
// add up, the oldest figures are the oldest of any source.
func addLag(sum, t *outboxv1.StreamLag) {
	if t == nil {
		return
	}
	sum.PendingEvents += t.GetPendingEvents()
	sum.PendingAggregates += t.GetPendingAggregates()
	sum.LeasedAggregates += t.GetLeasedAggregates()
	sum.ParkedAggregates += t.GetParkedAggregates()
	sum.GapAggregates += t.GetGapAggregates()
	sum.BackingOffAggregates += t.GetBackingOffAggregates()
	sum.DeliveredPerSecond += t.GetDeliveredPerSecond()
	sum.DeliveredLastMinute += t.GetDeliveredLastMinute()
	sum.ReadyAggregates += t.GetReadyAggregates()
	sum.StrandedEvents += t.GetStrandedEvents()
	sum.StalledAggregates += t.GetStalledAggregates()
	sum.IdleRelays += t.GetIdleRelays()
	if older(t.GetOldestPendingAge(), sum.GetOldestPendingAge()) {
		sum.OldestPendingAge = t.GetOldestPendingAge()
		sum.OldestPendingCreatedAt = t.GetOldestPendingCreatedAt()
	}
	if older(t.GetOldestHeldAge(), sum.GetOldestHeldAge()) {
		sum.OldestHeldAge = t.GetOldestHeldAge()
	}
}

func older(a, b *durationpb.Duration) bool {
	return a != nil && (b == nil || a.AsDuration() > b.AsDuration())
}

// ListRelays lists the relays of every source the caller may see, their
// streams written as addresses ("orders/billing"). A source that cannot
// answer is left out and named in skipped_sources; when none can, the call
// fails.
func (a *adminRouter) ListRelays(ctx context.Context, req *outboxv1.ListRelaysRequest) (*outboxv1.ListRelaysResponse, error) {
	vis, err := visibleSources(ctx, a.r.routes())
	if err != nil {
		return nil, err
	}
	out := &outboxv1.ListRelaysResponse{}
	var firstErr error
	answered := 0
	for _, v := range vis {
		res, err := v.e.Admin.ListRelays(v.ctx, req)
		if err != nil {
			if status.Code(err) == codes.PermissionDenied || ctx.Err() != nil {
				return nil, err
			}
			firstErr = cmpErr(firstErr, err)
			out.SkippedSources = append(out.SkippedSources, &outboxv1.SourceHealth{Name: v.name, Reason: status.Convert(err).Message()})
			continue
		}
		answered++
		for _, rl := range res.GetRelays() {
			if v.name != Default {
				rl.Source = v.name
			}
			for i, s := range rl.Streams {
				rl.Streams[i] = JoinStream(v.name, s)
			}
			for i, s := range rl.ExcludeStreams {
				rl.ExcludeStreams[i] = JoinStream(v.name, s)
			}
			out.Relays = append(out.Relays, rl)
		}
	}
	if answered == 0 {
		return nil, firstErr
	}
	return out, nil
}

// route finds the engine an admin request is for: the source of its
// "stream" field, or of its "filter" message's, or of its "event_id"
// ("source/event_id", as the sinks' message ids name events of a source
// other than default); a bare name or id, or none, is default's. It
// returns the source, the request with the source stripped, and the
// context for that engine. A stream and an event id of different sources
// are refused.
func route[Req proto.Message](a *adminRouter, ctx context.Context, req Req) (string, *Engine, context.Context, Req, error) {
	source, named, what := Default, "", "stream"
	var strips []func(protoreflect.Message)
	msg, field := streamField(req.ProtoReflect())
	if field != nil {
		addr := msg.Get(field).String()
		src, stream := SplitStream(addr)
		if containsStar(src) {
			return "", nil, nil, req, invalid(string(field.Name()), "%.140q spans sources: name one source", addr)
		}
		named = string(field.Name()) // a bare name is default's
		if src != Default || addr != stream {
			source, what = src, string(field.Name())
			strips = append(strips, func(clone protoreflect.Message) {
				m, f := streamField(clone)
				m.Set(f, protoreflect.ValueOfString(stream))
			})
		}
	}
	if f := eventIDField(req.ProtoReflect()); f != nil {
		addr := req.ProtoReflect().Get(f).String()
		if src, id, ok := strings.Cut(addr, "/"); ok {
			if named != "" && src != source {
				return "", nil, nil, req, invalid("event_id", "%.80q is of source %q, but %s names source %q", addr, src, named, source)
			}
			source, what = src, "event_id"
			strips = append(strips, func(clone protoreflect.Message) {
				clone.Set(f, protoreflect.ValueOfString(id))
			})
		}
	}
	e, err := a.r.routes().engine(ctx, source, what)
	if err != nil {
		return "", nil, nil, req, err
	}
	sctx, err := forSource(ctx, source)
	if err != nil {
		return "", nil, nil, req, err
	}
	if len(strips) > 0 {
		clone := proto.Clone(req).(Req)
		for _, strip := range strips {
			strip(clone.ProtoReflect())
		}
		req = clone
	}
	return source, e, sctx, req, nil
}

// eventIDField is the request's set "event_id" field, or nil.
func eventIDField(m protoreflect.Message) protoreflect.FieldDescriptor {
	if f := m.Descriptor().Fields().ByName("event_id"); f != nil && f.Kind() == protoreflect.StringKind && m.Has(f) {
		return f
	}
	return nil
}

// streamField returns the message holding the request's stream (itself or
// its filter) and that field, or nil when it has none set.
func streamField(m protoreflect.Message) (protoreflect.Message, protoreflect.FieldDescriptor) {
	fields := m.Descriptor().Fields()
	if f := fields.ByName("stream"); f != nil && f.Kind() == protoreflect.StringKind && m.Has(f) {
		return m, f
	}
	if f := fields.ByName("filter"); f != nil && f.Kind() == protoreflect.MessageKind && m.Has(f) {
		return streamField(m.Get(f).Message())
	}
	return nil, nil
}

// nameSource makes an engine's answer name source, when it is not
// default: every Event in it gets Event.source, and every other message's
// "stream" field becomes the address "source/stream", as requests name it
// (so an Aggregate, Attempt or OperatorAction read from an answer can be
// sent back as it is); an OperatorAction's request_json names it as the
// caller wrote it (nameRequest). Default's answers are left as a
// single-source server gives them.
func nameSource(source string, m protoreflect.Message) {
	if source == Default || !m.IsValid() {
		return
	}
	switch x := m.Interface().(type) {
	case *outboxv1.Event:
		x.Source = source
		return
	case *outboxv1.OperatorAction:
		// An action on every stream (a bulk filter without a stream, which
		// the engine records as "*") names its source too: "orders/*".
		x.Stream = JoinStream(source, x.Stream)
		x.RequestJson = nameRequest(source, x.RequestJson)
		return
	}
	m.Range(func(f protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		switch {
		case f.Name() == "stream" && f.Kind() == protoreflect.StringKind && !f.IsList():
			m.Set(f, protoreflect.ValueOfString(JoinStream(source, v.String())))
		case f.Kind() != protoreflect.MessageKind || f.IsMap():
		case f.IsList():
			for i := 0; i < v.List().Len(); i++ {
				nameSource(source, v.List().Get(i).Message())
			}
		default:
			nameSource(source, v.Message())
		}
		return true
	})
}

func routed[Req, Resp proto.Message](a *adminRouter, ctx context.Context, req Req,
	call func(outboxv1.AdminServiceServer, context.Context, Req) (Resp, error)) (Resp, error) {
	source, e, sctx, req, err := route(a, ctx, req)
	if err != nil {
		var zero Resp
		return zero, err
	}
	resp, err := call(e.Admin, sctx, req)
	if err == nil {
		nameSource(source, resp.ProtoReflect())
	}
	if status.Code(err) == codes.NotFound && source == Default && eventIDField(req.ProtoReflect()) != nil {
		// A bare id is default's: say how to name another source's (one
		// the caller may see).
		vis, _ := visibleSources(ctx, a.r.routes())
		if others := slices.DeleteFunc(sourceNames(vis), func(n string) bool { return n == Default }); len(others) > 0 {
			err = status.Errorf(codes.NotFound, "%s in source default; an event of another source (%s) is named SOURCE/EVENT_ID",
				status.Convert(err).Message(), strings.Join(others, ", "))
		}
	}
	return resp, err
}

func (a *adminRouter) GetAggregate(ctx context.Context, req *outboxv1.GetAggregateRequest) (*outboxv1.GetAggregateResponse, error) {
	return routed(a, ctx, req, outboxv1.AdminServiceServer.GetAggregate)
}

func (a *adminRouter) ListEvents(ctx context.Context, req *outboxv1.ListEventsRequest) (*outboxv1.ListEventsResponse, error) {
	return spanned(a, ctx, req, outboxv1.AdminServiceServer.ListEvents, listSources)
}

func (a *adminRouter) RetryAggregate(ctx context.Context, req *outboxv1.RetryAggregateRequest) (*outboxv1.RetryAggregateResponse, error) {
	return routed(a, ctx, req, outboxv1.AdminServiceServer.RetryAggregate)
}

func (a *adminRouter) SkipEvent(ctx context.Context, req *outboxv1.SkipEventRequest) (*outboxv1.SkipEventResponse, error) {
	return routed(a, ctx, req, outboxv1.AdminServiceServer.SkipEvent)
}

func (a *adminRouter) ListAggregates(ctx context.Context, req *outboxv1.ListAggregatesRequest) (*outboxv1.ListAggregatesResponse, error) {
	return spanned(a, ctx, req, outboxv1.AdminServiceServer.ListAggregates, listSources)
}

func (a *adminRouter) ListAttempts(ctx context.Context, req *outboxv1.ListAttemptsRequest) (*outboxv1.ListAttemptsResponse, error) {
	return routed(a, ctx, req, outboxv1.AdminServiceServer.ListAttempts)
}

func (a *adminRouter) BulkRetry(ctx context.Context, req *outboxv1.BulkRetryRequest) (*outboxv1.BulkRetryResponse, error) {
	return spanned(a, ctx, req, outboxv1.AdminServiceServer.BulkRetry, bulkSources[*outboxv1.BulkRetryRequest](addRetry))
}

func (a *adminRouter) BulkSkip(ctx context.Context, req *outboxv1.BulkSkipRequest) (*outboxv1.BulkSkipResponse, error) {
	return spanned(a, ctx, req, outboxv1.AdminServiceServer.BulkSkip, bulkSources[*outboxv1.BulkSkipRequest](addSkip))
}

func (a *adminRouter) Republish(ctx context.Context, req *outboxv1.RepublishRequest) (*outboxv1.RepublishResponse, error) {
	return routed(a, ctx, req, outboxv1.AdminServiceServer.Republish)
}

func (a *adminRouter) ListOperatorActions(ctx context.Context, req *outboxv1.ListOperatorActionsRequest) (*outboxv1.ListOperatorActionsResponse, error) {
	return spanned(a, ctx, req, outboxv1.AdminServiceServer.ListOperatorActions, listSources)
}

// Purge with a stream purges its source ("orders/billing"; bare: default).
// Without one, on a server of several sources, it purges every source the
// caller may purge entirely, one after another in name order: each
// source's progress goes out with PurgeResponse.source set and done unset,
// and a final message sums them and lists each source's final figures.
// Sources the token may access no stream of are left out; one it may
// access only some streams of refuses the whole purge before any source
// starts, as a single source refuses a stream-limited token a purge of
// every stream. A source failing ends the purge with its error, naming
// it; the sources before it stay purged.
func (a *adminRouter) Purge(req *outboxv1.PurgeRequest, stream outboxv1.AdminService_PurgeServer) error {
	// One snapshot of the sources for the whole walk (sources may be added
	// and removed meanwhile).
	rt := a.r.routes()
	if req.GetStream() != "" || len(rt.names) == 1 {
		source, e, ctx, req, err := route(a, stream.Context(), req)
		if err != nil {
			return err
		}
		return e.Admin.Purge(req, &purgeStream{AdminService_PurgeServer: stream, ctx: ctx, source: source})
	}
	parts, err := visibleSources(stream.Context(), rt)
	if err != nil {
		return err
	}
	for _, p := range parts {
		if err := auth.AuthorizeAllStreams(p.ctx); err != nil {
			return status.Errorf(codes.PermissionDenied, "source %s: %s; name a stream of it (%s) to purge it", p.name,
				status.Convert(err).Message(), JoinStream(p.name, "STREAM"))
		}
	}
	total := &outboxv1.PurgeResponse{Done: true}
	// What the sources purged so far deleted, for the error of one that
	// fails: a purge over several sources does not undo them (it is
	// idempotent: run again, it finishes the job).
	var done []string
	for _, p := range parts {
		ps := &purgeStream{AdminService_PurgeServer: stream, ctx: p.ctx, source: p.name, partial: true}
		if err := p.e.Admin.Purge(req, ps); err != nil {
			before := "no source was purged before it"
			if len(done) > 0 {
				before = "purged before it: " + strings.Join(done, "; ")
			}
			st := status.Convert(err)
			return status.Errorf(st.Code(), "source %s: %s (%s)", p.name, st.Message(), before)
		}
		last := ps.last
		if last == nil {
			return status.Errorf(codes.Internal, "source %s: the purge ended without reporting it done", p.name)
		}
		total.Deleted += last.GetDeleted()
		total.Batches += last.GetBatches()
		total.Remaining += last.GetRemaining()
		if el := last.GetElapsed(); el != nil {
			sum := total.GetElapsed().AsDuration() + el.AsDuration()
			total.Elapsed = durationpb.New(sum)
		}
		last.Done = true
		total.Sources = append(total.Sources, last)
		done = append(done, fmt.Sprintf("source %s, %d deleted", p.name, last.GetDeleted()))
	}
	return stream.Send(total)
}

// purgeStream is a Purge stream with the context its engine must see,
// whose messages name their source. A part of a purge over several sources
// is never done itself: it keeps its last message for the final one.
type purgeStream struct {
	outboxv1.AdminService_PurgeServer
	ctx     context.Context
	source  string
	partial bool
	last    *outboxv1.PurgeResponse
}

func (s *purgeStream) Context() context.Context { return s.ctx }

func (s *purgeStream) Send(r *outboxv1.PurgeResponse) error {
	if s.source != Default {
		r.Source = s.source
	}
	if s.partial {
		s.last = proto.CloneOf(r)
		if r.Done {
			r = proto.CloneOf(r)
			r.Done = false
		}
	}
	return s.AdminService_PurgeServer.Send(r)
}

// nameRequest rewrites an operator action's request_json, which the engine
// recorded from the request it saw (source stripped), to name source as the
// caller did: its "stream" and its filter's as "source/stream" ("source/*"
// for a filter without a stream, as the action's stream names it), its
// "event_id" as "source/event_id". The other values are kept byte for
// byte. A record that is not a JSON object is left as it is.
func nameRequest(source, request string) string {
	var rec map[string]json.RawMessage
	if json.Unmarshal([]byte(request), &rec) != nil || rec == nil {
		return request
	}
	address := func(m map[string]json.RawMessage, key string) {
		var v string
		if raw, ok := m[key]; ok && json.Unmarshal(raw, &v) == nil {
			m[key], _ = json.Marshal(JoinStream(source, v))
		}
	}
	address(rec, "stream")
	address(rec, "event_id")
	var filter map[string]json.RawMessage
	if raw, ok := rec["filter"]; ok && json.Unmarshal(raw, &filter) == nil && filter != nil {
		var v string
		if raw, ok := filter["stream"]; ok && json.Unmarshal(raw, &v) == nil && v == "" {
			filter["stream"] = json.RawMessage(`"*"`) // every stream, as the engine records it
		}
		address(filter, "stream")
		rec["filter"] = json.RawMessage(marshal(filter))
	}
	if out := marshal(rec); out != "" {
		return out
	}
	return request
}

// marshal is m as compact JSON, HTML characters unescaped (an
// error_contains of "<" stays "<"); "" if it cannot be.
func marshal(m map[string]json.RawMessage) string {
	var out bytes.Buffer
	enc := json.NewEncoder(&out)
	enc.SetEscapeHTML(false)
	if enc.Encode(m) != nil {
		return ""
	}
	return strings.TrimSuffix(out.String(), "\n")
}
