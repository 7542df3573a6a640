package main

// Tests of the operator commands: each runs rootCommand() in-process, as
// `outboxd <args>` would, against an in-process server on loopback and a
// database of its own, and checks output and exit codes against SQL.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/servertest"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/server"
)

// testServer is an outboxd server on loopback with its own database.
type testServer struct {
	addr  string
	pool  *pgxpool.Pool
	relay outboxv1.RelayServiceClient
}

// startServer runs a server for t on a fresh database; it stops when t ends.
func startServer(t *testing.T, configure func(*server.Config)) *testServer {
	t.Helper()
	r := servertest.Start(t, testdb.New(t), servertest.Options{Configure: func(c *server.Config) {
		c.PollInterval, c.ReconcileInterval = 50*time.Millisecond, 100*time.Millisecond
		if configure != nil {
			configure(c)
		}
	}})
	return &testServer{addr: r.Addr, pool: r.Pool, relay: r.Relay}
}

// result is what one run of the CLI printed and its exit code.
type result struct {
	stdout, stderr string
	code           int
}

// cli runs `outboxd args... --server ts.addr` with stdin in (nil: empty).
func (ts *testServer) cli(t *testing.T, in io.Reader, args ...string) result {
	t.Helper()
	return runCLI(t, context.Background(), in, nil, append(args, "--server", ts.addr)...)
}

// runCLI runs the root command as main does, with stdout going to out
// (nil: a buffer returned in the result).
func runCLI(t *testing.T, ctx context.Context, in io.Reader, out io.Writer, args ...string) result {
	t.Helper()
	if in == nil {
		in = strings.NewReader("")
	}
	var stdout bytes.Buffer
	if out == nil {
		out = &stdout
	}
	// An operator at a terminal has it on stdin and stderr alike.
	_, interactive := in.(tty)
	stderr := &termBuffer{tty: interactive}
	root := rootCommand()
	root.SetArgs(args)
	root.SetIn(in)
	root.SetOut(out)
	root.SetErr(stderr)
	err := root.ExecuteContext(ctx)
	if err != nil {
		fmt.Fprintln(stderr, "outboxd:", err)
	}
	r := result{stdout: stdout.String(), stderr: stderr.String(), code: exitCode(err)}
	t.Logf("outboxd %s: exit %d\n%s%s", strings.Join(args, " "), r.code, r.stdout, r.stderr)
	return r
}

func (r result) want(t *testing.T, code int) result {
	t.Helper()
	if r.code != code {
		t.Fatalf("exit code %d, want %d; stderr:\n%s", r.code, code, r.stderr)
	}
	return r
}

// parse decodes the stdout of a --json run: one document per line.
func parse[M proto.Message](t *testing.T, r result, newM func() M) []M {
	t.Helper()
	var ms []M
	for line := range strings.Lines(r.stdout) {
		m := newM()
		if err := protojson.Unmarshal([]byte(line), m); err != nil {
			t.Fatalf("stdout line %q is not a %T: %v", line, m, err)
		}
		ms = append(ms, m)
	}
	if len(ms) == 0 {
		t.Fatalf("no JSON on stdout")
	}
	return ms
}

func parseOne[M proto.Message](t *testing.T, r result, newM func() M) M {
	t.Helper()
	ms := parse(t, r, newM)
	if len(ms) != 1 {
		t.Fatalf("%d JSON documents on stdout, want 1", len(ms))
	}
	return ms[0]
}

// tty is a stdin that says it is a terminal.
type tty struct{ io.Reader }

func (tty) IsTerminal() bool { return true }

// termBuffer is a stderr that may say it is a terminal.
type termBuffer struct {
	bytes.Buffer
	tty bool
}

func (b *termBuffer) IsTerminal() bool { return b.tty }

// emit commits one event per key, each in its own transaction (so their
// created_at differ), and returns their ids in order.
func (ts *testServer) emit(t *testing.T, stream string, keys ...string) []string {
	t.Helper()
	ids := make([]string, len(keys))
	for i, k := range keys {
		err := ts.pool.QueryRow(context.Background(),
			`SELECT event_id::text FROM outbox.emit($1, $2, 'Changed', jsonb_build_object('i', $3::int))`,
			stream, k, i).Scan(&ids[i])
		if err != nil {
			t.Fatal(err)
		}
	}
	return ids
}

