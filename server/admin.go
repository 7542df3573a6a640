package server

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/auth"
	"github.com/outboxd/outboxd/internal/store"
)

// Limits of admin requests.
const (
	maxReasonLen        = 1024
	maxActorLen         = 128
	maxAggregateKeyLen  = 1024
	defaultPageSize     = 100
	maxPageSize         = 1000
	defaultPurgeBatch   = 1000
	maxPurgeBatch       = 10000
	maxLagStreamsFilter = 256
	// maxListEventsBytes bounds the events of one ListEvents page, encoded:
	// half of gRPC's default 4 MiB receive limit, leaving room for the
	// envelope and for one event larger than the rest. A page stops early,
	// with a next-page token, rather than exceed it.
	maxListEventsBytes = 2 << 20
)

// adminService implements outbox.v1.AdminService.
type adminService struct {
	outboxv1.UnimplementedAdminServiceServer
	s *Server
}

func (a *adminService) GetLag(ctx context.Context, req *outboxv1.GetLagRequest) (*outboxv1.GetLagResponse, error) {
	var f fieldErrors
	if len(req.GetStreams()) > maxLagStreamsFilter {
		f.add("streams", "at most %d streams, got %d", maxLagStreamsFilter, len(req.GetStreams()))
	}
	// Names, and patterns as the aggregate filter takes them.
	var names, prefixes []string
	every := false
	for i, v := range req.GetStreams() {
		switch s, prefix := checkStreamPattern(&f, fmt.Sprintf("streams[%d]", i), v); {
		case !prefix:
			names = append(names, s)
		case s == "":
			every = true
		default:
			prefixes = append(prefixes, s)
		}
	}
	if err := f.err(); err != nil {
		return nil, err
	}
	// Naming a stream the token may not see is refused, not answered
	// with zeros; without names, and for the streams a pattern matches, a
	// limited token sees its streams only.
	if err := auth.AuthorizeStreams(ctx, names...); err != nil {
		return nil, err
	}
	filter, err := a.lagFilter(ctx, names, prefixes, every || len(req.GetStreams()) == 0)
	if err != nil {
		return nil, a.s.dbError(ctx, "get lag", err)
	}
	lag, err := a.s.lag(ctx, filter)
	if err != nil {
		return nil, a.s.dbError(ctx, "get lag", err)
	}
	if visible := visibleStreams(ctx); visible != nil {
		lag.Streams = slices.DeleteFunc(lag.Streams, func(l store.StreamLag) bool { return !visible(l.Stream) })
		// Only relays whose every stream the caller may see count.
		relays, err := a.s.store.RelaySessions(ctx, a.s.sessionTTL())
		if err != nil {
			return nil, a.s.dbError(ctx, "get lag", err)
		}
		lag.ConnectedRelays = 0
		for _, r := range relays {
			if relayVisible(r, visible) {
				lag.ConnectedRelays++
			}
		}
	}
	resp := lagProto(lag, names)
	if visibleStreams(ctx) != nil && resp.XminHorizon != nil {
		// Who holds it (sessions of any database of the cluster) is not a
		// stream-limited caller's to see; how far back it is held is.
		resp.XminHorizon.Holder = ""
	}
	// Whatever the caller's streams: a stopped discovery holds back every
	// stream's new events. While the discovery loop's last turn found it
	// running, that answers without a statement.
	if resp.DiscoveryStopped, err = a.s.discoveryStopped(ctx); err != nil {
		return nil, a.s.dbError(ctx, "get lag", err)
	}
	return resp, nil
}

// lagFilter is the streams a lag report covers: nil for every stream, else
// the names and the known streams that match a prefix (none may match).
func (a *adminService) lagFilter(ctx context.Context, names, prefixes []string, every bool) ([]string, error) {
	if every {
		return nil, nil
	}
	filter := append([]string{}, names...)
	if len(prefixes) == 0 {
		return filter, nil
	}
	known, err := a.s.store.KnownStreams(ctx, 0)
	if err != nil {
		return nil, err
	}
	for _, name := range known {
		if slices.ContainsFunc(prefixes, func(p string) bool { return strings.HasPrefix(name, p) }) {
			filter = append(filter, name)
		}
	}
	return filter, nil
}

