package server

// The dead-letter workflow: listing aggregates in trouble and their attempt
// history, bulk retry and skip by filter, and republish. Bulk actions run
// the single-aggregate operations (store.RetryAggregate, store.SkipEvent)
// one aggregate at a time, each its own short transaction, so a bulk call
// never holds locks on more than one aggregate; they are recorded in
// outbox.operator_action before they start and updated when they end.

import (
	"cmp"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/auth"
	"github.com/outboxd/outboxd/internal/store"
)

const (
	// bulkBatch is how many aggregates a bulk action reads per page.
	bulkBatch = 100
	// bulkSample is how many matched aggregates a bulk response shows.
	bulkSample = 20
	// maxErrorFilterLen bounds AggregateFilter.error_contains.
	maxErrorFilterLen = 1024
)

// aggregateStateNames maps the proto states back to delivery states.
var aggregateStateNames = map[outboxv1.AggregateState]string{
	outboxv1.AggregateState_AGGREGATE_STATE_READY:   "ready",
	outboxv1.AggregateState_AGGREGATE_STATE_LEASED:  "leased",
	outboxv1.AggregateState_AGGREGATE_STATE_BACKOFF: "backoff",
	outboxv1.AggregateState_AGGREGATE_STATE_PARKED:  "parked",
	outboxv1.AggregateState_AGGREGATE_STATE_GAP:     "gap",
}

// checkFilter validates an AggregateFilter; field names are prefixed with
// "filter.". bulk refuses a filter that sets nothing.
func checkFilter(f *fieldErrors, pf *outboxv1.AggregateFilter, bulk bool) store.AggregateFilter {
	var out store.AggregateFilter
	if st := pf.GetStream(); st == "" {
		out.StreamPrefix = true
	} else {
		out.Stream, out.StreamPrefix = checkStreamPattern(f, "filter.stream", st)
	}
	for i, s := range pf.GetStates() {
		name, ok := aggregateStateNames[s]
		if !ok {
			f.add(fmt.Sprintf("filter.states[%d]", i), "%v is not a state with pending work (ready, leased, backoff, parked, gap)", s)
			continue
		}
		if !slices.Contains(out.States, name) {
			out.States = append(out.States, name)
		}
	}
	if e := pf.GetErrorContains(); checkText(f, "filter.error_contains", e, maxErrorFilterLen) {
		out.ErrorContains = e
	}
	out.PendingBefore = checkTimestamp(f, "filter.pending_before", pf.GetPendingBefore())
	out.StalledOnly = pf.GetStalledOnly()
	if bulk && pf.GetStream() == "" && len(pf.GetStates()) == 0 && pf.GetErrorContains() == "" &&
		pf.GetPendingBefore() == nil && !pf.GetStalledOnly() {
		f.add("filter", `is empty: set at least one field (stream "*" means every stream) so that a bulk action never applies to everything by accident`)
	}
	return out
}

// authorizeFilter checks a filter's streams against a stream-limited token:
// an exact stream must be allowed, a prefix must be covered by one of the
// token's patterns (a pattern that matches the literal "billing.*" ends in a
// wildcard that matches every stream with that prefix), and every stream
// needs an unlimited token.
func authorizeFilter(ctx context.Context, f store.AggregateFilter) error {
	switch {
	case !f.StreamPrefix:
		return auth.AuthorizeStreams(ctx, f.Stream)
	case f.Stream == "":
		return auth.AuthorizeAllStreams(ctx)
	}
	p, ok := auth.PrincipalFrom(ctx)
	if !ok || p.AllStreams() || p.AllowsStream(f.Stream+"*") {
		return nil
	}
	return status.Errorf(codes.PermissionDenied, "token %q may not access every stream matching %.140q; it is limited to %s",
		p.Name, f.Stream+"*", strings.Join(p.Streams, ","))
}

// aggregatePageToken is ListAggregates' opaque cursor.
type aggregatePageToken struct {
	T int64  `json:"t"`
	S string `json:"s"`
	K string `json:"k"`
}

func encodeAggregateToken(p store.AggregatePosition) string {
	b, _ := json.Marshal(aggregatePageToken{T: p.PendingSince.UnixNano(), S: p.Stream, K: p.AggregateKey})
	return base64.RawURLEncoding.EncodeToString(b)
}

