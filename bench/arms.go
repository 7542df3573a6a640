package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"runtime"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"golang.org/x/sync/errgroup"

	"github.com/outboxd/outboxd/client"
	"github.com/outboxd/outboxd/relay"
)

const (
	// benchStream and benchEventType name every event the benchmark writes.
	benchStream    = "bench"
	benchEventType = "BenchEvent"
	// payloadSize is the size of every event's JSON payload
	// (docs/benchmark.md: ~200 bytes).
	payloadSize = 200
	// drainRevisions is how many events each aggregate of a drain backlog
	// holds (docs/benchmark.md: N events across N/10 aggregates).
	drainRevisions = 10
	// backlogPad pads the drain backlog's payloads, built in SQL, to about
	// payloadSize: jsonb prints their other fields in about 55 bytes.
	backlogPad = payloadSize - 55
	// naivePollInterval is how long a naive poller waits after finding
	// nothing ("poll again later", as the textbook protocol says). Short, to give the
	// naive design its best latency.
	naivePollInterval = 10 * time.Millisecond
)

// appendPayload writes an event's JSON payload into buf: which producer
// wrote it and its sequence number among that producer's events (the sink's
// second order check), when it was sent, and padding to payloadSize.
func appendPayload(buf []byte, agg, producer int, seq, sentNs int64) []byte {
	buf = fmt.Appendf(buf[:0], `{"agg":"%d","p":%d,"seq":%d,"t":%d,"pad":"`, agg, producer, seq, sentNs)
	for len(buf) < payloadSize-2 {
		buf = append(buf, 'x')
	}
	return append(buf, `"}`...)
}

// payloadOrder is what the sink reads back from a payload.
type payloadOrder struct {
	Producer int   `json:"p"`
	Seq      int64 `json:"seq"`
}

// readPayloadOrder reads the producer and sequence number from a payload.
// Decoding the whole JSON document cost the sink 15% of the benchmark
// process's CPU in a drain, CPU the server and PostgreSQL need on a 2-core
// machine, so the two integer fields are found directly; anything
// unexpected falls back to encoding/json.
func readPayloadOrder(payload []byte) (payloadOrder, error) {
	p, okP := intField(payload, `"p":`)
	seq, okSeq := intField(payload, `"seq":`)
	if okP && okSeq {
		return payloadOrder{Producer: int(p), Seq: seq}, nil
	}
	order := payloadOrder{Producer: -1}
	err := json.Unmarshal(payload, &order)
	return order, err
}

// intField finds key (with its colon) in a flat JSON object and parses the
// integer after it. The benchmark's payloads hold no string that could
// contain a key.
func intField(doc []byte, key string) (int64, bool) {
	i := bytes.Index(doc, []byte(key))
	if i < 0 {
		return 0, false
	}
	rest := bytes.TrimLeft(doc[i+len(key):], " ")
	end := 0
	for end < len(rest) && (rest[end] == '-' || rest[end] >= '0' && rest[end] <= '9') {
		end++
	}
	n, err := strconv.ParseInt(string(rest[:end]), 10, 64)
	return n, err == nil
}

// countingSink is the Publisher every delivering arm hands events to. It
// waits the configured latency, as a broker round trip would, and then
// records the delivery in the ledger: a publish returns only after the
// "broker" has the event, as relay.Publisher requires.
type countingSink struct {
	latency time.Duration
	ledger  *Ledger
	// next, when set, is a real broker that must accept the event first.
	next relay.Publisher

	mu     sync.Mutex
	errors int64
	first  error
}

func (s *countingSink) Publish(ctx context.Context, ev relay.Event) error {
	if s.latency > 0 {
		time.Sleep(s.latency)
	}
	if s.next != nil {
		if err := s.next.Publish(ctx, ev); err != nil {
			return err // offered again, as a failed broker publish is
		}
	}
	at := time.Now().UnixNano()
	agg, err := strconv.Atoi(ev.AggregateKey)
	if err != nil {
		s.fail(fmt.Errorf("bench: sink got aggregate key %q, which no producer writes", ev.AggregateKey))
		return nil // a retry would not make it better
	}
	order, err := readPayloadOrder(ev.Payload)
	if err != nil {
		s.fail(fmt.Errorf("bench: sink got a payload that is not the benchmark's: %w", err))
		return nil
	}
	if _, err := s.ledger.Deliver(agg, ev.Revision, order.Producer, order.Seq, at); err != nil {
		s.fail(err)
	}
	return nil
}

