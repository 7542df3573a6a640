package sink_test

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/outboxd/outboxd/relay"
	"github.com/outboxd/outboxd/relay/sink"
)

// newSecret returns a fresh Standard Webhooks secret.
func newSecret() string {
	key := make([]byte, 32)
	_, _ = rand.Read(key)
	return "whsec_" + base64.StdEncoding.EncodeToString(key)
}

// secretFile writes secrets, one a line, to a file of the test.
func secretFile(t *testing.T, secrets ...string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "secret")
	if err := os.WriteFile(p, []byte(strings.Join(secrets, "\n")+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// verifyStandardWebhook is a receiver's check written from the Standard
// Webhooks specification, independently of the sink: the signed content
// is "id.timestamp.body", the key is the base64 after "whsec_", the header
// holds space-separated "v1,<base64 HMAC-SHA256>" signatures of which one
// must match, and the timestamp must be within five minutes of now.
func verifyStandardWebhook(secret string, h http.Header, body []byte, now time.Time) error {
	id, ts, sigs := h.Get("webhook-id"), h.Get("webhook-timestamp"), h.Get("webhook-signature")
	if id == "" || ts == "" || sigs == "" {
		return errors.New("missing webhook headers")
	}
	sec, err := strconv.ParseInt(ts, 10, 64)
	if err != nil {
		return fmt.Errorf("bad timestamp %q", ts)
	}
	if d := now.Sub(time.Unix(sec, 0)); d > 5*time.Minute || d < -5*time.Minute {
		return fmt.Errorf("timestamp %s too far from now", ts)
	}
	key, err := base64.StdEncoding.DecodeString(strings.TrimPrefix(secret, "whsec_"))
	if err != nil {
		return err
	}
	mac := hmac.New(sha256.New, key)
	mac.Write([]byte(id + "." + ts + "." + string(body)))
	want := mac.Sum(nil)
	for _, s := range strings.Fields(sigs) {
		version, sig, ok := strings.Cut(s, ",")
		if !ok || version != "v1" {
			continue
		}
		got, err := base64.StdEncoding.DecodeString(sig)
		if err == nil && hmac.Equal(got, want) {
			return nil
		}
	}
	return errors.New("no matching signature")
}

// hook is an httptest receiver recording what it accepts; answer, when
// set, decides the response instead of 204.
type hook struct {
	srv    *httptest.Server
	secret string
	mu     sync.Mutex
	got    []hookRequest
	answer func(w http.ResponseWriter, r *http.Request, body []byte) bool // true: handled
}

type hookRequest struct {
	header http.Header
	query  url.Values
	body   []byte
	err    error // signature verification
}

func newHook(t *testing.T) *hook {
	t.Helper()
	h := &hook{secret: newSecret()}
	h.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		h.mu.Lock()
		answer := h.answer
		h.mu.Unlock()
		if answer != nil && answer(w, r, body) {
			return
		}
		if r.Method != http.MethodPost || r.Header.Get("Content-Type") != "application/json" {
			http.Error(w, "want a JSON POST", http.StatusMethodNotAllowed)
			return
		}
		err := verifyStandardWebhook(h.secret, r.Header, body, time.Now())
		h.mu.Lock()
		h.got = append(h.got, hookRequest{r.Header.Clone(), r.URL.Query(), body, err})
		h.mu.Unlock()
		if err != nil {
			http.Error(w, err.Error(), http.StatusUnauthorized)
			return
		}
		w.WriteHeader(http.StatusNoContent)
	}))
	t.Cleanup(h.srv.Close)
	return h
}

func (h *hook) requests() []hookRequest {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]hookRequest(nil), h.got...)
}

func (h *hook) url(t *testing.T, params map[string]string) string {
	t.Helper()
	q := url.Values{"secret_file": {secretFile(t, h.secret)}}
	for k, v := range params {
		q.Set(k, v)
	}
	return h.srv.URL + "/hooks/outbox?" + q.Encode()
}

