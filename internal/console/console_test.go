package console_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"strings"
	"testing"
	"time"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/console"
)

// eventState reads an event's state through the admin API (as ops).
func (h *harness) eventState(t *testing.T, stream, key, id string) *outboxv1.EventInfo {
	t.Helper()
	admin, with := h.as(adminSecret)
	resp, err := admin.ListEvents(with(t.Context()), &outboxv1.ListEventsRequest{Stream: stream, AggregateKey: key})
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range resp.GetEvents() {
		if e.GetEvent().GetEventId() == id {
			return e
		}
	}
	t.Fatalf("event %s not listed", id)
	return nil
}

// aggState reads an aggregate's state through the admin API (as ops).
func (h *harness) aggState(t *testing.T, stream, key string) outboxv1.AggregateState {
	t.Helper()
	admin, with := h.as(adminSecret)
	resp, err := admin.GetAggregate(with(t.Context()), &outboxv1.GetAggregateRequest{Stream: stream, AggregateKey: key})
	if err != nil {
		t.Fatal(err)
	}
	return resp.GetAggregate().GetState()
}

func noRedirect(b *browser) {
	b.CheckRedirect = func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }
}

// Every page, the JSON endpoint and every action need a session that
// logged in; the login page is the way in.
func TestLoginRequired(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessOptions{})
	b := h.browser(t)
	noRedirect(b)
	for _, path := range []string{"/", "/aggregates", "/aggregate?stream=s&key=k", "/events", "/relays", "/bulk", "/purge"} {
		resp, err := b.Get(b.base + path)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusSeeOther || resp.Header.Get("Location") != "/login" {
			t.Errorf("GET %s without login: %d to %q, want 303 to /login", path, resp.StatusCode, resp.Header.Get("Location"))
		}
	}
	if code, _ := b.get(t, "/api/lag"); code != http.StatusUnauthorized {
		t.Errorf("GET /api/lag without login: %d, want 401", code)
	}
	resp, err := b.Get(b.base + "/login")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if cs := resp.Cookies(); len(cs) != 1 || !cs[0].HttpOnly || cs[0].SameSite != http.SameSiteStrictMode || cs[0].Secure || len(cs[0].Value) < 40 {
		t.Errorf("session cookie %+v: want one random id, HttpOnly, SameSite=Strict, not Secure over plain HTTP", cs)
	}
	csrf := b.csrf(t, "/login") // a pre-login session has a form token, but no token
	for _, path := range []string{"/act/skip", "/act/retry", "/bulk", "/purge"} {
		if code, _ := b.post(t, path, url.Values{"csrf": {csrf}}); code != http.StatusUnauthorized {
			t.Errorf("POST %s without login: %d, want 401", path, code)
		}
	}
	// A wrong token, and a relay token (neither viewer nor admin), do not log in.
	code, body := b.post(t, "/login", url.Values{"csrf": {csrf}, "token": {"not-a-token-at-all-0123"}})
	if code != http.StatusUnauthorized || !strings.Contains(body, "Unknown or revoked token") {
		t.Errorf("login with an unknown token: %d", code)
	}
	code, body = b.post(t, "/login", url.Values{"csrf": {csrf}, "token": {relaySecret}})
	if code != http.StatusForbidden || !strings.Contains(body, "neither the viewer nor the admin role") {
		t.Errorf("login with a relay token: %d", code)
	}
	if code, _ := b.get(t, "/"); code != http.StatusSeeOther {
		t.Errorf("after failed logins GET /: %d, want 303", code)
	}
}

