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
// session also polls, so a lost notification or a dropped connection delays
// an event by at most Config.PollInterval and never strands it.
type waker struct {
	s *Server

	mu  sync.Mutex
	gen chan struct{} // closed and replaced on every wake-up
}

func newWaker(s *Server) *waker {
	return &waker{s: s, gen: make(chan struct{})}
}

// wait returns a channel closed at the next wake-up.
func (w *waker) wait() <-chan struct{} {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.gen
}

func (w *waker) broadcast() {
	w.mu.Lock()
	close(w.gen)
	w.gen = make(chan struct{})
	w.mu.Unlock()
}

func (w *waker) run(ctx context.Context) {
	backoff := 100 * time.Millisecond
	for ctx.Err() == nil {
		err := w.listen(ctx)
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
			// Anything notified while we were not listening is found by
			// this round.
			w.broadcast()
			w.s.forEachSession(func(ss *session) { ss.requestReconcile() })
		},
		func(channel, payload string) {
			switch channel {
			case store.ChannelWakeup:
				w.broadcast()
			case store.ChannelReleased:
				if holder, err := uuid.Parse(payload); err == nil {
					w.s.reconcileSession(holder)
				}
			}
		})
}
