package bench

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	wsql "github.com/ThreeDotsLabs/watermill-sql/v4/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"

	"github.com/outboxd/outboxd/relay"
)

// The peers are built the way their users would build an outbox with them:
// the event is written by the library's own publish or insert call inside
// the producer's transaction, and the library's own consumer hands it to the
// sink. Neither library assigns per-aggregate revisions, so the producers
// number each aggregate's events in this process (keyedRevisions), holding
// the aggregate's lock across the transaction as outbox.emit's row lock
// does; that numbering is the ledger's bookkeeping and costs the database
// nothing, as for ceiling-insert.

// keyedRevisions hands out per-aggregate revisions in commit order: the
// aggregate's lock is held from the revision's assignment to the commit,
// and a failed transaction gives its revision back.
type keyedRevisions struct {
	mu   []sync.Mutex
	last []int64
}

func newKeyedRevisions(aggregates int) *keyedRevisions {
	return &keyedRevisions{mu: make([]sync.Mutex, aggregates), last: make([]int64, aggregates)}
}

// commit runs fn (one producer transaction) with the next revision of agg.
func (k *keyedRevisions) commit(agg int, fn func(rev int64) error) (int64, error) {
	k.mu[agg].Lock()
	defer k.mu[agg].Unlock()
	rev := k.last[agg] + 1
	if err := fn(rev); err != nil {
		return 0, err
	}
	k.last[agg] = rev
	return rev, nil
}

// watermillTopic is the topic every watermill arm publishes to; the queue
// schema keeps it in the table "watermill_bench".
const watermillTopic = "bench"

// watermillSchema and watermillOffsets are Watermill SQL's PostgreSQL queue
// adapters. An outbox has one consumer and wants its table to hold only
// pending work, which is what the queue schema is for (the default schema
// is a log with per-consumer-group offsets that keeps every message); the
// offsets adapter deletes a message once its handler acked it.
var (
	watermillSchema  = wsql.PostgreSQLQueueSchema{}
	watermillOffsets = wsql.PostgreSQLQueueOffsetsAdapter{DeleteOnAck: true}
)

// watermillTable is the table the queue schema keeps the topic in.
const watermillTable = "watermill_bench"

// watermillArm publishes with a Watermill SQL Publisher on the producer's
// transaction and consumes with one Watermill SQL Subscriber whose handler
// publishes to the sink and acks.
type watermillArm struct {
	// poll is the subscriber's poll interval; 0 is the library's default.
	poll time.Duration
	revs *keyedRevisions

	pool   *pgxpool.Pool
	sub    *wsql.Subscriber
	cancel context.CancelFunc
	done   chan struct{}
	mu     sync.Mutex
	errs   []error
}

// createWatermillTable creates the queue schema's table, as the library's
// InitializeSchema would on first use.
func createWatermillTable(ctx context.Context, pool *pgxpool.Pool) error {
	qs, err := watermillSchema.SchemaInitializingQueries(wsql.SchemaInitializingQueriesParams{Topic: watermillTopic})
	if err != nil {
		return err
	}
	for _, q := range qs {
		if _, err := pool.Exec(ctx, q.Query, q.Args...); err != nil {
			return fmt.Errorf("bench: create Watermill's queue table: %w", err)
		}
	}
	return nil
}

func (*watermillArm) delivers() bool { return true }

func (a *watermillArm) prepare(_ context.Context, env *armEnv, backlog int) error {
	if backlog > 0 {
		return errors.New("the watermill arm does not run the drain workload")
	}
	a.revs = newKeyedRevisions(env.aggregates)
	return nil
}

