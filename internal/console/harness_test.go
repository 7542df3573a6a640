package console_test

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc/metadata"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/auth"
	"github.com/outboxd/outboxd/internal/console"
	"github.com/outboxd/outboxd/internal/servertest"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/server"
)

const (
	adminSecret  = "console-admin-secret-0123456789"
	viewerSecret = "console-viewer-secret-0123456789"
	relaySecret  = "console-relay-secret-0123456789"
	// ordersSecret is a viewer's of source orders' streams only.
	ordersSecret = "console-orders-secret-012345678"
)

// tokenFile is what every test's server reads.
var tokenFile = strings.Join([]string{
	"ops admin " + auth.HashToken(adminSecret),
	"watcher viewer " + viewerSecret,
	"relayer relay " + relaySecret,
	"orders-watcher viewer " + ordersSecret + " streams=orders/*",
}, "\n")

// syncBuffer collects log lines from several goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// harness is a real replica (production interceptors, tokens) on a fresh
// database, and the console on an httptest server in front of it.
type harness struct {
	pool   *pgxpool.Pool
	rep    *servertest.Replica
	authn  *auth.Authenticator
	con    *console.Console
	srv    *httptest.Server
	logs   *syncBuffer // everything the replica and the console logged
	tokens string      // the token file's path
	url    string      // the database's
	// pools of harnessOptions.sources, by name
	sourcePools map[string]*pgxpool.Pool
}

type harnessOptions struct {
	noTokens bool
	open     bool
	tls      bool // serve the console over HTTPS
	config   func(*console.Config)
	// sources are further source databases, by name, each a fresh
	// database served by an engine of its own (serve --source).
	sources []string
	server  func(*server.Config) // after the harness's own settings
}

func newHarness(t *testing.T, o harnessOptions) *harness {
	t.Helper()
	url := testdb.New(t)
	h := &harness{pool: testdb.NewPoolURL(t, url), logs: &syncBuffer{}, url: url}
	log := slog.New(slog.NewTextHandler(io.MultiWriter(h.logs, testWriter{t}), &slog.HandlerOptions{Level: slog.LevelDebug}))
	if !o.noTokens {
		h.tokens = filepath.Join(t.TempDir(), "tokens")
		if err := os.WriteFile(h.tokens, []byte(tokenFile), 0o600); err != nil {
			t.Fatal(err)
		}
		var err error
		if h.authn, err = auth.New(auth.Config{File: h.tokens, Logger: log}); err != nil {
			t.Fatal(err)
		}
	}
	sources := map[string]string{}
	for _, name := range o.sources {
		surl := testdb.New(t)
		// The test databases are clones of one template: give each its own
		// lease key, as `outboxd migrate` does.
		if _, err := testdb.NewPoolURL(t, surl).Exec(t.Context(), `UPDATE outbox.lease_key
			SET key = decode(replace(gen_random_uuid()::text || gen_random_uuid()::text, '-', ''), 'hex')`); err != nil {
			t.Fatal(err)
		}
		sources[name] = surl
	}
	h.rep = servertest.Start(t, url, servertest.Options{
		Sources:       sources,
		Authenticator: h.authn,
		Configure: func(c *server.Config) {
			c.Logger = log
			c.MaxFailures = 1 // one nack parks
			if o.server != nil {
				o.server(c)
			}
		},
	})
	h.sourcePools = h.rep.Pools
	conn, err := h.rep.App.DialInProcess()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	cfg := console.Config{
		Conn: conn, Authenticator: h.authn, Open: o.open, Lag: h.rep.App.AdminServer().GetLag, Logger: log,
		SampleInterval: 250 * time.Millisecond, History: 2 * time.Minute, PollInterval: 500 * time.Millisecond,
	}
	if o.config != nil {
		o.config(&cfg)
	}
	if h.con, err = console.New(cfg); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	ran := make(chan struct{})
	go func() { defer close(ran); _ = h.con.Run(ctx) }()
	if o.tls {
		h.srv = httptest.NewTLSServer(h.con.Handler())
	} else {
		h.srv = httptest.NewServer(h.con.Handler())
	}
	t.Cleanup(func() { h.srv.Close(); cancel(); <-ran })
	return h
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSuffix(string(p), "\n"))
	return len(p), nil
}

// as is an AdminService client calling with token.
func (h *harness) as(token string) (outboxv1.AdminServiceClient, func(context.Context) context.Context) {
	with := func(ctx context.Context) context.Context {
		if token == "" {
			return ctx
		}
		return metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+token)
	}
	return h.rep.Admin, with
}

// emit commits n events to one aggregate and returns their ids in order.
func (h *harness) emit(t *testing.T, stream, key string, n int) []string {
	t.Helper()
	return h.emitIn(t, h.pool, stream, key, n)
}