// visibleStreams returns, for a caller whose token is limited to some
// streams, the test a stream must pass to appear in an overview (GetLag,
// ListRelays); nil for an unrestricted caller.
func visibleStreams(ctx context.Context) func(string) bool {
	p, ok := auth.PrincipalFrom(ctx)
	if !ok || p.AllStreams() {
		return nil
	}
	return p.AllowsStream
}

// relayVisible reports whether a stream-limited caller may see a relay
// session: only if it subscribed to named streams, all of them visible. A
// relay subscribed to every stream is not shown.
func relayVisible(r store.RelaySession, visible func(string) bool) bool {
	if len(r.Streams) == 0 {
		return false
	}
	for _, st := range r.Streams {
		if !visible(st) {
			return false
		}
	}
	return true
}

// lagProto converts a lag snapshot; every stream the request named gets an
// entry, zeros included, so a script can rely on finding it. The snapshot
// lists every stream that has had an event, so a named one it lacks has
// had none (never_had_events).
func lagProto(lag store.Lag, named []string) *outboxv1.GetLagResponse {
	byName := make(map[string]store.StreamLag, len(lag.Streams))
	for _, l := range lag.Streams {
		byName[l.Stream] = l
	}
	var eventless map[string]bool
	for _, n := range named {
		if _, ok := byName[n]; !ok {
			lag.Streams = append(lag.Streams, store.StreamLag{Stream: n})
			byName[n] = store.StreamLag{Stream: n}
			if eventless == nil {
				eventless = make(map[string]bool)
			}
			eventless[n] = true
		}
	}
	resp := &outboxv1.GetLagResponse{ConnectedRelays: uint32(lag.ConnectedRelays)}
	if !lag.StrandedAt.IsZero() {
		resp.StrandedAuditedAt = timestamppb.New(lag.StrandedAt)
	}
	var total store.StreamLag
	for _, l := range lag.Streams {
		sl := streamLagProto(l, lag.Now)
		sl.NeverHadEvents = eventless[l.Stream]
		resp.Streams = append(resp.Streams, sl)
		total.PendingEvents += l.PendingEvents
		total.PendingAggregates += l.PendingAggregates
		total.OldestPending = earliest(total.OldestPending, l.OldestPending)
		total.OldestHeld = earliest(total.OldestHeld, l.OldestHeld)
		total.Ready += l.Ready
		total.Leased += l.Leased
		total.Backoff += l.Backoff
		total.Parked += l.Parked
		total.Gap += l.Gap
		total.DeliveredLastMinute += l.DeliveredLastMinute
		total.Stranded += l.Stranded
		total.Stalled += l.Stalled
		for _, id := range l.IdleRelays {
			if !slices.Contains(total.IdleRelays, id) {
				total.IdleRelays = append(total.IdleRelays, id)
			}
		}
	}
	resp.Total = streamLagProto(total, lag.Now)
	if h := lag.XminHorizon; h.Age > 0 {
		resp.XminHorizon = &outboxv1.XminHorizon{AgeTransactions: h.Age, Holder: h.Holder}
		if !h.Since.IsZero() {
			resp.XminHorizon.HeldSince = timestamppb.New(h.Since)
		}
	}
	return resp
}

func streamLagProto(l store.StreamLag, now time.Time) *outboxv1.StreamLag {
	out := &outboxv1.StreamLag{
		Stream:               l.Stream,
		PendingEvents:        l.PendingEvents,
		PendingAggregates:    l.PendingAggregates,
		ReadyAggregates:      l.Ready,
		LeasedAggregates:     l.Leased,
		BackingOffAggregates: l.Backoff,
		ParkedAggregates:     l.Parked,
		GapAggregates:        l.Gap,
		DeliveredLastMinute:  l.DeliveredLastMinute,
		DeliveredPerSecond:   float64(l.DeliveredLastMinute) / 60,
		StrandedEvents:       l.Stranded,
		StalledAggregates:    l.Stalled,
		IdleRelays:           int64(len(l.IdleRelays)),
	}
	if !l.OldestPending.IsZero() {
		out.OldestPendingCreatedAt = timestamppb.New(l.OldestPending)
		out.OldestPendingAge = durationpb.New(max(0, now.Sub(l.OldestPending)))
	}
	if !l.OldestHeld.IsZero() {
		out.OldestHeldAge = durationpb.New(max(0, now.Sub(l.OldestHeld)))
	}
	return out
}