func TestWebhookPostsSignedEvent(t *testing.T) {
	t.Parallel()
	h := newHook(t)
	s := openSink(t, h.url(t, map[string]string{"query": "tenant=acme&v=2"}))
	ev := testEvent("0f8fad5b-d9cb-469f-a165-70867728950e")
	if err := s.Publish(t.Context(), ev); err != nil {
		t.Fatalf("Publish: %v", err)
	}
	got := h.requests()
	if len(got) != 1 {
		t.Fatalf("%d requests", len(got))
	}
	r := got[0]
	if r.err != nil {
		t.Fatalf("signature check: %v", r.err)
	}
	if r.header.Get("webhook-id") != ev.ID {
		t.Errorf("webhook-id %q, want the event id", r.header.Get("webhook-id"))
	}
	if r.query.Get("tenant") != "acme" || r.query.Get("v") != "2" || r.query.Has("secret_file") {
		t.Errorf("endpoint query %v: want the query parameter's, and no sink parameter", r.query)
	}
	var body struct {
		EventID      string            `json:"event_id"`
		Stream       string            `json:"stream"`
		AggregateKey string            `json:"aggregate_key"`
		Revision     int64             `json:"revision"`
		EventType    string            `json:"event_type"`
		Payload      json.RawMessage   `json:"payload"`
		Headers      map[string]string `json:"headers"`
	}
	if err := json.Unmarshal(r.body, &body); err != nil {
		t.Fatal(err)
	}
	if body.EventID != ev.ID || body.Stream != ev.Stream || body.AggregateKey != ev.AggregateKey ||
		body.Revision != 7 || body.EventType != ev.Type || string(body.Payload) != string(ev.Payload) || body.Headers["X-Tenant"] != "acme" {
		t.Errorf("body %s", r.body)
	}
}

// With two secrets in the file (a rotation), each request carries both
// signatures, and a receiver holding either accepts it.
func TestWebhookSignsWithEverySecret(t *testing.T) {
	t.Parallel()
	h := newHook(t)
	old := newSecret()
	s := openSink(t, h.srv.URL+"?secret_file="+url.QueryEscape(secretFile(t, old, h.secret)))
	if err := s.Publish(t.Context(), testEvent("e1")); err != nil {
		t.Fatalf("Publish: %v", err)
	}
	r := h.requests()[0]
	if n := len(strings.Fields(r.header.Get("webhook-signature"))); n != 2 {
		t.Errorf("%d signatures, want 2", n)
	}
	if err := verifyStandardWebhook(old, r.header, r.body, time.Now()); err != nil {
		t.Errorf("old secret: %v", err)
	}
}

