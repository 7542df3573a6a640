package server

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/google/uuid"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/auth"
	"github.com/outboxd/outboxd/internal/leasetoken"
	"github.com/outboxd/outboxd/internal/limits"
	"github.com/outboxd/outboxd/internal/store"
)

// SessionIDHeader is the response header of an accepted Subscribe stream:
// the session id that ListRelays and GetAggregate show as the lease holder.
const SessionIDHeader = limits.SessionIDHeader

// relayService implements outbox.v1.RelayService.
type relayService struct {
	outboxv1.UnimplementedRelayServiceServer
	s *Server
}

func (r *relayService) Subscribe(req *outboxv1.SubscribeRequest, stream outboxv1.RelayService_SubscribeServer) error {
	s := r.s
	var f fieldErrors
	checkPrintableASCII(&f, "relay_id", req.GetRelayId(), maxRelayIDLen)
	if len(req.GetStreams()) > maxSubscribeStreams {
		f.add("streams", "at most %d streams, got %d", maxSubscribeStreams, len(req.GetStreams()))
	}
	seen := make(map[string]bool)
	for i, name := range req.GetStreams() {
		checkStream(&f, fmt.Sprintf("streams[%d]", i), name)
		if seen[name] {
			f.add(fmt.Sprintf("streams[%d]", i), "%q is listed twice", name)
		}
		seen[name] = true
	}
	if len(req.GetExcludeStreams()) > maxSubscribeStreams {
		f.add("exclude_streams", "at most %d streams, got %d", maxSubscribeStreams, len(req.GetExcludeStreams()))
	}
	excluded := make(map[string]bool)
	for i, name := range req.GetExcludeStreams() {
		field := fmt.Sprintf("exclude_streams[%d]", i)
		checkStream(&f, field, name)
		switch {
		case excluded[name]:
			f.add(field, "%q is listed twice", name)
		case seen[name]:
			f.add(field, "%q is also in streams", name)
		}
		excluded[name] = true
	}
	if m := req.GetMaxInFlight(); m < 1 || int(m) > s.cfg.MaxInFlight {
		f.add("max_in_flight", "must be between 1 and %d, got %d", s.cfg.MaxInFlight, m)
	}
	window := max(int(req.GetMaxInFlightPerAggregate()), 1)
	if limit := min(s.cfg.MaxInFlightPerAggregate, max(int(req.GetMaxInFlight()), 1)); window > limit {
		f.add("max_in_flight_per_aggregate", "must be between 1 and %d (the server's limit, and at most max_in_flight), got %d", limit, window)
	}
	ttl := checkDuration(&f, "lease_ttl", req.GetLeaseTtl(), s.cfg.DefaultLeaseTTL, s.cfg.MinLeaseTTL, s.cfg.MaxLeaseTTL)
	if err := f.err(); err != nil {
		return err
	}
	ctx := stream.Context()
	if len(req.GetStreams()) == 0 {
		if err := auth.AuthorizeAllStreams(ctx); err != nil {
			return err
		}
	} else if err := auth.AuthorizeStreams(ctx, req.GetStreams()...); err != nil {
		return err
	}
	if err := s.checkSubscriptionLimit(ctx, req.GetRelayId()); err != nil {
		return err
	}
	if err := r.checkStreamsExist(ctx, req.GetStreams()); err != nil {
		return err
	}

	peerAddr := ""
	if p, ok := peer.FromContext(ctx); ok {
		peerAddr = p.Addr.String()
	}
	sess := newSession(s, req.GetRelayId(), peerAddr, req.GetStreams(), int(req.GetMaxInFlight()), ttl)
	sess.excludeStreams = req.GetExcludeStreams()
	sess.window = window
	sess.batches = req.GetAcceptBatches()
	sess.subscriber = subscriberKey(ctx, req.GetRelayId())
	if h := s.beforeAddSession.get(); h != nil {
		h()
	}
	if err := s.addSession(ctx, sess); err != nil {
		return err
	}
	defer s.removeSession(sess)
	// Headers now tell the relay its subscription was accepted (and under
	// which session id operators will see it), before any event exists.
	_ = stream.SendHeader(metadata.Pairs(SessionIDHeader, sess.id.String()))
	log := s.log.With("session", sess.id, "relay", sess.relayID, "peer", peerAddr)
	log.Info("relay subscribed", "streams", sess.streams, "exclude_streams", sess.excludeStreams, "max_in_flight", sess.maxInFlight,
		"max_in_flight_per_aggregate", window, "lease_ttl", ttl, "accept_batches", sess.batches)
	defer func() {
		// The stream is over: give its leases back at once so the events go
		// to another relay now, not after the TTL. Hand-overs stop first,
		// so this release covers every lease an ack handed this session.
		sess.close()
		relCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), releaseTimeout)
		defer cancel()
		n, err := s.store.Release(relCtx, sess.id)
		if err != nil {
			log.Warn("release leases failed; they will expire by TTL", "err", err)
			return
		}
		log.Info("relay unsubscribed", "released", n, "acked", sess.acked.Load())
	}()

	err := sess.run(ctx, stream.Send)
	if ctx.Err() != nil {
		return status.FromContextError(ctx.Err()).Err()
	}
	if _, ok := status.FromError(err); ok {
		return err
	}
	log.Warn("subscription failed", "err", err)
	return status.Error(codes.Unavailable, "delivery stream failed; reconnect")
}

