package migrations_test

import (
	"context"
	"errors"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxd/outboxd/internal/testdb"
)

// dispatchRound runs one discovery round the way a replica does
// (discover_scan, then discover_apply in the same transaction), naming
// every aggregate the scan found idle (or, with all, every one found) for
// session holder, and returns the events leased to it by revision and
// aggregate key.
func dispatchRound(ctx context.Context, pool interface {
	Begin(context.Context) (pgx.Tx, error)
}, holder uuid.UUID, all bool) (map[string]uuid.UUID, error) {
	leased := map[string]uuid.UUID{}
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		rows, err := tx.Query(ctx, `SELECT prev_snapshot, snapshot, stream, aggregate_key, idle FROM outbox.discover_scan()`)
		if err != nil {
			return err
		}
		var prev, next string
		var streams, keys []string
		for rows.Next() {
			var stream, key *string
			var idle bool
			if err := rows.Scan(&prev, &next, &stream, &key, &idle); err != nil {
				return err
			}
			if stream != nil && (idle || all) {
				streams, keys = append(streams, *stream), append(keys, *key)
			}
		}
		if err := rows.Err(); err != nil {
			return err
		}
		if prev == "" {
			return nil // nothing found
		}
		holders := make([]uuid.UUID, len(keys))
		relays := make([]string, len(keys))
		ttls := make([]time.Duration, len(keys))
		for i := range keys {
			holders[i], relays[i], ttls[i] = holder, "relay", 30*time.Second
		}
		rows, err = tx.Query(ctx, `SELECT (a.lease).aggregate_key, (a.lease).event_id
			FROM outbox.discover_apply($1, $2, $3, $4, $5, $6, $7, 'replica') a WHERE a.holder IS NOT NULL`,
			prev, next, streams, keys, holders, relays, ttls)
		if err != nil {
			return err
		}
		for rows.Next() {
			var key string
			var id uuid.UUID
			if err := rows.Scan(&key, &id); err != nil {
				return err
			}
			leased[key] = id
		}
		return rows.Err()
	})
	return leased, err
}

