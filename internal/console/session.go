package console

import (
	"context"
	"crypto/rand"
	"crypto/subtle"
	"encoding/base64"
	"net"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc/metadata"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/auth"
)

// cookieName names the session cookie.
const cookieName = "outboxd_console"

// session is one browser's state. The token is kept only here, in memory.
type session struct {
	id      string
	csrf    string
	token   string // empty until login (and always without tokens)
	name    string // the token's name, for display
	created time.Time
	seen    time.Time
	flash   []flash
}

type flash struct {
	Kind string // "ok" or "error"
	Text string
}

// sessions is the session table.
type sessions struct {
	ttl, idle time.Duration
	mu        sync.Mutex
	m         map[string]*session
}

func newSessions(ttl, idle time.Duration) *sessions {
	return &sessions{ttl: ttl, idle: idle, m: map[string]*session{}}
}

func randomID() string {
	b := make([]byte, 32)
	_, _ = rand.Read(b) // never fails (crypto/rand panics instead)
	return base64.RawURLEncoding.EncodeToString(b)
}

// create starts a session, dropping expired ones and, beyond maxSessions,
// the oldest.
func (s *sessions) create(now time.Time) *session {
	sess := &session{id: randomID(), csrf: randomID(), created: now, seen: now}
	s.mu.Lock()
	defer s.mu.Unlock()
	var oldest *session
	for id, o := range s.m {
		if s.expired(o, now) {
			delete(s.m, id)
		} else if oldest == nil || o.created.Before(oldest.created) {
			oldest = o
		}
	}
	if len(s.m) >= maxSessions && oldest != nil {
		delete(s.m, oldest.id)
	}
	s.m[sess.id] = sess
	return sess
}

func (s *sessions) expired(sess *session, now time.Time) bool {
	return now.Sub(sess.created) > s.ttl || now.Sub(sess.seen) > s.idle
}

// get returns the live session with id, marking it used.
func (s *sessions) get(id string, now time.Time) *session {
	s.mu.Lock()
	defer s.mu.Unlock()
	sess := s.m[id]
	if sess == nil {
		return nil
	}
	if s.expired(sess, now) {
		delete(s.m, id)
		return nil
	}
	sess.seen = now
	return sess
}

func (s *sessions) delete(id string) {
	s.mu.Lock()
	delete(s.m, id)
	s.mu.Unlock()
}

func (s *sessions) addFlash(sess *session, kind, text string) {
	s.mu.Lock()
	sess.flash = append(sess.flash, flash{Kind: kind, Text: text})
	s.mu.Unlock()
}

func (s *sessions) takeFlash(sess *session) []flash {
	s.mu.Lock()
	defer s.mu.Unlock()
	f := sess.flash
	sess.flash = nil
	return f
}

func (c *Console) setCookie(w http.ResponseWriter, r *http.Request, sess *session) {
	http.SetCookie(w, &http.Cookie{
		Name: cookieName, Value: sess.id, Path: "/", HttpOnly: true, SameSite: http.SameSiteStrictMode,
		Secure: r.TLS != nil, MaxAge: int(c.cfg.SessionTTL / time.Second),
	})
}

func (c *Console) sessionFrom(r *http.Request) *session {
	ck, err := r.Cookie(cookieName)
	if err != nil {
		return nil
	}
	return c.sessions.get(ck.Value, time.Now())
}

// request is what a page handler works with.
type request struct {
	w    http.ResponseWriter
	r    *http.Request
	ctx  context.Context // carries the session's bearer token to the AdminService
	sess *session
	// who is the token's principal; nil without tokens (everything allowed).
	who *auth.Principal
}

// can reports whether the session may call the AdminService method (full
// name), by the interceptors' own policy; it decides which actions a page
// offers. The call itself is authorized again by the server.
func (q *request) can(c *Console, method string) bool {
	return q.who == nil || c.cfg.Authenticator.Allows(q.who, method)
}

