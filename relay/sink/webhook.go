package sink

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/base64"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/outboxd/outboxd/relay"
)

// DefaultWebhookTimeout is the webhook sink's default bound on one POST.
const DefaultWebhookTimeout = 10 * time.Second

// Standard Webhooks headers the webhook sink sets.
const (
	HeaderWebhookID        = "webhook-id"
	HeaderWebhookTimestamp = "webhook-timestamp"
	HeaderWebhookSignature = "webhook-signature"
)

// webhookSecretPrefix starts a Standard Webhooks secret; the rest is the
// key in base64.
const webhookSecretPrefix = "whsec_"

// maxWebhookExcerpt bounds the response body quoted in an error.
const maxWebhookExcerpt = 256

type webhookConfig struct {
	endpoint string
	keys     [][]byte
	timeout  time.Duration
	roots    *x509.CertPool // from ca_file; nil: the system's
	ce       ceConfig
}

func parseWebhookURL(u *url.URL, display string) (*webhookConfig, error) {
	if u.Opaque != "" || u.Host == "" {
		return nil, invalid(display, "want %s://host[:port]/path?secret_file=...", u.Scheme)
	}
	if u.User != nil {
		return nil, invalid(display, "credentials in a webhook URL are not sent; authenticate with the signature")
	}
	if u.Fragment != "" {
		return nil, invalid(display, "unexpected fragment")
	}
	p, err := params(u, display, append([]string{"secret_file", "timeout", "query", "ca_file"}, ceParams...)...)
	if err != nil {
		return nil, err
	}
	cfg := &webhookConfig{timeout: DefaultWebhookTimeout}
	if cfg.ce, err = parseCE(p, display, "ce-"); err != nil {
		return nil, err
	}
	file, ok := p["secret_file"]
	if !ok || file == "" {
		return nil, invalid(display, `missing parameter "secret_file" (a file holding the whsec_... signing secret)`)
	}
	if cfg.keys, err = readWebhookSecrets(file); err != nil {
		return nil, invalid(display, "secret_file=%q: %v", file, err)
	}
	if v, ok := p["timeout"]; ok {
		if cfg.timeout, err = positiveDuration(v); err != nil {
			return nil, invalid(display, "timeout=%q: %v", v, err)
		}
	}
	if v, ok := p["ca_file"]; ok {
		if u.Scheme != "https" {
			return nil, invalid(display, "ca_file=%q: only for https:// endpoints", v)
		}
		if cfg.roots, err = readCAFile(v); err != nil {
			return nil, invalid(display, "ca_file=%q: %v", v, err)
		}
	}
	endpoint := *u
	endpoint.RawQuery, endpoint.ForceQuery = "", false
	if v, ok := p["query"]; ok {
		// The endpoint's own query string, kept apart from the sink's
		// parameters so that neither can be taken for the other.
		if _, err := url.ParseQuery(v); err != nil {
			return nil, invalid(display, "query=%q: %v", v, err)
		}
		endpoint.RawQuery = v
	}
	cfg.endpoint = endpoint.String()
	return cfg, nil
}

// readWebhookSecrets reads one or more whsec_ secrets, one a line; every
// one signs each request, so a receiver can rotate its secret by accepting
// the new one while the relay still signs with both. Error messages never
// show the secret.
func readWebhookSecrets(file string) ([][]byte, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	var keys [][]byte
	for i, line := range strings.Split(string(b), "\n") {
		line = strings.TrimSpace(line)
		if line == "" {
			continue
		}
		rest, ok := strings.CutPrefix(line, webhookSecretPrefix)
		if !ok {
			return nil, fmt.Errorf("line %d: want a secret starting with %q", i+1, webhookSecretPrefix)
		}
		key, err := base64.StdEncoding.DecodeString(rest)
		if err != nil {
			return nil, fmt.Errorf("line %d: the secret after %q is not base64", i+1, webhookSecretPrefix)
		}
		if len(key) < 24 {
			return nil, fmt.Errorf("line %d: the secret is %d bytes; want at least 24", i+1, len(key))
		}
		keys = append(keys, key)
	}
	if len(keys) == 0 {
		return nil, errors.New("no secret in the file")
	}
	return keys, nil
}

// readCAFile reads the PEM certificates that verify a receiver instead of
// the system's roots.
func readCAFile(file string) (*x509.CertPool, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(b) {
		return nil, errors.New("no PEM certificate in the file")
	}
	return pool, nil
}

// webhookSink POSTs each event to one endpoint, signed as Standard
// Webhooks specifies.
type webhookSink struct {
	cfg       *webhookConfig
	client    *http.Client
	transport *http.Transport
	now       func() time.Time
}

func openWebhook(_ context.Context, u *url.URL, display string, opts Options) (relay.Sink, error) {
	cfg, err := parseWebhookURL(u, display)
	if err != nil {
		return nil, err
	}
	// A transport of its own (the default's settings: proxy from the
	// environment, TLS with the system roots, HTTP/2), so Close can drop
	// its idle connections without touching anyone else's.
	tr := http.DefaultTransport.(*http.Transport).Clone()
	if cfg.roots != nil {
		// Still HTTP/2 when the receiver offers it: the clone keeps
		// ForceAttemptHTTP2.
		tr.TLSClientConfig = &tls.Config{RootCAs: cfg.roots, MinVersion: tls.VersionTLS12}
	}
	s := &webhookSink{
		cfg:       cfg,
		transport: tr,
		client: &http.Client{
			Transport: tr,
			Timeout:   cfg.timeout,
			// A redirected POST can turn into a GET or lose its body:
			// report the redirect instead of following it.
			CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
		},
		now: time.Now,
	}
	opts.Logger.Info("webhook sink ready", "sink", "webhook", "endpoint", display)
	return s, nil
}

