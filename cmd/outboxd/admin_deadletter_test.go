package main

import (
	"context"
	"strings"
	"testing"
	"time"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/server"
)

// park takes n deliveries of stream and nacks each with errText; with
// MaxFailures 1 every one parks its aggregate.
func (ts *testServer) park(t *testing.T, stream string, n int, errText string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	sub, err := ts.relay.Subscribe(ctx, &outboxv1.SubscribeRequest{RelayId: "cli-relay", Streams: []string{stream}, MaxInFlight: 1})
	if err != nil {
		t.Fatal(err)
	}
	for range n {
		d, err := sub.Recv()
		if err != nil {
			t.Fatal(err)
		}
		if _, err := ts.relay.Nack(ctx, &outboxv1.NackRequest{EventId: d.GetEvent().GetEventId(), LeaseToken: d.GetLeaseToken(), Error: errText}); err != nil {
			t.Fatal(err)
		}
	}
}

func TestCLIAggregatesAndAttempts(t *testing.T) {
	t.Parallel()
	ts := startServer(t, func(c *server.Config) { c.MaxFailures = 1 })
	ids := ts.emit(t, "billing.invoice", keys("i", 3)...)
	ts.emit(t, "sales", "s1")
	ts.park(t, "billing.invoice", 3, "HTTP 503 from the broker")

	r := ts.cli(t, nil, "aggregates", "--stream", "billing.*", "--state", "parked").want(t, exitOK)
	for _, k := range keys("i", 3) {
		if row := tableRow(t, r.stdout, "billing.invoice"); row[2] != "parked" {
			t.Errorf("row %v", row)
		}
		if !strings.Contains(r.stdout, k) {
			t.Errorf("aggregate %s missing:\n%s", k, r.stdout)
		}
	}
	if strings.Contains(r.stdout, "sales") {
		t.Errorf("filter let another stream through:\n%s", r.stdout)
	}
	list := parseOne(t, ts.cli(t, nil, "aggregates", "--error", "http 503", "--limit", "2", "--json").want(t, exitOK),
		func() *outboxv1.ListAggregatesResponse { return new(outboxv1.ListAggregatesResponse) })
	if len(list.GetAggregates()) != 2 || list.GetNextPageToken() == "" {
		t.Fatalf("--limit 2: %v", list)
	}
	rest := ts.cli(t, nil, "aggregates", "--error", "http 503", "--page-token", list.GetNextPageToken()).want(t, exitOK)
	if !strings.Contains(rest.stdout, "i03") || strings.Contains(rest.stdout, "i01") {
		t.Errorf("second page:\n%s", rest.stdout)
	}
	if r := ts.cli(t, nil, "aggregates", "--stream", "nothing").want(t, exitOK); !strings.Contains(r.stdout, "no aggregates") {
		t.Errorf("empty listing:\n%s", r.stdout)
	}
	ts.cli(t, nil, "aggregates", "--state", "idle").want(t, exitUsage)
	ts.cli(t, nil, "aggregates", "--stream", "Bad").want(t, exitUsage)

	r = ts.cli(t, nil, "attempts", ids[0]).want(t, exitOK)
	if row := tableRow(t, r.stdout, "AT"); row[len(row)-1] != "ERROR" {
		t.Errorf("header %v", row)
	}
	if !strings.Contains(r.stdout, "parked") || !strings.Contains(r.stdout, "HTTP 503 from the broker") || !strings.Contains(r.stdout, "cli-relay") {
		t.Errorf("attempts:\n%s", r.stdout)
	}
	at := parseOne(t, ts.cli(t, nil, "attempts", "billing.invoice", "i02", "--json").want(t, exitOK),
		func() *outboxv1.ListAttemptsResponse { return new(outboxv1.ListAttemptsResponse) })
	if len(at.GetAttempts()) != 1 || at.GetAttempts()[0].GetOutcome() != outboxv1.AttemptOutcome_ATTEMPT_OUTCOME_PARKED {
		t.Errorf("attempts --json: %v", at)
	}
	if r := ts.cli(t, nil, "attempts", "sales", "s1").want(t, exitOK); !strings.Contains(r.stdout, "no failed attempts") {
		t.Errorf("no attempts:\n%s", r.stdout)
	}
	ts.cli(t, nil, "attempts", "not-a-uuid").want(t, exitUsage)
	ts.cli(t, nil, "attempts", "00000000-0000-0000-0000-000000000001").want(t, exitNotFound)
}

