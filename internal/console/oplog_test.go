package console_test

import (
	"html"
	"net/http"
	"net/url"
	"regexp"
	"strings"
	"testing"

	"github.com/google/uuid"
)

// A retry made in the console is listed on the actions page and on the
// aggregate's page, with the token's name, what it did and the reason; the
// actions page filters by kind and refuses bad filters.
func TestOperatorActionsPages(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessOptions{})
	ev := h.park(t, "sales_order", "42", 1)
	b := h.browser(t)
	b.login(t, adminSecret)
	if _, body := b.get(t, "/aggregate?stream=sales_order&key=42"); !strings.Contains(body, "No operator action has changed this aggregate.") {
		t.Errorf("aggregate page before any action:\n%s", body)
	}
	csrf := b.csrf(t, "/")
	if _, body := b.post(t, "/act/skip", url.Values{"csrf": {csrf}, "stream": {"sales_order"}, "key": {"42"},
		"event_id": {ev.GetEventId()}, "reason": {"schema v3 is not deployed"}}); !strings.Contains(body, "skipped by ops") {
		t.Fatalf("skip: %s", body)
	}

	// A retry's optional reason is recorded with it.
	h.park(t, "sales_order", "43", 1)
	if _, body := b.post(t, "/act/retry", url.Values{"csrf": {csrf}, "stream": {"sales_order"}, "key": {"43"},
		"reason": {"sink redeployed"}}); !strings.Contains(body, "Retried sales_order/43") {
		t.Fatalf("retry: %s", body)
	}
	_, body := b.get(t, "/aggregate?stream=sales_order&key=43")
	if s := regexp.MustCompile(`(?s)<table class="grid" id="agg-actions">.*?</table>`).FindString(body); !strings.Contains(s, "retried (was parked)") ||
		!strings.Contains(s, "sink redeployed") {
		t.Fatalf("the retried aggregate's actions: %q", s)
	}

	code, body := b.get(t, "/actions?action=skip")
	row := regexp.MustCompile(`(?s)<tr>\s*<td class="n">\d+</td>.*?</tr>`).FindString(body)
	if code != http.StatusOK || !strings.Contains(row, "<td>skip</td>") || !strings.Contains(row, "<td>ops</td>") ||
		!strings.Contains(row, "<td>sales_order</td>") || !strings.Contains(row, "schema v3 is not deployed") {
		t.Fatalf("actions page: %d, first row %q", code, row)
	}
	_, body = b.get(t, "/aggregate?stream=sales_order&key=42")
	section := regexp.MustCompile(`(?s)<table class="grid" id="agg-actions">.*?</table>`).FindString(body)
	if !strings.Contains(html.UnescapeString(section), "skipped revision 1 (event "+ev.GetEventId()+")") ||
		!strings.Contains(section, "schema v3 is not deployed") || !strings.Contains(section, "<td>ops</td>") {
		t.Fatalf("the aggregate's actions: %q", section)
	}
	if _, body = b.get(t, "/actions?stream=sales_order&key=42"); !strings.Contains(body, "What it did here") {
		t.Errorf("actions of one aggregate without what each did there")
	}
	if _, body = b.get(t, "/actions?action=bulk_skip"); !strings.Contains(body, "No operator action matches.") {
		t.Errorf("bulk skips listed where there were none")
	}
	if code, body = b.get(t, "/actions?action=drop"); code != http.StatusBadRequest || !strings.Contains(body, "unknown action") {
		t.Errorf("an unknown action: %d", code)
	}
	if code, _ = b.get(t, "/actions?key=42"); code != http.StatusBadRequest {
		t.Errorf("a key without its stream: %d", code)
	}
}

// The search box on every page finds an event by its id and links its
// aggregate; what is not an id, and an id no event has, get a clear message.
func TestEventSearch(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessOptions{})
	ids := h.emit(t, "sales_order", "7", 2)
	b := h.browser(t)
	b.login(t, viewerSecret)
	if _, body := b.get(t, "/"); !strings.Contains(body, `id="event-search"`) || !strings.Contains(body, `action="/event"`) {
		t.Fatalf("no search box on the overview")
	}
	// The older of the two, so that a search that ignored the id and showed
	// the newest event would not pass.
	code, body := b.get(t, "/event?id="+url.QueryEscape(" "+ids[0]+" "))
	if code != http.StatusOK || !regexp.MustCompile(`id="event-aggregate" href="/aggregate\?key=7&amp;stream=sales_order"`).MatchString(body) ||
		!strings.Contains(body, `id="event-state">pending`) || !strings.Contains(body, "<span>Revision</span><b>1</b>") {
		t.Fatalf("search for %s: %d\n%s", ids[0], code, body)
	}
	if code, body = b.get(t, "/event?id=order-7"); code != http.StatusBadRequest || !strings.Contains(html.UnescapeString(body), `"order-7" is not an event id`) {
		t.Errorf("search for a non-id: %d", code)
	}
	if code, body = b.get(t, "/event?id="); code != http.StatusBadRequest || !strings.Contains(body, "Enter an event id") {
		t.Errorf("an empty search: %d", code)
	}
	missing := uuid.NewString()
	if code, body = b.get(t, "/event?id="+missing); code != http.StatusNotFound || !strings.Contains(body, "No event has id "+missing) {
		t.Errorf("search for an id no event has: %d", code)
	}
}
