package relay

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/outboxd/outboxd/client"
	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/servertest"
	"github.com/outboxd/outboxd/internal/testdb"
)

// These tests run the real runner against a real server replica on
// loopback (internal/servertest) and a real PostgreSQL (internal/testdb).
// Faults that a real server only shows under conditions a test cannot set
// up on demand (a network blip, a server failing one request) are injected
// by client interceptors on the runner's connection; everything else is the
// server's own answer.

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// bound is how long a test waits for anything before failing: a hang guard,
// not a timing assertion.
const bound = 30 * time.Second

// env is one database and one replica serving it.
type env struct {
	url  string
	pool *pgxpool.Pool
	srv  *servertest.Replica
}

func newEnv(t *testing.T, opts servertest.Options) *env {
	t.Helper()
	url := testdb.New(t)
	return &env{url: url, pool: testdb.NewPoolURL(t, url), srv: servertest.Start(t, url, opts)}
}

// emit commits one event of aggregate key in stream and returns its id.
func (e *env) emit(t *testing.T, stream, key string) string {
	t.Helper()
	ev, err := client.Emit(context.Background(), e.pool, client.Event{
		Stream: stream, AggregateKey: key, Type: "Changed", Payload: json.RawMessage(`{"k":"` + key + `"}`),
	})
	if err != nil {
		t.Fatal(err)
	}
	return ev.ID.String()
}

// published reports whether event id has published_at set.
func (e *env) published(t *testing.T, id string) bool {
	t.Helper()
	var p bool
	if err := e.pool.QueryRow(context.Background(),
		`SELECT published_at IS NOT NULL FROM outbox.event WHERE event_id = $1`, id).Scan(&p); err != nil {
		t.Fatal(err)
	}
	return p
}

// waitPublished waits until every id is published.
func (e *env) waitPublished(t *testing.T, ids ...string) {
	t.Helper()
	waitUntil(t, fmt.Sprintf("%d events published", len(ids)), func() bool {
		for _, id := range ids {
			if !e.published(t, id) {
				return false
			}
		}
		return true
	})
}

// aggregate reads aggregate key's delivery state through the AdminService
// (nil before the server has seen its first event).
func (e *env) aggregate(t *testing.T, stream, key string) *outboxv1.Aggregate {
	t.Helper()
	res, err := e.srv.Admin.GetAggregate(context.Background(), &outboxv1.GetAggregateRequest{Stream: stream, AggregateKey: key})
	if status.Code(err) == codes.NotFound {
		return nil
	}
	if err != nil {
		t.Fatal(err)
	}
	return res.GetAggregate()
}

// waitUntil polls cond (a database read: there is no signal to wait on)
// until it holds, failing the test after bound.
func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(bound)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("not reached within %v: %s", bound, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// waitSignal waits for c to deliver, failing the test after bound.
func waitSignal[T any](t *testing.T, what string, c <-chan T) T {
	t.Helper()
	select {
	case v := <-c:
		return v
	case <-time.After(bound):
		t.Fatalf("not reached within %v: %s", bound, what)
		var zero T
		return zero
	}
}

// dial connects to the replica with extra dial options (interceptors).
func (e *env) dial(t *testing.T, opts ...grpc.DialOption) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient(e.srv.Addr, append([]grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// running is a Runner started by start.
type running struct {
	*Runner
	cancel context.CancelFunc
	done   chan error
}

// start runs a runner until stop or the end of the test. Its logs go to
// the test.
func start(t *testing.T, cfg Config, h hooks) *running {
	t.Helper()
	return startCtx(t, context.Background(), cfg, h)
}

// startCtx is start with Run's context derived from parent, for tests
// about what that context carries (a span, say).
func startCtx(t *testing.T, parent context.Context, cfg Config, h hooks) *running {
	t.Helper()
	if cfg.Logger == nil {
		cfg.Logger = servertest.Logger(t)
	}
	r, err := NewRunner(cfg)
	if err != nil {
		t.Fatal(err)
	}
	r.hooks = h
	ctx, cancel := context.WithCancel(parent)
	run := &running{Runner: r, cancel: cancel, done: make(chan error, 1)}
	go func() { run.done <- r.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		select {
		case <-run.done:
		case <-time.After(bound):
			t.Errorf("Run did not return within %v of its context ending", bound)
		}
	})
	return run
}

// openAtEnd opens (closes) each gate still shut when the test ends. Called
// right after start, its cleanup runs before start's: a test that fails
// while a publish waits at a gate does not then wait out DrainTimeout for
// it. Only the test's goroutine may close the gates.
func openAtEnd(t *testing.T, gates ...chan struct{}) {
	t.Cleanup(func() {
		for _, g := range gates {
			select {
			case <-g:
			default:
				close(g)
			}
		}
	})
}

// stop cancels Run and returns its error.
func (r *running) stop(t *testing.T) error {
	t.Helper()
	r.cancel()
	err := waitSignal(t, "Run to return", r.done)
	r.done <- err // for the cleanup
	return err
}

// publisher is a Publisher whose behaviour each test sets: by default it
// accepts every event at once. It counts attempts per event and signals
// each publish that starts.
type publisher struct {
	mu       sync.Mutex
	attempts map[string]int
	started  chan Event
	// block, when set, makes Publish wait for it to close (then succeed)
	// or for its context to end.
	block chan struct{}
	// fail, when set, is returned by every Publish.
	fail error
	// cancelled is set when a Publish returned because its context ended,
	// and causes receives why that context ended (context.Cause).
	cancelled atomic.Bool
	causes    chan error
}

func newPublisher() *publisher {
	return &publisher{attempts: map[string]int{}, started: make(chan Event, 100), causes: make(chan error, 100)}
}

func (p *publisher) Publish(ctx context.Context, ev Event) error {
	p.mu.Lock()
	p.attempts[ev.ID]++
	p.mu.Unlock()
	select {
	case p.started <- ev:
	default:
	}
	if p.fail != nil {
		return p.fail
	}
	if p.block != nil {
		select {
		case <-p.block:
		case <-ctx.Done():
			p.cancelled.Store(true)
			select {
			case p.causes <- context.Cause(ctx):
			default: // as for started: no test waits for that many
			}
			return ctx.Err()
		}
	}
	return nil
}

func (p *publisher) attemptsOf(id string) int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.attempts[id]
}

// competitor is a second session on the replica with spare credit: if a
// lease the runner should hold lapses or is released, the event is
// delivered here.
type competitor struct {
	got chan *outboxv1.SubscribeResponse
}

func (e *env) competitor(t *testing.T, streams ...string) *competitor {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	st, err := e.srv.Relay.Subscribe(ctx, &outboxv1.SubscribeRequest{RelayId: "competitor", Streams: streams, MaxInFlight: 100})
	if err != nil {
		t.Fatal(err)
	}
	c := &competitor{got: make(chan *outboxv1.SubscribeResponse, 100)}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			d, err := st.Recv()
			if err != nil {
				return
			}
			c.got <- d
		}
	}()
	t.Cleanup(func() { cancel(); <-done })
	return c
}

