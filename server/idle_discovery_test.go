package server_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxd/outboxd/client"
	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/servertest"
	"github.com/outboxd/outboxd/internal/store"
	"github.com/outboxd/outboxd/internal/testdb"
	"github.com/outboxd/outboxd/migrations"
	"github.com/outboxd/outboxd/server"
)

// An idle discovery loop asks whether a round has anything to do before
// running one (store.RoundDue). An event committed while it is idle is
// found by the next check (its transaction began after the stored
// snapshot: at or above its xmax). And the answer is stale as soon as it
// is given: an event that commits after the check's snapshot (here:
// between the check and the loop acting on it) must still be found by the
// next check and round. That event's transaction was running when the
// stored snapshot was taken, so only the snapshot's list of running
// transactions (not its xmax) says the event is new.
func TestAnEventCommittedAfterAnEmptyCheckIsDiscovered(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	// After an empty check: signal idle, or (hold set) hold the loop until
	// release.
	idle := make(chan struct{}, 1)
	var hold atomic.Bool
	held, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	r.Server.SetAfterRoundDue(func(due bool, err error) {
		if err != nil || due {
			return
		}
		if hold.Load() {
			once.Do(func() {
				close(held)
				<-release
			})
			return
		}
		select {
		case idle <- struct{}{}:
		default:
		}
	})
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 4})

	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(context.Background()) }()
	var lateID uuid.UUID
	var lateXid string
	if err := tx.QueryRow(ctx, `SELECT event_id FROM outbox.emit('orders', 'late', 'T', '{}')`).Scan(&lateID); err != nil {
		t.Fatal(err)
	}
	if err := tx.QueryRow(ctx, `SELECT pg_current_xact_id()::text`).Scan(&lateXid); err != nil {
		t.Fatal(err)
	}
	// The loop is idle; then an event commits, and a round (after a check
	// that found it) stores a snapshot taken while the producer's
	// transaction runs.
	for len(idle) > 0 {
		<-idle
	}
	select {
	case <-idle:
	case <-ctx.Done():
		t.Fatal("the idle discovery loop made no check that found nothing")
	}
	first := emit(t, pool, "orders", "first", 1)
	if d := recv(t, st); d.GetEvent().GetEventId() != first[0].String() {
		t.Fatalf("got %v, want the first event", d)
	} else {
		ack(t, r, d)
	}
	var inXip bool
	if err := pool.QueryRow(ctx, `SELECT $1::xid8 = ANY (ARRAY(SELECT pg_snapshot_xip(snapshot)))
		AND $1::xid8 < pg_snapshot_xmax(snapshot) FROM outbox.discovery`, lateXid).Scan(&inXip); err != nil {
		t.Fatal(err)
	}
	if !inXip {
		t.Fatal("the stored snapshot does not list the producer's transaction as running")
	}

	hold.Store(true)
	select {
	case <-held:
	case <-ctx.Done():
		t.Fatal("the idle discovery loop made no check that found nothing")
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	close(release)
	if d := recv(t, st); d.GetEvent().GetEventId() != lateID.String() {
		t.Fatalf("got %v, want the event committed after the check", d)
	}
}