// earliest returns the earlier of two times, a zero time meaning "none".
func earliest(a, b time.Time) time.Time {
	if a.IsZero() || (!b.IsZero() && b.Before(a)) {
		return b
	}
	return a
}

func (a *adminService) ListRelays(ctx context.Context, _ *outboxv1.ListRelaysRequest) (*outboxv1.ListRelaysResponse, error) {
	// Refresh this replica's own rows first, so a relay that connected a
	// moment ago shows its current figures.
	a.s.saveSessions(ctx)
	list, err := a.s.store.RelaySessions(ctx, a.s.sessionTTL())
	if err != nil {
		return nil, a.s.dbError(ctx, "list relays", err)
	}
	visible := visibleStreams(ctx)
	resp := &outboxv1.ListRelaysResponse{}
	for _, r := range list {
		if visible != nil && !relayVisible(r, visible) {
			continue
		}
		resp.Relays = append(resp.Relays, &outboxv1.Relay{
			RelayId:        r.RelayID,
			SessionId:      r.SessionID.String(),
			Peer:           r.Peer,
			ReplicaId:      r.ReplicaID,
			Streams:        r.Streams,
			ExcludeStreams: r.ExcludeStreams,
			MaxInFlight:    uint32(r.MaxInFlight),
			InFlight:       uint32(r.InFlight),
			Acked:          uint64(r.Acked),
			ConnectedAt:    timestamppb.New(r.ConnectedAt),
		})
	}
	return resp, nil
}

// checkAggregate validates a (stream, aggregate_key) pair.
func checkAggregate(f *fieldErrors, stream, key string) {
	checkStream(f, "stream", stream)
	if key == "" {
		f.add("aggregate_key", "is required (1 to %d bytes)", maxAggregateKeyLen)
		return
	}
	checkText(f, "aggregate_key", key, maxAggregateKeyLen)
}

func (a *adminService) GetAggregate(ctx context.Context, req *outboxv1.GetAggregateRequest) (*outboxv1.GetAggregateResponse, error) {
	var f fieldErrors
	checkAggregate(&f, req.GetStream(), req.GetAggregateKey())
	if err := f.err(); err != nil {
		return nil, err
	}
	if err := auth.AuthorizeStreams(ctx, req.GetStream()); err != nil {
		return nil, err
	}
	agg, err := a.s.store.GetAggregate(ctx, req.GetStream(), req.GetAggregateKey())
	if errors.Is(err, store.ErrNotFound) {
		return nil, status.Errorf(codes.NotFound, "aggregate %s/%s has never had an event", req.GetStream(), req.GetAggregateKey())
	}
	if err != nil {
		return nil, a.s.dbError(ctx, "get aggregate", err)
	}
	return &outboxv1.GetAggregateResponse{Aggregate: aggregateProto(agg)}, nil
}

var aggregateStates = map[string]outboxv1.AggregateState{
	"idle":    outboxv1.AggregateState_AGGREGATE_STATE_IDLE,
	"ready":   outboxv1.AggregateState_AGGREGATE_STATE_READY,
	"leased":  outboxv1.AggregateState_AGGREGATE_STATE_LEASED,
	"backoff": outboxv1.AggregateState_AGGREGATE_STATE_BACKOFF,
	"parked":  outboxv1.AggregateState_AGGREGATE_STATE_PARKED,
	"gap":     outboxv1.AggregateState_AGGREGATE_STATE_GAP,
}

func aggregateProto(a store.Aggregate) *outboxv1.Aggregate {
	out := &outboxv1.Aggregate{
		Stream:              a.Stream,
		AggregateKey:        a.AggregateKey,
		State:               aggregateStates[a.State],
		LastRevision:        a.LastRevision,
		DeliveredRevision:   a.DeliveredRevision,
		PendingEvents:       a.PendingEvents,
		NextPendingRevision: a.NextPendingRevision,
		LeaseEpoch:          a.Epoch,
		Attempt:             uint32(a.Attempt),
		Failures:            uint32(a.Failures),
		LastError:           a.LastError,
		ParkedReason:        a.ParkedReason,
		GapRevision:         a.GapRevision,
		Stalled:             a.StalledReason != "",
		StalledReason:       a.StalledReason,
	}
	if a.State == "leased" {
		out.LeaseHolder = a.Holder.String()
		out.LeaseRelayId = a.HolderRelayID
		out.LeaseExpiresAt = optionalTimestamp(a.LeaseExpiresAt)
	}
	if a.LeasedEventID != uuid.Nil {
		out.LeasedEventId = a.LeasedEventID.String()
	}
	if a.NextPendingEventID != uuid.Nil {
		out.NextPendingEventId = a.NextPendingEventID.String()
	}
	out.OldestPendingCreatedAt = optionalTimestamp(a.OldestPending)
	out.NextAttemptAt = optionalTimestamp(a.NextAttemptAt)
	out.ParkedAt = optionalTimestamp(a.ParkedAt)
	return out
}