func (ts *testServer) count(t *testing.T, query string, args ...any) int64 {
	t.Helper()
	var n int64
	if err := ts.pool.QueryRow(context.Background(), query, args...).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// publish acts as a relay on stream: it takes n deliveries and acks each, so
// they are marked published through the protocol.
func (ts *testServer) publish(t *testing.T, stream string, n int) []string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	sub, err := ts.relay.Subscribe(ctx, &outboxv1.SubscribeRequest{
		RelayId: "test-publisher", Streams: []string{stream}, MaxInFlight: 100,
	})
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for range n {
		d, err := sub.Recv()
		if err != nil {
			t.Fatalf("delivery %d of %d: %v", len(ids)+1, n, err)
		}
		resp, err := ts.relay.Ack(ctx, &outboxv1.AckRequest{Acks: []*outboxv1.AckItem{{
			EventId: d.GetEvent().GetEventId(), LeaseToken: d.GetLeaseToken(),
		}}})
		if err != nil {
			t.Fatal(err)
		}
		if st := resp.GetResults()[0].GetStatus(); st != outboxv1.AckStatus_ACK_STATUS_PUBLISHED {
			t.Fatalf("ack %s: %v", d.GetEvent().GetEventId(), st)
		}
		ids = append(ids, d.GetEvent().GetEventId())
	}
	return ids
}

func keys(prefix string, n int) []string {
	ks := make([]string, n)
	for i := range ks {
		ks[i] = fmt.Sprintf("%s%02d", prefix, i+1)
	}
	return ks
}

// tableRow returns the fields of the first stdout line starting with first.
func tableRow(t *testing.T, out, first string) []string {
	t.Helper()
	for line := range strings.Lines(out) {
		if f := strings.Fields(line); len(f) > 0 && f[0] == first {
			return f
		}
	}
	t.Fatalf("no row %q in:\n%s", first, out)
	return nil
}

// keyValue returns the value of a key/value listing's line for key (as
// 'outboxd aggregate' prints them), failing the test without one.
func keyValue(t *testing.T, out, key string) string {
	t.Helper()
	for line := range strings.Lines(out) {
		if v, ok := strings.CutPrefix(line, key+" "); ok {
			return strings.TrimSpace(v)
		}
	}
	t.Fatalf("no line %q in:\n%s", key, out)
	return ""
}

func TestCLILag(t *testing.T) {
	t.Parallel()
	ts := startServer(t, nil)
	ts.emit(t, "orders", keys("o", 5)...)
	ts.emit(t, "orders", keys("o", 3)...) // second revisions of o01..o03
	ts.emit(t, "billing", keys("b", 3)...)
	ts.publish(t, "billing", 3)

	pending := ts.count(t, `SELECT count(*) FROM outbox.event WHERE published_at IS NULL`)
	if pending != 8 {
		t.Fatalf("setup: %d pending events, want 8", pending)
	}

	r := ts.cli(t, nil, "lag").want(t, exitOK)
	total := tableRow(t, r.stdout, "TOTAL")
	if total[1] != strconv.FormatInt(pending, 10) {
		t.Errorf("TOTAL pending %s, want %d", total[1], pending)
	}
	if orders := tableRow(t, r.stdout, "orders"); orders[1] != "8" || orders[2] != "5" {
		t.Errorf("orders row %v: want 8 pending events of 5 aggregates", orders)
	}
	if !strings.Contains(r.stdout, "connected relays:") {
		t.Errorf("no relay count in:\n%s", r.stdout)
	}

	lag := parseOne(t, ts.cli(t, nil, "lag", "--json").want(t, exitOK), func() *outboxv1.GetLagResponse { return new(outboxv1.GetLagResponse) })
	if got := lag.GetTotal().GetPendingEvents(); got != pending {
		t.Errorf("--json total.pending_events %d, SQL says %d", got, pending)
	}
	for _, s := range lag.GetStreams() {
		want := ts.count(t, `SELECT count(*) FROM outbox.event WHERE published_at IS NULL AND stream = $1`, s.GetStream())
		if s.GetPendingEvents() != want {
			t.Errorf("stream %s: pending_events %d, SQL says %d", s.GetStream(), s.GetPendingEvents(), want)
		}
	}
	if lag.GetTotal().GetOldestPendingAge() == nil {
		t.Errorf("total.oldest_pending_age unset with events pending")
	}
	// The table says when the stranded events were counted (a server
	// counts them about once a minute; the first count may still run).
	for deadline := time.Now().Add(30 * time.Second); lag.GetStrandedAuditedAt() == nil; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("no stranded count in 30s")
		}
		lag = parseOne(t, ts.cli(t, nil, "lag", "--json").want(t, exitOK), func() *outboxv1.GetLagResponse { return new(outboxv1.GetLagResponse) })
	}
	if out := ts.cli(t, nil, "lag").want(t, exitOK).stdout; !strings.Contains(out, "stranded events counted at "+fmtTime(lag.GetStrandedAuditedAt())) {
		t.Errorf("lag does not say when the stranded events were counted (%v):\n%s", lag.GetStrandedAuditedAt().AsTime(), out)
	}

	only := parseOne(t, ts.cli(t, nil, "lag", "--json", "--stream", "billing").want(t, exitOK), func() *outboxv1.GetLagResponse { return new(outboxv1.GetLagResponse) })
	for _, s := range only.GetStreams() {
		if s.GetStream() != "billing" {
			t.Errorf("--stream billing reported stream %q", s.GetStream())
		}
	}
	if got := only.GetTotal().GetPendingEvents(); got != 0 {
		t.Errorf("--stream billing: total pending %d, want 0", got)
	}
}