// checkStreamsExist refuses stream names no event has ever used: most likely
// a typo. A relay deployed before its producers sees NOT_FOUND and retries.
func (r *relayService) checkStreamsExist(ctx context.Context, streams []string) error {
	if len(streams) == 0 {
		return nil
	}
	unknown, err := r.s.store.UnknownStreams(ctx, streams)
	if err != nil {
		return r.s.dbError(ctx, "check streams", err)
	}
	if len(unknown) > 0 {
		return status.Errorf(codes.NotFound,
			"no event has ever been written to stream(s) %q; %s; check the names, or retry once producers have emitted",
			unknown, r.knownStreams(ctx))
	}
	return nil
}

// maxKnownStreams bounds the stream names a refused subscription lists.
const maxKnownStreams = 20

// knownStreams says which streams exist, as far as the caller's token may
// see them, for the error that refuses an unknown one: a typo is then
// obvious next to the name it missed.
func (r *relayService) knownStreams(ctx context.Context) string {
	names, err := r.s.store.KnownStreams(ctx, maxKnownStreams+1)
	if err != nil {
		return "known streams could not be read"
	}
	more := len(names) > maxKnownStreams
	names = names[:min(len(names), maxKnownStreams)]
	visible := names[:0]
	for _, n := range names {
		if auth.AuthorizeStreams(ctx, n) == nil {
			visible = append(visible, n)
		}
	}
	switch {
	case len(names) == 0:
		return "no stream has events yet"
	case len(visible) == 0:
		return "no stream this token may relay has events yet"
	case more:
		return "known streams include " + strings.Join(visible, ", ")
	default:
		return "known streams: " + strings.Join(visible, ", ")
	}
}

func (r *relayService) Ack(ctx context.Context, req *outboxv1.AckRequest) (*outboxv1.AckResponse, error) {
	s := r.s
	defer func(start time.Time) { s.metrics.ackDuration.Observe(time.Since(start).Seconds()) }(time.Now())
	items := req.GetAcks()
	if len(items) == 0 || len(items) > maxAckItems {
		var f fieldErrors
		f.add("acks", "must hold 1 to %d items, got %d", maxAckItems, len(items))
		return nil, f.err()
	}
	results := make([]*outboxv1.AckResult, len(items))
	ids := make([]uuid.UUID, 0, len(items))
	tokens := make([]leasetoken.Token, 0, len(items))
	// verified[i] is the index in ids of item i's event, -1 if its token
	// did not verify.
	verified := make([]int, len(items))
	for i, it := range items {
		results[i] = &outboxv1.AckResult{EventId: it.GetEventId()}
		id, err := r.verify(it.GetEventId(), it.GetLeaseToken())
		if err != nil {
			results[i].Status = outboxv1.AckStatus_ACK_STATUS_INVALID
			results[i].Message = err.Error()
			verified[i] = -1
			continue
		}
		verified[i] = len(ids)
		ids = append(ids, id.EventID)
		tokens = append(tokens, id)
	}
	if err := s.authorizeEvents(ctx, ids); err != nil {
		return nil, err
	}
	if len(ids) > 0 {
		byID, err := s.acks.submit(ctx, tokens)
		if err != nil {
			return nil, s.dbError(ctx, "ack", err)
		}
		for i, res := range results {
			if verified[i] >= 0 {
				res.Status, res.Message = ackStatus(byID[ids[verified[i]]].Status)
			}
		}
	}
	// Counted per status, once per call rather than once per item.
	var counts [len(ackResultLabels)]int
	for _, res := range results {
		if st := int(res.Status); st >= 0 && st < len(counts) {
			counts[st]++
		}
	}
	for st, n := range counts {
		if n > 0 {
			s.metrics.acks.WithLabelValues(ackResultLabels[st]).Add(float64(n))
		}
	}
	return &outboxv1.AckResponse{Results: results}, nil
}