func (s *countingSink) fail(err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.errors++
	if s.first == nil {
		s.first = err
	}
}

// err reports the first malformed delivery, if any.
func (s *countingSink) err() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.first == nil {
		return nil
	}
	return fmt.Errorf("%d malformed deliveries; the first: %w", s.errors, s.first)
}

// armEnv is what an arm works with: its fresh database and the run's
// shared bookkeeping.
type armEnv struct {
	cfg        *Config
	dbName     string
	dbURL      string
	pool       *pgxpool.Pool // producers and setup
	ledger     *Ledger
	sink       *countingSink
	aggregates int
	// revisions is how many events each aggregate of a drain backlog has
	// (all of it on one aggregate in hot-drain).
	revisions int
	// relays is how many relays (or pollers) deliver: Config.Relays, or
	// Config.ManyRelays in the many-relays workload.
	relays int
	// replicas is how many outboxd servers share the database (the
	// replicas workload); the relays spread over them.
	replicas    int
	maxInFlight int
	// window is the relays' max_in_flight_per_aggregate (0: 1).
	window int
	log    *slog.Logger
}

// arm is one way of getting events from producers to the sink.
type arm interface {
	// delivers says whether the arm delivers to the sink; the ceilings only
	// commit.
	delivers() bool
	// prepare readies the fresh database: the rows every workload needs
	// and, when backlog > 0, that many pending events across backlog/10
	// aggregates, recorded in the ledger.
	prepare(ctx context.Context, env *armEnv, backlog int) error
	// produce commits one event of aggregate agg in a transaction of its
	// own and returns its revision.
	produce(ctx context.Context, conn *pgxpool.Conn, agg int, payload []byte) (int64, error)
	// startServer starts what must run before the measured window opens;
	// it returns nil when there is no server.
	startServer(ctx context.Context, env *armEnv) (serverHandle, error)
	// startDelivery starts taking events to the sink.
	startDelivery(ctx context.Context, env *armEnv) error
	// stop stops delivery, letting publishes under way finish, then the
	// server. It is safe to call when nothing was started.
	stop(ctx context.Context) error
	// scan reports every event the database holds (publishedNs 0: pending;
	// publishedUnknown: published, time not recorded).
	scan(ctx context.Context, pool *pgxpool.Pool, fn func(agg int, rev, publishedNs int64) error) error
	// deletesOnAck says a delivered event leaves the table, so an event
	// scan does not find was acked (if it reached the sink) or lost.
	deletesOnAck() bool
	// tables is a condition on pg_stat_user_tables naming the tables the
	// arm writes, whose dead tuples and growth the report shows.
	tables() string
}

// publishedUnknown is what scan reports for an event the database records
// as delivered without a time.
const publishedUnknown = -1

func newArm(name string, cfg *Config) arm {
	switch name {
	case ArmCeilingInsert:
		return &ceilingArm{mark: false}
	case ArmCeilingInsertMark:
		return &ceilingArm{mark: true}
	case ArmNaivePoller:
		return &naiveArm{}
	case ArmEmit:
		return &producerArm{trigger: false}
	case ArmInsertTrigger:
		return &producerArm{trigger: true}
	case ArmWatermill:
		return &watermillArm{}
	case ArmWatermill10ms:
		return &watermillArm{poll: 10 * time.Millisecond}
	case ArmRiver:
		return &riverArm{}
	default:
		return &outboxdArm{binary: cfg.ServerBinary, flags: cfg.ServeFlags}
	}
}

// ceilingArm inserts into bench.ceiling_event and, with mark, sets
// published_at in a second transaction.
type ceilingArm struct{ mark bool }

