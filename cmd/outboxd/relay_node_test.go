package main_test

import (
	"bufio"
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxd/outboxd/internal/testdb"
)

// These tests run examples/relay-node, the JavaScript relay, against a real
// `outboxd serve`: the relay protocol works from another language's gRPC.

// nodeExampleDir is examples/relay-node, relative to this package.
var nodeExampleDir = filepath.Join("..", "..", "examples", "relay-node")

var (
	npmOnce sync.Once
	npmErr  error
)

// nodeExample returns the example's directory with its dependencies
// installed (`npm ci`, run again only when package-lock.json changed). It
// skips the test when Node.js or npm is missing, except in CI (CI=true),
// where that fails it.
func nodeExample(t *testing.T) string {
	t.Helper()
	for _, tool := range []string{"node", "npm"} {
		if _, err := exec.LookPath(tool); err != nil {
			if os.Getenv("CI") == "true" {
				t.Fatalf("%s is not installed; CI must run the JavaScript relay example", tool)
			}
			t.Skipf("%s is not installed", tool)
		}
	}
	npmOnce.Do(func() { npmErr = npmCI(nodeExampleDir) })
	if npmErr != nil {
		t.Fatal(npmErr)
	}
	return nodeExampleDir
}

// npmCI runs `npm ci` in dir unless node_modules was installed from the
// same package-lock.json (a stamp in node_modules records its hash).
func npmCI(dir string) error {
	lock, err := os.ReadFile(filepath.Join(dir, "package-lock.json"))
	if err != nil {
		return err
	}
	sum := sha256.Sum256(lock)
	want := hex.EncodeToString(sum[:])
	stamp := filepath.Join(dir, "node_modules", ".outboxd-npm-ci")
	if got, err := os.ReadFile(stamp); err == nil && string(got) == want {
		return nil
	}
	cmd := exec.Command("npm", "ci", "--no-audit", "--no-fund")
	cmd.Dir = dir
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("npm ci in %s: %v\n%s", dir, err, out)
	}
	return os.WriteFile(stamp, []byte(want), 0o644)
}

// nodeRelay is a running `node relay.js`; its stdout lines arrive on lines.
type nodeRelay struct {
	cmd   *exec.Cmd
	lines chan string
	done  chan struct{}
}

func startNodeRelay(t *testing.T, dir string, args ...string) *nodeRelay {
	t.Helper()
	cmd := exec.Command("node", append([]string{"relay.js"}, args...)...)
	cmd.Dir = dir
	cmd.Stderr = testLog{t, "relay.js"}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	r := &nodeRelay{cmd: cmd, lines: make(chan string, 1000), done: make(chan struct{})}
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			r.lines <- sc.Text()
		}
		_ = cmd.Wait()
		close(r.done)
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-r.done
	})
	return r
}

// stop sends SIGTERM and returns the exit code; a relay still running a
// minute later fails the test.
func (r *nodeRelay) stop(t *testing.T) int {
	t.Helper()
	_ = r.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-r.done:
		return r.cmd.ProcessState.ExitCode()
	case <-time.After(time.Minute):
		t.Fatal("relay.js did not exit within a minute of SIGTERM")
		return -1
	}
}

type testLog struct {
	t      *testing.T
	prefix string
}

func (l testLog) Write(p []byte) (int, error) {
	for line := range bytes.Lines(p) {
		l.t.Log(l.prefix+": ", string(bytes.TrimRight(line, "\n")))
	}
	return len(p), nil
}

// nodeLine is what relay.js prints, or posts, for one event.
type nodeLine struct {
	EventID         string            `json:"event_id"`
	Stream          string            `json:"stream"`
	AggregateKey    string            `json:"aggregate_key"`
	Revision        int64             `json:"revision"`
	EventType       string            `json:"event_type"`
	Payload         map[string]any    `json:"payload"`
	Headers         map[string]string `json:"headers"`
	Attempt         int               `json:"attempt"`
	Source          string            `json:"source"`
	RepublishAction int64             `json:"republish_action"`
}

// emitRevisions emits revisions from..to of aggregates a-0..a-(n-1) of
// stream, interleaved across aggregates.
func emitRevisions(t *testing.T, pool *pgxpool.Pool, stream string, from, to, n int) {
	t.Helper()
	if _, err := pool.Exec(context.Background(), `SELECT outbox.emit($1, 'a-' || a, 'Changed', jsonb_build_object('r', r), '{"x-tenant": "acme"}')
		FROM generate_series($2::int, $3::int) r, generate_series(0, $4::int - 1) a ORDER BY r, a`, stream, from, to, n); err != nil {
		t.Fatal(err)
	}
}