// emitIn is emit into the database of pool.
func (h *harness) emitIn(t *testing.T, pool *pgxpool.Pool, stream, key string, n int) []string {
	t.Helper()
	var ids []string
	for i := range n {
		var id string
		err := pool.QueryRow(t.Context(), `SELECT event_id::text FROM outbox.emit($1, $2, 'OrderPaid', $3::jsonb,
			'{"content-type": "application/json", "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}')`,
			stream, key, `{"order_id": "`+key+`", "line": `+string(rune('0'+i))+`}`).Scan(&id)
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, id)
	}
	return ids
}

// park emits n events to stream/key and delivers the first to a relay
// that nacks it: with MaxFailures 1 the aggregate is parked when Nack
// returns.
func (h *harness) park(t *testing.T, stream, key string, n int) *outboxv1.Event {
	t.Helper()
	return h.parkIn(t, "", stream, key, n)
}

// parkIn is park in source ("" for default): the events go into its
// database, the relay subscribes to "source/stream".
func (h *harness) parkIn(t *testing.T, source, stream, key string, n int) *outboxv1.Event {
	t.Helper()
	pool := h.pool
	if source != "" {
		pool = h.sourcePools[source]
		stream = source + "/" + stream
	}
	h.emitIn(t, pool, strings.TrimPrefix(stream, source+"/"), key, n)
	ctx, cancel := context.WithCancel(metadata.AppendToOutgoingContext(t.Context(), "authorization", "Bearer "+relaySecret))
	defer cancel()
	if h.authn == nil {
		ctx, cancel = context.WithCancel(t.Context())
		defer cancel()
	}
	st, err := h.rep.Relay.Subscribe(ctx, &outboxv1.SubscribeRequest{RelayId: "nacker", Streams: []string{stream}, MaxInFlight: 1})
	if err != nil {
		t.Fatal(err)
	}
	d, err := st.Recv()
	if err != nil {
		t.Fatal(err)
	}
	resp, err := h.rep.Relay.Nack(ctx, &outboxv1.NackRequest{EventId: d.GetEvent().GetEventId(), LeaseToken: d.GetLeaseToken(),
		Error: "sink rejected the message: schema v3 unknown"})
	if err != nil {
		t.Fatal(err)
	}
	if !resp.GetParked() {
		t.Fatalf("nack did not park: %v", resp)
	}
	// The relay goes, and the test waits until its session has ended on
	// the server: a session still running (the server sees the stream end
	// a moment after the relay) has its credit back after the park, and
	// would claim whatever the test makes claimable next (a retry of the
	// parked aggregate) before the test reads its state.
	header, err := st.Header()
	if err != nil || len(header.Get(server.SessionIDHeader)) != 1 {
		t.Fatalf("the relay's stream named no session: %v, %v", header, err)
	}
	cancel()
	ended := regexp.MustCompile(`msg="relay unsubscribed".* session=` + regexp.QuoteMeta(header.Get(server.SessionIDHeader)[0]) + ` `)
	eventually(t, time.Minute, "the relay's session ends on the server", func() bool { return ended.MatchString(h.logs.String()) })
	return d.GetEvent()
}

var csrfField = regexp.MustCompile(`name="csrf" value="([^"]+)"`)

// browser is an HTTP client with a cookie jar that records every URL it
// requested or was redirected to.
type browser struct {
	*http.Client
	base string
	next http.RoundTripper
	mu   sync.Mutex
	urls []string
}

func (h *harness) browser(t *testing.T) *browser {
	jar, err := cookiejar.New(nil)
	if err != nil {
		t.Fatal(err)
	}
	b := &browser{base: h.srv.URL, next: h.srv.Client().Transport}
	b.Client = &http.Client{Jar: jar, Transport: recorder{b}, Timeout: 30 * time.Second}
	return b
}

type recorder struct{ b *browser }

func (r recorder) RoundTrip(req *http.Request) (*http.Response, error) {
	r.b.mu.Lock()
	r.b.urls = append(r.b.urls, req.URL.String())
	r.b.mu.Unlock()
	return r.b.next.RoundTrip(req)
}

// get fetches path and returns the status and body.
func (b *browser) get(t *testing.T, path string) (int, string) {
	t.Helper()
	resp, err := b.Get(b.base + path)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(body)
}

// post submits a form as the console's own page would (same Origin).
func (b *browser) post(t *testing.T, path string, form url.Values, header ...string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, b.base+path, strings.NewReader(form.Encode()))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	req.Header.Set("Origin", b.base)
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := b.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(body)
}

// csrf reads the form token from a page of the console.
func (b *browser) csrf(t *testing.T, path string) string {
	t.Helper()
	_, body := b.get(t, path)
	m := csrfField.FindStringSubmatch(body)
	if m == nil {
		t.Fatalf("no csrf field on %s:\n%s", path, body)
	}
	return m[1]
}

// login logs in with token and fails the test unless it lands on the
// streams page.
func (b *browser) login(t *testing.T, token string) {
	t.Helper()
	code, body := b.post(t, "/login", url.Values{"csrf": {b.csrf(t, "/login")}, "token": {token}})
	if code != http.StatusOK || !strings.Contains(body, `id="streams"`) {
		t.Fatalf("login: %d\n%s", code, body)
	}
}