// A viewer sees every page but may not act: each action answers 403 and
// changes nothing; the pages offer no action forms.
func TestViewerCannotAct(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessOptions{})
	ev := h.park(t, "sales_order", "42", 2)
	h.emit(t, "sales_order", "7", 1)
	b := h.browser(t)
	b.login(t, viewerSecret)
	aggPath := "/aggregate?stream=sales_order&key=" + ev.GetAggregateKey()
	code, body := b.get(t, aggPath)
	if code != http.StatusOK || !strings.Contains(body, "parked") || !strings.Contains(body, "schema v3 unknown") {
		t.Fatalf("viewer on the aggregate page: %d\n%s", code, body)
	}
	if strings.Contains(body, `action="/act/skip"`) || strings.Contains(body, `action="/act/retry"`) {
		t.Error("the aggregate page offers actions to a viewer")
	}
	for _, path := range []string{"/", "/aggregates", "/events?stream=sales_order", "/relays", "/bulk", "/purge", "/api/lag"} {
		if code, _ := b.get(t, path); code != http.StatusOK {
			t.Errorf("viewer GET %s: %d, want 200", path, code)
		}
	}
	csrf := b.csrf(t, "/")
	key := ev.GetAggregateKey()
	for _, tc := range []struct {
		path string
		form url.Values
	}{
		{"/act/skip", url.Values{"event_id": {ev.GetEventId()}, "reason": {"r"}, "stream": {"sales_order"}, "key": {key}}},
		{"/act/retry", url.Values{"stream": {"sales_order"}, "key": {key}}},
		{"/act/accept-gap", url.Values{"stream": {"sales_order"}, "key": {key}, "reason": {"r"}}},
		{"/bulk", url.Values{"action": {"skip"}, "reason": {"r"}, "stream": {"sales_order"}}},
		{"/bulk/confirm", url.Values{"action": {"retry"}, "stream": {"sales_order"}, "confirm": {"yes"}}},
		{"/purge", url.Values{"older_than": {"1h"}}},
	} {
		tc.form.Set("csrf", csrf)
		code, body := b.post(t, tc.path, tc.form)
		if code != http.StatusForbidden || !strings.Contains(body, "needs the admin role") {
			t.Errorf("viewer POST %s: %d, want 403 naming the admin role\n%s", tc.path, code, body)
		}
	}
	if st := h.eventState(t, "sales_order", key, ev.GetEventId()).GetState(); st != outboxv1.EventState_EVENT_STATE_PENDING {
		t.Errorf("after the viewer's attempts the event is %v, want pending", st)
	}
}

// Actions need the session's form token and a same-origin request; with
// both, the skip is recorded under the token's name.
func TestCSRF(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessOptions{})
	ev := h.park(t, "sales_order", "42", 2)
	b := h.browser(t)
	b.login(t, adminSecret)
	csrf := b.csrf(t, "/")
	skip := func(token string, header ...string) (int, string) {
		form := url.Values{"event_id": {ev.GetEventId()}, "reason": {"poison"}, "stream": {"sales_order"}, "key": {ev.GetAggregateKey()}}
		if token != "" {
			form.Set("csrf", token)
		}
		return b.post(t, "/act/skip", form, header...)
	}
	for _, tc := range []struct {
		name   string
		token  string
		header []string
	}{
		{"no form token", "", nil},
		{"another session's form token", b.otherCSRF(t, h), nil},
		{"cross-origin", csrf, []string{"Origin", "http://evil.example"}},
		{"opaque origin", csrf, []string{"Origin", "null"}},
		{"cross-site fetch", csrf, []string{"Sec-Fetch-Site", "cross-site"}},
		{"referer elsewhere", csrf, []string{"Origin", "", "Referer", "http://evil.example/page"}},
	} {
		code, body := skip(tc.token, tc.header...)
		if code != http.StatusForbidden || !strings.Contains(body, "refused") {
			t.Errorf("%s: %d, want 403", tc.name, code)
		}
	}
	if st := h.eventState(t, "sales_order", ev.GetAggregateKey(), ev.GetEventId()).GetState(); st != outboxv1.EventState_EVENT_STATE_PENDING {
		t.Fatalf("a refused request skipped the event: %v", st)
	}
	code, body := skip(csrf)
	if code != http.StatusOK || !strings.Contains(body, "skipped by ops") {
		t.Fatalf("skip with the form token: %d\n%s", code, body)
	}
	info := h.eventState(t, "sales_order", ev.GetAggregateKey(), ev.GetEventId())
	if info.GetState() != outboxv1.EventState_EVENT_STATE_SKIPPED || info.GetSkip().GetActor() != "ops" || info.GetSkip().GetReason() != "poison" {
		t.Errorf("skip recorded as %v by %q (%q), want skipped by ops (poison)", info.GetState(), info.GetSkip().GetActor(), info.GetSkip().GetReason())
	}
	// A skip without a reason is refused by the console before the server.
	code, body = b.post(t, "/act/skip", url.Values{"csrf": {csrf}, "event_id": {ev.GetEventId()}, "reason": {"  "},
		"stream": {"sales_order"}, "key": {ev.GetAggregateKey()}})
	if code != http.StatusOK || !strings.Contains(body, "a reason is required") {
		t.Errorf("skip without a reason: %d", code)
	}
	// Logging out ends the session and its form token.
	if code, _ := b.post(t, "/logout", url.Values{"csrf": {csrf}}); code != http.StatusOK {
		t.Errorf("logout: %d", code)
	}
	if code, _ := b.get(t, "/api/lag"); code != http.StatusUnauthorized {
		t.Errorf("after logout /api/lag: %d, want 401", code)
	}
}

