package server_test

import (
	"context"
	"encoding/binary"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgconn/ctxwatch"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/durationpb"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/servertest"
	"github.com/outboxd/outboxd/internal/testdb"
)

// A relay that hangs up while its session's claim is in the database
// leaves no lease behind: the claim is not cancelled with the stream, so it
// returns its leases to the session, whose end releases them. Were it
// cancelled, the client would give up on the statement, the session would
// end and release what it held, and the statement, which a cancel request
// may reach too late (here it reaches it never), would still commit the
// lease to a session that is gone, holding the aggregate until the lease's
// TTL, an hour here.
//
// The claim is held by a test transaction that locks outbox.skipped_event,
// which the claim reads and the release does not. The stream is ended on
// the server's side through a context of the test's own, so that once its
// cancel function returns, every context derived from it is done: the test
// then knows whether the claim's context went with it (it did if the claim
// were cancelled with the stream) and, if so, waits until the client has
// given up and the session has ended before it lets the claim go on.
func TestARelayHangingUpDuringAClaimLeavesNoLease(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	url := testdb.New(t)
	pool := testdb.NewPoolURL(t, url)

	var mu sync.Mutex
	var claimCtx context.Context     // the context of the session's claim statement
	cancelled := make(chan struct{}) // the client gave up on the claim statement
	var endStream context.CancelFunc // ends the Subscribe stream on the server's side
	r := servertest.Start(t, url, servertest.Options{
		ConfigurePool: func(c *pgxpool.Config) {
			c.ConnConfig.Tracer = claimTracer(func(qctx context.Context) {
				mu.Lock()
				defer mu.Unlock()
				if claimCtx == nil {
					claimCtx = qctx
				}
			})
			// A cancel request never reaches the backend (neither the
			// watcher's nor the one pgx sends as it closes the connection):
			// only the client gives up, as when the request comes after the
			// statement went on.
			c.ConnConfig.DialFunc = dialDroppingCancelRequests
			c.ConnConfig.BuildContextWatcherHandler = func(pc *pgconn.PgConn) ctxwatch.Handler {
				return &cancelWatcher{inner: &pgconn.DeadlineContextWatcherHandler{Conn: pc.Conn()}, cancelled: func(qctx context.Context) {
					mu.Lock()
					defer mu.Unlock()
					if qctx == claimCtx {
						close(cancelled)
					}
				}}
			}
		},
		ServerOptions: []grpc.ServerOption{grpc.ChainStreamInterceptor(
			func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
				sctx, end := context.WithCancel(ss.Context())
				mu.Lock()
				endStream = end
				mu.Unlock()
				return handler(srv, &streamWithContext{ServerStream: ss, ctx: sctx})
			})},
	})
	r.Server.SetNoPolls()
	r.Server.SetReconcileTick(make(chan time.Time)) // never ticks

	emit(t, pool, "orders", "a", 1)
	waitDiscovered(t, pool, 1)
	hold, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer hold.Rollback(context.Background())
	if _, err := hold.Exec(ctx, `LOCK TABLE outbox.skipped_event IN ACCESS EXCLUSIVE MODE`); err != nil {
		t.Fatal(err)
	}
	st := subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 1, LeaseTtl: durationpb.New(time.Hour)})
	waitBlocked(t, ctx, pool, "the session's claim", "%outbox.claim(%")

	mu.Lock()
	end, qctx := endStream, claimCtx
	mu.Unlock()
	if end == nil || qctx == nil {
		t.Fatal("the stream's or the claim's context was not captured")
	}
	end()
	if qctx.Err() != nil {
		// Cancelled with the stream: let the statement go on only once the
		// client has given up on it and the session has ended (releasing
		// what it held then).
		select {
		case <-cancelled:
		case <-time.After(30 * time.Second): // a hang guard
			t.Fatal("the claim's context ended but its statement was not given up")
		}
		waitFor(t, func() int32 { return b2i(r.Server.Sessions() == 0) })
	}
	if err := hold.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Recv(); err == nil {
		t.Fatal("the ended stream delivered")
	}
	waitFor(t, func() int32 { return b2i(r.Server.Sessions() == 0) })
	eventually(t, func() (bool, string) {
		n := countWhere(t, pool, "pg_stat_activity", `datname = current_database() AND pid <> pg_backend_pid() AND state = 'active' AND query LIKE '%outbox.claim(%'`)
		return n == 0, fmt.Sprintf("%d claim statements still running", n)
	})
	if n := countWhere(t, pool, "outbox.delivery", "state = 'leased'"); n != 0 {
		t.Fatalf("%d lease(s) left to a session that is gone, until their TTL", n)
	}
	d := recv(t, subscribe(t, ctx, r, &outboxv1.SubscribeRequest{MaxInFlight: 1}))
	if d.GetEvent().GetAggregateKey() != "a" {
		t.Fatalf("delivered %s, want a", d.GetEvent().GetAggregateKey())
	}
}

// dialDroppingCancelRequests dials as pgx does, but a connection that
// opens with a cancel request is closed without sending it.
func dialDroppingCancelRequests(ctx context.Context, network, addr string) (net.Conn, error) {
	conn, err := (&net.Dialer{KeepAlive: 5 * time.Minute}).DialContext(ctx, network, addr)
	if err != nil {
		return nil, err
	}
	return &cancelDropper{Conn: conn}, nil
}

// cancelDropper is a connection to PostgreSQL that drops a cancel request
// (a first message of 16 bytes with code 80877102) and closes instead.
type cancelDropper struct {
	net.Conn
	started bool
}

func (c *cancelDropper) Write(b []byte) (int, error) {
	if !c.started {
		c.started = true
		if len(b) == 16 && binary.BigEndian.Uint32(b[4:8]) == 80877102 {
			c.Conn.Close()
			return len(b), nil
		}
	}
	return c.Conn.Write(b)
}

// claimTracer calls seen with the context of every outbox.claim statement.
type claimTracer func(ctx context.Context)

func (f claimTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, data pgx.TraceQueryStartData) context.Context {
	if strings.Contains(data.SQL, "outbox.claim(") {
		f(ctx)
	}
	return ctx
}

func (claimTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// cancelWatcher is a connection's context watcher handler that reports
// each statement context it gives up on.
type cancelWatcher struct {
	inner     ctxwatch.Handler
	cancelled func(ctx context.Context)
}

func (w *cancelWatcher) HandleCancel(ctx context.Context) {
	w.inner.HandleCancel(ctx)
	w.cancelled(ctx)
}

func (w *cancelWatcher) HandleUnwatchAfterCancel() { w.inner.HandleUnwatchAfterCancel() }

// streamWithContext is a server stream whose handler sees ctx, and that
// sends nothing once ctx is done, as a stream whose relay hung up.
type streamWithContext struct {
	grpc.ServerStream
	ctx context.Context
}

func (s *streamWithContext) Context() context.Context { return s.ctx }

func (s *streamWithContext) SendMsg(m any) error {
	if err := s.ctx.Err(); err != nil {
		return err
	}
	return s.ServerStream.SendMsg(m)
}
