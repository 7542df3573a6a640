package server

import (
	"context"
	"time"
)

// discover runs discovery rounds (outbox.discover) until ctx ends: each
// finds the events committed since the previous round, makes their
// aggregates claimable, and (through NOTIFY outbox_wakeup, and directly for
// this replica's sessions) wakes idle sessions. It is how producers' events
// reach delivery without their transactions writing anything the server
// owns. Every replica runs the loop; replicas take turns in the database, so
// concurrent rounds cost one advisory-lock attempt each.
//
// While rounds find events the loop runs every DiscoveryInterval; while they
// find nothing it lengthens the wait by as much up to DiscoveryIdleInterval, which is then
// the longest an event waits for its first round. An empty round takes no
// transaction id and writes nothing.
func (s *Server) discover(ctx context.Context) {
	wait := s.cfg.DiscoveryInterval
	t := time.NewTimer(0)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		found, err := s.store.Discover(ctx)
		switch {
		case err != nil:
			if ctx.Err() != nil {
				return
			}
			// Backing off to a second at most: the database is likely down,
			// and a log line every few milliseconds would bury the cause.
			wait = min(max(2*wait, s.cfg.DiscoveryIdleInterval), max(time.Second, s.cfg.DiscoveryIdleInterval))
			s.metrics.discoveryErrors.Inc()
			s.log.Warn("discovery round failed; retrying", "err", err, "in", wait)
		case found.Events > 0:
			s.metrics.discovered.Add(float64(found.Events))
			s.wake.broadcast()
			wait = s.cfg.DiscoveryInterval
		default:
			// Linear, not doubling: under a steady trickle of events the
			// pauses stay short, and an idle replica still settles at
			// DiscoveryIdleInterval within a fraction of a second.
			wait = min(wait+s.cfg.DiscoveryInterval, s.cfg.DiscoveryIdleInterval)
		}
		t.Reset(wait)
	}
}
