package console_test

import (
	"context"
	"encoding/json"
	"fmt"
	"html"
	"net/http"
	"net/url"
	"regexp"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/servertest"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/server"
)

// The events browser filters by stream, key, state and creation time and
// pages with the server's cursor.
func TestEventsBrowser(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessOptions{})
	h.emit(t, "sales_order", "a", 5)
	for i := range 55 {
		h.emit(t, "billing.invoice", "k-"+string(rune('a'+i%26))+string(rune('a'+i/26)), 1)
	}
	b := h.browser(t)
	b.login(t, viewerSecret)
	rows := func(body string) int { return strings.Count(body, `<td class="n">`) } // one revision cell per row

	code, body := b.get(t, "/events?stream=billing.invoice")
	if code != http.StatusOK || rows(body) != 50 || !strings.Contains(body, `id="next"`) {
		t.Fatalf("first page: %d, %d rows, next link %v", code, rows(body), strings.Contains(body, `id="next"`))
	}
	next := regexp.MustCompile(`id="next" href="([^"]+)"`).FindStringSubmatch(body)
	code, body = b.get(t, html.UnescapeString(next[1]))
	if code != http.StatusOK || rows(body) != 5 || strings.Contains(body, `id="next"`) || strings.Contains(body, "sales_order") {
		t.Fatalf("second page: %d, %d rows", code, rows(body))
	}
	_, body = b.get(t, "/events?stream=sales_order&key=a&state=pending")
	if rows(body) != 5 || !strings.Contains(body, `&#34;order_id&#34;: &#34;a&#34;`) || !strings.Contains(body, "traceparent") {
		t.Errorf("sales_order/a pending: %d rows, payload and headers shown: %v", rows(body), strings.Contains(body, "traceparent"))
	}
	if _, body = b.get(t, "/events?stream=sales_order&state=published"); rows(body) != 0 {
		t.Errorf("published events listed: %d", rows(body))
	}
	future := time.Now().Add(time.Hour).UTC().Format("2006-01-02T15:04")
	if _, body = b.get(t, "/events?stream=sales_order&after="+future); rows(body) != 0 {
		t.Errorf("events created after %s: %d", future, rows(body))
	}
	if _, body = b.get(t, "/events?stream=sales_order&before="+future); rows(body) != 5 {
		t.Errorf("events created before %s: %d", future, rows(body))
	}
	if code, body = b.get(t, "/events?after=yesterday"); code != http.StatusBadRequest || !strings.Contains(body, "not a time") {
		t.Errorf("a bad time: %d", code)
	}
	if code, _ = b.get(t, "/events?state=lost"); code != http.StatusBadRequest {
		t.Errorf("a bad state: %d", code)
	}
}

