package store_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/url"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/outboxd/outboxd/internal/store"
	"github.com/outboxd/outboxd/internal/testdb"
)

// Plans a connection cached while the tables were tiny still reach rows by
// key once the tables are large. A PL/pgSQL statement (and a prepared one
// under plan_cache_mode = auto) keeps its plan for the connection's life,
// and only an ANALYZE of a table it reads makes it plan again; planned
// against an empty table, a lookup by key is cheapest as a scan of the
// whole table, and a join of a batch's keys with a table cheapest as a
// nested loop over all of it. Between a database's first events and
// autovacuum's first ANALYZE of each table (never, where autovacuum is
// off), such a plan turns every event's insert, round and ack into a pass
// over the table: a round of 10,000 aggregates took over six minutes.
//
// The test caches every delivery path's plans on a server connection and a
// producer's while the tables hold a few rows, loads a large history behind
// them (autovacuum off, so nothing plans again), runs the same paths with
// small batches, and reads each statement's executed plan through
// auto_explain. A statement whose plan touched more than a tenth of the
// history (a round's batches are a few dozen rows), which only a pass over
// a large table does, fails the test with its plan.
func TestPlansCachedOnTinyTablesStayProbes(t *testing.T) {
	t.Parallel()
	t.Run("never analyzed", func(t *testing.T) { t.Parallel(); testPlansCachedOnTinyTables(t, false) })
	t.Run("analyzed while tiny", func(t *testing.T) { t.Parallel(); testPlansCachedOnTinyTables(t, true) })
}