func (*ceilingArm) delivers() bool                                             { return false }
func (*ceilingArm) prepare(context.Context, *armEnv, int) error                { return nil }
func (*ceilingArm) startServer(context.Context, *armEnv) (serverHandle, error) { return nil, nil }
func (*ceilingArm) startDelivery(context.Context, *armEnv) error               { return nil }
func (*ceilingArm) stop(context.Context) error                                 { return nil }
func (*ceilingArm) scan(context.Context, *pgxpool.Pool, func(int, int64, int64) error) error {
	return nil
}
func (*ceilingArm) deletesOnAck() bool { return false }
func (*ceilingArm) tables() string     { return "schemaname = 'bench' AND relname = 'ceiling_event'" }

func (c *ceilingArm) produce(ctx context.Context, conn *pgxpool.Conn, agg int, payload []byte) (int64, error) {
	var id [16]byte
	var rev int64
	if err := conn.QueryRow(ctx,
		`INSERT INTO bench.ceiling_event (stream, aggregate_key, event_type, payload)
		 VALUES ($1, $2, $3, $4::jsonb) RETURNING event_id, revision`,
		benchStream, strconv.Itoa(agg), benchEventType, string(payload)).Scan(&id, &rev); err != nil {
		return 0, fmt.Errorf("bench: ceiling insert: %w", err)
	}
	if c.mark {
		if _, err := conn.Exec(ctx,
			`UPDATE bench.ceiling_event SET published_at = clock_timestamp()
			 WHERE event_id = $1 AND published_at IS NULL`, id); err != nil {
			return 0, fmt.Errorf("bench: ceiling mark: %w", err)
		}
	}
	return rev, nil
}

// producerArm is the producer workload's outbox path: outbox.emit, the
// function producers in any language call, or with trigger client.Emit, the
// Go producers' path, a plain INSERT into outbox.event that leaves the
// revision to the table's trigger. Nothing delivers.
type producerArm struct{ trigger bool }

func (*producerArm) delivers() bool                                             { return false }
func (*producerArm) prepare(context.Context, *armEnv, int) error                { return nil }
func (*producerArm) startServer(context.Context, *armEnv) (serverHandle, error) { return nil, nil }
func (*producerArm) startDelivery(context.Context, *armEnv) error               { return nil }
func (*producerArm) stop(context.Context) error                                 { return nil }
func (*producerArm) scan(context.Context, *pgxpool.Pool, func(int, int64, int64) error) error {
	return nil
}
func (*producerArm) deletesOnAck() bool { return false }
func (*producerArm) tables() string     { return "schemaname = 'outbox'" }

func (a *producerArm) produce(ctx context.Context, conn *pgxpool.Conn, agg int, payload []byte) (int64, error) {
	if a.trigger {
		e, err := client.Emit(ctx, conn, client.Event{
			Stream: benchStream, AggregateKey: strconv.Itoa(agg), Type: benchEventType, Payload: payload,
		})
		return e.Revision, err
	}
	var rev int64
	if err := conn.QueryRow(ctx, `SELECT revision FROM outbox.emit($1, $2, $3, $4::jsonb)`,
		benchStream, strconv.Itoa(agg), benchEventType, string(payload)).Scan(&rev); err != nil {
		return 0, fmt.Errorf("bench: outbox.emit: %w", err)
	}
	return rev, nil
}

// outboxdArm produces through client.Emit (a plain INSERT) and delivers with
// the real server and K relay runners over loopback gRPC.
type outboxdArm struct {
	binary string
	flags  []string // extra serve flags
	server serverHandle
	relays *relayFleet
}

func (*outboxdArm) delivers() bool { return true }