// Accepting a gap and skipping need a reason; a retry of a parked
// aggregate makes it ready and accepting a gap releases a gap-held one,
// each recorded as the token's action.
func TestAggregateActions(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessOptions{})
	h.park(t, "sales_order", "42", 1)
	b := h.browser(t)
	b.login(t, adminSecret)
	csrf := b.csrf(t, "/")
	agg := url.Values{"csrf": {csrf}, "stream": {"sales_order"}, "key": {"42"}}
	if _, body := b.post(t, "/act/accept-gap", agg); !strings.Contains(body, "Accept gap: a reason is required") {
		t.Error("accept gap without a reason was not refused")
	}
	_, body := b.post(t, "/act/retry", agg)
	if !strings.Contains(body, "Retried sales_order/42: now ready") {
		t.Fatalf("retry: %s", body)
	}
	admin, with := h.as(adminSecret)
	got, err := admin.GetAggregate(with(t.Context()), &outboxv1.GetAggregateRequest{Stream: "sales_order", AggregateKey: "42"})
	if err != nil || got.GetAggregate().GetState() != outboxv1.AggregateState_AGGREGATE_STATE_READY {
		t.Fatalf("after retry: %v, %v", got, err)
	}
	if !strings.Contains(h.logs.String(), `msg="aggregate retried by operator" component=server`) ||
		!regexp.MustCompile(`msg="aggregate retried by operator".* actor=ops`).MatchString(h.logs.String()) {
		t.Error("the retry is not on the record as the token's (ops)")
	}

	// A gap: revisions 1 and 3, revision 1 delivered, 2 never comes.
	for _, rev := range []int{1, 3} {
		if _, err := h.pool.Exec(t.Context(), `SELECT outbox.emit('gaps', 'gap-1', 'T', '{}', revision => $1)`, rev); err != nil {
			t.Fatal(err)
		}
	}
	rctx, cancel := context.WithCancel(metadata.AppendToOutgoingContext(t.Context(), "authorization", "Bearer "+relaySecret))
	defer cancel()
	st, err := h.rep.Relay.Subscribe(rctx, &outboxv1.SubscribeRequest{RelayId: "acker", Streams: []string{"gaps"}, MaxInFlight: 1})
	if err != nil {
		t.Fatal(err)
	}
	d, err := st.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := h.rep.Relay.Ack(rctx, &outboxv1.AckRequest{Acks: []*outboxv1.AckItem{{EventId: d.GetEvent().GetEventId(), LeaseToken: d.GetLeaseToken()}}}); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(30 * time.Second); h.aggState(t, "gaps", "gap-1") != outboxv1.AggregateState_AGGREGATE_STATE_GAP; {
		if time.Now().After(deadline) {
			t.Fatalf("gap-1 is %v, want gap", h.aggState(t, "gaps", "gap-1"))
		}
		time.Sleep(20 * time.Millisecond)
	}
	gap := url.Values{"csrf": {csrf}, "stream": {"gaps"}, "key": {"gap-1"}, "reason": {"revision 2 rolled back upstream"}}
	if _, body := b.post(t, "/act/accept-gap", gap); !strings.Contains(body, "Gap accepted for gaps/gap-1: now") {
		t.Fatalf("accept gap: %s", body)
	}
	var actor, why string
	if err := h.pool.QueryRow(t.Context(), `SELECT actor, reason FROM outbox.accepted_gap WHERE aggregate_key = 'gap-1'`).Scan(&actor, &why); err != nil ||
		actor != "ops" || why != "revision 2 rolled back upstream" {
		t.Errorf("accepted gap recorded by %q (%q), %v; want ops and the reason", actor, why, err)
	}

	// A retry of an aggregate that is not parked: the server's refusal is
	// shown, not hidden.
	if _, body = b.post(t, "/act/retry", url.Values{"csrf": {csrf}, "stream": {"sales_order"}, "key": {"nope"}}); !strings.Contains(body, "NotFound") {
		t.Errorf("retry of an unknown aggregate: the page does not show the server's error")
	}
}