// otherCSRF logs a second browser in and returns its form token.
func (b *browser) otherCSRF(t *testing.T, h *harness) string {
	o := h.browser(t)
	o.login(t, adminSecret)
	return o.csrf(t, "/")
}

// The token goes from the login form into the server-side session and
// nowhere else: not in a URL, a redirect, a cookie, a page, or a log line
// (of the console or of the replica, which the console calls).
func TestTokenNeverInURLOrLog(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessOptions{})
	ev := h.park(t, "sales_order", "42", 2)
	b := h.browser(t)
	b.login(t, adminSecret)
	var bodies []string
	for _, path := range []string{"/", "/api/lag", "/aggregates", "/aggregate?stream=sales_order&key=" + ev.GetAggregateKey(),
		"/events?stream=sales_order", "/relays", "/bulk", "/purge"} {
		_, body := b.get(t, path)
		bodies = append(bodies, body)
	}
	csrf := b.csrf(t, "/")
	_, body := b.post(t, "/act/skip", url.Values{"csrf": {csrf}, "event_id": {ev.GetEventId()}, "reason": {"gone"},
		"stream": {"sales_order"}, "key": {ev.GetAggregateKey()}})
	bodies = append(bodies, body)
	_, body = b.post(t, "/purge", url.Values{"csrf": {csrf}, "older_than": {"1h"}})
	bodies = append(bodies, body)
	// A failed login with a near miss must not echo it either.
	o := h.browser(t)
	_, body = o.post(t, "/login", url.Values{"csrf": {o.csrf(t, "/login")}, "token": {adminSecret + "x"}})
	bodies = append(bodies, body)

	u, _ := url.Parse(h.srv.URL)
	for _, c := range b.Jar.Cookies(u) {
		if strings.Contains(c.Value, adminSecret) {
			t.Errorf("cookie %s holds the token", c.Name)
		}
	}
	for _, seen := range append(b.urls, o.urls...) {
		if strings.Contains(seen, adminSecret) || strings.Contains(seen, url.QueryEscape(adminSecret)) {
			t.Errorf("token in a URL: %s", seen)
		}
	}
	for i, body := range bodies {
		if strings.Contains(body, adminSecret) {
			t.Errorf("token in response %d", i)
		}
	}
	logs := h.logs.String()
	if strings.Contains(logs, adminSecret) {
		t.Error("token in the logs")
	}
	if !strings.Contains(logs, "console: login") || !strings.Contains(logs, "token_name=ops") {
		t.Errorf("the login is not logged by name:\n%s", logs)
	}
	if !strings.Contains(logs, "console: action") || !strings.Contains(logs, "actor=ops") {
		t.Errorf("the skip is not logged with its actor:\n%s", logs)
	}
}