// A round leases the next event of an aggregate it names only while the
// aggregate is new or idle once its row is locked, and the next revision is
// there and not skipped; everything else found is made ready or left to the
// lease in hand. The lease is the session's: its holder, attempt 1, a fresh
// epoch.
func TestDispatchLeasesOnlyIdleAggregatesNextEvent(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.NewPool(t)
	holder := uuid.New()
	round := func(all bool) map[string]uuid.UUID {
		t.Helper()
		got, err := dispatchRound(ctx, pool, holder, all)
		if err != nil {
			t.Fatal(err)
		}
		return got
	}
	state := func(key string) string {
		t.Helper()
		var s string
		if err := pool.QueryRow(ctx, `SELECT state FROM outbox.delivery WHERE aggregate_key = $1`, key).Scan(&s); err != nil {
			t.Fatal(err)
		}
		return s
	}

	// A new aggregate: leased to the session.
	exec(t, pool, `SELECT outbox.emit('orders', 'a', 'T', '{}')`)
	exec(t, pool, `SELECT outbox.emit('orders', 'g', 'T', '{}', revision => 1)`)
	got := round(false)
	if len(got) != 2 {
		t.Fatalf("leased %v, want a and g", got)
	}
	var h uuid.UUID
	var attempt int
	var epoch int64
	if err := pool.QueryRow(ctx, `SELECT holder, attempt, epoch FROM outbox.delivery WHERE aggregate_key = 'a' AND state = 'leased'`).
		Scan(&h, &attempt, &epoch); err != nil {
		t.Fatal(err)
	}
	if h != holder || attempt != 1 || epoch < time.Now().Add(-time.Hour).UnixMicro() {
		t.Fatalf("lease: holder %s attempt %d epoch %d", h, attempt, epoch)
	}

	// Named again while its lease is in hand: left alone.
	exec(t, pool, `SELECT outbox.emit('orders', 'a', 'T', '{}')`)
	if got := round(true); len(got) != 0 {
		t.Fatalf("leased %v while the aggregates' leases were in hand", got)
	}
	if n := count(t, pool, `SELECT count(*) FROM outbox.delivery d JOIN outbox.event e ON e.event_id = d.leased_event_id
		WHERE d.aggregate_key = 'a' AND d.state = 'leased' AND e.revision = 1`); n != 1 {
		t.Fatal("the lease on a's revision 1 changed")
	}

	// g idle at revision 1; revision 3 commits, 2 does not: held for the
	// claim's gap rule, not leased.
	ackEvents(t, pool, `aggregate_key = 'g'`)
	if s := state("g"); s != "idle" {
		t.Fatalf("g is %s after its ack, want idle", s)
	}
	exec(t, pool, `SELECT outbox.emit('orders', 'g', 'T', '{}', revision => 3)`)
	if got := round(false); len(got) != 0 {
		t.Fatalf("leased %v across a gap", got)
	}
	if s := state("g"); s != "ready" {
		t.Fatalf("g is %s, want ready (for the claim to hold the gap)", s)
	}

	// A claim finds g's gap and holds g there (state gap). Revision 2 then
	// commits; the round that finds it, though it names g for the session,
	// makes g ready for a claim and does not lease it: a round leases only
	// an aggregate that is new or idle once locked.
	if n := count(t, pool, `SELECT count(*) FROM outbox.claim(gen_random_uuid(), 'r', 'x', NULL, 10, interval '30 seconds')`); n != 0 {
		t.Fatalf("a claim leased %d events across g's gap", n)
	}
	if s := state("g"); s != "gap" {
		t.Fatalf("g is %s after a claim met its gap, want gap", s)
	}
	exec(t, pool, `SELECT outbox.emit('orders', 'g', 'T', '{}', revision => 2)`)
	if got := round(true); len(got) != 0 {
		t.Fatalf("leased %v: an aggregate held at a gap", got)
	}
	if s := state("g"); s != "ready" {
		t.Fatalf("g is %s once its missing revision came, want ready", s)
	}

	// A new aggregate whose first event an operator skipped: not leased.
	exec(t, pool, `SELECT outbox.emit('orders', 's', 'T', '{}')`)
	exec(t, pool, `INSERT INTO outbox.skipped_event (event_id, reason, actor)
		SELECT event_id, 'test', 'test' FROM outbox.event WHERE aggregate_key = 's'`)
	if got := round(false); len(got) != 0 {
		t.Fatalf("leased %v: a skipped event", got)
	}
	if s := state("s"); s != "ready" {
		t.Fatalf("s is %s, want ready", s)
	}
	if n := strandedEvents(t, pool); n != 0 {
		t.Fatalf("%d stranded events", n)
	}
}

// discover_apply refuses to apply a scan another round has overtaken.
func TestDispatchRefusesAnOvertakenScan(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.NewPool(t)
	exec(t, pool, `SELECT outbox.emit('orders', 'a', 'T', '{}')`)
	var prev, next string
	if err := pool.QueryRow(ctx, `SELECT prev_snapshot, snapshot FROM outbox.discover_scan() LIMIT 1`).Scan(&prev, &next); err != nil {
		t.Fatal(err)
	}
	discover(t, pool) // another round stores its snapshot
	_, err := pool.Exec(ctx, `SELECT * FROM outbox.discover_apply($1, $2)`, prev, next)
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) || pgErr.Code != "25000" {
		t.Fatalf("applying an overtaken scan: %v, want SQLSTATE 25000", err)
	}
}

// The race of TestDiscoveryClaimAndAckRace with dispatching discovery
// rounds whose "replica" acks what it was given at once.
func TestDispatchClaimAndAckRace(t *testing.T) {
	t.Parallel()
	raceDelivery(t, func(ctx context.Context, pool *pgxpool.Pool) error {
		leased, err := dispatchRound(ctx, pool, uuid.New(), false)
		if err != nil || len(leased) == 0 {
			return err
		}
		ids := make([]uuid.UUID, 0, len(leased))
		for _, id := range leased {
			ids = append(ids, id)
		}
		_, err = pool.Exec(ctx, `SELECT * FROM outbox.ack($1, 'x')`, ids)
		return err
	}, nil)
}

