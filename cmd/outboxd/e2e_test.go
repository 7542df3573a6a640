package main_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/outboxd/outboxd/internal/freeport"
	"github.com/outboxd/outboxd/internal/testdb"
)

// binary is the outboxd binary built once for these tests: they run real
// processes, because what they check (concurrent migrators, a server and a
// relay talking over loopback, signals) is about processes.
var binary string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "outboxd-e2e-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	binary = filepath.Join(dir, "outboxd")
	build := exec.Command("go", "build", "-o", binary, ".")
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "build outboxd:", err)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

func natsURL() string { return envOr("NATS_URL", "nats://127.0.0.1:4222") }

// envOr returns the environment variable name, or def when it is unset or
// empty: where the tests find their brokers.
func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

// `outboxd migrate` twice in parallel on an empty database: one applies, the
// other finds the schema up to date.
func TestMigrateTwiceInParallel(t *testing.T) {
	t.Parallel()
	url := testdb.NewEmpty(t)
	var wg sync.WaitGroup
	outs := make([]string, 2)
	errs := make([]error, 2)
	for i := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			out, err := exec.Command(binary, "migrate", "--database-url", url).CombinedOutput()
			outs[i], errs[i] = string(out), err
		}()
	}
	wg.Wait()
	applied, upToDate := 0, 0
	for i := range 2 {
		if errs[i] != nil {
			t.Fatalf("migrate %d: %v\n%s", i, errs[i], outs[i])
		}
		switch {
		case strings.Contains(outs[i], "applied ["):
			applied++
		case strings.Contains(outs[i], "schema is up to date"):
			upToDate++
		}
	}
	if applied != 1 || upToDate != 1 {
		t.Fatalf("want one migrate to apply and one to no-op; got:\n%s\n---\n%s", outs[0], outs[1])
	}
	if out, err := exec.Command(binary, "migrate", "status", "--database-url", url).CombinedOutput(); err != nil || strings.Contains(string(out), "pending") {
		t.Fatalf("migrate status: %v\n%s", err, out)
	}
}

// process is a running outboxd subprocess whose output goes to the test log.
type process struct {
	t    *testing.T
	cmd  *exec.Cmd
	done chan struct{}

	mu     sync.Mutex
	output strings.Builder // every line so far, for hasOutput
}

// hasOutput reports whether the process has printed a line containing s.
func (p *process) hasOutput(s string) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return strings.Contains(p.output.String(), s)
}

func start(t *testing.T, args ...string) *process {
	t.Helper()
	return startEnv(t, nil, args...)
}

// startEnv is start with env (KEY=value) added to the test's environment.
func startEnv(t *testing.T, env []string, args ...string) *process {
	t.Helper()
	cmd := exec.Command(binary, args...)
	if env != nil {
		cmd.Env = append(os.Environ(), env...)
	}
	pr, pw := io.Pipe()
	cmd.Stdout, cmd.Stderr = pw, pw
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	p := &process{t: t, cmd: cmd, done: make(chan struct{})}
	logged := make(chan struct{})
	go func() {
		defer close(logged)
		sc := bufio.NewScanner(pr)
		for sc.Scan() {
			t.Log(args[0], ": ", sc.Text())
			p.mu.Lock()
			p.output.WriteString(sc.Text() + "\n")
			p.mu.Unlock()
		}
	}()
	go func() { _ = cmd.Wait(); pw.Close(); <-logged; close(p.done) }()
	t.Cleanup(func() { p.signal(os.Kill) })
	return p
}

// signal sends sig and waits for the process to exit; it returns the exit
// code (-1 if a signal ended it). A process still running after two minutes
// fails the test (and is killed by the cleanup) instead of hanging the
// suite.
func (p *process) signal(sig os.Signal) int {
	code, _, ok := p.signalWithin(sig, 2*time.Minute)
	if !ok {
		_ = p.cmd.Process.Kill()
		p.t.Fatalf("%s did not exit within 2 minutes of %v", p.cmd.Args, sig)
	}
	return code
}

// signalWithin sends sig and waits up to bound for the process to exit. It
// returns the exit code, how long the exit took, and whether it happened.
func (p *process) signalWithin(sig os.Signal, bound time.Duration) (code int, took time.Duration, exited bool) {
	start := time.Now()
	_ = p.cmd.Process.Signal(sig)
	select {
	case <-p.done:
		return p.cmd.ProcessState.ExitCode(), time.Since(start), true
	case <-time.After(bound):
		return 0, time.Since(start), false
	}
}

func freeAddr(t *testing.T) string {
	t.Helper()
	addr, err := freeport.Addr()
	if err != nil {
		t.Fatal(err)
	}
	return addr
}