func (a *watermillArm) produce(ctx context.Context, conn *pgxpool.Conn, agg int, payload []byte) (int64, error) {
	return a.revs.commit(agg, func(rev int64) error {
		tx, err := conn.Begin(ctx)
		if err != nil {
			return err
		}
		defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
		pub, err := wsql.NewPublisher(wsql.TxFromPgx(tx), wsql.PublisherConfig{SchemaAdapter: watermillSchema}, nil)
		if err != nil {
			return err
		}
		msg := message.NewMessage(watermill.NewUUID(), payload)
		msg.Metadata.Set("agg", strconv.Itoa(agg))
		msg.Metadata.Set("rev", strconv.FormatInt(rev, 10))
		if err := pub.Publish(watermillTopic, msg); err != nil {
			return fmt.Errorf("bench: watermill publish: %w", err)
		}
		return tx.Commit(ctx)
	})
}

func (*watermillArm) startServer(context.Context, *armEnv) (serverHandle, error) { return nil, nil }

func (a *watermillArm) startDelivery(ctx context.Context, env *armEnv) error {
	var err error
	if a.pool, err = pgxpool.New(ctx, env.dbURL); err != nil {
		return err
	}
	a.sub, err = wsql.NewSubscriber(wsql.BeginnerFromPgx(a.pool), wsql.SubscriberConfig{
		SchemaAdapter: watermillSchema, OffsetsAdapter: watermillOffsets, PollInterval: a.poll,
	}, watermill.NewSlogLoggerWithLevelMapping(env.log, map[slog.Level]slog.Level{slog.LevelInfo: slog.LevelDebug}))
	if err != nil {
		return fmt.Errorf("bench: watermill subscriber: %w", err)
	}
	runCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	msgs, err := a.sub.Subscribe(runCtx, watermillTopic)
	if err != nil {
		cancel()
		return fmt.Errorf("bench: watermill subscribe: %w", err)
	}
	a.cancel, a.done = cancel, make(chan struct{})
	go func() {
		defer close(a.done)
		for msg := range msgs {
			if err := a.handle(runCtx, env.sink, msg); err != nil {
				a.fail(err)
				msg.Nack()
				continue
			}
			msg.Ack()
		}
	}()
	return nil
}

// handle is the subscriber's handler: it hands the message to the sink.
func (a *watermillArm) handle(ctx context.Context, sink relay.Publisher, msg *message.Message) error {
	rev, err := strconv.ParseInt(msg.Metadata.Get("rev"), 10, 64)
	if err != nil {
		return fmt.Errorf("bench: watermill message without a revision: %w", err)
	}
	return sink.Publish(ctx, relay.Event{
		ID: msg.UUID, Stream: benchStream, AggregateKey: msg.Metadata.Get("agg"), Revision: rev,
		Type: benchEventType, Payload: msg.Payload, Attempt: 1,
	})
}

func (a *watermillArm) fail(err error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.errs = append(a.errs, err)
}

func (a *watermillArm) stop(context.Context) error {
	if a.sub == nil {
		return nil
	}
	err := a.sub.Close()
	if a.cancel != nil {
		a.cancel()
		<-a.done
	}
	a.pool.Close()
	a.sub = nil
	a.mu.Lock()
	defer a.mu.Unlock()
	return errors.Join(append(a.errs, err)...)
}

// scan reports the messages still in the table; an acked message is
// deleted, so every committed event missing from the table was acked
// (deletesOnAck), and one that never reached the sink is lost.
func (*watermillArm) scan(ctx context.Context, pool *pgxpool.Pool, fn func(int, int64, int64) error) error {
	return scanEvents(ctx, pool,
		`SELECT metadata->>'agg', (metadata->>'rev')::bigint, NULL::timestamptz FROM `+watermillTable, fn)
}

func (*watermillArm) deletesOnAck() bool { return true }
func (*watermillArm) tables() string     { return "relname = '" + watermillTable + "'" }

// riverJobArgs is one event as a River job.
type riverJobArgs struct {
	Agg     int             `json:"agg"`
	Rev     int64           `json:"rev"`
	Payload json.RawMessage `json:"payload"`
}

func (riverJobArgs) Kind() string { return "bench_event" }

// riverWorker hands each job's event to the sink; an error makes River retry
// the job.
type riverWorker struct {
	river.WorkerDefaults[riverJobArgs]
	sink relay.Publisher
}