// A lease a discovery round dispatches runs its TTL from when the round has
// the delivery rows, not from when it started: a round that waited for a
// row (behind an ack, a claim, a re-scan) would otherwise dispatch a lease
// shorter than its TTL, or one already over. The test holds the idle
// aggregate's row, waits on pg_blocking_pids until the round waits for it,
// reads the clock, lets the round go on, and wants the lease to expire a
// full TTL (dispatchRound's 30 s) after that read.
func TestDispatchRunsItsTTLFromTheLocks(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pool := testdb.NewPool(t)
	emitIn(t, pool, "orders", "k", 1)
	discover(t, pool)
	if got := claimRevisions(t, pool); got["k"] != 1 {
		t.Fatalf("claim = %v, want k revision 1", got)
	}
	ackEvents(t, pool, `aggregate_key = 'k' AND revision = 1`) // idle now
	emitIn(t, pool, "orders", "k", 1)

	locker, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = locker.Rollback(context.WithoutCancel(ctx)) }()
	lockerPID := backendPID(t, locker)
	if _, err := locker.Exec(ctx, `SELECT 1 FROM outbox.delivery WHERE aggregate_key = 'k' FOR UPDATE`); err != nil {
		t.Fatal(err)
	}
	rounder, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer rounder.Release()
	rounderPID := backendPID(t, rounder)
	type result struct {
		leased map[string]uuid.UUID
		err    error
	}
	done := make(chan result, 1)
	go func() {
		leased, err := dispatchRound(ctx, rounder, uuid.New(), false)
		done <- result{leased, err}
	}()
	waitUntilBlockedBy(t, pool, rounderPID, lockerPID)
	var released time.Time
	if err := locker.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&released); err != nil {
		t.Fatal(err)
	}
	if err := locker.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case r := <-done:
		if r.err != nil {
			t.Fatal(r.err)
		}
		if len(r.leased) != 1 {
			t.Fatalf("the round leased %v, want k's revision 2", r.leased)
		}
	case <-ctx.Done():
		t.Fatal("the round never finished")
	}
	var expires time.Time
	if err := pool.QueryRow(ctx, `SELECT lease_expires_at FROM outbox.delivery WHERE aggregate_key = 'k' AND state = 'leased'`).
		Scan(&expires); err != nil {
		t.Fatalf("no lease: %v", err)
	}
	if want := released.Add(30 * time.Second); expires.Before(want) {
		t.Fatalf("dispatched a lease expiring %v; want at or after %v (30s after the row was free)", expires, want)
	}
}

// The lease a round returns for a dispatched event is that event, whole,
// with the lease the round wrote on its delivery row: for a new aggregate
// and for an idle one alike.
func TestDispatchReturnsTheEventItLeases(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	pool := testdb.NewPool(t)
	exec(t, pool, `SELECT outbox.emit('orders', 'i', 'T', '{}')`)
	discover(t, pool)
	ackEvents(t, pool, `aggregate_key = 'i'`) // idle at revision 1
	exec(t, pool, `SELECT outbox.emit('orders', 'i', 'Idle', '{"n": 2}', '{"h": "i"}')`)
	exec(t, pool, `SELECT outbox.emit('orders', 'n', 'New', '{"n": 1}', '{"h": "n"}', revision => 5)`)
	holder := uuid.New()
	type lease struct {
		holder                    uuid.UUID
		id                        uuid.UUID
		stream, key, typ, payload string
		headers                   map[string]string
		rev, epoch                int64
		attempt                   int
		created, expires          time.Time
	}
	var leases []lease
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		var prev, next string
		if err := tx.QueryRow(ctx, `SELECT min(prev_snapshot), min(snapshot) FROM outbox.discover_scan()`).Scan(&prev, &next); err != nil {
			return err
		}
		rows, err := tx.Query(ctx, `
			SELECT a.holder, (a.lease).event_id, (a.lease).stream, (a.lease).aggregate_key, (a.lease).revision,
			       (a.lease).event_type, (a.lease).payload, (a.lease).headers, (a.lease).created_at,
			       (a.lease).epoch, (a.lease).attempt, (a.lease).lease_expires_at
			FROM outbox.discover_apply($1, $2, ARRAY['orders', 'orders'], ARRAY['i', 'n'], ARRAY[$3::uuid, $3::uuid],
			                           ARRAY['relay', 'relay'], ARRAY[interval '30 seconds', interval '30 seconds'], 'replica') a
			WHERE a.holder IS NOT NULL`, prev, next, holder)
		if err != nil {
			return err
		}
		defer rows.Close()
		for rows.Next() {
			var l lease
			if err := rows.Scan(&l.holder, &l.id, &l.stream, &l.key, &l.rev, &l.typ, &l.payload, &l.headers, &l.created,
				&l.epoch, &l.attempt, &l.expires); err != nil {
				return err
			}
			leases = append(leases, l)
		}
		return rows.Err()
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range leases {
		var same bool
		if err := pool.QueryRow(ctx, `
			SELECT e.event_id = $1 AND e.stream = $2 AND e.revision = $4 AND e.event_type = $5 AND e.payload::text = $6
			       AND e.headers = $7 AND e.created_at = $8 AND d.epoch = $9 AND d.attempt = $10 AND $10 = 1
			       AND d.lease_expires_at = $11 AND d.leased_event_id = $1 AND d.holder = $12
			FROM outbox.event e JOIN outbox.delivery d ON d.stream = e.stream AND d.aggregate_key = e.aggregate_key
			WHERE e.event_id = $1 AND e.aggregate_key = $3`,
			l.id, l.stream, l.key, l.rev, l.typ, l.payload, l.headers, l.created, l.epoch, l.attempt, l.expires,
			holder).Scan(&same); err != nil || !same {
			t.Errorf("the lease returned for %s revision %d is not the event and lease the round wrote (%v)", l.key, l.rev, err)
		}
		if want := map[string]int64{"i": 2, "n": 5}[l.key]; l.rev != want {
			t.Errorf("leased %s revision %d, want %d", l.key, l.rev, want)
		}
	}
	leased := len(leases)
	if leased != 2 {
		t.Fatalf("the round returned %d leases, want 2 (i and n)", leased)
	}
}

