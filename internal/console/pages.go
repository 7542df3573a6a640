package console

import (
	"fmt"
	"net/http"
	"slices"
	"strings"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
)

// Page sizes the console asks for.
const (
	eventsPageSize     = 50
	aggregatesPageSize = 100
	attemptsPageSize   = 50
)

func (c *Console) overview(q *request) {
	data := map[string]any{"PollMs": c.cfg.PollInterval.Milliseconds(), "WindowMin": int(c.cfg.History.Minutes())}
	code := http.StatusOK
	lag, err := c.admin.GetLag(q.ctx, &outboxv1.GetLagRequest{})
	if err != nil {
		data["Error"], code = describe(err), httpCode(err)
	} else {
		var rows []streamRow
		for _, l := range lag.GetStreams() {
			rows = append(rows, rowOf(l))
		}
		data["Streams"], data["Total"], data["Relays"] = rows, rowOf(lag.GetTotal()), lag.GetConnectedRelays()
		data["Sources"], data["Warnings"] = sourcesOf(lag), warningsOf(lag)
	}
	c.render(q.w, q.r, code, "overview", q, data)
}

// troubleStates are the states the aggregates page shows by default.
var troubleStates = []outboxv1.AggregateState{
	outboxv1.AggregateState_AGGREGATE_STATE_PARKED,
	outboxv1.AggregateState_AGGREGATE_STATE_BACKOFF,
	outboxv1.AggregateState_AGGREGATE_STATE_GAP,
}

// filterForm is the aggregate filter as the pages' forms carry it.
type filterForm struct {
	// Source is the source chosen when the replica serves several ("" or
	// default: the stream as typed).
	Source                          string
	Stream, State, Error, OlderThan string
	Stalled                         bool
}

// Address is the stream address the form asks for (see address).
func (f filterForm) Address() string { return address(f.Source, f.Stream) }

// InSource is the source the form asks: default unless it names another.
func (f filterForm) InSource() string { return sourceOf(f.Address()) }

// trouble reports whether the form asks for the default view: the trouble
// states, not only stalled aggregates.
func (f filterForm) trouble() bool { return (f.State == "" || f.State == "trouble") && !f.Stalled }

// StalledParam is the form's stalled flag as a query value ("" when off).
func (f filterForm) StalledParam() string {
	if f.Stalled {
		return "1"
	}
	return ""
}

func readFilter(r *http.Request) filterForm {
	v := func(k string) string { return strings.TrimSpace(r.FormValue(k)) }
	return filterForm{Source: v("source"), Stream: v("stream"), State: v("state"), Error: v("error"), OlderThan: v("older_than"),
		Stalled: r.FormValue("stalled") != ""}
}

// proto converts the form; state "" or "trouble" means parked, backing off
// or held at a gap.
func (f filterForm) proto() (*outboxv1.AggregateFilter, error) {
	out := &outboxv1.AggregateFilter{Stream: f.Address(), ErrorContains: f.Error, StalledOnly: f.Stalled}
	switch f.State {
	case "", "trouble":
		if !f.Stalled {
			out.States = troubleStates
		}
	case "any":
	default:
		st, ok := outboxv1.AggregateState_value["AGGREGATE_STATE_"+strings.ToUpper(f.State)]
		if !ok {
			return nil, fmt.Errorf("unknown state %q", f.State)
		}
		out.States = []outboxv1.AggregateState{outboxv1.AggregateState(st)}
	}
	if f.OlderThan != "" {
		d, err := time.ParseDuration(f.OlderThan)
		if err != nil || d < 0 {
			return nil, fmt.Errorf("older than: %q is not a duration like 30m or 2h", f.OlderThan)
		}
		out.PendingBefore = timestamppb.New(time.Now().Add(-d))
	}
	return out, nil
}