// checkNodeLines checks that lines hold every event of the database once,
// each aggregate's in revision order, as stored, and that every event is
// marked published.
func checkNodeLines(t *testing.T, pool *pgxpool.Pool, lines []nodeLine) {
	t.Helper()
	waitPublished(t, pool, int64(len(lines)))
	type stored struct {
		key       string
		revision  int64
		published bool
	}
	events := map[string]stored{}
	rows, err := pool.Query(context.Background(), `SELECT event_id::text, aggregate_key, revision, published_at IS NOT NULL FROM outbox.event`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id string
		var s stored
		if err := rows.Scan(&id, &s.key, &s.revision, &s.published); err != nil {
			t.Fatal(err)
		}
		events[id] = s
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if len(lines) != len(events) {
		t.Errorf("%d events published, %d stored", len(lines), len(events))
	}
	last := map[string]int64{}
	for _, l := range lines {
		s, ok := events[l.EventID]
		switch {
		case !ok:
			t.Errorf("published unknown event %s", l.EventID)
		case s.key != l.AggregateKey || s.revision != l.Revision:
			t.Errorf("event %s published as %s r%d, stored as %s r%d", l.EventID, l.AggregateKey, l.Revision, s.key, s.revision)
		case !s.published:
			t.Errorf("event %s published but not marked published", l.EventID)
		}
		if l.Revision != last[l.AggregateKey]+1 {
			t.Errorf("aggregate %s: revision %d after %d", l.AggregateKey, l.Revision, last[l.AggregateKey])
		}
		last[l.AggregateKey] = l.Revision
		if l.Payload["r"] != float64(l.Revision) || l.Headers["x-tenant"] != "acme" || l.EventType != "Changed" {
			t.Errorf("event %s: payload %v, headers %v, type %q", l.EventID, l.Payload, l.Headers, l.EventType)
		}
	}
}

// The JavaScript relay prints every event on stdout, each aggregate in
// revision order, and acks it: events emitted before it starts and while it
// runs are all marked published, and SIGTERM stops it cleanly.
func TestNodeRelayToStdout(t *testing.T) {
	t.Parallel()
	dir := nodeExample(t)
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	addr := freeAddr(t)
	start(t, "serve", "--database-url", url, "--listen", addr, "--http-listen", "")

	const aggregates, revisions = 8, 10
	emitRevisions(t, pool, "sales_order", 1, revisions/2, aggregates)
	relay := startNodeRelay(t, dir, "--server", addr, "--sink", "stdout", "--max-in-flight", "4")
	var lines []nodeLine
	read := func(n int) {
		for len(lines) < n {
			select {
			case s := <-relay.lines:
				var l nodeLine
				if err := json.Unmarshal([]byte(s), &l); err != nil {
					t.Fatalf("relay.js printed %q: %v", s, err)
				}
				lines = append(lines, l)
			case <-relay.done:
				t.Fatalf("relay.js exited after %d of %d events", len(lines), n)
			case <-time.After(time.Minute): // a hang guard
				t.Fatalf("%d of %d events printed after a minute", len(lines), n)
			}
		}
	}
	read(aggregates * revisions / 2)
	emitRevisions(t, pool, "sales_order", revisions/2+1, revisions, aggregates)
	read(aggregates * revisions)
	checkNodeLines(t, pool, lines)
	if code := relay.stop(t); code != 0 {
		t.Errorf("relay.js exited with %d after SIGTERM", code)
	}
}

// Through a webhook that fails each event's first POST, the JavaScript
// relay nacks the failure and publishes the event again: every event
// arrives, each aggregate in order, acked only after a 2xx.
func TestNodeRelayToWebhookNacksFailures(t *testing.T) {
	t.Parallel()
	dir := nodeExample(t)
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	addr := freeAddr(t)
	start(t, "serve", "--database-url", url, "--listen", addr, "--http-listen", "",
		"--backoff-base", "10ms", "--backoff-cap", "50ms")

	secretFile, secrets := webhookSecrets(t, 2)
	var (
		mu       sync.Mutex
		attempts = map[string]int{}
		accepted []nodeLine
	)
	const aggregates, revisions = 4, 5
	all := make(chan struct{})
	hook := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(r.Body)
		var l nodeLine
		if err == nil {
			err = json.Unmarshal(body, &l)
		}
		if err != nil || r.Header.Get("webhook-id") != l.EventID {
			t.Errorf("webhook got %q (webhook-id %q): %v", body, r.Header.Get("webhook-id"), err)
			http.Error(w, "bad request", http.StatusBadRequest)
			return
		}
		if err := checkWebhookSignature(r, body, secrets); err != nil {
			t.Errorf("webhook %s: %v", l.EventID, err)
			http.Error(w, "bad signature", http.StatusUnauthorized)
			return
		}
		mu.Lock()
		defer mu.Unlock()
		attempts[l.EventID]++
		if attempts[l.EventID] == 1 {
			http.Error(w, "try again", http.StatusServiceUnavailable)
			return
		}
		accepted = append(accepted, l)
		if len(accepted) == aggregates*revisions {
			close(all)
		}
	}))
	t.Cleanup(hook.Close)

	emitRevisions(t, pool, "sales_order", 1, revisions, aggregates)
	// With a 2 minute lease, only nacks can bring each event back within
	// the minute this test waits: a failure left to its lease's expiry
	// would hold the aggregate for two.
	relay := startNodeRelay(t, dir, "--server", addr, "--sink", hook.URL, "--secret-file", secretFile, "--lease-ttl", "120")
	select {
	case <-all:
	case <-relay.done:
		t.Fatal("relay.js exited before every event was accepted")
	case <-time.After(time.Minute): // a hang guard
		t.Fatal("not every event accepted within a minute")
	}
	if code := relay.stop(t); code != 0 {
		t.Errorf("relay.js exited with %d after SIGTERM", code)
	}
	mu.Lock()
	defer mu.Unlock()
	checkNodeLines(t, pool, accepted)
	for _, l := range accepted {
		if l.Attempt != 2 || attempts[l.EventID] != 2 {
			t.Errorf("event %s accepted on attempt %d after %d POSTs, want the second of two", l.EventID, l.Attempt, attempts[l.EventID])
		}
	}
}

