package relay

import (
	"context"
	"strconv"
	"testing"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/servertest"
)

// The runner hands a Publisher the republish a delivery names
// (Event.RepublishAction), which DedupID adds to the message id; a first
// copy names none.
func TestRunnerPassesTheRepublishOn(t *testing.T) {
	t.Parallel()
	e := newEnv(t, servertest.Options{})
	id := e.emit(t, "orders", "a")
	pub := newPublisher()
	start(t, Config{Conn: e.srv.Conn, Publisher: pub}, hooks{})
	if ev := waitSignal(t, "the first copy's publish", pub.started); ev.ID != id || ev.RepublishAction != 0 || ev.DedupID() != id {
		t.Fatalf("first copy: event %s, republish action %d, dedup id %q", ev.ID, ev.RepublishAction, ev.DedupID())
	}
	e.waitPublished(t, id)

	if _, err := e.srv.Admin.Republish(context.Background(), &outboxv1.RepublishRequest{
		Stream: "orders", AggregateKey: "a", FromRevision: 1, Reason: "consumer lost its data"}); err != nil {
		t.Fatal(err)
	}
	var action int64
	if err := e.pool.QueryRow(context.Background(),
		`SELECT action_id FROM outbox.republished WHERE stream = 'orders' AND aggregate_key = 'a'`).Scan(&action); err != nil {
		t.Fatal(err)
	}
	ev := waitSignal(t, "the republished copy's publish", pub.started)
	if want := id + "/republish/" + strconv.FormatInt(action, 10); ev.ID != id || ev.RepublishAction != action || ev.DedupID() != want {
		t.Fatalf("republished copy: event %s, republish action %d (want %d), dedup id %q (want %q)",
			ev.ID, ev.RepublishAction, action, ev.DedupID(), want)
	}
	e.waitPublished(t, id)
}
