package console

import (
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/multisource"
)

// maxReason is the longest reason the AdminService accepts.
const maxReason = 1024

// allowed refuses, with 403, a session whose token may not call method.
// The server would refuse the call anyway; this says so before trying.
func (c *Console) allowed(q *request, method, what string) bool {
	if q.can(c, method) {
		return true
	}
	c.fail(q.w, q.r, q.sess, http.StatusForbidden,
		fmt.Sprintf("Token %s may not %s: that needs the admin role.", q.who.Name, what))
	return false
}

// reason reads the mandatory reason field.
func reason(r *http.Request) (string, error) {
	s := strings.TrimSpace(r.PostFormValue("reason"))
	switch {
	case s == "":
		return "", errors.New("a reason is required")
	case len(s) > maxReason:
		return "", fmt.Errorf("the reason is %d bytes; at most %d", len(s), maxReason)
	}
	return s, nil
}

// done records an action's outcome for the next page and redirects there.
func (c *Console) done(q *request, to string, err error, ok string) {
	if err != nil {
		c.sessions.addFlash(q.sess, "error", describe(err))
	} else {
		c.sessions.addFlash(q.sess, "ok", ok)
	}
	http.Redirect(q.w, q.r, to, http.StatusSeeOther)
}

func (c *Console) logAction(q *request, action string, err error, args ...any) {
	who := q.actor()
	if q.who != nil {
		who = q.who.Name
	}
	args = append([]any{"action", action, "actor", who}, args...)
	if err != nil {
		c.log.Info("console: action failed", append(args, "err", err)...)
		return
	}
	c.log.Info("console: action", args...)
}

func aggregateURL(stream, key string) string {
	return string(queryOf("/aggregate", "stream", stream, "key", key))
}

func (c *Console) retry(q *request) {
	if !c.allowed(q, outboxv1.AdminService_RetryAggregate_FullMethodName, "retry") {
		return
	}
	stream, key := q.r.PostFormValue("stream"), q.r.PostFormValue("key")
	// Optional for a retry; recorded with the action when given.
	why := strings.TrimSpace(q.r.PostFormValue("reason"))
	resp, err := c.admin.RetryAggregate(q.ctx, &outboxv1.RetryAggregateRequest{Stream: stream, AggregateKey: key, Actor: q.actor(),
		Reason: why})
	c.logAction(q, "retry", err, "stream", stream, "aggregate_key", key, "reason", why, "source", sourceOf(stream))
	c.done(q, aggregateURL(stream, key), err,
		fmt.Sprintf("Retried %s: now %s.", aggregateName(stream, key), aggState(resp.GetAggregate().GetState())))
}

func (c *Console) acceptGap(q *request) {
	if !c.allowed(q, outboxv1.AdminService_RetryAggregate_FullMethodName, "accept a gap") {
		return
	}
	stream, key := q.r.PostFormValue("stream"), q.r.PostFormValue("key")
	why, err := reason(q.r)
	if err != nil {
		c.sessions.addFlash(q.sess, "error", "Accept gap: "+err.Error())
		http.Redirect(q.w, q.r, aggregateURL(stream, key), http.StatusSeeOther)
		return
	}
	resp, err := c.admin.RetryAggregate(q.ctx, &outboxv1.RetryAggregateRequest{Stream: stream, AggregateKey: key,
		AcceptGap: true, Reason: why, Actor: q.actor()})
	c.logAction(q, "accept-gap", err, "stream", stream, "aggregate_key", key, "reason", why, "source", sourceOf(stream))
	c.done(q, aggregateURL(stream, key), err,
		fmt.Sprintf("Gap accepted for %s: now %s.", aggregateName(stream, key), aggState(resp.GetAggregate().GetState())))
}

func (c *Console) skip(q *request) {
	if !c.allowed(q, outboxv1.AdminService_SkipEvent_FullMethodName, "skip events") {
		return
	}
	stream, key, id := q.r.PostFormValue("stream"), q.r.PostFormValue("key"), q.r.PostFormValue("event_id")
	back := aggregateURL(stream, key)
	if stream == "" || key == "" {
		back = string(queryOf("/events", "state", "pending"))
	}
	why, err := reason(q.r)
	if err != nil {
		c.sessions.addFlash(q.sess, "error", "Skip: "+err.Error())
		http.Redirect(q.w, q.r, back, http.StatusSeeOther)
		return
	}
	// An event outside default is named SOURCE/EVENT_ID, as the router
	// routes it.
	id = multisource.JoinStream(sourceOf(stream), id)
	resp, err := c.admin.SkipEvent(q.ctx, &outboxv1.SkipEventRequest{EventId: id, Reason: why, Actor: q.actor()})
	c.logAction(q, "skip", err, "event_id", id, "reason", why)
	c.done(q, back, err, fmt.Sprintf("Event %s skipped by %s.", id, resp.GetSkip().GetActor()))
}