// An idle replica still notices that discovery must stop (here: the
// cluster's transaction counter is behind the stored snapshot, as after a
// counter set back) although no event is new: its check says a round is
// due, and the round reports the stop. The readiness watcher would notice
// too, and record the stop, which makes any check say a round is due; so
// the test holds the discovery row's lock from the moment the stored
// snapshot changes (queued behind that change, as pg_blocking_pids shows),
// and the stop can be recorded only after the loop noticed it itself.
func TestAnIdleReplicaNoticesDiscoveryStopped(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	awaitAnEmptyCheck(t, ctx, r)
	stopped := make(chan struct{}, 1)
	r.Server.SetAfterDiscover(func(d store.Discovery, err error) (store.Discovery, error) {
		if errors.Is(err, store.ErrDiscoveryStopped) {
			select {
			case stopped <- struct{}{}:
			default:
			}
		}
		return d, err
	})

	change, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = change.Rollback(context.Background()) }()
	if _, err := change.Exec(ctx, `UPDATE outbox.discovery SET snapshot = '4000000000:4000000000:'`); err != nil {
		t.Fatal(err)
	}
	var changer int32
	if err := change.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&changer); err != nil {
		t.Fatal(err)
	}
	hold, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = hold.Rollback(context.Background()) }()
	locked := make(chan error, 1)
	go func() {
		_, err := hold.Exec(ctx, `SELECT 1 FROM outbox.discovery FOR UPDATE`)
		locked <- err
	}()
	waitFor(t, func() int32 {
		var queued bool
		_ = pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_stat_activity
			WHERE $1 = ANY (pg_blocking_pids(pid)) AND query LIKE '%FROM outbox.discovery FOR UPDATE%')`, changer).Scan(&queued)
		return b2i(queued)
	})
	if err := change.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-locked; err != nil {
		t.Fatal(err)
	}
	select {
	case <-stopped:
	case <-ctx.Done():
		t.Fatal("the idle replica did not notice that discovery is stopped")
	}
	var recorded bool
	if err := pool.QueryRow(ctx, `SELECT stopped_reason IS NOT NULL FROM outbox.discovery`).Scan(&recorded); err != nil {
		t.Fatal(err)
	}
	if recorded {
		t.Fatal("the stop was recorded before the loop noticed it: the test did not hold the row")
	}
}

// A stop another replica (or a readiness check) recorded is reported by
// an idle replica's discovery loop too, with no new event to find: its
// check says a round is due, and the round fails with the stop.
func TestAnIdleReplicaReportsARecordedStop(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, nil)
	awaitAnEmptyCheck(t, ctx, r)
	stopped := make(chan error, 1)
	r.Server.SetAfterDiscover(func(d store.Discovery, err error) (store.Discovery, error) {
		if errors.Is(err, store.ErrDiscoveryStopped) {
			select {
			case stopped <- err:
			default:
			}
		}
		return d, err
	})
	if _, err := pool.Exec(ctx, `UPDATE outbox.discovery SET stopped_reason = 'recorded by the test', stopped_at = now()`); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-stopped:
		if !strings.Contains(err.Error(), "recorded by the test") {
			t.Fatalf("the round stopped with %v, want the recorded reason", err)
		}
	case <-ctx.Done():
		t.Fatal("the idle replica did not report the recorded stop")
	}
}

// A discovery loop runs a round right after a round that found several
// events (a busy loop never checks first), checks (store.RoundDue) before
// the next round after a round that found one event and after any turn
// that found nothing, and doubles its pause after each turn that found
// nothing up to DiscoveryIdleInterval. The pause after a round that found
// events is DiscoveryInterval, but half the idle interval after a lone
// event in a trickle (the round before that found any was more than the
// idle interval earlier), where checks 1, 2, 4 ms later would almost never
// find the next one. So a source with a trickle of events pays one round
// per event and one or two one-statement checks between them, and the
// check's round trip lands only on an event after a pause or a lone one.
func TestDiscoveryTurnsAfterAnEventAndAfterNothing(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	url := pollingDatabase(t)
	pool := testdb.NewPoolURL(t, url)
	// The second round comes half of it after the first, so the pair is
	// usually close; on a loaded machine it may not be (see below).
	const idle = time.Second
	begun := time.Now() // before the loop's start, which it counts as activity
	r := startReplica(t, url, func(c *server.Config) {
		c.DiscoveryInterval = time.Millisecond
		c.DiscoveryIdleInterval = idle
		// Rounds unpaced, so that each pause is the rule's alone
		// (TestRoundsArePacedByTheirLength has the pacing).
		c.DiscoveryPaceMax = c.DiscoveryInterval
	})
	// The loop's turns in order, as its hooks see them (all run on the
	// loop's goroutine): a round and what it found, a check and its answer,
	// the pause chosen after either.
	type turn struct {
		kind  string // "round", "check", "pause"
		found int64  // a round's events
		due   bool   // a check's answer
		pause time.Duration
	}
	var mu sync.Mutex
	var turns []turn
	// When each turn was, beside it: a round's time is taken as its hook
	// returns, so no later than the loop's clock reading that judges a
	// trickle (and records the round as the last that found events); a
	// pause's is the loop's own reading as it armed the pause, no earlier
	// than that; a check's is its hook's.
	var ats []time.Time
	settled := make(chan struct{}, 16) // a pause of idle after a round that found events (or after the start)
	foundOne := make(chan struct{}, 16)
	seenEvent := true // the start counts: the first batch waits for a quiet loop
	record := func(tn turn, at time.Time) {
		mu.Lock()
		defer mu.Unlock()
		turns = append(turns, tn)
		ats = append(ats, at)
		switch {
		case tn.kind == "round" && tn.found > 0:
			seenEvent = true
			foundOne <- struct{}{}
		case tn.kind == "pause" && tn.pause == idle && seenEvent:
			seenEvent = false
			settled <- struct{}{}
		}
	}
	// The second event is emitted by the hook of the round that found the
	// first, on the loop's goroutine, so it is committed before that round's
	// pause begins: the next round, half an idle interval later, finds it.
	var second uuid.UUID
	var secondErr error
	rounds := 0
	r.Server.SetAfterDiscover(func(d store.Discovery, err error) (store.Discovery, error) {
		if err == nil && d.Events > 0 {
			if rounds++; rounds == 1 {
				var e client.Emitted
				e, secondErr = client.Emit(ctx, pool, client.Event{Stream: "orders", AggregateKey: "a", Type: "Changed", Payload: []byte(`{}`)})
				second = e.ID
			}
		}
		if err == nil {
			record(turn{kind: "round", found: d.Events}, time.Now())
		}
		return d, err
	})
	r.Server.SetAfterRoundDue(func(due bool, err error) {
		if err == nil {
			record(turn{kind: "check", due: due}, time.Now())
		}
	})
	r.Server.SetAfterDiscoveryWait(func(w, _ time.Duration, at time.Time) { record(turn{kind: "pause", pause: w}, at) })
	wait := func(c chan struct{}, what string) {
		t.Helper()
		select {
		case <-c:
		case <-ctx.Done():
			t.Fatalf("%s never came", what)
		}
	}
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 4})
	deliver := func(ids []uuid.UUID) {
		t.Helper()
		for _, id := range ids {
			d := recv(t, st)
			if d.GetEvent().GetEventId() != id.String() {
				t.Fatalf("got %v, want %v", d, id)
			}
			ack(t, r, d)
		}
	}
	wait(settled, "a quiet loop")
	// A lone event after a quiet spell (a trickle), and another emitted as
	// soon as its round ran, so found half an idle interval later: usually
	// close together (the rounds' gap is the pause, a check and a round),
	// but a loaded machine can stretch that gap past the idle interval, and
	// the loop then rightly takes the second for a trickle too: its pause
	// is judged below from the gap the loop saw (0 here). Then, once the
	// loop is quiet again, two events in one transaction (one round finds
	// them both), and a lone one again.
	want := []time.Duration{idle / 2, 0, time.Millisecond, idle / 2}
	first := emit(t, pool, "orders", "a", 1)
	wait(foundOne, "the round that found the first event")
	if secondErr != nil {
		t.Fatal(secondErr)
	}
	deliver(append(first, second))
	wait(foundOne, "the round that found the second event")
	wait(settled, "a quiet loop after the second event")
	for _, n := range []int{2, 1} {
		deliver(emit(t, pool, "orders", "a", n))
		wait(foundOne, "a round that found events")
		wait(settled, "a quiet loop")
	}

	mu.Lock()
	defer mu.Unlock()
	found, checks := 0, 0
	// When the loop last saw events (or started), as bounds on its reading:
	// a round that found one event is a trickle if it came more than idle
	// after that. The first bound is the earliest the loop can have
	// started, the second the first turn the hooks saw.
	lastLo, lastHi := begun, time.Time{}
	if len(turns) > 0 {
		lastHi = ats[0]
	}
	for i, tn := range turns {
		if tn.kind == "pause" {
			continue
		}
		// The next turn that is not a pause, and the pause between.
		var pause time.Duration
		j := i + 1
		for ; j < len(turns) && turns[j].kind == "pause"; j++ {
			pause = turns[j].pause
		}
		if tn.kind == "check" && !tn.due {
			checks++
		}
		if j == len(turns) {
			break
		}
		next := turns[j]
		switch {
		case tn.kind == "round" && tn.found > 0:
			if want := map[bool]string{true: "check", false: "round"}[tn.found == 1]; next.kind != want {
				t.Fatalf("turn %d: a round found %d events and the next turn was a %s, want a %s (turns %v)", i, tn.found, next.kind, want, turns)
			}
			// The loop reads its clock for this round between the round's
			// hook and the pause it arms next (turns[i+1]), so the gap it
			// saw since the last round that found events lies in
			// [gapLo, gapHi].
			gapLo, gapHi := ats[i].Sub(lastHi), ats[i+1].Sub(lastLo)
			lastLo, lastHi = ats[i], ats[i+1]
			trickle := tn.found == 1 && gapLo > idle // surely one
			maybe := tn.found == 1 && gapHi > idle   // possibly one
			if found < len(want) && want[found] == idle/2 && !trickle {
				// A quiet loop's pauses add up to more than idle: the premise
				// of a trickle holds by construction.
				t.Fatalf("turn %d: round %d found %d event(s) %v-%v after the last that found any, want a lone one more than %v after (turns %v)", i, found+1, tn.found, gapLo, gapHi, idle, turns)
			}
			if found < len(want) {
				w := want[found]
				if w == 0 {
					// The close pair: a trickle only if the loop saw the gap
					// exceed the idle interval.
					w = time.Millisecond
					if trickle {
						w = idle / 2
					}
					t.Logf("round %d found %d event(s) %v-%v after the last that found any: it paused %v", found+1, tn.found, gapLo, gapHi, pause)
				}
				// Where the bounds straddle the idle interval (they are
				// microseconds apart) either pause is right.
				if pause != w && !(trickle != maybe && (pause == idle/2 || pause == time.Millisecond)) {
					t.Fatalf("turn %d: after round %d that found events (%d, %v-%v after the last that found any) the loop paused %v, want %v (turns %v)", i, found+1, tn.found, gapLo, gapHi, pause, w, turns)
				}
			}
			found++
		case tn.kind == "check" && tn.due:
			if next.kind != "round" {
				t.Fatalf("turn %d: a check said a round is due and the next turn was a %s (turns %v)", i, next.kind, turns)
			}
		default: // a round or a check that found nothing
			if next.kind != "check" {
				t.Fatalf("turn %d: a %s found nothing and the next turn was a %s, want a check (turns %v)", i, tn.kind, next.kind, turns)
			}
			// The pause doubles from the one before, up to the idle interval.
			prev := time.Duration(0)
			for k := i - 1; k >= 0; k-- {
				if turns[k].kind == "pause" {
					prev = turns[k].pause
					break
				}
			}
			if want := min(2*prev, idle); prev > 0 && pause != want {
				t.Fatalf("turn %d: after a %s that found nothing the loop paused %v after %v, want %v (doubling up to %v)", i, tn.kind, pause, prev, want, idle)
			}
		}
	}
	if found != len(want) {
		t.Fatalf("%d rounds found events, want %d (turns %v)", found, len(want), turns)
	}
	if checks < 2*5 {
		// After the close pair and the burst: checks 2, 4, 8, 16 and 32 ms
		// apart (and more) before the loop settles at the idle interval.
		// (A pair the loop took for a trickle is followed by one check, but
		// the burst alone is then followed by nine: 2 to 512 ms apart.)
		t.Fatalf("%d checks found nothing, want %d at least", checks, 2*5)
	}
}

// A discovery loop whose rounds have found nothing for DiscoveryQuietAfter
// checks every DiscoveryQuietInterval (the budget a replica of many sources
// spreads over them), never before; an event it then finds makes it fast
// again.
func TestAQuietDiscoveryLoopChecksAtTheQuietInterval(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	url := pollingDatabase(t)
	pool := testdb.NewPoolURL(t, url)
	const quietAfter, quietInterval, idle = time.Second, 100 * time.Millisecond, 5 * time.Millisecond
	r := startReplica(t, url, func(c *server.Config) {
		c.DiscoveryIdleInterval = idle
		c.DiscoveryQuietAfter = quietAfter
		c.DiscoveryQuietInterval = quietInterval
	})
	wait := func(what string, seen <-chan struct{}) {
		t.Helper()
		awaitClosed(t, ctx, seen, "the discovery loop never chose "+what)
	}
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 4})
	for i := range 2 {
		// Before the event commits: the round that finds it is later, and
		// the loop is quiet no sooner than quietAfter after that round.
		before := time.Now()
		ids := emit(t, pool, "orders", "a", 1)
		d := recv(t, st)
		if d.GetEvent().GetEventId() != ids[0].String() {
			t.Fatalf("event %d: got %v", i, d)
		}
		ack(t, r, d)
		wait("the quiet interval", pauseChosen(r, func(w time.Duration) bool { return w == quietInterval }))
		if took := time.Since(before); took < quietAfter {
			t.Fatalf("event %d: the loop went quiet %v after the event committed, before DiscoveryQuietAfter (%v)", i, took, quietAfter)
		}
	}
	// Quiet, it still finds the next event, and is fast again after it: no
	// pause longer than the idle interval (half of it after a lone event
	// in a trickle, as this one is).
	fast := pauseChosen(r, func(w time.Duration) bool { return w <= idle })
	ids := emit(t, pool, "orders", "b", 1)
	if d := recv(t, st); d.GetEvent().GetEventId() != ids[0].String() {
		t.Fatalf("after the quiet spell: got %v", d)
	}
	wait("a pause of at most the idle interval after an event", fast)
}

// alignedPause ends a pause on the next point of the grid of its length
// (shifted by the offset): timers that share the length and offset fire
// together, and none waits longer than the length.
func TestAlignedPause(t *testing.T) {
	t.Parallel()
	const d = time.Second
	base := time.Date(2026, 12, 3, 14, 0, 0, 0, time.UTC)
	for _, tc := range []struct {
		after, offset, want time.Duration
	}{
		{0, 0, d}, // on the grid: the next point
		{10 * time.Millisecond, 0, 990 * time.Millisecond}, // just past one (a timer that fired on the grid)
		{500 * time.Millisecond, 0, 500 * time.Millisecond},
		{999 * time.Millisecond, 0, time.Millisecond},
		{0, 250 * time.Millisecond, 250 * time.Millisecond},
		{260 * time.Millisecond, 250 * time.Millisecond, 990 * time.Millisecond},
		{999 * time.Millisecond, 250 * time.Millisecond, 251 * time.Millisecond},
	} {
		if got := server.AlignedPause(base.Add(tc.after), d, tc.offset); got != tc.want {
			t.Errorf("AlignedPause(grid+%v, %v, %v) = %v, want %v", tc.after, d, tc.offset, got, tc.want)
		}
	}
}

// The quiet loops of a replica's sources share the quiet interval, and
// each arms its quiet pauses to end on that interval's grid, so that their
// checks fall due together (one wake-up of the process for all of them);
// pauses that are not quiet are armed as chosen.
func TestQuietPausesEndOnTheGrid(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	url := pollingDatabase(t)
	const quietAfter, quietInterval, idle = 300 * time.Millisecond, 200 * time.Millisecond, 5 * time.Millisecond
	r := startReplica(t, url, func(c *server.Config) {
		c.DiscoveryIdleInterval = idle
		c.DiscoveryQuietAfter = quietAfter
		c.DiscoveryQuietInterval = quietInterval
	})
	type pause struct {
		at            time.Time
		chosen, armed time.Duration
	}
	pauses := make(chan pause, 1024)
	r.Server.SetAfterDiscoveryWait(func(chosen, armed time.Duration, at time.Time) {
		select {
		case pauses <- pause{at, chosen, armed}:
		default:
		}
	})
	quiet := 0
	for quiet < 3 {
		var p pause
		select {
		case p = <-pauses:
		case <-ctx.Done():
			t.Fatal("the loop never made three quiet pauses")
		}
		if p.chosen != quietInterval {
			if p.armed != p.chosen {
				t.Fatalf("a pause of %v that is not quiet was armed as %v", p.chosen, p.armed)
			}
			continue
		}
		quiet++
		if end := p.at.Round(0).Add(p.armed); !end.Truncate(quietInterval).Equal(end) {
			t.Fatalf("a quiet pause of %v armed at %v as %v ends off the grid (at %v)", p.chosen, p.at, p.armed, end)
		}
		if p.armed <= 0 || p.armed > quietInterval {
			t.Fatalf("a quiet pause of %v armed as %v", p.chosen, p.armed)
		}
	}
}

// The periodic loops of an engine (the readiness watch, the session
// refresh) arm their pauses to end on a grid that the same loop of every
// source of a replica shares (one wake-up for all their turns), a whole
// number of quiet intervals apart, at most the loop's interval, and
// shifted off the quiet discovery checks' grid by quarters of a quiet
// interval, a different number for each loop, so that no two of a
// source's loops, nor a loop and the quiet check, meet on its pool.
func TestPeriodicLoopsShareAGridOffTheQuietChecks(t *testing.T) {
	t.Parallel()
	const health, refresh = 250 * time.Millisecond, 330 * time.Millisecond
	type grid struct{ spacing, offset time.Duration }
	for _, tc := range []struct {
		name             string
		quiet            time.Duration
		readiness, renew grid
	}{
		// The most whole number of quiet intervals that is at most the
		// loop's interval; readiness half a quiet interval off the checks,
		// the refresh a quarter.
		{"quiet shorter than the loops", 100 * time.Millisecond, grid{200 * time.Millisecond, 50 * time.Millisecond}, grid{300 * time.Millisecond, 25 * time.Millisecond}},
		// A quiet interval longer than a loop's: that loop keeps its own.
		{"quiet longer than readiness", 300 * time.Millisecond, grid{health, 150 * time.Millisecond}, grid{300 * time.Millisecond, 75 * time.Millisecond}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
			defer cancel()
			r := startReplica(t, testdb.New(t), func(c *server.Config) {
				c.DiscoveryQuietInterval = tc.quiet
				c.SessionRefreshInterval = refresh
			})
			type pause struct {
				loop            string
				interval, armed time.Duration
				at              time.Time
			}
			pauses := make(chan pause, 64)
			r.Server.SetAfterLoopWait(func(loop string, interval, armed time.Duration, at time.Time) {
				select {
				case pauses <- pause{loop, interval, armed, at}:
				default:
				}
			})
			go r.Server.WatchReadiness(ctx, health, func(server.Readiness) {})
			loops := map[string]struct {
				interval time.Duration
				grid
			}{"readiness": {health, tc.readiness}, "refresh": {refresh, tc.renew}}
			last := map[string]time.Time{}
			seen := map[string]int{}
			for seen["readiness"] < 3 || seen["refresh"] < 3 {
				var p pause
				select {
				case p = <-pauses:
				case <-ctx.Done():
					t.Fatalf("the loops paused %v times, want three each", seen)
				}
				want, ok := loops[p.loop]
				if !ok || p.interval != want.interval {
					continue // the replica's own readiness watch, of its health interval
				}
				seen[p.loop]++
				end := p.at.Round(0).Add(p.armed) // the wall clock, as the grid is
				if on := end.Add(-want.offset); !on.Truncate(want.spacing).Equal(on) {
					t.Fatalf("%s: armed at %v for %v, it ends at %v, not %v off the grid of %v", p.loop, p.at, p.armed, end, want.offset, want.spacing)
				}
				if p.armed <= 0 || p.armed > want.spacing {
					t.Fatalf("%s: armed for %v, want (0, %v]", p.loop, p.armed, want.spacing)
				}
				if l := last[p.loop]; !l.IsZero() && end.Sub(l) != want.spacing {
					t.Fatalf("%s: a turn %v after the one before, want %v", p.loop, end.Sub(l), want.spacing)
				}
				last[p.loop] = end
			}
		})
	}
}

// Readiness takes whether discovery is stopped from the discovery loop's
// last turn while that is fresh, so a readiness check of a running
// replica costs the database no statement: not a call of
// outbox.discovery_stopped() every health interval for every source, nor
// a read of the applied migrations within Config.SchemaCheckInterval.
//
// The replica's statements are counted as it sends them (a pgx tracer on
// its pool): its own readiness watch asks both before the loop's first
// turn, once or (when its grid's first tick comes before that turn) twice,
// so only the checks made after the loop has turned are counted against
// it. The database counts the function's calls too (track_functions,
// flushed when the replica's connections end): no more than the replica
// sent, so no statement calls it on the replica's behalf either (the
// round's check does only for a database that moved cluster).
func TestReadinessTakesTheStopFromTheDiscoveryLoop(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	url := pollingDatabase(t) // a loop that turns (checks) at the idle interval
	pool := testdb.NewPoolURL(t, url)
	var dbname string
	if err := pool.QueryRow(ctx, `SELECT current_database()`).Scan(&dbname); err != nil {
		t.Fatal(err)
	}
	admin := testdb.NewPoolURL(t, testdb.ServerURL())
	if _, err := admin.Exec(ctx, `ALTER DATABASE "`+dbname+`" SET track_functions = 'all'`); err != nil {
		t.Fatal(err)
	}
	const askStopped = `SELECT outbox.discovery_stopped()`
	sent := &statementCounter{}
	// With the quiet interval a minute a turn stays fresh for two (twice
	// the quiet interval), beyond any stall of a loaded machine.
	r := servertest.Start(t, url, servertest.Options{
		Configure: func(c *server.Config) {
			c.DiscoveryIdleInterval, c.DiscoveryQuietInterval = 5*time.Millisecond, time.Minute
		},
		ConfigurePool: func(c *pgxpool.Config) { c.ConnConfig.Tracer = sent },
	})
	// A few turns of the loop first (checks, once it has backed off).
	var turns atomic.Int64
	r.Server.SetAfterRoundDue(func(bool, error) { turns.Add(1) })
	waitFor(t, func() int32 { return b2i(turns.Load() >= 3) })
	stoppedBefore, migrationsBefore := sent.count(askStopped), sent.count(migrations.AppliedVersionsSQL)
	const checks = 20
	for range checks {
		if rd := r.Server.CheckReadiness(ctx); !rd.Ready {
			t.Fatalf("not ready: %s", rd.Reason)
		}
	}
	if n := sent.count(askStopped) - stoppedBefore; n != 0 {
		t.Fatalf("%d readiness checks of a replica whose discovery loop turns called outbox.discovery_stopped() %d times; want none", checks, n)
	}
	if n := sent.count(migrations.AppliedVersionsSQL) - migrationsBefore; n != 0 {
		t.Fatalf("%d readiness checks within the schema check interval read the applied migrations %d times; want none", checks, n)
	}
	// Backends flush their function counts as they end: end them all.
	r.Close()
	pool.Close()
	testdb.TerminateBackends(t, admin, dbname)
	waitFor(t, func() int32 {
		var n int
		if err := admin.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity WHERE datname = $1`, dbname).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return b2i(n == 0)
	})
	r.Pool.Reset() // its connections were terminated; the clean-up uses it
	var calls int64
	if err := testdb.NewPoolURL(t, url).QueryRow(ctx, `SELECT coalesce(sum(calls), 0)::bigint FROM pg_stat_user_functions
		WHERE schemaname = 'outbox' AND funcname = 'discovery_stopped'`).Scan(&calls); err != nil {
		t.Fatal(err)
	}
	if asked := int64(sent.count(askStopped)); calls > asked {
		t.Fatalf("the database ran outbox.discovery_stopped() %d times, the replica asked for it %d times; want no call it did not ask for", calls, asked)
	}
}