func TestCLILagFailIfOlderThan(t *testing.T) {
	t.Parallel()
	ts := startServer(t, nil)
	// An hour-old pending event.
	ts.emit(t, "alerts", "a1")
	testdb.RewriteEvents(t, ts.pool, `UPDATE outbox.event SET created_at = now() - interval '1 hour'`)

	r := ts.cli(t, nil, "lag", "--fail-if-older-than", "30m").want(t, exitLagExceeded)
	tableRow(t, r.stdout, "TOTAL") // the report is still printed
	if !strings.Contains(r.stderr, "--fail-if-older-than 30m") {
		t.Errorf("stderr does not explain exit 5:\n%s", r.stderr)
	}
	r = ts.cli(t, nil, "lag", "--json", "--fail-if-older-than", "30m").want(t, exitLagExceeded)
	parseOne(t, r, func() *outboxv1.GetLagResponse { return new(outboxv1.GetLagResponse) })

	ts.cli(t, nil, "lag", "--fail-if-older-than", "2h").want(t, exitOK)
	ts.cli(t, nil, "lag", "--fail-if-older-than", "1d").want(t, exitOK)
	ts.cli(t, nil, "lag", "--fail-if-older-than", "soon").want(t, exitUsage)
	ts.cli(t, nil, "lag", "--fail-if-older-than", "1h", "--watch").want(t, exitUsage)

	// A mistyped --stream reads as an idle stream with zeros and passes the
	// check: lag warns of a named stream that has never had an event, and
	// only of that one (a drained stream has had events).
	ts.emit(t, "drained", "d1")
	ts.publish(t, "drained", 1)
	r = ts.cli(t, nil, "lag", "--stream", "alertz", "--stream", "drained", "--fail-if-older-than", "2h").want(t, exitOK)
	if !strings.Contains(r.stderr, "stream alertz has never had an event") || strings.Contains(r.stderr, "stream drained has") {
		t.Errorf("lag --stream alertz --stream drained: stderr %q; want a warning of alertz alone", r.stderr)
	}
	named := parseOne(t, ts.cli(t, nil, "lag", "--json", "--stream", "alertz", "--stream", "drained", "--stream", "alerts").want(t, exitOK),
		func() *outboxv1.GetLagResponse { return new(outboxv1.GetLagResponse) })
	for _, s := range named.GetStreams() {
		if want := s.GetStream() == "alertz"; s.GetNeverHadEvents() != want {
			t.Errorf("lag --json: stream %s never_had_events %v, want %v", s.GetStream(), s.GetNeverHadEvents(), want)
		}
	}
}

// frames is a terminal stdout that reports each write.
type frames struct {
	mu     sync.Mutex
	buf    bytes.Buffer
	writes chan struct{}
}

func (f *frames) Write(p []byte) (int, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.buf.Write(p)
	select {
	case f.writes <- struct{}{}:
	default:
	}
	return len(p), nil
}

func (f *frames) IsTerminal() bool { return true }

func (f *frames) String() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.buf.String()
}

func TestCLILagWatch(t *testing.T) {
	t.Parallel()
	ts := startServer(t, nil)
	ts.emit(t, "watched", "w1")
	ctx, cancel := context.WithCancel(context.Background())
	out := &frames{writes: make(chan struct{})}
	done := make(chan result, 1)
	go func() {
		done <- runCLI(t, ctx, nil, out, "lag", "--watch", "--interval", "10ms", "--server", ts.addr)
	}()
	for i := range 3 {
		select {
		case <-out.writes:
		case r := <-done:
			t.Fatalf("--watch ended after %d frames: exit %d\n%s", i, r.code, r.stderr)
		case <-time.After(10 * time.Second):
			t.Fatalf("--watch drew %d frames in 10s", i)
		}
	}
	cancel() // Ctrl-C
	r := <-done
	r.want(t, exitOK)
	s := out.String()
	if n := strings.Count(s, ansiHomeClear); n < 3 {
		t.Errorf("%d redraws (cursor home + clear), want at least 3", n)
	}
	last := s[strings.LastIndex(s, ansiHomeClear):]
	if row := tableRow(t, last, "TOTAL"); row[1] != "1" {
		t.Errorf("last frame TOTAL row %v, want 1 pending", row)
	}
}