// bulkForm is a bulk action's form: the filter, the action and its reason.
type bulkForm struct {
	F         filterForm
	Action    string // "retry" or "skip"
	Reason    string
	AcceptGap bool
	// PendingBefore fixes "older than" at the preview's time, so the
	// confirmation acts on what the dry run counted.
	PendingBefore string
}

func readBulk(r *http.Request) bulkForm {
	return bulkForm{F: readFilter(r), Action: r.FormValue("action"), Reason: strings.TrimSpace(r.FormValue("reason")),
		AcceptGap: r.FormValue("accept_gap") != "", PendingBefore: r.FormValue("pending_before")}
}

func (b *bulkForm) filter() (*outboxv1.AggregateFilter, error) {
	f, err := b.F.proto()
	if err != nil {
		return nil, err
	}
	if b.Action == "retry" && b.F.trouble() {
		// The form's default state, "parked, backing off or gap", means
		// what a retry can act on: a gap-held aggregate is retried only by
		// accepting its gap, which the server refuses without accept_gap.
		f.States = []outboxv1.AggregateState{outboxv1.AggregateState_AGGREGATE_STATE_PARKED,
			outboxv1.AggregateState_AGGREGATE_STATE_BACKOFF}
		if b.AcceptGap {
			f.States = append(f.States, outboxv1.AggregateState_AGGREGATE_STATE_GAP)
		}
	}
	if b.PendingBefore != "" {
		t, err := time.Parse(time.RFC3339Nano, b.PendingBefore)
		if err != nil {
			return nil, fmt.Errorf("pending_before: %w", err)
		}
		f.PendingBefore = timestamppb.New(t)
	} else if f.PendingBefore != nil {
		b.PendingBefore = f.PendingBefore.AsTime().Format(time.RFC3339Nano)
	}
	return f, nil
}

func (b *bulkForm) check() error {
	switch b.Action {
	case "retry":
		if b.AcceptGap && b.Reason == "" {
			return errors.New("accepting gaps needs a reason")
		}
		switch b.F.State {
		case "gap":
			if !b.AcceptGap {
				return errors.New(`a gap-held aggregate is retried by accepting its gap: tick "retry accepts gaps" and give a reason`)
			}
		case "ready", "leased":
			return fmt.Errorf("a retry acts on parked, backing-off and gap-held aggregates, not %s ones", b.F.State)
		}
	case "skip":
		if b.Reason == "" {
			return errors.New("a bulk skip needs a reason")
		}
	default:
		return fmt.Errorf("unknown action %q; want retry or skip", b.Action)
	}
	if len(b.Reason) > maxReason {
		return fmt.Errorf("the reason is %d bytes; at most %d", len(b.Reason), maxReason)
	}
	return nil
}

func (c *Console) bulkForm(q *request) {
	b := bulkForm{Action: "retry"}
	b.F = readFilter(q.r)
	names := c.sourceNames(q)
	b.F.Source = chosenSource(names, b.F.Source)
	c.render(q.w, q.r, http.StatusOK, "bulk", q, map[string]any{"B": b, "States": stateNames, "Sources": names})
}

// bulkRun runs the bulk action, as a dry run or for real.
func (c *Console) bulkRun(q *request, b *bulkForm, dry bool) (matched, changed int64, sample []*outboxv1.Aggregate, err error) {
	filter, err := b.filter()
	if err != nil {
		return 0, 0, nil, err
	}
	if b.Action == "retry" {
		resp, err := c.admin.BulkRetry(q.ctx, &outboxv1.BulkRetryRequest{Filter: filter, AcceptGap: b.AcceptGap,
			Reason: b.Reason, DryRun: dry, Actor: q.actor()})
		return resp.GetMatched(), resp.GetRetried(), resp.GetSample(), err
	}
	resp, err := c.admin.BulkSkip(q.ctx, &outboxv1.BulkSkipRequest{Filter: filter, Reason: b.Reason, DryRun: dry, Actor: q.actor()})
	return resp.GetMatched(), resp.GetSkipped(), resp.GetSample(), err
}

func bulkMethod(action string) string {
	if action == "skip" {
		return outboxv1.AdminService_BulkSkip_FullMethodName
	}
	return outboxv1.AdminService_BulkRetry_FullMethodName
}