func optionalTimestamp(t time.Time) *timestamppb.Timestamp {
	if t.IsZero() {
		return nil
	}
	return timestamppb.New(t)
}

func (a *adminService) ListEvents(ctx context.Context, req *outboxv1.ListEventsRequest) (*outboxv1.ListEventsResponse, error) {
	var f fieldErrors
	p := store.ListEventsParams{Stream: req.GetStream(), AggregateKey: req.GetAggregateKey(), Limit: defaultPageSize}
	if id := req.GetEventId(); id != "" {
		var err error
		if p.EventID, err = uuid.Parse(id); err != nil {
			f.add("event_id", "%.80q is not an event id (a UUID such as 0190a8c2-5d1e-7c3a-9f00-2b4c6d8e0f12)", id)
		}
		if p.Stream != "" || p.AggregateKey != "" || req.GetState() != 0 || req.GetCreatedAfter() != nil ||
			req.GetCreatedBefore() != nil || req.GetPageToken() != "" {
			f.add("event_id", "names one event; leave the other filters and page_token empty")
		}
	}
	if p.Stream != "" {
		checkStream(&f, "stream", p.Stream)
	}
	if p.AggregateKey != "" && p.Stream == "" {
		f.add("aggregate_key", "requires stream")
	}
	checkText(&f, "aggregate_key", p.AggregateKey, maxAggregateKeyLen)
	switch req.GetState() {
	case outboxv1.EventState_EVENT_STATE_UNSPECIFIED:
	case outboxv1.EventState_EVENT_STATE_PENDING:
		p.State = store.EventPending
	case outboxv1.EventState_EVENT_STATE_PUBLISHED:
		p.State = store.EventPublished
	case outboxv1.EventState_EVENT_STATE_SKIPPED:
		p.State = store.EventSkipped
	default:
		f.add("state", "unknown state %d", req.GetState())
	}
	p.CreatedAfter = checkTimestamp(&f, "created_after", req.GetCreatedAfter())
	p.CreatedBefore = checkTimestamp(&f, "created_before", req.GetCreatedBefore())
	if n := req.GetPageSize(); n > maxPageSize {
		f.add("page_size", "must be at most %d, got %d", maxPageSize, n)
	} else if n > 0 {
		p.Limit = int(n)
	}
	if tok := req.GetPageToken(); tok != "" {
		pos, err := decodePageToken(tok)
		if err != nil {
			f.add("page_token", "is not a token this server issued: %v", err)
		}
		p.Before = pos
	}
	if err := f.err(); err != nil {
		return nil, err
	}
	if p.EventID != uuid.Nil {
		// A limited token may find events of its streams by id.
		if err := a.s.authorizeEvents(ctx, []uuid.UUID{p.EventID}); err != nil {
			return nil, err
		}
	} else if err := authorizeOptionalStream(ctx, p.Stream); err != nil {
		return nil, err
	}
	// One more than the page tells whether another page follows.
	p.Limit++
	list, err := a.s.store.ListEvents(ctx, p)
	if err != nil {
		return nil, a.s.dbError(ctx, "list events", err)
	}
	resp := &outboxv1.ListEventsResponse{}
	more := len(list) == p.Limit
	if more {
		list = list[:p.Limit-1]
	}
	size := 0
	for i, r := range list {
		info := &outboxv1.EventInfo{Event: eventProto(r.Event), State: outboxv1.EventState_EVENT_STATE_PENDING}
		switch {
		case r.Skip != nil:
			info.State = outboxv1.EventState_EVENT_STATE_SKIPPED
			info.Skip = skipProto(*r.Skip)
		case !r.PublishedAt.IsZero():
			info.State = outboxv1.EventState_EVENT_STATE_PUBLISHED
			info.PublishedAt = timestamppb.New(r.PublishedAt)
		}
		// Fewer rows rather than a response a client cannot receive; the
		// first row always goes (one event is bounded by the payload limit).
		n := proto.Size(info)
		if i > 0 && size+n > maxListEventsBytes {
			more = true
			break
		}
		size += n
		resp.Events = append(resp.Events, info)
	}
	if more {
		last := list[len(resp.Events)-1]
		resp.NextPageToken = encodePageToken(store.EventPosition{CreatedAt: last.CreatedAt, EventID: last.ID})
	}
	return resp, nil
}

