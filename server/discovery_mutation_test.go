package server_test

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/store"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/server"
)

// The discovery loop records a stop in the database as soon as a round
// fails with it (store.DiscoveryStopped), before it pauses: a stop on a
// counter set back must hold once the counter passes the stored snapshot,
// when the ids look plausible again, whether or not a readiness check has
// asked meanwhile (readiness asks the database only once the loop's turn
// says stopped, which the loop stores just before it records). And once
// an operator re-scans, the loop resumes by itself and says so:
// outboxd_discovery_stopped goes back to 0, and an event committed after
// the re-scan is delivered. Kills: the loop taking the round's error for
// the reason without recording it; the loop never leaving its stopped
// state after a round succeeds.
func TestTheDiscoveryLoopRecordsAStopAtOnceAndResumesAfterARescan(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	reg := prometheus.NewPedanticRegistry()
	r := startReplica(t, url, func(c *server.Config) { c.Registerer = reg })
	var failed atomic.Bool
	recorded := make(chan bool, 1)
	r.Server.SetAfterDiscover(func(d store.Discovery, err error) (store.Discovery, error) {
		if errors.Is(err, store.ErrDiscoveryStopped) {
			failed.Store(true)
		}
		return d, err
	})
	// The pause armed after the failed round: the loop has dealt with it.
	r.Server.SetAfterDiscoveryWait(func(time.Duration, time.Duration, time.Time) {
		if !failed.CompareAndSwap(true, false) {
			return
		}
		var rec bool
		err := pool.QueryRow(context.WithoutCancel(ctx), `SELECT stopped_reason IS NOT NULL FROM outbox.discovery`).Scan(&rec)
		if err != nil {
			t.Error(err)
		}
		select {
		case recorded <- rec:
		default:
		}
	})

	var next int64
	if err := pool.QueryRow(ctx, `SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint`).Scan(&next); err != nil {
		t.Fatal(err)
	}
	// The counter set back: the stored snapshot far ahead of it.
	if _, err := pool.Exec(ctx, fmt.Sprintf(`UPDATE outbox.discovery SET snapshot = '%[1]d:%[1]d:'`, next+1_000_000_000)); err != nil {
		t.Fatal(err)
	}
	select {
	case rec := <-recorded:
		if !rec {
			t.Fatal("the loop went on after a round stopped by the counter without recording the stop")
		}
	case <-ctx.Done():
		t.Fatal("no discovery round stopped")
	}
	if got := gatherSum(t, reg, "outboxd_discovery_stopped"); got != 1 {
		t.Fatalf("outboxd_discovery_stopped = %v while stopped, want 1", got)
	}

	if _, err := pool.Exec(ctx, `SELECT * FROM outbox.rescan_discovery()`); err != nil {
		t.Fatal(err)
	}
	deliversANewEvent(t, ctx, r, pool, "after the re-scan")
	waitFor(t, func() int32 { return b2i(gatherSum(t, reg, "outboxd_discovery_stopped") == 0) })
}

// A check that fails (the database refuses the statement) is not a check
// that found nothing: the loop runs the round, which reports the failure
// (outboxd_discovery_errors_total, a warning), rather than back off as if
// all were discovered and store a turn that says discovery runs, which
// would keep the replica ready and the failure silent for as long as it
// lasts. Kills: the loop taking a failed check for "nothing due".
func TestAFailedCheckIsReportedByTheRoundItRuns(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	reg := prometheus.NewPedanticRegistry()
	r := startReplica(t, url, func(c *server.Config) { c.Registerer = reg })
	awaitAnEmptyCheck(t, ctx, r)
	failedCheck := make(chan struct{}, 1)
	r.Server.SetAfterRoundDue(func(_ bool, err error) {
		if err != nil {
			select {
			case failedCheck <- struct{}{}:
			default:
			}
		}
	})
	errorsBefore := gatherSum(t, reg, "outboxd_discovery_errors_total")

	// Every statement on discovery's state fails while its table is gone.
	if _, err := pool.Exec(ctx, `ALTER TABLE outbox.discovery RENAME TO discovery_away`); err != nil {
		t.Fatal(err)
	}
	select {
	case <-failedCheck:
	case <-ctx.Done():
		t.Fatal("no check failed while discovery's table was gone")
	}
	waitFor(t, func() int32 { return b2i(gatherSum(t, reg, "outboxd_discovery_errors_total") > errorsBefore) })
	if _, err := pool.Exec(ctx, `ALTER TABLE outbox.discovery_away RENAME TO discovery`); err != nil {
		t.Fatal(err)
	}
	deliversANewEvent(t, ctx, r, pool, "once discovery's table was back")
}

// As TestARoundWakesOnlyTheGroupsOfTheStreamsItMadeReady, for a filter that
// excludes: a session that takes every stream but orders is not asked to
// claim for an orders aggregate a round made ready. Kills: filterAdmits
// ignoring the excluded streams.
func TestARoundDoesNotWakeAGroupThatExcludesItsStream(t *testing.T) {
	t.Parallel()
	roundWakesOnlyTheOrdersGroup(t, &outboxv1.SubscribeRequest{RelayId: "others", ExcludeStreams: []string{"orders"}, MaxInFlight: 4})
}

// deliversANewEvent subscribes to r, commits an event and checks that it is
// delivered (discovery finds events again, when), and acks it.
func deliversANewEvent(t *testing.T, ctx context.Context, r *replica, pool *pgxpool.Pool, when string) {
	t.Helper()
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 4})
	emit(t, pool, "orders", "new", 1)
	d := recv(t, st)
	if d.GetEvent().GetAggregateKey() != "new" {
		t.Fatalf("got %v, want the event committed %s", d.GetEvent(), when)
	}
	ack(t, r, d)
}