func TestCLIAggregate(t *testing.T) {
	t.Parallel()
	ts := startServer(t, nil)
	ids := ts.emit(t, "orders", "o1", "o1")

	r := ts.cli(t, nil, "aggregate", "orders", "o1").want(t, exitOK)
	if row := tableRow(t, r.stdout, "state"); row[1] != "ready" {
		t.Errorf("state row %v, want ready", row)
	}
	// The id skip takes, so that skipping a stuck aggregate's event needs
	// no search.
	if v := keyValue(t, r.stdout, "next pending event"); v != ids[0] {
		t.Errorf("next pending event row %q, want revision 1's id %s", v, ids[0])
	}
	if row := tableRow(t, r.stdout, "pending"); row[2] != "2" {
		t.Errorf("pending events row %v, want 2", row)
	}

	a := parseOne(t, ts.cli(t, nil, "aggregate", "orders", "o1", "--json").want(t, exitOK),
		func() *outboxv1.GetAggregateResponse { return new(outboxv1.GetAggregateResponse) }).GetAggregate()
	if a.GetStream() != "orders" || a.GetAggregateKey() != "o1" || a.GetLastRevision() != 2 || a.GetPendingEvents() != 2 ||
		a.GetState() != outboxv1.AggregateState_AGGREGATE_STATE_READY {
		t.Errorf("aggregate %v", a)
	}

	r = ts.cli(t, nil, "aggregate", "orders", "no-such-key").want(t, exitNotFound)
	if strings.Contains(r.stderr, "rpc error") {
		t.Errorf("gRPC noise in the message:\n%s", r.stderr)
	}
	ts.cli(t, nil, "aggregate", "orders").want(t, exitUsage)
}

func TestCLISkip(t *testing.T) {
	t.Parallel()
	ts := startServer(t, nil)
	ids := ts.emit(t, "orders", "o1", "o1")
	ts.emit(t, "billing", "b1")
	published := ts.publish(t, "billing", 1)[0]

	r := ts.cli(t, nil, "skip", ids[0]).want(t, exitUsage)
	if !strings.Contains(r.stderr, "--reason") {
		t.Errorf("stderr does not ask for --reason:\n%s", r.stderr)
	}
	ts.cli(t, nil, "skip", ids[0], "--reason", "  ").want(t, exitUsage)
	ts.cli(t, nil, "skip", "not-a-uuid", "--reason", "x").want(t, exitUsage)
	// The shape of retry and aggregate: told where the event id is.
	if r := ts.cli(t, nil, "skip", "orders", "o1", "--reason", "x").want(t, exitUsage); !strings.Contains(r.stderr, "outboxd aggregate orders o1") {
		t.Errorf("skip STREAM KEY does not point at 'outboxd aggregate':\n%s", r.stderr)
	}
	if n := ts.count(t, `SELECT count(*) FROM outbox.skipped_event`); n != 0 {
		t.Fatalf("%d events skipped by refused commands", n)
	}

	r = ts.cli(t, nil, "skip", ids[0], "--reason", "poison payload", "--actor", "alice").want(t, exitOK)
	if !strings.Contains(r.stdout, "poison payload") {
		t.Errorf("skip output lacks the reason:\n%s", r.stdout)
	}
	if n := ts.count(t, `SELECT count(*) FROM outbox.skipped_event WHERE event_id = $1 AND reason = 'poison payload'`, ids[0]); n != 1 {
		t.Errorf("skipped_event rows for %s: %d", ids[0], n)
	}

	list := parseOne(t, ts.cli(t, nil, "events", "--state", "skipped", "--json").want(t, exitOK),
		func() *outboxv1.ListEventsResponse { return new(outboxv1.ListEventsResponse) })
	if len(list.GetEvents()) != 1 {
		t.Fatalf("events --state skipped listed %d events, want 1", len(list.GetEvents()))
	}
	e := list.GetEvents()[0]
	if e.GetEvent().GetEventId() != ids[0] || e.GetState() != outboxv1.EventState_EVENT_STATE_SKIPPED ||
		e.GetSkip().GetReason() != "poison payload" || e.GetSkip().GetActor() != "alice" || e.GetSkip().GetSkippedAt() == nil {
		t.Errorf("skipped event listed as %v", e)
	}
	r = ts.cli(t, nil, "events", "--state", "skipped").want(t, exitOK)
	if row := tableRow(t, r.stdout, ids[0]); !strings.Contains(strings.Join(row, " "), "skipped") ||
		!strings.Contains(r.stdout, "poison payload") {
		t.Errorf("events table:\n%s", r.stdout)
	}

	ts.cli(t, nil, "skip", ids[0], "--reason", "again").want(t, exitPrecondition)
	ts.cli(t, nil, "skip", published, "--reason", "too late").want(t, exitPrecondition)
	if n := ts.count(t, `SELECT count(*) FROM outbox.skipped_event`); n != 1 {
		t.Errorf("%d skipped events, want 1", n)
	}
}