func decodeAggregateToken(tok string) (store.AggregatePosition, error) {
	raw, err := base64.RawURLEncoding.DecodeString(tok)
	if err != nil {
		return store.AggregatePosition{}, errors.New("not base64")
	}
	var t aggregatePageToken
	if err := json.Unmarshal(raw, &t); err != nil || t.S == "" {
		return store.AggregatePosition{}, errors.New("malformed")
	}
	return store.AggregatePosition{PendingSince: time.Unix(0, t.T), Stream: t.S, AggregateKey: t.K}, nil
}

// checkPageSize reads an optional page size.
func checkPageSize(f *fieldErrors, n uint32) int {
	if n > maxPageSize {
		f.add("page_size", "must be at most %d, got %d", maxPageSize, n)
		return defaultPageSize
	}
	if n == 0 {
		return defaultPageSize
	}
	return int(n)
}

func (a *adminService) ListAggregates(ctx context.Context, req *outboxv1.ListAggregatesRequest) (*outboxv1.ListAggregatesResponse, error) {
	var f fieldErrors
	filter := checkFilter(&f, req.GetFilter(), false)
	limit := checkPageSize(&f, req.GetPageSize())
	var after store.AggregatePosition
	if tok := req.GetPageToken(); tok != "" {
		var err error
		if after, err = decodeAggregateToken(tok); err != nil {
			f.add("page_token", "is not a token this server issued: %v", err)
		}
	}
	if err := f.err(); err != nil {
		return nil, err
	}
	if err := authorizeFilter(ctx, filter); err != nil {
		return nil, err
	}
	list, err := a.s.store.ListAggregates(ctx, filter, after, limit+1)
	if err != nil {
		return nil, a.s.dbError(ctx, "list aggregates", err)
	}
	resp := &outboxv1.ListAggregatesResponse{}
	if len(list) > limit {
		list = list[:limit]
		resp.NextPageToken = encodeAggregateToken(list[limit-1].Position)
	}
	for _, l := range list {
		resp.Aggregates = append(resp.Aggregates, aggregateProto(l.Aggregate))
	}
	return resp, nil
}

var attemptOutcomes = map[string]outboxv1.AttemptOutcome{
	"nacked":   outboxv1.AttemptOutcome_ATTEMPT_OUTCOME_NACKED,
	"expired":  outboxv1.AttemptOutcome_ATTEMPT_OUTCOME_EXPIRED,
	"released": outboxv1.AttemptOutcome_ATTEMPT_OUTCOME_RELEASED,
	"parked":   outboxv1.AttemptOutcome_ATTEMPT_OUTCOME_PARKED,
}

