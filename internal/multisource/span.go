package multisource

// Admin calls for every source (no stream on a server of several, or a
// stream "*/pattern"): the listings (ListEvents, ListAggregates,
// ListOperatorActions) page through every source the caller may see, and
// the bulk actions (BulkRetry, BulkSkip) act on each of them once. A server
// of one source answers a request without a stream as before, through
// route.

import (
	"context"
	"fmt"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
)

const (
	// defaultPageSize is the engines' page size when a request sets none
	// (the proto's documented default).
	defaultPageSize = 100
	// spanPageBytes: a page over sources goes on into the next source only
	// while it is smaller than this, so that with what the next engine adds
	// (at most its own bound, 2 MiB for ListEvents) it stays under gRPC's
	// default 4 MiB receive limit.
	spanPageBytes = 1 << 20
	// spanTokenSep separates the source a listing over sources continues in
	// from that engine's page token (base64url, which has no ':').
	spanTokenSep = ":"
	// maxBulkSample is the most aggregates a bulk action's sample lists.
	maxBulkSample = 20
)

// spans reports whether an admin request is for every source: it names
// no source, on a server of several (no stream, its own or its filter's,
// and no event id), or its stream names every source ("*/billing.*", on
// any server). It returns the request each engine is to see: the stream
// without its "*/".
func spans[Req proto.Message](rt *routes, req Req) (Req, bool) {
	m := req.ProtoReflect()
	msg, f := streamField(m)
	if msg == nil {
		// A page token of a listing over sources goes on as one even on a
		// server left with one source (engine tokens have no ':'), so that
		// one naming a removed source says so.
		tok := m.Descriptor().Fields().ByName("page_token")
		overSources := tok != nil && strings.Contains(m.Get(tok).String(), spanTokenSep)
		return req, (len(rt.names) > 1 || overSources) && eventIDField(m) == nil
	}
	src, stream := SplitStream(msg.Get(f).String())
	if src != "*" {
		return req, false
	}
	clone := proto.Clone(req).(Req)
	cm, cf := streamField(clone.ProtoReflect())
	cm.Set(cf, protoreflect.ValueOfString(stream))
	return clone, true
}

// source is a source the caller may see: its engine, and the context that
// engine must see (forSource).
type source struct {
	name string
	e    *Engine
	ctx  context.Context
}

// errNoSource refuses a call over every source from a token that may access
// no stream of any.
var errNoSource = status.Error(codes.PermissionDenied, "the token may access no stream of any source")

// visibleSources returns the sources of rt the caller's token may see, in
// name order, or errNoSource when there is none.
func visibleSources(ctx context.Context, rt *routes) ([]source, error) {
	var out []source
	for _, name := range rt.names {
		if sctx, err := forSource(ctx, name); err == nil {
			out = append(out, source{name, rt.engines[name], sctx})
		}
	}
	if len(out) == 0 {
		return nil, errNoSource
	}
	return out, nil
}

func sourceNames(vis []source) []string {
	names := make([]string, len(vis))
	for i, v := range vis {
		names[i] = v.name
	}
	return names
}

// refusal reports whether a source's error says something about the
// request or the caller (INVALID_ARGUMENT, PERMISSION_DENIED) or the call
// was cancelled, rather than about that source: it fails a call over
// sources instead of leaving the source out.
func refusal(ctx context.Context, err error) bool {
	c := status.Code(err)
	return c == codes.InvalidArgument || c == codes.PermissionDenied || ctx.Err() != nil
}

// spanned answers req with over when it is for every source (spans), with
// the engine of its source (routed) otherwise.
func spanned[Req, Resp proto.Message](a *adminRouter, ctx context.Context, req Req,
	call func(outboxv1.AdminServiceServer, context.Context, Req) (Resp, error),
	over func(context.Context, *routes, Req, func(outboxv1.AdminServiceServer, context.Context, Req) (Resp, error)) (Resp, error)) (Resp, error) {
	rt := a.r.routes()
	if sub, ok := spans(rt, req); ok {
		return over(ctx, rt, sub, call)
	}
	return routed(a, ctx, req, call)
}