// 2xx acks; 408, 429 and 5xx are retryable errors carrying Retry-After;
// other statuses are errors naming the status and quoting the body.
func TestWebhookStatusHandling(t *testing.T) {
	t.Parallel()
	h := newHook(t)
	s := openSink(t, h.url(t, nil))
	date := time.Now().Add(90 * time.Second).UTC().Format(http.TimeFormat)
	cases := []struct {
		status     int
		retryAfter string
		body       string
		ok         bool
		wantAfter  time.Duration // 0: no RetryAfter; -1: some, about 90s
		wantInText []string
		permanent  bool // the refusal parks at once (relay.Permanent)
	}{
		{status: 200, ok: true},
		{status: 202, ok: true},
		{status: 408, wantInText: []string{"408"}},
		{status: 429, retryAfter: "7", wantAfter: 7 * time.Second, wantInText: []string{"429 Too Many Requests"}},
		{status: 503, retryAfter: date, wantAfter: -1, body: "maintenance", wantInText: []string{"503", "maintenance"}},
		{status: 500, retryAfter: "soon", body: "oops", wantInText: []string{"500", "oops"}},
		{status: 502, retryAfter: "999999999", wantAfter: 24 * time.Hour, wantInText: []string{"502"}},
		{status: 400, body: `{"error":"unknown field total"}` + strings.Repeat("x", 1000), wantInText: []string{"400 Bad Request", "unknown field total", "…", "refused"}, permanent: true},
		{status: 410, wantInText: []string{"410"}, permanent: true},
		{status: 413, wantInText: []string{"413 Request Entity Too Large"}, permanent: true},
		{status: 302, wantInText: []string{"302", "redirect", "/elsewhere"}},
	}
	for _, c := range cases {
		h.mu.Lock()
		h.answer = func(w http.ResponseWriter, _ *http.Request, _ []byte) bool {
			if c.retryAfter != "" {
				w.Header().Set("Retry-After", c.retryAfter)
			}
			if c.status == 302 {
				w.Header().Set("Location", "/elsewhere")
			}
			w.WriteHeader(c.status)
			_, _ = io.WriteString(w, c.body)
			return true
		}
		h.mu.Unlock()
		err := s.Publish(t.Context(), testEvent("e-"+strconv.Itoa(c.status)))
		if c.ok {
			if err != nil {
				t.Errorf("status %d: %v", c.status, err)
			}
			continue
		}
		if err == nil {
			t.Errorf("status %d: Publish succeeded", c.status)
			continue
		}
		for _, w := range c.wantInText {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("status %d: error %q does not mention %q", c.status, err, w)
			}
		}
		if len(err.Error()) > 600 {
			t.Errorf("status %d: error is %d bytes; want a bounded excerpt", c.status, len(err.Error()))
		}
		// The nack that carries the error names the event: the text is
		// the receiver's answer, first, so that a listing cut short shows it.
		if want := "webhook sink: POST answered " + strconv.Itoa(c.status); !strings.HasPrefix(err.Error(), want) ||
			strings.Contains(err.Error(), "e-"+strconv.Itoa(c.status)) {
			t.Errorf("status %d: error %q, want it to start %q and not repeat the event id", c.status, err, want)
		}
		if relay.IsPermanent(err) != c.permanent {
			t.Errorf("status %d: permanent = %v, want %v", c.status, relay.IsPermanent(err), c.permanent)
		}
		d, has := relay.RetryAfterOf(err)
		switch {
		case c.wantAfter == 0 && has:
			t.Errorf("status %d: RetryAfter %v, want none", c.status, d)
		case c.wantAfter > 0 && d != c.wantAfter:
			t.Errorf("status %d: RetryAfter %v, want %v", c.status, d, c.wantAfter)
		case c.wantAfter < 0 && (d < 80*time.Second || d > 91*time.Second):
			t.Errorf("status %d: RetryAfter %v, want about 90s", c.status, d)
		}
	}
}

func TestWebhookTimeout(t *testing.T) {
	t.Parallel()
	h := newHook(t)
	h.mu.Lock()
	h.answer = func(_ http.ResponseWriter, r *http.Request, _ []byte) bool {
		<-r.Context().Done()
		return true
	}
	h.mu.Unlock()
	s := openSink(t, h.url(t, map[string]string{"timeout": "200ms"}))
	start := time.Now()
	if err := s.Publish(t.Context(), testEvent("e1")); err == nil {
		t.Fatal("Publish to a receiver that never answers succeeded")
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Errorf("Publish took %v with timeout=200ms", d)
	}
}

func TestWebhookOpenRejectsBadSecrets(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	write := func(name, content string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	short := "whsec_" + base64.StdEncoding.EncodeToString([]byte("short"))
	cases := map[string]struct{ file, want string }{
		"missing":   {filepath.Join(dir, "nope"), "no such file"},
		"empty":     {write("empty", "\n\n"), "no secret"},
		"no prefix": {write("plain", "c2VjcmV0c2VjcmV0c2VjcmV0c2VjcmV0\n"), `starting with "whsec_"`},
		"not b64":   {write("bad", "whsec_!!!notbase64!!!\n"), "not base64"},
		"short":     {write("short", short), "at least 24"},
		"23 bytes":  {write("short23", "whsec_"+base64.StdEncoding.EncodeToString(make([]byte, 23))), "is 23 bytes; want at least 24"},
	}
	for name, c := range cases {
		u := "https://127.0.0.1:1/hook?secret_file=" + url.QueryEscape(c.file)
		s, err := sink.Open(t.Context(), u, sink.Options{})
		if err == nil {
			_ = s.Close()
			t.Errorf("%s: Open succeeded", name)
			continue
		}
		if !errors.Is(err, sink.ErrInvalidURL) || !strings.Contains(err.Error(), "secret_file=") || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: error %q, want ErrInvalidURL naming secret_file and %q", name, err, c.want)
		}
		if strings.Contains(err.Error(), "notbase64") {
			t.Errorf("%s: error shows the secret: %v", name, err)
		}
	}
}