func TestCLIEventsPagination(t *testing.T) {
	t.Parallel()
	ts := startServer(t, nil)
	ts.emit(t, "other", "x1", "x2")
	ts.emit(t, "paged", keys("k", 25)...)
	newList := func() *outboxv1.ListEventsResponse { return new(outboxv1.ListEventsResponse) }

	// Three listings of at most 10, the first fetched in pages of 4.
	var seen []*outboxv1.EventInfo
	token := ""
	for i, want := range []int{10, 10, 5} {
		args := []string{"events", "--stream", "paged", "--limit", "10", "--json"}
		if i == 0 {
			args = append(args, "--page-size", "4")
		} else {
			args = append(args, "--page-token", token)
		}
		page := parseOne(t, ts.cli(t, nil, args...).want(t, exitOK), newList)
		if len(page.GetEvents()) != want {
			t.Fatalf("listing %d: %d events, want %d", i+1, len(page.GetEvents()), want)
		}
		seen = append(seen, page.GetEvents()...)
		token = page.GetNextPageToken()
		if (token == "") != (i == 2) {
			t.Fatalf("listing %d: next_page_token %q", i+1, token)
		}
	}
	var got []string
	for i, e := range seen {
		got = append(got, e.GetEvent().GetEventId())
		if e.GetEvent().GetStream() != "paged" {
			t.Errorf("event of stream %q listed", e.GetEvent().GetStream())
		}
		if i > 0 && e.GetEvent().GetCreatedAt().AsTime().After(seen[i-1].GetEvent().GetCreatedAt().AsTime()) {
			t.Errorf("event %d is newer than event %d: not newest first", i, i-1)
		}
	}
	rows, err := ts.pool.Query(context.Background(), `SELECT event_id::text FROM outbox.event WHERE stream = 'paged' ORDER BY created_at DESC`)
	if err != nil {
		t.Fatal(err)
	}
	var want []string
	for rows.Next() {
		var id string
		if err := rows.Scan(&id); err != nil {
			t.Fatal(err)
		}
		want = append(want, id)
	}
	if rows.Err() != nil {
		t.Fatal(rows.Err())
	}
	if !slices.Equal(got, want) {
		t.Errorf("pages listed\n%v\nwant\n%v", got, want)
	}

	r := ts.cli(t, nil, "events", "--stream", "paged", "--limit", "3", "--payload").want(t, exitOK)
	if n := strings.Count(r.stdout, "paged"); n != 3 {
		t.Errorf("--limit 3 table has %d rows:\n%s", n, r.stdout)
	}
	if !strings.Contains(r.stdout, "--page-token ") || !strings.Contains(r.stdout, `{"i":`) {
		t.Errorf("table lacks the next page token or payloads:\n%s", r.stdout)
	}
	r = ts.cli(t, nil, "events", "--limit", "0", "--page-size", "7").want(t, exitOK)
	if n := strings.Count(r.stdout, "Changed"); n != 27 || strings.Contains(r.stdout, "--page-token") {
		t.Errorf("--limit 0 listed %d events, want all 27 and no token:\n%s", n, r.stdout)
	}
	ts.cli(t, nil, "events", "--key", "k01").want(t, exitUsage)
	ts.cli(t, nil, "events", "--state", "lost").want(t, exitUsage)
	ts.cli(t, nil, "events", "--since", "yesterday").want(t, exitUsage)
	list := parseOne(t, ts.cli(t, nil, "events", "--since", "1h", "--until", "2999-01-01T00:00:00Z", "--json", "--limit", "0").want(t, exitOK), newList)
	if len(list.GetEvents()) != 27 {
		t.Errorf("--since 1h listed %d events, want 27", len(list.GetEvents()))
	}
}