// checkTimestamp validates an optional timestamp; nil yields the zero time.
func checkTimestamp(f *fieldErrors, field string, ts *timestamppb.Timestamp) time.Time {
	if ts == nil {
		return time.Time{}
	}
	if err := ts.CheckValid(); err != nil {
		f.add(field, "is not a valid timestamp")
		return time.Time{}
	}
	return ts.AsTime()
}

// Page tokens are opaque to clients: base64 of "unix-nanos/event-id", the
// position of the last event of the previous page.
func encodePageToken(p store.EventPosition) string {
	return base64.RawURLEncoding.EncodeToString([]byte(strconv.FormatInt(p.CreatedAt.UnixNano(), 10) + "/" + p.EventID.String()))
}

func decodePageToken(tok string) (store.EventPosition, error) {
	raw, err := base64.RawURLEncoding.DecodeString(tok)
	if err != nil {
		return store.EventPosition{}, errors.New("not base64")
	}
	nanos, id, ok := strings.Cut(string(raw), "/")
	if !ok {
		return store.EventPosition{}, errors.New("malformed")
	}
	n, err := strconv.ParseInt(nanos, 10, 64)
	if err != nil {
		return store.EventPosition{}, errors.New("malformed time")
	}
	eid, err := uuid.Parse(id)
	if err != nil {
		return store.EventPosition{}, errors.New("malformed event id")
	}
	return store.EventPosition{CreatedAt: time.Unix(0, n), EventID: eid}, nil
}

func skipProto(s store.Skip) *outboxv1.Skip {
	return &outboxv1.Skip{Reason: s.Reason, Actor: s.Actor, SkippedAt: timestamppb.New(s.SkippedAt)}
}

// checkReason validates a mandatory operator reason.
func checkReason(f *fieldErrors, reason string) {
	if strings.TrimSpace(reason) == "" {
		f.add("reason", "is required: say why, it is stored with the decision")
		return
	}
	if checkText(f, "reason", reason, utf8.UTFMax*maxReasonLen) && utf8.RuneCountInString(reason) > maxReasonLen {
		f.add("reason", "must be at most %d characters", maxReasonLen)
	}
}

// authorizeOptionalStream checks a request's optional stream filter: a
// caller limited to some streams must name one of them.
func authorizeOptionalStream(ctx context.Context, stream string) error {
	if stream == "" {
		return auth.AuthorizeAllStreams(ctx)
	}
	return auth.AuthorizeStreams(ctx, stream)
}

// actor names who performs an operator action: the authenticated token's
// name (with the request's actor field in parentheses, if given), else the
// actor field, else "anonymous" with the caller's address.
func actor(ctx context.Context, f *fieldErrors, requested string) string {
	if requested != "" {
		checkPrintableASCII(f, "actor", requested, maxActorLen)
	}
	if p, ok := auth.PrincipalFrom(ctx); ok {
		if requested != "" {
			return p.Name + " (" + requested + ")"
		}
		return p.Name
	}
	if requested != "" {
		return requested
	}
	if p, ok := peer.FromContext(ctx); ok {
		return "anonymous@" + p.Addr.String()
	}
	return "anonymous"
}