func TestCLIBulkRetryAndSkip(t *testing.T) {
	t.Parallel()
	ts := startServer(t, func(c *server.Config) { c.MaxFailures = 1 })
	ts.emit(t, "billing.invoice", keys("i", 4)...)
	ts.emit(t, "billing.refund", keys("r", 2)...)
	ts.park(t, "billing.invoice", 4, "HTTP 503")
	ts.park(t, "billing.refund", 2, "schema mismatch")

	ts.cli(t, nil, "bulk-retry").want(t, exitUsage)
	ts.cli(t, nil, "bulk-skip", "--stream", "*").want(t, exitUsage) // no reason
	ts.cli(t, nil, "bulk-retry", "--stream", "*", "--accept-gap").want(t, exitUsage)

	r := ts.cli(t, nil, "bulk-retry", "--error", "503", "--dry-run").want(t, exitOK)
	if !strings.HasPrefix(r.stdout, "4 aggregates would be retried") || !strings.Contains(r.stdout, "i04") {
		t.Errorf("dry run:\n%s", r.stdout)
	}
	// Older than: nothing was pending an hour ago; all of them before a
	// minute from now (RFC 3339).
	if r := ts.cli(t, nil, "bulk-retry", "--error", "503", "--pending-before", "1h", "--dry-run").want(t, exitOK); !strings.HasPrefix(r.stdout, "0 aggregates would be retried") {
		t.Errorf("dry run older than an hour:\n%s", r.stdout)
	}
	soon := time.Now().Add(time.Minute).UTC().Format(time.RFC3339)
	if r := ts.cli(t, nil, "bulk-skip", "--stream", "billing.*", "--pending-before", soon, "--reason", "x", "--dry-run").want(t, exitOK); !strings.HasPrefix(r.stdout, "6 aggregates would have their next event skipped") {
		t.Errorf("dry run pending before %s:\n%s", soon, r.stdout)
	}
	// Not confirmed: without a terminal and without --yes, or answered no.
	ts.cli(t, nil, "bulk-retry", "--error", "503").want(t, exitNotConfirmed)
	ts.cli(t, tty{strings.NewReader("n\n")}, "bulk-retry", "--error", "503").want(t, exitNotConfirmed)
	if n := ts.count(t, `SELECT count(*) FROM outbox.delivery WHERE state = 'parked'`); n != 6 {
		t.Fatalf("%d parked after refused runs, want 6", n)
	}
	r = ts.cli(t, tty{strings.NewReader("y\n")}, "bulk-retry", "--error", "503", "--reason", "broker back").want(t, exitOK)
	if !strings.Contains(r.stdout, "retried 4 aggregates of 4 matched") {
		t.Errorf("bulk retry:\n%s", r.stdout)
	}
	if n := ts.count(t, `SELECT count(*) FROM outbox.delivery WHERE state = 'ready' AND stream = 'billing.invoice'`); n != 4 {
		t.Fatalf("%d ready after the bulk retry", n)
	}

	res := parseOne(t, ts.cli(t, nil, "bulk-skip", "--stream", "billing.refund", "--reason", "bad schema", "--actor", "dave", "--yes", "--json").want(t, exitOK),
		func() *outboxv1.BulkSkipResponse { return new(outboxv1.BulkSkipResponse) })
	if res.GetSkipped() != 2 || res.GetMatched() != 2 {
		t.Errorf("bulk skip: %v", res)
	}
	if n := ts.count(t, `SELECT count(*) FROM outbox.skipped_event WHERE actor = 'dave'`); n != 2 {
		t.Errorf("%d skips recorded", n)
	}
	if r := ts.cli(t, nil, "bulk-skip", "--stream", "billing.refund", "--reason", "again", "--yes").want(t, exitOK); !strings.HasPrefix(r.stdout, "0 aggregates") {
		t.Errorf("nothing left to skip:\n%s", r.stdout)
	}
}

func TestCLIRepublish(t *testing.T) {
	t.Parallel()
	ts := startServer(t, nil)
	ts.emit(t, "orders", "o1", "o1", "o1")
	published := ts.publish(t, "orders", 3)

	ts.cli(t, nil, "republish", "orders", "o1", "--from-revision", "2").want(t, exitUsage) // no reason
	ts.cli(t, nil, "republish", "orders", "--from-revision", "2", "--reason", "x").want(t, exitUsage)
	ts.cli(t, nil, "republish", "orders", "o1", "--reason", "x").want(t, exitUsage)
	ts.cli(t, nil, "republish", "orders", "nope", "--from-revision", "1", "--reason", "x", "--yes").want(t, exitNotFound)
	ts.cli(t, nil, "republish", "orders", "o1", "--from-revision", "9", "--reason", "x", "--yes").want(t, exitPrecondition)

	r := ts.cli(t, nil, "republish", "orders", "o1", "--from-revision", "2", "--reason", "consumer lost data", "--dry-run").want(t, exitOK)
	if !strings.Contains(r.stdout, "2 events of 1 aggregate would be delivered again") {
		t.Errorf("dry run:\n%s", r.stdout)
	}
	r = ts.cli(t, nil, "republish", "orders", "o1", "--from-revision", "2", "--reason", "consumer lost data", "--yes").want(t, exitOK)
	if !strings.Contains(r.stdout, "2 events of 1 aggregate are delivered again") {
		t.Errorf("republish:\n%s", r.stdout)
	}
	if got := ts.publish(t, "orders", 2); got[0] != published[1] || got[1] != published[2] {
		t.Errorf("redelivered %v, want %v", got, published[1:])
	}
	r = ts.cli(t, nil, "republish", "orders", "--published-since", "1h", "--reason", "replay", "--dry-run").want(t, exitOK)
	if !strings.Contains(r.stdout, "3 events of 1 aggregate would be delivered again") {
		t.Errorf("time range dry run:\n%s", r.stdout)
	}
}

func TestCLILagShowsStalledAndIdle(t *testing.T) {
	t.Parallel()
	ts := startServer(t, nil)
	ts.emit(t, "orders", "o1")
	r := ts.cli(t, nil, "lag").want(t, exitOK)
	header := tableRow(t, r.stdout, "STREAM")
	if strings.Join(header, " ") != "STREAM PENDING AGGREGATES OLDEST HELD READY LEASED BACKOFF PARKED GAP STALLED STRANDED IDLE RELAYS DELIVERED/S" {
		t.Errorf("header %v", header)
	}
	if row := tableRow(t, r.stdout, "TOTAL"); len(row) != 14 || row[10] != "0" || row[12] != "0" {
		t.Errorf("TOTAL row %v", row)
	}
}