// webhookSecrets writes n whsec_ secrets to a file, as the Go webhook sink's
// secret_file holds them, and returns the file and the keys.
func webhookSecrets(t *testing.T, n int) (file string, keys [][]byte) {
	t.Helper()
	var text strings.Builder
	for range n {
		k := make([]byte, 32)
		if _, err := rand.Read(k); err != nil {
			t.Fatal(err)
		}
		keys = append(keys, k)
		text.WriteString("whsec_" + base64.StdEncoding.EncodeToString(k) + "\n")
	}
	file = filepath.Join(t.TempDir(), "webhook-secret")
	if err := os.WriteFile(file, []byte(text.String()), 0o600); err != nil {
		t.Fatal(err)
	}
	return file, keys
}

// checkWebhookSignature verifies a request as a Standard Webhooks receiver
// does, and as the Go webhook sink signs: webhook-signature holds "v1,"
// and the base64 HMAC-SHA256 of "id.timestamp.body" under each key, in
// order, space-separated; the timestamp is recent.
func checkWebhookSignature(r *http.Request, body []byte, keys [][]byte) error {
	id, ts := r.Header.Get("webhook-id"), r.Header.Get("webhook-timestamp")
	sec, err := strconv.ParseInt(ts, 10, 64)
	if err != nil || time.Since(time.Unix(sec, 0)).Abs() > 5*time.Minute {
		return fmt.Errorf("webhook-timestamp %q is not a recent Unix time", ts)
	}
	var want []string
	for _, k := range keys {
		m := hmac.New(sha256.New, k)
		m.Write([]byte(id + "." + ts + "."))
		m.Write(body)
		want = append(want, "v1,"+base64.StdEncoding.EncodeToString(m.Sum(nil)))
	}
	if got := r.Header.Get("webhook-signature"); got != strings.Join(want, " ") {
		return fmt.Errorf("webhook-signature %q, want %q", got, strings.Join(want, " "))
	}
	return nil
}

// A webhook that refuses an event with a 4xx other than 408 and 429 (here
// 401) gets it once: the JavaScript relay nacks it as permanent, as the Go
// sink does, and the aggregate parks at once with the status in its
// reason, instead of being retried forever.
func TestNodeRelayParksWebhook4xx(t *testing.T) {
	t.Parallel()
	dir := nodeExample(t)
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	addr := freeAddr(t)
	start(t, "serve", "--database-url", url, "--listen", addr, "--http-listen", "",
		"--backoff-base", "10ms", "--backoff-cap", "50ms")
	secretFile, _ := webhookSecrets(t, 1)
	var posts atomic.Int64
	hook := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		posts.Add(1)
		http.Error(w, "who are you", http.StatusUnauthorized)
	}))
	t.Cleanup(hook.Close)
	emitRevisions(t, pool, "sales_order", 1, 1, 1)
	relay := startNodeRelay(t, dir, "--server", addr, "--sink", hook.URL, "--secret-file", secretFile, "--lease-ttl", "120")
	var state, reason string
	for deadline := time.Now().Add(time.Minute); state != "parked"; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("aggregate %s after a minute of 401s (%d POSTs), want parked", state, posts.Load())
		}
		if err := pool.QueryRow(t.Context(), `SELECT coalesce((SELECT state FROM outbox.delivery LIMIT 1), 'undiscovered'),
			coalesce((SELECT error FROM outbox.attempt ORDER BY attempt_id DESC LIMIT 1), '')`).Scan(&state, &reason); err != nil {
			t.Fatal(err)
		}
	}
	if n := posts.Load(); n != 1 {
		t.Errorf("%d POSTs of the refused event, want 1", n)
	}
	if !strings.Contains(reason, "401") {
		t.Errorf("parked with %q, want the 401 in the reason", reason)
	}
	if code := relay.stop(t); code != 0 {
		t.Errorf("relay.js exited with %d after SIGTERM", code)
	}
}

