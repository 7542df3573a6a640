package server

import (
	"context"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/google/uuid"

	"github.com/outboxd/outboxd/internal/store"
)

// ListenerApplicationName is the application_name of a replica's LISTEN
// connection, followed by a space and the replica's id.
const ListenerApplicationName = "outboxd-listener"

// waker owns the replica's LISTEN connection. It wakes idle sessions when a
// discovery round (on any replica) found new events, and routes "lease
// released" notices from other replicas to the local session holding the
// lease. Notifications only cut latency: every session's poll group also
// polls, so a lost notification or a dropped connection delays an event by
// at most Config.PollInterval and never strands it.
//
// It also holds the discovery loop's sleep (see doc.go, Discovery): the
// sleeper's lock is taken on this connection (sleep), so that a lost
// connection gives it back by itself and producers stop notifying a
// listener that is not there, and the loop is told (discoverWake) when a
// producer's notice comes while it sleeps or the connection is lost.
//
// A round of this replica that made rows ready wakes the local sessions
// itself, as soon as it has committed; its own NOTIFY, which comes back on
// this connection, would wake them a second time for the same work. So the
// waker does not act on it: the round tells the waker which backend it runs
// on before it commits (openRound), a wake-up from that backend while the
// round is open is the round's, and one that has not arrived when the round
// ends is the next to come from that backend (notifications of one backend
// arrive in commit order), unless the connection was lost meanwhile.
type waker struct {
	s *Server

	mu sync.Mutex
	// connected: LISTEN is registered on the current connection, whose
	// generation is gen (raised at every connect and loss).
	connected bool
	gen       uint64
	// open maps the backend of a round under way to what was seen of it.
	open map[uint32]*roundEcho
	// expect counts, per backend, the echoes of ended rounds still to
	// arrive on the current connection.
	expect map[uint32]int
	// asleep: the discovery loop sleeps, holding the sleeper's lock on the
	// current connection.
	asleep bool

	// ops run on the LISTEN connection between its waits (store.ListenOp).
	ops store.ListenOps
}

// roundEcho is a round under way, as the listener sees it.
type roundEcho struct {
	gen  uint64
	seen bool // a wake-up from its backend arrived while it was open
}

func newWaker(s *Server) *waker {
	return &waker{s: s, open: make(map[uint32]*roundEcho), expect: make(map[uint32]int)}
}

// sleep takes the sleeper's lock on the LISTEN connection and reports
// whether the discovery loop now sleeps: producers that commit from here on
// notify store.ChannelDiscover, which wakes the loop through discoverWake.
// False when there is no connection, another replica sleeps, the database's
// settings do not allow it, or ctx ends.
func (w *waker) sleep(ctx context.Context) bool {
	reply := make(chan bool, 1)
	op := func(ctx context.Context, c *store.ListenConn) error {
		ok, err := c.Sleep(ctx)
		if err != nil && c != nil {
			// The connection's next wait fails if it is lost; a statement
			// that failed on its own (a schema not migrated yet) only
			// keeps the loop awake.
			w.s.log.Warn("discovery could not sleep; it keeps checking", "err", err)
		}
		w.mu.Lock()
		w.setAsleep(ok && err == nil && w.connected)
		ok = w.asleep
		w.mu.Unlock()
		reply <- ok
		return nil
	}
	w.ops.Send(ctx, op)
	select {
	case ok := <-reply:
		return ok
	case <-ctx.Done():
		return false
	}
}

// setAsleep records whether the loop sleeps, for the loop and the
// outboxd_discovery_asleep gauge; w.mu is held.
func (w *waker) setAsleep(asleep bool) {
	w.asleep = asleep
	v := 0.0
	if asleep {
		v = 1
	}
	w.s.metrics.discoveryAsleep.Set(v)
}

// isAsleep says whether the discovery loop sleeps.
func (w *waker) isAsleep() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.asleep
}

// wakeUp ends the discovery loop's sleep: asleep is cleared at once, and
// the sleeper's lock is given back by an op queued on the LISTEN
// connection. The loop does not wait for it (a listener busy with
// notifications would hold it up for nothing): ops run in the order they
// were sent, so the give-back comes before any later try to sleep, and
// producers stop notifying within a round trip.
func (w *waker) wakeUp(ctx context.Context) {
	w.mu.Lock()
	asleep := w.asleep
	w.setAsleep(false)
	w.mu.Unlock()
	if !asleep {
		return
	}
	w.ops.Send(ctx, func(ctx context.Context, c *store.ListenConn) error {
		if err := c.Wake(ctx); err != nil && c != nil {
			return err // the lock stays while the session does: reconnect
		}
		return nil
	})
}