// A scan hands back at most p_max_aggregates aggregates, the oldest first,
// while the round's apply makes every aggregate found deliverable. A limit
// below 1 is refused: 0 would hide the round's header row too, and a
// caller reading "nothing found" from that would never advance.
func TestScanReturnsTheOldestAggregatesUpToItsLimit(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pool := testdb.NewPool(t)
	keys := []string{"k1", "k2", "k3", "k4", "k5"}
	for _, k := range keys {
		// One transaction each: created_at, the scan's order, rises.
		if _, err := pool.Exec(ctx, `INSERT INTO outbox.event (stream, aggregate_key, event_type, payload)
			VALUES ('s', $1, 't', '{}')`, k); err != nil {
			t.Fatal(err)
		}
	}
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		rows, err := tx.Query(ctx, `SELECT prev_snapshot, snapshot, events, aggregate_key FROM outbox.discover_scan(2)`)
		if err != nil {
			return err
		}
		var prev, next string
		var events int64
		var got []string
		for rows.Next() {
			var key string
			if err := rows.Scan(&prev, &next, &events, &key); err != nil {
				return err
			}
			got = append(got, key)
		}
		if err := rows.Err(); err != nil {
			return err
		}
		if events != 5 || len(got) != 2 || got[0] != "k1" || got[1] != "k2" {
			t.Errorf("discover_scan(2): %d events, aggregates %v; want 5 events, [k1 k2]", events, got)
		}
		_, err = tx.Exec(ctx, `SELECT * FROM outbox.discover_apply($1, $2)`, prev, next)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	var ready int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox.delivery WHERE stream = 's' AND state = 'ready'`).Scan(&ready); err != nil {
		t.Fatal(err)
	}
	if ready != len(keys) {
		t.Fatalf("%d aggregates ready after the round, want all %d it found", ready, len(keys))
	}
	for _, bad := range []int{0, -1} {
		_, err = pool.Exec(ctx, `SELECT * FROM outbox.discover_scan($1)`, bad)
		wantSQLState(t, err, "22023")
	}
}

// roundOf runs one discovery round with discover_scan's event limit (NULL
// for none) and no dispatch, and returns how many events it found and the
// snapshot it stored.
func roundOf(ctx context.Context, t *testing.T, pool *pgxpool.Pool, maxEvents *int) (events int64, stored string) {
	t.Helper()
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		var prev, next *string
		var n *int64
		if err := tx.QueryRow(ctx, `SELECT min(prev_snapshot), min(snapshot), min(events) FROM outbox.discover_scan(NULL, $1)`,
			maxEvents).Scan(&prev, &next, &n); err != nil {
			return err
		}
		if n == nil {
			return nil // nothing found
		}
		events = *n
		if _, err := tx.Exec(ctx, `SELECT * FROM outbox.discover_apply($1, $2)`, *prev, *next); err != nil {
			return err
		}
		return tx.QueryRow(ctx, `SELECT snapshot::text FROM outbox.discovery`).Scan(&stored)
	})
	if err != nil {
		t.Fatal(err)
	}
	return events, stored
}

// With an event limit a round takes a backlog in parts: whole transactions
// in xid order until the limit is reached, storing the snapshot cut at the
// first transaction it left out, with the transactions still running below
// that cut. The next rounds go on from there, so every event is found
// exactly once, including one whose transaction was running below the cut
// and committed later; a transaction larger than the limit is taken whole.
func TestRoundsTakeABacklogInParts(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pool := testdb.NewPool(t)
	insert := func(q pgx.Tx, keys ...string) {
		t.Helper()
		for _, k := range keys {
			if _, err := q.Exec(ctx, `INSERT INTO outbox.event (stream, aggregate_key, event_type, payload)
				VALUES ('s', $1, 't', '{}')`, k); err != nil {
				t.Fatal(err)
			}
		}
	}
	commitOf := func(keys ...string) {
		t.Helper()
		if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { insert(tx, keys...); return nil }); err != nil {
			t.Fatal(err)
		}
	}
	// Transactions in xid order: x1 and x2, then a running one, then x3 to
	// x5, three events each (the running one one).
	commitOf("a1", "a2", "a3")
	commitOf("b1", "b2", "b3")
	running, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = running.Rollback(ctx) }()
	insert(running, "r1")
	var runningXid string
	if err := running.QueryRow(ctx, `SELECT pg_current_xact_id()::text`).Scan(&runningXid); err != nil {
		t.Fatal(err)
	}
	commitOf("c1", "c2", "c3")
	commitOf("d1", "d2", "d3")
	commitOf("e1", "e2", "e3")

	limit := 4
	// The fourth event in xid order is x2's first: x1 and x2 whole.
	n, stored := roundOf(ctx, t, pool, &limit)
	if n != 6 {
		t.Fatalf("first round found %d events, want x1's and x2's 6", n)
	}
	if parts := strings.Split(stored, ":"); len(parts) != 3 || !slices.Contains(strings.Split(parts[2], ","), runningXid) {
		t.Fatalf("stored snapshot %s does not keep the running transaction %s below its cut", stored, runningXid)
	}
	// And the apply wrote what the cut shows, no more: the rows of x1's and
	// x2's aggregates.
	if rows := count(t, pool, `SELECT count(*) FROM outbox.delivery WHERE stream = 's'`); rows != 6 {
		t.Fatalf("after the first round %d aggregates have a delivery row, want x1's and x2's 6", rows)
	}
	if err := running.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	// Now the one that was running (below the stored cut: on top of the
	// limit, which counts from the cut on), x3 and x4 (the fourth event from
	// the cut is x4's first); then x5, and nothing.
	for i, want := range []int64{7, 3, 0} {
		if n, _ := roundOf(ctx, t, pool, &limit); n != want {
			t.Fatalf("round %d found %d events, want %d", i+2, n, want)
		}
	}
	var rows int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM outbox.delivery WHERE stream = 's' AND state = 'ready'`).Scan(&rows); err != nil {
		t.Fatal(err)
	}
	if rows != 16 {
		t.Fatalf("%d aggregates claimable, want all 16", rows)
	}

	// A transaction larger than the limit is taken whole: a round always
	// makes progress.
	commitOf("f1", "f2", "f3")
	commitOf("g1")
	one := 1
	if n, _ := roundOf(ctx, t, pool, &one); n != 3 {
		t.Fatalf("a round limited to 1 event found %d, want the first transaction's 3", n)
	}
	if n, _ := roundOf(ctx, t, pool, &one); n != 1 {
		t.Fatalf("the next round found %d, want the last transaction's 1", n)
	}
	for _, bad := range []int{0, -1} {
		_, err := pool.Exec(ctx, `SELECT * FROM outbox.discover_scan(NULL, $1)`, bad)
		wantSQLState(t, err, "22023")
	}
}