// The W3C trace context the relay put in the event's headers also goes as
// HTTP headers without CloudEvents, so a receiver's HTTP instrumentation
// continues the trace.
func TestWebhookSendsTraceContextAsHTTPHeaders(t *testing.T) {
	t.Parallel()
	h := newHook(t)
	s := openSink(t, h.url(t, nil))
	ev := testEvent("7c9e6679-7425-40de-944b-e07fc1f90ae7")
	const tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	ev.Headers = map[string]string{"traceparent": tp, "tracestate": "vendor=1", "X-Tenant": "acme"}
	if err := s.Publish(t.Context(), ev); err != nil {
		t.Fatalf("Publish: %v", err)
	}
	got := h.requests()
	if len(got) != 1 || got[0].err != nil {
		t.Fatalf("requests %+v", got)
	}
	if g := got[0].header.Get("traceparent"); g != tp {
		t.Errorf("traceparent header %q, want %q", g, tp)
	}
	if g := got[0].header.Get("tracestate"); g != "vendor=1" {
		t.Errorf("tracestate header %q", g)
	}
	if g := got[0].header.Get("X-Tenant"); g != "" {
		t.Errorf("producer header X-Tenant sent as an HTTP header (%q); it belongs in the body", g)
	}
}

// caFile writes srv's certificate as a PEM file of the test.
func caFile(t *testing.T, srv *httptest.Server) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "ca.pem")
	block := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw})
	if err := os.WriteFile(p, block, 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// Over https the receiver's certificate is verified: with the system's
// roots a test CA is refused (an error worth retrying: the receiver may
// fix its certificate), and with ca_file naming that CA the signed POST
// lands, over HTTP/2 when the receiver offers it.
func TestWebhookTLS(t *testing.T) {
	t.Parallel()
	secret := newSecret()
	var (
		mu    sync.Mutex
		proto []string
	)
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		if err := verifyStandardWebhook(secret, r.Header, body, time.Now()); err != nil || r.TLS == nil {
			http.Error(w, fmt.Sprintf("tls %v: %v", r.TLS != nil, err), http.StatusUnauthorized)
			return
		}
		mu.Lock()
		proto = append(proto, r.Proto)
		mu.Unlock()
		w.WriteHeader(http.StatusNoContent)
	}))
	srv.EnableHTTP2 = true
	srv.StartTLS()
	t.Cleanup(srv.Close)
	base := srv.URL + "/hook?secret_file=" + url.QueryEscape(secretFile(t, secret))

	untrusted := openSink(t, base)
	err := untrusted.Publish(t.Context(), testEvent("e-untrusted"))
	if err == nil || !strings.Contains(err.Error(), "certificate") || relay.IsPermanent(err) {
		t.Errorf("Publish to a receiver with an unknown CA = %v (permanent: %v); want a certificate error, not permanent", err, relay.IsPermanent(err))
	}

	trusted := openSink(t, base+"&ca_file="+url.QueryEscape(caFile(t, srv)))
	if err := trusted.Publish(t.Context(), testEvent("e-trusted")); err != nil {
		t.Fatalf("Publish with ca_file: %v", err)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(proto) != 1 || proto[0] != "HTTP/2.0" {
		t.Errorf("receiver accepted %v; want one request over HTTP/2.0", proto)
	}
}

