package server

import (
	"context"
	"time"

	outboxv1 "github.com/outboxd/outboxd/gen/outbox/v1"
	"github.com/outboxd/outboxd/internal/store"
	"google.golang.org/protobuf/types/known/durationpb"
)

// sessionTTL is how long a relay session's row counts as alive without a
// refresh: three refresh periods, so one slow refresh does not hide it.
func (s *Server) sessionTTL() time.Duration { return 3 * s.cfg.SessionRefreshInterval }

// sessionRecord is what ListRelays shows of a local session.
func (ss *session) record() store.RelaySession {
	return store.RelaySession{
		SessionID: ss.id, RelayID: ss.relayID, Peer: ss.peer, ReplicaID: ss.srv.cfg.ReplicaID,
		Streams: ss.streams, ExcludeStreams: ss.excludeStreams, MaxInFlight: ss.maxInFlight, InFlight: int(ss.inflightN.Load()),
		Acked: int64(ss.acked.Load()), ConnectedAt: ss.connectedAt,
	}
}

// saveSessions records every local session as alive, with its counters.
// It holds sessionRows from its snapshot of the sessions until its write:
// a session that ends meanwhile deletes its row after this write, not
// before it (see removeSession).
func (s *Server) saveSessions(ctx context.Context) {
	s.sessionRows.Lock()
	defer s.sessionRows.Unlock()
	var recs []store.RelaySession
	s.forEachSession(func(ss *session) { recs = append(recs, ss.record()) })
	if h := s.beforeSaveSessions.get(); h != nil {
		h()
	}
	if err := s.writeSessionRows(ctx, recs); err != nil && ctx.Err() == nil {
		s.log.Warn("refreshing relay sessions failed", "err", err)
	}
}

// writeSessionRows upserts recs. The write is not cancelled with ctx: a
// statement cancelled on its way can still commit after its caller has
// returned (and let go of sessionRows), and so after a removal that
// followed it.
func (s *Server) writeSessionRows(ctx context.Context, recs []store.RelaySession) error {
	wctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), releaseTimeout)
	defer cancel()
	return s.store.SaveRelaySessions(wctx, recs)
}

// refreshSessions keeps this replica's relay-session rows fresh and removes
// rows other replicas left when they crashed, until ctx is done. It has a
// loop of its own: a long retention purge must not let this replica's
// sessions go stale and vanish from ListRelays.
func (s *Server) refreshSessions(ctx context.Context) {
	refresh := time.NewTimer(s.loopPause(time.Now(), s.cfg.SessionRefreshInterval, refreshLoop))
	defer refresh.Stop()
	var cleaned time.Time
	for {
		select {
		case <-ctx.Done():
			return
		case <-refresh.C:
			s.rearmLoop(refresh, s.cfg.SessionRefreshInterval, refreshLoop)
			s.saveSessions(ctx)
			if time.Since(cleaned) < staleStatsInterval {
				continue
			}
			if err := s.store.DeleteStaleStats(ctx, s.sessionTTL(), s.cfg.ReplicaID); err != nil {
				if ctx.Err() == nil {
					s.log.Warn("removing stale relay sessions failed", "err", err)
				}
				continue
			}
			cleaned = time.Now()
		}
	}
}

// staleStatsInterval is how often a replica deletes the relay-session rows
// other replicas stopped refreshing and the delivery counts older than
// GetLag reads (store.DeleteStaleStats). Every reader already ignores such
// rows (they filter on seen_at and bucket), so the deletion only keeps the
// tables small and need not follow the session refresh: at every refresh
// it was 20 statements a second for 50 quiet sources.
const staleStatsInterval = time.Minute