func (a *adminService) ListAttempts(ctx context.Context, req *outboxv1.ListAttemptsRequest) (*outboxv1.ListAttemptsResponse, error) {
	var f fieldErrors
	p := store.AttemptsParams{Limit: checkPageSize(&f, req.GetPageSize())}
	switch {
	case req.GetEventId() != "":
		id, err := uuid.Parse(req.GetEventId())
		if err != nil {
			f.add("event_id", "must be a UUID")
		}
		p.EventID = id
		if req.GetStream() != "" || req.GetAggregateKey() != "" {
			f.add("event_id", "names the event; leave stream and aggregate_key empty")
		}
	case req.GetStream() == "" && req.GetAggregateKey() == "":
		f.add("event_id", "or stream and aggregate_key are required")
	default:
		checkAggregate(&f, req.GetStream(), req.GetAggregateKey())
		p.Stream, p.AggregateKey = req.GetStream(), req.GetAggregateKey()
	}
	if tok := req.GetPageToken(); tok != "" {
		raw, err := base64.RawURLEncoding.DecodeString(tok)
		n, perr := strconv.ParseInt(string(raw), 10, 64)
		if err != nil || perr != nil || n <= 0 {
			f.add("page_token", "is not a token this server issued")
		}
		p.Before = n
	}
	if err := f.err(); err != nil {
		return nil, err
	}
	if p.EventID != uuid.Nil {
		if err := a.s.authorizeEvents(ctx, []uuid.UUID{p.EventID}); err != nil {
			return nil, err
		}
	} else if err := auth.AuthorizeStreams(ctx, p.Stream); err != nil {
		return nil, err
	}
	limit := p.Limit
	p.Limit++
	list, err := a.s.store.Attempts(ctx, p)
	if err != nil {
		return nil, a.s.dbError(ctx, "list attempts", err)
	}
	resp := &outboxv1.ListAttemptsResponse{}
	if len(list) > limit {
		list = list[:limit]
		resp.NextPageToken = base64.RawURLEncoding.EncodeToString([]byte(strconv.FormatInt(list[limit-1].ID, 10)))
	}
	for _, at := range list {
		resp.Attempts = append(resp.Attempts, &outboxv1.Attempt{
			EventId: at.EventID.String(), Stream: at.Stream, AggregateKey: at.AggregateKey, Revision: at.Revision,
			Attempt: uint32(at.Attempt), Outcome: attemptOutcomes[at.Outcome], Error: at.Error,
			RelayId: at.RelayID, ReplicaId: at.ReplicaID, At: timestamppb.New(at.At),
		})
	}
	if len(list) == 0 && p.EventID != uuid.Nil {
		// Say whether the event exists at all, rather than an empty page
		// for a typo.
		ok, err := a.s.store.EventExists(ctx, p.EventID)
		if err != nil {
			return nil, a.s.dbError(ctx, "list attempts", err)
		}
		if !ok {
			return nil, status.Errorf(codes.NotFound, "event %s does not exist (never did, or was purged after publishing)", p.EventID)
		}
	}
	return resp, nil
}

// bulkMatch counts the aggregates a bulk action's filter matches and
// samples the first of them.
func (a *adminService) bulkMatch(ctx context.Context, filter store.AggregateFilter) (int64, []*outboxv1.Aggregate, error) {
	n, err := a.s.store.CountAggregates(ctx, filter)
	if err != nil {
		return 0, nil, err
	}
	list, err := a.s.store.ListAggregates(ctx, filter, store.AggregatePosition{}, bulkSample)
	if err != nil {
		return 0, nil, err
	}
	sample := make([]*outboxv1.Aggregate, 0, len(list))
	for _, l := range list {
		sample = append(sample, aggregateProto(l.Aggregate))
	}
	return n, sample, nil
}

// eachMatch calls fn once for every aggregate filter matches, in pages in
// (stream, aggregate_key) order, and returns how many it passed to fn. The
// key order is what makes it once: fn releases work (a skip, a retry) that
// relays deliver while later pages are read, and a delivered aggregate can
// match again (its next event fails the same way), but its key stays
// behind the cursor. An aggregate that comes to match only while the walk
// is under way is acted on if its key is still ahead, as if it had matched
// from the start. The sessions are woken after each page, so what fn
// released is delivered while the action goes on, not after it.
func (a *adminService) eachMatch(ctx context.Context, filter store.AggregateFilter, fn func(store.ListedAggregate) error) (int64, error) {
	page := cmp.Or(int(a.s.bulkPage.Load()), bulkBatch)
	var afterStream, afterKey string
	var seen int64
	for {
		list, err := a.s.store.ListAggregatesByKey(ctx, filter, afterStream, afterKey, page)
		if err != nil {
			return seen, err
		}
		for _, l := range list {
			if err := ctx.Err(); err != nil {
				return seen, err
			}
			seen++
			if h := a.s.beforeBulkAct.get(); h != nil {
				h(ctx, l.Stream, l.AggregateKey)
			}
			if err := fn(l); err != nil {
				return seen, err
			}
		}
		if len(list) < page {
			return seen, nil
		}
		a.s.wake.broadcast()
		if h := a.s.afterBulkPage.get(); h != nil {
			h()
		}
		afterStream, afterKey = list[len(list)-1].Stream, list[len(list)-1].AggregateKey
	}
}