func (c *Console) aggregates(q *request) {
	f := readFilter(q.r)
	names := c.sourceNames(q)
	f.Source = chosenSource(names, f.Source)
	data := map[string]any{"F": f, "States": stateNames, "Sources": names}
	code := http.StatusOK
	filter, err := f.proto()
	if err != nil {
		data["Error"] = err.Error()
		c.render(q.w, q.r, http.StatusBadRequest, "aggregates", q, data)
		return
	}
	resp, err := c.admin.ListAggregates(q.ctx, &outboxv1.ListAggregatesRequest{
		Filter: filter, PageSize: aggregatesPageSize, PageToken: q.r.FormValue("page")})
	switch {
	case unimplemented(err):
		// Until the server has ListAggregates: the per-stream counts, and
		// the way in through the events browser.
		data["Unimplemented"] = describe(err)
		if lag, err := c.admin.GetLag(q.ctx, &outboxv1.GetLagRequest{}); err == nil {
			var rows []streamRow
			for _, l := range lag.GetStreams() {
				rows = append(rows, rowOf(l))
			}
			data["Streams"] = rows
		}
	case err != nil:
		data["Error"], code = describe(err), httpCode(err)
	default:
		data["Aggregates"], data["Next"], data["Skipped"] = resp.GetAggregates(), resp.GetNextPageToken(), resp.GetSkippedSources()
		if f.trouble() && q.r.FormValue("page") == "" {
			// Stalled aggregates that are ready or leased are in trouble
			// too, though in none of the trouble states: the first of them
			// under the list (stalled backing-off ones are in it already).
			stalled := &outboxv1.AggregateFilter{Stream: filter.GetStream(), ErrorContains: filter.GetErrorContains(),
				PendingBefore: filter.GetPendingBefore(), StalledOnly: true, States: activeStates}
			if more, err := c.admin.ListAggregates(q.ctx, &outboxv1.ListAggregatesRequest{Filter: stalled, PageSize: stalledPageSize}); err != nil {
				data["StalledError"] = describe(err)
			} else {
				data["Stalled"], data["MoreStalled"] = more.GetAggregates(), more.GetNextPageToken() != ""
			}
		}
	}
	c.render(q.w, q.r, code, "aggregates", q, data)
}

// activeStates are the states in which a stalled aggregate is not among the
// trouble states.
var activeStates = []outboxv1.AggregateState{
	outboxv1.AggregateState_AGGREGATE_STATE_READY,
	outboxv1.AggregateState_AGGREGATE_STATE_LEASED,
}

// stalledPageSize is how many stalled ready or leased aggregates the
// default aggregates page lists under the trouble states.
const stalledPageSize = 20

var stateNames = []string{"trouble", "any", "parked", "backoff", "gap", "ready", "leased"}

func (c *Console) aggregate(q *request) {
	stream, key := q.r.FormValue("stream"), q.r.FormValue("key")
	data := map[string]any{"Stream": stream, "Key": key,
		"CanRetry": q.can(c, outboxv1.AdminService_RetryAggregate_FullMethodName),
		"CanSkip":  q.can(c, outboxv1.AdminService_SkipEvent_FullMethodName)}
	if stream == "" || key == "" {
		data["Error"] = "Name a stream and an aggregate key."
		c.render(q.w, q.r, http.StatusBadRequest, "aggregate", q, data)
		return
	}
	agg, err := c.admin.GetAggregate(q.ctx, &outboxv1.GetAggregateRequest{Stream: stream, AggregateKey: key})
	if err != nil {
		data["Error"] = describe(err)
		c.render(q.w, q.r, httpCode(err), "aggregate", q, data)
		return
	}
	// Its stream as the address asked (the answer's is bare), for the
	// action forms.
	source := sourceOf(stream)
	data["A"], data["Source"] = agg.GetAggregate(), onSource(source)
	pending, err := c.admin.ListEvents(q.ctx, &outboxv1.ListEventsRequest{Stream: stream, AggregateKey: key,
		State: outboxv1.EventState_EVENT_STATE_PENDING, PageSize: eventsPageSize})
	if err != nil {
		data["EventsError"] = describe(err)
	} else {
		// Newest first from the server; the next to deliver goes on top.
		ev := pending.GetEvents()
		addressEvents(ev)
		slices.Reverse(ev)
		data["Pending"], data["MorePending"] = ev, pending.GetNextPageToken() != ""
	}
	recent, err := c.admin.ListEvents(q.ctx, &outboxv1.ListEventsRequest{Stream: stream, AggregateKey: key, PageSize: 10})
	if err == nil {
		addressEvents(recent.GetEvents())
		data["Recent"] = recent.GetEvents()
	}
	c.aggregateActions(q, stream, key, data)
	attempts, err := c.admin.ListAttempts(q.ctx, &outboxv1.ListAttemptsRequest{Stream: stream, AggregateKey: key,
		PageSize: attemptsPageSize})
	if err != nil {
		data["AttemptsError"] = describe(err)
	} else {
		data["Attempts"] = attempts.GetAttempts()
	}
	c.render(q.w, q.r, http.StatusOK, "aggregate", q, data)
}