func (w *riverWorker) Work(ctx context.Context, job *river.Job[riverJobArgs]) error {
	return w.sink.Publish(ctx, relay.Event{
		ID: strconv.FormatInt(job.ID, 10), Stream: benchStream, AggregateKey: strconv.Itoa(job.Args.Agg),
		Revision: job.Args.Rev, Type: benchEventType, Payload: job.Args.Payload, Attempt: job.Attempt,
	})
}

// riverMaxWorkers is the default queue's worker count in River's own
// getting-started configuration.
const riverMaxWorkers = 100

// riverArm inserts one job per producer transaction with InsertTx and works
// them with a River client configured as River's documentation does.
type riverArm struct {
	revs   *keyedRevisions
	pool   *pgxpool.Pool
	client *river.Client[pgx.Tx]
	worker *riverWorker
	start  bool
}

// migrateRiver creates River's tables with its own migrator.
func migrateRiver(ctx context.Context, pool *pgxpool.Pool) error {
	m, err := rivermigrate.New(riverpgxv5.New(pool), nil)
	if err != nil {
		return err
	}
	if _, err := m.Migrate(ctx, rivermigrate.DirectionUp, nil); err != nil {
		return fmt.Errorf("bench: River's migrations: %w", err)
	}
	return nil
}

func (*riverArm) delivers() bool { return true }

func (a *riverArm) prepare(ctx context.Context, env *armEnv, backlog int) error {
	if backlog > 0 {
		return errors.New("the river arm does not run the drain workload")
	}
	a.revs = newKeyedRevisions(env.aggregates)
	var err error
	if a.pool, err = pgxpool.New(ctx, env.dbURL); err != nil {
		return err
	}
	a.worker = &riverWorker{sink: env.sink}
	workers := river.NewWorkers()
	river.AddWorker(workers, a.worker)
	a.client, err = river.NewClient(riverpgxv5.New(a.pool), &river.Config{
		Queues:  map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: riverMaxWorkers}},
		Workers: workers,
		Logger:  env.log,
	})
	if err != nil {
		a.pool.Close()
		a.pool = nil
		return fmt.Errorf("bench: river client: %w", err)
	}
	return nil
}

func (a *riverArm) produce(ctx context.Context, conn *pgxpool.Conn, agg int, payload []byte) (int64, error) {
	return a.revs.commit(agg, func(rev int64) error {
		tx, err := conn.Begin(ctx)
		if err != nil {
			return err
		}
		defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
		if _, err := a.client.InsertTx(ctx, tx, riverJobArgs{Agg: agg, Rev: rev, Payload: payload}, nil); err != nil {
			return fmt.Errorf("bench: river InsertTx: %w", err)
		}
		return tx.Commit(ctx)
	})
}

func (*riverArm) startServer(context.Context, *armEnv) (serverHandle, error) { return nil, nil }

func (a *riverArm) startDelivery(ctx context.Context, _ *armEnv) error {
	if err := a.client.Start(context.WithoutCancel(ctx)); err != nil {
		return fmt.Errorf("bench: river start: %w", err)
	}
	a.start = true
	return nil
}

// stop lets running jobs finish and their completions land, then closes.
func (a *riverArm) stop(ctx context.Context) error {
	var err error
	if a.start {
		stopCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
		err = a.client.Stop(stopCtx)
		cancel()
		a.start = false
	}
	if a.pool != nil {
		a.pool.Close()
		a.pool = nil
	}
	return err
}

func (*riverArm) scan(ctx context.Context, pool *pgxpool.Pool, fn func(int, int64, int64) error) error {
	return scanEvents(ctx, pool, `
		SELECT args->>'agg', (args->>'rev')::bigint, CASE WHEN state = 'completed' THEN finalized_at END
		FROM river_job`, fn)
}

func (*riverArm) deletesOnAck() bool { return false }
func (*riverArm) tables() string     { return "relname = 'river_job'" }