// listSources answers a listing for every source (see spans): it reads the sources the caller may see in name order, filling
// the page from one and going on into the next, each source's items named
// as route's answers name them. Its next_page_token is "SOURCE:TOKEN", the
// source to go on in and that engine's own token (empty to start it).
//
// A source that cannot answer (its database down) is left out and named in
// the page's skipped_sources with the reason, as GetLag leaves it out of
// its figures; when no source read answers, the call fails with the first
// source's error. Refusals (INVALID_ARGUMENT, PERMISSION_DENIED) fail the
// call: they say something about the request, not the source. A source
// that refuses the token (PERMISSION_DENIED: it may see only some streams
// of that source, and the request spans them all, naming no stream or
// "*/*") is left out and named in skipped_sources too, its reason saying
// to name a stream of it; the engine still decides what the token may
// see. When the first page finds no source that lets the token list, the
// call fails with PERMISSION_DENIED giving each source's reason.
func listSources[Req, Resp proto.Message](ctx context.Context, rt *routes, req Req,
	call func(outboxv1.AdminServiceServer, context.Context, Req) (Resp, error)) (Resp, error) {
	var zero Resp
	rm := req.ProtoReflect()
	fSize, fToken := rm.Descriptor().Fields().ByName("page_size"), rm.Descriptor().Fields().ByName("page_token")
	size := int(rm.Get(fSize).Uint())
	if size == 0 {
		size = defaultPageSize
	}
	start, inner, err := parseSpanToken(ctx, rt, rm.Get(fToken).String())
	if err != nil {
		return zero, err
	}
	vis, err := visibleSources(ctx, rt)
	if err != nil {
		return zero, err
	}
	out := zero.ProtoReflect().New()
	fItems := itemsField(out.Descriptor())
	fNext, fSkipped := out.Descriptor().Fields().ByName("next_page_token"), out.Descriptor().Fields().ByName("skipped_sources")
	items := out.Mutable(fItems).List()
	skip := func(name, reason string) {
		out.Mutable(fSkipped).List().Append(protoreflect.ValueOfMessage((&outboxv1.SourceHealth{Name: name,
			Reason: reason}).ProtoReflect()))
	}
	var firstErr error
	var scoped []string
	seen, answered := 0, 0
	for _, v := range vis {
		if v.name < start {
			continue
		}
		seen++
		if items.Len() >= size || (items.Len() > 0 && proto.Size(out.Interface()) >= spanPageBytes) {
			out.Set(fNext, protoreflect.ValueOfString(v.name+spanTokenSep))
			break
		}
		sub := proto.Clone(req).(Req)
		sm := sub.ProtoReflect()
		sm.Set(fSize, protoreflect.ValueOfUint32(uint32(size-items.Len())))
		sm.Clear(fToken)
		if v.name == start && inner != "" {
			sm.Set(fToken, protoreflect.ValueOfString(inner))
		}
		res, err := call(v.e.Admin, v.ctx, sub)
		if err != nil {
			if status.Code(err) == codes.PermissionDenied && ctx.Err() == nil {
				// The token may see only some streams of this source, not
				// the streams the request spans.
				msg, _ := strings.CutSuffix(status.Convert(err).Message(), "; name the streams to access")
				why := fmt.Sprintf("%s; name a stream of source %s to list it (%s/STREAM)", msg, v.name, v.name)
				skip(v.name, why)
				scoped = append(scoped, "source "+v.name+": "+why)
				continue
			}
			if refusal(ctx, err) {
				return zero, err
			}
			firstErr = cmpErr(firstErr, err)
			skip(v.name, status.Convert(err).Message())
			continue
		}
		answered++
		nameSource(v.name, res.ProtoReflect())
		got := res.ProtoReflect().Get(fItems).List()
		for i := range got.Len() {
			items.Append(got.Get(i))
		}
		if next := res.ProtoReflect().Get(fNext).String(); next != "" {
			// The engine has more (or ended its page early): go on there.
			out.Set(fNext, protoreflect.ValueOfString(v.name+spanTokenSep+next))
			break
		}
	}
	switch {
	case seen == 0:
		return zero, errNoSource // the token goes on in a source it may not see
	case answered == 0 && firstErr != nil:
		return zero, firstErr
	case answered == 0 && len(scoped) > 0 && start == "" && out.Get(fNext).String() == "":
		// No source the token may see lets it list what it asked.
		return zero, status.Error(codes.PermissionDenied, strings.Join(scoped, "; "))
	}
	return out.Interface().(Resp), nil
}

// itemsField is a list response's repeated message field (events,
// aggregates, actions).
func itemsField(d protoreflect.MessageDescriptor) protoreflect.FieldDescriptor {
	fields := d.Fields()
	for i := range fields.Len() {
		if f := fields.Get(i); f.IsList() && f.Kind() == protoreflect.MessageKind && f.Name() != "skipped_sources" {
			return f
		}
	}
	panic("multisource: " + string(d.FullName()) + " has no list of items")
}