// Transaction ids follow first writes, not commits. A producer that took its
// id early (a business write) and then waited for an aggregate's counter
// behind a later-id producer commits its revision after the other's. A round
// limited to one event cuts its snapshot between the two ids, so it sees the
// later revisions alone: revision 2 of k (new) and 3 of j (delivered through
// 1, idle). k's cursor must start below revision 1, the lowest pending one
// (which the round's decision sees committed), not below 2, or revision 1
// would be found next round behind the cursor, a late event never
// delivered. And both aggregates are pending since their oldest pending
// event, the later-id producer's, whose transaction began first.
func TestACutThatShowsALaterRevisionAloneKeepsTheEarlierOne(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pool := testdb.NewPool(t)
	exec(t, pool, `INSERT INTO outbox.event (stream, aggregate_key, event_type, payload) VALUES ('s', 'j', 't', '{}')`)
	discover(t, pool)
	if got := claimRevisions(t, pool); got["j"] != 1 {
		t.Fatalf("claimed %v, want j's revision 1", got)
	}
	ackEvents(t, pool, `aggregate_key = 'j'`)

	// The later-id producer's transaction begins first (its events' created_at
	// is the older), the early-id one takes its id first.
	later, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = later.Rollback(ctx) }()
	if _, err := later.Exec(ctx, `SELECT now()`); err != nil {
		t.Fatal(err)
	}
	early, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = early.Rollback(ctx) }()
	var earlyXid, laterXid int64
	if err := early.QueryRow(ctx, `SELECT pg_current_xact_id()::text::bigint`).Scan(&earlyXid); err != nil {
		t.Fatal(err)
	}
	if err := later.QueryRow(ctx, `SELECT pg_current_xact_id()::text::bigint`).Scan(&laterXid); err != nil {
		t.Fatal(err)
	}
	if earlyXid >= laterXid {
		t.Fatalf("transaction ids %d, %d: want the early one's lower", earlyXid, laterXid)
	}
	const emit = `INSERT INTO outbox.event (stream, aggregate_key, event_type, payload)
		VALUES ('s', 'k', 't', '{}'), ('s', 'j', 't', '{}') RETURNING revision`
	revisions := func(q pgx.Tx) ([]int64, error) {
		rows, err := q.Query(ctx, emit)
		if err != nil {
			return nil, err
		}
		return pgx.CollectRows(rows, pgx.RowTo[int64])
	}
	if revs, err := revisions(later); err != nil || !slices.Equal(revs, []int64{1, 2}) {
		t.Fatalf("the later-id producer's revisions %v (err %v), want k 1, j 2", revs, err)
	}
	earlyPid, laterPid := backendPID(t, early), backendPID(t, later)
	earlyRevs := make(chan []int64, 1)
	go func() {
		revs, err := revisions(early)
		if err != nil {
			t.Error(err)
		}
		earlyRevs <- revs
	}()
	waitUntilBlockedBy(t, pool, earlyPid, laterPid)
	if err := later.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if revs := <-earlyRevs; !slices.Equal(revs, []int64{2, 3}) {
		t.Fatalf("the early-id producer's revisions %v, want k 2, j 3", revs)
	}
	if err := early.Commit(ctx); err != nil {
		t.Fatal(err)
	}

	one := 1
	if n, _ := roundOf(ctx, t, pool, &one); n != 2 {
		t.Fatalf("the first round found %d events, want the early-id transaction's 2 alone", n)
	}
	rows, err := pool.Query(ctx, `SELECT d.aggregate_key, d.delivered_revision, d.state,
			d.pending_since = o.oldest AND d.claimable_at = o.oldest
		FROM outbox.delivery d
		CROSS JOIN LATERAL (SELECT min(e.created_at) AS oldest FROM outbox.event e
		                    WHERE e.stream = d.stream AND e.aggregate_key = d.aggregate_key AND e.published_at IS NULL) o
		WHERE d.stream = 's' ORDER BY d.aggregate_key`)
	if err != nil {
		t.Fatal(err)
	}
	type row struct {
		Key         string
		Cursor      int64
		State       string
		SinceOldest bool
	}
	got, err := pgx.CollectRows(rows, pgx.RowToStructByPos[row])
	if err != nil {
		t.Fatal(err)
	}
	if want := []row{{"j", 1, "ready", true}, {"k", 0, "ready", true}}; !slices.Equal(got, want) {
		t.Fatalf("after the cut round the aggregates are %+v, want %+v (ready at their cursors, pending and claimable since their oldest event)", got, want)
	}
	if n, _ := roundOf(ctx, t, pool, &one); n != 2 {
		t.Fatalf("the second round found %d events, want the later-id transaction's 2", n)
	}
	if late := count(t, pool, `SELECT count(*) FROM outbox.late_event`); late != 0 {
		t.Fatalf("%d late events: an earlier revision was left behind its cursor", late)
	}
	if got := claimRevisions(t, pool); got["k"] != 1 || got["j"] != 2 {
		t.Fatalf("claimed %v, want k's revision 1 and j's 2", got)
	}
}