// ServeAckStream serves one AckStream: it answers each request with ack (an
// Ack of the same items), in order, until the relay closes its side (nil),
// the stream fails, ack refuses a request as a whole (its status ends the
// stream, as it would fail an Ack call), the stream's context ends (the
// authenticator ends the streams of a revoked token that way), or end is
// closed: the server takes no more acks (UNAVAILABLE), so that a graceful
// stop need not wait for relays to close their ack streams.
//
// Requests are read and answered on a goroutine of their own: only the
// handler's return ends a gRPC stream, and it must be able to return while
// that goroutine waits in Recv. A panic there is raised again on the
// handler's goroutine. No answer is sent once it has returned
// (gRPC forbids it): a send and the return are fenced by a mutex, so a
// send held up by a relay that reads nothing holds up the return too, until
// the connection closes.
func ServeAckStream(stream outboxv1.RelayService_AckStreamServer, end <-chan struct{},
	ack func(context.Context, *outboxv1.AckRequest) (*outboxv1.AckResponse, error)) error {
	ctx := stream.Context()
	var mu sync.Mutex
	returned := false
	answered := make(chan error, 1)
	panicked := make(chan any, 1)
	go func() {
		defer func() {
			if p := recover(); p != nil {
				panicked <- p
			}
		}()
		for {
			req, err := stream.Recv()
			if err != nil {
				if errors.Is(err, io.EOF) {
					err = nil // the relay is done acking
				}
				answered <- err
				return
			}
			res, err := ack(ctx, &outboxv1.AckRequest{Acks: req.GetAcks()})
			if err != nil {
				answered <- err
				return
			}
			mu.Lock()
			if returned {
				mu.Unlock()
				return
			}
			err = stream.Send(&outboxv1.AckStreamResponse{Results: res.GetResults()})
			mu.Unlock()
			if err != nil {
				answered <- err
				return
			}
		}
	}()
	var err error
	select {
	case err = <-answered:
		return err
	case p := <-panicked:
		// Again on the handler's goroutine, where the server's recovery
		// turns it into INTERNAL (counted and logged), as for an Ack call.
		panic(p)
	case <-ctx.Done():
		err = status.FromContextError(ctx.Err()).Err()
	case <-end:
		err = status.Error(codes.Unavailable, "the server is shutting down and takes no more acks; send them again (to another replica)")
	}
	mu.Lock()
	returned = true
	mu.Unlock()
	return err
}

// ackResultLabels is the outboxd_acks_total result label of each AckStatus,
// by its number.
var ackResultLabels = [...]string{
	outboxv1.AckStatus_ACK_STATUS_UNSPECIFIED:       "unknown",
	outboxv1.AckStatus_ACK_STATUS_PUBLISHED:         "published",
	outboxv1.AckStatus_ACK_STATUS_ALREADY_PUBLISHED: "already_published",
	outboxv1.AckStatus_ACK_STATUS_LEASE_LOST:        "lease_lost",
	outboxv1.AckStatus_ACK_STATUS_NOT_FOUND:         "not_found",
	outboxv1.AckStatus_ACK_STATUS_INVALID:           "invalid",
	outboxv1.AckStatus_ACK_STATUS_RETRY:             "retry",
}

func ackStatus(st store.AckStatus) (outboxv1.AckStatus, string) {
	switch st {
	case store.AckPublished:
		return outboxv1.AckStatus_ACK_STATUS_PUBLISHED, ""
	case store.AckAlreadyPublished:
		return outboxv1.AckStatus_ACK_STATUS_ALREADY_PUBLISHED, "already published"
	case store.AckLeaseLost:
		return outboxv1.AckStatus_ACK_STATUS_LEASE_LOST, "event was skipped by an operator; not marked published"
	case store.AckOutOfOrder:
		return outboxv1.AckStatus_ACK_STATUS_LEASE_LOST,
			"an earlier revision of this aggregate is not acked yet (acks apply in revision order); not marked published, it will be delivered again"
	case store.AckNotFound:
		return outboxv1.AckStatus_ACK_STATUS_NOT_FOUND, "no such event (never existed, or purged)"
	case store.AckFailed:
		return outboxv1.AckStatus_ACK_STATUS_RETRY, "the database refused this ack; retry it later"
	default:
		return outboxv1.AckStatus_ACK_STATUS_UNSPECIFIED, "internal: no result"
	}
}