func TestWebhookOpenRejectsBadCAFile(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	notPEM := filepath.Join(dir, "ca.pem")
	if err := os.WriteFile(notPEM, []byte("not a certificate\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	secret := url.QueryEscape(secretFile(t, newSecret()))
	for _, c := range []struct{ url, want string }{
		{"https://127.0.0.1:1/h?secret_file=" + secret + "&ca_file=" + url.QueryEscape(filepath.Join(dir, "nope")), "no such file"},
		{"https://127.0.0.1:1/h?secret_file=" + secret + "&ca_file=" + url.QueryEscape(notPEM), "no PEM certificate"},
		{"http://127.0.0.1:1/h?secret_file=" + secret + "&ca_file=" + url.QueryEscape(notPEM), "only for https://"},
	} {
		s, err := sink.Open(t.Context(), c.url, sink.Options{})
		if err == nil {
			_ = s.Close()
			t.Errorf("Open(%s) succeeded", c.url)
			continue
		}
		if !errors.Is(err, sink.ErrInvalidURL) || !strings.Contains(err.Error(), "ca_file=") || !strings.Contains(err.Error(), c.want) {
			t.Errorf("Open(%s) = %q, want ErrInvalidURL naming ca_file and %q", c.url, err, c.want)
		}
	}
}

// Credentials in a webhook URL would never be sent (the signature
// authenticates): Open refuses them as a configuration error instead of
// ignoring them, without showing them.
func TestWebhookOpenRefusesCredentials(t *testing.T) {
	t.Parallel()
	secret := url.QueryEscape(secretFile(t, newSecret()))
	for _, u := range []string{
		"https://alice:s3cret@127.0.0.1:1/hook?secret_file=" + secret,
		"http://s3cret@127.0.0.1:1/hook?secret_file=" + secret,
	} {
		s, err := sink.Open(t.Context(), u, sink.Options{})
		if err == nil {
			_ = s.Close()
			t.Errorf("Open(%s) succeeded", u)
			continue
		}
		if !errors.Is(err, sink.ErrInvalidURL) || !strings.Contains(err.Error(), "credentials") || strings.Contains(err.Error(), "s3cret") {
			t.Errorf("Open(%s) = %v, want ErrInvalidURL about credentials, without them", u, err)
		}
	}
}

// A secrets file as editors and secret stores write it: CRLF line ends,
// indentation, blank lines, a secret of exactly 24 bytes (the least Open
// takes). Every secret signs.
func TestWebhookSecretFileToleratesWhiteSpace(t *testing.T) {
	t.Parallel()
	h := newHook(t)
	least := "whsec_" + base64.StdEncoding.EncodeToString(make([]byte, 24))
	p := filepath.Join(t.TempDir(), "secret")
	if err := os.WriteFile(p, []byte("\r\n  "+least+"\r\n\t"+h.secret+" \r\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	s := openSink(t, h.srv.URL+"?secret_file="+url.QueryEscape(p))
	if err := s.Publish(t.Context(), testEvent("e1")); err != nil {
		t.Fatalf("Publish: %v", err)
	}
	r := h.requests()[0]
	if r.err != nil {
		t.Fatalf("the receiver's secret did not verify: %v", r.err)
	}
	if err := verifyStandardWebhook(least, r.header, r.body, time.Now()); err != nil {
		t.Errorf("the 24-byte secret: %v", err)
	}
}

// A receiver's answer is read to its end (up to 64 KiB) before the next
// publish, so that the relay's connection to it is reused: one connection
// for many events, not one each, whatever the receiver writes back.
func TestWebhookReusesItsConnection(t *testing.T) {
	t.Parallel()
	h := newHook(t)
	peers := map[string]bool{} // client addresses, one per connection
	h.mu.Lock()
	h.answer = func(w http.ResponseWriter, r *http.Request, _ []byte) bool {
		h.mu.Lock()
		peers[r.RemoteAddr] = true
		h.mu.Unlock()
		_, _ = w.Write([]byte(strings.Repeat("ok ", 3000))) // past the excerpt an error would quote
		return true
	}
	h.mu.Unlock()
	s := openSink(t, h.url(t, nil))
	for i := range 5 {
		if err := s.Publish(t.Context(), testEvent(fmt.Sprintf("e%d", i))); err != nil {
			t.Fatalf("Publish %d: %v", i, err)
		}
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if len(peers) != 1 {
		t.Fatalf("5 publishes came over %d connections, want 1", len(peers))
	}
}
