package store

import (
	"context"
	"errors"
	"strings"
	"sync"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// The channels the outbox schema's functions and this package's operator
// actions notify on. Producers notify only ChannelDiscover, and only while a
// replica's discovery sleeps (see ListenConn.Sleep).
const (
	// ChannelWakeup: aggregates were made ready (a discovery round, a
	// release, an operator's retry).
	ChannelWakeup = "outbox_wakeup"
	// ChannelReleased: a lease ended away from its holder's replica (an ack
	// there, an operator's skip); the payload is the holder's session id.
	ChannelReleased = "outbox_released"
	// ChannelDiscover: a producer inserted an event while a replica's
	// discovery slept (the insert trigger notifies it at commit).
	ChannelDiscover = "outbox_discover"
	// DiscoverSettingsChanged is the payload of ChannelDiscover when
	// outbox.settings.producer_wakeups changed: a sleeping replica wakes and
	// tries again under the new setting.
	DiscoverSettingsChanged = "settings"
)

// ErrNotListening is what a ListenConn's statements return between
// connections.
var ErrNotListening = errors.New("store: the LISTEN connection is not up")

// ListenConn is the LISTEN connection as a ListenOp sees it: between waits
// for notifications, on the goroutine that waits, so its statements never
// race a wait.
type ListenConn struct{ conn *pgx.Conn }

// Sleep takes the discovery sleeper's lock for this connection's session
// (outbox.discovery_sleep), so that producers notify ChannelDiscover from
// now on; false when another session holds it or the database's
// producer_wakeups setting does not allow it. The lock lasts until Wake or
// the end of the session: a lost connection gives it back by itself, and
// producers stop notifying into it.
func (c *ListenConn) Sleep(ctx context.Context) (bool, error) {
	if c == nil {
		return false, ErrNotListening
	}
	var ok bool
	err := c.conn.QueryRow(ctx, `SELECT outbox.discovery_sleep()`).Scan(&ok)
	return ok, err
}

// MaySleep says whether the database's settings let a replica sleep
// (outbox.discovery_may_sleep).
func (c *ListenConn) MaySleep(ctx context.Context) (bool, error) {
	if c == nil {
		return false, ErrNotListening
	}
	var ok bool
	err := c.conn.QueryRow(ctx, `SELECT outbox.discovery_may_sleep()`).Scan(&ok)
	return ok, err
}

// Wake gives the sleeper's lock back (outbox.discovery_wake).
func (c *ListenConn) Wake(ctx context.Context) error {
	if c == nil {
		return ErrNotListening
	}
	_, err := c.conn.Exec(ctx, `SELECT outbox.discovery_wake()`)
	return err
}

// A ListenOp runs on the LISTEN connection between waits (c is nil while
// there is no connection).
type ListenOp func(ctx context.Context, c *ListenConn) error

// ListenOps hands ListenOps to a Listen. Send interrupts the connection's
// wait for notifications, so an op runs within a round trip, without a
// goroutine per wait to watch for it: the listener's every notification is
// a wake-up of an otherwise idle process, and its cost is what a quiet
// source's event pays (see server/doc.go, Discovery). The zero value is
// ready to use; one ListenOps serves one Listen at a time.
type ListenOps struct {
	mu    sync.Mutex
	queue []ListenOp
	// up: a Listen's loop runs; ops sent meanwhile wait in queue for it.
	up bool
	// interrupt ends the wait under way (nil between waits).
	interrupt context.CancelFunc
}

// Send has op run on the LISTEN connection between two waits, or at once
// with a nil ListenConn (on the caller's goroutine) when no connection
// listens. Every op sent runs exactly once; it never blocks on the
// connection.
func (q *ListenOps) Send(ctx context.Context, op ListenOp) {
	q.mu.Lock()
	if !q.up {
		q.mu.Unlock()
		_ = op(ctx, nil)
		return
	}
	q.queue = append(q.queue, op)
	if q.interrupt != nil {
		q.interrupt()
		q.interrupt = nil
	}
	q.mu.Unlock()
}

// start marks a Listen's loop as running.
func (q *ListenOps) start() {
	q.mu.Lock()
	q.up = true
	q.mu.Unlock()
}

// stop ends the loop: the ops still queued are told there is no
// connection, as are those sent from now on.
func (q *ListenOps) stop(ctx context.Context) {
	q.mu.Lock()
	q.up = false
	left := q.queue
	q.queue = nil
	q.mu.Unlock()
	for _, op := range left {
		_ = op(ctx, nil)
	}
}

// next takes the first queued op, if any; q.mu is held.
func (q *ListenOps) next() ListenOp {
	if len(q.queue) == 0 {
		return nil
	}
	op := q.queue[0]
	q.queue[0] = nil
	q.queue = q.queue[1:]
	return op
}

// Listen opens a connection of its own to databaseURL, named
// applicationName (operators find it in pg_stat_activity), LISTENs on
// channels, calls ready once it listens, and then notified for each
// notification (with the process id of the backend that sent it, and the
// connection, on which it may run statements; an error it returns ends the
// connection), and runs each op sent to ops between waits, until ctx ends,
// the connection fails or an op fails; it returns why. Every op sent runs:
// those that came as the connection failed run with a nil ListenConn. Not
// one of the pool's connections: a LISTEN binds its session, and waiting
// for notifications holds the connection for good.
func Listen(ctx context.Context, databaseURL, applicationName string, channels []string,
	ready func(), notified func(c *ListenConn, pid uint32, channel, payload string) error, ops *ListenOps) error {
	cfg, err := pgx.ParseConfig(databaseURL)
	if err != nil {
		return err
	}
	cfg.RuntimeParams["application_name"] = applicationName
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	// One statement for every channel: once the connection has run one
	// (pg_stat_activity), it listens on all of them.
	listen := make([]string, len(channels))
	for i, ch := range channels {
		listen[i] = "LISTEN " + pgx.Identifier{ch}.Sanitize()
	}
	if _, err := conn.Exec(ctx, strings.Join(listen, "; ")); err != nil {
		return err
	}
	ops.start()
	// Told there is no connection, rather than never answered.
	defer ops.stop(ctx)
	ready()
	lc := &ListenConn{conn: conn}
	for {
		n, op, err := ops.wait(ctx, conn)
		if err != nil {
			if op != nil {
				_ = op(ctx, nil)
			}
			return err
		}
		if op != nil {
			if err := op(ctx, lc); err != nil {
				return err
			}
		}
		if n != nil {
			if err := notified(lc, n.PID, n.Channel, n.Payload); err != nil {
				return err
			}
		}
	}
}

// wait waits for the next notification on conn or the next op, and returns
// what came (both, when they came together). An op interrupts the wait,
// which pgx ends by a read deadline without closing the connection (a
// timeout leaves it usable), so the op can run on it; a notification that
// arrives meanwhile stays queued in conn for the next wait.
func (q *ListenOps) wait(ctx context.Context, conn *pgx.Conn) (*pgconn.Notification, ListenOp, error) {
	q.mu.Lock()
	if op := q.next(); op != nil {
		q.mu.Unlock()
		return nil, op, nil
	}
	waitCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	q.interrupt = cancel
	q.mu.Unlock()
	n, err := conn.WaitForNotification(waitCtx)
	q.mu.Lock()
	q.interrupt = nil
	op := q.next()
	q.mu.Unlock()
	if op != nil && err != nil && ctx.Err() == nil && !conn.IsClosed() {
		// The wait ended for the op.
		err = nil
	}
	return n, op, err
}
