package server

import (
	"context"
	"fmt"
	"time"
)

// Readiness is the replica's ability to serve: the database answers, its
// schema is the one this binary expects, and discovery can run on it.
type Readiness struct {
	Ready  bool
	Reason string // why not, for logs and /readyz
}

// CheckReadiness compares the database's applied migrations with the
// embedded ones (one statement, which also says the database answers), and
// whether discovery is stopped (a database restored into another cluster:
// new events would not be delivered until an operator re-scans). The
// discovery loop's own turns say that (see discoveryStopped), and that the
// database answers, so while the loop turns a readiness check reads the
// migrations only once per Config.SchemaCheckInterval and otherwise costs
// no statement: 50 quiet sources checked every 2 s made 25 statements a
// second for an answer that changes only when someone migrates. Without a
// recent turn it asks both, and records a stop it notices (see
// store.DiscoveryStopped).
func (s *Server) CheckReadiness(ctx context.Context) Readiness {
	ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	if at := s.schemaCurrentAt.Load(); at == 0 || time.Since(time.Unix(0, at)) >= s.cfg.SchemaCheckInterval || s.freshTurn() == nil {
		n, err := s.store.PendingMigrations(ctx)
		switch {
		case err != nil:
			s.schemaCurrentAt.Store(0)
			return Readiness{Reason: err.Error()}
		case n > 0:
			s.schemaCurrentAt.Store(0)
			return Readiness{Reason: fmt.Sprintf("%d schema migration(s) pending; run `outboxd migrate`", n)}
		}
		s.schemaCurrentAt.Store(time.Now().UnixNano())
	}
	stopped, err := s.discoveryStopped(ctx)
	switch {
	case err != nil:
		return Readiness{Reason: err.Error()}
	case stopped != "":
		return Readiness{Reason: "discovery stopped: " + stopped}
	}
	return Readiness{Ready: true}
}

// WatchReadiness checks readiness every interval (on the grid of
// loopPause) and calls report when it changes (and once at the start),
// until ctx is done.
func (s *Server) WatchReadiness(ctx context.Context, interval time.Duration, report func(Readiness)) {
	var last *Readiness
	t := time.NewTimer(s.loopPause(time.Now(), interval, readinessLoop))
	defer t.Stop()
	for {
		r := s.CheckReadiness(ctx)
		if ctx.Err() != nil {
			return
		}
		if last == nil || last.Ready != r.Ready {
			if r.Ready {
				s.log.Info("ready: database reachable, schema current, discovery running")
			} else {
				s.log.Warn("not ready", "reason", r.Reason)
			}
			report(r)
			last = &r
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			s.rearmLoop(t, interval, readinessLoop)
		}
	}
}