// actor is the actor field actions send: empty with a token (the server
// records the token's name), "console@<address>" without.
func (q *request) actor() string {
	if q.who != nil {
		return ""
	}
	return "console@" + q.r.RemoteAddr
}

// disabled reports why the console refuses every page, or "".
func (c *Console) disabled(r *http.Request) string {
	switch {
	case c.cfg.Authenticator != nil:
		return ""
	case !c.cfg.Open:
		return "The console needs tokens: this server runs without a token file, and without one the console opens only on a loopback --http-listen and only when gRPC does not require client certificates. Give serve --token-file (a token with the viewer or admin role logs in)."
	case !loopbackHost(r.Host):
		// Without login, a page from elsewhere could rebind a name of its
		// own to 127.0.0.1; only loopback names reach an open console.
		return "Without tokens the console answers only to a loopback host name (127.0.0.1, [::1] or localhost)."
	case !loopbackHost(r.RemoteAddr):
		// The Host header is the client's to choose; the peer address is
		// not. A proxy on this machine forwarding others' requests still
		// passes, which is why an open console needs a loopback listener.
		return "Without tokens the console answers only to connections from this machine."
	}
	return ""
}

func loopbackHost(hostport string) bool {
	host := hostport
	if h, _, err := net.SplitHostPort(hostport); err == nil {
		host = h
	}
	if strings.EqualFold(host, "localhost") {
		return true
	}
	ip := net.ParseIP(strings.Trim(host, "[]"))
	return ip != nil && ip.IsLoopback()
}

// sameOrigin reports whether a POST comes from one of this console's own
// pages, as far as the browser says: Sec-Fetch-Site, then Origin (or
// Referer) must name this host. A request saying nothing (not a browser)
// is left to the synchronizer token.
func sameOrigin(r *http.Request) bool {
	if site := r.Header.Get("Sec-Fetch-Site"); site != "" && site != "same-origin" && site != "none" {
		return false
	}
	origin := r.Header.Get("Origin")
	if origin == "" {
		origin = r.Header.Get("Referer")
		if origin == "" {
			return true
		}
	}
	u, err := url.Parse(origin)
	return err == nil && u.Host != "" && strings.EqualFold(u.Host, r.Host)
}

// checkPost refuses a POST without this session's synchronizer token or
// from another origin.
func checkPost(r *http.Request, sess *session) string {
	if !sameOrigin(r) {
		return "refused: the request did not come from this console (Origin mismatch)"
	}
	got := r.PostFormValue("csrf")
	if got == "" || subtle.ConstantTimeCompare([]byte(got), []byte(sess.csrf)) != 1 {
		return "refused: missing or wrong form token (CSRF); reload the page and try again"
	}
	return ""
}

// page wraps a handler with the console's access rules.
func (c *Console) page(h func(*request)) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if why := c.disabled(r); why != "" {
			c.fail(w, r, nil, http.StatusForbidden, why)
			return
		}
		sess := c.sessionFrom(r)
		if c.cfg.Authenticator == nil && sess == nil {
			sess = c.sessions.create(time.Now())
			c.setCookie(w, r, sess)
		}
		q := &request{w: w, r: r, sess: sess, ctx: r.Context()}
		if c.cfg.Authenticator != nil {
			if sess == nil || sess.token == "" {
				c.toLogin(w, r, "")
				return
			}
			p, ok := c.cfg.Authenticator.Lookup(sess.token)
			if !ok {
				c.sessions.delete(sess.id)
				c.toLogin(w, r, "Your token was revoked or changed; log in again.")
				return
			}
			q.who = p
			q.ctx = metadata.AppendToOutgoingContext(r.Context(), "authorization", "Bearer "+sess.token)
		}
		if r.Method == http.MethodPost {
			if why := checkPost(r, sess); why != "" {
				c.fail(w, r, sess, http.StatusForbidden, why)
				return
			}
		}
		w.Header().Set("Cache-Control", "no-store")
		h(q)
	}
}

