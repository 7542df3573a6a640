package main

// Tests of what an operator sees first: credentials refused, errors
// readable, stream patterns, streams with nothing pending.

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/auth"
	"github.com/outboxd/outboxd/internal/servertest"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/server"
)

// A refused credential says how to give one and exits 7, its own code; a
// token of the wrong role is still permission denied (exit 1). Not
// parallel: it sets $OUTBOXD_TOKEN.
func TestCLIAuthenticationFailure(t *testing.T) {
	t.Setenv(auth.DefaultClientEnvVar, "")
	dir := t.TempDir()
	tokens := filepath.Join(dir, "tokens")
	if err := os.WriteFile(tokens, []byte("ops admin "+auth.HashToken("cli-admin-secret-0123456789")+"\nfeed relay cli-relay-secret-0123456789\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	authn, err := auth.New(auth.Config{File: tokens, Logger: servertest.Logger(t)})
	if err != nil {
		t.Fatal(err)
	}
	rep := servertest.Start(t, testdb.New(t), servertest.Options{Authenticator: authn,
		Configure: func(c *server.Config) {
			c.PollInterval, c.ReconcileInterval = 50*time.Millisecond, 100*time.Millisecond
		}})
	file := func(name, content string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(content+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	wrong, relayTok, admin := file("wrong", "not-a-known-token-0123456789"), file("relay", "cli-relay-secret-0123456789"),
		file("admin", "cli-admin-secret-0123456789")
	lag := func(args ...string) result {
		return runCLI(t, t.Context(), nil, nil, append([]string{"lag", "--server", rep.Addr}, args...)...)
	}

	r := lag().want(t, exitUnauthenticated)
	if !strings.Contains(r.stderr, "missing bearer token") || !strings.Contains(r.stderr, "--token-file") ||
		!strings.Contains(r.stderr, "$OUTBOXD_TOKEN") {
		t.Errorf("no token: the message does not say how to give one:\n%s", r.stderr)
	}
	if r := lag("--token-file", wrong).want(t, exitUnauthenticated); !strings.Contains(r.stderr, "the token from --token-file "+wrong) {
		t.Errorf("unknown token from a file: the message does not say where it came from:\n%s", r.stderr)
	}
	t.Setenv(auth.DefaultClientEnvVar, "not-a-known-token-0123456789")
	if r := lag().want(t, exitUnauthenticated); !strings.Contains(r.stderr, "the token from $OUTBOXD_TOKEN") {
		t.Errorf("unknown token from the environment: the message does not say where it came from:\n%s", r.stderr)
	}
	t.Setenv(auth.DefaultClientEnvVar, "")
	lag("--token-file", relayTok).want(t, exitFailure) // known, but not an operator's
	lag("--token-file", admin).want(t, exitOK)

	// A relay refused at its first Subscribe exits 7 too.
	r = runCLI(t, t.Context(), nil, nil, "relay", "--server", rep.Addr, "--sink", "stdout://", "--token-file", wrong)
	if r.code != exitUnauthenticated {
		t.Errorf("relay with an unknown token: exit %d, want %d:\n%s", r.code, exitUnauthenticated, r.stderr)
	}
	r = runCLI(t, t.Context(), nil, nil, "relay", "--server", rep.Addr, "--sink", "stdout://")
	if r.code != exitUnauthenticated || !strings.Contains(r.stderr, "--token-file") {
		t.Errorf("relay without a token: exit %d, want %d and how to give one:\n%s", r.code, exitUnauthenticated, r.stderr)
	}
}

// Skipping the event that failed clears the aggregate's last error with its
// failures: the error was that event's, and the next one has not failed.
func TestCLISkipClearsTheLastError(t *testing.T) {
	t.Parallel()
	ts := startServer(t, func(c *server.Config) { c.MaxFailures = 1 })
	ids := ts.emit(t, "skips", "k1", "k1")
	ts.park(t, "skips", 1, "HTTP 422: schema v3 unknown")
	if r := ts.cli(t, nil, "aggregate", "skips", "k1").want(t, exitOK); !strings.Contains(r.stdout, "schema v3 unknown") {
		t.Fatalf("parked aggregate shown as:\n%s", r.stdout)
	}
	ts.cli(t, nil, "skip", ids[0], "--reason", "poison").want(t, exitOK)
	r := ts.cli(t, nil, "aggregate", "skips", "k1").want(t, exitOK)
	if row := tableRow(t, r.stdout, "state"); row[1] != "ready" || strings.Contains(r.stdout, "schema v3 unknown") {
		t.Errorf("after skipping the failed event:\n%s", r.stdout)
	}
}

// A broker's answer after a long prefix still shows in the tables, cut
// ones say so, and --wide prints the error whole.
func TestCLIErrorsShowTheBrokersAnswer(t *testing.T) {
	t.Parallel()
	ts := startServer(t, func(c *server.Config) { c.MaxFailures = 1 })
	ts.emit(t, "long", "l1")
	answer := "503 Service Unavailable: the broker's disk is full"
	errText := "amqp sink: publish to exchange \"orders-exchange-with-a-long-name\" routing key \"long.l1.orders.created.v1\": " + answer +
		"; " + strings.Repeat("x", 200) + " the end"
	ts.park(t, "long", 1, errText)
	for _, args := range [][]string{{"aggregates", "--stream", "long"}, {"attempts", "long", "l1"}} {
		r := ts.cli(t, nil, args...).want(t, exitOK)
		if !strings.Contains(r.stdout, answer) || strings.Contains(r.stdout, "the end") || !strings.Contains(r.stderr, "--wide") {
			t.Errorf("%s: want the broker's answer, the error cut, and a note on --wide:\n%s%s", args[0], r.stdout, r.stderr)
		}
		r = ts.cli(t, nil, append(args, "--wide")...).want(t, exitOK)
		if !strings.Contains(r.stdout, errText) || strings.Contains(r.stderr, "--wide") {
			t.Errorf("%s --wide: want the whole error:\n%s%s", args[0], r.stdout, r.stderr)
		}
	}
}

// lag takes the stream patterns the aggregate filter takes, an invalid one
// is refused with the accepted forms, and a stream with nothing pending and
// no recent delivery stays listed with zeros.
func TestCLILagStreamPatternsAndIdleStreams(t *testing.T) {
	t.Parallel()
	ts := startServer(t, nil)
	ts.emit(t, "billing.invoice", "i1", "i2")
	ts.emit(t, "billing.refund", "r1")
	ts.emit(t, "orders", "o1")
	ts.emit(t, "shipped", "s1")
	ts.publish(t, "shipped", 1)
	// The delivery rate covers the last minute: clearing its counts stands
	// for that minute passing.
	ts.count(t, `WITH gone AS (DELETE FROM outbox.delivered_count RETURNING 1) SELECT count(*) FROM gone`)

	streamsOf := func(args ...string) []string {
		t.Helper()
		lag := parseOne(t, ts.cli(t, nil, append([]string{"lag", "--json"}, args...)...).want(t, exitOK),
			func() *outboxv1.GetLagResponse { return new(outboxv1.GetLagResponse) })
		var names []string
		for _, s := range lag.GetStreams() {
			names = append(names, s.GetStream())
		}
		return names
	}
	if got := streamsOf("--stream", "billing.*"); !slices.Equal(got, []string{"billing.invoice", "billing.refund"}) {
		t.Errorf("lag --stream billing.*: streams %v", got)
	}
	if got := streamsOf("--stream", "billing.*", "--stream", "orders"); !slices.Equal(got, []string{"billing.invoice", "billing.refund", "orders"}) {
		t.Errorf("lag --stream billing.* --stream orders: streams %v", got)
	}
	if got := streamsOf("--stream", "nothing.*"); len(got) != 0 {
		t.Errorf("lag --stream nothing.*: streams %v, want none", got)
	}
	if got := streamsOf("--stream", "*"); !slices.Equal(got, []string{"billing.invoice", "billing.refund", "orders", "shipped"}) {
		t.Errorf("lag --stream '*': streams %v", got)
	}
	r := ts.cli(t, nil, "lag").want(t, exitOK)
	if row := tableRow(t, r.stdout, "shipped"); row[1] != "0" {
		t.Errorf("the idle stream: row %v, want 0 pending", row)
	}
	for _, args := range [][]string{{"lag", "--stream", "Billing*"}, {"aggregates", "--stream", "Billing*"}} {
		r := ts.cli(t, nil, args...).want(t, exitUsage)
		if !strings.Contains(r.stderr, `"billing.*"`) || !strings.Contains(r.stderr, `"*" for every stream`) {
			t.Errorf("%s --stream Billing*: the error does not name the accepted forms:\n%s", args[0], r.stderr)
		}
	}
}

// A catch-all relay that leaves some streams to other relays is listed
// with what it really takes, and is no idle relay of a stream it leaves.
func TestCLIRelaysShowExcludedStreams(t *testing.T) {
	t.Parallel()
	ts := startServer(t, nil)
	ts.emit(t, "billing", "b1")
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	sub, err := ts.relay.Subscribe(ctx, &outboxv1.SubscribeRequest{RelayId: "catch-all", ExcludeStreams: []string{"billing", "orders"}, MaxInFlight: 5})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sub.Header(); err != nil {
		t.Fatal(err)
	}
	var list *outboxv1.ListRelaysResponse
	for list.GetRelays() == nil && ctx.Err() == nil { // the session is recorded once the stream is open
		list = parseOne(t, ts.cli(t, nil, "relays", "--json").want(t, exitOK),
			func() *outboxv1.ListRelaysResponse { return new(outboxv1.ListRelaysResponse) })
	}
	if rel := list.GetRelays(); len(rel) != 1 || len(rel[0].GetStreams()) != 0 || !slices.Equal(rel[0].GetExcludeStreams(), []string{"billing", "orders"}) {
		t.Fatalf("relays --json: %v", list)
	}
	if row := tableRow(t, ts.cli(t, nil, "relays").want(t, exitOK).stdout, "catch-all"); !strings.Contains(strings.Join(row, " "), "all but billing,orders") {
		t.Errorf("relays row %v, want its streams as all but billing,orders", row)
	}
	// Both have waited past idle_relay_after; the relay does not take
	// billing, whose aggregate is ready (discovered) first.
	for ts.count(t, `SELECT count(*) FROM outbox.delivery WHERE stream = 'billing' AND state = 'ready'`) != 1 {
		select {
		case <-ctx.Done():
			t.Fatal("billing/b1 never became ready")
		case <-time.After(20 * time.Millisecond):
		}
	}
	ts.count(t, `WITH s AS (UPDATE outbox.settings SET idle_relay_after = '1 millisecond' RETURNING 1) SELECT count(*) FROM s`)
	ts.count(t, `WITH s AS (UPDATE outbox.relay_session SET connected_at = now() - interval '1 hour' RETURNING 1) SELECT count(*) FROM s`)
	if row := tableRow(t, ts.cli(t, nil, "lag", "--stream", "billing").want(t, exitOK).stdout, "billing"); row[12] != "0" {
		t.Errorf("billing counts the catch-all that excludes it as an idle relay: %v", row)
	}
}