// The README's production shape end to end: `outboxd serve` and `outboxd relay
// --sink nats://...` as processes; events emitted in SQL reach JetStream with
// Nats-Msg-Id = event_id, in revision order, and are marked published.
func TestServeAndRelayToNATS(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	addr := freeAddr(t)
	js, streamName, prefix := jetStreamSink(t, "E2E")

	_, err := pool.Exec(ctx, `SELECT outbox.emit('sales_order', 'o-' || a, 'OrderChanged', jsonb_build_object('n', r))
		FROM generate_series(1, 5) r, generate_series(1, 20) a ORDER BY r, a`)
	if err != nil {
		t.Fatal(err)
	}
	start(t, "serve", "--database-url", url, "--listen", addr, "--http-listen", "")
	start(t, "relay", "--server", addr, "--max-in-flight", "8",
		"--sink", fmt.Sprintf("%s?stream=%s&subject=%s.{stream}.{aggregate_key}", natsURL(), streamName, prefix))

	waitPublished(t, pool, 100)
	s, err := js.Stream(ctx, streamName)
	if err != nil {
		t.Fatal(err)
	}
	cons, err := s.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	last := map[string]int{}
	batch, err := cons.Fetch(100, jetstream.FetchMaxWait(10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for msg := range batch.Messages() {
		n++
		h := msg.Headers()
		var rev int
		fmt.Sscan(h.Get("Outbox-Revision"), &rev)
		key := h.Get("Outbox-Aggregate-Key")
		if rev != last[key]+1 {
			t.Errorf("%s: revision %d after %d", key, rev, last[key])
		}
		last[key] = rev
		if h.Get("Nats-Msg-Id") != h.Get("Outbox-Event-Id") || h.Get("Nats-Msg-Id") == "" {
			t.Errorf("Nats-Msg-Id %q, event id %q", h.Get("Nats-Msg-Id"), h.Get("Outbox-Event-Id"))
		}
		if want := prefix + ".sales_order." + key; msg.Subject() != want {
			t.Errorf("subject %s, want %s", msg.Subject(), want)
		}
	}
	if n != 100 {
		t.Fatalf("JetStream holds %d messages, want 100", n)
	}
}

// jetStreamSink connects to NATS and names a JetStream stream (and a
// lowercase subject prefix) unique to this test; the relay creates the
// stream, and it is deleted when the test ends.
func jetStreamSink(t *testing.T, kind string) (js jetstream.JetStream, streamName, prefix string) {
	t.Helper()
	streamName = fmt.Sprintf("%s_%d", kind, time.Now().UnixNano())
	nc, err := nats.Connect(natsURL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err = jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = js.DeleteStream(context.Background(), streamName) })
	return js, streamName, strings.ToLower(streamName)
}

// waitPublished waits (bounded) until n events are published.
// pendingStates describes where the pending events stand, for a failure
// message: per delivery state, how many aggregates and an example.
func pendingStates(pool *pgxpool.Pool) string {
	rows, err := pool.Query(context.Background(), `
		SELECT coalesce(d.state, 'no delivery row'), count(DISTINCT (e.stream, e.aggregate_key)),
		       min(format('%s/%s r%s cursor %s through %s holder %s expires %s discovered %s', e.stream, e.aggregate_key,
		           e.revision, d.delivered_revision, d.leased_through, d.holder, d.lease_expires_at,
		           pg_visible_in_snapshot(e.xid, (SELECT snapshot FROM outbox.discovery))))
		FROM outbox.event e
		LEFT JOIN outbox.delivery d ON d.stream = e.stream AND d.aggregate_key = e.aggregate_key
		WHERE e.published_at IS NULL GROUP BY 1`)
	if err != nil {
		return err.Error()
	}
	defer rows.Close()
	var out []string
	for rows.Next() {
		var state, example string
		var n int64
		if err := rows.Scan(&state, &n, &example); err != nil {
			return err.Error()
		}
		out = append(out, fmt.Sprintf("%s: %d aggregates (e.g. %s)", state, n, example))
	}
	if len(out) == 0 {
		return "none pending: the missing events do not exist (never committed, or their commits were lost)"
	}
	return strings.Join(out, "; ")
}

func waitPublished(t *testing.T, pool *pgxpool.Pool, n int64) {
	t.Helper()
	deadline := time.Now().Add(2 * time.Minute)
	for {
		// A failing query is retried: the database may be down on purpose.
		var got int64
		err := pool.QueryRow(context.Background(), `SELECT count(*) FROM outbox.event WHERE published_at IS NOT NULL`).Scan(&got)
		if err == nil && got >= n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d events published (last error: %v); pending by delivery state: %s", got, n, err, pendingStates(pool))
		}
		time.Sleep(50 * time.Millisecond)
	}
}