// signWebhook returns the webhook-signature header value: "v1," and the
// base64 HMAC-SHA256 of "id.timestamp.body" under each key, space-separated.
func signWebhook(keys [][]byte, id, timestamp string, body []byte) string {
	sigs := make([]string, len(keys))
	for i, k := range keys {
		m := hmac.New(sha256.New, k)
		m.Write([]byte(id))
		m.Write([]byte{'.'})
		m.Write([]byte(timestamp))
		m.Write([]byte{'.'})
		m.Write(body)
		sigs[i] = "v1," + base64.StdEncoding.EncodeToString(m.Sum(nil))
	}
	return strings.Join(sigs, " ")
}

// Publish POSTs ev as JSON (or as a CloudEvent) and returns nil on a 2xx
// answer. 408, 429 and 5xx are errors the runner retries with its backoff,
// or after the response's Retry-After when that is longer
// (relay.RetryAfter). Another 4xx is a permanent error naming the status
// and quoting the body, so the aggregate parks at once with it: the
// receiver refused these bytes. A redirect is an ordinary error.
func (s *webhookSink) Publish(ctx context.Context, ev relay.Event) error {
	if ev.ID == "" {
		return errors.New("webhook sink: event has no ID, which webhook-id needs")
	}
	var (
		m   ceMessage
		err error
	)
	if s.cfg.ce.on() {
		m, err = s.cfg.ce.message(ev)
	} else {
		m.body, err = encodeEvent(ev)
		m.contentType = "application/json"
	}
	if err != nil {
		return fmt.Errorf("webhook sink: %w", err)
	}
	body := m.body
	ts := strconv.FormatInt(s.now().Unix(), 10)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, s.cfg.endpoint, bytes.NewReader(body))
	if err != nil {
		return fmt.Errorf("webhook sink: %w", err)
	}
	req.Header.Set("Content-Type", m.contentType)
	// The HTTP binding: attributes as ce-* headers (binary mode). The
	// event's own headers travel in the body; the W3C trace context also
	// goes as HTTP headers, in every mode, so that the receiver's HTTP
	// instrumentation continues the relay's trace.
	for k, v := range m.headers {
		req.Header.Set(k, v)
	}
	for _, h := range []string{"traceparent", "tracestate"} {
		if v, ok := lookupFold(ev.Headers, h); ok {
			req.Header.Set(h, v)
		}
	}
	req.Header.Set("User-Agent", "outboxd-relay")
	id := ev.MessageID()
	req.Header.Set(HeaderWebhookID, id)
	req.Header.Set(HeaderWebhookTimestamp, ts)
	req.Header.Set(HeaderWebhookSignature, signWebhook(s.cfg.keys, id, ts, body))
	resp, err := s.client.Do(req)
	if err != nil {
		return fmt.Errorf("webhook sink: %w", err)
	}
	defer resp.Body.Close()
	excerpt, _ := io.ReadAll(io.LimitReader(resp.Body, maxWebhookExcerpt+1))
	// Read a little more so the connection can be reused, not forever.
	_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
	if resp.StatusCode >= 200 && resp.StatusCode < 300 {
		return nil
	}
	err = fmt.Errorf("webhook sink: POST answered %s%s", resp.Status, quoteExcerpt(excerpt))
	switch {
	case resp.StatusCode == http.StatusRequestTimeout || resp.StatusCode == http.StatusTooManyRequests || resp.StatusCode >= 500:
		return relay.RetryAfter(err, retryAfter(resp.Header.Get("Retry-After"), s.now()))
	case resp.StatusCode >= 300 && resp.StatusCode < 400:
		return fmt.Errorf("%w (redirect to %q not followed: configure the final URL)", err, resp.Header.Get("Location"))
	case resp.StatusCode >= 400:
		// 413 (too large) and the other refusals of this request: the
		// same bytes would be refused again, so the aggregate parks now
		// with the status and body excerpt as its reason.
		return relay.Permanent(fmt.Errorf("%w (refused by the receiver; retrying will not help until it changes)", err))
	default:
		return fmt.Errorf("%w (unexpected status)", err)
	}
}

// quoteExcerpt renders the start of a response body for an error message.
func quoteExcerpt(b []byte) string {
	if len(b) == 0 {
		return ""
	}
	more := ""
	if len(b) > maxWebhookExcerpt {
		b, more = b[:maxWebhookExcerpt], "…"
	}
	// A rune cut at the limit becomes U+FFFD, as does any invalid byte.
	return fmt.Sprintf(": %q%s", strings.ToValidUTF8(string(b), "\uFFFD"), more)
}

// retryAfter parses a Retry-After value: delay seconds or an HTTP date.
// It returns 0 when there is none or it cannot be read.
func retryAfter(v string, now time.Time) time.Duration {
	v = strings.TrimSpace(v)
	if v == "" {
		return 0
	}
	if n, err := strconv.ParseInt(v, 10, 64); err == nil {
		if n <= 0 {
			return 0
		}
		return time.Duration(min(n, int64(24*time.Hour/time.Second))) * time.Second
	}
	if t, err := http.ParseTime(v); err == nil {
		return max(t.Sub(now), 0)
	}
	return 0
}

// Close drops the sink's idle connections.
func (s *webhookSink) Close() error {
	s.transport.CloseIdleConnections()
	return nil
}