func (c *Console) events(q *request) {
	r := q.r
	f := map[string]string{"Source": r.FormValue("source"), "Stream": r.FormValue("stream"), "Key": r.FormValue("key"),
		"State": r.FormValue("state"), "After": r.FormValue("after"), "Before": r.FormValue("before")}
	names := c.sourceNames(q)
	f["Source"] = chosenSource(names, f["Source"])
	data := map[string]any{"F": f, "Sources": names}
	addr := address(f["Source"], f["Stream"])
	req := &outboxv1.ListEventsRequest{Stream: addr, AggregateKey: f["Key"], PageSize: eventsPageSize,
		PageToken: r.FormValue("page")}
	if f["State"] != "" {
		st, ok := outboxv1.EventState_value["EVENT_STATE_"+strings.ToUpper(f["State"])]
		if !ok {
			data["Error"] = fmt.Sprintf("unknown state %q", f["State"])
			c.render(q.w, r, http.StatusBadRequest, "events", q, data)
			return
		}
		req.State = outboxv1.EventState(st)
	}
	for _, b := range []struct {
		field string
		dst   **timestamppb.Timestamp
	}{{"After", &req.CreatedAfter}, {"Before", &req.CreatedBefore}} {
		if f[b.field] == "" {
			continue
		}
		t, err := parseTime(f[b.field])
		if err != nil {
			data["Error"] = strings.ToLower(b.field) + ": " + err.Error()
			c.render(q.w, r, http.StatusBadRequest, "events", q, data)
			return
		}
		*b.dst = timestamppb.New(t)
	}
	resp, err := c.admin.ListEvents(q.ctx, req)
	code := http.StatusOK
	if err != nil {
		data["Error"], code = describe(err), httpCode(err)
	} else {
		addressEvents(resp.GetEvents())
		data["Events"], data["Next"], data["Skipped"] = resp.GetEvents(), resp.GetNextPageToken(), resp.GetSkippedSources()
	}
	c.render(q.w, r, code, "events", q, data)
}

// parseTime reads a time from a datetime-local input (taken as UTC) or
// RFC 3339.
func parseTime(s string) (time.Time, error) {
	for _, layout := range []string{time.RFC3339, "2006-01-02T15:04:05", "2006-01-02T15:04", "2006-01-02"} {
		if t, err := time.Parse(layout, s); err == nil {
			return t, nil
		}
	}
	return time.Time{}, fmt.Errorf("%q is not a time like 2026-01-31T14:05 (UTC) or RFC 3339", s)
}

func (c *Console) relays(q *request) {
	data := map[string]any{}
	code := http.StatusOK
	resp, err := c.admin.ListRelays(q.ctx, &outboxv1.ListRelaysRequest{})
	replicaOf := map[string]string{} // session id: replica id
	if err != nil {
		data["Error"], code = describe(err), httpCode(err)
	} else {
		data["Relays"] = resp.GetRelays()
		replicas := map[string]bool{}
		for _, r := range resp.GetRelays() {
			replicas[r.GetReplicaId()] = true
			replicaOf[r.GetSessionId()] = r.GetReplicaId()
		}
		data["Replicas"] = len(replicas)
	}
	// In flight in every source (ListAggregates reaches one at a time).
	sources := c.sourceNames(q)
	if sources == nil {
		sources = []string{""}
	}
	rows, more := []inFlight{}, false
	for _, src := range sources {
		leased, err := c.admin.ListAggregates(q.ctx, &outboxv1.ListAggregatesRequest{PageSize: aggregatesPageSize,
			Filter: &outboxv1.AggregateFilter{Stream: address(src, ""),
				States: []outboxv1.AggregateState{outboxv1.AggregateState_AGGREGATE_STATE_LEASED}}})
		if err != nil {
			data["InFlightError"] = strings.TrimPrefix(onSource(src)+": ", ": ") + describe(err)
			continue
		}
		for _, a := range leased.GetAggregates() {
			rows = append(rows, inFlight{Aggregate: a, Replica: replicaOf[a.GetLeaseHolder()]})
		}
		more = more || leased.GetNextPageToken() != ""
	}
	data["InFlight"], data["MoreInFlight"] = rows, more
	c.render(q.w, q.r, code, "relays", q, data)
}

// inFlight is a leased aggregate with the replica whose session holds the
// lease ("" when that session is not listed, e.g. it just ended).
type inFlight struct {
	*outboxv1.Aggregate
	Replica string
}