// bulkPreview runs the dry run and shows its count with a confirmation.
func (c *Console) bulkPreview(q *request) {
	b := readBulk(q.r)
	data := map[string]any{"B": &b, "States": stateNames, "Sources": c.sourceNames(q), "On": onSource(b.F.InSource())}
	if err := b.check(); err != nil {
		data["Error"] = err.Error()
		c.render(q.w, q.r, http.StatusBadRequest, "bulk", q, data)
		return
	}
	if !c.allowed(q, bulkMethod(b.Action), "bulk "+b.Action) {
		return
	}
	matched, _, sample, err := c.bulkRun(q, &b, true)
	code := http.StatusOK
	switch {
	case unimplemented(err):
		data["Unimplemented"] = describe(err)
	case err != nil:
		data["Error"], code = describe(err), httpCode(err)
	default:
		data["Preview"], data["Matched"], data["Sample"] = true, matched, sample
	}
	c.render(q.w, q.r, code, "bulk", q, data)
}

// bulkApply runs the confirmed action.
func (c *Console) bulkApply(q *request) {
	b := readBulk(q.r)
	if err := b.check(); err != nil {
		c.fail(q.w, q.r, q.sess, http.StatusBadRequest, err.Error())
		return
	}
	if !c.allowed(q, bulkMethod(b.Action), "bulk "+b.Action) {
		return
	}
	if q.r.PostFormValue("confirm") != "yes" {
		c.fail(q.w, q.r, q.sess, http.StatusBadRequest, "a bulk action needs its confirmation; run the dry run first")
		return
	}
	matched, changed, _, err := c.bulkRun(q, &b, false)
	c.logAction(q, "bulk-"+b.Action, err, "source", b.F.InSource(), "stream", b.F.Address(), "state", b.F.State, "error_contains", b.F.Error,
		"matched", matched, "changed", changed, "reason", b.Reason)
	verb := map[string]string{"retry": "retried", "skip": "skipped"}[b.Action]
	c.done(q, string(queryOf("/aggregates", "source", b.F.Source, "stream", b.F.Stream)), err,
		fmt.Sprintf("Bulk %s%s: %d matched, %d %s (the dry run counted %s).", b.Action, onSource(b.F.InSource()), matched, changed, verb, q.r.PostFormValue("expected")))
}

func (c *Console) purgeForm(q *request) {
	names := c.sourceNames(q)
	c.render(q.w, q.r, http.StatusOK, "purge", q, map[string]any{"OlderThan": "168h", "CanPurge": q.can(c, outboxv1.AdminService_Purge_FullMethodName),
		"Sources": names, "Source": chosenSource(names, "")})
}

// purgeDryRun counts what a purge would delete; the console never deletes
// (outboxd purge does, from the command line).
func (c *Console) purgeDryRun(q *request) {
	if !c.allowed(q, outboxv1.AdminService_Purge_FullMethodName, "run a purge dry run") {
		return
	}
	older, stream := strings.TrimSpace(q.r.PostFormValue("older_than")), strings.TrimSpace(q.r.PostFormValue("stream"))
	source := strings.TrimSpace(q.r.PostFormValue("source"))
	addr := address(source, stream)
	if source == allSources && stream == "" {
		addr = "" // Purge without a stream covers every source
	}
	data := map[string]any{"OlderThan": older, "Stream": stream, "Source": source, "CanPurge": true, "Sources": c.sourceNames(q)}
	d, err := time.ParseDuration(older)
	if err != nil || d < 0 {
		data["Error"] = fmt.Sprintf("older than: %q is not a duration like 168h", older)
		c.render(q.w, q.r, http.StatusBadRequest, "purge", q, data)
		return
	}
	if src, _ := multisource.SplitStream(addr); strings.Contains(src, "*") {
		// Purge spans sources only without a stream: one stream is of one
		// source.
		data["Error"] = fmt.Sprintf("a purge of stream %q is of one source: pick its source, or leave the stream empty to purge every source", stream)
		c.render(q.w, q.r, http.StatusBadRequest, "purge", q, data)
		return
	}
	cut := time.Now().Add(-d)
	st, err := c.admin.Purge(q.ctx, &outboxv1.PurgeRequest{PublishedBefore: timestamppb.New(cut), DryRun: true, Stream: addr})
	var last *outboxv1.PurgeResponse
	for err == nil {
		var m *outboxv1.PurgeResponse
		if m, err = st.Recv(); err == nil {
			last = m
		}
	}
	if !errors.Is(err, io.EOF) {
		data["Error"] = describe(err)
		c.render(q.w, q.r, httpCode(err), "purge", q, data)
		return
	}
	data["Result"] = map[string]string{"Deleted": strconv.FormatInt(last.GetDeleted(), 10), "Cut": cut.UTC().Format(time.RFC3339),
		"On": onSource(sourceOf(addr))}
	c.render(q.w, q.r, http.StatusOK, "purge", q, data)
}