func TestCLIPurge(t *testing.T) {
	t.Parallel()
	ts := startServer(t, nil)
	// Four events created three hours ago and published two hours ago, two
	// created and published now, two pending. The events are published by
	// real acks, then moved back in time.
	ts.emit(t, "pur", "p01", "p02", "p03", "p04", "p05", "p06")
	ts.publish(t, "pur", 6)
	ts.emit(t, "pur", keys("q", 2)...)
	testdb.RewriteEvents(t, ts.pool, `UPDATE outbox.event
		SET created_at = now() - interval '3 hours', published_at = now() - interval '2 hours'
		WHERE aggregate_key IN ('p01', 'p02', 'p03', 'p04')`)
	total := func() int64 { return ts.count(t, `SELECT count(*) FROM outbox.event`) }

	ts.cli(t, nil, "purge").want(t, exitUsage)
	ts.cli(t, nil, "purge", "--older-than", "1h", "--before", "1h").want(t, exitUsage)

	// Piped stdin cannot confirm, even with a "y" in it.
	r := ts.cli(t, strings.NewReader("y\n"), "purge", "--older-than", "1h").want(t, exitNotConfirmed)
	if !strings.Contains(r.stderr, "--yes") {
		t.Errorf("refusal does not mention --yes:\n%s", r.stderr)
	}
	if n := total(); n != 8 {
		t.Fatalf("%d events left after an unconfirmed purge, want 8", n)
	}

	r = ts.cli(t, nil, "purge", "--older-than", "1h", "--dry-run").want(t, exitOK)
	if !strings.Contains(r.stdout, "would delete 4 ") {
		t.Errorf("dry run output:\n%s", r.stdout)
	}
	dry := parse(t, ts.cli(t, nil, "purge", "--older-than", "1h", "--dry-run", "--json").want(t, exitOK),
		func() *outboxv1.PurgeResponse { return new(outboxv1.PurgeResponse) })
	if last := dry[len(dry)-1]; !last.GetDone() || last.GetDeleted() != 4 {
		t.Errorf("dry run --json ended with %v", last)
	}
	if n := total(); n != 8 {
		t.Fatalf("%d events left after dry runs, want 8", n)
	}

	// Answering no on a terminal.
	r = ts.cli(t, tty{strings.NewReader("n\n")}, "purge", "--older-than", "1h").want(t, exitNotConfirmed)
	if !strings.Contains(r.stderr, "Delete 4 events published before") || !strings.Contains(r.stderr, "[y/N]") {
		t.Errorf("no confirmation prompt on stderr:\n%s", r.stderr)
	}
	if n := total(); n != 8 {
		t.Fatalf("%d events left after answering no, want 8", n)
	}

	progress := parse(t, ts.cli(t, nil, "purge", "--older-than", "1h", "--yes", "--batch-size", "3", "--json").want(t, exitOK),
		func() *outboxv1.PurgeResponse { return new(outboxv1.PurgeResponse) })
	if last := progress[len(progress)-1]; !last.GetDone() || last.GetDeleted() != 4 || last.GetBatches() < 2 {
		t.Errorf("purge --json ended with %v, want done, 4 deleted in at least 2 batches of 3", last)
	}
	if n := ts.count(t, `SELECT count(*) FROM outbox.event WHERE aggregate_key IN ('p01', 'p02', 'p03', 'p04')`); n != 0 {
		t.Errorf("%d of the old published events left", n)
	}
	if n := total(); n != 4 {
		t.Fatalf("%d events left, want 4 (2 recently published, 2 pending)", n)
	}

	// Answering yes on a terminal, with the progress bar on a terminal
	// stderr; a cut-off in the future still spares pending events.
	r = ts.cli(t, tty{strings.NewReader("y\n")}, "purge", "--before", time.Now().Add(time.Hour).Format(time.RFC3339)).want(t, exitOK)
	if !strings.Contains(r.stdout, "deleted 2 ") {
		t.Errorf("summary line:\n%s", r.stdout)
	}
	if n := ts.count(t, `SELECT count(*) FROM outbox.event WHERE published_at IS NULL`); n != 2 || total() != 2 {
		t.Errorf("%d events left, %d pending; want only the 2 pending", total(), n)
	}
	r = ts.cli(t, nil, "purge", "--older-than", "0s", "--yes").want(t, exitOK)
	if !strings.Contains(r.stdout, "nothing to purge") {
		t.Errorf("purge with nothing to do:\n%s", r.stdout)
	}
}