// statementCounter is a pgx tracer that counts the statements a pool
// sends, by their text.
type statementCounter struct {
	mu   sync.Mutex
	sent map[string]int
}

func (c *statementCounter) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.sent == nil {
		c.sent = map[string]int{}
	}
	c.sent[data.SQL]++
	return ctx
}

func (*statementCounter) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

func (c *statementCounter) count(sql string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.sent[sql]
}

// Readiness trusts a schema it found current for SchemaCheckInterval, no
// longer: a migration that becomes pending (here: recorded as rolled
// back) makes the replica not ready at the next check after that.
func TestReadinessRereadsTheSchema(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	url := testdb.New(t)
	r := startReplica(t, url, func(c *server.Config) {
		c.DiscoveryIdleInterval = 5 * time.Millisecond
		c.SchemaCheckInterval = 50 * time.Millisecond
	})
	var turns atomic.Int64
	r.Server.SetAfterRoundDue(func(bool, error) { turns.Add(1) })
	waitFor(t, func() int32 { return b2i(turns.Load() >= 3) })
	if rd := r.Server.CheckReadiness(ctx); !rd.Ready {
		t.Fatalf("not ready: %s", rd.Reason)
	}
	if _, err := testdb.NewPoolURL(t, url).Exec(ctx, `INSERT INTO outbox.goose_db_version (version_id, is_applied)
		SELECT max(version_id), false FROM outbox.goose_db_version`); err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() int32 {
		rd := r.Server.CheckReadiness(ctx)
		if !rd.Ready && !strings.Contains(rd.Reason, "migration(s) pending") {
			t.Fatalf("not ready for another reason: %s", rd.Reason)
		}
		return b2i(!rd.Ready)
	})
}