// Bulk actions count first, by stream, state, error text and age, and
// change nothing until confirmed.
func TestBulkRetry(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessOptions{})
	h.park(t, "sales_order", "1", 1)
	h.park(t, "sales_order", "2", 1)
	b := h.browser(t)
	b.login(t, adminSecret)
	csrf := b.csrf(t, "/bulk")
	form := url.Values{"csrf": {csrf}, "action": {"skip"}, "stream": {"sales_order"}, "state": {"parked"}}
	if code, body := b.post(t, "/bulk", form); code != http.StatusBadRequest || !strings.Contains(body, "a bulk skip needs a reason") {
		t.Errorf("bulk skip without a reason: %d", code)
	}
	form.Set("action", "retry")
	if code, body := b.post(t, "/bulk/confirm", form); code != http.StatusBadRequest || !strings.Contains(body, "needs its confirmation") {
		t.Errorf("bulk confirm without the confirmation: %d", code)
	}
	state := func(key string) outboxv1.AggregateState {
		admin, with := h.as(adminSecret)
		got, err := admin.GetAggregate(with(t.Context()), &outboxv1.GetAggregateRequest{Stream: "sales_order", AggregateKey: key})
		if err != nil {
			t.Fatal(err)
		}
		return got.GetAggregate().GetState()
	}
	for _, c := range []struct {
		field, value string
		want         int
	}{
		{"error", "SCHEMA V3", 2}, {"error", "timeout", 0}, {"older_than", "1h", 0}, {"older_than", "0s", 2},
	} {
		f := url.Values{"csrf": {csrf}, "action": {"retry"}, "stream": {"sales_order"}, "state": {"parked"}, c.field: {c.value}}
		if code, body := b.post(t, "/bulk", f); code != http.StatusOK || !strings.Contains(body, fmt.Sprintf("Dry run: %d aggregate(s) match", c.want)) {
			t.Errorf("bulk dry run with %s=%s: %d, want %d matched\n%s", c.field, c.value, code, c.want, body)
		}
	}
	code, body := b.post(t, "/bulk", form)
	if code != http.StatusOK || !strings.Contains(body, "Dry run: 2 aggregate(s) match") {
		t.Fatalf("bulk dry run: %d\n%s", code, body)
	}
	if state("1") != outboxv1.AggregateState_AGGREGATE_STATE_PARKED {
		t.Fatal("the dry run changed something")
	}
	confirm := url.Values{}
	for _, m := range regexp.MustCompile(`<input type="hidden" name="([a-z_]+)" value="([^"]*)">`).FindAllStringSubmatch(
		body[strings.Index(body, `action="/bulk/confirm"`):], -1) {
		confirm.Set(m[1], html.UnescapeString(m[2]))
	}
	if _, body = b.post(t, "/bulk/confirm", confirm); !strings.Contains(body, "Bulk retry: 2 matched, 2 retried") {
		t.Fatalf("bulk confirm: %s", body)
	}
	if state("1") != outboxv1.AggregateState_AGGREGATE_STATE_READY || state("2") != outboxv1.AggregateState_AGGREGATE_STATE_READY {
		t.Error("bulk retry left an aggregate parked")
	}
}

// The aggregates page lists aggregates in trouble, filtered by stream.
func TestAggregatesPage(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessOptions{})
	h.park(t, "sales_order", "p-1", 1)
	b := h.browser(t)
	b.login(t, viewerSecret)
	code, body := b.get(t, "/aggregates")
	if code != http.StatusOK {
		t.Fatalf("aggregates page: %d", code)
	}
	if !strings.Contains(body, "p-1") || !strings.Contains(body, "schema v3 unknown") {
		t.Errorf("the parked aggregate is not listed with its error:\n%s", body)
	}
	if _, body = b.get(t, "/aggregates?stream=billing.*"); strings.Contains(body, "p-1") {
		t.Error("the stream filter is ignored")
	}
}

// The purge page counts and deletes nothing; its input is checked.
func TestPurgeDryRun(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessOptions{})
	h.emit(t, "sales_order", "1", 1)
	b := h.browser(t)
	b.login(t, adminSecret)
	csrf := b.csrf(t, "/purge")
	if code, body := b.post(t, "/purge", url.Values{"csrf": {csrf}, "older_than": {"a week"}}); code != http.StatusBadRequest || !strings.Contains(body, "not a duration") {
		t.Errorf("bad duration: %d", code)
	}
	code, body := b.post(t, "/purge", url.Values{"csrf": {csrf}, "older_than": {"0s"}, "stream": {"sales_order"}})
	if code != http.StatusOK || !strings.Contains(body, `would delete <b>0</b> event(s)`) {
		t.Errorf("purge dry run: %d\n%s", code, body)
	}
}