// filterRecord is a filter as the audit record shows it.
func filterRecord(pf *outboxv1.AggregateFilter) map[string]any {
	m := map[string]any{"stream": pf.GetStream(), "error_contains": pf.GetErrorContains(), "stalled_only": pf.GetStalledOnly()}
	var states []string
	for _, s := range pf.GetStates() {
		states = append(states, aggregateStateNames[s])
	}
	m["states"] = states
	if pf.GetPendingBefore() != nil {
		m["pending_before"] = pf.GetPendingBefore().AsTime()
	}
	return m
}

func (a *adminService) BulkRetry(ctx context.Context, req *outboxv1.BulkRetryRequest) (*outboxv1.BulkRetryResponse, error) {
	var f fieldErrors
	filter := checkFilter(&f, req.GetFilter(), true)
	retryable := []string{"backoff", "parked"}
	if req.GetAcceptGap() {
		retryable = append(retryable, "gap")
		checkReason(&f, req.GetReason())
	} else if r := req.GetReason(); r != "" {
		checkReason(&f, r)
	}
	if len(filter.States) == 0 {
		filter.States = retryable
	}
	for _, st := range filter.States {
		if !slices.Contains(retryable, st) {
			f.add("filter.states", "BulkRetry retries parked and backing-off aggregates (and gap-held ones with accept_gap), not %s ones", st)
			break
		}
	}
	who := actor(ctx, &f, req.GetActor())
	if err := f.err(); err != nil {
		return nil, err
	}
	if err := authorizeFilter(ctx, filter); err != nil {
		return nil, err
	}
	// An aggregate a discovery round woke from its gap reads ready until its
	// next claim holds it there again: accepting gaps takes it too.
	filter.WokenGaps = req.GetAcceptGap()
	matched, sample, err := a.bulkMatch(ctx, filter)
	if err != nil {
		return nil, a.s.dbError(ctx, "bulk retry", err)
	}
	resp := &outboxv1.BulkRetryResponse{Matched: matched, Sample: sample}
	if req.GetDryRun() {
		return resp, nil
	}
	actionID, err := a.s.store.StartAction(ctx, store.OperatorAction{Action: store.ActionBulkRetry, Actor: who, Reason: req.GetReason(),
		Stream: req.GetFilter().GetStream(), Request: map[string]any{"filter": filterRecord(req.GetFilter()), "accept_gap": req.GetAcceptGap()}})
	if err != nil {
		return nil, a.s.dbError(ctx, "bulk retry", err)
	}
	seen, err := a.eachMatch(ctx, filter, func(l store.ListedAggregate) error {
		woken := l.State == "ready" // matched as woken from its gap (WokenGaps)
		agg, err := a.s.store.RetryAggregate(ctx, store.RetryParams{Stream: l.Stream, AggregateKey: l.AggregateKey,
			AcceptGap: req.GetAcceptGap() && (l.State == "gap" || woken), Reason: req.GetReason(), Actor: who, ActionID: actionID})
		var se *store.StateError
		switch {
		case errors.Is(err, store.ErrNotFound) || errors.As(err, &se):
			return nil // its state changed since it matched (a lease, a relay's ack): not ours to retry
		case err != nil:
			return err
		case woken && agg.DeliveredRevision == l.DeliveredRevision:
			return nil // its missing revision was committed meanwhile: no gap to accept
		}
		resp.Retried++
		return nil
	})
	resp.Matched = max(resp.Matched, seen)
	return resp, a.finishBulk(ctx, "bulk retry", actionID, resp.Retried, resp.Retried, who, err)
}

// finishBulk records a bulk action's outcome and wakes the sessions; err is
// the action's own error, reported after the record.
func (a *adminService) finishBulk(ctx context.Context, what string, actionID, aggregates, events int64, who string, err error) error {
	// Recorded even when the call was cut short, with what was done.
	ferr := a.s.store.FinishAction(context.WithoutCancel(ctx), actionID, aggregates, events)
	a.s.wake.broadcast()
	a.s.log.Warn(what+" by operator", "action_id", actionID, "actor", who, "aggregates", aggregates, "events", events, "err", err)
	if err == nil {
		err = ferr
	}
	if err != nil {
		if _, ok := status.FromError(err); ok && status.Code(err) != codes.Unknown {
			return err
		}
		if ctx.Err() != nil {
			return status.Errorf(codes.Canceled, "%s cut short after %d aggregates (action %d records them): %v", what, aggregates, actionID, err)
		}
		return a.s.dbError(ctx, what, err)
	}
	return nil
}

