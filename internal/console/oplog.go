package console

// The record of operator actions (ListOperatorActions) and finding an event
// by its id.

import (
	"fmt"
	"net/http"
	"slices"
	"strings"

	"github.com/google/uuid"
	"google.golang.org/protobuf/types/known/timestamppb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/actiondetail"
	"github.com/outboxd/outboxd/internal/multisource"
)

const (
	actionsPageSize = 50
	// aggregateActionsShown is how many of an aggregate's actions its page
	// shows.
	aggregateActionsShown = 20
)

// actionKinds are the kinds the actions page filters by.
var actionKinds = []string{"retry", "skip", "bulk_retry", "bulk_skip", "republish"}

// actions lists operator actions: who did what, when, why.
func (c *Console) actions(q *request) {
	r := q.r
	f := map[string]string{"Source": strings.TrimSpace(r.FormValue("source")), "Stream": strings.TrimSpace(r.FormValue("stream")),
		"Key": strings.TrimSpace(r.FormValue("key")), "Action": r.FormValue("action"), "Since": r.FormValue("since")}
	sources := c.sourceNames(q)
	f["Source"] = chosenSource(sources, f["Source"])
	addr := address(f["Source"], f["Stream"])
	// Each source keeps its own record: the page shows one source's, or
	// every source's (source "*"), each row naming its source.
	data := map[string]any{"F": f, "Kinds": actionKinds, "Sources": sources, "Source": sourceOf(addr)}
	req := &outboxv1.ListOperatorActionsRequest{Stream: addr, AggregateKey: f["Key"], Action: f["Action"],
		PageSize: actionsPageSize, PageToken: r.FormValue("page")}
	bad := func(msg string) {
		data["Error"] = msg
		c.render(q.w, r, http.StatusBadRequest, "actions", q, data)
	}
	if req.AggregateKey != "" && f["Stream"] == "" {
		bad("An aggregate key needs its stream.")
		return
	}
	if req.Action != "" && !slices.Contains(actionKinds, req.Action) {
		bad(fmt.Sprintf("unknown action %q", req.Action))
		return
	}
	if f["Since"] != "" {
		t, err := parseTime(f["Since"])
		if err != nil {
			bad("since: " + err.Error())
			return
		}
		req.Since = timestamppb.New(t)
	}
	resp, err := c.admin.ListOperatorActions(q.ctx, req)
	code := http.StatusOK
	if err != nil {
		data["Error"], code = describe(err), httpCode(err)
	} else {
		data["Actions"], data["Next"], data["PerAggregate"] = resp.GetActions(), resp.GetNextPageToken(), req.AggregateKey != ""
		data["Skipped"] = resp.GetSkippedSources()
	}
	c.render(q.w, r, code, "actions", q, data)
}

// aggregateActions adds an aggregate's latest operator actions to its page.
func (c *Console) aggregateActions(q *request, stream, key string, data map[string]any) {
	resp, err := c.admin.ListOperatorActions(q.ctx, &outboxv1.ListOperatorActionsRequest{Stream: stream, AggregateKey: key,
		PageSize: aggregateActionsShown})
	if err != nil {
		data["ActionsError"] = describe(err)
		return
	}
	data["Actions"], data["MoreActions"] = resp.GetActions(), resp.GetNextPageToken() != ""
}

// event finds one event by its id, from the search box in every page's
// header.
func (c *Console) event(q *request) {
	id := strings.TrimSpace(q.r.FormValue("id"))
	data := map[string]any{"ID": id}
	// An id may come as its sinks' message id, SOURCE/EVENT_ID outside
	// default.
	source, bare := multisource.SplitStream(id)
	if _, err := uuid.Parse(bare); err != nil {
		data["Error"] = fmt.Sprintf("%q is not an event id: an event id is a UUID such as 0190a8c2-5d1e-7c3a-9f00-2b4c6d8e0f12 (orders/0190a8c2-… for source orders).", id)
		if id == "" {
			data["Error"] = "Enter an event id (a UUID) to find the event."
		}
		c.render(q.w, q.r, http.StatusBadRequest, "event", q, data)
		return
	}
	resp, err := c.admin.ListEvents(q.ctx, &outboxv1.ListEventsRequest{EventId: id})
	if err == nil && len(resp.GetEvents()) == 0 && source == multisource.Default && bare == id {
		// A bare id is default's, but its owner may have pasted one of
		// another source without the prefix: look in the others.
		for _, src := range c.sourceNames(q) {
			if src == multisource.Default {
				continue
			}
			more, err := c.admin.ListEvents(q.ctx, &outboxv1.ListEventsRequest{EventId: multisource.JoinStream(src, id)})
			if err == nil && len(more.GetEvents()) > 0 {
				resp = more
				break
			}
		}
	}
	addressEvents(resp.GetEvents())
	switch {
	case err != nil:
		data["Error"] = describe(err)
		c.render(q.w, q.r, httpCode(err), "event", q, data)
	case len(resp.GetEvents()) == 0:
		data["Error"] = fmt.Sprintf("No event has id %s: it never existed, or it was purged after it was published.", id)
		c.render(q.w, q.r, http.StatusNotFound, "event", q, data)
	default:
		data["E"] = resp.GetEvents()[0]
		c.render(q.w, q.r, http.StatusOK, "event", q, data)
	}
}

// actionDetail is what an action did to the aggregate a listing named.
func actionDetail(a *outboxv1.OperatorAction) string {
	return actiondetail.Of(a)
}