// The streams page shows every stall signal GetLag has: here events no
// rule will deliver (a delivery row that says idle with an event pending,
// as a delivery bug would leave it) and a relay connected for a stream
// whose ready work waits while it holds nothing, in the table the server
// renders and in what the page polls.
func TestStreamsPageShowsStrandedAndIdleRelays(t *testing.T) {
	t.Parallel()
	// The stranded audit runs again for the first reader after 1 ms; the
	// counts a reader gets are the last finished audit's.
	h := newHarness(t, harnessOptions{server: func(c *server.Config) { c.StrandedAuditInterval = time.Millisecond }})
	ctx := t.Context()
	h.emit(t, "orders", "lost", 1)
	h.emit(t, "billing.invoice", "waiting", 1)
	for _, key := range []string{"lost", "waiting"} {
		deadline := time.Now().Add(30 * time.Second)
		for {
			var st string
			_ = h.pool.QueryRow(ctx, `SELECT state FROM outbox.delivery WHERE aggregate_key = $1`, key).Scan(&st)
			if st == "ready" {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s not ready: %q", key, st)
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	exec := func(sql string, args ...any) {
		t.Helper()
		if _, err := h.pool.Exec(context.Background(), sql, args...); err != nil {
			t.Fatal(err)
		}
	}
	var claimable, since time.Time
	if err := h.pool.QueryRow(ctx, `UPDATE outbox.delivery d SET state = 'idle', claimable_at = NULL, pending_since = NULL
		FROM outbox.delivery o WHERE o.stream = d.stream AND o.aggregate_key = d.aggregate_key AND d.aggregate_key = 'lost'
		RETURNING o.claimable_at, o.pending_since`).Scan(&claimable, &since); err != nil {
		t.Fatal(err)
	}
	// The replica's cleanup counts stranded events: put the row back.
	defer exec(`UPDATE outbox.delivery SET state = 'ready', claimable_at = $1, pending_since = $2 WHERE aggregate_key = 'lost'`, claimable, since)
	for deadline := time.Now().Add(30 * time.Second); ; { // a hang guard
		lag, err := h.rep.App.AdminServer().GetLag(ctx, &outboxv1.GetLagRequest{})
		if err != nil {
			t.Fatal(err)
		}
		if lag.GetTotal().GetStrandedEvents() == 1 {
			break // an audit has counted it: every later reader sees it
		}
		if time.Now().After(deadline) {
			t.Fatalf("no audit counted the stranded event in 30s: %v", lag.GetTotal())
		}
	}
	exec(`UPDATE outbox.settings SET idle_relay_after = '1 millisecond'`)
	exec(`INSERT INTO outbox.relay_session (session_id, relay_id, peer, replica_id, streams, max_in_flight, in_flight, connected_at, seen_at)
		VALUES (gen_random_uuid(), 'wedged', '10.0.0.1:1', 'other-replica', '{billing.invoice}', 8, 0, now() - interval '1 hour', clock_timestamp())`)

	b := h.browser(t)
	b.login(t, viewerSecret)
	code, body := b.get(t, "/")
	if code != http.StatusOK || !strings.Contains(body, `>Stranded</th>`) {
		t.Fatalf("streams page: %d, Stranded column %v", code, strings.Contains(body, `>Stranded</th>`))
	}
	cells := func(stream string) []string {
		t.Helper()
		row := regexp.MustCompile(`(?s)<tr>\s*<td><a [^>]*>` + regexp.QuoteMeta(stream) + `</a></td>(.*?)</tr>`).FindStringSubmatch(body)
		if row == nil {
			t.Fatalf("no row for %s:\n%s", stream, body)
		}
		var out []string
		for _, m := range regexp.MustCompile(`<td class="([^"]*)">([^<]*)</td>`).FindAllStringSubmatch(row[1], -1) {
			out = append(out, strings.TrimSpace(m[1])+"="+m[2])
		}
		if len(out) != 12 {
			t.Fatalf("row of %s has %d figures: %v", stream, len(out), out)
		}
		return out
	}
	// Pending, aggregates, oldest, delivered, ready, leased, backing off,
	// parked, gap, stalled, stranded, idle relays.
	if got := cells("orders"); got[10] != "n bad=1" || got[11] != "n=0" {
		t.Errorf("orders: stranded %q, idle relays %q; want 1 (marked bad) and 0", got[10], got[11])
	}
	if got := cells("billing.invoice"); got[10] != "n=0" || got[11] != "n warn=1" {
		t.Errorf("billing.invoice: stranded %q, idle relays %q; want 0 and 1 (marked warn)", got[10], got[11])
	}
	var lag struct {
		Streams []struct {
			Stream     string `json:"stream"`
			Stranded   int64  `json:"stranded"`
			IdleRelays int64  `json:"idle_relays"`
		} `json:"streams"`
		Total struct {
			Stranded   int64 `json:"stranded"`
			IdleRelays int64 `json:"idle_relays"`
		} `json:"total"`
	}
	_, js := b.get(t, "/api/lag")
	if err := json.Unmarshal([]byte(js), &lag); err != nil {
		t.Fatalf("/api/lag: %v\n%s", err, js)
	}
	if lag.Total.Stranded != 1 || lag.Total.IdleRelays != 1 {
		t.Errorf("/api/lag total: stranded %d, idle relays %d; want 1 and 1\n%s", lag.Total.Stranded, lag.Total.IdleRelays, js)
	}
}

// An aggregate whose leases keep expiring is stalled while leased, in none
// of the trouble states: the default aggregates page lists it under them,
// and a bulk action from the stalled filter keeps the filter.
func TestAggregatesPageListsStalledLeased(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessOptions{})
	h.park(t, "sales_order", "p-1", 1)
	if _, err := h.pool.Exec(t.Context(), `UPDATE outbox.settings SET stall_after_unanswered = 2`); err != nil {
		t.Fatal(err)
	}
	h.emit(t, "billing.invoice", "hangs", 1)
	ctx, cancel := context.WithCancel(metadata.AppendToOutgoingContext(t.Context(), "authorization", "Bearer "+relaySecret))
	defer cancel()
	st, err := h.rep.Relay.Subscribe(ctx, &outboxv1.SubscribeRequest{RelayId: "hanging-relay", Streams: []string{"billing.invoice"},
		MaxInFlight: 2, LeaseTtl: durationpb.New(time.Second)})
	if err != nil {
		t.Fatal(err)
	}
	// Two leases end unanswered; the third is held past the page's reads
	// (a loaded machine took over a second to log in and fetch it, and the
	// third lease ended too). Should it end before it is extended, the
	// next attempt is held instead, and the page counts one more.
	var held uint32
	for want := uint32(1); held == 0; want++ {
		d, err := st.Recv()
		if err != nil {
			t.Fatal(err)
		}
		if d.GetAttempt() != want {
			t.Fatalf("attempt %d, want %d", d.GetAttempt(), want)
		}
		if want < 3 {
			continue
		}
		_, err = h.rep.Relay.ExtendLease(ctx, &outboxv1.ExtendLeaseRequest{
			EventId: d.GetEvent().GetEventId(), LeaseToken: d.GetLeaseToken(), Ttl: durationpb.New(time.Hour)})
		switch status.Code(err) {
		case codes.OK:
			held = want
		case codes.FailedPrecondition: // ended before it was extended
		default:
			t.Fatalf("extend attempt %d: %v", want, err)
		}
	}
	unanswered := fmt.Sprintf("%d deliveries", held-1)
	b := h.browser(t)
	b.login(t, viewerSecret)
	code, body := b.get(t, "/aggregates")
	if code != http.StatusOK || !strings.Contains(body, "p-1") {
		t.Fatalf("aggregates page: %d, parked aggregate listed %v", code, strings.Contains(body, "p-1"))
	}
	i := strings.Index(body, `id="stalled"`)
	if i < 0 {
		t.Fatalf("no stalled section on the default aggregates page:\n%s", body)
	}
	if s := body[i:]; !strings.Contains(s, "key=hangs") || !strings.Contains(s, ">leased<") || !strings.Contains(s, unanswered) {
		t.Errorf("stalled section:\n%s", s)
	}
	if _, body = b.get(t, "/aggregates?state=parked"); strings.Contains(body, `id="stalled"`) {
		t.Error("a state filter still lists the stalled section")
	}
	_, body = b.get(t, "/aggregates?state=any&stalled=1")
	if !strings.Contains(body, "key=hangs") || strings.Contains(body, "p-1") {
		t.Errorf("stalled only: the list is wrong:\n%s", body)
	}
	if !regexp.MustCompile(`href="/bulk\?[^"]*stalled=1`).MatchString(body) {
		t.Error("the bulk link from the stalled filter drops stalled")
	}
}

// The relays page shows the relays of every replica on the database, and
// their deliveries in flight with the replica holding each lease, though
// the console asks only its own replica.
func TestRelaysAcrossReplicas(t *testing.T) {
	t.Parallel()
	const replicaA, replicaB = "replica-a", "replica-b"
	h := newHarness(t, harnessOptions{server: func(c *server.Config) { c.ReplicaID = replicaA }})
	other := servertest.Start(t, h.url, servertest.Options{Authenticator: h.authn, Configure: func(c *server.Config) {
		c.ReplicaID, c.SessionRefreshInterval = replicaB, 100*time.Millisecond
	}})
	h.emit(t, "billing.invoice", "on-a", 1)
	h.emit(t, "sales_order", "on-b", 1)
	ctx, cancel := context.WithCancel(metadata.AppendToOutgoingContext(t.Context(), "authorization", "Bearer "+relaySecret))
	defer cancel()
	hold := func(relay outboxv1.RelayServiceClient, id, stream string) {
		t.Helper()
		st, err := relay.Subscribe(ctx, &outboxv1.SubscribeRequest{RelayId: id, Streams: []string{stream}, MaxInFlight: 1})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := st.Recv(); err != nil {
			t.Fatal(err)
		}
	}
	hold(h.rep.Relay, "relay-on-a", "billing.invoice")
	hold(other.Relay, "relay-on-b", "sales_order")

	b := h.browser(t)
	b.login(t, viewerSecret)
	var body string
	for deadline := time.Now().Add(20 * time.Second); ; {
		var code int
		if code, body = b.get(t, "/relays"); code != http.StatusOK {
			t.Fatalf("relays page: %d\n%s", code, body)
		}
		if strings.Contains(body, "relay-on-b") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the other replica's relay never showed:\n%s", body)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if !strings.Contains(body, "2 connected to 2 replica(s)") {
		t.Errorf("relays heading: want 2 relays on 2 replicas\n%s", body)
	}
	inFlight := body[strings.Index(body, `id="in-flight"`):]
	for _, want := range []string{
		"<td>relay-on-a</td><td>" + replicaA + "</td>",
		"<td>relay-on-b</td><td>" + replicaB + "</td>",
		"key=on-a", "key=on-b",
	} {
		if !strings.Contains(inFlight, want) {
			t.Errorf("deliveries in flight lack %q:\n%s", want, inFlight)
		}
	}
}

// A bulk action's confirmation acts on the cut-off its dry run computed
// (pending_before), not on "older than" read again at confirmation time:
// an aggregate that grew old enough between the dry run and the click was
// not counted, and must not be skipped. The confirmation is posted as if
// its dry run had run an hour ago.
func TestBulkConfirmKeepsTheDryRunsCutOff(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessOptions{})
	h.park(t, "sales_order", "old", 1)
	h.park(t, "sales_order", "newer", 1)
	// "Older than" is by how long an aggregate has had an event pending.
	if _, err := h.pool.Exec(t.Context(), `UPDATE outbox.delivery SET pending_since = now() - CASE aggregate_key
		WHEN 'old' THEN interval '3 hours' ELSE interval '90 minutes' END WHERE stream = 'sales_order'`); err != nil {
		t.Fatal(err)
	}
	b := h.browser(t)
	b.login(t, adminSecret)
	dryRunCut := time.Now().Add(-2 * time.Hour).UTC().Format(time.RFC3339Nano) // "older than 1h", an hour ago
	code, body := b.post(t, "/bulk/confirm", url.Values{"csrf": {b.csrf(t, "/bulk")}, "action": {"skip"}, "reason": {"stale"},
		"stream": {"sales_order"}, "state": {"parked"}, "older_than": {"1h"}, "pending_before": {dryRunCut},
		"confirm": {"yes"}, "expected": {"1"}})
	if code != http.StatusOK || !strings.Contains(body, "Bulk skip: 1 matched, 1 skipped") {
		t.Errorf("bulk skip confirmed with the dry run's cut-off: %d, want 1 matched and skipped\n%s", code, body)
	}
	if st := h.aggState(t, "sales_order", "newer"); st != outboxv1.AggregateState_AGGREGATE_STATE_PARKED {
		t.Errorf("the aggregate the dry run did not count is %v, want still parked", st)
	}
}

// The console's purge form only counts: it never deletes (outboxd purge
// does, from the command line). A published event old enough to purge is
// counted and still there afterwards.
func TestPurgeFormDeletesNothing(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessOptions{})
	h.emit(t, "sales_order", "1", 1)
	ctx, cancel := context.WithCancel(metadata.AppendToOutgoingContext(t.Context(), "authorization", "Bearer "+relaySecret))
	defer cancel()
	st, err := h.rep.Relay.Subscribe(ctx, &outboxv1.SubscribeRequest{RelayId: "acker", Streams: []string{"sales_order"}, MaxInFlight: 1})
	if err != nil {
		t.Fatal(err)
	}
	d, err := st.Recv()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := h.rep.Relay.Ack(ctx, &outboxv1.AckRequest{Acks: []*outboxv1.AckItem{{EventId: d.GetEvent().GetEventId(), LeaseToken: d.GetLeaseToken()}}}); err != nil {
		t.Fatal(err)
	}
	cancel()
	testdb.RewriteEvents(t, h.pool, `UPDATE outbox.event SET created_at = now() - interval '3 hours',
		published_at = now() - interval '2 hours' WHERE published_at IS NOT NULL`)
	count := func() (n int) {
		t.Helper()
		if err := h.pool.QueryRow(context.Background(), `SELECT count(*) FROM outbox.event`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	if n := count(); n != 1 {
		t.Fatalf("%d events before the purge form, want 1", n)
	}
	b := h.browser(t)
	b.login(t, adminSecret)
	code, body := b.post(t, "/purge", url.Values{"csrf": {b.csrf(t, "/purge")}, "older_than": {"1h"}, "stream": {"sales_order"}})
	if code != http.StatusOK || !strings.Contains(body, `would delete <b>1</b> event(s)`) {
		t.Errorf("purge form: %d, want it to count the published event\n%s", code, body)
	}
	if n := count(); n != 1 {
		t.Errorf("%d events after the purge form, want the 1 it counted still there", n)
	}
}

// The bulk form's default state, "parked, backing off or gap", means for a
// retry without "retry accepts gaps" the parked and backing-off aggregates
// only: the server refuses a retry filter naming gap-held ones without
// accept_gap, so the form's default must not send them, or the default
// bulk retry would fail every time.
func TestBulkRetryOfTheDefaultStatesWithoutAcceptingGaps(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessOptions{})
	h.park(t, "sales_order", "1", 1)
	b := h.browser(t)
	b.login(t, adminSecret)
	code, body := b.post(t, "/bulk", url.Values{"csrf": {b.csrf(t, "/bulk")}, "action": {"retry"}, "stream": {"sales_order"}})
	if code != http.StatusOK || !strings.Contains(body, "Dry run: 1 aggregate(s) match") {
		t.Errorf("bulk retry dry run in the default states: %d, want 1 parked aggregate matched\n%s", code, body)
	}
}