// roundOutcome is what one outbox.discover_round call returned.
type roundOutcome struct {
	rows, events, woken int64
	last                uuid.UUID
	found               []string          // stream/key, in the order returned
	leased              map[string]string // stream/key -> the holder's name
}

// discoverRoundAs runs outbox.discover_round with an offer from the sessions
// named in names (their holders in order), with the credits and JSON
// filters given.
func discoverRoundAs(t *testing.T, pool *pgxpool.Pool, names []string, credits []int32, filters any) roundOutcome {
	t.Helper()
	holders := make([]uuid.UUID, len(names))
	relays := make([]string, len(names))
	ttls := make([]time.Duration, len(names))
	byHolder := map[uuid.UUID]string{}
	for i, n := range names {
		holders[i], relays[i], ttls[i] = uuid.NewSHA1(uuid.Nil, []byte(n)), "relay-"+n, time.Minute
		byHolder[holders[i]] = n
	}
	rows, err := pool.Query(testContext(t), `SELECT r.events, r.woken, r.last_holder, r.stream, r.aggregate_key,
			r.holder, (r.lease).stream, (r.lease).aggregate_key
		FROM outbox.discover_round(NULL, NULL, $1, $2, $3, $4, $5, 'replica') r`, holders, relays, ttls, credits, filters)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	out := roundOutcome{leased: map[string]string{}}
	for rows.Next() {
		var events, woken *int64
		var last, holder *uuid.UUID
		var stream, key, leaseStream, leaseKey *string
		if err := rows.Scan(&events, &woken, &last, &stream, &key, &holder, &leaseStream, &leaseKey); err != nil {
			t.Fatal(err)
		}
		out.rows++
		switch {
		case events != nil:
			out.events, out.woken = *events, *woken
			if last != nil {
				out.last = *last
			}
		case stream != nil:
			out.found = append(out.found, *stream+"/"+*key)
		case holder != nil:
			out.leased[*leaseStream+"/"+*leaseKey] = byHolder[*holder]
		}
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// One statement runs a whole round with the offer made up front: each idle
// aggregate found, oldest first, goes to the next session in turn that
// takes its stream and has credit left; the rest are woken; the round says
// which session it gave its last aggregate to (the next round's turns begin
// after it) and what it found.
func TestDiscoverRoundDispatchesByTheOffer(t *testing.T) {
	t.Parallel()
	pool := testdb.NewPool(t)
	names := []string{"s1", "s2", "s3"}
	filters := []map[string][]string{{"streams": {"a"}}, {"exclude": {"a"}}, {}}

	if got := discoverRoundAs(t, pool, names, []int32{1, 5, 0}, filters); got.rows != 0 {
		t.Fatalf("a round that found nothing returned %d rows, want none", got.rows)
	}
	for _, e := range []string{"a/1", "b/1", "a/2", "c/1"} {
		stream, key, _ := strings.Cut(e, "/")
		emitIn(t, pool, stream, key, 1)
	}
	// s1 takes only a and has credit for one; s2 takes all but a; s3 has no
	// credit. a/1 goes to s1 (first in turn), b/1 to s2 (next in turn),
	// a/2 to nobody (s1 spent, s2 excludes a), c/1 to s2 (s1 spent, s3 has
	// nothing), the last.
	got := discoverRoundAs(t, pool, names, []int32{1, 5, 0}, filters)
	want := map[string]string{"a/1": "s1", "b/1": "s2", "c/1": "s2"}
	if !maps.Equal(got.leased, want) {
		t.Errorf("leased %v, want %v", got.leased, want)
	}
	if !slices.Equal(got.found, []string{"a/1", "b/1", "a/2", "c/1"}) {
		t.Errorf("found %v, want every aggregate, oldest first", got.found)
	}
	if got.events != 4 || got.woken != 1 {
		t.Errorf("events %d, woken %d; want 4 and 1 (a/2)", got.events, got.woken)
	}
	if got.last != uuid.NewSHA1(uuid.Nil, []byte("s2")) {
		t.Errorf("the last aggregate went to %v, want s2", got.last)
	}
	var states []string
	if err := pool.QueryRow(testContext(t), `SELECT array_agg(stream || '/' || aggregate_key || ':' || state ORDER BY stream, aggregate_key)
		FROM outbox.delivery`).Scan(&states); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(states, []string{"a/1:leased", "a/2:ready", "b/1:leased", "c/1:leased"}) {
		t.Errorf("delivery rows %v", states)
	}

	// Turns begin with the first session offered and move on with each
	// aggregate: with s2 first and credit to spare for both, the round's
	// two aggregates go to s2 and then s1.
	emitIn(t, pool, "d", "1", 1)
	emitIn(t, pool, "a", "3", 1)
	got = discoverRoundAs(t, pool, []string{"s2", "s1"}, []int32{5, 5}, []map[string][]string{{}, {}})
	if want := map[string]string{"d/1": "s2", "a/3": "s1"}; !maps.Equal(got.leased, want) {
		t.Errorf("leased %v, want %v", got.leased, want)
	}
	// A session first in turn with credit to spare is passed over for a
	// stream it does not take; an empty list of streams takes every one.
	emitIn(t, pool, "g", "1", 1)
	got = discoverRoundAs(t, pool, []string{"s1", "s2"}, []int32{5, 5}, []map[string][]string{{"streams": {"a"}}, {"streams": {}}})
	if want := map[string]string{"g/1": "s2"}; !maps.Equal(got.leased, want) {
		t.Errorf("leased %v, want %v", got.leased, want)
	}
	// No offer at all: every aggregate found is woken.
	emitIn(t, pool, "e", "1", 1)
	if got := discoverRoundAs(t, pool, nil, nil, nil); len(got.leased) != 0 || got.woken != 1 || got.last != uuid.Nil {
		t.Errorf("a round with no offer: leased %v, woken %d, last %v", got.leased, got.woken, got.last)
	}
}

// An offer whose arrays do not line up is refused with a clear error, before
// the round reads or writes anything.
func TestDiscoverRoundRefusesABadOffer(t *testing.T) {
	t.Parallel()
	ctx := testContext(t)
	pool := testdb.NewPool(t)
	emitIn(t, pool, "a", "1", 1)
	h := uuid.New()
	for _, c := range []struct {
		name string
		args []any
	}{
		{"credits short", []any{[]uuid.UUID{h}, []string{"r"}, []time.Duration{time.Minute}, []int32{}, nil}},
		{"filters not an array", []any{[]uuid.UUID{h}, []string{"r"}, []time.Duration{time.Minute}, []int32{1}, map[string]any{}}},
		{"filters short", []any{[]uuid.UUID{h}, []string{"r"}, []time.Duration{time.Minute}, []int32{1}, []any{}}},
		{"no holder", []any{[]*uuid.UUID{nil}, []string{"r"}, []time.Duration{time.Minute}, []int32{1}, nil}},
		{"no credit", []any{[]uuid.UUID{h}, []string{"r"}, []time.Duration{time.Minute}, []*int32{nil}, nil}},
		{"no TTL", []any{[]uuid.UUID{h}, []string{"r"}, []*time.Duration{nil}, []int32{1}, nil}},
		{"no positive TTL", []any{[]uuid.UUID{h}, []string{"r"}, []time.Duration{0}, []int32{1}, nil}},
		{"streams not a list", []any{[]uuid.UUID{h}, []string{"r"}, []time.Duration{time.Minute}, []int32{1},
			[]any{map[string]any{"streams": "a"}}}},
		{"exclude not a list", []any{[]uuid.UUID{h}, []string{"r"}, []time.Duration{time.Minute}, []int32{1},
			[]any{map[string]any{"exclude": map[string]any{"a": 1}}}}},
		{"filter not an object", []any{[]uuid.UUID{h}, []string{"r"}, []time.Duration{time.Minute}, []int32{1}, []any{"a"}}},
	} {
		_, err := pool.Exec(ctx, `SELECT * FROM outbox.discover_round(NULL, NULL, $1, $2, $3, $4, $5)`, c.args...)
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) || pgErr.Code != "22023" || !strings.Contains(pgErr.Message, "discover_round") {
			t.Errorf("%s: got %v, want invalid_parameter_value naming discover_round", c.name, err)
		}
	}
	if n := count(t, pool, `SELECT count(*) FROM outbox.delivery`); n != 0 {
		t.Errorf("%d delivery rows written by refused rounds", n)
	}
}