func TestCLIRetry(t *testing.T) {
	t.Parallel()
	ts := startServer(t, func(c *server.Config) { c.MaxFailures = 1 })
	ts.emit(t, "flaky", "f1")

	// A relay fails once: with MaxFailures 1 the aggregate is parked.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	sub, err := ts.relay.Subscribe(ctx, &outboxv1.SubscribeRequest{RelayId: "r", Streams: []string{"flaky"}, MaxInFlight: 1})
	if err != nil {
		t.Fatal(err)
	}
	d, err := sub.Recv()
	if err != nil {
		t.Fatal(err)
	}
	nack, err := ts.relay.Nack(ctx, &outboxv1.NackRequest{
		EventId: d.GetEvent().GetEventId(), LeaseToken: d.GetLeaseToken(), Error: "broker says no",
	})
	if err != nil {
		t.Fatal(err)
	}
	if !nack.GetParked() {
		t.Fatalf("nack did not park: %v", nack)
	}
	// The session stays open, its one delivery of credit spent on another
	// aggregate, so that it cannot claim f1 once the retry makes it ready.
	// (Ending the stream instead raced the retry: the server can take a
	// moment to see a stream end, and the session claimed f1 meanwhile.)
	other := ts.emit(t, "flaky", "f0")[0]
	if d, err := sub.Recv(); err != nil || d.GetEvent().GetEventId() != other {
		t.Fatalf("the session got %v (err %v), want f0's event %s", d.GetEvent(), err, other)
	}

	r := ts.cli(t, nil, "aggregate", "flaky", "f1").want(t, exitOK)
	if row := tableRow(t, r.stdout, "state"); row[1] != "parked" || !strings.Contains(r.stdout, "broker says no") {
		t.Errorf("parked aggregate shown as:\n%s", r.stdout)
	}
	// No lease lines for an aggregate nobody leases, and one failure is
	// said as such.
	if strings.Contains(r.stdout, "lease") || !strings.Contains(r.stdout, "publish failed once; last error: broker says no") {
		t.Errorf("parked aggregate shown as:\n%s", r.stdout)
	}
	ts.cli(t, nil, "retry", "flaky", "f1", "--accept-gap").want(t, exitUsage)
	ts.cli(t, nil, "retry", "flaky", "nope").want(t, exitNotFound)

	r = ts.cli(t, nil, "retry", "flaky", "f1").want(t, exitOK)
	if !strings.Contains(r.stdout, "flaky/f1 is ready") {
		t.Errorf("retry output:\n%s", r.stdout)
	}
	a := parseOne(t, ts.cli(t, nil, "retry", "flaky", "f1", "--json").want(t, exitOK), // ready stays ready
		func() *outboxv1.RetryAggregateResponse { return new(outboxv1.RetryAggregateResponse) }).GetAggregate()
	if a.GetState() != outboxv1.AggregateState_AGGREGATE_STATE_READY || a.GetFailures() != 0 || a.GetLastError() != "" {
		t.Errorf("after retry: %v", a)
	}
	// The error was the failed attempt's: after the retry the aggregate no
	// longer shows it, and the attempt history keeps it.
	if r := ts.cli(t, nil, "aggregate", "flaky", "f1").want(t, exitOK); strings.Contains(r.stdout, "broker says no") {
		t.Errorf("the retried aggregate still shows the old error:\n%s", r.stdout)
	}
	if r := ts.cli(t, nil, "attempts", "flaky", "f1").want(t, exitOK); !strings.Contains(r.stdout, "broker says no") {
		t.Errorf("the attempt history lost the error:\n%s", r.stdout)
	}
}