// Over TLS the session cookie is Secure, and the console works as over
// plain HTTP.
func TestSecureCookieOverTLS(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessOptions{tls: true})
	b := h.browser(t)
	resp, err := b.Get(b.base + "/login")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if cs := resp.Cookies(); len(cs) != 1 || !cs[0].Secure || !cs[0].HttpOnly || cs[0].SameSite != http.SameSiteStrictMode {
		t.Errorf("session cookie over TLS %+v: want Secure, HttpOnly, SameSite=Strict", cs)
	}
	b.login(t, viewerSecret)
}

// Sessions end: after their lifetime, and when the token is revoked.
func TestSessionEnds(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessOptions{})
	b := h.browser(t)
	b.login(t, viewerSecret)
	if err := os.WriteFile(h.tokens, []byte("ops admin "+adminSecret+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := h.authn.Reload(); err != nil {
		t.Fatal(err)
	}
	code, body := b.get(t, "/")
	if code != http.StatusOK || !strings.Contains(body, "revoked") || !strings.Contains(body, `name="token"`) {
		t.Errorf("after revocation GET /: %d, want the login page saying the token was revoked\n%s", code, body)
	}

	short := newHarness(t, harnessOptions{config: func(c *console.Config) { c.SessionTTL = time.Nanosecond }})
	s := short.browser(t)
	_, body = s.post(t, "/login", url.Values{"csrf": {s.csrf(t, "/login")}, "token": {adminSecret}})
	// The session expired before the redirect's GET could use it.
	if last := s.urls[len(s.urls)-1]; !strings.HasSuffix(last, "/login") || strings.Contains(body, `id="streams"`) {
		t.Errorf("an expired session still served the page (last URL %s)", last)
	}
}

// Without tokens the console follows serve's loopback rule: open (no
// login) when Open, refused otherwise; open, it answers only loopback host
// names, still needs the form token, and records actions as console@addr.
func TestWithoutTokens(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessOptions{noTokens: true, open: true})
	ev := h.park(t, "sales_order", "42", 2)
	b := h.browser(t)
	code, body := b.get(t, "/")
	if code != http.StatusOK || !strings.Contains(body, "no login (loopback)") {
		t.Fatalf("open console GET /: %d", code)
	}
	req, _ := http.NewRequestWithContext(context.Background(), http.MethodGet, h.srv.URL+"/", nil)
	req.Host = "rebound.evil.example"
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusForbidden {
		t.Errorf("open console with Host rebound.evil.example: %d, want 403", resp.StatusCode)
	}
	// A peer from elsewhere claiming a loopback Host is refused too: the
	// Host header is the client's to choose, the peer address is not.
	remote := httptest.NewRequest(http.MethodGet, "http://127.0.0.1/", nil)
	remote.RemoteAddr = "192.0.2.7:40000"
	rec := httptest.NewRecorder()
	h.con.Handler().ServeHTTP(rec, remote)
	if rec.Code != http.StatusForbidden || !strings.Contains(rec.Body.String(), "connections from this machine") {
		t.Errorf("open console from a non-loopback peer with Host 127.0.0.1: %d, want 403", rec.Code)
	}
	form := url.Values{"event_id": {ev.GetEventId()}, "reason": {"drop"}, "stream": {"sales_order"}, "key": {ev.GetAggregateKey()}}
	if code, _ := b.post(t, "/act/skip", form); code != http.StatusForbidden {
		t.Errorf("open console skip without the form token: %d, want 403", code)
	}
	form.Set("csrf", b.csrf(t, "/bulk"))
	if code, _ := b.post(t, "/act/skip", form); code != http.StatusOK {
		t.Errorf("open console skip: %d", code)
	}
	info := h.eventState(t, "sales_order", ev.GetAggregateKey(), ev.GetEventId())
	if !strings.HasPrefix(info.GetSkip().GetActor(), "console@127.0.0.1:") {
		t.Errorf("skip actor %q, want console@<address>", info.GetSkip().GetActor())
	}

	closed := newHarness(t, harnessOptions{noTokens: true, open: false})
	code, body = closed.browser(t).get(t, "/")
	if code != http.StatusForbidden || !strings.Contains(body, "needs tokens") {
		t.Errorf("console without tokens off loopback: %d\n%s", code, body)
	}
}