// settingsChanged acts on a change of the database's producer_wakeups, on
// the LISTEN connection c: a sleeping loop that the settings no longer let
// sleep gives the lock back at once and is woken; otherwise nothing changes
// (a notice of a change made before the loop fell asleep, say). An error
// leaves the connection in doubt: it is closed, which gives the lock back.
func (w *waker) settingsChanged(ctx context.Context, c *store.ListenConn) error {
	if !w.isAsleep() {
		return nil
	}
	ok, err := c.MaySleep(ctx)
	if err != nil || ok {
		return err
	}
	if err := c.Wake(ctx); err != nil {
		return err
	}
	w.mu.Lock()
	w.setAsleep(false)
	w.mu.Unlock()
	w.woken()
	return nil
}

// woken tells a sleeping discovery loop to run a round.
func (w *waker) woken() {
	select {
	case w.s.discoverWake <- struct{}{}:
	default:
	}
}

// openRound says a discovery round of this replica is about to apply on
// backend pid.
func (w *waker) openRound(pid uint32) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.connected {
		w.open[pid] = &roundEcho{gen: w.gen}
	}
}

// closeRound ends the round on backend pid. notified says the round
// committed a NOTIFY outbox_wakeup (it made rows ready and the caller wakes
// the local sessions for them): its echo, if not seen yet, is expected.
// seen reports a wake-up from the backend while the round was open, which
// the caller must act on (wake the sessions) if the round did not notify.
func (w *waker) closeRound(pid uint32, notified bool) (seen bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	e := w.open[pid]
	if e == nil {
		return false
	}
	delete(w.open, pid)
	if notified && !e.seen && w.connected && e.gen == w.gen {
		w.expect[pid]++
	}
	return e.seen
}

// echo reports whether a wake-up from backend pid is a local round's own
// (and so already acted on), taking it into account.
func (w *waker) echo(pid uint32) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	if e := w.open[pid]; e != nil {
		e.seen = true
		return true
	}
	if w.expect[pid] > 0 {
		w.expect[pid]--
		if w.expect[pid] == 0 {
			delete(w.expect, pid)
		}
		return true
	}
	return false
}

// listening records a connect (up) or the loss of the connection: echoes
// expected on the previous one will not come.
func (w *waker) listening(up bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.connected = up
	w.gen++
	clear(w.expect)
	if !up && w.asleep {
		// The lock went with the session: producers no longer notify, so
		// the loop must check again, and a notice sent before the loss
		// may not have come.
		w.setAsleep(false)
		w.woken()
	}
}

// broadcast wakes one idle session of every poll group (see pollGroup):
// work of any stream may have become claimable.
func (w *waker) broadcast() { w.s.wakeGroups(nil) }

func (w *waker) run(ctx context.Context) {
	backoff := 100 * time.Millisecond
	for ctx.Err() == nil {
		err := w.listen(ctx)
		w.listening(false)
		if ctx.Err() != nil {
			return
		}
		w.s.log.Warn("listen connection lost; reconnecting", "err", err, "in", backoff)
		t := time.NewTimer(backoff + rand.N(backoff/2))
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
		backoff = min(backoff*2, 10*time.Second)
	}
}

// listen runs one LISTEN connection until it fails.
func (w *waker) listen(ctx context.Context) error {
	// Named, so operators (and tests) can find it in pg_stat_activity.
	name := ListenerApplicationName + " " + w.s.cfg.ReplicaID
	return store.Listen(ctx, w.s.cfg.DatabaseURL, name,
		[]string{store.ChannelWakeup, store.ChannelReleased, store.ChannelDiscover},
		func() {
			w.listening(true)
			// Anything notified while we were not listening is found by
			// this round.
			w.broadcast()
			w.s.forEachSession(func(ss *session) { ss.requestReconcile() })
		},
		func(c *store.ListenConn, pid uint32, channel, payload string) error {
			switch channel {
			case store.ChannelWakeup:
				if !w.echo(pid) {
					w.broadcast()
				}
			case store.ChannelReleased:
				if holder, err := uuid.Parse(payload); err == nil {
					w.s.reconcileSession(holder)
				}
			case store.ChannelDiscover:
				if payload == store.DiscoverSettingsChanged {
					if err := w.settingsChanged(ctx, c); err != nil {
						return err
					}
					break
				}
				// A producer committed while a replica slept; only the
				// sleeper acts on it (the others check as usual).
				if w.isAsleep() {
					w.woken()
				}
			}
			if h := w.s.afterNotify.get(); h != nil {
				h(channel)
			}
			return nil
		}, &w.ops)
}