// none fails the test if the competitor has received anything.
func (c *competitor) none(t *testing.T) {
	t.Helper()
	select {
	case d := <-c.got:
		t.Fatalf("event %s (attempt %d) was delivered to a second session: the runner's lease lapsed or was released",
			d.GetEvent().GetEventId(), d.GetAttempt())
	default:
	}
}

// streamLog records, on a connection dialled with its option, what the
// runner's Subscribe asked and what the server sent on the stream: each
// delivery in arrival order, with the lease epoch it came under, and how
// many deliveries each message carried. The tests check with it that events
// they mean to be under one lease were, and that a claim came in one
// message.
type streamLog struct {
	mu     sync.Mutex
	accept []bool      // accept_batches of each Subscribe
	got    []delivered // every delivery, in arrival order
	perMsg []int       // how many deliveries each message carried
}

// delivered is one delivery's revision and lease epoch.
type delivered struct{ revision, epoch int64 }

func (d delivered) String() string { return fmt.Sprintf("r%d@epoch%d", d.revision, d.epoch) }

// option records what the runner and the server sent: dialled after
// (inside) any interceptor that hides deliveries from the runner, it sees
// those too.
func (l *streamLog) option() grpc.DialOption {
	return grpc.WithChainStreamInterceptor(func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, m string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
		s, err := streamer(ctx, desc, cc, m, opts...)
		if err != nil {
			return nil, err
		}
		return streamLogStream{s, l}, nil
	})
}

type streamLogStream struct {
	grpc.ClientStream
	l *streamLog
}

func (s streamLogStream) SendMsg(m any) error {
	if req, ok := m.(*outboxv1.SubscribeRequest); ok {
		s.l.mu.Lock()
		s.l.accept = append(s.l.accept, req.GetAcceptBatches())
		s.l.mu.Unlock()
	}
	return s.ClientStream.SendMsg(m)
}

func (s streamLogStream) RecvMsg(m any) error {
	err := s.ClientStream.RecvMsg(m)
	res, ok := m.(*outboxv1.SubscribeResponse)
	if err != nil || !ok {
		return err
	}
	// A message carries its deliveries, or is itself the one delivery.
	ds := res.GetDeliveries()
	if len(ds) == 0 {
		ds = []*outboxv1.SubscribeResponse{res}
	}
	s.l.mu.Lock()
	defer s.l.mu.Unlock()
	for _, d := range ds {
		s.l.got = append(s.l.got, delivered{d.GetEvent().GetRevision(), d.GetLeaseEpoch()})
	}
	s.l.perMsg = append(s.l.perMsg, len(ds))
	return nil
}

// accepts returns the accept_batches of each Subscribe so far.
func (l *streamLog) accepts() []bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]bool(nil), l.accept...)
}

// deliveries returns the deliveries received so far.
func (l *streamLog) deliveries() []delivered {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]delivered(nil), l.got...)
}

// perMessage returns how many deliveries each message so far carried.
func (l *streamLog) perMessage() []int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]int(nil), l.perMsg...)
}