// A database moved to another cluster (restored from a dump, pg_upgrade)
// stops discovery. An empty round does not look at the cluster (it writes
// nothing), so an idle replica's check does: it records the stop, the round
// it asks for fails with it, and readiness says so, with no new event.
func TestAnIdleReplicaNoticesAnotherCluster(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, func(c *server.Config) { c.DiscoveryIdleInterval = 5 * time.Millisecond })
	awaitAnEmptyCheck(t, ctx, r)
	if rd := r.Server.CheckReadiness(ctx); !rd.Ready {
		t.Fatalf("not ready before the move: %s", rd.Reason)
	}
	if _, err := pool.Exec(ctx, `UPDATE outbox.discovery SET system_identifier = 42`); err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() int32 { return b2i(!r.Server.CheckReadiness(ctx).Ready) })
	if rd := r.Server.CheckReadiness(ctx); !strings.Contains(rd.Reason, "another PostgreSQL cluster") {
		t.Fatalf("readiness reason %q, want it to name another cluster", rd.Reason)
	}
	var recorded bool
	if err := pool.QueryRow(ctx, `SELECT stopped_reason IS NOT NULL FROM outbox.discovery`).Scan(&recorded); err != nil || !recorded {
		t.Fatalf("the stop is not recorded (%v)", err)
	}
}

