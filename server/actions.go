package server

// The record of operator actions: ListOperatorActions reads what every
// retry, skip, bulk action and republish wrote (store.ListActions).

import (
	"context"
	"encoding/base64"
	"slices"
	"strconv"
	"strings"

	"google.golang.org/protobuf/types/known/timestamppb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/auth"
	"github.com/outboxd/outboxd/internal/store"
)

// maxActionScans bounds how many pages ListOperatorActions reads to fill one
// page for a stream-limited token, whose visible actions may be sparse; the
// page then ends early, with a token that continues the listing.
const maxActionScans = 10

func (a *adminService) ListOperatorActions(ctx context.Context, req *outboxv1.ListOperatorActionsRequest) (*outboxv1.ListOperatorActionsResponse, error) {
	var f fieldErrors
	p := store.ListActionsParams{Stream: req.GetStream(), AggregateKey: req.GetAggregateKey(), Action: req.GetAction(),
		Limit: checkPageSize(&f, req.GetPageSize())}
	switch {
	case p.AggregateKey != "":
		checkAggregate(&f, p.Stream, p.AggregateKey)
	case p.Stream != "":
		checkStream(&f, "stream", p.Stream)
	}
	if p.Action != "" && !slices.Contains(store.ActionNames, p.Action) {
		f.add("action", "%.40q is not an action; want one of %s", p.Action, strings.Join(store.ActionNames, ", "))
	}
	p.Since = checkTimestamp(&f, "since", req.GetSince())
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
	// Naming a stream the token may not see is refused, not answered with
	// an empty page.
	if p.Stream != "" {
		if err := auth.AuthorizeStreams(ctx, p.Stream); err != nil {
			return nil, err
		}
	}
	visible := actionVisible(ctx)
	limit := p.Limit
	p.Limit++
	resp := &outboxv1.ListOperatorActionsResponse{}
	var last int64 // the id of the last action read
	for range maxActionScans {
		list, err := a.s.store.ListActions(ctx, p)
		if err != nil {
			return nil, a.s.dbError(ctx, "list operator actions", err)
		}
		for _, r := range list {
			if len(resp.Actions) == limit {
				// r follows the page: continue after the last one read.
				resp.NextPageToken = actionToken(last)
				return resp, nil
			}
			last = r.ID
			if visible(r.Stream) {
				resp.Actions = append(resp.Actions, actionProto(r))
			}
		}
		if len(list) <= limit {
			return resp, nil
		}
		p.Before = last
	}
	// Scanned enough for one call: a shorter page (or an empty one) whose
	// token continues where the scan stopped.
	resp.NextPageToken = actionToken(last)
	return resp, nil
}

func actionToken(id int64) string {
	return base64.RawURLEncoding.EncodeToString([]byte(strconv.FormatInt(id, 10)))
}

// actionVisible returns the test an action's stream (or a bulk filter's
// stream pattern) must pass for the caller to see it: a stream-limited
// token sees the actions whose stream it may access, and bulk actions whose
// pattern it covers, as authorizeFilter would let it run them.
func actionVisible(ctx context.Context) func(string) bool {
	p, ok := auth.PrincipalFrom(ctx)
	if !ok || p.AllStreams() {
		return func(string) bool { return true }
	}
	return func(stream string) bool {
		return stream != "*" && p.AllowsStream(stream)
	}
}

func actionProto(r store.ActionRecord) *outboxv1.OperatorAction {
	out := &outboxv1.OperatorAction{
		ActionId:    r.ID,
		Action:      r.Action,
		Actor:       r.Actor,
		Reason:      r.Reason,
		Stream:      r.Stream,
		RequestJson: r.Request,
		Aggregates:  r.Aggregates,
		Events:      r.Events,
		StartedAt:   timestamppb.New(r.StartedAt),
		FinishedAt:  optionalTimestamp(r.FinishedAt),
		DetailJson:  r.Detail,
	}
	return out
}