// sessionCookie returns the value of b's session cookie, or "".
func (b *browser) sessionCookie(t *testing.T) string {
	t.Helper()
	u, err := url.Parse(b.base)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range b.Jar.Cookies(u) {
		if c.Name == "outboxd_console" {
			return c.Value
		}
	}
	return ""
}

// replay returns a new browser that presents id as its session cookie, as
// someone who copied the cookie would, and does not follow redirects.
func (h *harness) replay(t *testing.T, id string) *browser {
	t.Helper()
	o := h.browser(t)
	noRedirect(o)
	u, _ := url.Parse(h.srv.URL)
	o.Jar.SetCookies(u, []*http.Cookie{{Name: "outboxd_console", Value: id, Path: "/"}})
	return o
}

// Logging in starts a new session with a new id: a session id planted in a
// browser before login (session fixation) is worth nothing after it, even
// though it was the session the login form was posted from.
func TestLoginGivesAFreshSessionID(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessOptions{})
	b := h.browser(t)
	b.csrf(t, "/login")
	planted := b.sessionCookie(t)
	if planted == "" {
		t.Fatal("the login page set no session cookie")
	}
	b.login(t, adminSecret)
	if now := b.sessionCookie(t); now == planted || now == "" {
		t.Fatalf("after login the session id is %q, the pre-login one was %q: want a new one", now, planted)
	}
	resp, err := h.replay(t, planted).Get(h.srv.URL + "/")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusSeeOther || resp.Header.Get("Location") != "/login" {
		t.Errorf("GET / with the pre-login session id: %d to %q, want 303 to /login", resp.StatusCode, resp.Header.Get("Location"))
	}
}

// Logging out ends the session on the server, not only in the browser that
// logged out: its cookie, replayed from elsewhere, no longer reaches a page
// or acts.
func TestLogoutEndsTheSessionForACopiedCookie(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessOptions{})
	b := h.browser(t)
	b.login(t, adminSecret)
	id := b.sessionCookie(t)
	csrf := b.csrf(t, "/")
	if code, _ := h.replay(t, id).get(t, "/api/lag"); code != http.StatusOK {
		t.Fatalf("the copied cookie before logout: GET /api/lag %d, want 200", code)
	}
	if code, _ := b.post(t, "/logout", url.Values{"csrf": {csrf}}); code != http.StatusOK {
		t.Fatalf("logout: %d", code)
	}
	o := h.replay(t, id)
	if code, _ := o.get(t, "/api/lag"); code != http.StatusUnauthorized {
		t.Errorf("the copied cookie after logout: GET /api/lag %d, want 401", code)
	}
	if code, _ := o.post(t, "/purge", url.Values{"csrf": {csrf}, "older_than": {"1h"}}); code != http.StatusUnauthorized {
		t.Errorf("the copied cookie after logout: POST /purge %d, want 401", code)
	}
}

// The login form is held to the same rules as every other form: without
// the session's form token, or posted from another origin, it is refused
// and logs nobody in (login CSRF would put the operator's browser in a
// session of someone else's token).
func TestLoginNeedsTheFormTokenAndSameOrigin(t *testing.T) {
	t.Parallel()
	h := newHarness(t, harnessOptions{})
	b := h.browser(t)
	noRedirect(b)
	csrf := b.csrf(t, "/login")
	for _, tc := range []struct {
		name   string
		form   url.Values
		header []string
	}{
		{"no form token", url.Values{"token": {adminSecret}}, nil},
		{"wrong form token", url.Values{"token": {adminSecret}, "csrf": {csrf + "x"}}, nil},
		{"cross-origin", url.Values{"token": {adminSecret}, "csrf": {csrf}}, []string{"Origin", "http://evil.example"}},
	} {
		code, body := b.post(t, "/login", tc.form, tc.header...)
		if code != http.StatusForbidden || !strings.Contains(body, "refused") {
			t.Errorf("login with %s: %d, want 403 refused", tc.name, code)
		}
	}
	if code, _ := b.get(t, "/api/lag"); code != http.StatusUnauthorized {
		t.Errorf("after refused logins GET /api/lag: %d, want 401", code)
	}
}