// awaitAnEmptyCheck waits until r's discovery loop has made a check that
// found nothing: it has backed off from its last round.
func awaitAnEmptyCheck(t *testing.T, ctx context.Context, r *replica) {
	t.Helper()
	idle := make(chan struct{}, 1)
	r.Server.SetAfterRoundDue(func(due bool, err error) {
		if err == nil && !due {
			select {
			case idle <- struct{}{}:
			default:
			}
		}
	})
	select {
	case <-idle:
	case <-ctx.Done():
		t.Fatal("the discovery loop never went idle")
	}
}

// A replica says its source is in use (FoundEventsLately, which keeps serve
// from trimming the source's pool) once a discovery round has found events,
// for DiscoveryQuietAfter, and not because it has just started: an idle
// source's pool was kept whole for the first DiscoveryQuietAfter, so the
// connections an overlap of its periodic work opened stayed open.
func TestFoundEventsLatelyOnlyAfterARoundFoundEvents(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, func(c *server.Config) { c.DiscoveryQuietAfter = time.Hour })
	// The loop arms its timer after every turn, and after a round that
	// found events only once it has recorded them.
	awaitClosed(t, ctx, pauseChosen(r, func(time.Duration) bool { return true }),
		"the discovery loop never armed its timer after its first turn")
	if r.Server.FoundEventsLately() {
		t.Fatal("FoundEventsLately right after the replica started, with no event in the database: want false")
	}
	var found atomic.Bool
	r.Server.SetAfterDiscover(func(d store.Discovery, err error) (store.Discovery, error) {
		if err == nil && d.Events > 0 {
			found.Store(true)
		}
		return d, err
	})
	armed := pauseChosen(r, func(time.Duration) bool { return found.Load() })
	emit(t, pool, "orders", "a", 1)
	awaitClosed(t, ctx, armed, "the discovery loop never armed its timer after the round that found the event")
	if !r.Server.FoundEventsLately() {
		t.Fatal("FoundEventsLately after a round found an event (DiscoveryQuietAfter an hour): want true")
	}
}

