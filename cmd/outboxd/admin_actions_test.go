package main

import (
	"strings"
	"testing"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/server"
)

// A retry, a skip and a republish of the skipped event, each from the CLI,
// are listed by 'outboxd actions' (table and JSON) and under the
// aggregate's state by 'outboxd aggregate'.
func TestCLIActions(t *testing.T) {
	t.Parallel()
	ts := startServer(t, func(c *server.Config) { c.MaxFailures = 1 })
	ts.cli(t, nil, "actions").want(t, exitOK)
	if r := ts.cli(t, nil, "actions").want(t, exitOK); !strings.Contains(r.stdout, "no operator actions on record") {
		t.Errorf("empty listing:\n%s", r.stdout)
	}

	ts.emit(t, "flaky", "f1")
	ts.park(t, "flaky", 1, "broker says no")
	ts.cli(t, nil, "retry", "flaky", "f1", "--reason", "broker is back", "--actor", "bob").want(t, exitOK)
	ts.publish(t, "flaky", 1)

	r := ts.cli(t, nil, "actions").want(t, exitOK)
	if row := tableRow(t, r.stdout, "1"); len(row) < 9 || row[2] != "retry" || row[3] != "bob" || row[4] != "flaky" ||
		row[5] != "1" || strings.Join(row[7:], " ") != "broker is back" {
		t.Errorf("retry row %q in:\n%s", row, r.stdout)
	}
	r = ts.cli(t, nil, "actions", "--stream", "flaky", "--key", "f1").want(t, exitOK)
	if !strings.Contains(r.stdout, "WHAT IT DID HERE") || !strings.Contains(r.stdout, "retried (was parked)") {
		t.Errorf("the aggregate's actions:\n%s", r.stdout)
	}
	r = ts.cli(t, nil, "aggregate", "flaky", "f1").want(t, exitOK)
	if !strings.Contains(r.stdout, "operator actions (newest first):") || !strings.Contains(r.stdout, "retried (was parked): broker is back") {
		t.Errorf("aggregate with its actions:\n%s", r.stdout)
	}

	// A skip, then the skipped event delivered after all.
	ids := ts.emit(t, "sk", "k1")
	ts.park(t, "sk", 1, "poison")
	ts.cli(t, nil, "skip", ids[0], "--reason", "poison", "--actor", "ann").want(t, exitOK)
	later := ts.emit(t, "sk", "k1")
	ts.publish(t, "sk", 1) // steps over the skipped revision 1
	// Without --include-skipped the skipped revision stays skipped.
	r = ts.cli(t, nil, "republish", "sk", "k1", "--from-revision", "1", "--reason", "receiver fixed", "--dry-run").want(t, exitOK)
	if !strings.Contains(r.stdout, "1 event of 1 aggregate would be delivered again") {
		t.Errorf("republish dry run without --include-skipped:\n%s", r.stdout)
	}
	r = ts.cli(t, nil, "republish", "sk", "k1", "--from-revision", "1", "--include-skipped", "--reason", "receiver fixed", "--yes").want(t, exitOK)
	if !strings.Contains(r.stdout, "2 events of 1 aggregate are delivered again") || !strings.Contains(r.stdout, "1 event of them skipped before") {
		t.Errorf("republish with --include-skipped:\n%s", r.stdout)
	}
	if got := ts.publish(t, "sk", 2); got[0] != ids[0] || got[1] != later[0] {
		t.Errorf("delivered %v, want the skipped %s then %s", got, ids[0], later[0])
	}
	r = ts.cli(t, nil, "aggregate", "sk", "k1").want(t, exitOK)
	for _, want := range []string{"revisions 1-2 delivered again (2 events, 1 of them skipped before): receiver fixed",
		"skipped revision 1 (event " + ids[0] + "): poison"} {
		if !strings.Contains(r.stdout, want) {
			t.Errorf("aggregate sk/k1 lacks %q:\n%s", want, r.stdout)
		}
	}

	all := parseOne(t, ts.cli(t, nil, "actions", "--json").want(t, exitOK),
		func() *outboxv1.ListOperatorActionsResponse { return new(outboxv1.ListOperatorActionsResponse) })
	var kinds []string
	for _, a := range all.GetActions() {
		kinds = append(kinds, a.GetAction())
	}
	if strings.Join(kinds, ",") != "republish,skip,retry" {
		t.Errorf("actions in JSON: %v", kinds)
	}
	one := parseOne(t, ts.cli(t, nil, "actions", "--action", "skip", "--json").want(t, exitOK),
		func() *outboxv1.ListOperatorActionsResponse { return new(outboxv1.ListOperatorActionsResponse) })
	if len(one.GetActions()) != 1 || one.GetActions()[0].GetActor() != "ann" {
		t.Errorf("skips: %v", one)
	}
	r = ts.cli(t, nil, "actions", "--limit", "1").want(t, exitOK)
	if !strings.Contains(r.stdout, "continue with --page-token") {
		t.Errorf("a limited listing gives no way on:\n%s", r.stdout)
	}

	ts.cli(t, nil, "actions", "--key", "f1").want(t, exitUsage)
	ts.cli(t, nil, "actions", "--action", "delete").want(t, exitUsage)
	ts.cli(t, nil, "actions", "--stream", "Bad Stream").want(t, exitUsage)
}