func (*outboxdArm) prepare(ctx context.Context, env *armEnv, backlog int) error {
	if backlog == 0 {
		return nil
	}
	// Through the trigger, as a producer would, with explicit revisions
	// 1..env.revisions per aggregate (10; all of it on one aggregate in
	// hot-drain): the bookkeeping is the real one. Chunks of aggregates go
	// to parallel connections; no two touch one aggregate.
	aggs := backlog / env.revisions
	fmt.Fprintf(env.cfg.Progress, "        filling %s pending events through outbox.event's trigger...\n", fmtCount(backlog))
	const chunk = 2_000
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(runtime.NumCPU())
	for from := 0; from < aggs; from += chunk {
		to := min(from+chunk, aggs) - 1
		g.Go(func() error {
			_, err := env.pool.Exec(gctx, `
				INSERT INTO outbox.event (stream, aggregate_key, revision, event_type, payload)
				SELECT $1, a::text, r, $2,
				       jsonb_build_object('agg', a::text, 'p', -1, 'seq', 0, 't', 0, 'pad', repeat('x', $3::int))
				FROM generate_series($4::int, $5::int) a, generate_series(1, $6::int) r
				ORDER BY a, r`,
				benchStream, benchEventType, backlogPad, from, to, env.revisions)
			return err
		})
	}
	if err := g.Wait(); err != nil {
		return fmt.Errorf("bench: fill the drain backlog: %w", err)
	}
	return settleBacklog(ctx, env, aggs, env.revisions)
}

func (*outboxdArm) produce(ctx context.Context, conn *pgxpool.Conn, agg int, payload []byte) (int64, error) {
	e, err := client.Emit(ctx, conn, client.Event{
		Stream: benchStream, AggregateKey: strconv.Itoa(agg), Type: benchEventType, Payload: payload,
	})
	return e.Revision, err
}

func (a *outboxdArm) startServer(ctx context.Context, env *armEnv) (serverHandle, error) {
	if env.replicas > 1 {
		rs, err := startReplicaSet(ctx, env.replicas, a.binary, a.flags, env.dbURL, logWriter{env.log})
		if err != nil {
			return nil, err
		}
		a.server = rs
		return a.server, nil
	}
	// Assigned only on success: a nil *childServer in the interface would
	// not compare equal to nil in stop.
	s, err := startChildServer(ctx, a.binary, a.flags, env.dbURL, logWriter{env.log})
	if err != nil {
		return nil, err
	}
	a.server = s
	return a.server, nil
}

func (a *outboxdArm) startDelivery(ctx context.Context, env *armEnv) error {
	var err error
	a.relays, err = startRelays(ctx, a.server.addrs(), env.relays, env.maxInFlight, env.window, env.sink, env.log)
	return err
}

func (a *outboxdArm) stop(ctx context.Context) error {
	var errs []error
	if a.relays != nil {
		errs = append(errs, a.relays.stop())
		a.relays = nil
	}
	if a.server != nil {
		errs = append(errs, a.server.died(), a.server.stop(ctx))
		a.server = nil
	}
	return errors.Join(errs...)
}

func (*outboxdArm) scan(ctx context.Context, pool *pgxpool.Pool, fn func(int, int64, int64) error) error {
	return scanEvents(ctx, pool,
		`SELECT aggregate_key, revision, published_at FROM outbox.event WHERE stream = 'bench'`, fn)
}

func (*outboxdArm) deletesOnAck() bool { return false }
func (*outboxdArm) tables() string     { return "schemaname = 'outbox'" }

// naiveArm is the textbook outbox protocol done in SQL by K workers: lock an
// aggregate with pending events FOR UPDATE SKIP LOCKED, select its earliest
// pending event FOR UPDATE, publish while holding the transaction, mark,
// commit.
type naiveArm struct {
	pool   *pgxpool.Pool
	stopCh chan struct{}
	wg     sync.WaitGroup
	mu     sync.Mutex
	errs   []error
}

// The textbook SQL, with its tables renamed to the benchmark's.
const (
	naiveProduce = `
		WITH changed AS (
		    UPDATE bench.naive_aggregate SET revision = revision + 1
		    WHERE aggregate_key = $1
		    RETURNING aggregate_key, revision
		)
		INSERT INTO bench.naive_event (stream, aggregate_key, revision, event_type, payload)
		SELECT 'bench', aggregate_key, revision, 'BenchEvent', $2::jsonb FROM changed
		RETURNING revision`
	naiveLockAggregate = `
		SELECT o.aggregate_key FROM bench.naive_aggregate AS o
		WHERE EXISTS (
		    SELECT 1 FROM bench.naive_event AS e
		    WHERE e.aggregate_key = o.aggregate_key AND e.published_at IS NULL
		)
		ORDER BY o.aggregate_key LIMIT 1
		FOR UPDATE OF o SKIP LOCKED`
	naiveHeadEvent = `
		SELECT event_id::text, revision, event_type, payload::text, created_at FROM bench.naive_event
		WHERE aggregate_key = $1 AND published_at IS NULL
		ORDER BY revision LIMIT 1 FOR UPDATE`
	naiveMark = `
		UPDATE bench.naive_event SET published_at = clock_timestamp()
		WHERE event_id = $1::uuid AND published_at IS NULL
		RETURNING event_id`
)