func (a *adminService) RetryAggregate(ctx context.Context, req *outboxv1.RetryAggregateRequest) (*outboxv1.RetryAggregateResponse, error) {
	var f fieldErrors
	checkAggregate(&f, req.GetStream(), req.GetAggregateKey())
	p := store.RetryParams{Stream: req.GetStream(), AggregateKey: req.GetAggregateKey(), AcceptGap: req.GetAcceptGap(),
		Actor: actor(ctx, &f, req.GetActor())}
	if p.AcceptGap || req.GetReason() != "" {
		// Required to accept a gap; recorded with any retry when given.
		checkReason(&f, req.GetReason())
		p.Reason = req.GetReason()
	}
	if err := f.err(); err != nil {
		return nil, err
	}
	if err := auth.AuthorizeStreams(ctx, p.Stream); err != nil {
		return nil, err
	}
	agg, err := a.s.store.RetryAggregate(ctx, p)
	var se *store.StateError
	switch {
	case errors.Is(err, store.ErrNotFound):
		return nil, status.Errorf(codes.NotFound, "aggregate %s/%s has never had an event", p.Stream, p.AggregateKey)
	case errors.As(err, &se):
		return nil, status.Error(codes.FailedPrecondition, se.Message)
	case err != nil:
		return nil, a.s.dbError(ctx, "retry aggregate", err)
	}
	a.s.log.Info("aggregate retried by operator", "stream", p.Stream, "aggregate_key", p.AggregateKey,
		"accept_gap", p.AcceptGap, "actor", p.Actor, "state", agg.State)
	a.s.wake.broadcast()
	return &outboxv1.RetryAggregateResponse{Aggregate: aggregateProto(agg)}, nil
}

func (a *adminService) SkipEvent(ctx context.Context, req *outboxv1.SkipEventRequest) (*outboxv1.SkipEventResponse, error) {
	var f fieldErrors
	id, err := uuid.Parse(req.GetEventId())
	if err != nil {
		f.add("event_id", "must be a UUID")
	}
	checkReason(&f, req.GetReason())
	who := actor(ctx, &f, req.GetActor())
	if err := f.err(); err != nil {
		return nil, err
	}
	if err := a.s.authorizeEvents(ctx, []uuid.UUID{id}); err != nil {
		return nil, err
	}
	sk, err := a.s.store.SkipEvent(ctx, id, req.GetReason(), who)
	switch {
	case errors.Is(err, store.ErrNotFound):
		return nil, status.Errorf(codes.NotFound, "event %s does not exist (never did, or was purged after publishing)", id)
	case errors.Is(err, store.ErrAlreadyPublished):
		return nil, status.Errorf(codes.FailedPrecondition, "event %s is already published; there is nothing to skip", id)
	case errors.Is(err, store.ErrAlreadySkipped):
		return nil, status.Errorf(codes.FailedPrecondition, "event %s is already skipped", id)
	case err != nil:
		return nil, a.s.dbError(ctx, "skip event", err)
	}
	a.s.log.Warn("event skipped by operator; it will never be delivered", "event_id", id, "actor", who, "reason", sk.Reason)
	a.s.wake.broadcast()
	return &outboxv1.SkipEventResponse{Skip: skipProto(sk)}, nil
}

func (a *adminService) Purge(req *outboxv1.PurgeRequest, stream outboxv1.AdminService_PurgeServer) error {
	var f fieldErrors
	if req.GetPublishedBefore() == nil {
		f.add("published_before", "is required")
	}
	p := store.PurgeParams{
		PublishedBefore: checkTimestamp(&f, "published_before", req.GetPublishedBefore()),
		Stream:          req.GetStream(),
		BatchSize:       defaultPurgeBatch,
		DryRun:          req.GetDryRun(),
	}
	if p.Stream != "" {
		checkStream(&f, "stream", p.Stream)
	}
	if n := req.GetBatchSize(); n > maxPurgeBatch {
		f.add("batch_size", "must be at most %d, got %d", maxPurgeBatch, n)
	} else if n > 0 {
		p.BatchSize = int(n)
	}
	if err := f.err(); err != nil {
		return err
	}
	ctx := stream.Context()
	if err := authorizeOptionalStream(ctx, p.Stream); err != nil {
		return err
	}
	res, err := a.s.purge(ctx, p, func(pr purgeProgress) error { return stream.Send(pr.proto()) })
	if err != nil {
		if _, ok := status.FromError(err); ok {
			return err
		}
		return a.s.dbError(ctx, "purge", err)
	}
	a.s.log.Info("purge finished", "published_before", p.PublishedBefore, "stream", p.Stream,
		"dry_run", p.DryRun, "deleted", res.deleted, "batches", res.batches, "elapsed", res.elapsed)
	return nil
}