// verify checks that token is genuine and was issued for eventID.
func (r *relayService) verify(eventID, token string) (leasetoken.Token, error) {
	id, err := uuid.Parse(eventID)
	if err != nil {
		return leasetoken.Token{}, errors.New("event_id is not a UUID")
	}
	t, err := r.s.signer.Verify(token)
	if err != nil {
		return leasetoken.Token{}, errors.New("lease_token is malformed or forged")
	}
	if t.EventID != id {
		return leasetoken.Token{}, errors.New("lease_token was issued for a different event")
	}
	return t, nil
}

func (r *relayService) Nack(ctx context.Context, req *outboxv1.NackRequest) (*outboxv1.NackResponse, error) {
	s := r.s
	var f fieldErrors
	t, err := r.verify(req.GetEventId(), req.GetLeaseToken())
	if err != nil {
		f.add("lease_token", "%v", err)
	}
	// A broker's throttle hint can exceed the backoff cap (an HTTP
	// Retry-After of an hour, say): honour it up to the cap rather than
	// refuse the nack and lose its failure count.
	retryAfter := min(checkDuration(&f, "retry_after", req.GetRetryAfter(), 0, 0, time.Duration(math.MaxInt64)), s.cfg.BackoffCap)
	if err := f.err(); err != nil {
		return nil, err
	}
	if err := s.authorizeEvents(ctx, []uuid.UUID{t.EventID}); err != nil {
		return nil, err
	}
	maxFailures := s.cfg.MaxFailures
	if req.GetPermanent() {
		// The relay knows retrying cannot help (an event larger than its
		// broker accepts): this failure is the last, so it parks now with
		// the relay's error in its reason.
		maxFailures, retryAfter = 1, 0
	}
	res, err := s.store.Nack(ctx, store.NackParams{
		EventID: t.EventID, Epoch: t.Epoch, Error: nackErrorText(req.GetError()), RetryAfter: retryAfter,
		BackoffBase: s.cfg.BackoffBase, BackoffCap: s.cfg.BackoffCap, MaxFailures: maxFailures,
	})
	if errors.Is(err, store.ErrLeaseLost) {
		return nil, status.Error(codes.FailedPrecondition,
			"lease is no longer current (acked, expired and re-leased, or released), or the event is not its earliest pending revision (with max_in_flight_per_aggregate above 1, the acks of the revisions before it must land first); nothing changed")
	}
	if err != nil {
		return nil, s.dbError(ctx, "nack", err)
	}
	ended := res.Ended
	if len(ended) == 0 {
		ended = []uuid.UUID{t.EventID}
	}
	if h := s.beforeNackNotice.get(); h != nil && res.Holder != uuid.Nil {
		h(res.Holder)
	}
	if res.Holder != uuid.Nil && !s.released(res.Holder, false, t.Epoch, ended...) {
		// Held through another replica: tell it, so the session frees its
		// credit now rather than at its next reconciliation. Best effort;
		// the reconciliation still catches it.
		if err := s.store.NotifyReleased(ctx, res.Holder); err != nil && ctx.Err() == nil {
			s.log.Warn("telling the holder's replica about a nack failed; it reconciles", "err", err)
		}
	}
	if res.Parked {
		s.metrics.nacks.WithLabelValues("parked").Inc()
	} else {
		s.metrics.nacks.WithLabelValues("backoff").Inc()
	}
	out := &outboxv1.NackResponse{Parked: res.Parked, Failures: uint32(res.Failures)}
	if !res.NextAttemptAt.IsZero() {
		out.NextAttemptAt = timestamppb.New(res.NextAttemptAt)
	}
	return out, nil
}

func (r *relayService) ExtendLease(ctx context.Context, req *outboxv1.ExtendLeaseRequest) (*outboxv1.ExtendLeaseResponse, error) {
	s := r.s
	var f fieldErrors
	t, err := r.verify(req.GetEventId(), req.GetLeaseToken())
	if err != nil {
		f.add("lease_token", "%v", err)
	}
	if req.GetTtl() == nil {
		f.add("ttl", "is required")
	}
	ttl := checkDuration(&f, "ttl", req.GetTtl(), 0, s.cfg.MinLeaseTTL, s.cfg.MaxLeaseTTL)
	if err := f.err(); err != nil {
		return nil, err
	}
	if err := s.authorizeEvents(ctx, []uuid.UUID{t.EventID}); err != nil {
		return nil, err
	}
	exp, err := s.store.ExtendLease(ctx, t.EventID, t.Epoch, ttl)
	if errors.Is(err, store.ErrLeaseLost) {
		return nil, status.Error(codes.FailedPrecondition, "lease is no longer current (acked, expired and re-leased, or released); nothing changed")
	}
	if err != nil {
		return nil, s.dbError(ctx, "extend lease", err)
	}
	// ttl is what the lease had left as the statement set it.
	return &outboxv1.ExtendLeaseResponse{LeaseExpiresAt: timestamppb.New(exp), LeaseTtlRemaining: durationpb.New(ttl)}, nil
}

