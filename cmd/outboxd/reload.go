package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/outboxd/outboxd/internal/app"
	"github.com/outboxd/outboxd/internal/filewatch"
	"github.com/outboxd/outboxd/internal/store"
	"github.com/outboxd/outboxd/server"
)

// Reloading sources. The sources serve can add and remove while it runs are
// those of the `source:` list of its --config file: --source flags and
// $OUTBOXD_SOURCE cannot change under a running process, and the default
// source (--database-url) is fixed. On SIGHUP and whenever the file changes,
// serve rereads that list and, source by source, adds the new ones, removes
// the ones gone, and removes then adds again one whose URL changed; the
// engines of the others are not touched. A list that does not parse (or a
// file that no longer does: unknown key, password) changes nothing.
//
// The same sourceSet serves the sources given by --source or
// $OUTBOXD_SOURCE (then there is no file to reread), and default, that did
// not answer when serve started: it adds each once it answers, and nothing
// removes them.

// sourceConnectTimeout bounds one attempt at opening a source (dial, ping,
// schema check), so that an unreachable host holds up no reload for long.
const sourceConnectTimeout = 10 * time.Second

// reloadableSource is a source of the --config file's list, served or
// still being connected, or one given by flag still being connected.
type reloadableSource struct {
	src source
	// cancel ends its connect loop; done is closed when the loop has
	// returned, with pool set when the source was added.
	cancel context.CancelFunc
	done   chan struct{}
	pool   *sourcePool
}

// sourceSet keeps the replica's reloadable sources in line with the
// --config file, and connects the sources that did not answer at startup.
type sourceSet struct {
	rep      *app.Replica
	log      *slog.Logger
	base     server.Config // of every added source; Store and DatabaseURL are its own
	maxConns int32
	interval time.Duration // between attempts at a source that does not answer
	drain    time.Duration // a removed source's streams have this long to ack what they hold
	path     string        // the --config file
	// reread returns the file's `source:` list, or an error when the file
	// does not parse or check; nil when the sources came from flags (no
	// reloads).
	reread func() ([]string, error)
	fixed  map[string]bool // sources given otherwise (default), never reloaded
	// reloads counts reloads by result; OnReload (tests) sees each.
	reloads *prometheus.CounterVec
	// poolMetrics exports the pools of the sources served.
	poolMetrics *sourcePoolCollector

	mu   sync.Mutex // serialises reloads
	live map[string]*reloadableSource
}

func newSourceReloadMetric(reg prometheus.Registerer) *prometheus.CounterVec {
	c := prometheus.NewCounterVec(prometheus.CounterOpts{
		Name: "outboxd_source_reloads_total",
		Help: "Rereads of the --config file's source list (SIGHUP, file change), by result: ok (applied) or error (nothing changed).",
	}, []string{"result"})
	c.WithLabelValues("ok")
	c.WithLabelValues("error")
	reg.MustRegister(c)
	return c
}

// start begins connecting the sources of the list serve started with that
// it could not open at once (the others it was given with their pools).
func (s *sourceSet) start(ctx context.Context, opened map[string]*sourcePool, all []source) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.live = map[string]*reloadableSource{}
	for _, src := range all {
		if pool := opened[src.name]; pool != nil {
			done := make(chan struct{})
			close(done)
			s.live[src.name] = &reloadableSource{src: src, pool: pool, cancel: func() {}, done: done}
			continue
		}
		s.connect(ctx, src, false)
	}
}

// connect adds src, retrying every interval while its database does not
// answer (the replica's readiness names it meanwhile). With wait, it
// returns after the first attempt.
func (s *sourceSet) connect(ctx context.Context, src source, wait bool) {
	ctx, cancel := context.WithCancel(ctx)
	rs := &reloadableSource{src: src, cancel: cancel, done: make(chan struct{})}
	s.live[src.name] = rs
	tried := make(chan struct{})
	go func() {
		defer close(rs.done)
		first := true
		for {
			pool, err := s.add(ctx, src)
			if first {
				close(tried)
				first = false
			}
			if err == nil {
				rs.pool = pool
				return
			}
			if ctx.Err() != nil {
				return
			}
			s.log.Warn("source not added yet; retrying", "source", src.name, "err", err, "in", s.interval)
			if err := s.rep.SetSourcePending(src.name, err.Error()); err != nil {
				s.log.Error("source not added yet, and not named pending", "source", src.name, "err", err)
			}
			t := time.NewTimer(s.interval)
			select {
			case <-ctx.Done():
				t.Stop()
				return
			case <-t.C:
			}
		}
	}()
	if wait {
		<-tried
	}
}