func (*naiveArm) delivers() bool { return true }

func (*naiveArm) prepare(ctx context.Context, env *armEnv, backlog int) error {
	if backlog == 0 {
		_, err := env.pool.Exec(ctx,
			`INSERT INTO bench.naive_aggregate (aggregate_key) SELECT a::text FROM generate_series(0, $1::int - 1) a`,
			env.aggregates)
		if err != nil {
			return fmt.Errorf("bench: create the naive poller's aggregates: %w", err)
		}
		return nil
	}
	aggs := backlog / drainRevisions
	if _, err := env.pool.Exec(ctx, `
		INSERT INTO bench.naive_aggregate (aggregate_key, revision)
		SELECT a::text, $2 FROM generate_series(0, $1::int - 1) a`, aggs, drainRevisions); err != nil {
		return fmt.Errorf("bench: fill the drain backlog: %w", err)
	}
	if _, err := env.pool.Exec(ctx, `
		INSERT INTO bench.naive_event (stream, aggregate_key, revision, event_type, payload)
		SELECT $1, a::text, r, $2,
		       jsonb_build_object('agg', a::text, 'p', -1, 'seq', 0, 't', 0, 'pad', repeat('x', $3::int))
		FROM generate_series(0, $4::int - 1) a, generate_series(1, $5::int) r
		ORDER BY a, r`, benchStream, benchEventType, backlogPad, aggs, drainRevisions); err != nil {
		return fmt.Errorf("bench: fill the drain backlog: %w", err)
	}
	return settleBacklog(ctx, env, aggs, drainRevisions)
}

func (*naiveArm) produce(ctx context.Context, conn *pgxpool.Conn, agg int, payload []byte) (int64, error) {
	var rev int64
	if err := conn.QueryRow(ctx, naiveProduce, strconv.Itoa(agg), string(payload)).Scan(&rev); err != nil {
		return 0, fmt.Errorf("bench: naive produce: %w", err)
	}
	return rev, nil
}

func (*naiveArm) startServer(context.Context, *armEnv) (serverHandle, error) { return nil, nil }

func (a *naiveArm) startDelivery(ctx context.Context, env *armEnv) error {
	cfg, err := pgxpool.ParseConfig(env.dbURL)
	if err != nil {
		return err
	}
	cfg.MaxConns = int32(env.cfg.Relays)
	if a.pool, err = pgxpool.NewWithConfig(ctx, cfg); err != nil {
		return err
	}
	a.stopCh = make(chan struct{})
	for range env.cfg.Relays {
		a.wg.Add(1)
		go func() {
			defer a.wg.Done()
			if err := a.work(ctx, env.sink); err != nil {
				a.mu.Lock()
				a.errs = append(a.errs, err)
				a.mu.Unlock()
			}
		}()
	}
	return nil
}

// work polls until stopped; a transaction under way is finished first.
func (a *naiveArm) work(ctx context.Context, sink relay.Publisher) error {
	conn, err := a.pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer conn.Release()
	for {
		select {
		case <-a.stopCh:
			return nil
		default:
		}
		found, err := a.pollOnce(ctx, conn, sink)
		if err != nil {
			return fmt.Errorf("bench: naive poller: %w", err)
		}
		if !found {
			select {
			case <-a.stopCh:
				return nil
			case <-time.After(naivePollInterval):
			}
		}
	}
}