// The JavaScript relay prints what outboxd's own stdout sink prints of an
// event of another source and of a republished copy: source only when it
// is not default, republish_action only on the copy an operator's
// republish made (the action's id).
func TestNodeRelayNamesTheSourceAndTheRepublish(t *testing.T) {
	t.Parallel()
	dir := nodeExample(t)
	def, a := testdb.New(t), testdb.New(t)
	addr := freeAddr(t)
	start(t, "serve", "--database-url", def, "--source", "a="+a, "--listen", addr, "--http-listen", "")
	emitTo := func(url string) string {
		t.Helper()
		var id string
		if err := testdb.NewPoolURL(t, url).QueryRow(t.Context(),
			`SELECT event_id::text FROM outbox.emit('payments', 'k', 'T', '{}')`).Scan(&id); err != nil {
			t.Fatal(err)
		}
		return id
	}
	defID, aID := emitTo(def), emitTo(a)
	// A Subscribe stream serves one source: one relay each, default's to
	// stdout, a's to a webhook, whose webhook-id names the source too.
	relayDef := startNodeRelay(t, dir, "--server", addr, "--sink", "stdout", "--streams", "payments")
	select {
	case s := <-relayDef.lines:
		var l nodeLine
		if err := json.Unmarshal([]byte(s), &l); err != nil {
			t.Fatalf("relay.js printed %q: %v", s, err)
		}
		if l.EventID != defID || l.Source != "" || l.RepublishAction != 0 {
			t.Errorf("default's event printed as %s with source %q, republish_action %d; want %s and neither", l.EventID, l.Source, l.RepublishAction, defID)
		}
	case <-relayDef.done:
		t.Fatal("relay.js exited")
	case <-time.After(time.Minute): // a hang guard
		t.Fatal("no event printed after a minute")
	}

	type posted struct {
		line      nodeLine
		webhookID string
	}
	posts := make(chan posted, 10)
	hook := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var p posted
		if err := json.NewDecoder(r.Body).Decode(&p.line); err != nil {
			t.Errorf("webhook body: %v", err)
		}
		p.webhookID = r.Header.Get("webhook-id")
		posts <- p
	}))
	defer hook.Close()
	secretFile, _ := webhookSecrets(t, 1)
	relayA := startNodeRelay(t, dir, "--server", addr, "--sink", hook.URL, "--secret-file", secretFile, "--streams", "a/payments")
	next := func() posted {
		t.Helper()
		select {
		case p := <-posts:
			return p
		case <-relayA.done:
			t.Fatal("relay.js exited")
		case <-time.After(time.Minute): // a hang guard
			t.Fatal("nothing posted after a minute")
		}
		return posted{}
	}
	if p := next(); p.line.EventID != aID || p.line.Source != "a" || p.line.RepublishAction != 0 || p.webhookID != "a/"+aID {
		t.Errorf("a's event posted as %s with source %q, republish_action %d, webhook-id %q; want %s, a, none, a/%[4]s",
			p.line.EventID, p.line.Source, p.line.RepublishAction, p.webhookID, aID)
	}

	// Posted is not yet acked: the republish needs the event published.
	aPool := testdb.NewPoolURL(t, a)
	eventually(t, "a's event published", func() bool {
		var ok bool
		_ = aPool.QueryRow(t.Context(), `SELECT published_at IS NOT NULL FROM outbox.event WHERE event_id = $1`, aID).Scan(&ok)
		return ok
	})
	out, code := outboxd(t, nil, "republish", "a/payments", "k", "--from-revision", "1", "--reason", "receiver lost it", "--yes",
		"--server", addr)
	if code != 0 {
		t.Fatalf("republish exited %d:\n%s", code, out)
	}
	var action int64
	if err := aPool.QueryRow(t.Context(), `SELECT max(action_id) FROM outbox.republished`).Scan(&action); err != nil {
		t.Fatal(err)
	}
	if p := next(); p.line.EventID != aID || p.line.Source != "a" || p.line.RepublishAction != action || action == 0 || p.webhookID != "a/"+aID {
		t.Errorf("republished copy posted as %s with source %q, republish_action %d, webhook-id %q; want %s, a, %d, a/%[5]s",
			p.line.EventID, p.line.Source, p.line.RepublishAction, p.webhookID, aID, action)
	}
}