// add opens src's pool and adds its engine to the replica.
func (s *sourceSet) add(ctx context.Context, src source) (*sourcePool, error) {
	octx, cancel := context.WithTimeout(ctx, sourceConnectTimeout)
	defer cancel()
	// Alone in the list: its errors name no source, which readiness and
	// the log line name already ("source orders: not added yet: ...").
	pool, err := openSource(octx, src, []source{src}, s.maxConns)
	if err != nil {
		return nil, err
	}
	if err := s.rep.AddSource(octx, app.Source{Name: src.name, Server: namedSourceConfig(s.base, src, pool)}); err != nil {
		pool.Close()
		return nil, err
	}
	s.poolMetrics.add(src.name, pool) // and the pool follows its engine
	return pool, nil
}

// drop removes a source: it ends its connect loop, removes its engine from
// the replica (see app.Replica.RemoveSource) and closes its pool.
func (s *sourceSet) drop(ctx context.Context, rs *reloadableSource) error {
	rs.cancel()
	<-rs.done
	delete(s.live, rs.src.name)
	if rs.pool == nil {
		s.rep.ClearSourcePending(rs.src.name)
		return nil
	}
	err := s.rep.RemoveSource(ctx, rs.src.name, s.drain)
	s.poolMetrics.remove(rs.src.name)
	rs.pool.Close()
	return err
}

// Reload rereads the file's source list and applies it. On error nothing
// has changed; the error is logged and counted.
func (s *sourceSet) Reload(ctx context.Context) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	err := s.reload(ctx)
	if err != nil {
		s.reloads.WithLabelValues("error").Inc()
		s.log.Error("sources: reload failed; keeping the sources served", "config", s.path, "err", err)
		return err
	}
	s.reloads.WithLabelValues("ok").Inc()
	return nil
}

func (s *sourceSet) reload(ctx context.Context) error {
	specs, err := s.reread()
	if err != nil {
		return err
	}
	want, err := parseSourceSpecs(specs, maps.Clone(s.fixed))
	if err != nil {
		return fmt.Errorf("%s: source: %w", s.path, err)
	}
	if len(s.fixed)+len(want) == 0 {
		return fmt.Errorf("%s: source: the list is empty and no other source is given: a server serves at least one source", s.path)
	}
	wanted := map[string]source{}
	for _, w := range want {
		wanted[w.name] = w
	}
	var removed, added []string
	var errs []error
	for _, name := range slices.Sorted(maps.Keys(s.live)) {
		rs := s.live[name]
		if w, ok := wanted[name]; s.fixed[name] || ok && w.url == rs.src.url {
			continue // (default, not yet served: the file does not list it)
		}
		if err := s.drop(ctx, rs); err != nil {
			errs = append(errs, fmt.Errorf("source %s: %w", name, err))
		}
		removed = append(removed, name)
	}
	for _, w := range want {
		if s.live[w.name] == nil {
			s.connect(ctx, w, true)
			added = append(added, w.name)
		}
	}
	if len(added)+len(removed) == 0 {
		s.log.Debug("sources: source list unchanged", "config", s.path)
		return nil
	}
	s.log.Info("sources reloaded", "config", s.path, "added", added, "removed", removed,
		"sources", slices.Sorted(maps.Keys(s.live)))
	return errors.Join(errs...)
}

// close removes nothing from the replica (it is stopping): it ends the
// connect loops and closes the pools once the replica has stopped.
func (s *sourceSet) close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, rs := range s.live {
		rs.cancel()
		<-rs.done
		if rs.pool != nil {
			rs.pool.Close()
		}
	}
}

// Watch reloads on SIGHUP and whenever the --config file's directory
// changes (see filewatch), until ctx is done. It reloads once as soon as it
// watches; ready, when not nil, is called then.
func (s *sourceSet) Watch(ctx context.Context, ready func()) error {
	first := true
	return filewatch.Watch(ctx, filewatch.Config{Path: s.path, What: "sources", Logger: s.log},
		func() {
			_ = s.Reload(ctx)
			if first && ready != nil {
				ready()
			}
			first = false
		})
}

// namedSourceConfig is the engine configuration of a source other than
// default: base, with the source's store, and the replica's logger and
// metrics registry (labelled with the source by app).
func namedSourceConfig(base server.Config, src source, pool *sourcePool) server.Config {
	sc := base
	sc.Store, sc.DatabaseURL, sc.Logger, sc.Registerer = store.New(pool.Pool), withoutPoolParams(src.url), nil, nil
	return sc
}
