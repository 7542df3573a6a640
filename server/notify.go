package server

import (
	"context"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
)

// ListenerApplicationName is the application_name of a replica's LISTEN
// connection.
const ListenerApplicationName = "outboxd-listener"

const (
	chanWakeup   = "outbox_wakeup"
	chanReleased = "outbox_released"
	// armTTL is how long one registration in outbox.listener stays good
	// for. The first producer statement that finds it consumes it and
	// notifies; idle sessions register again, busy ones do not.
	armTTL = 10 * time.Second
)

// waker owns the replica's LISTEN connection. It wakes idle sessions when a
// producer notifies, routes "lease released" notices from other replicas to
// the local session holding the lease, and registers the replica in
// outbox.listener while sessions idle. Notifications only cut latency: every
// session also polls, so a lost notification or a dropped connection delays
// an event by at most Config.PollInterval and never strands it.
type waker struct {
	s *Server

	mu         sync.Mutex
	gen        chan struct{} // closed and replaced on every wake-up
	armedUntil time.Time
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

// arm registers this replica as waiting, so producers notify, unless a
// registration is still comfortably alive.
func (w *waker) arm(ctx context.Context) {
	now := time.Now()
	w.mu.Lock()
	if w.armedUntil.Sub(now) > armTTL/2 {
		w.mu.Unlock()
		return
	}
	w.armedUntil = now.Add(armTTL)
	w.mu.Unlock()
	// A registration is soft state (lost, the sessions' polls still find
	// everything), so its commit need not wait for the WAL flush.
	_, err := w.s.store.Pool().Exec(ctx,
		`WITH async AS (SELECT set_config('synchronous_commit', 'off', true))
		 INSERT INTO outbox.listener (replica_id, waiting_until)
		 SELECT $1, now() + $2::interval FROM async
		 ON CONFLICT (replica_id) DO UPDATE SET waiting_until = EXCLUDED.waiting_until`,
		w.s.cfg.ReplicaID, armTTL)
	if err != nil {
		w.mu.Lock()
		w.armedUntil = time.Time{}
		w.mu.Unlock()
		w.s.log.Debug("register listener failed", "err", err)
	}
}

func (w *waker) run(ctx context.Context) {
	defer func() {
		c, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		_, _ = w.s.store.Pool().Exec(c, `DELETE FROM outbox.listener WHERE replica_id = $1`, w.s.cfg.ReplicaID)
	}()
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
	cfg, err := pgx.ParseConfig(w.s.cfg.DatabaseURL)
	if err != nil {
		return err
	}
	// Named, so operators (and tests) can find it in pg_stat_activity.
	cfg.RuntimeParams["application_name"] = ListenerApplicationName
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	for _, ch := range []string{chanWakeup, chanReleased} {
		if _, err := conn.Exec(ctx, "LISTEN "+ch); err != nil {
			return err
		}
	}
	// Anything notified while we were not listening is found by this round.
	w.broadcast()
	w.s.forEachSession(func(ss *session) { ss.requestReconcile() })
	for {
		n, err := conn.WaitForNotification(ctx)
		if err != nil {
			return err
		}
		switch n.Channel {
		case chanWakeup:
			// The producer that notified consumed the registrations (see
			// outbox.wake_listeners): register again at the next idle poll.
			w.mu.Lock()
			w.armedUntil = time.Time{}
			w.mu.Unlock()
			w.broadcast()
		case chanReleased:
			if holder, err := uuid.Parse(n.Payload); err == nil {
				w.s.reconcileSession(holder)
			}
		}
	}
}