// parseSpanToken reads a listing over sources' page token: the source to go
// on in and its engine's token. An empty token starts at the first source.
func parseSpanToken(ctx context.Context, rt *routes, tok string) (source, inner string, err error) {
	if tok == "" {
		return "", "", nil
	}
	source, inner, ok := strings.Cut(tok, spanTokenSep)
	if !ok || ValidName(source) != nil {
		return "", "", invalid("page_token", "%.80q is not a token of a listing over every source (SOURCE%sTOKEN, as next_page_token gives it); "+
			"a token of one source's listing goes with the stream it was issued for", tok, spanTokenSep)
	}
	if rt.engines[source] == nil {
		why := "is not a source this server serves"
		if rt.removed[source] {
			why = "was removed from this server's configuration"
		}
		return "", "", invalid("page_token", "goes on in source %q, which %s (it serves %s): start the listing again without page_token",
			source, why, servedTo(ctx, rt.names))
	}
	return source, inner, nil
}

// bulkSources returns the action over every source (bulkEach) of a bulk
// action whose sources' answers add up with add.
func bulkSources[Req interface {
	proto.Message
	GetDryRun() bool
}, Resp proto.Message](add func(sum, part Resp)) func(context.Context, *routes, Req, func(outboxv1.AdminServiceServer, context.Context, Req) (Resp, error)) (Resp, error) {
	return func(ctx context.Context, rt *routes, req Req, call func(outboxv1.AdminServiceServer, context.Context, Req) (Resp, error)) (Resp, error) {
		return bulkEach(ctx, rt, req, call, add)
	}
}

// bulkEach applies a bulk action whose filter names no stream, on a server
// of several sources, to every source the caller may see, once each, in
// name order. A dry run of every source comes first: a request or token a
// source refuses, or a source that cannot answer, fails the action before
// any source changes (naming that source; a request refused as
// INVALID_ARGUMENT is the engine's error as it is, every source refusing
// it alike), so it never silently acts on some sources only. Then each
// source acts and records its own operator action; a source failing then,
// with any code, ends the action with its error, naming it and the sources
// before it, which acted. The answer sums the sources' counts, its sample
// takes each source's aggregates (named) up to 20 in all.
func bulkEach[Req interface {
	proto.Message
	GetDryRun() bool
}, Resp proto.Message](ctx context.Context, rt *routes, req Req,
	call func(outboxv1.AdminServiceServer, context.Context, Req) (Resp, error),
	add func(sum, part Resp)) (Resp, error) {
	var zero Resp
	parts, err := visibleSources(ctx, rt)
	if err != nil {
		return zero, err
	}
	sum := zero.ProtoReflect().New().Interface().(Resp)
	run := func(dry bool) error {
		var done []string
		for _, p := range parts {
			sub := req
			if dry && !req.GetDryRun() {
				sub = proto.Clone(req).(Req)
				f := sub.ProtoReflect().Descriptor().Fields().ByName("dry_run")
				sub.ProtoReflect().Set(f, protoreflect.ValueOfBool(true))
			}
			res, err := call(p.e.Admin, p.ctx, sub)
			if err != nil {
				st := status.Convert(err)
				if dry && st.Code() == codes.InvalidArgument {
					return err // the request, refused alike by every source
				}
				msg := "source " + p.name + ": " + st.Message()
				switch {
				case dry:
					msg += "; no source was changed"
				case len(done) > 0:
					msg += "; source " + strings.Join(done, ", ") + " acted (each records its action)"
				}
				return status.Error(st.Code(), msg)
			}
			done = append(done, p.name)
			if dry == req.GetDryRun() {
				nameSource(p.name, res.ProtoReflect())
				add(sum, res)
			}
		}
		return nil
	}
	if err := run(true); err != nil {
		return zero, err
	}
	if req.GetDryRun() {
		return sum, nil
	}
	return sum, run(false)
}

func addRetry(sum, p *outboxv1.BulkRetryResponse) {
	sum.Matched += p.GetMatched()
	sum.Retried += p.GetRetried()
	sum.Sample = appendSample(sum.Sample, p.GetSample())
}

func addSkip(sum, p *outboxv1.BulkSkipResponse) {
	sum.Matched += p.GetMatched()
	sum.Skipped += p.GetSkipped()
	sum.Sample = appendSample(sum.Sample, p.GetSample())
}

func appendSample(sum, more []*outboxv1.Aggregate) []*outboxv1.Aggregate {
	return append(sum, more[:min(len(more), maxBulkSample-len(sum))]...)
}
