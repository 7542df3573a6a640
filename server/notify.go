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
// lease. Producers never notify. Notifications only cut latency: every
// session's poll group also polls, so a lost notification or a dropped
// connection delays an event by at most Config.PollInterval and never
// strands it.
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
}

// roundEcho is a round under way, as the listener sees it.
type roundEcho struct {
	gen  uint64
	seen bool // a wake-up from its backend arrived while it was open
}

func newWaker(s *Server) *waker {
	return &waker{s: s, open: make(map[uint32]*roundEcho), expect: make(map[uint32]int)}
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
	return store.Listen(ctx, w.s.cfg.DatabaseURL, name, []string{store.ChannelWakeup, store.ChannelReleased},
		func() {
			w.listening(true)
			// Anything notified while we were not listening is found by
			// this round.
			w.broadcast()
			w.s.forEachSession(func(ss *session) { ss.requestReconcile() })
		},
		func(pid uint32, channel, payload string) {
			switch channel {
			case store.ChannelWakeup:
				if !w.echo(pid) {
					w.broadcast()
				}
			case store.ChannelReleased:
				if holder, err := uuid.Parse(payload); err == nil {
					w.s.reconcileSession(holder)
				}
			}
			if h := w.s.afterNotify.get(); h != nil {
				h(channel)
			}
		})
}
