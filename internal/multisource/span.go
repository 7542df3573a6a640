package multisource

// Admin calls for every source (no stream on a server of several, or a
// stream "*/pattern"): the listings (ListEvents, ListAggregates,
// ListOperatorActions) page through every source the caller may see, and
// the bulk actions (BulkRetry, BulkSkip) act on each of them once. A server
// of one source answers a request without a stream as before, through
// route.

import (
	"context"
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

// listSources answers a listing for every source (see spans): it reads the sources the caller may see in name order, filling
// the page from one and going on into the next, each source's items named
// as route's answers name them. Its next_page_token is "SOURCE:TOKEN", the
// source to go on in and that engine's own token (empty to start it).
//
// A source that cannot answer (its database down) is left out and named in
// the page's skipped_sources with the reason, as GetLag leaves it out of
// its figures; when no source read answers, the call fails with the first
// source's error. Refusals (INVALID_ARGUMENT, PERMISSION_DENIED) fail the
// call: they say something about the request, not the source.
func listSources[Req, Resp proto.Message](ctx context.Context, rt *routes, req Req,
	call func(outboxv1.AdminServiceServer, context.Context, Req) (Resp, error)) (Resp, error) {
	var zero Resp
	rm := req.ProtoReflect()
	fSize, fToken := rm.Descriptor().Fields().ByName("page_size"), rm.Descriptor().Fields().ByName("page_token")
	size := int(rm.Get(fSize).Uint())
	if size == 0 {
		size = defaultPageSize
	}
	start, inner, err := parseSpanToken(rt, rm.Get(fToken).String())
	if err != nil {
		return zero, err
	}
	out := zero.ProtoReflect().New()
	fItems := itemsField(out.Descriptor())
	fNext, fSkipped := out.Descriptor().Fields().ByName("next_page_token"), out.Descriptor().Fields().ByName("skipped_sources")
	items := out.Mutable(fItems).List()
	var firstErr error
	visible, answered := 0, 0
	for _, name := range rt.names {
		if name < start {
			continue
		}
		sctx, err := forSource(ctx, name)
		if err != nil {
			continue // the caller may see nothing of this source
		}
		visible++
		if items.Len() >= size || (items.Len() > 0 && proto.Size(out.Interface()) >= spanPageBytes) {
			out.Set(fNext, protoreflect.ValueOfString(name+spanTokenSep))
			break
		}
		sub := proto.Clone(req).(Req)
		sm := sub.ProtoReflect()
		sm.Set(fSize, protoreflect.ValueOfUint32(uint32(size-items.Len())))
		sm.Clear(fToken)
		if name == start && inner != "" {
			sm.Set(fToken, protoreflect.ValueOfString(inner))
		}
		res, err := call(rt.engines[name].Admin, sctx, sub)
		if err != nil {
			if c := status.Code(err); c == codes.InvalidArgument || c == codes.PermissionDenied || ctx.Err() != nil {
				return zero, err
			}
			firstErr = cmpErr(firstErr, err)
			skipped := out.Mutable(fSkipped).List()
			skipped.Append(protoreflect.ValueOfMessage((&outboxv1.SourceHealth{Name: name,
				Reason: status.Convert(err).Message()}).ProtoReflect()))
			continue
		}
		answered++
		nameSource(name, res.ProtoReflect())
		got := res.ProtoReflect().Get(fItems).List()
		for i := range got.Len() {
			items.Append(got.Get(i))
		}
		if next := res.ProtoReflect().Get(fNext).String(); next != "" {
			// The engine has more (or ended its page early): go on there.
			out.Set(fNext, protoreflect.ValueOfString(name+spanTokenSep+next))
			break
		}
	}
	switch {
	case visible == 0:
		return zero, status.Error(codes.PermissionDenied, "the token may access no stream of any source")
	case answered == 0 && firstErr != nil:
		return zero, firstErr
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
func parseSpanToken(rt *routes, tok string) (source, inner string, err error) {
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
			source, why, strings.Join(rt.names, ", "))
	}
	return source, inner, nil
}

// bulkSources applies a bulk action whose filter names no stream, on a
// server of several sources, to every source the caller may see, once
// each, in name order. A dry run of every source comes first: a request or
// token a source refuses, or a source that cannot answer, fails the action
// before any source changes (naming that source), so it never silently
// acts on some sources only. Then each source acts and records its own
// operator action; a source failing then ends the action with its error,
// naming it, the sources before it having acted. The answer sums the
// sources' counts, its sample takes each source's aggregates (named) up to
// 20 in all.
func bulkSources[Req interface {
	proto.Message
	GetDryRun() bool
}, Resp proto.Message](ctx context.Context, rt *routes, req Req,
	call func(outboxv1.AdminServiceServer, context.Context, Req) (Resp, error),
	add func(sum, part Resp)) (Resp, error) {
	type part struct {
		name string
		e    *Engine
		ctx  context.Context
	}
	var parts []part
	for _, name := range rt.names {
		if sctx, err := forSource(ctx, name); err == nil {
			parts = append(parts, part{name, rt.engines[name], sctx})
		}
	}
	var zero Resp
	if len(parts) == 0 {
		return zero, status.Error(codes.PermissionDenied, "the token may access no stream of any source")
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
				if st.Code() == codes.InvalidArgument {
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
	if err := run(true); err != nil || req.GetDryRun() {
		if err != nil {
			return zero, err
		}
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