func (a *adminService) BulkSkip(ctx context.Context, req *outboxv1.BulkSkipRequest) (*outboxv1.BulkSkipResponse, error) {
	var f fieldErrors
	filter := checkFilter(&f, req.GetFilter(), true)
	checkReason(&f, req.GetReason())
	who := actor(ctx, &f, req.GetActor())
	if err := f.err(); err != nil {
		return nil, err
	}
	if err := authorizeFilter(ctx, filter); err != nil {
		return nil, err
	}
	matched, sample, err := a.bulkMatch(ctx, filter)
	if err != nil {
		return nil, a.s.dbError(ctx, "bulk skip", err)
	}
	resp := &outboxv1.BulkSkipResponse{Matched: matched, Sample: sample}
	if req.GetDryRun() {
		return resp, nil
	}
	actionID, err := a.s.store.StartAction(ctx, store.OperatorAction{Action: store.ActionBulkSkip, Actor: who, Reason: req.GetReason(),
		Stream: req.GetFilter().GetStream(), Request: map[string]any{"filter": filterRecord(req.GetFilter())}})
	if err != nil {
		return nil, a.s.dbError(ctx, "bulk skip", err)
	}
	reason := fmt.Sprintf("%s (bulk skip, action %d)", req.GetReason(), actionID)
	seen, err := a.eachMatch(ctx, filter, func(l store.ListedAggregate) error {
		if l.NextPendingEventID == uuid.Nil {
			return nil
		}
		// The event that was next when it matched, and only it: if a relay
		// published it meanwhile, SkipEvent refuses, and its successor is
		// not skipped in its place.
		_, err := a.s.store.SkipEventOf(ctx, actionID, l.NextPendingEventID, reason, who)
		switch {
		case errors.Is(err, store.ErrNotFound), errors.Is(err, store.ErrAlreadyPublished), errors.Is(err, store.ErrAlreadySkipped):
			return nil
		case err != nil:
			return err
		}
		resp.Skipped++
		return nil
	})
	resp.Matched = max(resp.Matched, seen)
	return resp, a.finishBulk(ctx, "bulk skip", actionID, resp.Skipped, resp.Skipped, who, err)
}