// toLogin sends a browser to the login page; API calls and POSTs get 401.
func (c *Console) toLogin(w http.ResponseWriter, r *http.Request, msg string) {
	if r.Method != http.MethodGet || strings.HasPrefix(r.URL.Path, "/api/") {
		c.fail(w, r, nil, http.StatusUnauthorized, cmpString(msg, "log in first"))
		return
	}
	if msg != "" {
		sess := c.sessions.create(time.Now())
		c.sessions.addFlash(sess, "error", msg)
		c.setCookie(w, r, sess)
	}
	http.Redirect(w, r, "/login", http.StatusSeeOther)
}

func cmpString(a, b string) string {
	if a != "" {
		return a
	}
	return b
}

func (c *Console) loginPage(w http.ResponseWriter, r *http.Request) {
	if why := c.disabled(r); why != "" {
		c.fail(w, r, nil, http.StatusForbidden, why)
		return
	}
	if c.cfg.Authenticator == nil {
		http.Redirect(w, r, "/", http.StatusSeeOther)
		return
	}
	sess := c.sessionFrom(r)
	if sess == nil {
		sess = c.sessions.create(time.Now())
		c.setCookie(w, r, sess)
	}
	w.Header().Set("Cache-Control", "no-store")
	c.render(w, r, http.StatusOK, "login", &request{w: w, r: r, sess: sess}, nil)
}

// login checks the posted token and, if it may read, starts a new session
// holding it (a fresh id, so a session id planted before login is useless).
func (c *Console) login(w http.ResponseWriter, r *http.Request) {
	if why := c.disabled(r); why != "" || c.cfg.Authenticator == nil {
		c.fail(w, r, nil, http.StatusForbidden, cmpString(why, "no login without tokens"))
		return
	}
	pre := c.sessionFrom(r)
	if pre == nil {
		c.fail(w, r, nil, http.StatusForbidden, "refused: no session; open the login page first")
		return
	}
	if why := checkPost(r, pre); why != "" {
		c.fail(w, r, pre, http.StatusForbidden, why)
		return
	}
	q := &request{w: w, r: r, sess: pre}
	p, ok := c.cfg.Authenticator.Lookup(strings.TrimSpace(r.PostFormValue("token")))
	if !ok {
		c.log.Info("console: login refused: unknown token", "remote", r.RemoteAddr)
		c.render(w, r, http.StatusUnauthorized, "login", q, map[string]any{"Error": "Unknown or revoked token."})
		return
	}
	if !c.cfg.Authenticator.Allows(p, outboxv1.AdminService_GetLag_FullMethodName) {
		c.log.Info("console: login refused: no viewer or admin role", "token_name", p.Name, "remote", r.RemoteAddr)
		c.render(w, r, http.StatusForbidden, "login", q,
			map[string]any{"Error": "Token " + p.Name + " has neither the viewer nor the admin role."})
		return
	}
	c.sessions.delete(pre.id)
	sess := c.sessions.create(time.Now())
	sess.token, sess.name = strings.TrimSpace(r.PostFormValue("token")), p.Name
	c.setCookie(w, r, sess)
	c.log.Info("console: login", "token_name", p.Name, "remote", r.RemoteAddr)
	http.Redirect(w, r, "/", http.StatusSeeOther)
}

func (c *Console) logout(q *request) {
	c.sessions.delete(q.sess.id)
	http.SetCookie(q.w, &http.Cookie{Name: cookieName, Value: "", Path: "/", MaxAge: -1, HttpOnly: true,
		SameSite: http.SameSiteStrictMode, Secure: q.r.TLS != nil})
	c.log.Info("console: logout", "token_name", q.sess.name, "remote", q.r.RemoteAddr)
	if c.cfg.Authenticator == nil {
		http.Redirect(q.w, q.r, "/", http.StatusSeeOther)
		return
	}
	http.Redirect(q.w, q.r, "/login", http.StatusSeeOther)
}