// pauseChosen returns a channel closed once r's discovery loop arms its
// timer with a pause for which want is true (from now on: it replaces the
// loop's AfterDiscoveryWait hook).
func pauseChosen(r *replica, want func(time.Duration) bool) <-chan struct{} {
	seen := make(chan struct{})
	var once sync.Once
	r.Server.SetAfterDiscoveryWait(func(w, _ time.Duration, _ time.Time) {
		if want(w) {
			once.Do(func() { close(seen) })
		}
	})
	return seen
}

// awaitClosed waits for ch, and fails the test with msg if ctx ends first.
func awaitClosed(t *testing.T, ctx context.Context, ch <-chan struct{}, msg string) {
	t.Helper()
	select {
	case <-ch:
	case <-ctx.Done():
		t.Fatal(msg)
	}
}

// After a round that found events the discovery loop pauses as long as the
// round took once it found 32 events or more, and that share of it for
// fewer, from DiscoveryInterval up to DiscoveryPaceMax: under load the next
// round collects what arrived while this one ran (fewer, larger rounds at
// the same fixed cost each), while a light load's small rounds go on
// almost at once. A round as large as DiscoveryMaxEvents (a backlog taken
// in parts) is followed after DiscoveryInterval: the rest is there
// already. The round that finds the events (one transaction's, so one
// round finds them all) is held at its hook for hold, so it takes at least
// that long; the upper bounds leave it seconds more, and still tell the
// rule from its neighbours (the round's length for a small round; ten
// times it for 320 events, were the share not capped at the whole).
func TestRoundsArePacedByTheirLength(t *testing.T) {
	t.Parallel()
	const hold, interval, idle = 300 * time.Millisecond, time.Millisecond, 10 * time.Second
	for _, tc := range []struct {
		name      string
		events    int
		configure func(*server.Config)
		ok        func(pause time.Duration) bool
		want      string
	}{
		{"as long as a full round", 320, func(*server.Config) {},
			func(p time.Duration) bool { return p >= hold && p < 8*hold }, "the round's length"},
		{"a share of a small round", 2, func(*server.Config) {},
			func(p time.Duration) bool { return p >= hold/16 && p < hold/2 }, "2/32 of the round's length"},
		{"at most DiscoveryPaceMax", 64, func(c *server.Config) { c.DiscoveryPaceMax = hold / 3 },
			func(p time.Duration) bool { return p == hold/3 }, "DiscoveryPaceMax"},
		{"not after a round as large as DiscoveryMaxEvents", 64, func(c *server.Config) { c.DiscoveryMaxEvents = 2 },
			func(p time.Duration) bool { return p == interval }, "DiscoveryInterval"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
			defer cancel()
			url := testdb.New(t)
			pool := testdb.NewPoolURL(t, url)
			r := startReplica(t, url, func(c *server.Config) {
				c.DiscoveryInterval, c.DiscoveryIdleInterval = interval, idle
				tc.configure(c)
			})
			var held atomic.Bool
			r.Server.SetAfterDiscover(func(d store.Discovery, err error) (store.Discovery, error) {
				if err == nil && d.Events > 0 && held.CompareAndSwap(false, true) {
					if d.Events != int64(tc.events) {
						t.Errorf("the first round that found events found %d, want the transaction's %d", d.Events, tc.events)
					}
					time.Sleep(hold)
				}
				return d, err
			})
			pauses := make(chan time.Duration, 1)
			var sent atomic.Bool
			r.Server.SetAfterDiscoveryWait(func(chosen, _ time.Duration, _ time.Time) {
				if held.Load() && sent.CompareAndSwap(false, true) {
					pauses <- chosen
				}
			})
			tx, err := pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			for range tc.events {
				if _, err := client.Emit(ctx, tx, client.Event{Stream: "orders", AggregateKey: "a", Type: "Changed", Payload: []byte(`{}`)}); err != nil {
					t.Fatal(err)
				}
			}
			if err := tx.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			select {
			case p := <-pauses:
				if !tc.ok(p) {
					t.Fatalf("after a round of %d events held %v the loop paused %v, want %s", tc.events, hold, p, tc.want)
				}
			case <-ctx.Done():
				t.Fatal("no round found the events")
			}
		})
	}
}