func testPlansCachedOnTinyTables(t *testing.T, analyzeTiny bool) {
	ctx := context.Background()
	dbURL := superuserURL(t, testdb.New(t))
	const history = 20000 // aggregates of history; 3 events and an attempt each

	admin := testdb.NewPoolURL(t, dbURL)
	// An ANALYZE would plan the statements again and hide what this test
	// looks for; the option itself is DDL, so it goes before any plan.
	for _, table := range []string{"event", "aggregate", "delivery", "attempt", "late_event", "skipped_event"} {
		if _, err := admin.Exec(ctx, "ALTER TABLE outbox."+table+" SET (autovacuum_enabled = false)"); err != nil {
			t.Fatal(err)
		}
	}

	plans := &planLog{}
	// One connection for the server's calls (set up as the server's are) and
	// one for the producers' (as a producer's would be, with none of the
	// server's settings): every call below plans on them, and runs its
	// cached plan.
	onePlannedConn := func(server bool) *pgxpool.Pool {
		cfg, err := pgxpool.ParseConfig(dbURL)
		if err != nil {
			t.Fatal(err)
		}
		cfg.MaxConns = 1
		cfg.ConnConfig.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) { plans.add(n) }
		cfg.AfterConnect = func(ctx context.Context, c *pgx.Conn) error {
			_, err := c.Exec(ctx, `LOAD 'auto_explain'`)
			return err
		}
		if server {
			store.ConfigurePool(cfg)
		}
		pool, err := pgxpool.NewWithConfig(ctx, cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(pool.Close)
		return pool
	}
	pool, producer := onePlannedConn(true), onePlannedConn(false)
	st := store.New(pool)

	w := &planWorkload{t: t, st: st, producer: producer, again: "early", hot: "early-hot"}
	// More than five calls of each, so that statements under
	// plan_cache_mode = auto settle on their generic plan too.
	for round := range 7 {
		w.round(ctx, fmt.Sprintf("a%d", round))
		if round == 0 && analyzeTiny {
			// As autovacuum does once a young table has had a few dozen
			// rows written: the statements plan again, for tables the
			// statistics now say are tiny.
			if _, err := admin.Exec(ctx, "ANALYZE outbox.event, outbox.aggregate, outbox.delivery, outbox.attempt, outbox.skipped_event, outbox.late_event"); err != nil {
				t.Fatal(err)
			}
		}
	}

	// The history: published events of aggregates delivered to their end,
	// each with a failed attempt on record, a skipped event and a late one
	// (as records; for plans, rows are rows); and a hot aggregate with a
	// backlog of its own, in a stream no session here names (the session
	// that takes every stream claims its head in each round), to which each
	// round adds an event (a round finds it, and must not read its
	// backlog). Written with triggers off, as a
	// restore would, and stamped frozen so that discovery has nothing of it
	// to find.
	if _, err := admin.Exec(ctx, fmt.Sprintf(`
		SET session_replication_role = replica;
		INSERT INTO outbox.aggregate (stream, aggregate_key, last_revision)
		SELECT 'plans', 'h' || g, 3 FROM generate_series(1, %[1]d) g;
		INSERT INTO outbox.event (event_id, stream, aggregate_key, revision, event_type, payload,
		                          created_at, published_at, xid)
		SELECT gen_random_uuid(), 'plans', 'h' || g, r, 'history', '{}', now() - interval '1 day', now(), '2'
		FROM generate_series(1, %[1]d) g, generate_series(1, 3) r;
		INSERT INTO outbox.delivery (stream, aggregate_key, state, delivered_revision)
		SELECT 'plans', 'h' || g, 'idle', 3 FROM generate_series(1, %[1]d) g;
		INSERT INTO outbox.attempt (stream, aggregate_key, event_id, revision, attempt, outcome)
		SELECT 'plans', 'h' || g, gen_random_uuid(), 3, 1, 'expired' FROM generate_series(1, %[1]d) g;
		INSERT INTO outbox.skipped_event (event_id, reason, actor)
		SELECT event_id, 'history', 'test' FROM outbox.event WHERE event_type = 'history' AND revision = 2;
		INSERT INTO outbox.late_event (event_id)
		SELECT event_id FROM outbox.event WHERE event_type = 'history' AND revision = 1;
		INSERT INTO outbox.aggregate (stream, aggregate_key, last_revision) VALUES ('plans.hot', 'backlog', %[2]d);
		INSERT INTO outbox.event (event_id, stream, aggregate_key, revision, event_type, payload, created_at, xid)
		SELECT gen_random_uuid(), 'plans.hot', 'backlog', r, 'backlog', '{}', now() - interval '1 hour', '2'
		FROM generate_series(1, %[2]d) r;
		INSERT INTO outbox.delivery (stream, aggregate_key, state, delivered_revision, claimable_at, pending_since)
		VALUES ('plans.hot', 'backlog', 'ready', 0, now() - interval '1 hour', now() - interval '1 hour');
		RESET session_replication_role`, history, history/4)); err != nil {
		t.Fatal(err)
	}

	for _, p := range []*pgxpool.Pool{pool, producer} {
		if _, err := p.Exec(ctx, `SET auto_explain.log_format = json; SET auto_explain.log_analyze = on;
			SET auto_explain.log_timing = off; SET auto_explain.log_nested_statements = on;
			SET auto_explain.log_min_duration = 0; SET client_min_messages = log`); err != nil {
			t.Fatal(err)
		}
	}
	w.again = "h"                          // aggregates of the history, idle until now
	w.hot = "backlog"                      // the hot aggregate of the history
	w.lagOf = []string{"plans", "plans.w"} // a lag read of all would count the hot backlog, by design
	plans.start()
	for round := range 3 {
		w.round(ctx, fmt.Sprintf("b%d", round))
	}
	logged, garbled := plans.stop()
	if len(garbled) > 0 {
		t.Fatalf("%d plans auto_explain sent could not be read, the first:\n%s", len(garbled), garbled[0])
	}
	if len(logged) < 50 {
		t.Fatalf("auto_explain logged %d plans; the workload runs far more statements", len(logged))
	}

	// Then a backlog held for an operator (parked aggregates, one pending
	// event each, in the same stream), and the lag of the events no round
	// has found yet: each of those is checked against its own aggregate's
	// delivery row, never against the stream's backlog; and a lag read of
	// another stream reads none of it. (A lag read of this stream reads the
	// backlog by design.)
	if _, err := admin.Exec(ctx, fmt.Sprintf(`
		SET session_replication_role = replica;
		INSERT INTO outbox.aggregate (stream, aggregate_key, last_revision)
		SELECT 'plans', 'p' || g, 1 FROM generate_series(1, %[1]d) g;
		INSERT INTO outbox.event (event_id, stream, aggregate_key, revision, event_type, payload, created_at, xid)
		SELECT gen_random_uuid(), 'plans', 'p' || g, 1, 'held', '{}', now() - interval '1 hour', '2'
		FROM generate_series(1, %[1]d) g;
		INSERT INTO outbox.delivery (stream, aggregate_key, state, delivered_revision, pending_since,
		                             parked_at, parked_reason, parked_revision)
		SELECT 'plans', 'p' || g, 'parked', 0, now() - interval '1 hour', now(), 'held', 1
		FROM generate_series(1, %[1]d) g;
		RESET session_replication_role`, history/4)); err != nil {
		t.Fatal(err)
	}
	plans.start()
	if _, err := producer.Exec(ctx, `
		INSERT INTO outbox.event (stream, aggregate_key, event_type, payload)
		SELECT 'plans', 'undiscovered-' || g, 'new', '{}' FROM generate_series(1, 20) g`); err != nil {
		t.Fatal(err)
	}
	var undiscovered int64
	if err := pool.QueryRow(ctx, `SELECT events FROM outbox.undiscovered(ARRAY['plans'])`).Scan(&undiscovered); err != nil {
		t.Fatal(err)
	}
	if undiscovered != 20 {
		t.Fatalf("outbox.undiscovered counted %d events; want the 20 no round has found", undiscovered)
	}
	if _, err := st.Lag(ctx, []string{"elsewhere"}, time.Minute); err != nil {
		t.Fatal(err)
	}
	// A lag read of every stream, as the console samples every source,
	// with a relay connected and idle: the streams whose ready work waits
	// for a relay are found by a probe per stream, never by reading one.
	if _, err := admin.Exec(ctx, `
		INSERT INTO outbox.relay_session (session_id, relay_id, peer, replica_id, streams, max_in_flight,
		                                  connected_at, seen_at)
		VALUES (gen_random_uuid(), 'idle-relay', 'plans-test', 'plans-replica', '{}', 10,
		        now() - interval '1 hour', now() + interval '1 hour')`); err != nil {
		t.Fatal(err)
	}
	everyStreamLagFrom := plans.count()
	lag, err := st.Lag(ctx, nil, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.ContainsFunc(lag.Streams, func(l store.StreamLag) bool { return l.Stream == "plans.hot" && len(l.IdleRelays) == 1 }) {
		t.Fatalf("the lag read of every stream found no idle relay for plans.hot, whose ready aggregate waits an hour: %+v", lag.Streams)
	}
	// (The log keeps what it read before too.)
	if logged, garbled = plans.stop(); len(garbled) > 0 {
		t.Fatalf("%d plans auto_explain sent could not be read, the first:\n%s", len(garbled), garbled[0])
	}

	// A round's batch is a few dozen rows; a pass over the history is
	// thousands.
	const maxTouched = history / 10
	for i, p := range logged {
		if testing.Verbose() && os.Getenv("OUTBOXD_TEST_SHOW_PLANS") != "" {
			t.Logf("%d rows touched:\n%s\nplan:\n%s", p.touched, p.query, p.plan)
		}
		// The stranded audit reads every aggregate by design (it checks
		// delivery's states against the producers' counters), rationed by
		// its caller.
		if strings.Contains(p.query, "outbox.stranded(") {
			continue
		}
		// A lag read of every stream counts every pending event, the hot
		// backlog's and the parked ones' too, by design (outbox.pending_by_stream).
		if i >= everyStreamLagFrom && strings.Contains(p.query, "WITH pend AS") {
			continue
		}
		if p.touched > maxTouched {
			t.Errorf("a statement touched %d rows (over %d) with a plan cached on tiny tables:\n%s\nplan:\n%s",
				p.touched, maxTouched, p.query, p.plan)
		}
	}
}

// superuserURL is u with the server's own user: LOAD 'auto_explain' and its
// settings are a superuser's.
func superuserURL(t *testing.T, u string) string {
	t.Helper()
	server, err := url.Parse(testdb.ServerURL())
	if err != nil {
		t.Fatal(err)
	}
	db, err := url.Parse(u)
	if err != nil {
		t.Fatal(err)
	}
	db.User = server.User
	return db.String()
}

// planWorkload runs every delivery path once per round, with small
// batches.
type planWorkload struct {
	t  *testing.T
	st *store.Store
	// producer is a producer's connection: the events go in through it.
	producer *pgxpool.Pool
	// again prefixes the keys of aggregates every round produces to again,
	// and hot is the key of the aggregate of stream plans.hot each adds an
	// event to.
	again, hot string
	// lagOf are the streams whose lag a round reads (nil: all).
	lagOf []string
}

func (w *planWorkload) round(ctx context.Context, tag string) {
	t := w.t
	t.Helper()
	holder := uuid.New()
	ttl := time.Minute
	// Most sessions here name their streams; one takes every stream, as a
	// relay does by default. Its claims and hints, and the idle replica's
	// probe, find the streams with claimable work by a walk down the claim
	// index (outbox.claimable_streams) that no plan may turn into a walk
	// down the primary key, which passes every aggregate not claimable on
	// the way (5,604 rows touched here when each step asked only for the
	// greatest stream, which both indexes give). The probe is a statement
	// of the server's own, and its probes of a stream's rows in claim order
	// must not read and sort the stream (202,346 rows touched here while it
	// was planned without the claim's settings).

	// Producers: automatic revisions for new aggregates and for aggregates
	// of the history, an explicit id and revision, and a retry of it.
	explicit := uuid.New()
	// First, so that the claim below takes it: an aggregate whose first
	// event an operator skips before any delivery (the claim's path that
	// steps over skipped revisions).
	var skip uuid.UUID
	if err := w.producer.QueryRow(ctx, `
		INSERT INTO outbox.event (stream, aggregate_key, event_type, payload)
		SELECT 'plans', $1 || '-skip', 'skipped', '{}' FROM generate_series(1, 2)
		RETURNING event_id`, tag).Scan(&skip); err != nil {
		t.Fatal(err)
	}
	if _, err := w.producer.Exec(ctx, `
		INSERT INTO outbox.event (stream, aggregate_key, event_type, payload)
		SELECT 'plans', $1 || '-' || g, 'new', '{}' FROM generate_series(1, 20) g`, tag); err != nil {
		t.Fatal(err)
	}
	if _, err := w.producer.Exec(ctx, `
		INSERT INTO outbox.event (stream, aggregate_key, event_type, payload)
		SELECT 'plans', $1 || g, 'again', '{}' FROM generate_series(1, 5) g`, w.again); err != nil {
		t.Fatal(err)
	}
	if _, err := w.producer.Exec(ctx, `
		INSERT INTO outbox.event (stream, aggregate_key, event_type, payload)
		SELECT 'plans.w', $1 || '-w' || g, 'windowed', '{}' FROM generate_series(1, 3) g, generate_series(1, 3) r`, tag); err != nil {
		t.Fatal(err)
	}
	if _, err := w.producer.Exec(ctx, `
		INSERT INTO outbox.event (stream, aggregate_key, event_type, payload) VALUES ('plans.hot', $1, 'hot', '{}')`, w.hot); err != nil {
		t.Fatal(err)
	}
	emitted := uuid.New()
	for range 2 {
		if _, err := w.producer.Exec(ctx, `
			INSERT INTO outbox.event (event_id, stream, aggregate_key, revision, event_type, payload)
			VALUES ($1, 'plans', $2, 1, 'explicit', '{}')`, explicit, tag+"-explicit"); err != nil {
			t.Fatal(err)
		}
		for _, fn := range []string{"outbox.emit", "outbox.emit_event"} {
			var id uuid.UUID
			var revision int64
			if err := w.producer.QueryRow(ctx, `SELECT event_id, revision FROM `+fn+`('plans', $1, 'emitted', '{}', '{}', NULL, $2)`,
				tag+"-emitted", emitted).Scan(&id, &revision); err != nil {
				t.Fatal(err)
			}
			if id != emitted || revision != 1 {
				t.Fatalf("%s answered %v revision %d for event %v, the aggregate's first", fn, id, revision, emitted)
			}
		}
	}

	// Skipped before any round: the round's dispatch finds the aggregate's
	// head skipped and leaves it to the claim below.
	if _, err := w.st.SkipEvent(ctx, skip, "not wanted", "plans-test"); err != nil {
		t.Fatal(err)
	}
	d, err := w.st.Discover(ctx, "plans-replica", 100, 0, []store.Offer{
		{Holder: holder, RelayID: "plans-relay", TTL: ttl, Credit: 5, StreamFilter: store.StreamFilter{Streams: []string{"plans"}}},
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if d.Events == 0 {
		t.Fatal("discovery found nothing of the round's events")
	}
	leases, err := w.st.Claim(ctx, store.ClaimParams{Holder: holder, RelayID: "plans-relay", ReplicaID: "plans-replica",
		Streams: []string{"plans"},
		Limit:   20, TTL: ttl, MaxAttempts: 10, MaxDue: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	for _, dl := range d.Dispatched {
		leases = append(leases, dl.Lease)
	}
	// A session that takes every stream (but the windows' below): a claim,
	// the ack of what it claimed (its hint), and the idle replica's probe.
	every := uuid.New()
	everyLeases, err := w.st.Claim(ctx, store.ClaimParams{Holder: every, RelayID: "plans-relay", ReplicaID: "plans-replica",
		ExcludeStreams: []string{"plans.w"}, Limit: 1, TTL: ttl, MaxAttempts: 10, MaxDue: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if len(everyLeases) != 1 {
		t.Fatalf("%d leases for the session that takes every stream; want 1", len(everyLeases))
	}
	if _, err := w.st.Ack(ctx, store.AckParams{IDs: []uuid.UUID{everyLeases[0].Event.ID}, ReplicaID: "plans-replica",
		Filters: map[uuid.UUID]store.StreamFilter{every: {ExcludeStreams: []string{"plans.w"}}}, MaxDue: time.Hour}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := w.st.RoundDue(ctx, true, time.Hour); err != nil {
		t.Fatal(err)
	}
	if len(leases) < 10 {
		t.Fatalf("%d leases; the round needs at least 10", len(leases))
	}
	var acks []uuid.UUID
	for _, l := range leases[4:] {
		acks = append(acks, l.Event.ID)
	}
	// One ack alone (the one-row path), then a batch.
	for _, batch := range [][]uuid.UUID{acks[:1], acks[1:]} {
		if _, err := w.st.Ack(ctx, store.AckParams{IDs: batch, ReplicaID: "plans-replica",
			HandOver: map[uuid.UUID]store.HandOverTarget{holder: {TTL: ttl}},
			Filters:  map[uuid.UUID]store.StreamFilter{holder: {Streams: []string{"plans"}}}, MaxDue: time.Hour}); err != nil {
			t.Fatal(err)
		}
	}
	// Windows: leases of three revisions each, acked head first (the
	// lease goes on), then the rest, handed over to a session that takes
	// windows too (the general path of an ack batch).
	windowed := uuid.New()
	wleases, err := w.st.Claim(ctx, store.ClaimParams{Holder: windowed, RelayID: "plans-relay", ReplicaID: "plans-replica",
		Streams: []string{"plans.w"}, Limit: 3, Window: 3, Credit: 9, TTL: ttl, MaxAttempts: 10, MaxDue: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	if len(wleases) != 9 {
		t.Fatalf("%d leases of windows; want 3 aggregates of 3 events", len(wleases))
	}
	var heads, rest []uuid.UUID
	for _, l := range wleases {
		if l.Event.Revision == 1 {
			heads = append(heads, l.Event.ID)
		} else {
			rest = append(rest, l.Event.ID)
		}
	}
	for _, batch := range [][]uuid.UUID{heads, rest} {
		if _, err := w.st.Ack(ctx, store.AckParams{IDs: batch, ReplicaID: "plans-replica",
			HandOver: map[uuid.UUID]store.HandOverTarget{windowed: {TTL: ttl, Window: 3, Credit: 3}},
			Filters:  map[uuid.UUID]store.StreamFilter{windowed: {Streams: []string{"plans.w"}}}, MaxDue: time.Hour}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := w.st.Nack(ctx, store.NackParams{EventID: leases[0].Event.ID, Epoch: leases[0].Epoch, Error: "broker down",
		BackoffBase: time.Second, BackoffCap: time.Minute, MaxFailures: 10}); err != nil {
		t.Fatal(err)
	}
	if _, err := w.st.Park(ctx, leases[1].Event.ID, leases[1].Epoch, "too large"); err != nil {
		t.Fatal(err)
	}
	if _, err := w.st.RetryAggregate(ctx, store.RetryParams{Stream: "plans", AggregateKey: leases[1].Event.AggregateKey,
		Reason: "fixed", Actor: "plans-test"}); err != nil {
		t.Fatal(err)
	}
	if _, err := w.st.GetAggregate(ctx, "plans", leases[1].Event.AggregateKey); err != nil {
		t.Fatal(err)
	}
	if _, err := w.st.ExtendLease(ctx, leases[2].Event.ID, leases[2].Epoch, ttl); err != nil {
		t.Fatal(err)
	}
	if _, err := w.st.HeldEvents(ctx, holder); err != nil {
		t.Fatal(err)
	}
	if _, err := w.st.Release(ctx, holder); err != nil {
		t.Fatal(err)
	}
	if _, err := w.st.Lag(ctx, w.lagOf, time.Minute); err != nil {
		t.Fatal(err)
	}
	// The operator's reads: the dead letters of the stream, one
	// aggregate's attempts and events, the newest events and actions.
	// (Not the listing of a stream's pending or skipped events: with
	// published_at in no index, so that acks stay HOT updates, it reads
	// the stream's events whatever the plan.)
	parked := leases[1].Event
	if _, err := w.st.ListAggregates(ctx, store.AggregateFilter{Stream: "plans", States: []string{"parked", "backoff"}},
		store.AggregatePosition{}, 10); err != nil {
		t.Fatal(err)
	}
	if _, err := w.st.Attempts(ctx, store.AttemptsParams{Stream: "plans", AggregateKey: parked.AggregateKey, Limit: 10}); err != nil {
		t.Fatal(err)
	}
	if _, err := w.st.Attempts(ctx, store.AttemptsParams{EventID: parked.ID, Limit: 10}); err != nil {
		t.Fatal(err)
	}
	for _, p := range []store.ListEventsParams{
		{Stream: "plans", Limit: 10},
		{Stream: "plans", AggregateKey: parked.AggregateKey, Limit: 10},
		{EventID: parked.ID, Limit: 1},
	} {
		if _, err := w.st.ListEvents(ctx, p); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := w.st.ListActions(ctx, store.ListActionsParams{Limit: 10}); err != nil {
		t.Fatal(err)
	}
	if _, err := w.st.ListActions(ctx, store.ListActionsParams{Stream: "plans", AggregateKey: parked.AggregateKey, Limit: 10}); err != nil {
		t.Fatal(err)
	}
	if _, err := w.st.EventExists(ctx, parked.ID); err != nil {
		t.Fatal(err)
	}
	if _, err := w.st.PublishedAmong(ctx, acks); err != nil {
		t.Fatal(err)
	}
	if _, err := w.st.EventStreams(ctx, acks); err != nil {
		t.Fatal(err)
	}
	if _, err := w.st.KnownStreams(ctx, 10); err != nil {
		t.Fatal(err)
	}
	if _, err := w.st.Stranded(ctx); err != nil {
		t.Fatal(err)
	}
}

// planLog collects the plans auto_explain sends the client while started.
type planLog struct {
	mu      sync.Mutex
	on      bool
	plans   []loggedPlan
	garbled []string
}

type loggedPlan struct {
	query, plan string
	touched     int64
}

func (l *planLog) start() { l.mu.Lock(); l.on = true; l.mu.Unlock() }

// count is how many plans the log holds so far.
func (l *planLog) count() int { l.mu.Lock(); defer l.mu.Unlock(); return len(l.plans) }

// stop returns the plans read, and the messages that looked like plans but
// could not be read.
func (l *planLog) stop() (plans []loggedPlan, garbled []string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.on = false
	return slices.Clone(l.plans), slices.Clone(l.garbled)
}

func (l *planLog) add(n *pgconn.Notice) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.on || n.Severity != "LOG" {
		return
	}
	_, text, ok := strings.Cut(n.Message, "plan:\n")
	if !ok {
		return
	}
	var p struct {
		Query string    `json:"Query Text"`
		Plan  *planNode `json:"Plan"`
	}
	if err := json.Unmarshal([]byte(text), &p); err != nil || p.Plan == nil {
		l.garbled = append(l.garbled, n.Message)
		return
	}
	var b strings.Builder
	p.Plan.render(&b, 1)
	l.plans = append(l.plans, loggedPlan{query: p.Query, plan: b.String(), touched: p.Plan.touched()})
}

// planNode is the part of an EXPLAIN (FORMAT JSON, ANALYZE) node this test
// reads. Rows are averages over the node's loops.
type planNode struct {
	Type           string      `json:"Node Type"`
	Relation       string      `json:"Relation Name"`
	Index          string      `json:"Index Name"`
	Rows           float64     `json:"Actual Rows"`
	Loops          float64     `json:"Actual Loops"`
	Filtered       float64     `json:"Rows Removed by Filter"`
	JoinFiltered   float64     `json:"Rows Removed by Join Filter"`
	RecheckRemoved float64     `json:"Rows Removed by Index Recheck"`
	Plans          []*planNode `json:"Plans"`
}

// render writes the plan as one line per node, with what each touched.
func (n *planNode) render(b *strings.Builder, depth int) {
	fmt.Fprintf(b, "%s%s", strings.Repeat("  ", depth), n.Type)
	if n.Relation != "" {
		fmt.Fprintf(b, " on %s", n.Relation)
	}
	if n.Index != "" {
		fmt.Fprintf(b, " using %s", n.Index)
	}
	fmt.Fprintf(b, " (rows %.0f x loops %.0f", n.Rows, n.Loops)
	if removed := n.Filtered + n.JoinFiltered + n.RecheckRemoved; removed > 0 {
		fmt.Fprintf(b, ", removed %.0f", removed)
	}
	b.WriteString(")\n")
	for _, c := range n.Plans {
		c.render(b, depth+1)
	}
}

// touched is how many rows the plan's nodes produced or read and threw
// away, in all their loops.
func (n *planNode) touched() int64 {
	total := (n.Rows + n.Filtered + n.JoinFiltered + n.RecheckRemoved) * n.Loops
	for _, c := range n.Plans {
		total += float64(c.touched())
	}
	return int64(total)
}