// authorizeEvents refuses the whole request (PermissionDenied, nothing
// changed) when the caller's token is limited to streams and one of the
// events is of another. Unrestricted callers cost nothing; restricted ones
// one primary-key lookup per event.
func (s *Server) authorizeEvents(ctx context.Context, ids []uuid.UUID) error {
	p, ok := auth.PrincipalFrom(ctx)
	if !ok || p.AllStreams() || len(ids) == 0 {
		return nil
	}
	streams, err := s.store.EventStreams(ctx, ids)
	if err != nil {
		return s.dbError(ctx, "authorize", err)
	}
	return auth.AuthorizeStreams(ctx, streams...)
}

// checkSubscriptionLimit bounds the Subscribe streams one caller (its token's
// name, or its relay_id without auth) may hold open on this replica, so a
// misbehaving relay cannot pile up sessions.
func (s *Server) checkSubscriptionLimit(ctx context.Context, relayID string) error {
	key := subscriberKey(ctx, relayID)
	n := 0
	s.forEachSession(func(ss *session) {
		if ss.subscriber == key {
			n++
		}
	})
	if n >= s.cfg.MaxSubscriptionsPerRelay {
		return status.Errorf(codes.ResourceExhausted,
			"%s already holds %d Subscribe streams on this replica (the limit); close some or raise --max-subscriptions-per-relay", key, n)
	}
	return nil
}

// subscriberKey names who opens a Subscribe stream, for the per-relay limit.
func subscriberKey(ctx context.Context, relayID string) string {
	if p, ok := auth.PrincipalFrom(ctx); ok {
		return "token " + p.Name
	}
	return "relay " + relayID
}

// maxNackErrorBytes is how much of a nack's error text is kept (as
// last_error, and quoted in a parked reason).
const maxNackErrorBytes = 4096

// nackErrorText makes a relay's error text storable, so a nack never fails
// because of it: PostgreSQL text cannot hold NUL (each becomes U+FFFD), and
// the text is cut at maxNackErrorBytes on a character boundary, marked with
// an ellipsis. (Protobuf already guarantees valid UTF-8.)
func nackErrorText(s string) string {
	s = strings.ReplaceAll(strings.ToValidUTF8(s, "\uFFFD"), "\x00", "\uFFFD")
	if len(s) <= maxNackErrorBytes {
		return s
	}
	const ellipsis = "…"
	cut := maxNackErrorBytes - len(ellipsis)
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + ellipsis
}

// ListSources answers the one source a single-source server serves,
// "default", to a caller whose token may access any stream of it (with
// streams set: every one of them, "*" meaning every stream of it); to one
// scoped otherwise ("orders/*") it answers none.
func (r *relayService) ListSources(ctx context.Context, req *outboxv1.ListSourcesRequest) (*outboxv1.ListSourcesResponse, error) {
	if err := CheckListSources(req); err != nil {
		return nil, err
	}
	if p, ok := auth.PrincipalFrom(ctx); ok && !SourceListed(p, auth.DefaultSource, req.GetStreams()) {
		return &outboxv1.ListSourcesResponse{}, nil
	}
	return &outboxv1.ListSourcesResponse{Sources: []string{auth.DefaultSource}}, nil
}

// CheckListSources validates a ListSourcesRequest: each of streams is "*"
// or a stream name, at most 64 of them.
func CheckListSources(req *outboxv1.ListSourcesRequest) error {
	var f fieldErrors
	if n := len(req.GetStreams()); n > maxSubscribeStreams {
		f.add("streams", "at most %d names, got %d", maxSubscribeStreams, n)
	}
	for i, name := range req.GetStreams() {
		if name != "*" {
			checkStream(&f, fmt.Sprintf("streams[%d]", i), name)
		}
	}
	return f.err()
}

// SourceListed reports whether ListSources names source to p: p may access
// some stream of it and, for each of streams, that stream ("*": every
// stream of the source), so that a relay subscribing to those streams of
// it is not refused.
func SourceListed(p *auth.Principal, source string, streams []string) bool {
	q, ok := p.ForSource(source)
	if !ok {
		return false
	}
	for _, s := range streams {
		if s == "*" && !q.AllStreams() || s != "*" && !q.AllowsStream(s) {
			return false
		}
	}
	return true
}