// A round that found 32 events or more pauses as long as it took, no
// longer: the pause is that share of the round's length below 32 events
// and the whole of it from 32 on, so a round of 48 events is not followed
// by a pause of one and a half rounds (under load, where rounds are full,
// that would leave the discovery connection idle half the time for
// nothing). The round is held at its hook for hold, so it takes at least
// that long; it runs right after the check that said it was due (the loop
// was idle), whose hook marks its start, so it took no longer than from
// that mark to the moment the loop armed the pause after it. The bounds
// are the round's own length, not a guess at a loaded machine's speed.
func TestARoundOfMoreThan32EventsPausesAsLongAsItTook(t *testing.T) {
	t.Parallel()
	const hold, events, idle = 600 * time.Millisecond, 48, 3 * time.Second
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	url := pollingDatabase(t)
	pool := testdb.NewPoolURL(t, url)
	// DiscoveryPaceMax is the idle interval (the default): far above the
	// round's length and one and a half of it.
	r := startReplica(t, url, func(c *server.Config) {
		c.DiscoveryInterval, c.DiscoveryIdleInterval = time.Millisecond, idle
	})
	awaitAnEmptyCheck(t, ctx, r)
	// From here every turn is a check until one finds the events due; the
	// round that finds them follows it at once, on the loop's goroutine.
	var dueAt atomic.Pointer[time.Time]
	r.Server.SetAfterRoundDue(func(due bool, err error) {
		if err == nil && due {
			now := time.Now()
			dueAt.Store(&now)
		}
	})
	var held atomic.Bool
	var began time.Time // the round's check, read on the loop's goroutine
	r.Server.SetAfterDiscover(func(d store.Discovery, err error) (store.Discovery, error) {
		if err == nil && d.Events > 0 && held.CompareAndSwap(false, true) {
			if d.Events != events {
				t.Errorf("the round that found events found %d, want the transaction's %d", d.Events, events)
			}
			if at := dueAt.Load(); at != nil {
				began = *at
			}
			time.Sleep(hold)
		}
		return d, err
	})
	type pause struct {
		chosen time.Duration
		at     time.Time
		began  time.Time
	}
	pauses := make(chan pause, 1)
	var sent atomic.Bool
	r.Server.SetAfterDiscoveryWait(func(chosen, _ time.Duration, at time.Time) {
		if held.Load() && sent.CompareAndSwap(false, true) {
			pauses <- pause{chosen, at, began}
		}
	})
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for range events {
		if _, err := client.Emit(ctx, tx, client.Event{Stream: "orders", AggregateKey: "a", Type: "Changed", Payload: []byte(`{}`)}); err != nil {
			t.Fatal(err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case p := <-pauses:
		if p.began.IsZero() {
			t.Fatal("the round that found the events followed no check that said it was due")
		}
		// The round took at least hold, at most until the pause was armed.
		if most := p.at.Sub(p.began); p.chosen < hold || p.chosen > most {
			t.Fatalf("after a round of %d events held %v (and over within %v) the loop paused %v, want the round's length: no more than %v",
				events, hold, most, p.chosen, most)
		}
	case <-ctx.Done():
		t.Fatal("no round found the events")
	}
}

// A failed round is retried after the loop's own back-off (after a stop,
// the idle interval, a second at least), also once the loop is quiet: the
// quiet interval (a replica's budget of checks, spread over its sources)
// paces checks that find nothing, not retries of a round that failed. The
// stop is recorded while the loop is quiet; its next check says a round is
// due (a stop is among the check's conditions), the round fails with the
// stop, and the pause after it is a second, chosen and armed as such, not
// the quiet interval on its grid.
func TestAFailedRoundIsRetriedAfterItsOwnPauseInAQuietLoop(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	const quietInterval = 3 * time.Second
	r := startReplica(t, url, func(c *server.Config) {
		c.DiscoveryIdleInterval = 5 * time.Millisecond
		c.DiscoveryQuietAfter = 100 * time.Millisecond
		c.DiscoveryQuietInterval = quietInterval
	})
	awaitClosed(t, ctx, pauseChosen(r, func(w time.Duration) bool { return w == quietInterval }),
		"the discovery loop never chose the quiet interval")
	var failed atomic.Bool
	r.Server.SetAfterDiscover(func(d store.Discovery, err error) (store.Discovery, error) {
		if errors.Is(err, store.ErrDiscoveryStopped) {
			failed.Store(true)
		}
		return d, err
	})
	type pause struct{ chosen, armed time.Duration }
	pauses := make(chan pause, 1)
	var sent atomic.Bool
	r.Server.SetAfterDiscoveryWait(func(chosen, armed time.Duration, _ time.Time) {
		if failed.Load() && sent.CompareAndSwap(false, true) {
			pauses <- pause{chosen, armed}
		}
	})
	if _, err := pool.Exec(ctx, `UPDATE outbox.discovery SET stopped_reason = 'recorded by the test', stopped_at = now()`); err != nil {
		t.Fatal(err)
	}
	select {
	case p := <-pauses:
		if p.chosen != time.Second || p.armed != time.Second {
			t.Fatalf("after a round that failed with the stop, in a quiet loop, the loop chose a pause of %v, armed as %v; want a second (the idle interval, a second at least), not the quiet interval %v",
				p.chosen, p.armed, quietInterval)
		}
	case <-ctx.Done():
		t.Fatal("no round failed with the recorded stop")
	}
}

// A round that found exactly as many events as its bound (here
// DiscoveryMaxEvents; a saturated replica's rounds, bounded by their
// sessions' credit, find that many whenever the backlog is of one-event
// transactions) is a backlog taken in parts, like one that found more: it
// is followed after DiscoveryInterval, unpaced, since the rest is there
// already. Three events, each its own transaction, commit while
// discovery's lock is held, and DiscoveryMaxEvents is 2: the first round
// takes two of them. It is held at its hook for hold, so that pacing it
// (2/32 of its length) would pause well over DiscoveryInterval.
func TestARoundAsLargeAsItsBoundIsNotPaced(t *testing.T) {
	t.Parallel()
	const hold, interval = 300 * time.Millisecond, time.Millisecond
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	r := startReplica(t, url, func(c *server.Config) {
		c.DiscoveryInterval, c.DiscoveryIdleInterval = interval, 10*time.Second
		c.DiscoveryMaxEvents = 2
	})
	found, pauses := watchFirstRound(r, hold)
	release := holdDiscovery(ctx, t, pool)
	for _, key := range []string{"a", "b", "c"} {
		emit(t, pool, "orders", key, 1)
	}
	release()
	select {
	case p := <-pauses:
		if n := found.Load(); n != 2 {
			t.Fatalf("the first round took %d events, want 2 (DiscoveryMaxEvents)", n)
		}
		if p != interval {
			t.Fatalf("after a round that took exactly DiscoveryMaxEvents events (held %v) the loop paused %v, want DiscoveryInterval (%v): the rest is there already", hold, p, interval)
		}
	case <-ctx.Done():
		t.Fatal("no round found the events")
	}
}

// watchFirstRound records how many events the first round that found any
// took (holding it at its hook for hold first, when positive) and sends the
// pause the loop chose after it.
func watchFirstRound(r *replica, hold time.Duration) (*atomic.Int64, <-chan time.Duration) {
	found := new(atomic.Int64)
	r.Server.SetAfterDiscover(func(d store.Discovery, err error) (store.Discovery, error) {
		if err == nil && d.Events > 0 && found.CompareAndSwap(0, d.Events) && hold > 0 {
			time.Sleep(hold)
		}
		return d, err
	})
	pauses := make(chan time.Duration, 1)
	var sent atomic.Bool
	r.Server.SetAfterDiscoveryWait(func(chosen, _ time.Duration, _ time.Time) {
		if found.Load() > 0 && sent.CompareAndSwap(false, true) {
			pauses <- chosen
		}
	})
	return found, pauses
}

// A round as large as its bound (DiscoveryMaxEvents here; the credit of a
// saturated replica's sessions likewise) leaves the rest of the backlog
// there, and is followed after DiscoveryInterval (Config.DiscoveryMaxEvents:
// "the rest of the backlog is there already"), also when it found a single
// event after a quiet spell: that is a backlog taken in parts, not a lone
// event in a trickle, whose half idle interval is for checks that would
// almost never find the next event. Two events, each its own transaction,
// commit while discovery's lock is held, after the loop went quiet; with
// DiscoveryMaxEvents 1 the first round takes one of them.
func TestARoundAsLargeAsItsBoundIsNotATrickle(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	url := pollingDatabase(t)
	pool := testdb.NewPoolURL(t, url)
	const interval, idle = time.Millisecond, time.Second
	r := startReplica(t, url, func(c *server.Config) {
		c.DiscoveryInterval, c.DiscoveryIdleInterval = interval, idle
		c.DiscoveryMaxEvents = 1
	})
	// Quiet for more than the idle interval: the loop started (which counts
	// as activity) and backed off to the idle interval since.
	awaitClosed(t, ctx, pauseChosen(r, func(w time.Duration) bool { return w == idle }),
		"the discovery loop never backed off to the idle interval")
	found, pauses := watchFirstRound(r, 0)
	release := holdDiscovery(ctx, t, pool)
	emit(t, pool, "orders", "a", 1)
	emit(t, pool, "orders", "b", 1)
	release()
	select {
	case p := <-pauses:
		if n := found.Load(); n != 1 {
			t.Fatalf("the first round took %d events, want 1 (DiscoveryMaxEvents)", n)
		}
		if p != interval {
			t.Fatalf("after a round as large as DiscoveryMaxEvents (one event of two) the loop paused %v, want DiscoveryInterval (%v): the rest of the backlog is there already", p, interval)
		}
	case <-ctx.Done():
		t.Fatal("no round found the events")
	}
}

// pollingDatabase returns a new test database whose replicas' discovery
// never sleeps (outbox.settings.producer_wakeups off): the loop paces its
// checks as it does wherever it cannot sleep (another replica sleeps, the
// producers use two-phase commit), which is what the tests of that pacing
// watch.
func pollingDatabase(t *testing.T) string {
	t.Helper()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)
	if _, err := pool.Exec(t.Context(), `UPDATE outbox.settings SET producer_wakeups = 'off'`); err != nil {
		t.Fatal(err)
	}
	return url
}