// loopPause is how long a periodic loop of the engine (readiness, the
// session refresh) waits from now for its next turn: about interval, on a
// grid that the same loop of every source of the replica shares, so that
// their turns fall due together and the process wakes once for all of
// them. A wake-up of an idle Go process costs 0.1-0.4 ms of CPU on the
// benchmark VM (bench/cmd/wakeup-cost); 50 sources' readiness checks every 2 s, spread at random,
// were 25 wake-ups a second. The grid's points are a whole number of quiet
// discovery intervals apart (the most that is at most interval, so a loop
// never turns less often than asked) and shifted from the quiet discovery
// checks' grid (alignedPause) by quarters of a quiet interval: the refresh
// by one, readiness by two. So none of a source's loops falls due with
// another or with its quiet check: two statements at once on a quiet pool
// open a second connection, a backend start (plain tickers that met every
// 10 s opened about 4 a second for 50 sources). Where the quiet interval
// is longer than interval (over 100 sources at the default budget, for
// readiness) the points are interval apart and may meet a check by chance;
// readiness then costs a statement only every SchemaCheckInterval.
func (s *Server) loopPause(now time.Time, interval time.Duration, loop periodicLoop) time.Duration {
	quiet := time.Duration(s.quietInterval.Load())
	if quiet <= 0 || interval <= 0 {
		return interval
	}
	spacing := interval
	if quiet <= interval {
		spacing = interval / quiet * quiet
	}
	return alignedPause(now, spacing, quiet*time.Duration(loop.quarters)/4)
}

// periodicLoop names a periodic loop of the engine and its place on the
// grid (loopPause): quarters of a quiet interval off the quiet checks.
type periodicLoop struct {
	name     string
	quarters int
}

var (
	refreshLoop   = periodicLoop{"refresh", 1}
	readinessLoop = periodicLoop{"readiness", 2}
)

// rearmLoop arms t, a fired timer of loop, for its next turn (loopPause),
// telling the test hook.
func (s *Server) rearmLoop(t *time.Timer, interval time.Duration, loop periodicLoop) {
	now := time.Now()
	pause := s.loopPause(now, interval, loop)
	if h := s.afterLoopWait.get(); h != nil {
		h(loop.name, interval, pause, now)
	}
	t.Reset(pause)
}

// janitor runs the retention janitor every JanitorInterval when Retention
// is set, until ctx is done.
func (s *Server) janitor(ctx context.Context) {
	if s.cfg.Retention <= 0 {
		return
	}
	t := time.NewTicker(s.cfg.JanitorInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			_, _ = s.runJanitor(ctx)
		}
	}
}

// runJanitor purges events published longer ago than Config.Retention.
func (s *Server) runJanitor(ctx context.Context) (purgeProgress, error) {
	p := store.PurgeParams{PublishedBefore: time.Now().Add(-s.cfg.Retention), BatchSize: s.cfg.JanitorBatch}
	res, err := s.purge(ctx, p, nil)
	if err != nil {
		if ctx.Err() == nil {
			s.log.Warn("retention janitor failed; retrying at its next run", "err", err, "deleted", res.deleted)
		}
		return res, err
	}
	if res.deleted > 0 {
		s.log.Info("retention janitor purged published events", "deleted", res.deleted,
			"batches", res.batches, "published_before", p.PublishedBefore, "elapsed", res.elapsed)
	}
	s.metrics.purged.Add(float64(res.deleted))
	return res, nil
}

// purgeProgress is where a purge stands.
type purgeProgress struct {
	deleted, batches, remaining int64
	done                        bool
	elapsed                     time.Duration
}

func (p purgeProgress) proto() *outboxv1.PurgeResponse {
	return &outboxv1.PurgeResponse{
		Deleted: p.deleted, Batches: p.batches, Remaining: p.remaining, Done: p.done,
		Elapsed: durationpb.New(p.elapsed),
	}
}

// purge deletes (or, dry, counts) published events in batches, each its own
// statement, reporting after every batch to progress (which may be nil). The
// first report carries the estimate of what will be deleted.
func (s *Server) purge(ctx context.Context, p store.PurgeParams, progress func(purgeProgress) error) (purgeProgress, error) {
	start := time.Now()
	var pr purgeProgress
	report := func() error {
		pr.elapsed = time.Since(start)
		if progress == nil {
			return nil
		}
		return progress(pr)
	}
	total, err := s.store.CountPurgeable(ctx, p)
	if err != nil {
		return pr, err
	}
	pr.remaining = total
	if err := report(); err != nil {
		return pr, err
	}
	var pos store.EventPosition
	for !pr.done {
		if err := ctx.Err(); err != nil {
			return pr, err
		}
		b, err := s.store.PurgeOne(ctx, p, pos)
		if err != nil {
			return pr, err
		}
		pos = b.Next
		pr.batches++
		pr.deleted += b.Deleted
		pr.remaining = max(0, total-pr.deleted)
		pr.done = b.Done
		if pr.done {
			pr.remaining = 0
		}
		if err := report(); err != nil {
			return pr, err
		}
	}
	return pr, nil
}