func TestCLIRelays(t *testing.T) {
	t.Parallel()
	ts := startServer(t, nil)
	ts.emit(t, "rl", "k1")
	r := ts.cli(t, nil, "relays").want(t, exitOK)
	if !strings.Contains(r.stdout, "no relays") {
		t.Errorf("relays with none connected:\n%s", r.stdout)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	sub, err := ts.relay.Subscribe(ctx, &outboxv1.SubscribeRequest{RelayId: "cli-test-relay", Streams: []string{"rl"}, MaxInFlight: 5})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sub.Recv(); err != nil { // the session exists once it delivers
		t.Fatal(err)
	}
	list := parseOne(t, ts.cli(t, nil, "relays", "--json").want(t, exitOK),
		func() *outboxv1.ListRelaysResponse { return new(outboxv1.ListRelaysResponse) })
	if len(list.GetRelays()) != 1 {
		t.Fatalf("%d relays listed, want 1", len(list.GetRelays()))
	}
	rel := list.GetRelays()[0]
	if rel.GetRelayId() != "cli-test-relay" || !slices.Equal(rel.GetStreams(), []string{"rl"}) ||
		rel.GetMaxInFlight() != 5 || rel.GetInFlight() != 1 || rel.GetSessionId() == "" {
		t.Errorf("relay listed as %v", rel)
	}
	r = ts.cli(t, nil, "relays").want(t, exitOK)
	if row := tableRow(t, r.stdout, "cli-test-relay"); !slices.Contains(row, "1/5") {
		t.Errorf("relays table row %v, want in flight 1/5", row)
	}
	lag := parseOne(t, ts.cli(t, nil, "lag", "--json").want(t, exitOK), func() *outboxv1.GetLagResponse { return new(outboxv1.GetLagResponse) })
	if lag.GetConnectedRelays() != 1 {
		t.Errorf("lag: connected_relays %d, want 1", lag.GetConnectedRelays())
	}
}

func TestCLIServerUnavailable(t *testing.T) {
	t.Parallel()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := lis.Addr().String()
	lis.Close()
	r := runCLI(t, context.Background(), nil, nil, "lag", "--server", addr).want(t, exitFailure)
	if !strings.Contains(r.stderr, addr) || !strings.Contains(r.stderr, "unavailable") {
		t.Errorf("stderr:\n%s", r.stderr)
	}
}

func TestStatusExitCodes(t *testing.T) {
	t.Parallel()
	for c, want := range map[codes.Code]int{
		codes.OK: exitOK, codes.InvalidArgument: exitUsage, codes.NotFound: exitNotFound,
		codes.FailedPrecondition: exitPrecondition, codes.Unavailable: exitFailure,
		codes.Internal: exitFailure, codes.Unimplemented: exitFailure, codes.PermissionDenied: exitFailure,
		codes.Unauthenticated: exitUnauthenticated,
	} {
		if got := statusExitCode(c); got != want {
			t.Errorf("%v: exit %d, want %d", c, got, want)
		}
	}

	st, err := status.New(codes.InvalidArgument, "invalid request: reason: must be 1 to 1024 characters (and 1 more)").
		WithDetails(&errdetails.BadRequest{FieldViolations: []*errdetails.BadRequest_FieldViolation{
			{Field: "reason", Description: "must be 1 to 1024 characters"},
			{Field: "event_id", Description: "is not a UUID"},
		}})
	if err != nil {
		t.Fatal(err)
	}
	c := &adminClient{flags: &adminFlags{clientFlags: clientFlags{server: "x:1"}}}
	got := c.rpcError(context.Background(), "SkipEvent", st.Err())
	if exitCode(got) != exitUsage {
		t.Errorf("exit %d, want %d", exitCode(got), exitUsage)
	}
	want := "invalid request: reason: must be 1 to 1024 characters (and 1 more)\n  event_id: is not a UUID"
	if got.Error() != want {
		t.Errorf("message %q, want %q", got.Error(), want)
	}

	if exitCode(nil) != exitOK || exitCode(errors.New("x")) != exitFailure ||
		exitCode(fmt.Errorf("wrapped: %w", usageError("bad"))) != exitUsage ||
		exitCode(fmt.Errorf("relay: %w", status.Error(codes.InvalidArgument, "max_in_flight"))) != exitUsage ||
		exitCode(fmt.Errorf("relay: %w", status.Error(codes.Unauthenticated, "token"))) != exitUnauthenticated {
		t.Errorf("exitCode does not see through wrapping")
	}
}

func TestParseAndFormatDurations(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]time.Duration{
		"90s": 90 * time.Second, "15m": 15 * time.Minute, "30d": 720 * time.Hour, "7d12h": 180 * time.Hour, "0s": 0,
	} {
		if got, err := parseAge(in); err != nil || got != want {
			t.Errorf("parseAge(%q) = %v, %v; want %v", in, got, err, want)
		}
	}
	for _, in := range []string{"", "soon", "-5m", "d", "1.5d", "3x"} {
		if got, err := parseAge(in); err == nil {
			t.Errorf("parseAge(%q) = %v, want an error", in, got)
		}
	}
	now := time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	if got, err := parseTimeOrAgo("1h", now); err != nil || !got.Equal(now.Add(-time.Hour)) {
		t.Errorf("parseTimeOrAgo(1h) = %v, %v", got, err)
	}
	if got, err := parseTimeOrAgo("2026-01-02T03:04:05+01:00", now); err != nil || !got.Equal(time.Date(2026, 1, 2, 2, 4, 5, 0, time.UTC)) {
		t.Errorf("parseTimeOrAgo(RFC 3339) = %v, %v", got, err)
	}
	for d, want := range map[time.Duration]string{
		0: "0s", 350 * time.Millisecond: "350ms", 4230 * time.Millisecond: "4.2s", 192 * time.Second: "3m12s",
		5*time.Hour + 3*time.Minute + 10*time.Second: "5h03m", 26 * time.Hour: "1d02h",
	} {
		if got := fmtAge(d); got != want {
			t.Errorf("fmtAge(%v) = %q, want %q", d, got, want)
		}
	}
	if got := cell("a\tb\x1b[2J", 0); strings.ContainsAny(got, "\t\x1b") {
		t.Errorf("cell kept control characters: %q", got)
	}
}

// A connection refused for want of TLS, or of a client certificate, names
// the flag to add; a TLS client against a plaintext server, the flags to
// drop. gRPC's own words name neither.
func TestTLSHint(t *testing.T) {
	plain, withTLS := &clientFlags{}, &clientFlags{tlsCA: "ca.pem"}
	for _, c := range []struct {
		f        *clientFlags
		msg, say string
	}{
		{plain, `connection error: desc = "error reading server preface: EOF"`, "connect with --tls"},
		{withTLS, `connection error: desc = "transport: authentication handshake failed: remote error: tls: certificate required"`, "give --tls-cert and --tls-key"},
		{withTLS, `connection error: desc = "transport: authentication handshake failed: tls: first record does not look like a TLS handshake"`, "connect without the --tls flags"},
		{withTLS, `connection error: desc = "error reading server preface: EOF"`, ""},
		{plain, `connection error: desc = "transport: Error while dialing: dial tcp 127.0.0.1:1: connect: connection refused"`, ""},
	} {
		got := tlsHint(c.f, c.msg)
		if (c.say == "") != (got == "") || !strings.Contains(got, c.say) {
			t.Errorf("tlsHint(tls=%v, %q) = %q, want one saying %q", c.f.usesTLS(), c.msg, got, c.say)
		}
	}
}