func (a *adminService) Republish(ctx context.Context, req *outboxv1.RepublishRequest) (*outboxv1.RepublishResponse, error) {
	var f fieldErrors
	checkStream(&f, "stream", req.GetStream())
	key := req.GetAggregateKey()
	checkText(&f, "aggregate_key", key, maxAggregateKeyLen)
	ranged := req.GetPublishedAfter() != nil || req.GetPublishedBefore() != nil
	after := checkTimestamp(&f, "published_after", req.GetPublishedAfter())
	before := checkTimestamp(&f, "published_before", req.GetPublishedBefore())
	switch {
	case req.GetFromRevision() < 0:
		f.add("from_revision", "must be positive")
	case req.GetFromRevision() > 0 && key == "":
		f.add("from_revision", "needs aggregate_key (a time range selects aggregates of a whole stream)")
	case req.GetFromRevision() > 0 && ranged:
		f.add("from_revision", "and a time range exclude each other")
	case req.GetFromRevision() == 0 && !ranged:
		f.add("from_revision", "or published_after is required: say what to deliver again")
	}
	if ranged {
		if req.GetPublishedAfter() == nil {
			f.add("published_after", "is required with a time range")
		}
		if before.IsZero() {
			before = time.Now()
		}
		if !after.IsZero() && !before.After(after) {
			f.add("published_before", "must be after published_after")
		}
	}
	checkReason(&f, req.GetReason())
	who := actor(ctx, &f, req.GetActor())
	if err := f.err(); err != nil {
		return nil, err
	}
	if err := auth.AuthorizeStreams(ctx, req.GetStream()); err != nil {
		return nil, err
	}
	action := store.OperatorAction{Action: store.ActionRepublish, Actor: who, Reason: req.GetReason(),
		Stream: req.GetStream(), Request: map[string]any{"stream": req.GetStream(), "aggregate_key": key, "from_revision": req.GetFromRevision(),
			"published_after": after, "published_before": before, "include_skipped": req.GetIncludeSkipped()}}
	resp := &outboxv1.RepublishResponse{}
	// one rewinds c, as part of the bulk action actionID or, when own is
	// set, as an action of its own that its transaction records only if it
	// rewinds.
	one := func(c store.RepublishCandidate, actionID int64, own *store.OperatorAction) error {
		r, err := a.s.store.Republish(ctx, store.RepublishParams{Stream: c.Stream, AggregateKey: c.AggregateKey,
			FromRevision: c.FromRevision, ActionID: actionID, Own: own, DryRun: req.GetDryRun(), IncludeSkipped: req.GetIncludeSkipped()})
		var se *store.StateError
		switch {
		case errors.As(err, &se) && key == "":
			resp.RefusedAggregates++
			if len(resp.Refused) < bulkSample {
				resp.Refused = append(resp.Refused, c.Stream+"/"+c.AggregateKey+": "+se.Message)
			}
			return nil
		case errors.As(err, &se):
			return status.Error(codes.FailedPrecondition, se.Message)
		case errors.Is(err, store.ErrNotFound):
			return status.Errorf(codes.NotFound, "aggregate %s/%s has never had an event delivered", c.Stream, c.AggregateKey)
		case err != nil:
			return err
		}
		resp.Aggregates++
		resp.Events += r.Events
		resp.UnskippedEvents += r.Unskipped
		if own != nil {
			a.s.wake.broadcast()
			a.s.log.Warn("republish by operator", "action_id", r.ActionID, "actor", who, "aggregates", 1, "events", r.Events)
		}
		return nil
	}
	if key != "" {
		// One aggregate: its rewind and its record commit together, so a
		// refused republish (never delivered, parked, a purged revision in
		// the way) records nothing, as a refused retry or skip does not.
		// With a time range, its first revision published in it.
		c := store.RepublishCandidate{Stream: req.GetStream(), AggregateKey: key, FromRevision: req.GetFromRevision()}
		if ranged {
			list, err := a.s.store.RepublishCandidates(ctx, req.GetStream(), key, after, before, "", 1)
			if err != nil {
				return nil, a.s.dbError(ctx, "republish", err)
			}
			if len(list) == 0 {
				return resp, nil
			}
			c = list[0]
		}
		var own *store.OperatorAction
		if !req.GetDryRun() {
			own = &action
		}
		if err := one(c, 0, own); err != nil {
			return nil, a.republishError(ctx, err)
		}
		return resp, nil
	}
	if req.GetDryRun() {
		if err := a.eachCandidate(ctx, req.GetStream(), after, before, func(c store.RepublishCandidate) error { return one(c, 0, nil) }); err != nil {
			return nil, a.republishError(ctx, err)
		}
		return resp, nil
	}
	actionID, err := a.s.store.StartAction(ctx, action)
	if err != nil {
		return nil, a.s.dbError(ctx, "republish", err)
	}
	err = a.eachCandidate(ctx, req.GetStream(), after, before, func(c store.RepublishCandidate) error { return one(c, actionID, nil) })
	return resp, a.finishBulk(ctx, "republish", actionID, resp.Aggregates, resp.Events, who, err)
}

// republishError answers a republish that failed without an action on
// record: a status as it is, anything else as a database error.
func (a *adminService) republishError(ctx context.Context, err error) error {
	if _, ok := status.FromError(err); ok {
		return err
	}
	return a.s.dbError(ctx, "republish", err)
}

// eachCandidate calls fn for every aggregate of stream with an event
// published in [after, before), a page at a time.
func (a *adminService) eachCandidate(ctx context.Context, stream string, after, before time.Time, fn func(store.RepublishCandidate) error) error {
	afterKey := ""
	for {
		list, err := a.s.store.RepublishCandidates(ctx, stream, "", after, before, afterKey, bulkBatch)
		if err != nil {
			return err
		}
		for _, c := range list {
			if err := ctx.Err(); err != nil {
				return err
			}
			if err := fn(c); err != nil {
				return err
			}
		}
		if len(list) < bulkBatch {
			return nil
		}
		afterKey = list[len(list)-1].AggregateKey
	}
}