// pollOnce runs one transaction of the textbook protocol; found is false
// when no aggregate had a pending event that was not locked.
func (a *naiveArm) pollOnce(ctx context.Context, conn *pgxpool.Conn, sink relay.Publisher) (found bool, err error) {
	tx, err := conn.Begin(ctx)
	if err != nil {
		return false, err
	}
	defer func() {
		if err != nil || !found {
			_ = tx.Rollback(context.WithoutCancel(ctx))
		}
	}()
	var key string
	if err := tx.QueryRow(ctx, naiveLockAggregate).Scan(&key); errors.Is(err, pgx.ErrNoRows) {
		return false, nil
	} else if err != nil {
		return false, err
	}
	var ev relay.Event
	if err := tx.QueryRow(ctx, naiveHeadEvent, key).
		Scan(&ev.ID, &ev.Revision, &ev.Type, &ev.Payload, &ev.CreatedAt); errors.Is(err, pgx.ErrNoRows) {
		return false, nil
	} else if err != nil {
		return false, err
	}
	ev.Stream, ev.AggregateKey, ev.Attempt = benchStream, key, 1
	// Publish while the aggregate stays locked: no other poller can pass
	// this event; a failed publish rolls back and the event comes again.
	if err := sink.Publish(ctx, ev); err != nil {
		return false, err
	}
	if _, err := tx.Exec(ctx, naiveMark, ev.ID); err != nil {
		return false, err
	}
	return true, tx.Commit(ctx)
}

func (a *naiveArm) stop(context.Context) error {
	if a.stopCh == nil {
		return nil
	}
	close(a.stopCh)
	a.wg.Wait()
	a.pool.Close()
	a.stopCh = nil
	a.mu.Lock()
	defer a.mu.Unlock()
	return errors.Join(a.errs...)
}

func (*naiveArm) scan(ctx context.Context, pool *pgxpool.Pool, fn func(int, int64, int64) error) error {
	return scanEvents(ctx, pool, `SELECT aggregate_key, revision, published_at FROM bench.naive_event`, fn)
}

func (*naiveArm) deletesOnAck() bool { return false }
func (*naiveArm) tables() string     { return "schemaname = 'bench' AND relname LIKE 'naive\\_%'" }

// scanEvents streams (aggregate_key, revision, published_at) rows to fn.
func scanEvents(ctx context.Context, pool *pgxpool.Pool, query string, fn func(int, int64, int64) error) error {
	rows, err := pool.Query(ctx, query)
	if err != nil {
		return fmt.Errorf("bench: read back events: %w", err)
	}
	defer rows.Close()
	var (
		key       string
		rev       int64
		published *time.Time
	)
	for rows.Next() {
		if err := rows.Scan(&key, &rev, &published); err != nil {
			return fmt.Errorf("bench: read back events: %w", err)
		}
		agg, err := strconv.Atoi(key)
		if err != nil {
			return fmt.Errorf("bench: the database holds an event of aggregate %q, which no producer writes", key)
		}
		var publishedNs int64
		if published != nil {
			publishedNs = published.UnixNano()
		}
		if err := fn(agg, rev, publishedNs); err != nil {
			return err
		}
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("bench: read back events: %w", err)
	}
	return nil
}

// settleBacklog records a freshly filled backlog in the ledger, then
// vacuums, analyzes and checkpoints, so that the drain measures delivery and
// not the fill's aftermath (autovacuum's first pass, a checkpoint forced by
// the fill's WAL).
func settleBacklog(ctx context.Context, env *armEnv, aggs, revisions int) error {
	for agg := range aggs {
		if err := env.ledger.Prefill(agg, int64(revisions)); err != nil {
			return err
		}
	}
	for _, stmt := range []string{"VACUUM (ANALYZE)", "CHECKPOINT"} {
		if _, err := env.pool.Exec(ctx, stmt); err != nil {
			return fmt.Errorf("bench: %s after the fill: %w", stmt, err)
		}
	}
	return nil
}

// logWriter turns a child server's stderr lines into warnings.
type logWriter struct{ log *slog.Logger }

func (w logWriter) Write(p []byte) (int, error) {
	w.log.Warn(string(trimNewline(p)))
	return len(p), nil
}

func trimNewline(p []byte) []byte {
	for len(p) > 0 && (p[len(p)-1] == '\n' || p[len(p)-1] == '\r') {
		p = p[:len(p)-1]
	}
	return p
}
